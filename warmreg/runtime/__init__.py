"""The runtime: where a launch goes once launch code returns its spec (the hot path: launch state, fast launch, C dispatch)."""
