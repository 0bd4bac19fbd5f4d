"""The stages of the pipeline: packs, the distributed shard, compile processes, autotuning, rehearsal."""
