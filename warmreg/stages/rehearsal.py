"""Rehearsal: on the local GPU, warm launches every key once for real, so a first launch costs what
a later one does.

A key that is compiled, loaded and has its fast launch still pays, on its first real launch, for
what only a launch does: the driver's first launch of the function, the first run of the op's launch
code and the C launch path on real tensors, the allocator's first block of an output size. The
:class:`Rehearse` stage (after tuning, so a tuned kernel launches its chosen candidate) moves that
into warm: each kernel's own launch code runs once per key on :meth:`~warmreg.TritonKernel.tuning_inputs`
(by default its warmup inputs as zero-filled device tensors: every index 0, every length 0), as
often as CPython needs before a function runs specialized bytecode (``_RUNS``), then the GPU is
synchronized, so a kernel that faults on them fails the warm, not the first request.

In a cold warm, a key the forked compile finished early (loaded, its fast launch prepared: see
:attr:`~warmreg.pipeline.stage.Stage.finish`) is rehearsed right then (:meth:`Rehearse.rehearse_now`), while the
other keys still compile, unless its kernel is tuned; the rest, and the synchronize, come after loading.

The launches are warmreg's own (the monitor ignores them, as it does compiles in warm). A launch
whose inputs would not give back the key is not made (a contract error, logged); a kernel whose
launch is unsafe on zeros overrides ``tuning_inputs`` or sets ``rehearse = False``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import attrs

from .. import _triton
from ..contract.domains import runtime_platform
from ..pipeline.stage import Stage

if TYPE_CHECKING:
    from ..pipeline.bind import Task
    from ..pipeline.planning import Plan

__all__ = ["SLOWEST", "Rehearse"]

log = logging.getLogger("warmreg.stages.rehearsal")

#: Launches of each key after the contract check: CPython 3.12+ specializes bytecode at its 2nd run,
#: 3.11 only once a function's 8th call quickened it (``QUICKENING_WARMUP_DELAY``); 3.10 never.
_RUNS = 9 if sys.version_info[:2] == (3, 11) else 2
#: The slowest rehearsed keys the report lists (kernel, key, host seconds).
SLOWEST = 8


class Rehearse(Stage):
    """The stage that launches every loaded key once on the local GPU.

    :ivar launched: keys launched (a tuned kernel's tuning key counts once: its chosen candidate).
    :ivar skipped: ``(kernel, key, why)`` of keys not rehearsed.
    :ivar seconds: time spent, the final synchronize included (``synchronize_seconds``: that alone; ``early``: the
        keys rehearsed while the forked compile still ran, their time included).
    :ivar per_key: ``(kernel, key, seconds)`` of each key rehearsed: the host time of its inputs and launches
        (the GPU's share shows in the final synchronize); the report keeps the slowest (:data:`SLOWEST`).
    """

    name = "rehearsal"

    def __init__(self) -> None:
        self.launched = 0
        self.skipped: list[tuple[str, str, str]] = []
        self.per_key: list[tuple[str, Any, float]] = []
        self.seconds = self.synchronize_seconds = 0.0
        self.early = 0
        self._done: set[tuple[str, Any]] = set()  # (kernel, key) rehearsed
        self._device: Any = None

    @classmethod
    def for_plan(cls, plan: Plan) -> Rehearse | None:
        """The stage, if ``plan`` is for the local GPU."""
        return cls() if plan.platform.local else None

    def section(self) -> dict[str, Any]:
        """The keys launched, those skipped with why, the time it took, and where the time went."""
        slowest = sorted(self.per_key, key=lambda row: -row[2])[:SLOWEST]
        return {
            "launched": self.launched, "early": self.early, "skipped": [list(s) for s in self.skipped], "seconds": self.seconds,
            "synchronize_seconds": self.synchronize_seconds, "slowest": [[name, str(key), s] for name, key, s in slowest],
        }  # fmt: skip

    def rehearse_now(self, task: Task) -> None:
        """Rehearse one key the forked compile has just finished, if it is loaded with its fast launch and its
        kernel is not tuned (a tuned kernel launches its chosen candidate, known after loading)."""
        loaded = task.status != "failed" and getattr(task.compiled, "module", None) is not None and task.captured is None
        kernel = task.kp.kernel_for(task.key) if loaded else None
        if kernel is None or kernel.tune_configs or not getattr(kernel, "rehearse", True):
            return
        start, launched = time.perf_counter(), self.launched
        if (task.kp.name, task.key) not in self._done:
            self._done.add((task.kp.name, task.key))
            self._rehearse(task.kp.name, kernel, task.key, self._ready())
        self.early += self.launched - launched
        self.seconds += time.perf_counter() - start

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        import torch

        start, device = time.perf_counter(), self._ready()
        for task in tasks:
            if task.status == "failed" or task.compiled is None:
                continue
            kernel = task.kp.kernel_for(task.key)
            key = attrs.evolve(task.key, config=None) if kernel.tune_configs else task.key  # type: ignore[call-arg]
            if (task.kp.name, key) in self._done or not getattr(kernel, "rehearse", True):
                continue
            self._done.add((task.kp.name, key))
            self._rehearse(task.kp.name, kernel, key, device)
        synchronize = time.perf_counter()
        torch.cuda.synchronize(device)  # a kernel that faults on its rehearsal fails the warm here
        self.seconds += time.perf_counter() - start
        self.synchronize_seconds = time.perf_counter() - synchronize

    def _ready(self) -> Any:
        """The device the keys launch on, first making ready what launch code reads."""
        if self._device is None:
            self._device = _triton.torch_device()
            runtime_platform()  # launch code's defaults read it (launch_pdl): detected once, now
        return self._device

    def _rehearse(self, name: str, kernel: Any, key: Any, device: Any) -> None:
        """Launch one key on its tuning inputs: once captured (its inputs must give back the key), then ``_RUNS`` times."""
        from ..runtime.launch import capture

        start = time.perf_counter()
        try:
            inputs = kernel.tuning_inputs(key, device)
            launcher = getattr(kernel, kernel.launcher)
            with capture() as probe:
                launcher(**inputs)
            if probe.key != key:
                self.skipped.append((name, str(key), f"its inputs launch {probe.key}"))
                return
            for _ in range(_RUNS):
                launcher(**inputs)
            self.launched += 1
            self.per_key.append((name, key, time.perf_counter() - start))  # the key named only if among the slowest
        except Exception as exc:  # inputs the launch code refuses: the key serves as it is
            log.warning("no rehearsal of %s %s: %s", name, key, exc)
            self.skipped.append((name, str(key), f"{type(exc).__name__}: {exc}"))
