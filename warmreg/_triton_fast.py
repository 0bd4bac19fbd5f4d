"""The guarded fast launch: a warmed key's compiled kernel, launched without Triton's per-call binding.

Part of the Triton adapter (checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0; tested in
``tests/test_fast_launch.py``). What differs between releases comes from
:data:`warmreg._triton_release.RELEASE`: the knobs ``JITFunction.run`` folds into a launch's options
(3.9 adds ``fpsan_homomorphic_casts``), and from 3.8 on ``CompiledKernel.__del__`` unloads its module,
so an entry holds its ``CompiledKernel`` (and so its module) for as long as it can launch it.

``JITFunction.run`` spends most of a small launch's host time on work that repeats identically for
every call of one compile key: binding the arguments, specializing each one, formatting the cache key
as a string, checking globals, building launch metadata and calling two empty launch-hook chains
from C. A warmreg launch already knows its compile key, so after the first launch of a key on a device
(which goes through ``JITFunction.run`` and therefore through the monitor, the cache and the
compiler like any launch), :func:`build` records what Triton chose for it and returns a
:class:`FastLaunch`: one generated function that re-checks, per call, every property of the arguments
Triton specializes on (a tensor's dtype and 16-byte alignment; integer width, divisibility by 16
and the value 1; the type of floats and bools; constexpr values and arguments Triton turned into
constants) and then calls the compiled kernel's launcher directly. If any check fails, a launch hook
is installed (a profiler), Triton's debug or instrumentation knob changed, or a global the kernel
read has changed, it returns ``False`` and the caller
takes Triton's ordinary path: the fast path can be slower than needed, never wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import triton
import triton.language as tl
from triton.knobs import HookChain
from triton.runtime.driver import driver as _driver
from triton.runtime.jit import JITFunction

from ._triton import run_kwargs
from ._triton_release import RELEASE

__all__ = ["FastLaunch", "build"]

#: Triton's width of a specialized int (the same in 3.6-3.9): i32 when it fits, u64 from 2**63, i64 otherwise.
_WIDTH = {
    "i32": "-2147483648 <= {v} < 2147483648",
    "i64": "-9223372036854775808 <= {v} < 9223372036854775808 and not -2147483648 <= {v} < 2147483648",
    "u64": "9223372036854775808 <= {v} < 18446744073709551616",
}
#: An int parameter annotated with its type (``stride: tl.int64``) keeps that type whatever its value.
_ANNOTATED_WIDTH = {"i64": "-9223372036854775808 <= {v} < 9223372036854775808", "u64": "0 <= {v} < 18446744073709551616"}


class FastLaunch:
    """A compiled kernel with the guards of one specialization.

    :ivar launch: ``launch(grid, kwargs) -> bool``: checks the guards and launches, or returns
        ``False`` without launching.
    :ivar device: the device id whose loaded module it launches.
    :ivar source: the generated guard-and-launch function's source (for review and tests).
    :ivar jit: the ``@triton.jit`` function it was built from: a launch whose kernel serves the key
        with another one (against the contract) takes Triton's path instead.
    :ivar compiled: the ``CompiledKernel`` it launches; holding it keeps the module loaded (Triton
        3.8+ unloads a module when its ``CompiledKernel`` is collected, e.g. after the jit function's
        ``device_caches`` are cleared).
    """

    __slots__ = ("compiled", "device", "jit", "launch", "source")

    def __init__(
        self,
        launch: Callable[[tuple[int, ...], Mapping[str, Any]], bool],
        device: int,
        source: str,
        jit: Any = None,
        compiled: Any = None,
    ) -> None:
        self.launch = launch
        self.device = device
        self.source = source
        self.jit = jit
        self.compiled = compiled


def _device_getter() -> Callable[[], int]:
    """Triton's current-device function, or torch's C getter behind it once CUDA is initialized
    (``torch.cuda.current_device`` re-checks lazy initialization on every call)."""
    import torch

    getter = _driver.active.get_current_device
    if getter is torch.cuda.current_device and torch.cuda.is_initialized():
        return torch._C._cuda_getDevice
    return getter


def build(
    jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any], compiled: Any, device: int
) -> FastLaunch | None:
    """The guarded fast launch of ``compiled``, which ``jit`` just launched with ``kwargs`` on ``device``.

    Returns ``None`` where the arguments hold something the guards cannot check cheaply (tuples,
    tensor descriptors, objects other than tensors and scalars) or the jit function has pre-run hooks:
    such launches always take Triton's path.
    """
    if jit.pre_run_hooks or not hasattr(compiled, "packed_metadata"):
        return None
    full = run_kwargs(jit, kwargs, options)
    binder = jit.device_caches[device][4]
    bound, specialization, _ = binder(**full)
    runtime = triton.knobs.runtime
    env: dict[str, Any] = {"_run": compiled.run, "_fn": compiled.function, "_packed": compiled.packed_metadata}
    env.update(_rt=runtime, _enter=runtime.launch_enter_hook, _exit=runtime.launch_exit_hook)
    env.update(_device_of=_device_getter(), _stream_of=_driver.active.get_current_stream)
    fetch, checks, args = [], [], []
    for i, (param, (ty, spec)) in enumerate(zip(jit.params, specialization)):
        value, var = bound[param.name], f"a{i}"
        args.append(var)
        if param.name in kwargs:
            fetch.append(f"        {var} = kw[{param.name!r}]")
        else:  # a default Triton filled in: the launcher did not pass it
            env[f"_d{i}"] = value
            checks.append(f"{param.name!r} not in kw")
            fetch.append(f"        {var} = _d{i}")
        check = _guard(var, i, param, ty, spec, value, env)
        if check is None:
            return None
        checks.append(f"({check})")
    for j, ((name, _), (val, globals_dict)) in enumerate(jit.used_global_vals.items()):
        env[f"_g{j}"], env[f"_gd{j}"] = val, globals_dict
        checks.append(f"_gd{j}.get({name!r}, _run) == _g{j}")
    hooks_idle = [f"_rt.{h} is {v}" + (f" and not {v}.calls" if isinstance(env[v], HookChain) else "")
                  for h, v in (("launch_enter_hook", "_enter"), ("launch_exit_hook", "_exit"))]  # fmt: skip
    # Triton's key also holds the debug flag and the knobs JITFunction.run reads per call
    env.update(_dbg=runtime.debug)
    knob_checks = []
    for j, (_name, path) in enumerate(RELEASE.run_option_knobs):
        group, _, attr = path.partition(".")
        env[f"_kg{j}"], env[f"_kv{j}"] = getattr(triton.knobs, group), full[_name]
        knob_checks.append(f"_kg{j}.{attr} == _kv{j}")
    checks += [*hooks_idle, "_rt.debug == _dbg", *knob_checks, f"_device_of() == {int(device)}"]
    lines = [
        "def launch(grid, kw):",
        f"    if len(kw) != {len(kwargs)}: return False",
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
    return FastLaunch(env["launch"], int(device), source, jit, compiled)


@functools.lru_cache(maxsize=1024)
def _code(source: str, name: str) -> Any:
    # the keys of one kernel mostly differ only in the values bound in ``env``, not in the source:
    # compile each distinct source once (compiling is ~0.7 ms; a warm builds an entry per key)
    return compile(source, f"<warmreg fast launch of {name}>", "exec")


def _guard(var: str, i: int, param: Any, ty: str, spec: Any, value: Any, env: dict[str, Any]) -> str | None:
    """The Python condition under which Triton specializes ``var`` exactly as it did ``value``
    (``""`` for no condition, ``None`` when there is no cheap exact condition)."""
    cls = type(value)
    if not isinstance(ty, str):  # tuples of arguments
        return None
    if param.is_constexpr or ty == "constexpr":  # constexpr params, ints equal to 1, None
        if not isinstance(value, (int, float, str, bool, type(None), tl.dtype)):
            return None
        if value is None:
            return f"{var} is None"
        env[f"_c{i}"] = value
        env[f"_cc{i}"] = cls
        return f"{var}.__class__ is _cc{i} and {var} == _c{i}"
    if ty.startswith("*"):
        if not hasattr(value, "data_ptr") or not hasattr(value, "dtype"):
            return None
        env[f"_dt{i}"] = value.dtype  # Triton reads only dtype and data_ptr() of a tensor-like
        cond = f"{var}.dtype is _dt{i}"
        if spec == "D":
            return cond + f" and not ({var}.data_ptr() & 15)"
        if param.do_not_specialize or param.do_not_specialize_on_alignment:
            return cond
        return cond + f" and ({var}.data_ptr() & 15)"
    if ty in _WIDTH and cls is int:
        annotated = getattr(param, "annotation_type", None) == ty
        width = _ANNOTATED_WIDTH.get(ty) if annotated else None
        cond = f"{var}.__class__ is int and " + (width or _WIDTH[ty]).format(v=var)
        if param.do_not_specialize:
            return cond
        if annotated and spec not in ("D", ""):  # an annotated int keeps its type; Triton keys 1 by its value
            env[f"_c{i}"] = value
            return cond + f" and {var} == _c{i}"
        cond += f" and {var} != 1"
        if spec == "D":
            return cond + f" and not ({var} & 15)"
        if param.do_not_specialize_on_alignment:
            return cond
        return cond + f" and ({var} & 15)"
    if ty in ("fp32", "u1") and cls in (float, bool):
        return f"{var}.__class__ is {cls.__name__}"
    return None
