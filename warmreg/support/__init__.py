"""Support: bounded JSON reads, output checks, installed entry points and the version (file and metadata plumbing)."""
