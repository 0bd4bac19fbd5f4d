"""What a Triton cache's warms specialized, kept in it, so that the next process's prefetch decodes it ahead.

A warm from a prefetched pack takes the pack's own specializations, decoded and hashed while the engine loads its
weights (:func:`warmreg._triton.cache.specialize_remembered`); a warm from the disk cache had to run Triton's
argument packing, serialize each key's specialization and hash it on the warm's own path. After a warm this stage
keeps each key's specialization in ``<cache>/warmreg/specializations.json`` (by target and jit function; not
those it took from a pack or from this file, decoded in this process: the pack holds them), and
:func:`warmreg.prefetch` decodes those of the local GPUs' targets on its thread (:func:`decode`), where binding
finds them, and reads the group file of each one's cache entry, where the warm's hit finds it. Binding takes a
decoded specialization only where Triton's in-memory key and the parsed options it computes agree with it, so a
stale entry (a changed kernel, another environment) costs its decode and nothing else; an unreadable file is
ignored and written anew. The file is written whole (as a pack install writes:
:func:`~warmreg.stages.pack_install.atomic_write`) and only when a warm specialized something it does not hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton.hits import remember_found_group
from ..pipeline.stage import Stage
from ..support import bounded_json
from ..values.platform import Platform
from .pack_install import atomic_write, sweep_temporaries
from .pack_reader import lock

if TYPE_CHECKING:
    from ..pipeline.bind import Task
    from ..pipeline.planning import Plan

__all__ = ["LIMIT", "Remember", "decode", "index_path"]

log = logging.getLogger("warmreg.stages.remember")

#: Entries a cache's file keeps: past it, the last warm's and then the earliest read.
LIMIT = 4096
_ENTRY_BYTES = 16 * 1024  # a specialization is 1-3 KB (the Flash example's 75: 157 KB in all)
_FORMAT = 1
_Entry = tuple[str, str, str]  # (target, jit function's full name, serialized specialization)
#: Per cache directory, the entries this process read from its file or wrote to it.
_known: dict[str, set[_Entry]] = {}


def index_path(directory: str) -> Path:
    """The file of the cache ``directory``."""
    return Path(directory, "warmreg", "specializations.json")


def _read(directory: str) -> list[_Entry]:
    """The file's entries, in order; none if it is missing, unreadable or over the bounds of a file of
    :data:`LIMIT` entries (read as any untrusted JSON: :mod:`warmreg.support.bounded_json`)."""
    try:
        raw = bounded_json.read_regular_file(index_path(directory), limit=LIMIT * _ENTRY_BYTES)
        data = bounded_json.loads(raw, max_depth=4, max_values=4 * LIMIT + 8)
        if data.get("format") != _FORMAT:
            return []
        return [(str(t), str(n), str(d)) for t, n, d in data["entries"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


class Remember(Stage):
    """Keeps the warm's specializations in its cache's file (see the module)."""

    name: ClassVar[str] = "remember"

    def __init__(self) -> None:
        self.kept = 0

    @classmethod
    def for_plan(cls, plan: Plan) -> Remember:
        return cls()

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        target, directory = plan.platform.target, _triton_cache.cache_dir()
        known = _known.setdefault(directory, set())
        recorded = _triton_cache.decoded_specializations()  # a pack's (it holds them) or this file's: not written
        found = [
            (target, t.jit_name, t.specialization_data) for t in tasks
            if t.status != "failed" and t.jit_name and t.specialization_data and t.specialization_data not in recorded
        ]  # fmt: skip
        new = len(set(found) - known)
        if new and _keep(directory, found):
            self.kept = new

    def section(self) -> dict[str, Any] | None:
        """How many of this warm's specializations its cache's file lacked and now holds (none: nothing written)."""
        return {"kept": self.kept} if self.kept else None


_lock = threading.Lock()  # one writer of this process at a time


def _keep(directory: str, found: list[_Entry]) -> bool:
    """Merge ``found`` (one warm's) into the file of the cache ``directory`` and write it whole, unless the file
    holds them all already; whether it wrote."""
    with _lock:
        path = index_path(directory)
        fd = None
        try:
            path.parent.mkdir(exist_ok=True)
            # the ranks of a job on one host share a cache: one read, merge and write at a time, or the last
            # rename would drop what the others merged (flock on the directory: no lock file is made)
            fd = lock(path.parent, shared=False)
            held = _read(directory)
            known = _known.setdefault(directory, set())
            known.update(held)
            if known.issuperset(found):  # another process (or an earlier read) wrote them: nothing to do
                return False
            entries = list(dict.fromkeys([*held, *found]))
            if len(entries) > LIMIT:  # the last warm's, then the earliest read
                mine = set(found)
                entries = [e for e in entries if e not in mine][: max(0, LIMIT - len(mine))] + list(dict.fromkeys(found))
            sweep_temporaries(path.parent)  # a writer that was killed mid-write
            atomic_write(path, json.dumps({"format": _FORMAT, "entries": entries}).encode())
        except OSError as exc:  # only a head start for the next process: nothing left behind
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only where it is empty
            log.debug("could not keep the warm's specializations in %s: %r", path, exc)
            return False
        finally:
            if fd is not None:
                os.close(fd)
        known.update(entries)
        return True


def decode(jits: Mapping[str, Any], targets: list[Any], *, stop: Callable[[], bool]) -> int:
    """Decode and hash the current cache's specializations for ``targets`` (``GPUTarget``) of ``jits`` (functions by
    full name), for binding to find (:func:`warmreg._triton.cache.local_cache_hash`), and read the group file of
    each one's cache entry, for its hit to find (:func:`warmreg._triton.hits.remember_found_group`: the warm skips
    Triton's ``get_group``, as after a pack install); stops once ``stop()`` says so. Returns how many were decoded;
    an entry that does not decode is skipped."""
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
            binary_hash, src = _triton_cache.hashed_source(jit, data, platform)
            decoded += 1
            remember_found_group(directory, binary_hash, _triton_cache.metadata_filename(src))  # the hit's group read
        except Exception as exc:
            log.debug("could not decode a specialization of %s: %r", name, exc)
    return decoded
