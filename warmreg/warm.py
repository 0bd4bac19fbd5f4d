"""``plan`` and ``warm``: the two calls an engine makes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import triton

from . import _triton, _triton_cache
from .compile import OnError, check_on_error, compile_keys
from .config import WarmConfig
from .errors import CompileFailed, ConfigError, WarmregError
from .platform import Platform, check_features, resolve_platform
from .plugins import OnPluginError, call_register_hooks, load_plugins
from .registry import Plan, Registry
from .report import KeyResult, WarmReport

__all__ = ["default_workers", "plan", "prefetch", "reset_state", "warm"]


def default_workers() -> int:
    """Compile threads by default: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def plan(
    config: Any,
    *,
    target: str | Platform | None = None,
    plugins: Iterable[Any] = (),
    entry_points: bool = True,
    on_plugin_error: OnPluginError = "raise",
    serving: Mapping[str, Any] | None = None,
) -> Plan:
    """The kernels and keys a deployment needs, without compiling anything.

    :param config: anything :meth:`WarmConfig.load` accepts.
    :param serving: serving settings that override those of ``config`` (e.g. a plain Hugging Face
        ``config.json`` with ``{"max_num_batched_tokens": 8192}``).
    :param target: ``None`` for the local GPU, or a target such as ``"cuda:90"``.
    :param plugins: extra plugin modules/objects besides the installed entry points.
    :param entry_points: load installed plugins (group ``warmreg``).
    :param on_plugin_error: ``"raise"`` or ``"skip"`` a plugin that fails (see :mod:`warmreg.plugins`).
    :raises ConfigError: for a missing or invalid field, naming it, the plugin and the fix.
    :raises PluginError: for a broken plugin under ``on_plugin_error="raise"``.
    """
    _triton.check_version()
    cfg = WarmConfig.load(config, serving=serving)
    platform = resolve_platform(target)
    loaded = load_plugins(plugins, entry_points=entry_points, on_plugin_error=on_plugin_error)
    registry = Registry(cfg, platform)
    problems = call_register_hooks(loaded, registry, cfg, platform, on_plugin_error)
    check_features(platform)
    result = registry.plan()
    names = tuple(n for n in loaded.names if n not in {p.split(":")[0] for p in problems})
    served = {t for types in loaded.manager.hook.warmreg_model_types() for t in types}
    if not result.kernels and not result.skipped and not problems and served and cfg.model_type not in served:
        raise ConfigError(
            "model.model_type",
            f"is {cfg.model_type!r}, which no installed plugin serves (served: {', '.join(sorted(served))})",
            fix=(
                "check model_type, or install the warmreg plugin of this model family: warmreg-deepseek-v4 and "
                "warmreg-kimi-k3 are built from the warmreg repository's plugins/ (not on an index yet: "
                "pip install --find-links DIST warmreg-<family>, README 'Set up'); other families ship their own"
            ),
        )
    return Plan(
        config=cfg,
        platform=platform,
        kernels=result.kernels,
        skipped=result.skipped,
        plugins=names,
        plugin_problems=loaded.problems + tuple(problems),
    )


def prefetch() -> None:
    """Start, on a background thread, the part of a warm that depends on no config: Triton's hash of
    its own installation (``triton_key()``, which reads the 415 MB ``libtriton.so``: ~0.5 s on the
    H200 host, the largest single cost of a warm from a warm cache or a pack).

    Call it early in an engine's start-up (before loading weights); :func:`warm` starts it too if it
    has not started, and waits for it only where it needs the hash. Idempotent; returns at once.
    """
    _triton_cache.prefetch_triton_key()


def reset_state() -> None:
    """Forget what this process warmed: Triton's compiled kernels in memory (of every jit function
    defined so far), warmreg's fast launches and what the JIT monitor learned from earlier warms.

    For test suites (the pytest fixture ``warmreg_isolated`` calls it around each test) and before
    compiling into another cache directory. Armed monitors stay armed.
    """
    from .kernel import FAST_TABLES
    from .monitor import KNOWLEDGE

    _triton.forget_compiled()
    FAST_TABLES.clear()
    KNOWLEDGE.clear()


def warm(
    config: Any,
    *,
    target: str | Platform | None = None,
    workers: int | None = None,
    on_error: OnError = "raise",
    plugins: Iterable[Any] = (),
    entry_points: bool = True,
    on_plugin_error: OnPluginError = "raise",
    progress: bool | None = None,
    monitor: str | None = None,
    record: str | os.PathLike[str] | None = None,
    pack: str | os.PathLike[str] | None = None,
    group: Any = None,
    distributed: bool | None = None,
    serving: Mapping[str, Any] | None = None,
) -> WarmReport:
    """Compile (or load from cache) every key the deployment needs, before it serves.

    On the local GPU it also builds each kernel's launcher and loads its module, so the first real
    launch pays nothing. With ``target`` it cross-compiles on any machine, GPU or not.

    :param config: anything :meth:`WarmConfig.load` accepts (dict, path, HF config, engine config).
    :param target: ``None`` for the local GPU, or e.g. ``"cuda:90"``, ``"rocm:gfx942"``.
    :param workers: compile threads (default: the CPUs available).
    :param on_error: ``"raise"`` (warm everything, then raise :class:`CompileFailed` if a key failed),
        ``"continue"`` (return the report with the failures) or ``"stop"`` (stop at the first failure).
    :param progress: show a progress bar (default: when stderr is a terminal).
    :param monitor: arm the JIT monitor in this mode (``warn``, ``error``, ``record``) once warm
        has finished; disarm it with :func:`warmreg.disarm`.
    :param record: with ``monitor="record"``, the JSON-lines file misses are appended to.
    :param pack: install this pack into Triton's cache first (see :mod:`warmreg.pack`), so every
        key it holds is a cache hit; refused entries are compiled as usual. Installed pack wheels
        (``warmreg build --wheel``) built for this model type, target and Triton release are
        installed first in any case; others are skipped with a logged reason.
    :param group: a ``torch.distributed`` process group to shard compiling over (default: the world
        group when torch.distributed is initialized); see :mod:`warmreg.distributed`.
    :param distributed: ``False`` never shards; ``None`` shards automatically when torch.distributed
        is initialized with more than one rank; ``True`` requires it.
    :param serving: serving settings that override those of ``config`` (see :func:`plan`).
    :returns: the :class:`WarmReport`.
    :raises CompileFailed: under ``on_error`` ``"raise"`` or ``"stop"`` if any key failed; its
        ``report`` attribute holds the full report.
    """
    start = time.perf_counter()
    prefetch()  # if the engine did not already: overlaps the hash with plugin loading and planning
    on_error = check_on_error(on_error)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise WarmregError(f"workers={workers!r} must be an int >= 1", fix="pass e.g. workers=8, or None for all CPUs")
    from .distributed import resolve_group, sharded_compile

    shard_group = resolve_group(group, distributed)
    the_plan = plan(config, target=target, plugins=plugins, entry_points=entry_points, on_plugin_error=on_plugin_error, serving=serving)
    _triton_cache.check_cache_writable()
    pack_note: list[str] = []
    from .pack import installed_for

    packs: list[str | os.PathLike[str]] = [*installed_for(the_plan.platform, the_plan.config.model_type)]
    if pack is not None:
        packs.append(pack)

    def install_packs() -> None:
        # between binding and compiling (compile_keys' before_compile): the launch code of every key
        # runs while Triton's installation is still being hashed; the install needs that hash
        from .pack import install

        for path in packs:
            r = install(os.fspath(path), target=the_plan.platform, jits=the_plan.jits())
            pack_note.append(
                f"{path}: {r.installed} installed, {r.present} present, {len(r.refused)} refused, "
                f"{r.launchers} C launchers in {r.seconds:.2f} s"
            )

    plan_seconds = time.perf_counter() - start
    n_workers = workers or default_workers()
    show = sys.stderr.isatty() if progress is None else progress
    before = install_packs if packs else None
    shard = None
    if shard_group is not None:
        if before is not None:
            before()
        results, shard = sharded_compile(the_plan, group=shard_group, workers=n_workers, on_error=on_error)
    elif show:
        results = _compile_with_progress(the_plan, n_workers, on_error, before)
    else:
        results = compile_keys(the_plan.items(), platform=the_plan.platform, workers=n_workers, on_error=on_error, before_compile=before)
    report = WarmReport(
        platform=the_plan.platform.target,
        model_type=the_plan.config.model_type,
        triton_version=triton.__version__,
        workers=n_workers,
        seconds=time.perf_counter() - start,
        plan_seconds=plan_seconds,
        results=results,
        plugins=the_plan.plugins,
        skipped=tuple(f"{s.kernel} ({s.plugin}): {s.reason}" for s in the_plan.skipped),
        plugin_problems=the_plan.plugin_problems,
        pack="; ".join(pack_note) or None,
        rank=shard.rank if shard else 0,
        world_size=shard.world_size if shard else 1,
        shard_compiled=shard.compiled_here if shard else None,
        shard_received=shard.received if shard else None,
        shard_launchers_received=shard.launchers_received if shard else None,
    )
    from .monitor import KNOWLEDGE, arm

    owners = {_triton.full_name(j): kp.name for kp in the_plan.kernels for j in kp.kernel.jits() if j is not None}
    KNOWLEDGE.learn(report, owners)
    if report.failed and on_error != "continue":
        error = CompileFailed([(r.kernel, r.key, r.error or "") for r in report.failed])
        error.report = report  # type: ignore[attr-defined]
        raise error
    if monitor is not None and monitor != "off":
        arm(monitor, record=record)  # type: ignore[arg-type]
    return report


def _compile_with_progress(
    the_plan: Plan, workers: int, on_error: OnError, before_compile: Callable[[], None] | None = None
) -> list[KeyResult]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]warm[/] {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"{the_plan.platform} ({workers} workers)", total=the_plan.num_keys)
        return compile_keys(
            the_plan.items(),
            platform=the_plan.platform,
            workers=workers,
            on_error=on_error,
            advance=lambda _r: bar.advance(task),
            before_compile=before_compile,
        )
