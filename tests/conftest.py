"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    """A fresh, empty Triton cache directory (TRITON_CACHE_DIR) for each test, and warmreg's state
    reset around it (the public ``warmreg_isolated`` fixture)."""
    return warmreg_isolated


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available (the device host); elsewhere they skip."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
