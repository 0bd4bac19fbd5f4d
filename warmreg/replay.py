"""Replay recorded misses (``record`` mode JSON lines): compile each with Triton's own ``preload``."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from . import _triton_cache
from .errors import WarmregError
from .monitor import Miss
from .platform import Platform

__all__ = ["ReplayResult", "read_records", "replay"]


@attrs.frozen
class ReplayResult:
    """Outcome of compiling one recorded specialization."""

    jit_name: str
    target: str
    ok: bool
    error: str | None = None


def read_records(path: str | Path) -> list[Miss]:
    """Read a record file (one JSON object per line).

    :raises WarmregError: naming the file and line of a malformed record.
    """
    misses = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            misses.append(Miss.from_json(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise WarmregError(f"{path}:{n}: not a warmreg miss record ({exc})", fix="pass a file written by record mode") from exc
    return misses


def replay(path: str | Path, *, target: str | None = None) -> list[ReplayResult]:
    """Compile every recorded compile miss into the Triton cache.

    :param target: compile for this target instead of the one recorded (e.g. ``cuda:90`` on a CPU machine).
    """
    results = []
    for miss in read_records(path):
        if miss.kind != "compile" or not miss.specialization_data:
            continue
        where = target or miss.target or "cuda:90"
        try:
            _triton_cache.replay(miss.jit_name, miss.specialization_data, Platform.parse(where))
            results.append(ReplayResult(miss.jit_name, where, True))
        except Exception as exc:
            results.append(ReplayResult(miss.jit_name, where, False, f"{type(exc).__name__}: {exc}"))
    return results
