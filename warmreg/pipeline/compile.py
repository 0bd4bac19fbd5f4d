"""Compiling bound keys: in parallel on a bounded pool, each key isolated, each timed; then loading.

Each bound key's captured launch (:mod:`warmreg.pipeline.bind`) becomes ``JITFunction.warmup``, whose compiles run
on a thread pool through Triton's async compile mode; a key in Triton's disk cache loads from there directly, bound
and hashed once (inline: when every key is, on the calling thread, :data:`INLINE_HITS`). Triton's compilation listener
says whether each binary came from its disk cache. On the local GPU each binary is loaded (launcher built, module
loaded) on a pool as soon as it is compiled, while the next key compiles (a hit: right after it, inline), and each
key's guarded fast launch is prepared (all through the adapter, :mod:`warmreg._triton`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton.hits import load_hit
from ..runtime.launch import FAST_LAUNCH, IN_WARMUP, remember_fast_launch
from ..support.threads import quiet_pool
from ..values.platform import Platform
from .bind import OnError, Status, Task, cancel_rest, describe

__all__ = ["INLINE_HITS", "compile_scope", "compile_tasks", "finishing", "prepare_fast_launches", "remove_failed"]

log = logging.getLogger("warmreg.pipeline.compile")
_tls = threading.local()
#: Compile on the calling thread when every key is already in Triton's disk cache (a warm cache, an
#: installed pack): a hit is Python under the GIL, so a pool only adds threads contending for it (each
#: module loads right after its hit). ``False`` sends hits to the pool too (benchmarks compare both).
INLINE_HITS = True

def _compile(task: Task, platform: Platform) -> None:
    """The second phase for one key: ``JITFunction.warmup`` of its captured launch (submitted to the pool under
    the async compile mode, inline otherwise); a key found in the disk cache loads from there (``load_hit``)."""
    if task.launch is None:
        return
    jit, grid, kwargs, options = task.launch
    task.launch = None
    _tls.task = task  # the compile listener reads it (launch code, and so capture, ran in phase one)
    start = time.perf_counter()
    try:
        hit = task.status is Status.PENDING and task.in_cache  # bound and hashed once: not again
        direct = load_hit(jit, task.triton_key, task.specialization_data, platform) if hit else None
        task.compiled = direct if direct is not None else _triton.retrying_ast_race(_triton.warmup, jit, grid, kwargs, options)
    except Exception as exc:
        task.fail(describe(exc))
    finally:
        _tls.task = None
        task.seconds += time.perf_counter() - start


class _TimedExecutor(Executor):
    """Wraps a pool so each compile knows its task (for the listener) and is timed in its worker."""

    def __init__(self, inner: Executor, on_done: Callable[[Task], None] | None, load_device: int | None = None) -> None:
        self.inner, self.on_done, self.load_device = inner, on_done, load_device  # local GPU: load once compiled

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        task = _tls.task
        context = contextvars.copy_context()  # the compile keeps the warm's scope (IN_WARMUP)

        def run() -> Any:
            _tls.task = task
            start, compiled = time.perf_counter(), None
            try:
                compiled = _triton.retrying_ast_race(fn, *args, **kwargs)
                return compiled
            except BaseException as exc:
                if task is not None:
                    task.fail(describe(exc))
                raise
            finally:
                if task is not None:
                    task.seconds += time.perf_counter() - start
                    if compiled is not None and self.load_device is not None:
                        _load(task, compiled, self.load_device)  # overlaps launcher builds with other compiles
                    if self.on_done is not None:
                        self.on_done(task)
                _tls.task = None

        return self.inner.submit(context.run, run)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def _on_compiled(cache_hit: bool, metadata: Any) -> None:
    """Triton produced (or found in its disk cache) the binary of the task compiling on this thread."""
    if (task := getattr(_tls, "task", None)) is not None:
        task.to(Status.DISK_CACHE if cache_hit and not task.precompiled else Status.COMPILED)  # (precompiled: for this warm)
        task.binary_hash = metadata.get("hash") if isinstance(metadata, dict) else None


@contextmanager
def compile_scope(platform: Platform) -> Iterator[None]:
    """The scope of a warm's binding and compiling: warmreg's own compiles (``IN_WARMUP``), Triton's compilation
    listener, per-kernel objects Triton shares (``shared_kernel_objects``), for a cross target its stand-in driver, the environment read once."""
    token = IN_WARMUP.set(True)
    try:
        with _triton.compile_listener(_on_compiled), _triton.shared_kernel_objects(), _triton.cross_target(platform), _triton_cache.fixed_env():
            yield
    finally:
        IN_WARMUP.reset(token)


def compile_tasks(
    tasks: list[Task], *, platform: Platform, workers: int, on_error: OnError, on_done: Callable[[Task], None] | None = None
) -> None:
    """Compile every bound task not done yet (inside :func:`compile_scope`); one failure never
    stops the others unless ``on_error="stop"``. ``on_done`` is called once per task it finishes.
    On the local GPU every binary is loaded too (launcher built, module loaded), not at its first launch."""
    todo = [t for t in tasks if not t.done]
    if not todo:
        return
    _triton_cache.wait_triton_key()
    for t in todo:  # found in the cache by a stage, or put there for this warm by a compile process: not looked up again
        t.in_cache = t.in_cache or t.precompiled or _triton_cache.in_disk_cache(t.launch[0], t.specialization_data, platform)  # type: ignore[index]
    hits = INLINE_HITS and all(t.in_cache for t in todo)
    with _loading(platform, workers, hits) as load:
        if workers <= 1 or hits:
            _run_serial(todo, platform, on_error, on_done, load)
        else:
            pool = quiet_pool(workers, "warmreg-compile")  # a Ctrl-C to the process group stops the warm, not ptxas
            try:  # each key loads on the pool as soon as it compiles
                _run_async(todo, platform, _TimedExecutor(pool, on_done, _triton.current_device() if platform.local else None), on_error, on_done)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            for task in todo:  # and the hits Triton's async mode found inline
                load(task)


@contextmanager
def finishing(platform: Platform, workers: int, on_done: Callable[[Task], None] | None = None) -> Iterator[Callable[[Task], None]]:
    """``finish(task)``: the compile step of one key a stage has just put in Triton's disk cache, while it still works
    (a hit; loaded with its fast launch on the local GPU). A load that builds a C launcher waits for the end."""
    with _loading(platform, workers, True) as load:
        def finish(task: Task) -> None:
            task.in_cache = True
            _run_serial([task], platform, "continue", on_done, load)
            if getattr(task.compiled, "module", None) is not None:  # loaded here
                prepare_fast_launches([task])

        yield finish


def remove_failed(tasks: list[Task], platform: Platform) -> None:
    """A failed key leaves no files in the cache."""
    for task in tasks:
        if task.status == "failed" and task.captured is not None and task.specialization_data is not None:
            _triton_cache.remove_unfinished(task.captured[0], task.specialization_data, platform)


def _run_serial(
    tasks: list[Task], platform: Platform, on_error: OnError, on_done: Callable[[Task], None] | None, load: Callable[[Task], None]
) -> None:
    for task in tasks:
        _compile(task, platform)
        if task.status == "pending":
            task.to(Status.COMPILED)
        load(task)
        if on_done is not None:
            on_done(task)
        if task.status == "failed" and on_error == "stop":
            cancel_rest(tasks, task)
            return


def _run_async(tasks: list[Task], platform: Platform, executor: Executor, on_error: OnError, on_done: Callable[[Task], None] | None) -> None:
    with _triton.async_compile(executor):
        for task in tasks:
            _compile(task, platform)
            if on_done is not None and task.status in ("memory", "failed"):  # nothing was submitted
                on_done(task)
            if task.status == "failed" and on_error == "stop":
                cancel_rest(tasks, task)
                break
    for task in tasks:
        if hasattr(compiled := task.compiled, "result"):  # FutureKernel: resolved (or failed) when the mode exited
            try:
                task.compiled = compiled.result()
            except Exception as exc:
                task.fail(task.error or describe(exc))
                task.compiled = None
        if task.status == "pending":
            task.to(Status.COMPILED)


@contextmanager
def _loading(platform: Platform, workers: int, hits: bool) -> Iterator[Callable[[Task], None]]:
    """Local GPU: ``load(task)`` loads a compiled key on a pool (while the next key compiles), not at its first
    launch; every load is done on exit; off the local GPU it does nothing. If every key is a hit, each loads
    right after its hit, on the calling thread (a loading thread only contends with the hits for the GIL), but
    those that build a C launcher: on the pool, once the block is done."""
    if not platform.local:
        yield lambda task: None
        return
    device, futures, builds = _triton.current_device(), list[Future[None]](), list[Task]()

    def load(task: Task) -> None:
        if not hits:
            futures.append(pool.submit(contextvars.copy_context().run, _load, task, task.compiled, device))
        elif task.compiled is not None and task.status != "failed" and _triton.builds_on_load(task.compiled):
            builds.append(task)
        else:
            _load(task, task.compiled, device)

    with quiet_pool(workers, "warmreg-load") as pool:
        try:
            yield load
            futures += [pool.submit(contextvars.copy_context().run, _load, t, t.compiled, device) for t in builds]
        finally:
            for future in futures:
                future.result()


def _load(task: Task, compiled: Any, device: int) -> None:
    """Build the launcher and load the module of one compiled kernel (idempotent), timed."""
    if compiled is None or task.status == "failed":
        return
    _triton.set_device(device)  # the CUDA current device is per thread
    start = time.perf_counter()
    try:
        _triton.finish_load(compiled)
    except Exception as exc:
        task.fail(describe(exc))
    task.load_seconds += time.perf_counter() - start


def prepare_fast_launches(tasks: list[Task]) -> None:
    """Local GPU: build each loaded key's guarded fast launch now (from the very arguments its binary
    was specialized for), so that its first runtime launch already skips ``JITFunction.run``."""
    if not FAST_LAUNCH:
        return
    device = _triton.current_device()
    for task in tasks:
        if task.captured is None or task.compiled is None or task.status == "failed":
            continue
        jit, _grid, kwargs, options = task.captured
        try:
            remember_fast_launch(task.kp.name, task.key, jit, kwargs, options, task.compiled, device)
        except Exception as exc:  # a fast path is an optimization: the first launch builds it instead
            log.debug("no fast launch prepared for %s %s: %s", task.kp.name, task.key, exc)
        task.captured = None
