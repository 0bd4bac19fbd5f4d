"""The runtime: where a launch goes once launch code returns its spec (the hot path; fast launch, C dispatch, interpreter)."""
