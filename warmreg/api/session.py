"""What a warm leaves in this process: the plans warmed with their fast launches, the monitor taught and armed.

A second warm of a plan this process warmed, with every key still in memory, returns the earlier report
(:func:`already_warm`); :func:`finish` teaches the JIT monitor what a warm compiled, raises for failed keys
and arms the monitor; :func:`reset_state` forgets all of it.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import attrs

from .. import _triton
from .._triton import cache as _triton_cache
from ..monitoring import KNOWLEDGE, arm
from ..pipeline.bind import OnError
from ..pipeline.report import WarmReport
from ..runtime.launch import FAST_TABLES, TUNED, WARMED, forget_loaded
from ..values.errors import CompileFailed

if TYPE_CHECKING:
    from ..pipeline.planning import Plan
    from ..pipeline.stage import Stage

__all__ = ["already_warm", "finish", "remember", "reset_state"]


def reset_state() -> None:
    """Forget what this process warmed: Triton's compiled kernels in memory (of every jit function
    defined so far), warmreg's fast launches and tuned choices, and what the JIT monitor learned from
    earlier warms (the choices kept in the cache directory stay).

    For test suites (the pytest fixture ``warmreg_isolated`` calls it around each test) and before
    compiling into another cache directory. Armed monitors stay armed.
    """
    _triton.forget_compiled()
    forget_loaded()
    KNOWLEDGE.clear()


def _plan_identity(the_plan: Plan) -> tuple[Any, ...]:
    return (the_plan.platform.target, _triton_cache.cache_dir(), tuple((kp.name, key) for kp, key in the_plan.items()))


def _tuned_state(the_plan: Plan) -> dict[str, dict[Any, int]]:
    return {kp.name: dict(TUNED.get(kp.name, {})) for kp in the_plan.kernels if kp.kernel.tune_configs}


def already_warm(the_plan: Plan, shard: Stage | None, start: float) -> WarmReport | None:
    """The report of an earlier warm of this very plan in this process, when every key it warmed is
    still in memory with the fast launch it prepared and every tuned choice it made (a second warm
    then has nothing to do)."""
    if shard is not None or not the_plan.platform.local:
        return None
    earlier = WARMED.get(_plan_identity(the_plan))
    if earlier is None:
        return None
    report, entries, tuned = earlier
    if any((e := ref()) is None or FAST_TABLES.get(name, {}).get(key) is not e for name, key, ref in entries) or _tuned_state(the_plan) != tuned:
        return None
    return attrs.evolve(report, seconds=time.perf_counter() - start, already_warm=True)


def remember(the_plan: Plan, report: WarmReport, shard: Stage | None) -> None:
    """Keep what this warm left in memory, for :func:`already_warm` to check next time."""
    if shard is None and the_plan.platform.local and not report.failed:
        fast = [(r.kernel, r.key, FAST_TABLES.get(r.kernel, {}).get(r.key)) for r in report.results]
        if all(entry is not None for _, _, entry in fast):  # every key verifiable in memory
            refs = tuple((name, key, weakref.ref(entry)) for name, key, entry in fast)
            WARMED[_plan_identity(the_plan)] = (report, refs, _tuned_state(the_plan))


def finish(report: WarmReport, the_plan: Plan, on_error: OnError, monitor: str | None, record: Any) -> WarmReport:
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

