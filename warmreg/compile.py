"""Compiling a plan's keys: in parallel on a bounded pool, each key isolated, each timed.

Two phases. First every key is bound and specialized on the calling thread through the kernel's own
launch code (the warm session captures the launch instead of running it); that needs neither the
disk cache nor ``triton_key()``, so it overlaps the background hash of Triton's installation and
comes before a pack is installed. Then each captured launch becomes ``JITFunction.warmup``, whose
compiles run on a thread pool through Triton's async compile mode. Triton's compilation listener
says whether each binary came from its disk cache. (Both through the adapter, :mod:`warmreg._triton`.)
"""

from __future__ import annotations

import contextvars
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Literal

from . import _triton, _triton_cache
from .errors import KernelContractError, WarmregError
from .kernel import WARM_SESSION, LaunchSpec, TritonKernel, check_no_option_kwargs
from .key import CompileKey
from .platform import Platform
from .registry import KernelPlan
from .report import KeyResult

__all__ = ["OnError", "compile_keys"]

log = logging.getLogger("warmreg.compile")
OnError = Literal["raise", "continue", "stop"]
_tls = threading.local()

#: CPython without gh-113035 (December 2023; 3.11.7 has the bug) keeps ``ast.parse``'s recursion
#: depth in interpreter-wide state: two threads parsing at once (Triton parses each kernel's source
#: while compiling) can then fail with this ``SystemError`` although both sources are fine (gh-106905).
_AST_RACE = "AST constructor recursion depth mismatch"
_AST_RACE_ATTEMPTS = 4


def _retrying_ast_race(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run again when it fails only by CPython's ``ast.parse`` thread race.

    The race fails a parse before Triton writes anything, so running the compile again is safe; each
    attempt needs another thread parsing at the same instant to fail again.
    """
    for attempt in range(1, _AST_RACE_ATTEMPTS + 1):
        try:
            return fn(*args, **kwargs)
        except SystemError as exc:
            if _AST_RACE not in str(exc) or attempt == _AST_RACE_ATTEMPTS:
                raise
            log.debug("CPython ast.parse thread race (attempt %d), compiling again: %s", attempt, exc)
    raise AssertionError("unreachable")


class _Task:
    """Mutable record of one key while it warms."""

    def __init__(self, kp: KernelPlan, key: CompileKey) -> None:
        self.kp, self.key = kp, key
        self.status = "memory"
        self.seconds = 0.0
        self.load_seconds = 0.0
        self.error: str | None = None
        self.triton_key: str | None = None
        self.binary_hash: str | None = None
        self.jit_name: str | None = None
        self.specialization_data: str | None = None
        self.compiled: Any = None
        #: the captured launch (jit, grid, kwargs, options), compiled in the second phase
        self.launch: tuple[Any, tuple[int, ...], Any, dict[str, Any]] | None = None
        self.captured: tuple[Any, tuple[int, ...], Any, dict[str, Any]] | None = None

    def result(self) -> KeyResult:
        # an unresolved async compile reports nothing yet: from Triton 3.7 a FutureKernel forwards
        # attribute reads to result(), which would wait here (on a pool thread: for itself)
        compiled = None if _triton.is_future_kernel(self.compiled) else self.compiled
        return KeyResult(
            kernel=self.kp.name,
            key=self.key,
            status=self.status,  # type: ignore[arg-type]
            seconds=self.seconds,
            load_seconds=self.load_seconds,
            error=self.error,
            triton_key=self.triton_key,
            binary_hash=self.binary_hash or getattr(compiled, "hash", None),
            jit_name=self.jit_name,
            specialization_data=self.specialization_data,
            cache_files=_triton.cache_files(compiled) if compiled is not None and self.status != "failed" else {},
        )


_CURRENT: ContextVar[_Task | None] = ContextVar("warmreg_current_task", default=None)
#: Set while warmreg itself compiles on this thread; the monitor reads it to tell warmup from runtime.
IN_WARMUP: ContextVar[bool] = ContextVar("warmreg_in_warmup", default=False)


class _Session:
    """The warm session: receives the launch code's :class:`LaunchSpec` and compiles it."""

    def capture(self, kernel: TritonKernel[Any], spec: LaunchSpec[Any]) -> Any:
        task = _CURRENT.get()
        if task is None:  # a launch from inside launch code; warm it as its own key
            raise KernelContractError(kernel.name, "launched outside the key being warmed")
        if spec.key != task.key:
            diff = ", ".join(str(d) for d in task.key.diff(spec.key))
            raise KernelContractError(
                kernel.name,
                f"warmup_inputs({task.key}) led the launch code to key {spec.key} ({diff})",
                fix="make warmup_inputs build inputs whose dispatch gives back the same key",
            )
        check_no_option_kwargs(kernel, spec)
        jit = kernel.jit_for(spec.key)
        options = spec.key.launch_options()
        task.jit_name = _triton.full_name(jit)
        task.triton_key, task.specialization_data = _triton.specialize(jit, spec.kwargs, options)
        # Status before the compile starts: async compiles report through the listener at any time.
        task.status = "memory" if _triton.in_memory(jit, task.triton_key) else "pending"
        task.launch = task.captured = (jit, spec.grid or (1,), spec.kwargs, options)
        return spec.outputs


def _compile(task: _Task) -> None:
    """The second phase for one key: ``JITFunction.warmup`` of its captured launch (submitted to
    the pool under the async compile mode, inline otherwise)."""
    if task.launch is None:
        return
    jit, grid, kwargs, options = task.launch
    task.launch = None
    _tls.task = task  # the compile listener reads it (launch code, and so capture, ran in phase one)
    start = time.perf_counter()
    try:
        task.compiled = _retrying_ast_race(_triton.warmup, jit, grid, kwargs, options)
    except Exception as exc:
        task.status, task.error = "failed", _describe(exc)
    finally:
        _tls.task = None
        task.seconds += time.perf_counter() - start


class _TimedExecutor(Executor):
    """Wraps a pool so each compile knows its task (for the listener) and is timed in its worker."""

    def __init__(
        self, inner: Executor, on_done: Callable[[_Task], None] | None, load_device: int | None = None
    ) -> None:
        self.inner = inner
        self.on_done = on_done
        self.load_device = load_device  # local GPU: load each binary as soon as it is compiled

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        task = _tls.task
        context = contextvars.copy_context()  # the compile keeps the warm's scope (IN_WARMUP)

        def run() -> Any:
            _tls.task = task
            start = time.perf_counter()
            compiled = None
            try:
                compiled = _retrying_ast_race(fn, *args, **kwargs)
                return compiled
            except BaseException as exc:
                if task is not None:
                    task.status, task.error = "failed", _describe(exc)
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
    task = getattr(_tls, "task", None)
    if task is not None:
        task.status = "disk_cache" if cache_hit else "compiled"
        task.binary_hash = metadata.get("hash") if isinstance(metadata, dict) else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        what = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno, "not writable")
        return (
            f"OSError: the Triton cache ({exc.filename or _triton_cache.cache_dir()}) is {what}: {exc.strerror}; "
            "fix: free space or set TRITON_CACHE_DIR to a writable directory with room"
        )
    text = str(exc).strip().splitlines()
    head = text[-1] if text else ""
    return f"{type(exc).__name__}: {head}"[:2000]


def compile_keys(
    items: Iterable[tuple[KernelPlan, CompileKey]],
    *,
    platform: Platform,
    workers: int,
    on_error: OnError = "raise",
    advance: Callable[[KeyResult], None] | None = None,
    before_compile: Callable[[], None] | None = None,
) -> list[KeyResult]:
    """Compile every ``(kernel, key)``; one failure never stops the others unless ``on_error="stop"``.

    :param items: the plan's pairs.
    :param platform: the target; a cross target swaps in Triton's stand-in driver for the duration.
    :param workers: compile threads (1 compiles inline).
    :param advance: called with each key's result as it completes (progress display).
    :param before_compile: called between binding every key and compiling them (a pack install:
        it runs after the launch code, before any cache lookup); what it raises propagates.
    :returns: one :class:`KeyResult` per item, in order.
    """
    tasks = [_Task(kp, key) for kp, key in items]
    on_done = (lambda task: advance(task.result())) if advance is not None else None
    session = _Session()
    session_token = WARM_SESSION.set(session)
    warm_token = IN_WARMUP.set(True)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="warmreg-compile") if workers > 1 else None
    try:
        with _triton.compile_listener(_on_compiled), _triton.cross_target(platform):
            stopped = _bind_all(tasks, on_error, on_done)
            if before_compile is not None:
                before_compile()
            _triton_cache.wait_triton_key()
            if pool is None:
                _run_serial(tasks, on_error, advance, stopped)
            else:
                load_device = _triton.current_device() if platform.local else None
                _run_async(tasks, _TimedExecutor(pool, on_done, load_device), on_error, on_done, stopped)
        if platform.local:
            _finish_loads(tasks, workers)
            _prepare_fast_launches(tasks)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        IN_WARMUP.reset(warm_token)
        WARM_SESSION.reset(session_token)
    for task in tasks:
        if task.status == "failed" and task.captured is not None and task.specialization_data is not None:
            _triton_cache.remove_unfinished(task.captured[0], task.specialization_data, platform)  # a failure leaves no files
    return [t.result() for t in tasks]


def _bind(task: _Task) -> None:
    token = _CURRENT.set(task)
    try:
        task.kp.kernel_for(task.key).launch_for_warm(task.key)
    except Exception as exc:
        task.status, task.error = "failed", _describe(exc)
    finally:
        _CURRENT.reset(token)


def _bind_all(tasks: list[_Task], on_error: OnError, on_done: Callable[[_Task], None] | None) -> bool:
    """First phase: run every key's launch code; returns whether ``on_error="stop"`` stopped it."""
    for task in tasks:
        _bind(task)
        if task.status == "failed":
            if on_done is not None:
                on_done(task)
            if on_error == "stop":
                _cancel_rest(tasks, task)
                return True
    return False


def _run_serial(
    tasks: list[_Task], on_error: OnError, advance: Callable[[KeyResult], None] | None, stopped: bool
) -> None:
    for task in tasks:
        if task.launch is None and task.status == "failed":
            continue  # failed (and reported) while binding
        _compile(task)
        if task.status == "pending":
            task.status = "compiled"
        if advance is not None:
            advance(task.result())
        if task.status == "failed" and on_error == "stop" and not stopped:
            _cancel_rest(tasks, task)
            return


def _run_async(
    tasks: list[_Task], executor: Executor, on_error: OnError, on_done: Callable[[_Task], None] | None, stopped: bool
) -> None:
    with _triton.async_compile(executor):
        for task in tasks:
            if task.launch is None and task.status == "failed":
                continue  # failed (and reported) while binding
            _compile(task)
            if on_done is not None and task.status in ("memory", "failed"):  # nothing was submitted
                on_done(task)
            if task.status == "failed" and on_error == "stop" and not stopped:
                _cancel_rest(tasks, task)
                break
    for task in tasks:
        compiled = task.compiled
        if hasattr(compiled, "result"):  # FutureKernel: resolved (or failed) when the mode exited
            try:
                task.compiled = compiled.result()
            except Exception as exc:
                task.status, task.error, task.compiled = "failed", task.error or _describe(exc), None
        if task.status == "pending":
            task.status = "compiled"


def _cancel_rest(tasks: list[_Task], failed: _Task) -> None:
    """``on_error="stop"``: keys not bound yet, or bound but not compiled yet, are not attempted."""
    for task in tasks:
        unbound = task.status == "memory" and task.compiled is None and task.triton_key is None
        if task is not failed and (unbound or task.launch is not None):
            task.status, task.error, task.launch = "failed", f"not attempted: stopped after {failed.kp.name} failed", None


def _load(task: _Task, compiled: Any, device: int) -> None:
    """Build the launcher and load the module of one compiled kernel (idempotent), timed."""
    _triton.set_device(device)  # the CUDA current device is per thread
    start = time.perf_counter()
    try:
        _triton.finish_load(compiled)
    except Exception as exc:
        task.status, task.error = "failed", _describe(exc)
    task.load_seconds += time.perf_counter() - start


def _finish_loads(tasks: list[_Task], workers: int) -> None:
    """Build launchers and load modules now rather than at the first launch (local GPU only).

    Keys compiled on the pool were loaded there as soon as they compiled; this loads the rest
    (cache hits found inline, the serial path) and is a no-op for loaded ones.
    """

    device = _triton.current_device()

    def load(task: _Task) -> None:
        _load(task, task.compiled, device)

    pending = [t for t in tasks if t.compiled is not None and t.status != "failed"]
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="warmreg-load") as pool:
        futures = [pool.submit(contextvars.copy_context().run, load, t) for t in pending]
        for future in futures:
            future.result()


def _prepare_fast_launches(tasks: list[_Task]) -> None:
    """Local GPU: build each loaded key's guarded fast launch now (from the very arguments its binary
    was specialized for), so that its first runtime launch already skips ``JITFunction.run``."""
    from .kernel import FAST_LAUNCH, remember_fast_launch

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


def check_on_error(value: str) -> OnError:
    """Validate an ``on_error`` argument."""
    if value not in ("raise", "continue", "stop"):
        raise WarmregError(f"on_error={value!r} is not one of 'raise', 'continue', 'stop'", fix="pick one of them")
    return value  # type: ignore[return-value]
