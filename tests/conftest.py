"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from warmreg import _triton
from warmreg.kernel import FAST_TABLES
from warmreg.monitor import KNOWLEDGE


@pytest.fixture(autouse=True)
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty Triton cache directory (TRITON_CACHE_DIR) for each test."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    _triton.forget_compiled()
    KNOWLEDGE.clear()
    FAST_TABLES.clear()
    yield cache
    _triton.forget_compiled()
    KNOWLEDGE.clear()
    FAST_TABLES.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available (the device host); elsewhere they skip."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
