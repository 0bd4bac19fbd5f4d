"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmreg import _triton
from warmreg.monitor import KNOWLEDGE

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers (dsv4_support.py)


@pytest.fixture(autouse=True)
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty Triton cache directory (TRITON_CACHE_DIR) for each test."""
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    _triton.forget_compiled()
    KNOWLEDGE.clear()
    yield cache
    _triton.forget_compiled()
    KNOWLEDGE.clear()
