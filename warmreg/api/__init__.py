"""The calls an engine makes: warm, prefetch, plan, and the warm inside an engine's start-up."""
