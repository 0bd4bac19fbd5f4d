"""Every test gets its own, empty Triton cache directory and a clean warmreg state (warmreg's
``warmreg_isolated`` fixture): warm results never leak between tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    return warmreg_isolated
