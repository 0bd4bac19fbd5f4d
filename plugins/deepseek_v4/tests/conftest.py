"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    """A fresh, empty Triton cache directory and warmreg's state reset, for each test (warmreg's
    public ``warmreg_isolated`` fixture)."""
    return warmreg_isolated
