"""The guarded fast launch: a warmed key's compiled kernel, launched without Triton's per-call binding.

Part of the Triton adapter (checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0; tested in
``tests/test_fast_launch.py``). What differs between releases comes from :data:`warmreg._triton.release.RELEASE`:
the knobs ``JITFunction.run`` folds into a launch's options (3.9 adds ``fpsan_homomorphic_casts``), and from 3.8
on ``CompiledKernel.__del__`` unloads its module, so an entry holds its ``CompiledKernel`` while it can launch it.

``JITFunction.run`` spends most of a small launch's host time on work that repeats identically for every call
of one compile key: binding the arguments, specializing each one, formatting the cache key as a string,
checking globals, building launch metadata and calling two empty launch-hook chains from C. A warmreg launch
already knows its compile key, so after the first launch of a key on a device (which goes through
``JITFunction.run`` and so through the monitor, the cache and the compiler like any launch), :func:`build`
records what Triton chose for it and returns a :class:`FastLaunch`: one generated function that re-checks, per
call, every property of the arguments Triton specializes on (a tensor's dtype and 16-byte alignment; integer
width, divisibility by 16 and the value 1; the type of floats and bools; constexpr values and arguments Triton
turned into constants) and then calls the compiled kernel's launcher directly. If any check fails, a launch hook
is installed (a profiler), Triton's debug or instrumentation knob changed, or a global the kernel read has
changed, it returns ``False`` and the caller takes Triton's ordinary path: slower than needed, never wrong.

Below it sits the C launch path (``warmreg/runtime/_cdispatch.c``, built at install; :data:`NATIVE`): the same
guards as a table, read by one C call that reads each tensor through torch's C shim (the AOTI ABI, no Python
call; torch.Tensor's C getters where it is not found: :data:`TENSOR_ABI`), packs the parameters on the
stack and calls ``cuLaunchKernelEx`` itself, without Triton's launcher (its Python wrapper, argument parsing,
context query and a driver call per pointer, which the ``is_cuda`` guard replaces). Both come from one list of
guards (:func:`_guard`); a launch the C guards refuse goes to the Python function, then to Triton. Kernels that
need what only Triton's launcher does (scratch memory, tensor descriptors, sanitizers) keep the Python path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton.knobs import HookChain
from triton.runtime.driver import driver as _driver
from triton.runtime.jit import JITFunction

from .._triton import launcher_now, run_kwargs
from .._triton.release import RELEASE

_cdispatch: Any
try:
    from . import _cdispatch  # type: ignore[attr-defined,no-redef]
except ImportError:  # built without a C compiler: the Python fast path serves alone
    _cdispatch = None

__all__ = ["NATIVE", "TENSOR_ABI", "FastLaunch", "build", "native_refusal"]

_Launch = Callable[[tuple[int, ...], Mapping[str, Any]], bool]
#: Launch through the C path where it was built and a kernel allows it. ``WARMREG_NATIVE_LAUNCH=0``
#: in the environment (read at import) keeps the Python fast path (for comparisons and debugging).
NATIVE: bool = _cdispatch is not None and os.environ.get("WARMREG_NATIVE_LAUNCH", "1") != "0"

#: Triton's width of a specialized int (the same in 3.6-3.9): i32 when it fits, u64 from 2**63, i64 otherwise.
_WIDTH = {
    "i32": "-2147483648 <= {v} < 2147483648",
    "i64": "-9223372036854775808 <= {v} < 9223372036854775808 and not -2147483648 <= {v} < 2147483648",
    "u64": "9223372036854775808 <= {v} < 18446744073709551616",
}
#: An int parameter annotated with its type (``stride: tl.int64``) keeps that type whatever its value.
_ANNOTATED_WIDTH = {"i64": "-9223372036854775808 <= {v} < 9223372036854775808", "u64": "0 <= {v} < 18446744073709551616"}


class FastLaunch:
    """A compiled kernel with the guards of one specialization. ``made()`` returns the Python
    guard-and-launch function's source and the function (cached: see ``python``).

    :ivar launch: ``launch(grid, kwargs) -> bool``: checks the guards and launches, or returns
        ``False`` without launching. The C entry's ``launch`` where there is one (its fallback is
        the Python function), else the Python function.
    :ivar device: the device id whose loaded module it launches.
    :ivar jit: the ``@triton.jit`` function it was built from: a launch whose kernel serves the key
        with another one (against the contract) takes Triton's path instead.
    :ivar compiled: the ``CompiledKernel`` it launches; holding it keeps the module loaded (Triton
        3.8+ unloads a module when its ``CompiledKernel`` is collected, e.g. after the jit function's
        ``device_caches`` are cleared).
    :ivar python: the generated Python function. Beside a C entry it is generated at its first use (the C
        guards refused a launch, or ``python`` or ``source`` was read), not at warm: compiling its
        source was most of an entry's build.
    :ivar native: the C entry (``warmreg.runtime._cdispatch.Entry``), or ``None`` where the kernel or the
        install has none.
    """

    __slots__ = ("__weakref__", "_made", "compiled", "device", "jit", "launch", "native")

    def __init__(self, made: Callable[[], tuple[str, _Launch]], device: int, jit: Any = None, compiled: Any = None, native: Any = None) -> None:
        self._made, self.device, self.jit, self.compiled, self.native = made, device, jit, compiled, native
        self.launch = native.launch if native is not None else self.python

    python = property(lambda self: self._made()[1])
    source = property(lambda self: self._made()[0], doc="the Python function's source (for review and tests)")


def _device_getter() -> Callable[[], int]:
    """Triton's current-device function, or torch's C getter behind it once CUDA is initialized
    (``torch.cuda.current_device`` re-checks lazy initialization on every call)."""
    getter = _driver.active.get_current_device
    if getter is torch.cuda.current_device and torch.cuda.is_initialized():
        return torch._C._cuda_getDevice
    return getter


#: Guard kinds shared by the Python and the C launch (the numbers are ``_cdispatch.c``'s).
_PTR, _INT, _F32, _BOOL, _CONST, _NONE = range(6)
_ALIGNED, _UNALIGNED, _ANY_ALIGNMENT = range(3)
_W_I32, _W_I64_WIDE, _W_U64_HIGH, _W_I64, _W_U64 = range(5)
_NE1, _DIV16, _NDIV16, _EQ = 1, 2, 4, 8
_WIDTH_CODE = {"i32": _W_I32, "i64": _W_I64_WIDE, "u64": _W_U64_HIGH}
_ANNOTATED_CODE = {"i64": _W_I64, "u64": _W_U64}
_WIDTH_COND = {
    _W_I32: _WIDTH["i32"], _W_I64_WIDE: _WIDTH["i64"], _W_U64_HIGH: _WIDTH["u64"],
    _W_I64: _ANNOTATED_WIDTH["i64"], _W_U64: _ANNOTATED_WIDTH["u64"],
}  # fmt: skip


def build(
    jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any], compiled: Any, device: int,
    *, require_cuda: bool = True,
) -> FastLaunch | None:  # fmt: skip
    """The guarded fast launch of ``compiled``, which ``jit`` just launched with ``kwargs`` on ``device``.

    ``require_cuda=False`` lets the C guards accept CPU tensors: only for tests, which check the
    guards and the packed parameters with ``native.pack`` and launch nothing.

    Returns ``None`` where the arguments hold something the guards cannot check cheaply (tuples,
    tensor descriptors, objects other than tensors and scalars) or the jit function has pre-run hooks:
    such launches always take Triton's path.
    """
    if jit.pre_run_hooks or not hasattr(compiled, "packed_metadata"):
        return None
    full = run_kwargs(jit, kwargs, options)
    binder = jit.device_caches[device][4]
    bound, specialization, _ = binder(**full)
    guards = []
    for param, (ty, spec) in zip(jit.params, specialization):
        guard = _guard(param, ty, spec, bound[param.name])
        if guard is None:
            return None
        absent = param.name not in kwargs  # only a default is kept: never the caller's tensors
        guards.append((param.name, absent, bound[param.name] if absent else None, guard))
    runtime = triton.knobs.runtime
    # what else Triton's key and launch read per call: globals the kernel used, the launch hooks,
    # the debug flag and the knobs JITFunction.run folds into the options, and the current device
    env_checks: list[tuple[Any, str, Any, bool, bool]] = [
        (globals_dict, name, val, False, False) for (name, _), (val, globals_dict) in jit.used_global_vals.items()
    ]
    for hook in ("launch_enter_hook", "launch_exit_hook"):
        chain = getattr(runtime, hook)
        env_checks.append((runtime, hook, chain, True, isinstance(chain, HookChain)))
    env_checks.append((runtime, "debug", runtime.debug, False, False))
    for name, path in RELEASE.run_option_knobs:
        group, _, attr = path.partition(".")
        env_checks.append((getattr(triton.knobs, group), attr, full[name], False, False))
    device_of, stream_of = _device_getter(), _driver.active.get_current_stream
    made = functools.cache(functools.partial(_python_launch, jit, compiled, len(kwargs), guards, env_checks, device_of, stream_of, device))
    native = _native_launch(compiled, len(kwargs), guards, env_checks, device_of, stream_of, device, lambda g, kw: made()[1](g, kw), require_cuda)
    return FastLaunch(made, int(device), jit, compiled, native)


def _python_launch(
    jit: JITFunction, compiled: Any, nkw: int, guards: list[Any], env_checks: list[Any],
    device_of: Any, stream_of: Any, device: int,
) -> tuple[str, Callable[[tuple[int, ...], Mapping[str, Any]], bool]]:  # fmt: skip
    """The generated Python guard-and-launch function (source, function)."""
    env: dict[str, Any] = {"_run": launcher_now(compiled), "_fn": compiled.function, "_packed": compiled.packed_metadata}
    env.update(_device_of=device_of, _stream_of=stream_of)
    fetch, checks, args = [], [], []
    for i, (name, absent, value, guard) in enumerate(guards):
        var = f"a{i}"
        args.append(var)
        if absent:  # a default Triton filled in: the launcher did not pass it
            env[f"_d{i}"] = value
            checks.append(f"{name!r} not in kw")
            fetch.append(f"        {var} = _d{i}")
        else:
            fetch.append(f"        {var} = kw[{name!r}]")
        check = _condition(var, i, guard, env)
        if check:
            checks.append(f"({check})")
    for j, (obj, attr, value, identity, empty_calls) in enumerate(env_checks):
        env[f"_e{j}"], env[f"_v{j}"] = obj, value
        got = f"_e{j}.get({attr!r}, _run)" if isinstance(obj, dict) else f"_e{j}.{attr}"
        checks.append(f"{got} {'is' if identity else '=='} _v{j}" + (f" and not _v{j}.calls" if empty_calls else ""))
    checks.append(f"_device_of() == {int(device)}")
    lines = [
        "def launch(grid, kw):",
        f"    if len(kw) != {nkw}: return False",
        "    try:",
        *fetch,
        "        if not (" + "\n                and ".join(checks) + "):",
        "            return False",
        "    except (KeyError, AttributeError, TypeError):  # a missing argument, or not tensor-like",
        "        return False",
        "    n = len(grid)",
        "    _run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, "
        f"_stream_of({int(device)}), _fn, _packed, None, None, None, {', '.join(args)})",
        "    return True",
    ]
    source = "\n".join(lines) + "\n"
    exec(_code(source, jit.fn.__qualname__), env)
    return source, env["launch"]


def native_refusal(compiled: Any) -> str | None:
    """Why the C launch cannot launch ``compiled`` (``None``: it can): what only Triton's launcher does."""
    if _cdispatch is None:
        return "warmreg.runtime._cdispatch was not built (no C compiler at install)"
    md = getattr(compiled, "metadata", None)
    if md is None:
        return "no compiled kernel metadata"
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return "the kernel uses global or profile scratch memory"
    if getattr(md, "tensordesc_meta", None):
        return "the kernel takes tensor descriptors"
    if "gsan" in str(getattr(md, "instrumentation_mode", "") or ""):
        return "the kernel is instrumented by the sanitizer"
    packed = compiled.packed_metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and all(isinstance(v, int) for v in packed)):
        return f"unknown launch metadata {packed!r}"
    return None


def _native_launch(
    compiled: Any, nkw: int, guards: list[Any], env_checks: list[Any], device_of: Any, stream_of: Any,
    device: int, fallback: Any, require_cuda: bool,
) -> Any:  # fmt: skip
    """The C entry of the same guards (``None`` where :func:`native_refusal` says no or it is off)."""
    if not NATIVE or _cdispatch is None or native_refusal(compiled) is not None:
        return None
    specs = []
    for name, absent, value, (kind, mode, flags, obj) in guards:
        cls = type(obj) if kind == _CONST else None
        specs.append((name, absent, kind, mode, flags, obj, cls, value, _dtype_code(obj) if kind == _PTR else -1))
    num_warps, num_ctas, shared = compiled.packed_metadata
    md = compiled.metadata
    return _cdispatch.Entry(
        function=int(compiled.function), num_warps=num_warps, num_ctas=num_ctas, shared=shared,
        launch_pdl=bool(md.launch_pdl), cooperative=bool(md.launch_cooperative_grid), device=int(device), nkw=nkw,
        args=tuple(specs), checks=tuple(env_checks), get_device=device_of, get_stream=stream_of,
        fallback=fallback, keep=compiled, require_cuda=require_cuda,
    )  # fmt: skip


#: Whether the C entries read a tensor's dtype, device and data pointer through torch's C shim (the AOTI ABI,
#: no Python call per read) rather than torch.Tensor's getters: where ``_cdispatch.tensor_abi`` finds that the shim
#: agrees with the getters on sample tensors, unless ``WARMREG_TENSOR_ABI=0`` (read at import; for comparisons).
TENSOR_ABI: bool = os.environ.get("WARMREG_TENSOR_ABI", "1") != "0"


@functools.cache
def _tensor_abi() -> bool:
    """Turn the C entries' shim reads on, once per process (``False``: the getters stay)."""
    if not TENSOR_ABI or _cdispatch is None:
        return False
    base = torch.arange(40, dtype=torch.int64)
    samples = (
        torch.empty(3, dtype=torch.float32), base[5:], torch.zeros(2, 3, dtype=torch.bfloat16).t(),
        torch.nn.Parameter(torch.ones(4, dtype=torch.float16)), torch.empty(0, dtype=torch.int8), base.view(torch.float64),
    )  # fmt: skip
    return bool(_cdispatch.tensor_abi(samples) >= 0)


@functools.cache
def _dtype_code(dtype: Any) -> int:
    """torch's ScalarType number of ``dtype`` as the C entries compare it (-1: they compare the dtype object)."""
    if not isinstance(dtype, torch.dtype) or not _tensor_abi():
        return -1
    return int(_cdispatch.dtype_code(torch.empty(0, dtype=dtype)))


@functools.lru_cache(maxsize=1024)
def _code(source: str, name: str) -> Any:
    # the keys of one kernel mostly differ only in the values bound in ``env``, not in the source:
    # compile each distinct source once (compiling is ~0.7 ms; a warm builds an entry per key)
    return compile(source, f"<warmreg fast launch of {name}>", "exec")


def _guard(param: Any, ty: str, spec: Any, value: Any) -> tuple[int, int, int, Any] | None:
    """``(kind, mode, flags, object)``: the condition under which Triton specializes an argument
    exactly as it did ``value`` (``None`` when there is no cheap exact condition)."""
    cls = type(value)
    if not isinstance(ty, str):  # tuples of arguments
        return None
    if param.is_constexpr or ty == "constexpr":  # constexpr params, ints equal to 1, None
        if not isinstance(value, (int, float, str, bool, type(None), tl.dtype)):
            return None
        return (_NONE, 0, 0, None) if value is None else (_CONST, 0, 0, value)
    if ty.startswith("*"):
        if not hasattr(value, "data_ptr") or not hasattr(value, "dtype"):
            return None
        # Triton reads only dtype and data_ptr() of a tensor-like
        if spec == "D":
            return (_PTR, _ALIGNED, 0, value.dtype)
        if param.do_not_specialize or param.do_not_specialize_on_alignment:
            return (_PTR, _ANY_ALIGNMENT, 0, value.dtype)
        return (_PTR, _UNALIGNED, 0, value.dtype)
    if ty in _WIDTH and cls is int:
        annotated = getattr(param, "annotation_type", None) == ty
        width = _ANNOTATED_CODE.get(ty, _WIDTH_CODE[ty]) if annotated else _WIDTH_CODE[ty]
        if param.do_not_specialize:
            return (_INT, width, 0, None)
        if annotated and spec not in ("D", ""):  # an annotated int keeps its type; Triton keys 1 by its value
            return (_INT, width, _EQ, value)
        if spec == "D":
            return (_INT, width, _NE1 | _DIV16, None)
        if param.do_not_specialize_on_alignment:
            return (_INT, width, _NE1, None)
        return (_INT, width, _NE1 | _NDIV16, None)
    if ty == "fp32" and cls is float:
        return (_F32, 0, 0, None)
    if ty == "u1" and cls is bool:
        return (_BOOL, 0, 0, None)
    return None


def _condition(var: str, i: int, guard: tuple[int, int, int, Any], env: dict[str, Any]) -> str:
    """The Python condition of a guard on ``var`` (``""`` for none); binds its objects in ``env``."""
    kind, mode, flags, obj = guard
    if kind == _NONE:
        return f"{var} is None"
    if kind == _CONST:
        env[f"_c{i}"], env[f"_cc{i}"] = obj, type(obj)
        return f"{var}.__class__ is _cc{i} and {var} == _c{i}"
    # whether a value is 16-aligned is bound in env (``_z{i}``), not written into the source, so keys
    # that differ only in it share one source and its compiled code (:func:`_code`)
    if kind == _PTR:
        env[f"_dt{i}"] = obj
        cond = f"{var}.dtype is _dt{i}"
        if mode == _ANY_ALIGNMENT:
            return cond
        env[f"_z{i}"] = mode == _ALIGNED
        return cond + f" and (({var}.data_ptr() & 15) == 0) is _z{i}"
    if kind == _INT:
        cond = f"{var}.__class__ is int and " + _WIDTH_COND[mode].format(v=var)
        if flags & _EQ:
            env[f"_c{i}"] = obj
            cond += f" and {var} == _c{i}"
        if flags & _NE1:
            cond += f" and {var} != 1"
        if flags & (_DIV16 | _NDIV16):
            env[f"_z{i}"] = bool(flags & _DIV16)
            cond += f" and (({var} & 15) == 0) is _z{i}"
        return cond
    return f"{var}.__class__ is {'float' if kind == _F32 else 'bool'}"
