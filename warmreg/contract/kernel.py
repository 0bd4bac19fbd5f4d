"""The kernel contract: one launch path for runtime and warmup.

A plugin subclasses :class:`TritonKernel` and writes its launch code once, as a method decorated
with :func:`kernel_launcher` that returns a :class:`LaunchSpec`. At runtime the decorator launches
the ``@triton.jit`` function (through Triton's interpreter when the tensors live on the CPU); while
:func:`warmreg.warm` binds a key, the same code path hands the spec to the warm instead
(:mod:`warmreg.runtime.launch` is where the spec goes).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs
import torch

from ..runtime.launch import run
from ..support.cuda_memory import zeros as device_zeros
from ..values.errors import KernelContractError, LaunchError
from ..values.key import LAUNCH_OPTIONS, CompileKey

if TYPE_CHECKING:
    from ..values.platform import Platform
    from .config import WarmConfig

__all__ = ["K", "LaunchSpec", "TritonKernel", "TuneConfig", "check_no_option_kwargs", "kernel_launcher", "meta", "output"]

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
    if not offset:  # one torch call (1.3-2.3 us, a third of the path below); an empty view has an empty storage
        strides = None if stride is None else tuple(int(s) for s in stride)
        return torch.empty(shape, dtype=dtype, device="meta") if strides is None else torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    stride = tuple(int(s) for s in (torch.empty(shape, device="meta").stride() if stride is None else stride))
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) if all(shape) else offset
    base = torch.empty(max(extent, 1), dtype=dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def output(
    kernel: str,
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """An op's output buffer: ``out`` when the caller passed one (checked), else a fresh
    ``torch.empty(shape, dtype, device)``.

    Ops take ``out=`` so that engines and CUDA-graph capture can hand them persistent buffers and a
    launch allocates nothing. A caller's buffer must be exactly what the op would allocate: that
    shape, dtype and device, contiguous and 16-byte aligned as ``torch.empty`` returns it (an op's
    keys assume its fresh outputs are aligned: an unaligned buffer would be another binary).

    :param kernel: the kernel's name, for the error.
    :param name: the parameter's name (``"out"``, ``"q_out"``), for the error.
    :raises LaunchError: naming the parameter, what it is and what the op needs.
    """
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise LaunchError(kernel, f"{name} is a {type(out).__name__}, not a tensor", fix=f"pass a tensor or leave {name} out")
    if (
        out.shape != shape or out.dtype is not dtype or out.device != device
        or not out.is_contiguous() or out.data_ptr() & 15
    ):  # fmt: skip
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" + ("" if out.is_contiguous() else ", not contiguous")
        got += ", not 16-byte aligned" if out.data_ptr() & 15 else ""
        raise LaunchError(
            kernel,
            f"{name} is {got}; this launch writes a contiguous, 16-byte aligned {dtype} {tuple(shape)} on {device}",
            fix=f"allocate {name} as torch.empty({tuple(shape)}, dtype={dtype}, device={str(device)!r}) or leave it out",
        )
    return out


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
    grid: tuple[int, ...] | Callable[[Mapping[str, Any]], tuple[int, ...]] | None
    kwargs: Mapping[str, Any]
    outputs: Any = None


def _frozen_items(value: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((str(k), v) for k, v in dict(value).items()))


@attrs.frozen
class TuneConfig:
    """One autotune candidate of a tuned kernel (the counterpart of ``triton.Config``).

    :param constexprs: the tuned ``tl.constexpr`` arguments and their values (``{"BT": 64}``),
        merged into the launch's kwargs; the launch code leaves them out.
    :param num_warps: Triton's ``num_warps`` for this candidate.
    :param num_stages: Triton's ``num_stages`` for this candidate.
    """

    constexprs: tuple[tuple[str, Any], ...] = attrs.field(converter=_frozen_items, factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def options(self) -> dict[str, int]:
        """The Triton launch options this candidate sets."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.constexprs)
        return f"TuneConfig({inner}{', ' if inner else ''}num_warps={self.num_warps}, num_stages={self.num_stages})"


def kernel_launcher(fn: Callable[..., LaunchSpec[K]]) -> Callable[..., Any]:
    """Turn launch code returning a :class:`LaunchSpec` into a launch (runtime) or a compile (warm).

    The decorated method validates its inputs, computes the key with ``dispatch``, allocates outputs
    and returns ``LaunchSpec(key, grid, kwargs, outputs)``; the decorator does the rest (see
    :func:`warmreg.runtime.launch.run`) and returns ``outputs``. The launch has ``fn``'s own signature and
    passes each argument on as it came (a ``*args, **kwargs`` forwarder costs ~0.8 us a launch).
    """
    params = list(inspect.signature(fn).parameters.values())
    env: dict[str, Any] = {"_wr_fn": fn, "_wr_run": run, "_wr_spec": LaunchSpec, "_wr_bad": _not_a_spec}
    if not params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in env for p in params):

        def launch(self: TritonKernel[K], *args: Any, **kwargs: Any) -> Any:
            spec = fn(self, *args, **kwargs)
            return run(self, spec) if isinstance(spec, LaunchSpec) else _not_a_spec(self, spec)

    else:
        heads, passed = [], []
        for i, p in enumerate(params):
            if p.kind is p.KEYWORD_ONLY and (i == 0 or params[i - 1].kind is not p.KEYWORD_ONLY):
                heads.append("*")
            if p.default is not p.empty:
                env[f"_wr_d{i}"] = p.default
            heads.append(p.name + (f"=_wr_d{i}" if p.default is not p.empty else ""))
            passed.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
            if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
                heads.append("/")
        source = (
            f"def launch({', '.join(heads)}):\n    spec = _wr_fn({', '.join(passed)})\n"
            f"    return _wr_run({params[0].name}, spec) if isinstance(spec, _wr_spec) else _wr_bad({params[0].name}, spec)\n"
        )
        exec(compile(source, f"<warmreg launch of {fn.__qualname__}>", "exec"), env)
        launch = env["launch"]
    launch = functools.wraps(fn)(launch)
    launch.__warmreg_launcher__ = True  # type: ignore[attr-defined]
    return launch


def _not_a_spec(kernel: Any, spec: Any) -> Any:
    raise KernelContractError(kernel.name, f"launch code returned {type(spec).__name__}", fix="return a LaunchSpec")


class TritonKernel(Generic[K]):
    """Base class of a warmreg kernel. Subclass contract:

    - ``name``: a stable, unique name (default ``module.QualName``); two registrations with the same
      name are the same kernel and their keys are merged.
    - ``key_type``: the :class:`CompileKey` subclass (default: ``SomeKey`` of a ``TritonKernel[SomeKey]`` base).
    - ``jit``: the ``@triton.jit`` function, or override :meth:`jit_for` when the key selects one of
      several (FP8 / MXFP4); :meth:`jits` must then list them all.
    - :meth:`dispatch`: pure function of runtime inputs to the key; called at runtime and at warm.
    - :meth:`domains`: how the inputs ``dispatch`` reads vary in a deployment (config + platform).
    - :meth:`when`: optional filter over a domain point (may read inputs ``dispatch`` does not).
    - :meth:`warmup_inputs` (optional): meta-tensor arguments of the launcher that reproduce a key;
      by default the domain point that produced it. Each key is warmed by a registered instance whose
      domains produced it, but keep :meth:`dispatch` and :meth:`warmup_inputs` functions of their
      arguments and the key: two instances under one name are one kernel.
    - ``__call__`` (or any method) decorated with :func:`kernel_launcher`: the launch code.
    - ``tune_configs`` (optional): the autotune candidates of a tuned kernel. Its key type then has
      a field ``config: int | None = None`` and no launch-option fields; ``dispatch`` returns the
      key with ``config=None`` (the tuning key), the launch code leaves the tuned constexprs out of
      the kwargs and may give ``grid`` as a callable of the kwargs merged with the candidate's
      constexprs. Warm compiles every candidate of every key (``config=i``), benchmarks them on
      the GPU on :meth:`tuning_inputs` and keeps the fastest (:mod:`warmreg.stages.tuning`).

    :meth:`dispatch`, :meth:`domains` and :meth:`warmup_inputs` may raise
    :class:`~warmreg.ConfigError` for a config they cannot serve; anything else they raise is a bug
    in the kernel and is reported against it.
    """

    name: ClassVar[str] = ""
    key_type: ClassVar[type[CompileKey]]
    jit: ClassVar[Any] = None
    #: Name of the launcher method that warm calls with :meth:`warmup_inputs`.
    launcher: ClassVar[str] = "__call__"
    #: Autotune candidates (empty: not a tuned kernel); see the class docstring.
    tune_configs: ClassVar[tuple[TuneConfig, ...]] = ()
    #: Launch each key once for real at the end of a warm on the GPU (:mod:`warmreg.stages.rehearsal`), on
    #: :meth:`tuning_inputs`; ``False`` for a kernel no inputs can be made up for safely.
    rehearse: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = f"{cls.__module__}.{cls.__qualname__}"
        for base in cls.__dict__.get("__orig_bases__", ()):  # TritonKernel[SomeKey]: key_type defaults to SomeKey
            arg = (getattr(base, "__args__", None) or (None,))[0]
            if "key_type" not in cls.__dict__ and isinstance(arg, type) and issubclass(arg, CompileKey):
                cls.key_type = arg

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
        """Keyword arguments of the launcher (meta tensors, ints) whose launch has exactly ``key``. Default: the
        last domain point that gave ``key`` in a plan of this instance, less what the launcher does not take (so
        each launcher argument needs a domain: one value for those that never reach the key)."""
        point = vars(self).get("_witnesses", {}).get(attrs.evolve(key, config=None) if self.tune_configs else key)  # type: ignore[call-arg]
        if point is None:
            raise KernelContractError(self.name, f"has no domain point giving {key}", fix="plan it first or override warmup_inputs")
        params = inspect.signature(getattr(self, self.launcher)).parameters
        return {n: v for n, v in point.items() if n in params or any(p.kind is p.VAR_KEYWORD for p in params.values())}

    def launch_for_warm(self, key: K) -> Any:
        """Run the launch code with :meth:`warmup_inputs` (inside a warm session: a compile)."""
        method = getattr(self, self.launcher)
        if not getattr(method, "__warmreg_launcher__", False):
            raise KernelContractError(
                self.name, f"method {self.launcher!r} is not decorated with @kernel_launcher", fix="decorate the launch code"
            )
        return method(**self.warmup_inputs(key))

    def tuning_inputs(self, key: K, device: torch.device) -> Mapping[str, Any]:
        """Keyword arguments of the launcher, real tensors on ``device``, that warm benchmarks the
        candidates of tuning key ``key`` (``config=None``) on: the shapes that key serves.

        Default: :meth:`warmup_inputs` with each meta tensor made real: zeros (same strides) written as bytes by the
        driver's memset (:func:`warmreg.support.cuda_memory.zeros`): no torch kernel, which torch loads at its first use
        (5-30 ms on an H100, in a warm's rehearsal).
        Tuned kernels whose timing depends on the data or on sizes the key does not fix (a token count) override it.
        """
        return {name: _real(value, device) for name, value in self.warmup_inputs(key).items()}

    def with_config(self, spec: LaunchSpec[K], index: int) -> LaunchSpec[K]:
        """The launch of candidate ``index`` of a tuned kernel: its constexprs merged into the kwargs,
        its grid evaluated, ``config=index`` in the key. Warm binds every candidate through it; a
        runtime launch goes through it with the candidate warm chose."""
        if not 0 <= index < len(self.tune_configs):
            raise KernelContractError(self.name, f"has no autotune candidate {index} ({len(self.tune_configs)} declared)")
        kwargs = {**spec.kwargs, **dict(self.tune_configs[index].constexprs)}
        grid = spec.grid(kwargs) if callable(spec.grid) else spec.grid
        return LaunchSpec(attrs.evolve(spec.key, config=index), grid, kwargs, spec.outputs)  # type: ignore[call-arg]

    def launch_options(self, key: K) -> dict[str, Any]:
        """The Triton launch options of ``key``: its own fields, plus its candidate's for a tuned kernel."""
        options = key.launch_options()
        index = getattr(key, "config", None) if self.tune_configs else None
        if index is not None:
            options.update(self.tune_configs[index].options())
        return options

    def dispatch_params(self) -> tuple[str, ...]:
        """Names of the runtime inputs :meth:`dispatch` takes."""
        return _dispatch_params(type(self))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _real(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        nbytes = value.untyped_storage().nbytes() or value.element_size()
        storage = device_zeros(nbytes, device).view(value.dtype)
        return storage.as_strided(value.shape, value.stride(), value.storage_offset())
    if isinstance(value, (list, tuple)):
        items = [_real(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a NamedTuple takes fields
    if attrs.has(type(value)):  # an argument that groups tensors
        return attrs.evolve(value, **{f.name: _real(getattr(value, f.name), device) for f in attrs.fields(type(value)) if f.init})
    return value


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
