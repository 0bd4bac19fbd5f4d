"""A stage of the warm pipeline: what steps in between binding every key and loading the binaries.

A stage owns its options (given to its constructor) and its own section of the warm report
(:meth:`Stage.section`, filed under :attr:`Stage.name`); the pipeline (:func:`warmreg.pipeline.run.run`)
calls its steps in order and knows no stage by name. :mod:`warmreg.stages` holds the stages and composes
them for a warm and for a pack build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .bind import Task
    from .planning import Plan

__all__ = ["Stage"]


class Stage:
    """A step between binding and loading. Its methods are called in this order, each by default
    doing nothing; subclasses override what they need.

    :ivar name: the stage's section in the warm report (:attr:`warmreg.WarmReport.stages`).
    :ivar progress: set by the pipeline before the first call: the warm's per-key progress callback
        (``None`` when none is shown), for a stage that finishes keys itself; a key counts once.
    :ivar finish: set too, for :meth:`first`: the compile step of one key the stage put in Triton's disk cache (the
        forked compile), so that its work here (a hit, a load, a fast launch) overlaps the compiles still running.
    """

    name: ClassVar[str] = ""
    progress: Callable[[Task], None] | None = None
    finish: Callable[[Task], None] | None = None

    def before_compile(self, plan: Plan, tasks: list[Task]) -> None:
        """After every key is bound, before any cache lookup (e.g. a pack install)."""

    def first(self, plan: Plan, tasks: list[Task]) -> list[Task]:
        """The tasks to compile first (e.g. this rank's shard of the keys)."""
        return tasks

    def after_first(self, plan: Plan, tasks: list[Task]) -> None:
        """After those compiled (e.g. the exchange between ranks, which may mark keys failed); every
        key not done yet is compiled next."""

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        """Every key compiled and, on the local GPU, loaded with its fast launch (e.g. autotuning),
        still inside the warm's compile scope."""

    def section(self) -> dict[str, Any] | None:
        """What this stage did, as JSON values for the report (``None``: nothing to say); a
        ``summary`` entry is one line the report's :meth:`~warmreg.WarmReport.summary` adds."""
        return None
