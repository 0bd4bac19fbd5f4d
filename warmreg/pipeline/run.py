"""The warm pipeline: plan → bind every key once → stages → compile → load → results.

:func:`run` is the one pipeline every warm goes through: :func:`warmreg.warm` (with the pack install
and, under torch.distributed, the exchange between ranks as stages) and :func:`warmreg.stages.build.build`
(which compiles into an empty cache and writes a pack from the results). A :class:`Stage` steps in
between binding and loading; the pipeline owns the progress display, so every branch shows the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from .._triton import cache as _triton_cache
from ..values.errors import WarmregError
from .bind import OnError, Task, bind_all, check_on_error
from .compile import compile_scope, compile_tasks, finishing, prepare_fast_launches, remove_failed
from .planning import Plan
from .report import KeyResult
from .stage import Stage

__all__ = ["OnError", "check_on_error", "check_workers", "default_workers", "run"]


def default_workers() -> int:
    """Compile threads by default: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def check_workers(workers: int | None) -> int:
    """Validate a ``workers`` argument (``None``: :func:`default_workers`)."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise WarmregError(
            f"workers={workers!r} must be an int >= 1 (compile threads and processes)",
            fix="pass e.g. workers=8 (--workers 8), or leave it out for every CPU this process may use",
        )
    return workers


def run(
    plan: Plan,
    *,
    workers: int,
    on_error: OnError,
    stages: Sequence[Stage] = (),
    progress: bool | None = None,
    verb: str = "warm",
) -> list[KeyResult]:
    """Warm every key of ``plan``: bind each once, run the stages, compile, load (local GPU).

    :param workers: compile threads (1 compiles inline); a stage may fork compile processes of its own.
    :param on_error: ``"raise"``/``"continue"`` warm every key; ``"stop"`` stops at the first failure.
    :param stages: stage objects (see the module's docstring).
    :param progress: show a progress bar (default: when stderr is a terminal).
    :param verb: what the progress bar says the work is (``warm``, ``build``).
    :returns: one :class:`KeyResult` per key of the plan, in order.
    """
    _triton_cache.check_cache_writable()
    tasks = [Task(kp, key) for kp, key in plan.items()]
    show = sys.stderr.isatty() if progress is None else progress
    with _progress(show, f"[bold]{verb}[/] {plan.platform} ({workers} workers)", len(tasks)) as on_done, compile_scope(plan.platform):
        bind_all(tasks, plan.platform, on_error, on_done)
        with finishing(plan.platform, workers, on_done) as finish:
            for stage in stages:
                stage.progress, stage.finish = on_done, finish
            for stage in stages:  # every stage runs even after a stop: ranks meet in their collectives
                stage.before_compile(plan, tasks)
            first = tasks
            for stage in stages:
                first = stage.first(plan, first)
        compile_tasks(first, platform=plan.platform, workers=workers, on_error=on_error, on_done=on_done)
        for stage in stages:
            stage.after_first(plan, tasks)
        compile_tasks(tasks, platform=plan.platform, workers=workers, on_error=on_error, on_done=on_done)
        if plan.platform.local:
            prepare_fast_launches(tasks)
        for stage in stages:
            stage.after_load(plan, tasks)
    remove_failed(tasks, plan.platform)
    return [t.result() for t in tasks]


@contextmanager
def _progress(show: bool, title: str, total: int) -> Iterator[Callable[[Task], None] | None]:
    """A progress bar advanced once per finished key (or nothing, when not shown)."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=total)
        done: set[int] = set()

        def advance(t: Task) -> None:
            if id(t) not in done:  # a stage may finish a key before the compile step does
                done.add(id(t))
                bar.advance(task)

        yield advance
