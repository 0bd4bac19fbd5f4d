"""A stage of the warm pipeline: what steps in between binding every key and loading the binaries.

Packs (:class:`warmreg.stages.pack.PackInstall`) and the exchange between the ranks of a distributed warm
(:class:`warmreg.stages.distributed.Shard`) are stages, and so is choosing each autotuned kernel's candidate
(:class:`warmreg.stages.tuning.Tune`), as is compiling the misses in forked processes
(:class:`warmreg.stages.processes.Processes`); :func:`warmreg.pipeline.run.run` calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bind import Task
    from .planning import Plan

__all__ = ["Stage"]


class Stage:
    """A step between binding and loading. Its methods are called in this order, each by default
    doing nothing; subclasses override what they need.

    :ivar progress: set by the pipeline before the first call: the warm's per-key progress callback
        (``None`` when none is shown), for a stage that finishes keys itself; a key counts once.
    """

    progress: Callable[[Task], None] | None = None

    def before_compile(self, plan: Plan, tasks: list[Task]) -> None:
        """After every key is bound, before any cache lookup (e.g. a pack install)."""

    def first(self, plan: Plan, tasks: list[Task]) -> list[Task]:
        """The tasks to compile first (e.g. this rank's shard of the keys)."""
        return tasks

    def after_first(self, plan: Plan, tasks: list[Task]) -> None:
        """After those compiled (e.g. the exchange between ranks, which may mark keys failed); every
        key not done yet is compiled next."""

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        """Every key compiled and, on the local GPU, loaded with its fast launch (e.g. autotuning,
        :class:`warmreg.stages.tuning.Tune`), still inside the warm's compile scope."""
