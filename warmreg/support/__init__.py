"""Support: bounded JSON reads, output checks, installed entry points, zeroed device memory and the version (file, device and metadata plumbing)."""
