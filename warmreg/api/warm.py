"""The calls an engine makes: :func:`plan`, :func:`prefetch`, :func:`warm` (and :func:`reset_state`).

``warm`` is the pipeline (:mod:`warmreg.pipeline.run`) with the stages a deployment needs
(:func:`warmreg.stages.compose.for_warm`: packs, the shard of a distributed job, compile processes,
autotuning, rehearsal), then the JIT monitor taught what was warmed (and armed, if asked).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..pipeline import run as pipeline
from ..pipeline.planning import OnPluginError, Platform, plan
from ..pipeline.report import WarmReport
from ..stages import compose
from . import session
from .prefetch import prefetch, wait_for_plugins
from .session import reset_state

__all__ = ["plan", "prefetch", "reset_state", "warm"]


def warm(
    config: Any, *, target: str | Platform | None = None, workers: int | None = None, on_error: pipeline.OnError = "raise",
    plugins: Iterable[Any] = (), entry_points: bool = True, on_plugin_error: OnPluginError = "raise",
    progress: bool | None = None, monitor: str | None = None, record: str | os.PathLike[str] | None = None,
    pack: str | os.PathLike[str] | None = None, group: Any = None, distributed: bool | None = None,
    serving: Mapping[str, Any] | None = None, rehearse: bool = True,
) -> WarmReport:  # fmt: skip
    """Compile (or load from cache) every key the deployment needs, before it serves; on the local
    GPU also build each kernel's launcher and load its module, so the first launch pays nothing.

    :param config: anything :meth:`WarmConfig.load` accepts; ``serving``, ``target``, ``plugins``,
        ``entry_points`` and ``on_plugin_error`` as for :func:`plan` (``target`` cross-compiles).
    :param workers: compile processes and threads (default: the CPUs available; :mod:`warmreg.stages.processes`).
    :param on_error: ``"raise"`` (warm every key, then raise :class:`CompileFailed`), ``"continue"``
        (return the report with the failures) or ``"stop"`` (stop at the first failure).
    :param progress: show a progress bar (default: when stderr is a terminal).
    :param monitor: arm the JIT monitor in this mode once warm; ``record``: its JSON-lines file.
    :param pack: a pack to install into Triton's cache before compiling (its keys become cache hits),
        as installed pack wheels of this model, target and release are (:class:`warmreg.stages.pack.PackInstall`).
    :param group: the ``torch.distributed`` group to shard compiling over (default: the world group);
        ``distributed``: ``False`` never shards, ``None`` shards when torch.distributed is
        initialized with more than one rank, ``True`` requires it (:class:`warmreg.stages.distributed.Shard`).
    :param rehearse: on the GPU, launch each key once at the end (:mod:`warmreg.stages.rehearsal`).
    :raises CompileFailed: under ``on_error`` ``"raise"`` or ``"stop"`` if a key failed (``.report``).
    """
    start = time.perf_counter()
    wait_for_plugins()  # prefetch started here if the engine did not; the plugins imported before planning
    on_error, workers = pipeline.check_on_error(on_error), pipeline.check_workers(workers)
    shard = compose.shard(group, distributed)
    the_plan = plan(config, target=target, plugins=plugins, entry_points=entry_points, on_plugin_error=on_plugin_error, serving=serving)
    if (again := session.already_warm(the_plan, shard, start)) is not None:
        return session.finish(again, the_plan, on_error, monitor, record)
    stages = compose.for_warm(the_plan, workers=workers, pack=pack, shard=shard, rehearse=rehearse)
    plan_seconds = time.perf_counter() - start
    results = pipeline.run(the_plan, workers=workers, on_error=on_error, stages=stages, progress=progress)
    report = WarmReport.of(the_plan, results, stages, workers=workers, seconds=time.perf_counter() - start, plan_seconds=plan_seconds)
    session.remember(the_plan, report, shard)
    return session.finish(report, the_plan, on_error, monitor, record)
