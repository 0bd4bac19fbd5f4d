"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    """A fresh, empty Triton cache directory (TRITON_CACHE_DIR) for each test, and warmreg's state
    reset around it (the public ``warmreg_isolated`` fixture)."""
    return warmreg_isolated


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--network", action="store_true", help="run the tests marked network (they ask a package index)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available (the device host), those marked ``network``
    only with ``--network``: the README's test command runs offline once set up."""
    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "network": None if config.getoption("--network") else pytest.mark.skip(reason="asks a package index: pass --network"),
    }
    for item in items:
        for mark, skip in skips.items():
            if skip is not None and mark in item.keywords:
                item.add_marker(skip)
