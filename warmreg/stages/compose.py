"""The stages of a warm and of a pack build, composed in one place.

A warm installs packs (:class:`~warmreg.stages.pack.PackInstall`), shards the keys over the ranks of a
torch.distributed job (:class:`~warmreg.stages.distributed.Shard`), compiles the misses in forked
processes (:class:`~warmreg.stages.processes.Processes`), chooses autotune candidates on the GPU
(:class:`~warmreg.stages.tuning.Tune`), launches each key once there
(:class:`~warmreg.stages.rehearsal.Rehearse`: a key the forked compile finished early, at once) and keeps
what it specialized in its cache for the next process's prefetch (:class:`~warmreg.stages.remember.Remember`);
a build compiles (processes) and tunes, nothing else.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..pipeline.stage import Stage
from .distributed import Shard
from .pack import PackInstall
from .processes import Processes
from .rehearsal import Rehearse
from .remember import Remember
from .seed import Seed
from .tuning import Tune

if TYPE_CHECKING:
    from ..pipeline.planning import Plan

__all__ = ["for_build", "for_warm", "shard"]


def shard(group: Any, distributed: bool | None) -> Shard | None:
    """The sharding stage of a warm over ``group`` (``None``: a single-process warm; see
    :meth:`Shard.resolve`). Resolved before planning: a distributed warm is never served from memory."""
    return Shard.resolve(group, distributed)


def for_warm(
    plan: Plan, *, workers: int, pack: str | os.PathLike[str] | None, shard: Shard | None, rehearse: bool
) -> list[Stage]:
    """The stages of a warm of ``plan``, in the order they run."""
    processes, rehearsal = Processes.for_plan(plan, workers), Rehearse.for_plan(plan) if rehearse else None
    if processes is not None and rehearsal is not None:  # a key the forked compile finished early rehearses then
        processes.on_finished = rehearsal.rehearse_now
    stages = (PackInstall.for_plan(plan, pack), shard, processes, Tune.for_plan(plan), rehearsal, Remember.for_plan(plan))
    return [s for s in stages if s is not None]


def for_build(plan: Plan, *, workers: int, seed_from: str | os.PathLike[str] | None = None) -> list[Stage]:
    """The stages of a pack build of ``plan``: the entries ``seed_from`` (the process's own Triton cache)
    already holds copied in, then compile processes and autotuning."""
    stages = (Seed(seed_from) if seed_from is not None else None, Processes.for_plan(plan, workers), Tune.for_plan(plan))
    return [s for s in stages if s is not None]
