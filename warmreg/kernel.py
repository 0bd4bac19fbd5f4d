"""The kernel contract: one launch path for runtime and warmup.

A plugin subclasses :class:`TritonKernel` and writes its launch code once, as a method decorated
with :func:`kernel_launcher` that returns a :class:`LaunchSpec`. At runtime the decorator launches
the ``@triton.jit`` function (through Triton's interpreter when the tensors live on the CPU); while
:func:`warmreg.warm` runs, the same code path ends in Triton's compile-only ``warmup`` instead.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import attrs
import torch

from . import _triton, _triton_fast
from .errors import KernelContractError
from .key import LAUNCH_OPTIONS, CompileKey

if TYPE_CHECKING:
    from .config import WarmConfig
    from .platform import Platform

__all__ = ["LaunchSpec", "TritonKernel", "kernel_launcher", "meta"]

K = TypeVar("K", bound=CompileKey)


def meta(
    shape: Iterable[int],
    dtype: torch.dtype,
    *,
    stride: Iterable[int] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """A meta tensor (no memory) shaped like a runtime input, for domains and warmup inputs.

    :param shape: the tensor's shape.
    :param dtype: its dtype.
    :param stride: strides in elements (contiguous if omitted), e.g. a view of a fused projection.
    :param offset: storage offset in elements; a non-zero offset makes ``data_ptr()`` reflect it, so
        Triton sees the misalignment of an offset view.
    """
    shape = tuple(int(s) for s in shape)
    if stride is None:
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= max(size, 1)
        stride = tuple(reversed(strides))
    stride = tuple(int(s) for s in stride)
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) if all(shape) else offset
    base = torch.empty(max(extent, 1), dtype=dtype, device="meta")
    return base.as_strided(shape, stride, offset)


@attrs.define  # not frozen: a frozen attrs class costs ~0.4 us more per launch; nothing mutates it
class LaunchSpec(Generic[K]):
    """What launch code returns: the key, the grid, the kernel's arguments and the outputs.

    :param key: the compile key of this launch; its launch options (``num_warps``...) are passed to
        Triton, so warmup and runtime cannot disagree.
    :param grid: the launch grid, or ``None`` for an empty batch (no launch; outputs still returned).
    :param kwargs: the ``@triton.jit`` function's arguments by name.
    :param outputs: what the launcher returns to its caller.
    """

    key: K
    grid: tuple[int, ...] | None
    kwargs: Mapping[str, Any]
    outputs: Any = None


class _WarmSession(Protocol):
    def capture(self, kernel: TritonKernel[Any], spec: LaunchSpec[Any]) -> Any: ...


#: The warm in progress on this thread/context, if any: launches become compile-only captures.
WARM_SESSION: ContextVar[_WarmSession | None] = ContextVar("warmreg_warm_session", default=None)
#: The warmreg kernel name and key of the launch in progress (set only while a monitor is armed).
LAUNCH: ContextVar[tuple[str, CompileKey] | None] = ContextVar("warmreg_launch", default=None)
#: Set by the monitor while armed: called with (kernel name, key) for every runtime launch.
ON_LAUNCH: list[Callable[[str, CompileKey], None]] = []
#: Launch a key's compiled kernel directly (guarded, see :mod:`warmreg._triton_fast`) after its first
#: launch through Triton. Set ``WARMREG_FAST_LAUNCH=0`` in the environment (read at import) to always
#: take Triton's ``JITFunction.run``.
FAST_LAUNCH: bool = os.environ.get("WARMREG_FAST_LAUNCH", "1") != "0"
#: Guarded fast launches by warmreg kernel name, then compile key (see :func:`remember_fast_launch`).
FAST_TABLES: dict[str, dict[CompileKey, Any]] = {}


def kernel_launcher(fn: Callable[..., LaunchSpec[K]]) -> Callable[..., Any]:
    """Turn launch code returning a :class:`LaunchSpec` into a launch (runtime) or a compile (warm).

    The decorated method validates its inputs, computes the key with ``dispatch``, allocates outputs
    and returns ``LaunchSpec(key, grid, kwargs, outputs)``; the decorator does the rest and returns
    ``outputs``.
    """

    @functools.wraps(fn)
    def launch(self: TritonKernel[K], *args: Any, **kwargs: Any) -> Any:
        spec = fn(self, *args, **kwargs)
        if not isinstance(spec, LaunchSpec):
            raise KernelContractError(self.name, f"launch code returned {type(spec).__name__}", fix="return a LaunchSpec")
        session = WARM_SESSION.get()
        if session is not None:
            return session.capture(self, spec)
        if spec.grid is None:
            return spec.outputs
        if ON_LAUNCH:  # a monitor is armed: count the launch (a fast launch cannot compile or load)
            for listener in ON_LAUNCH:
                listener(self.name, spec.key)
        jit = self.jit_for(spec.key)
        fast = FAST_TABLES.get(self.name) if FAST_LAUNCH else None
        if fast is not None:
            entry = fast.get(spec.key)
            if entry is not None and entry.jit is jit and entry.launch(spec.grid, spec.kwargs):
                return spec.outputs
        options = spec.key.launch_options()
        if _on_cpu(spec.kwargs):
            from . import _triton_interp  # the interpreter (and numpy) only for a CPU launch

            _triton_interp.interpreted(jit)[spec.grid](**spec.kwargs, **options)
            return spec.outputs
        token = LAUNCH.set((self.name, spec.key)) if ON_LAUNCH else None
        try:
            compiled = jit[spec.grid](**spec.kwargs, **options)
        finally:
            if token is not None:
                LAUNCH.reset(token)
        if FAST_LAUNCH:
            _remember(self, spec, jit, options, compiled)
        return spec.outputs

    launch.__warmreg_launcher__ = True  # type: ignore[attr-defined]
    return launch


def _remember(kernel: TritonKernel[Any], spec: LaunchSpec[Any], jit: Any, options: Mapping[str, Any], compiled: Any) -> None:
    """Keep the guarded fast launch of a key Triton just launched (see :mod:`warmreg._triton_fast`)."""
    if compiled is None or not isinstance(spec.grid, tuple):
        return
    remember_fast_launch(kernel.name, spec.key, jit, spec.kwargs, options, compiled, _triton.current_device())


def remember_fast_launch(
    name: str, key: CompileKey, jit: Any, kwargs: Mapping[str, Any], options: Mapping[str, Any], compiled: Any, device: int
) -> bool:
    """Build and keep the guarded fast launch of ``key`` of kernel ``name`` from a launch of ``jit``
    with ``kwargs`` that ``compiled`` serves (loaded on ``device``). Warm calls it for each key it
    loads on the local GPU, so even a key's first launch skips ``JITFunction.run``; the runtime path
    calls it after a key's first launch through Triton. Returns whether an entry was kept.

    One entry per kernel name and key (two instances under one name are one kernel): an entry
    launches only on the device it was built on and only for the jit function it was built from, so
    a key launched on another device, or by an instance whose ``jit_for(key)`` differs (against the
    contract), takes Triton's path and then replaces the entry.
    """
    entry = _triton_fast.build(jit, kwargs, options, compiled, device)
    if entry is None:
        return False
    FAST_TABLES.setdefault(name, {})[key] = entry
    return True


def _on_cpu(kwargs: Mapping[str, Any]) -> bool:
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False


class TritonKernel(Generic[K]):
    """Base class of a warmreg kernel. Subclass contract:

    - ``name``: a stable, unique name (default ``module.QualName``); two registrations with the same
      name are the same kernel and their keys are merged.
    - ``key_type``: the :class:`CompileKey` subclass.
    - ``jit``: the ``@triton.jit`` function, or override :meth:`jit_for` when the key selects one of
      several (FP8 / MXFP4); :meth:`jits` must then list them all.
    - :meth:`dispatch`: pure function of runtime inputs to the key; called at runtime and at warm.
    - :meth:`domains`: how the inputs ``dispatch`` reads vary in a deployment (config + platform).
    - :meth:`when`: optional filter over a domain point (may read inputs ``dispatch`` does not).
    - :meth:`warmup_inputs`: meta-tensor arguments of the launcher that reproduce a key.
      Each key is warmed by a registered instance whose domains produced it, but keep
      :meth:`dispatch` and :meth:`warmup_inputs` functions of their arguments and the key: two
      instances under one name are one kernel.
    - ``__call__`` (or any method) decorated with :func:`kernel_launcher`: the launch code.

    :meth:`dispatch`, :meth:`domains` and :meth:`warmup_inputs` may raise
    :class:`~warmreg.ConfigError` for a config they cannot serve; anything else they raise is a bug
    in the kernel and is reported against it.
    """

    name: ClassVar[str] = ""
    key_type: ClassVar[type[CompileKey]]
    jit: ClassVar[Any] = None
    #: Name of the launcher method that warm calls with :meth:`warmup_inputs`.
    launcher: ClassVar[str] = "__call__"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = f"{cls.__module__}.{cls.__qualname__}"

    def jit_for(self, key: K) -> Any:
        """The ``@triton.jit`` function that serves ``key`` (default: ``jit``)."""
        if self.jit is None:
            raise KernelContractError(self.name, "has no jit function", fix="set the class attribute jit or override jit_for")
        return self.jit

    def jits(self) -> tuple[Any, ...]:
        """Every ``@triton.jit`` function this kernel may launch."""
        return (self.jit,) if self.jit is not None else ()

    if TYPE_CHECKING:
        # Declared as callables so that subclasses may name their inputs (``dispatch(self, *, x, y)``)
        # without breaking the override rules of type checkers.
        dispatch: Callable[..., K]
        when: Callable[..., bool]
    else:

        def dispatch(self, **runtime: Any) -> K:
            """The compile key for these runtime inputs. Pure; no tensors are read."""
            raise KernelContractError(self.name, "does not implement dispatch")

        def when(self, **point: Any) -> bool:
            """Whether a combination of domain values can occur at runtime (default: always)."""
            return True

    def domains(self, config: WarmConfig, platform: Platform) -> Any:
        """How the runtime inputs of :meth:`dispatch` (and :meth:`when`) vary in this deployment.

        Either a mapping of input name to the values it takes (the core enumerates the product), or an
        iterable of points (dicts of input name to value) for inputs that vary together.
        """
        raise KernelContractError(self.name, "does not implement domains")

    def warmup_inputs(self, key: K) -> Mapping[str, Any]:
        """Keyword arguments of the launcher (meta tensors, ints) whose launch has exactly ``key``."""
        raise KernelContractError(self.name, "does not implement warmup_inputs")

    def launch_for_warm(self, key: K) -> Any:
        """Run the launch code with :meth:`warmup_inputs` (inside a warm session: a compile)."""
        method = getattr(self, self.launcher)
        if not getattr(method, "__warmreg_launcher__", False):
            raise KernelContractError(
                self.name, f"method {self.launcher!r} is not decorated with @kernel_launcher", fix="decorate the launch code"
            )
        return method(**self.warmup_inputs(key))

    def dispatch_params(self) -> tuple[str, ...]:
        """Names of the runtime inputs :meth:`dispatch` takes."""
        return _dispatch_params(type(self))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


@functools.cache
def _dispatch_params(cls: Any) -> tuple[str, ...]:
    params = inspect.signature(cls.dispatch).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        raise KernelContractError(cls.name, "dispatch takes **kwargs", fix="name each runtime input dispatch reads")
    return tuple(p.name for p in params if p.name != "self")


def check_no_option_kwargs(kernel: TritonKernel[Any], spec: LaunchSpec[Any]) -> None:
    """Launch options must come from the key, never from the kwargs (they would drift)."""
    clash = sorted(set(spec.kwargs) & set(LAUNCH_OPTIONS))
    if clash:
        raise KernelContractError(
            kernel.name, f"launch kwargs set the launch option(s) {clash}", fix="make them fields of the compile key"
        )
