"""Stable GPU timing for small kernels: interleaved rounds, CUDA-graph replay, medians with their spread.

A single ``do_bench`` figure of a 10-60 µs kernel moved by up to 2x between two runs on the H200 (it
flushes L2 before every rep and times each call with its own events, so host jitter and the flush
land in the figure). Here:

- the candidates of one comparison (e.g. a kernel and its reference) run in **interleaved rounds**
  (A, B, A, B, ...), so a drift of the machine's speed hits both alike;
- every candidate that can be captured is captured **in a CUDA graph** of ``n`` back-to-back calls
  (``n`` such that a replay lasts about ``target_ms``, from the replay time of a one-call graph),
  and a round times one replay with CUDA events, divided by ``n``: the GPU time of a call, with no
  host launch cost and no per-call event overhead (the kernels under ~50 µs are the ones where the
  host cost would otherwise dominate); a candidate that cannot be captured (a host sync inside, as
  in references that loop in Python) is timed as ``n`` back-to-back calls between two events, a
  host-bound figure, and says so (``method``);
- each candidate's figure is the **median over rounds**, reported with p10, p90, min, max and the
  relative spread ``(p90 - p10) / median``.

L2 is not flushed: a serving step calls these kernels back to back on warm caches, which is what a
graph replay measures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["interleaved"]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    i = (len(s) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def _estimate_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """Milliseconds per call of ``fn`` (a graph's ``replay``, or the callable itself), median of ``calls``."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph(fn: Callable[[], Any], n: int) -> torch.cuda.CUDAGraph | None:
    """``n`` calls of ``fn`` captured in one CUDA graph, or ``None`` if ``fn`` cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):  # warm up on the side stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph
    except Exception:  # a host sync (.item(), .tolist()) or an allocation pattern capture refuses
        torch.cuda.synchronize()
        return None


class _Candidate:
    def __init__(self, fn: Callable[[], Any], target_ms: float) -> None:
        one = _graph(fn, 1)
        est = _estimate_ms(one.replay if one is not None else fn)
        self.n = max(1, min(1000, int(target_ms / max(est, 1e-4))))
        self.graph = _graph(fn, self.n) if one is not None else None
        self.fn = fn
        self.graphed = self.graph is not None
        self.method = f"CUDA graph of {self.n} calls, replayed" if self.graphed else f"{self.n} back-to-back calls between events (host-bound)"
        self.times: list[float] = []

    def round(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.n):
                self.fn()
        end.record()
        torch.cuda.synchronize()
        self.times.append(start.elapsed_time(end) / self.n)

    def summary(self) -> dict[str, Any]:
        med = statistics.median(self.times)
        p10, p90 = _quantile(self.times, 0.1), _quantile(self.times, 0.9)
        return {
            "median_ms": med, "p10_ms": p10, "p90_ms": p90, "min_ms": min(self.times), "max_ms": max(self.times),
            "spread": (p90 - p10) / med if med else float("nan"), "rounds": len(self.times), "calls_per_round": self.n,
            "method": self.method, "graphed": self.graphed, "raw_ms": self.times,
        }  # fmt: skip


def interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int = 21, target_ms: float = 2.0) -> dict[str, dict[str, Any]]:
    """Time each candidate in ``rounds`` interleaved rounds; returns its summary (see the module).

    :param fns: candidates by name, each an already warmed zero-argument callable.
    :param target_ms: about how long one round of each candidate lasts.
    """
    candidates = {name: _Candidate(fn, target_ms) for name, fn in fns.items()}
    for _ in range(rounds):
        for c in candidates.values():
            c.round()
    for c in candidates.values():
        c.graph = None  # free the graphs' memory pools before the next comparison
    return {name: c.summary() for name, c in candidates.items()}
