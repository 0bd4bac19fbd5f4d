"""Runtime launch state: where a :class:`~warmreg.LaunchSpec` goes once launch code returns it.

The one home of what a launch consults at runtime:

- the **warm session** (:data:`WARM_SESSION`): while warm binds a key, the spec is handed to it
  instead of launched (:mod:`warmreg.pipeline.bind`);
- the **launch listeners** a JIT monitor adds (:func:`add_launch_listener`), each called with the
  kernel's name and key of every runtime launch, and :func:`current_launch`, the launch in progress,
  which the monitor reads in Triton's compile hook;
- the **fast launches** warm prepares (:data:`FAST_TABLES`, built by :mod:`warmreg.runtime.fast`):
  a warmed key launches its compiled kernel directly, guarded, and falls back to Triton's path;
- :data:`IN_WARMUP`, the scope in which warmreg itself compiles (a monitor ignores those compiles);
- the **tuned choices** of autotuned kernels (:data:`TUNED`, filled by :mod:`warmreg.stages.tuning`): a
  launch takes the candidate warm chose for its key; a key warm never tuned launches candidate 0
  and tells the untuned listeners (a monitor counts it as an autotune miss). warmreg never
  benchmarks while serving.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from .. import _triton
from ..values.key import CompileKey
from . import fast as _triton_fast

__all__ = [
    "FAST_LAUNCH", "FAST_TABLES", "FORCE_CONFIG", "IN_WARMUP", "TUNED", "WARMED", "WARM_SESSION", "KeyOnly", "LaunchListener", "WarmSession", "capture",
    "add_launch_listener", "add_untuned_listener", "current_launch", "remember_fast_launch", "remove_launch_listener",
    "forget_loaded", "remove_untuned_listener", "run", "use_config",
]  # fmt: skip

#: Called with (kernel name, key) for every runtime launch of a warmreg kernel.
LaunchListener = Callable[[str, CompileKey], None]


class WarmSession(Protocol):
    """What a warm in progress does with a launch: capture it (and return the launch's outputs)."""

    def capture(self, kernel: Any, spec: Any) -> Any: ...


#: The warm in progress on this thread/context, if any: launches become compile-only captures.
WARM_SESSION: ContextVar[WarmSession | None] = ContextVar("warmreg_warm_session", default=None)


class KeyOnly:
    """The warm session :func:`capture` uses by default: it keeps the key a launch would have and launches nothing."""

    def __init__(self) -> None:
        self.key: CompileKey | None = None

    def capture(self, kernel: Any, spec: Any) -> Any:
        self.key = spec.key
        return spec.outputs


@contextmanager
def capture(session: WarmSession | None = None) -> Iterator[Any]:
    """The one way a launch is captured: within the block, launch code hands its spec to ``session``
    (default: a :class:`KeyOnly`, whose ``key`` is the launch's) instead of launching; yields the session."""
    session = KeyOnly() if session is None else session
    token = WARM_SESSION.set(session)
    try:
        yield session
    finally:
        WARM_SESSION.reset(token)
#: Set while warmreg itself compiles on this thread; the monitor reads it to tell warmup from runtime.
IN_WARMUP: ContextVar[bool] = ContextVar("warmreg_in_warmup", default=False)
#: Launch a key's compiled kernel directly (guarded, see :mod:`warmreg.runtime.fast`). Set
#: ``WARMREG_FAST_LAUNCH=0`` in the environment (read at import) to always take ``JITFunction.run``.
FAST_LAUNCH: bool = os.environ.get("WARMREG_FAST_LAUNCH", "1") != "0"
#: Guarded fast launches by warmreg kernel name, then compile key (see :func:`remember_fast_launch`).
FAST_TABLES: dict[str, dict[CompileKey, Any]] = {}

#: The autotune candidate chosen for each tuning key (``config=None``), by kernel name.
TUNED: dict[str, dict[CompileKey, int]] = {}
#: What each warm of this process left loaded, by plan: its report, weak references to the fast launches
#: it prepared and the tuned choices it made (:mod:`warmreg.api.session` keeps and checks it). Weak, so
#: that a kernel Triton frees is not kept loaded by this record.
WARMED: dict[tuple[Any, ...], tuple[Any, tuple[tuple[str, Any, Any], ...], dict[str, dict[Any, int]]]] = {}


def forget_loaded() -> None:
    """Forget the fast launches, tuned choices and warmed plans of this process (not Triton's kernels)."""
    FAST_TABLES.clear()
    TUNED.clear()
    WARMED.clear()
#: Launch this candidate of every tuned kernel on this thread/context (benchmarks, tests).
FORCE_CONFIG: ContextVar[int | None] = ContextVar("warmreg_force_config", default=None)

_LAUNCH: ContextVar[tuple[str, CompileKey] | None] = ContextVar("warmreg_launch", default=None)
_LISTENERS: list[LaunchListener] = []
_UNTUNED: list[LaunchListener] = []


def add_launch_listener(listener: LaunchListener) -> None:
    """Call ``listener(kernel_name, key)`` for every runtime launch from now on (a JIT monitor)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def remove_launch_listener(listener: LaunchListener) -> None:
    """Stop calling ``listener`` (no-op if it is not registered)."""
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)


@contextmanager
def use_config(index: int) -> Iterator[None]:
    """``with warmreg.use_config(i):`` every tuned kernel launched in the block takes candidate ``i``
    (tests of each candidate against a reference; warm's own benchmarks)."""
    token = FORCE_CONFIG.set(index)
    try:
        yield
    finally:
        FORCE_CONFIG.reset(token)


def add_untuned_listener(listener: LaunchListener) -> None:
    """Call ``listener(kernel_name, tuning_key)`` whenever a tuned kernel launches on a GPU a key warm
    did not tune (it takes candidate 0)."""
    if listener not in _UNTUNED:
        _UNTUNED.append(listener)


def remove_untuned_listener(listener: LaunchListener) -> None:
    """Stop calling ``listener`` (no-op if it is not registered)."""
    if listener in _UNTUNED:
        _UNTUNED.remove(listener)


def current_launch() -> tuple[str, CompileKey] | None:
    """The warmreg kernel name and key of the launch going through Triton on this thread, while a
    listener is registered (``None`` otherwise)."""
    return _LAUNCH.get()


def run(kernel: Any, spec: Any) -> Any:
    """Launch ``spec`` of ``kernel`` (or hand it to the warm session) and return its outputs."""
    session = WARM_SESSION.get()
    if session is not None:
        return session.capture(kernel, spec)
    if spec.grid is None:
        return spec.outputs
    if kernel.tune_configs:
        spec = _tuned(kernel, spec)
    for listener in _LISTENERS:  # a monitor is armed: count the launch (a fast launch cannot compile or load)
        listener(kernel.name, spec.key)
    jit = kernel.jit_for(spec.key)
    fast = FAST_TABLES.get(kernel.name) if FAST_LAUNCH else None
    if fast is not None:
        entry = fast.get(spec.key)
        if entry is not None and entry.jit is jit and entry.launch(spec.grid, spec.kwargs):
            return spec.outputs
    options = kernel.launch_options(spec.key)
    if _on_cpu(spec.kwargs):
        from .._triton import interp as _triton_interp  # the interpreter (and numpy) only for a CPU launch

        _triton_interp.interpreted(jit)[spec.grid](**spec.kwargs, **options)
        return spec.outputs
    token = _LAUNCH.set((kernel.name, spec.key)) if _LISTENERS else None
    try:
        compiled = jit[spec.grid](**spec.kwargs, **options)
    finally:
        if token is not None:
            _LAUNCH.reset(token)
    if FAST_LAUNCH and compiled is not None and isinstance(spec.grid, tuple):
        remember_fast_launch(kernel.name, spec.key, jit, spec.kwargs, options, compiled, _triton.current_device())
    return spec.outputs


def remember_fast_launch(
    name: str, key: CompileKey, jit: Any, kwargs: Mapping[str, Any], options: Mapping[str, Any], compiled: Any, device: int
) -> bool:
    """Build and keep the guarded fast launch of ``key`` of kernel ``name`` from a launch of ``jit``
    with ``kwargs`` that ``compiled`` serves (loaded on ``device``). Warm calls it for each key it
    loads on the local GPU, so even a key's first launch skips ``JITFunction.run``; :func:`run`
    calls it after a key's first launch through Triton. Returns whether an entry was kept.

    One entry per kernel name and key (two instances under one name are one kernel): an entry
    launches only on the device it was built on and only for the jit function it was built from, so
    a key launched on another device, or by an instance whose ``jit_for(key)`` differs (against the
    contract), takes Triton's path and then replaces the entry.
    """
    entry = _triton_fast.build(jit, kwargs, options, compiled, device)
    if entry is None:
        _triton.launcher_now(compiled)  # its launches take Triton's launcher: made now, not at the first
        return False
    FAST_TABLES.setdefault(name, {})[key] = entry
    return True


def _tuned(kernel: Any, spec: Any) -> Any:
    """The launch of the candidate chosen for ``spec.key`` (forced, tuned, or else candidate 0)."""
    index = FORCE_CONFIG.get()
    if index is None:
        index = TUNED.get(kernel.name, {}).get(spec.key)
        if index is None:
            index = 0
            if _UNTUNED and not _on_cpu(spec.kwargs):  # the interpreter neither compiles nor tunes
                for listener in _UNTUNED:
                    listener(kernel.name, spec.key)
    return kernel.with_config(spec, index)


def _on_cpu(kwargs: Mapping[str, Any]) -> bool:
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False
