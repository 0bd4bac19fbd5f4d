"""The ``warmreg`` command line."""
