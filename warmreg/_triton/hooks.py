"""Triton's hooks as the JIT monitor uses them: the pre-compile hook, the JIT cache hook, load hooks, the autotuner's bench.

Part of the Triton adapter (:mod:`warmreg._triton`); checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import triton

__all__ = ["CompileRequest", "HookHandle", "add_load_hook", "get_jit_cache_hook", "install_compile_hook", "load_hooks", "only_own_compile_hook", "remove_compile_hook", "remove_load_hook", "set_jit_cache_hook", "unwrap_autotuner_bench", "wrap_autotuner_bench"]

log = logging.getLogger("warmreg._triton")

_load_wrappers: dict[Callable[[str], None], Callable[..., None]] = {}


@attrs.frozen(kw_only=True)
class CompileRequest:
    """A compile Triton is about to run, as its pre-compile hook (``knobs.runtime.jit_cache_hook``)
    describes it.

    :ivar key: Triton's in-memory cache key of the launch.
    :ivar jit_name: the jit function's full name; ``jit`` the function itself.
    :ivar specialization: readable signature, constants, attributes and options.
    :ivar specialization_data: Triton's own replayable serialization (``JITFunction.preload``).
    """

    key: str
    jit_name: str
    jit: Any
    specialization: dict[str, Any]
    specialization_data: str | None
    is_warmup: bool


def _request(key: Any, fn: Any, compile: Mapping[str, Any], is_warmup: bool) -> CompileRequest:
    spec: dict[str, Any] = {k: compile.get(k) for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
    spec["signature"] = {getattr(p, "name", str(p)): v for p, v in dict(compile.get("signature") or {}).items()}
    spec["constants"] = {str(k): str(v) for k, v in dict(compile.get("constants") or {}).items()}
    spec["attrs"] = {str(k): str(v) for k, v in dict((compile.get("configs") or [{}])[0]).items()}
    spec["manual_warmup"] = is_warmup
    return CompileRequest(
        key=str(key),
        jit_name=f"{fn.module}.{fn.name}",
        jit=getattr(fn, "jit_function", None),
        specialization=spec,
        specialization_data=compile.get("specialization_data"),
        is_warmup=is_warmup,
    )


@attrs.frozen
class HookHandle:
    """What :func:`install_compile_hook` installed and what was there before."""

    hook: Callable[..., Any]
    previous: Callable[..., Any] | None


def install_compile_hook(callback: Callable[[CompileRequest], None]) -> HookHandle:
    """Call ``callback`` before every compile Triton runs (it may raise to refuse the compile); the
    hook installed before keeps being called after it. Triton has one slot
    (``knobs.runtime.jit_cache_hook``, keyword arguments ``key, repr, fn, compile, is_manual_warmup,
    already_compiled``); :func:`remove_compile_hook` puts the previous one back."""
    previous = triton.knobs.runtime.jit_cache_hook

    def hook(*, key: Any, repr: str, fn: Any, compile: Any, is_manual_warmup: bool, already_compiled: bool) -> Any:
        callback(_request(key, fn, compile, is_manual_warmup))
        if previous is not None:
            return previous(
                key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, already_compiled=already_compiled
            )
        return None

    if previous is None or previous in _alone:
        _alone.add(hook)
    triton.knobs.runtime.jit_cache_hook = hook
    return HookHandle(hook, previous)


#: the hooks :func:`install_compile_hook` installed over no foreign hook
_alone: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def only_own_compile_hook() -> bool:
    """Whether Triton's pre-compile hook slot is empty or holds only hooks :func:`install_compile_hook`
    installed (the JIT monitor, which ignores a warm's own compiles): nothing else needs to see them."""
    hook = triton.knobs.runtime.jit_cache_hook
    return hook is None or hook in _alone


def remove_compile_hook(handle: HookHandle) -> None:
    """Undo :func:`install_compile_hook` (only if nobody replaced the hook since)."""
    if triton.knobs.runtime.jit_cache_hook is handle.hook:
        triton.knobs.runtime.jit_cache_hook = handle.previous


def get_jit_cache_hook() -> Any:
    """Triton's single pre-compile hook slot (``knobs.runtime.jit_cache_hook``)."""
    return triton.knobs.runtime.jit_cache_hook


def set_jit_cache_hook(hook: Any) -> None:
    triton.knobs.runtime.jit_cache_hook = hook


def add_load_hook(callback: Callable[[str], None]) -> None:
    """Call ``callback(jit_name)`` before Triton loads a kernel's module onto the device (its
    kernel-load-start hook chain, whose hooks take ``module, function, name, metadata_group, hash``)."""

    def hook(module: Any, function: Any, name: str, metadata_group: Any, hash: str) -> None:
        callback(name)

    _load_wrappers[callback] = hook
    triton.knobs.runtime.kernel_load_start_hook.add(hook)


def remove_load_hook(callback: Callable[[str], None]) -> None:
    hook = _load_wrappers.pop(callback, None)
    if hook is not None:
        triton.knobs.runtime.kernel_load_start_hook.remove(hook)


def load_hooks() -> tuple[Any, ...]:
    return tuple(triton.knobs.runtime.kernel_load_start_hook.calls)


_AUTOTUNER_BENCH = None


def wrap_autotuner_bench(before: Any) -> None:
    """Call ``before(name)`` before every benchmark the autotuner runs (``Autotuner._bench``), with the full
    name of the function it tunes (its ``base_fn``, or ``fn``; the autotuner's repr when it has neither)."""
    global _AUTOTUNER_BENCH
    from triton.runtime.autotuner import Autotuner

    if _AUTOTUNER_BENCH is not None:
        return
    original = Autotuner._bench
    _AUTOTUNER_BENCH = original

    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self, "base_fn", None) or getattr(self, "fn", None)
        before(f"{fn.__module__}.{fn.__qualname__}" if fn is not None and hasattr(fn, "__qualname__") else repr(self))
        return original(self, *args, **kwargs)

    Autotuner._bench = _bench  # type: ignore[method-assign]


def unwrap_autotuner_bench() -> None:
    global _AUTOTUNER_BENCH
    from triton.runtime.autotuner import Autotuner

    if _AUTOTUNER_BENCH is not None:
        Autotuner._bench = _AUTOTUNER_BENCH  # type: ignore[method-assign]
        _AUTOTUNER_BENCH = None
