"""Binding: every key of a plan runs its kernel's launch code once, on meta tensors, and is captured.

A key's launch code (``launch_for_warm(key)``: :meth:`~warmreg.TritonKernel.warmup_inputs`, then
the kernel's own launcher) runs exactly once per warm, on the calling thread. Its
:class:`~warmreg.LaunchSpec` is checked against the key and specialized the way Triton will compile
it, and the result is a :class:`Task`: what every later stage (pack install, the exchange between
ranks, compiling, loading) works from. Binding needs neither the disk cache nor ``triton_key()``,
so it overlaps the background hash of Triton's installation.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable
from typing import Any, Literal

from .. import _triton
from .._triton import cache as _triton_cache
from ..contract.kernel import LaunchSpec, TritonKernel, check_no_option_kwargs
from ..runtime.launch import capture
from ..values.errors import KernelContractError, WarmregError
from ..values.key import CompileKey
from ..values.platform import Platform
from .planning import KernelPlan
from .report import KeyResult

__all__ = ["OnError", "Status", "Task", "bind_all", "cancel_rest", "check_on_error", "describe"]

OnError = Literal["raise", "continue", "stop"]


class Status(str, enum.Enum):
    """Where a key stands while it warms (the first four are :class:`~warmreg.KeyResult` statuses)."""

    MEMORY = "memory"  # already loaded in this process (until binding says otherwise)
    PENDING = "pending"  # bound, to compile
    COMPILED = "compiled"
    DISK_CACHE = "disk_cache"
    FAILED = "failed"  # terminal: nothing moves a failed key on


class Task:
    """One key while it warms: bound (launch captured), then compiled, then loaded.

    :ivar status: a :class:`Status`, changed only by :meth:`to`.
    :ivar launch: the captured launch ``(jit, grid, kwargs, options)``; the compile consumes it.
    :ivar captured: the same, kept until the fast launch is prepared (local GPU).
    :ivar precompiled: compiled into Triton's disk cache for this warm by another process (a stage):
        found there, it reports ``compiled``.
    :ivar in_cache: a stage found its binary in Triton's disk cache (the compile step does not look again).
    """

    def __init__(self, kp: KernelPlan, key: CompileKey) -> None:
        self.kp, self.key = kp, key
        self.status = Status.MEMORY
        self.seconds = self.load_seconds = 0.0
        self.error: str | None = None
        self.triton_key: str | None = None
        self.binary_hash: str | None = None
        self.jit_name: str | None = None
        self.specialization_data: str | None = None
        self.compiled: Any = None
        self.launch: tuple[Any, tuple[int, ...], Any, dict[str, Any]] | None = None
        self.captured: tuple[Any, tuple[int, ...], Any, dict[str, Any]] | None = None
        self.precompiled = self.in_cache = False

    @property
    def done(self) -> bool:
        """Compiled, found, or failed: nothing left to compile."""
        return self.launch is None

    def to(self, status: Status, error: str | None = None) -> None:
        """The one transition of :attr:`status`: to ``FAILED`` from anywhere (with nothing left to compile;
        ``error`` restates why), to anything else unless the key failed."""
        if status is Status.FAILED:
            self.status, self.error, self.launch = status, self.error if error is None else error, None
        elif self.status is not Status.FAILED:
            self.status = status

    def fail(self, error: str) -> None:
        self.to(Status.FAILED, error)

    def result(self) -> KeyResult:
        # an unresolved async compile reports nothing yet: from Triton 3.7 a FutureKernel forwards
        # attribute reads to result(), which would wait here (on a pool thread: for itself)
        compiled = None if _triton.is_future_kernel(self.compiled) else self.compiled
        return KeyResult(
            kernel=self.kp.name, key=self.key, status=self.status.value,  # type: ignore[arg-type]
            seconds=self.seconds, load_seconds=self.load_seconds, error=self.error, triton_key=self.triton_key,
            binary_hash=self.binary_hash or getattr(compiled, "hash", None), jit_name=self.jit_name,
            specialization_data=self.specialization_data,
            cache_files=_triton.cache_files(compiled) if compiled is not None and self.status != "failed" else {},
        )  # fmt: skip


class _Binder:
    """The warm session while one key binds: checks the captured spec and specializes it."""

    def __init__(self, task: Task, platform: Platform) -> None:
        self.task, self.platform = task, platform

    def capture(self, kernel: TritonKernel[Any], spec: LaunchSpec[Any]) -> Any:
        task = self.task
        if kernel.tune_configs:  # each candidate of a tuning key is a key of its own (config=i)
            spec = kernel.with_config(spec, getattr(task.key, "config", None) or 0)
        if task.jit_name is not None:  # a second launch from one key's launch code
            raise KernelContractError(kernel.name, f"launch code of {task.key} launched twice", fix="launch once per call")
        if spec.key != task.key:
            diff = ", ".join(str(d) for d in task.key.diff(spec.key))
            raise KernelContractError(
                kernel.name,
                f"warmup_inputs({task.key}) led the launch code to key {spec.key} ({diff})",
                fix="make warmup_inputs build inputs whose dispatch gives back the same key",
            )
        check_no_option_kwargs(kernel, spec)
        jit = kernel.jit_for(spec.key)
        options = kernel.launch_options(spec.key)
        task.jit_name = _triton.full_name(jit)
        task.triton_key, task.specialization_data = _triton_cache.specialize_remembered(jit, spec.kwargs, options, self.platform)
        # Status before the compile starts: async compiles report through the listener at any time.
        task.to(Status.MEMORY if _triton.in_memory(jit, task.triton_key) else Status.PENDING)
        if callable(spec.grid):
            raise KernelContractError(kernel.name, "returned a callable grid without tune_configs", fix="return a tuple")
        task.launch = task.captured = (jit, spec.grid or (1,), spec.kwargs, options)
        return spec.outputs


def _bind(task: Task, platform: Platform) -> None:
    try:
        with capture(_Binder(task, platform)):
            task.kp.kernel_for(task.key).launch_for_warm(task.key)
    except Exception as exc:
        task.fail(describe(exc))


def bind_all(tasks: list[Task], platform: Platform, on_error: OnError, on_done: Callable[[Task], None] | None) -> bool:
    """Run every task's launch code once, for ``platform``; returns whether ``on_error="stop"`` stopped it."""
    for task in tasks:
        _bind(task, platform)
        if task.status == "failed":
            if on_done is not None:
                on_done(task)
            if on_error == "stop":
                cancel_rest(tasks, task)
                return True
    return False


def cancel_rest(tasks: list[Task], failed: Task) -> None:
    """``on_error="stop"``: keys not bound yet, or bound but not compiled yet, are not attempted."""
    for task in tasks:
        unbound = task.status == "memory" and task.compiled is None and task.triton_key is None
        if task is not failed and (unbound or task.launch is not None):
            task.fail(f"not attempted: stopped after {failed.kp.name} failed")


def describe(exc: BaseException) -> str:
    """One line for a failed key: the exception's type and last line (a full cache: what to do)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT):
        what = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno, "not writable")
        return (
            f"OSError: the Triton cache ({exc.filename or _triton_cache.cache_dir()}) is {what}: {exc.strerror}; "
            "fix: free space or set TRITON_CACHE_DIR to a writable directory with room"
        )
    text = str(exc).strip().splitlines()
    head = text[-1] if text else ""
    if head.strip() == "^" and exc.__cause__ is not None:  # Triton's wrap of an error in a called jit function
        return f"{type(exc).__name__} at {text[0] if text else '?'} from {describe(exc.__cause__)}"[:2000]
    return f"{type(exc).__name__}: {head}"[:2000]


def check_on_error(value: str) -> OnError:
    """Validate an ``on_error`` argument."""
    if value not in ("raise", "continue", "stop"):
        raise WarmregError(f"on_error={value!r} is not one of 'raise', 'continue', 'stop'", fix="pick one of them")
    return value  # type: ignore[return-value]
