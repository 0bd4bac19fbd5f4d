"""Seeding a build's empty cache from Triton's own: a pack build after a warm compiles nothing it already has.

A pack build compiles into an empty cache directory, so that every entry it packs is whole and its files
are its own. :class:`Seed`, a stage of the build (:func:`warmreg.stages.compose.for_build`), copies into
that directory, before any lookup, each entry the process's own Triton cache already holds for a key of the
plan: the files, then the group file (what Triton reads as the entry being there) rewritten to name the
copies. A warm after the build is a separate matter: the pack installs into the serving cache.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._triton import cache as _triton_cache
from ..pipeline.stage import Stage

if TYPE_CHECKING:
    from ..pipeline.bind import Task
    from ..pipeline.planning import Plan

__all__ = ["Seed", "copy_entry"]


class Seed(Stage):
    """The build stage that copies the entries of the cache at ``source`` the plan's keys hit.

    :ivar copied: entries copied (each a key the build then finds instead of compiling).
    """

    name = "seed"

    def __init__(self, source: str | os.PathLike[str]) -> None:
        self.source = Path(source)
        self.copied = 0

    def section(self) -> dict[str, Any]:
        """The entries copied from the process's own cache."""
        return {"source": str(self.source), "copied": self.copied}

    def before_compile(self, plan: Plan, tasks: list[Task]) -> None:
        target = Path(_triton_cache.cache_dir())
        if not self.source.is_dir() or self.source.resolve() == target.resolve():
            return
        for task in tasks:
            if task.captured is None or task.specialization_data is None:
                continue
            try:
                sub = _triton_cache.cache_subdir(_triton_cache.local_cache_hash(task.captured[0], task.specialization_data, plan.platform))
            except Exception:  # the compile step says why, for this cache
                continue
            if not (target / sub).exists() and copy_entry(self.source / sub, target / sub):
                self.copied += 1


def copy_entry(src: Path, dst: Path) -> bool:
    """Copy one whole entry (its group file names every file), group file last; ``False`` if it is not whole."""
    groups = sorted(src.glob("__grp__*.json"))
    if not groups:
        return False
    staged = dst.with_name(f".{dst.name}.seed-{uuid.uuid4().hex[:8]}")
    try:
        children = {name: Path(path) for g in groups for name, path in json.loads(g.read_text())["child_paths"].items()}
        if not all(p.parent == src and p.is_file() for p in children.values()):
            return False
        staged.mkdir(parents=True)
        for path in children.values():
            shutil.copyfile(path, staged / path.name)
        for g in groups:  # the group file, naming the copies, written last
            body = json.loads(g.read_text())
            body["child_paths"] = {name: str(dst / Path(p).name) for name, p in body["child_paths"].items()}
            (staged / g.name).write_text(json.dumps(body))
        os.replace(staged, dst)
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a whole entry: the build compiles it
        shutil.rmtree(staged, ignore_errors=True)
        return False
