"""Every warmed key, launched for real on the local GPU: nothing compiles, first launch ≈ steady state.

For each example config: ``warm()`` (optionally from a pack), arm the monitor in ``record`` mode, then
for every kernel and every key launch the kernel's own launch code with real device tensors shaped
exactly like its ``warmup_inputs(key)`` (same shape, strides and storage offset, so the same
alignment), zero-filled so every index stays in bounds; an autotuned kernel's keys each as their candidate
(``warmreg.use_config``). Records, per kernel: launches, misses,
failures, the first launch's time, the median steady-state launch time, how many launches went
through Triton's ``JITFunction.run`` instead of warmup's guarded fast path (0 when every warmed key
is served by its fast launch), and what each key's first launch did that a steady launch does not
(``first_launch_work``: compiles, module loads, calls of ``JITFunction.run`` and of the compiled kernel's
own launcher; all 0 where warm left nothing to the first launch).

    python benchmarks/gpu_all_keys.py examples/deepseek_v4_flash.json [more configs] [--pack CONFIG=PACK]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write

import warmreg
from warmreg.monitoring import current
from warmreg.testing import materialize


def _timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


_RUNS = [0]
_REAL_RUN = JITFunction.run


def _counting_run(self: Any, *args: Any, **kwargs: Any) -> Any:
    _RUNS[0] += 1
    return _REAL_RUN(self, *args, **kwargs)


class _Work:
    """Counts, while active, what a launch after warm must not do: compile (``JITFunction._do_compile``), load a
    module (the driver's ``load_binary``), or go through Triton's Python launch path (``JITFunction.run``, and the
    compiled kernel's own launcher, ``CompiledKernel.run``, which warmreg's C launch does not call)."""

    def __init__(self) -> None:
        from triton.runtime.driver import driver

        self.counts = {"compiles": 0, "module_loads": 0, "triton_run": 0, "triton_launcher": 0}
        utils, launcher = driver.active.utils, driver.active.launcher_cls
        self._patches = [
            (JITFunction, "_do_compile", "compiles"), (JITFunction, "run", "triton_run"),
            (utils, "load_binary", "module_loads"), (launcher, "__call__", "triton_launcher"),
        ]  # fmt: skip
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> dict[str, int]:
        for owner, name, counter in self._patches:
            real = getattr(owner, name)
            self._saved.append((owner, name, owner.__dict__.get(name, real) if isinstance(owner, type) else real))

            def counted(*a: Any, _real: Any = real, _c: str = counter, **k: Any) -> Any:
                self.counts[_c] += 1
                return _real(*a, **k)

            setattr(owner, name, counted)
        return self.counts

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()


def _launch(launcher: Any, inputs: dict[str, Any], index: int | None) -> Any:
    """One launch; an autotune candidate key is launched as that candidate (every candidate is warmed)."""
    if index is None:
        return launcher(**inputs)
    with warmreg.use_config(index):
        return launcher(**inputs)


def run_config(config: str, pack: str | None) -> dict[str, Any]:
    from warmreg.runtime.launch import FAST_TABLES

    t = time.perf_counter()
    report = warmreg.warm(config, pack=pack, on_error="continue", monitor="record")
    warm_wall = time.perf_counter() - t
    mon = current()
    assert mon is not None
    plan = warmreg.plan(config)
    device = torch.device("cuda")
    kernels: dict[str, Any] = {}
    for kp in plan.kernels:
        row: dict[str, Any] = {"keys": len(kp.keys), "launched": 0, "failures": [], "first_ms": [], "steady_ms": [],
                               "fast_entries": len(FAST_TABLES.get(kp.name, {}))}  # fmt: skip
        launcher = getattr(kp.kernel, kp.kernel.launcher)
        _RUNS[0] = 0
        JITFunction.run = _counting_run  # type: ignore[method-assign]
        for key in kp.keys:
            try:
                inputs = {k: materialize(v, device) for k, v in kp.kernel.warmup_inputs(key).items()}
                index = getattr(key, "config", None) if kp.kernel.tune_configs else None
                launch = functools.partial(_launch, launcher, inputs, index)
                with _Work() as work:
                    row["first_ms"].append(_timed(launch))
                for name, count in work.items():
                    row["first_" + name] = row.get("first_" + name, 0) + count
                row["steady_ms"].append(median([_timed(launch) for _ in range(20)]))
                row["launched"] += 1
            except Exception as exc:  # reported per key; the sweep goes on
                row["failures"].append(f"{key}: {type(exc).__name__}: {exc}"[:600])
                traceback.print_exc(limit=3)
        JITFunction.run = _REAL_RUN  # type: ignore[method-assign]
        row["triton_run_calls"] = _RUNS[0]
        row["median_first_ms"] = median(row["first_ms"])
        row["median_steady_ms"] = median(row["steady_ms"])
        kernels[kp.name] = row
    misses = [m.explain() for m in mon.misses]
    warmreg.disarm()
    return {
        "config": config,
        "pack": pack,
        "warm_wall_s": warm_wall,
        "warm_summary": report.summary(),
        "warm_failed": [(r.kernel, str(r.key), r.error) for r in report.failed],
        "load_seconds_total": sum(r.load_seconds for r in report.results),
        "kernels": kernels,
        "misses": misses,
        "counters": mon.counters(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--pack", action="append", default=[], help="CONFIG=PACK: warm that config from a pack")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    packs = dict(p.split("=", 1) for p in args.pack)
    results = [run_config(c, packs.get(c)) for c in args.configs]
    for r in results:
        launched = sum(k["launched"] for k in r["kernels"].values())
        failures = sum(len(k["failures"]) for k in r["kernels"].values())
        slow = sum(k["triton_run_calls"] for k in r["kernels"].values())
        first = {c: sum(k.get("first_" + c, 0) for k in r["kernels"].values()) for c in ("compiles", "module_loads", "triton_run", "triton_launcher")}
        r["first_launch_work"] = first
        print(f"{r['config']}: {r['warm_summary']}; {launched} keys launched, {failures} launch failures, "
              f"{len(r['misses'])} misses, {slow} launches through JITFunction.run; first launches did {first}")  # fmt: skip
    print("->", write(f"gpu_all_keys_{args.tag}", {"configs": results}))


if __name__ == "__main__":
    main()
