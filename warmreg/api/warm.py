"""The calls an engine makes: :func:`plan`, :func:`prefetch`, :func:`warm` (and :func:`reset_state`).

``warm`` is the pipeline (:mod:`warmreg.pipeline.run`) with the add-ons a deployment needs plugged in:
packs installed as a stage (:class:`warmreg.stages.pack.PackInstall`), the keys sharded over the ranks of a
torch.distributed job as a stage (:class:`warmreg.stages.distributed.Shard`), and the JIT monitor taught
what was warmed (and armed, if asked).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import triton

from .. import _triton
from .._triton import cache as _triton_cache
from ..pipeline import run as pipeline
from ..pipeline.bind import OnError, check_on_error
from ..stages.distributed import Shard
from ..values.errors import CompileFailed, WarmregError
from ..monitoring import KNOWLEDGE, arm
from ..stages.pack import PackInstall, prefetch_install
from ..pipeline.planning import Plan, plan
from ..values.platform import Platform
from ..pipeline.plugins import OnPluginError
from ..stages.processes import Processes
from ..stages.rehearsal import Rehearse
from ..pipeline.report import KeyResult, WarmReport
from ..stages.tuning import Tune

__all__ = ["prefetch", "reset_state", "warm"]

log = logging.getLogger("warmreg.api.warm")


def prefetch(pack: str | os.PathLike[str] | None = None) -> None:
    """Start, on background threads, the part of a warm that depends on no config: Triton's hash of
    its own installation (``triton_key()``, which reads the 415 MB ``libtriton.so``: ~0.5 s on the
    H200 host, the largest single cost of a warm from a warm cache or a pack), importing the
    installed plugins with their kernels (~0.4 s there: the first plan's cost), then the modules
    Triton imports at its first specialization and each kernel's source hash, and the CUDA driver's
    utility module Triton compiles into a fresh cache (0.4-0.9 s of a warm from a pack there).

    :param pack: a pack the engine will warm with: installed too, once the plugins are imported,
        into the cache directory ``TRITON_CACHE_DIR`` names now, for the pack's own target (read,
        verified and written as :func:`warmreg.stages.pack.install` does). A warm of that pack into that
        cache then waits for it instead of installing; it installs the pack itself if the
        prefetch failed, refused an entry, or installed it for another target or cache directory.

    Call it early in an engine's start-up (before loading weights); :func:`warm` starts it too if it
    has not started, and waits for each part only where it needs it. Idempotent; returns at once.
    """
    global _plugins_thread
    _triton_cache.prefetch_triton_key()
    with _plugins_lock:
        if _plugins_thread is None:
            _plugins_thread = threading.Thread(target=_import_plugins, name="warmreg-plugins", daemon=True)
            _plugins_thread.start()
    if pack is not None:
        prefetch_install(pack, after=_plugins_thread)


_plugins_lock = threading.Lock()
_plugins_thread: threading.Thread | None = None


def _prefetched() -> None:
    prefetch()
    assert _plugins_thread is not None
    _plugins_thread.join()  # one import of the plugins, not two racing


def _import_plugins() -> None:
    from ..pipeline.plugins import loaded_jits

    try:
        jits = loaded_jits()  # the installed plugins imported, and their kernels' jit functions
    except Exception as exc:  # the warm's own plan loads them again and reports the problem
        log.debug("prefetch could not import the plugins: %r", exc)
        return
    # what the first warm of a process computes once, whatever the config: the modules Triton
    # imports at its first specialization, and each kernel's source hash (an AST walk of its callees)
    _triton.preimport()
    for jit in jits.values():
        try:
            _triton.source_hash(jit)
        except Exception as exc:  # the warm computes it again and reports the kernel that fails
            log.debug("prefetch could not hash %s: %r", _triton.full_name(jit), exc)


def reset_state() -> None:
    """Forget what this process warmed: Triton's compiled kernels in memory (of every jit function
    defined so far), warmreg's fast launches and tuned choices, and what the JIT monitor learned from
    earlier warms (the choices kept in the cache directory stay).

    For test suites (the pytest fixture ``warmreg_isolated`` calls it around each test) and before
    compiling into another cache directory. Armed monitors stay armed.
    """
    from ..runtime.launch import FAST_TABLES, TUNED

    _triton.forget_compiled()
    FAST_TABLES.clear()
    TUNED.clear()
    KNOWLEDGE.clear()
    _WARMED.clear()


def warm(
    config: Any, *, target: str | Platform | None = None, workers: int | None = None, on_error: OnError = "raise",
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
    _prefetched()  # started here if the engine did not; the plugins' import done before planning
    on_error, workers = check_on_error(on_error), _workers(workers)
    shard = Shard.resolve(group, distributed)
    the_plan = plan(config, target=target, plugins=plugins, entry_points=entry_points, on_plugin_error=on_plugin_error, serving=serving)
    if (again := _already_warm(the_plan, shard, start)) is not None:
        return _finish(again, the_plan, on_error, monitor, record)
    _triton_cache.check_cache_writable()
    packs = PackInstall.for_plan(the_plan, pack)
    plan_seconds = time.perf_counter() - start
    procs, tune, rehearsal = Processes.for_plan(the_plan, workers), Tune.for_plan(the_plan), Rehearse.for_plan(the_plan) if rehearse else None
    stages = [s for s in (packs, shard, procs, tune, rehearsal) if s is not None]
    results = pipeline.run(the_plan, workers=workers, on_error=on_error, stages=stages, progress=progress)
    report = _report(the_plan, results, workers, time.perf_counter() - start, plan_seconds, packs, shard, tune, rehearsal, procs)
    return _finish(report, the_plan, on_error, monitor, record)


#: What each warm of this process left in memory, by plan: its report, (weak references to) the fast
#: launches it prepared and the tuned choices it made (see :func:`_already_warm`). :func:`reset_state`
#: forgets it. Weak, so that a kernel Triton frees is not kept loaded by this record.
_WARMED: dict[tuple[Any, ...], tuple[WarmReport, tuple[tuple[str, Any, Any], ...], dict[str, dict[Any, int]]]] = {}


def _plan_identity(the_plan: Plan) -> tuple[Any, ...]:
    return (the_plan.platform.target, _triton_cache.cache_dir(), tuple((kp.name, key) for kp, key in the_plan.items()))


def _tuned_state(the_plan: Plan) -> dict[str, dict[Any, int]]:
    from ..runtime.launch import TUNED

    return {kp.name: dict(TUNED.get(kp.name, {})) for kp in the_plan.kernels if kp.kernel.tune_configs}


def _already_warm(the_plan: Plan, shard: Shard | None, start: float) -> WarmReport | None:
    """The report of an earlier warm of this very plan in this process, when every key it warmed is
    still in memory with the fast launch it prepared and every tuned choice it made (a second warm
    then has nothing to do)."""
    from ..runtime.launch import FAST_TABLES

    if shard is not None or not the_plan.platform.local:
        return None
    earlier = _WARMED.get(_plan_identity(the_plan))
    if earlier is None:
        return None
    report, entries, tuned = earlier
    if any((e := ref()) is None or FAST_TABLES.get(name, {}).get(key) is not e for name, key, ref in entries) or _tuned_state(the_plan) != tuned:
        return None
    return attrs.evolve(report, seconds=time.perf_counter() - start, already_warm=True)


def _remember(the_plan: Plan, report: WarmReport, shard: Shard | None) -> None:
    from ..runtime.launch import FAST_TABLES

    if shard is None and the_plan.platform.local and not report.failed:
        fast = [(r.kernel, r.key, FAST_TABLES.get(r.kernel, {}).get(r.key)) for r in report.results]
        if all(entry is not None for _, _, entry in fast):  # every key verifiable in memory
            refs = tuple((name, key, weakref.ref(entry)) for name, key, entry in fast)
            _WARMED[_plan_identity(the_plan)] = (report, refs, _tuned_state(the_plan))


def _workers(workers: int | None) -> int:
    if workers is None:
        return pipeline.default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise WarmregError(f"workers={workers!r} must be an int >= 1", fix="pass e.g. workers=8, or None for all CPUs")
    return workers


def _report(
    the_plan: Plan, results: list[KeyResult], workers: int, seconds: float, plan_seconds: float,
    packs: PackInstall | None, shard: Shard | None, tune: Tune | None, rehearsal: Rehearse | None = None,
    procs: Processes | None = None,
) -> WarmReport:  # fmt: skip
    stats = shard.stats() if shard is not None else None
    report = WarmReport(
        platform=the_plan.platform.target,
        model_type=the_plan.config.model_type,
        triton_version=triton.__version__,
        workers=workers,
        seconds=seconds,
        plan_seconds=plan_seconds,
        results=results,
        plugins=the_plan.plugins,
        skipped=tuple(f"{s.kernel} ({s.plugin}): {s.reason}" for s in the_plan.skipped),
        plugin_problems=tuple(str(p) for p in the_plan.plugin_problems),
        pack=packs.note() if packs is not None else None,
        rank=stats.rank if stats else 0,
        world_size=stats.world_size if stats else 1,
        shard_compiled=stats.compiled_here if stats else None,
        shard_received=stats.received if stats else None,
        shard_launchers_received=stats.launchers_received if stats else None,
        tuning=tuple(c.to_json() for c in tune.choices) if tune is not None else (),
        tuning_seconds=tune.seconds if tune is not None else 0.0,
        rehearsed=rehearsal.launched if rehearsal is not None else 0,
        rehearsal_seconds=rehearsal.seconds if rehearsal is not None else 0.0,
        processes=procs.processes if procs is not None else 0,
        processes_seconds=procs.seconds if procs is not None else 0.0,
    )
    _remember(the_plan, report, shard)
    return report


def _finish(report: WarmReport, the_plan: Plan, on_error: OnError, monitor: str | None, record: Any) -> WarmReport:
    """Teach the monitor what was warmed, raise for failures (unless ``continue``), arm the monitor."""
    owners = {_triton.full_name(j): kp.name for kp in the_plan.kernels for j in kp.kernel.jits() if j is not None}
    KNOWLEDGE.learn(report, owners)
    if report.failed and on_error != "continue":
        error = CompileFailed([(r.kernel, r.key, r.error or "") for r in report.failed])
        error.report = report  # type: ignore[attr-defined]
        raise error
    if monitor is not None and monitor != "off":
        arm(monitor, record=record)  # type: ignore[arg-type]
    return report
