"""The warm pipeline: plan, bind, stages, compile, load, report (names no stage)."""
