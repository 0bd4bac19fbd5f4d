"""Installed entry points, read once per state of ``sys.path`` (plugins and pack wheels)."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
from typing import Any

__all__ = ["entry_points"]

_eps_lock = threading.Lock()
_eps: tuple[tuple[Any, ...], Any] | None = None
_READ = importlib.metadata.entry_points


def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The installed entry points of ``group``, as ``importlib.metadata.entry_points(group=group)``
    gives them, from one read of every distribution's metadata per state of ``sys.path``.

    Each read opens every installed distribution's ``entry_points.txt`` (~10 ms in a small
    environment, far more in an engine's); a warm needs two groups (plugins and pack wheels) and a
    process plans several times. The snapshot is read again when ``sys.path`` or the modification
    time of one of its entries changes, as installing or removing a distribution changes its
    directory. Where ``importlib.metadata.entry_points`` was replaced (tests), that is called instead.
    """
    global _eps
    if importlib.metadata.entry_points is not _READ:
        return tuple(importlib.metadata.entry_points(group=group))
    stamp = (tuple(sys.path), tuple(_mtime(p) for p in sys.path))
    with _eps_lock:
        if _eps is None or _eps[0] != stamp:
            _eps = (stamp, _READ())
        every = _eps[1]
    return tuple(every.select(group=group))


def _mtime(path: str) -> int:
    try:
        return os.stat(path or ".").st_mtime_ns
    except OSError:
        return -1
