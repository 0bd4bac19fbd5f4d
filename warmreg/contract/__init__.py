"""The contract: what a plugin writes against (config, domains, warmup space, hooks, registry, kernel)."""
