"""Forked workers that fork one another: the pool of the forked compile (:mod:`warmreg.stages.processes`).

A fork copies the forking process's page tables: about 7 ms on the H100 host with CUDA up. A
``ProcessPoolExecutor`` on the fork context forks every worker from the warm, one after another, before
any takes work, so 16 workers cost the warm about 0.11 s before its first compile started. Here the warm
forks one worker; a worker handed the range of workers ``[lo, hi)`` forks a worker for its upper half
and keeps the lower one, until it is one worker, then takes work. 16 workers are born in 5 generations of
forks, each on its own process, and each takes work as soon as its share is forked.

Work is the indices ``0 .. count - 1``, taken in order from a counter in shared memory (so the first
index handed out is the first taken); each result comes back on one pipe as one write of at most
``PIPE_BUF`` bytes (atomic: the workers' messages never interleave). The pipe's end of file says every
worker is gone; once every index's result is in, the warm need not wait for it (:meth:`ForkPool.close` with
``wait=False``: a thread reads to it and reaps the workers). A worker dies with the process that forked it
(``PR_SET_PDEATHSIG``): the warm's workers with the warm (SIGKILL, as before), a worker's workers with it (SIGTERM, so that a compiler's
handler removes its temporary files). :meth:`ForkPool.terminate` sends SIGTERM to every worker that
reported its pid; one that had not yet dies with its forker.

The workers write their temporary files (Triton's ``.ptx`` and ptxas log, a launcher's build) into a directory of
the pool's own under the system's (``warmreg-fork-<host hash>-<pid>-*``, as ``tempfile.tempdir`` and ``TMPDIR``):
Triton removes those files only once ptxas returns, so a worker killed with the warm (SIGKILL) left them in the
system's temporary directory. The pool removes its directory once every worker is gone, and then those of warms on
this host that died.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing
import os
import select
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from .._triton import cache as _triton_cache

__all__ = ["ForkPool", "Result", "remove_temporaries"]

#: A result: (index, error or None, start, seconds), ``start`` on the workers' and the warm's one clock.
Result = tuple[int, str | None, float, float]

_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("<iIdd")  # index (or a worker's birth, its pid in the length field), error length, start, seconds
_BIRTH, _INIT_FAILED = -1, -2
_ATOMIC = getattr(select, "PIPE_BUF", 4096)
_TEMP = f"warmreg-fork-{_triton_cache.HOST}-"  # then the warm's pid, "-" and mkdtemp's random part


class ForkPool:
    """``workers`` forked processes running ``work(index)`` for every index below ``count``.

    :param init: run first in every worker (signals, the compile driver); an exception in it ends that
        worker, whose share of the work the others take.
    :param work: ``index -> (error or None, start, seconds)``; an exception is reported as the error.
    :param tree: the workers fork one another; ``False``: this process forks each (for comparisons).
    """

    def __init__(
        self, workers: int, count: int, init: Callable[[], None], work: Callable[[int], tuple[str | None, float, float]],
        *, tree: bool = True,
    ) -> None:  # fmt: skip
        self.workers, self.count, self.init, self.work, self.tree = workers, count, init, work, tree
        self.pids: set[int] = set()  # every worker that reported its birth, and the first
        self.born: list[float] = []  # when each worker began (``time.perf_counter()``)
        self.init_errors: list[str] = []  # a worker whose ``init`` raised: what it raised
        self._lock = multiprocessing.get_context("fork").Lock()
        self._next = mmap.mmap(-1, 4)  # the next index to take
        self._read = self._write = -1
        self._root = self._warm = 0
        self._firsts: list[int] = []  # without the tree: the other workers this process forked
        self._buffer = b""  # what was read of the pipe and not yet parsed
        self._complete = False  # every index's result came back
        self.temp: str | None = None  # the workers' temporary directory, while they may write there

    def start(self) -> None:
        """Fork the first worker, which forks the others (call with SIGINT blocked: they are born so)."""
        self._read, self._write = os.pipe()
        self._warm = os.getpid()
        with contextlib.suppress(OSError):  # (none: the workers write where this process would)
            self.temp = tempfile.mkdtemp(prefix=f"{_TEMP}{self._warm}-")
        try:
            self._root = self._spawn(0, self.workers if self.tree else 1)
            self.pids.add(self._root)
            for i in range(1, 1 if self.tree else self.workers):
                self._firsts.append(self._spawn(i, i + 1))
                self.pids.add(self._firsts[-1])
        finally:
            os.close(self._write)  # this process never writes: end of file once every worker is gone

    def results(self) -> Iterator[Result]:
        """Each result as a worker sends it, until every index has its result or every worker is gone."""
        received = 0
        for result in self._messages(self._read):
            yield result
            received += 1
            if received == self.count:
                self._complete = True
                return

    def _messages(self, read: int, *, more: bool = True) -> Iterator[Result]:
        """The results on the pipe ``read`` until its end of file (``more=False``: only those already read); births
        and failed starts are noted on the way."""
        while True:  # what an earlier reader left in the buffer first, then what comes
            while len(self._buffer) >= _HEADER.size:
                index, length, start, seconds = _HEADER.unpack_from(self._buffer)
                size = _HEADER.size + (0 if index == _BIRTH else length)  # a birth's length is its pid
                if len(self._buffer) < size:
                    break
                message, self._buffer = self._buffer[:size], self._buffer[size:]
                if index == _BIRTH:
                    self.pids.add(length)
                    self.born.append(start)
                elif index == _INIT_FAILED:
                    self.init_errors.append(message[_HEADER.size :].decode("utf-8", "replace"))
                else:
                    yield index, message[_HEADER.size :].decode("utf-8", "replace") if length else None, start, seconds
            if not more or not (chunk := os.read(read, 1 << 16)):
                return
            self._buffer += chunk

    def terminate(self) -> None:
        """SIGTERM to every worker now (their default action, or a compiler's handler, which cleans up and dies)."""
        for pid in self.pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    def close(self, *, wait: bool = True) -> None:
        """Wait for every worker to be gone (the pipe's end of file), reap the first, close the pipe.

        :param wait: ``False``, once :meth:`results` gave every index's result: return at once and leave that
            to a thread. The workers have nothing left to do but exit, and the exits (each worker waits for the
            workers it forked) took 9 / 18 / 34 ms after the last result with 2 / 4 / 8 workers on the 2-core
            machine: time a warm need not wait. A worker born after the last result only exits.
        """
        if self._read < 0:
            return
        if not wait and self._complete:
            self._read, read = -1, self._read
            for _ in self._messages(read, more=False):  # the births read with the last result
                continue
            self._remove_temp()  # (no worker compiles again)
            threading.Thread(target=self._reap, args=(read,), name="warmreg-fork-pool-reap", daemon=True).start()
            return
        read, self._read = self._read, -1
        self._reap(read)

    def _reap(self, read: int) -> None:
        """Read the pipe to its end of file (births still noted; results a terminated pool still sent dropped),
        close it, and reap the workers this process forked."""
        try:
            for _ in self._messages(read):
                continue
        finally:
            os.close(read)
            for pid in [self._root, *self._firsts] if self._root else []:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            self._remove_temp()  # with what a worker's compiler left on SIGTERM

    def _remove_temp(self) -> None:
        temp, self.temp = self.temp, None
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
            remove_temporaries()  # (here, not on a thread a process that ends may not wait for)

    # -- in the workers ------------------------------------------------------------------------------

    def _spawn(self, lo: int, hi: int) -> int:
        """Fork the worker of ``[lo, hi)``; its pid (in the worker: never returns)."""
        forker = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            code = self._live(lo, hi, forker)
        finally:
            os._exit(code)

    def _live(self, lo: int, hi: int, forker: int) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL if forker == self._warm else signal.SIGTERM)
        if os.getppid() != forker:  # the forker died before the line above
            return 1
        if self._read >= 0:  # (a worker's workers inherit it closed)
            os.close(self._read)
            self._read = -1
        if self.temp:
            tempfile.tempdir = os.environ["TMPDIR"] = self.temp  # (and the compilers it runs)
        self._send(_HEADER.pack(_BIRTH, os.getpid(), time.perf_counter(), 0.0))
        try:
            self.init()
        except Exception as exc:  # this worker forks and takes nothing: the others take its share
            self._report(_INIT_FAILED, f"{type(exc).__name__}: {exc}", 0.0, 0.0)
            return 1
        kids = []
        while hi - lo > 1:  # fork the upper half of the range, keep the lower
            mid = (lo + hi + 1) // 2
            try:
                kids.append(self._spawn(mid, hi))
            except OSError:  # no more processes: this worker works with fewer
                break
            hi = mid
        while (index := self._take()) is not None:
            try:
                error, start, seconds = self.work(index)
            except Exception as exc:
                error, start, seconds = f"{type(exc).__name__}: {exc}", time.perf_counter(), 0.0
            self._report(index, error, start, seconds)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        return 0

    def _take(self) -> int | None:
        with self._lock:
            index = int.from_bytes(self._next[:4], "little")
            if index >= self.count:
                return None
            self._next[:4] = (index + 1).to_bytes(4, "little")
        return index

    def _report(self, index: int, error: str | None, start: float, seconds: float) -> None:
        text = (error or "").encode("utf-8", "replace")[: _ATOMIC - _HEADER.size] or (b"?" if error is not None else b"")
        self._send(_HEADER.pack(index, len(text), start, seconds) + text)

    def _send(self, message: bytes) -> None:
        os.write(self._write, message)  # at most PIPE_BUF bytes: one atomic write


def remove_temporaries() -> int:
    """Remove the workers' temporary directories that pools of warms on this host that died (SIGKILL) left in the
    system's temporary directory; those of live processes stay. Returns how many were removed."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            pid = entry.name.removeprefix(_TEMP).partition("-")[0]
            if entry.name.startswith(_TEMP) and pid.isdigit() and not _triton_cache.alive(int(pid)) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed
