"""Compiling a warm's cache misses in forked processes: the stage :class:`Processes`.

Triton's frontend (the AST walk that generates each kernel's IR) is Python and holds the GIL, so a
compile pool of threads runs it one key at a time: a cold DeepSeek-V4-Flash warm on 16 threads took
2.3-4.9 s on H200 hosts, 1.2-2.6 s with this stage (Triton 3.6.0 and 3.8.0, the README's Results).
This stage forks up to ``workers`` children right before the compile step;
each one compiles keys missing from Triton's disk cache into it, side by side on every core. As a child
reports a key, this process compiles it from the cache (a hit: :attr:`~warmreg.pipeline.stage.Stage.finish`),
loads it and prepares its fast launch while the other keys still compile, so Triton's hooks, warmreg's
listener and the loads see every key as before, and the key reports ``compiled``.

The children fork one another (:mod:`warmreg.stages.fork_pool`: the warm forks one, which forks
half of the rest, and so on; 16 children are born in 5 generations of forks instead of 16 forks in a
row), and each takes keys, longest source first, as soon as its share is forked. A child is a fork
of the warming process (nothing but a key's index is handed to it, and nothing imported again),
swaps Triton's driver for the stand-in of its target so that it never touches the GPU
(CUDA cannot be used in a child forked after it started), and writes only through Triton's own
cache manager (atomic renames): a child that fails or is killed leaves the cache as consistent as an
interrupted compile would, and a key a child did not compile is compiled by the compile step here,
which reports its error. On Triton 3.6, for the local CUDA GPU, each child also builds the C
launchers of the kernels it compiled (one child per distinct launcher), which the warm's loads
would otherwise build after the compile. Linux only, CUDA and ROCm targets, and only when at least
:data:`MIN_MISSES` keys miss (a fork is not worth it for a handful), with as many children as the
fork budget pays for (:data:`FORK_BUDGET_S`: a fork's cost grows with the resident memory), and with
the cores shared among the ranks of a job on this host (``LOCAL_WORLD_SIZE``).

An interrupt (SIGINT) is the warm's alone: the children are born with SIGINT blocked and then ignore
it, and so do the compilers they run (a blocked signal stays blocked across ``exec``; an ignored one
would not be enough, as LLVM in the child installs handlers of its own, which ``exec`` resets to the
default), so a Ctrl-C sent to the whole process group kills no ptxas half way (Triton would print its
PTX with "please share the reproducer"). The warm, on its KeyboardInterrupt, ends the children at once
(SIGTERM, without waiting for their keys) and raises on. A SIGINT that arrives while the warm forks is
held and delivered once it has (see :func:`_interrupts_deferred`); the children fork theirs with it
blocked and ignored.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton import launchers as _triton_launchers
from ..pipeline.stage import Stage
from .fork_pool import ForkPool

if TYPE_CHECKING:
    from ..pipeline.bind import Task
    from ..pipeline.planning import Plan

__all__ = ["ENABLED", "FORK_BASE_MS", "FORK_BUDGET_S", "FORK_MS_PER_GIB", "MIN_MISSES", "TREE", "Processes"]

log = logging.getLogger("warmreg.pipeline.compile")

#: Whether warms and pack builds compile their misses in forked processes (``False``: threads only,
#: as the benchmarks compare).
ENABLED = True
#: Fewer misses than this compile on threads.
MIN_MISSES = 4
#: The children fork one another (:mod:`warmreg.stages.fork_pool`); ``False``: the warm forks each (for comparisons).
TREE = True
#: A fork copies the page tables of what the warming process has resident: about 2 ms per GiB with
#: 4 KiB pages (the CPU machine: 8 GiB resident, 15-19 ms a fork), after a few ms for any process
#: (:data:`FORK_BASE_MS`; the H200 host with CUDA up, 0.66 GiB resident: 7 ms a fork).
#: A warm forks only as many children as are born within :data:`FORK_BUDGET_S` of forks made one after
#: another (in the tree, one generation a fork: an engine that keeps large host buffers, such as pinned
#: swap space, forks fewer children, or none and compiles on threads).
FORK_BASE_MS = 5.0
FORK_MS_PER_GIB = 2.2
FORK_BUDGET_S = 0.25


class Processes(Stage):
    """The stage that compiles the keys missing from Triton's disk cache in forked children.

    :ivar compiled: keys a child compiled; ``processes`` the children forked (0: none were needed), ``started``
        those that had begun when the last key came back (one that cannot start leaves its share to the others;
        the stage does not wait for the children's exits once every key is back: a thread reaps them).
    :ivar seconds: wall time of the forked compile.
    :ivar timeline: where that time went, in seconds from its start (:meth:`section`).
    :ivar on_finished: called with each key once :attr:`~warmreg.pipeline.stage.Stage.finish` has finished it here
        (loaded, with its fast launch): a later stage's part of the key, taken early (the rehearsal; set by
        :func:`warmreg.stages.compose.for_warm`).
    """

    name = "processes"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.compiled = 0
        self.processes = 0
        self.on_finished: Callable[[Task], None] | None = None
        self.started = 0
        self.seconds = 0.0
        self.timeline: dict[str, float] = {}
        self._spans: list[tuple[float, float]] = []  # each key's (start, end) in a child, perf_counter

    @classmethod
    def for_plan(cls, plan: Plan, workers: int) -> Processes | None:
        """The stage, where it can run: Linux, a CUDA or ROCm target, more than one worker."""
        ok = (
            ENABLED
            and workers > 1
            and sys.platform.startswith("linux")
            and (plan.platform.is_cuda or plan.platform.is_rocm)
        )
        return cls(workers) if ok else None

    def section(self) -> dict[str, Any]:
        """The children forked (0: none were needed) and started, the keys they compiled, the wall time and its
        timeline: ``forked`` (when the last child began: they fork one another), ``first_key`` and
        ``last_key_start`` (when a child began its first and its last key), ``last_key_end``, and ``busy`` (the
        children's compile seconds summed, against ``seconds`` x ``processes``)."""
        return {"processes": self.processes, "started": self.started, "compiled": self.compiled, "seconds": self.seconds, "timeline": self.timeline}

    def first(self, plan: Plan, tasks: list[Task]) -> list[Task]:
        """Compile the misses among the tasks to compile first (after a distributed warm picked this
        rank's share); returns them unchanged, for the compile step."""
        platform = plan.platform
        missed = []
        for t in tasks:
            if t.launch is not None:
                t.in_cache = _triton_cache.in_disk_cache(t.launch[0], t.specialization_data, platform)
                if not t.in_cache:
                    missed.append((t, t.launch[0]))
        sizes = {jit: _source_size(jit) for jit in {jit for _, jit in missed}}  # once a kernel: its keys share it
        misses = [t for t, _ in sorted(missed, key=lambda m: sizes[m[1]], reverse=True)]  # the longest compiles first
        affordable = _affordable_forks() if len(misses) >= MIN_MISSES else 0
        share = self.workers // _ranks_on_this_host()  # the ranks of a job on one host all warm at once
        if affordable >= 2 and share >= 2:
            start = time.perf_counter()
            self.processes = min(share, len(misses), affordable)
            try:
                self._fork(misses, plan, start)
            except Exception as exc:  # e.g. no process could be forked: the compile step compiles the rest
                log.warning(
                    "compiling in processes failed (%s: %s); the rest compiles on threads", type(exc).__name__, exc
                )
            self.seconds = time.perf_counter() - start
            if self._spans:  # perf_counter is CLOCK_MONOTONIC: one clock for the children and this process
                starts, ends = [a for a, _ in self._spans], [b for _, b in self._spans]
                self.timeline.update(
                    first_key=min(starts) - start, last_key_start=max(starts) - start, last_key_end=max(ends) - start,
                    busy=sum(b - a for a, b in self._spans),
                )  # fmt: skip
        return tasks

    def _fork(self, misses: list[Task], plan: Plan, start: float) -> None:
        global _CLAIMS
        with _lock:
            _LAUNCHES[:] = [t.launch for t in misses]
            _CLAIMS = _Claims() if plan.platform.is_cuda and plan.platform.local else None
            pool = ForkPool(self.processes, len(misses), functools.partial(_child_init, plan.platform), _child_compile, tree=TREE)
            collected = False  # every key came back, and none failed
            try:
                with _interrupts_deferred(), warnings.catch_warnings():
                    # Python 3.12+ warns about forking a process that runs threads
                    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
                    pool.start()
                collected = self._collect(pool, misses)
            except BaseException:  # an interrupt: no child compiles on
                pool.terminate()
                raise
            finally:
                # every key back and compiled: the children's exits are not the warm's to wait for. A key that failed
                # is compiled again, and what its child's failed write left is removed then, only once that child is
                # gone (remove_unfinished spares a live process's temporary directories)
                pool.close(wait=not collected)
                _LAUNCHES.clear()
                _CLAIMS = None
            self.started = len(pool.born)
            if pool.born:
                self.timeline["forked"] = max(pool.born) - start
            for error in dict.fromkeys(pool.init_errors):
                log.warning("a compile process could not start (%s); its share compiles in the others", error)

    def _collect(self, pool: ForkPool, misses: list[Task]) -> bool:
        """Take in each key a child compiled, as the children finish them; whether every key came back compiled."""
        finished = failed = 0
        for index, error, began, seconds in pool.results():
            task = misses[index]
            finished += 1
            task.seconds += seconds
            self._spans.append((began, began + seconds))
            if error is not None:  # the compile step compiles it again, and reports the error
                failed += 1
                log.debug("a compile process could not compile %s %s: %s", task.kp.name, task.key, error)
                continue
            task.precompiled = True
            self.compiled += 1
            if self.finish is not None:  # this process's part of the key (its hit, load, fast launch) now
                self.finish(task)
                if self.on_finished is not None:
                    self.on_finished(task)
            elif self.progress is not None:
                self.progress(task)
        if finished < len(misses):
            log.warning(
                "compiling in processes left %d of %d keys (a compile process died); the rest compiles on threads",
                len(misses) - finished, len(misses),
            )  # fmt: skip
        return finished == len(misses) and not failed


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT while the block forks the children, then hand it to the handler that was there.

    CPython prints and drops an exception raised in an at-fork hook ("Exception ignored in ..."): the
    KeyboardInterrupt of a SIGINT that arrived while such a hook ran was lost, and the warm ran on. In
    the block a Python handler of SIGINT (only the main thread runs them) is replaced by one that notes
    the signal, which the previous handler gets as the block ends, even if the block raised; and the
    forking thread blocks SIGINT, so that every child starts with it blocked.
    """
    noted: list[int] = []
    handler = signal.getsignal(signal.SIGINT)
    previous = handler if callable(handler) and threading.current_thread() is threading.main_thread() else None
    if previous is not None:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        try:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if noted and previous is not None:  # called, not raised again: a wakeup fd (asyncio's) had its byte
            previous(signal.SIGINT, None)


def _affordable_forks() -> int:
    """How many children the fork budget pays for, by this process's resident memory: the forks made one
    after another until the last child is born. Forking each (``TREE`` off), one a child; in the tree, the
    warm forks one and each generation doubles the children, so ``k`` forks in a row bear ``2 ** (k - 1)``."""
    resident = _resident_gib()
    per_fork_s = (FORK_BASE_MS + FORK_MS_PER_GIB * resident) / 1000
    in_a_row = int(FORK_BUDGET_S // per_fork_s)
    affordable = 1 << min(in_a_row - 1, 16) if TREE and in_a_row else in_a_row
    if affordable < 2:
        log.info("compiling on threads: forking with %.0f GiB resident costs about %.0f ms a child", resident, per_fork_s * 1000)
    return affordable


def _ranks_on_this_host() -> int:
    """The processes of a job on this host that warm at the same time: ``LOCAL_WORLD_SIZE`` (set by
    torchrun and most launchers; 1 without it), so that they share the cores rather than each
    forking as many children as there are CPUs."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _resident_gib() -> float:
    """This process's resident memory (``/proc/self/statm``), in GiB."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


_lock = threading.Lock()
#: The launches of the forked compile running now, which its children inherit (one at a time).
_LAUNCHES: list[Any] = []


class _Claims:
    """The C launchers the children of one forked compile claimed (Triton 3.6, local CUDA GPU), so
    that a launcher several keys share is built once: their cache keys (64 hex digits each) in an
    anonymous shared mapping under a lock, both inherited through the fork (nothing on disk)."""

    SLOTS = 1024  # launchers (the Flash example has 25); past them a child builds unclaimed

    def __init__(self) -> None:
        self.lock = multiprocessing.get_context("fork").Lock()
        self.memory = mmap.mmap(-1, 4 + 64 * self.SLOTS)  # a count, then the keys

    def claim(self, key: str) -> bool:
        """Whether the calling child is the first to claim launcher ``key``."""
        entry = key.encode().ljust(64, b"\0")[:64]
        with self.lock:
            count = int.from_bytes(self.memory[:4], "little")
            if any(self.memory[4 + 64 * i : 4 + 64 * (i + 1)] == entry for i in range(count)):
                return False
            if count < self.SLOTS:
                self.memory[4 + 64 * count : 4 + 64 * (count + 1)] = entry
                self.memory[:4] = (count + 1).to_bytes(4, "little")
            return True


#: Where the children of the forked compile running now claim the launchers they build (else ``None``).
_CLAIMS: _Claims | None = None


def _source_size(jit: Any) -> int:
    """What the children hand out first: a kernel's source length with that of the ``@triton.jit`` functions its
    source names, a stand-in for its compile time (the children take keys in order, so a long compile handed out
    last would finish after every other; the Kimi-K3 full example's slowest key, ``kda_chunk_intra``, has the longest
    source by twice and compiled in 4-5 s of an 8.3 s cold warm started 65th of 86 (H100, Triton 3.6.0))."""
    src = getattr(jit, "src", "")
    names = getattr(getattr(jit, "fn", None), "__globals__", {})
    called = (v for k, v in names.items() if k in src and v is not jit and isinstance(getattr(v, "src", None), str))
    return len(src) + sum(len(v.src) for v in called)


def _child_init(platform: Any) -> None:
    """A child blocks and ignores interrupts, as do the compilers it runs (the warm ends the children), ends on
    SIGTERM without the handler an engine may have installed, and only compiles (it dies with the process that
    forked it: :mod:`warmreg.stages.fork_pool`)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (born so, when forked by Processes._fork)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _triton.compile_worker(platform)


def _child_compile(index: int) -> tuple[str | None, float, float]:
    """In a child: compile launch ``index`` into Triton's disk cache; ``(error or None, start, seconds)``
    (``start``: ``time.perf_counter()`` here, the same clock as the warm's)."""
    jit, grid, kwargs, options = _LAUNCHES[index]
    start = time.perf_counter()
    try:
        compiled = _triton.retrying_ast_race(_triton.warmup, jit, grid, kwargs, options)
    except Exception as exc:
        from ..pipeline.bind import describe  # (bind imports torch, which the CLI's refusals never import)

        return describe(exc), start, time.perf_counter() - start
    if _CLAIMS is not None:
        try:
            _triton_launchers.prebuild(compiled, _CLAIMS.claim)
        except Exception as exc:  # the warm's load builds it again, and reports a failure
            log.debug("a compile process could not build the launcher of %s: %s", _triton.full_name(jit), exc)
    return None, start, time.perf_counter() - start
