"""What a Triton cache's warms specialized, kept in it, so that the next process's prefetch decodes it ahead.

A warm from a prefetched pack takes the pack's own specializations, decoded and hashed while the engine loads its
weights (:func:`warmreg._triton.cache.specialize_remembered`); a warm from the disk cache had to run Triton's
argument packing, serialize each key's specialization and hash it on the warm's own path. After a warm this stage
keeps each key's specialization in ``<cache>/warmreg/specializations.json`` (by target and jit function), and
:func:`warmreg.prefetch` decodes those of the local GPUs' targets on its thread (:func:`decode`), where binding
finds them. Binding takes a decoded specialization only where Triton's in-memory key and the parsed options it
computes agree with it, so a stale entry (a changed kernel, another environment) costs its decode and nothing
else; an unreadable file is ignored and written anew. The file is written whole (a temporary file renamed over
it) and only when a warm specialized something it does not hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .. import _triton
from .._triton import cache as _triton_cache
from ..pipeline.stage import Stage
from ..values.platform import Platform

if TYPE_CHECKING:
    from ..pipeline.bind import Task
    from ..pipeline.planning import Plan

__all__ = ["LIMIT", "Remember", "decode", "index_path"]

log = logging.getLogger("warmreg.stages.remember")

#: Entries a cache's file keeps: past it, the last warm's and then the earliest read.
LIMIT = 4096
_FORMAT = 1
_Entry = tuple[str, str, str]  # (target, jit function's full name, serialized specialization)
#: Per cache directory, the entries this process read from its file or wrote to it.
_known: dict[str, set[_Entry]] = {}


def index_path(directory: str) -> Path:
    """The file of the cache ``directory``."""
    return Path(directory, "warmreg", "specializations.json")


def _read(directory: str) -> list[_Entry]:
    """The file's entries, in order; none if it is missing or unreadable."""
    try:
        data = json.loads(index_path(directory).read_text())
        if data.get("format") != _FORMAT:
            return []
        return [(str(t), str(n), str(d)) for t, n, d in data["entries"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


class Remember(Stage):
    """Keeps the warm's specializations in its cache's file (see the module)."""

    name: ClassVar[str] = "remember"

    def __init__(self) -> None:
        self.added = 0

    @classmethod
    def for_plan(cls, plan: Plan) -> Remember:
        return cls()

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        target = plan.platform.target
        found = [(target, t.jit_name, t.specialization_data) for t in tasks if t.status != "failed" and t.jit_name and t.specialization_data]
        directory = _triton_cache.cache_dir()
        known = _known.setdefault(directory, set())
        if known.issuperset(found):
            return
        entries = dict.fromkeys(_read(directory))
        before = len(entries)
        entries.update(dict.fromkeys(found))
        kept = list(entries)
        if len(kept) > LIMIT:  # the last warm's, then the earliest read
            mine = set(found)
            kept = [*(e for e in kept if e not in mine)][: max(0, LIMIT - len(mine))] + [e for e in kept if e in mine]
        path = index_path(directory)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"format": _FORMAT, "entries": kept}))
            os.replace(tmp, path)
        except OSError as exc:  # only a head start for the next process: the warm goes on, leaving nothing behind
            with contextlib.suppress(OSError):
                tmp.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only where it is empty
            log.debug("could not keep the warm's specializations in %s: %r", path, exc)
            return
        known.update(kept)
        self.added = len(entries) - before

    def section(self) -> dict[str, Any] | None:
        """The specializations this warm added to its cache's file (none: nothing)."""
        return {"added": self.added} if self.added else None


def decode(jits: Mapping[str, Any], targets: list[Any], *, stop: Callable[[], bool]) -> int:
    """Decode and hash the current cache's specializations for ``targets`` (``GPUTarget``) of ``jits`` (functions by
    full name), for binding to find (:func:`warmreg._triton.cache.local_cache_hash`); stops once ``stop()`` says
    so. Returns how many were decoded; an entry that does not decode is skipped."""
    directory = _triton_cache.cache_dir()
    entries = _read(directory)
    _known.setdefault(directory, set()).update(entries)
    decoded = 0
    platforms: dict[str, Platform | None] = {}
    for target, name, data in entries:
        if stop():
            break
        if target not in platforms:
            try:
                parsed = Platform.parse(target)
                platforms[target] = parsed if _triton.gpu_target(parsed) in targets else None
            except Exception:  # a target this Triton cannot compile for
                platforms[target] = None
        jit, platform = jits.get(name), platforms[target]
        if jit is None or platform is None:
            continue
        try:
            _triton_cache.local_cache_hash(jit, data, platform)
            decoded += 1
        except Exception as exc:
            log.debug("could not decode a specialization of %s: %r", name, exc)
    return decoded
