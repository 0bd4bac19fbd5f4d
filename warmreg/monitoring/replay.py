"""Replay recorded misses (``record`` mode JSON lines): compile each with Triton's own ``preload``."""

from __future__ import annotations

from pathlib import Path

import attrs

from .._triton import cache as _triton_cache
from ..support import bounded_json as _json
from ..values.errors import WarmregError
from ..values.platform import Platform
from . import Miss

__all__ = ["RECORDS_MAX", "ReplayResult", "read_records", "replay"]


#: The largest record file read (a record is a few kilobytes; a day of misses stays far below).
RECORDS_MAX = 64 << 20


@attrs.frozen
class ReplayResult:
    """Outcome of one recorded miss: compiled, failed (``error``) or not attempted (``skipped``, why)."""

    jit_name: str
    target: str | None
    ok: bool
    error: str | None = None
    skipped: str | None = None


def read_records(path: str | Path) -> list[Miss]:
    """Read a record file (one JSON object per line), bounded in size and nesting.

    :raises WarmregError: naming the file, and the line of a malformed record.
    """
    try:
        text = _json.read_regular_file(path, limit=RECORDS_MAX).decode()
    except (OSError, ValueError) as exc:
        raise WarmregError(f"{path}: cannot be read as a record file ({exc})", fix="pass a file written by record mode") from exc
    misses = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            misses.append(Miss.from_json(_json.loads(line)))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise WarmregError(f"{path}:{n}: not a warmreg miss record ({exc})", fix="pass a file written by record mode") from exc
    return misses


def replay(path: str | Path, *, target: str | None = None) -> list[ReplayResult]:
    """Compile every recorded compile miss into the Triton cache; every other record is returned as
    skipped, with the reason.

    :param target: compile for this target instead of the one recorded (e.g. ``cuda:90`` on a CPU
        machine); a record that names no target is skipped without it.
    """
    if target is not None:
        Platform.parse(target)  # a bad target is one error, not one per record
    results = []
    for miss in read_records(path):
        where = target or miss.target
        if miss.kind != "compile":
            results.append(ReplayResult(miss.jit_name, where, False, skipped=f"a {miss.kind} miss: nothing to compile"))
        elif not miss.specialization_data:
            results.append(ReplayResult(miss.jit_name, where, False, skipped="the record holds no specialization data"))
        elif where is None:
            results.append(ReplayResult(miss.jit_name, None, False, skipped="the record names no target: pass --target, e.g. cuda:90"))
        else:
            try:
                _triton_cache.replay(miss.jit_name, miss.specialization_data, Platform.parse(where))
                results.append(ReplayResult(miss.jit_name, where, True))
            except Exception as exc:
                results.append(ReplayResult(miss.jit_name, where, False, f"{type(exc).__name__}: {exc}"))
    return results
