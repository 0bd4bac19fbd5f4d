"""Everything warmreg knows about Triton's internals: this module and its siblings ``_triton_cache``
(the disk cache and its key), ``_triton_interp`` (the interpreter), ``_triton_fast`` (the guarded
fast launch) and ``_triton_launchers`` (C launchers for packs).

Each rule names the Triton release it was checked against (3.6.0). ``tests/test_triton_adapter.py``
tests each internal this module relies on, so a Triton upgrade that moves one fails there first,
and :func:`check_version` refuses an unsupported release with one readable line.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver as _driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key

from . import _triton_launchers
from .errors import TargetError, WarmregError
from .platform import Platform

__all__ = [
    "SUPPORTED_TRITON",
    "check_version",
    "cross_target",
    "gpu_target",
    "specialization_key",
]

#: Triton releases whose internals this module was checked against.
SUPPORTED_TRITON = ("3.6",)


class UnsupportedTriton(WarmregError):
    """The installed Triton release is not one warmreg's adapter was checked against."""


def check_version(version: str = triton.__version__) -> None:
    """Refuse a Triton release the adapter does not support, in one line.

    :raises UnsupportedTriton: naming the installed and the supported releases.
    """
    if not any(version == s or version.startswith(s + ".") for s in SUPPORTED_TRITON):
        raise UnsupportedTriton(
            f"Triton {version} is not supported by this warmreg (supported: {', '.join(SUPPORTED_TRITON)})",
            fix="pip install 'triton==3.6.0' or a warmreg release that supports this Triton",
        )


def gpu_target(platform: Platform) -> GPUTarget:
    """Triton's ``GPUTarget`` for a platform (3.6.0: backend ``cuda``/``hip``, warp 32/64).

    :raises TargetError: for XPU, which the PyPI Triton wheel cannot compile for.
    """
    if platform.is_cuda:
        return GPUTarget("cuda", platform.sm, 32)
    if platform.is_rocm:
        return GPUTarget("hip", str(platform.arch), 64)
    raise TargetError(platform.target, "cannot be cross-compiled with this Triton", fix="warm on the XPU host itself")


# Triton keeps one binder and backend per device id (JITFunction.device_caches): every cross target
# needs its own id, or a second target reuses the first one's backend. Ids start far above real GPUs.
_device_ids: dict[str, int] = {}
_ids_lock = threading.Lock()


def _device_id(platform: Platform) -> int:
    with _ids_lock:
        return _device_ids.setdefault(platform.target, 10_000 + len(_device_ids))


class _CrossTargetDriver(DriverBase):
    """A stand-in driver that reports a named target, so ``JITFunction.warmup`` compiles for it."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.target = gpu_target(platform)
        self.device = _device_id(platform)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def get_benchmarker(self) -> Any:
        raise TargetError(self.platform.target, "cannot run benchmarks (cross target)", fix="autotune on the GPU host")

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_cross_lock = threading.RLock()


@contextlib.contextmanager
def cross_target(platform: Platform) -> Iterator[None]:
    """Make Triton compile for ``platform`` while the block runs (a no-op for the local GPU).

    Triton's driver is process-global (``triton.runtime.driver.driver``), so cross-target blocks are
    serialized with a lock, and the previous driver is restored exactly on exit.
    """
    if platform.local:
        yield
        return
    with _cross_lock:
        previous = _driver._active  # 3.6.0: DriverConfig keeps the active driver here
        _driver.set_active(_CrossTargetDriver(platform))
        try:
            yield
        finally:
            _driver._active = previous


def current_device() -> int:
    """The device id Triton's ``JITFunction.run`` uses right now."""
    return int(_driver.active.get_current_device())


def set_device(device: int) -> None:
    """Make ``device`` current on this thread (Triton loads modules onto the current device)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(device)


def specialize(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, str]:
    """Triton's in-memory cache key for a launch and its serialized specialization (Triton 3.6.0).

    The key is ``JITFunction.run``'s ``key``, the string Triton's JIT hooks receive, so warmed
    launches and runtime compiles can be matched exactly. The specialization data is what Triton's
    hooks report as ``specialization_data`` and what ``JITFunction.preload`` compiles from: packs and
    distributed warms ship it instead of anything pickled.
    """
    from triton.runtime.jit import serialize_specialization_data

    full = dict(kwargs)
    full.update(options)
    full["debug"] = full.get("debug", jit.debug) or triton.knobs.runtime.debug
    full["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    _, key_cache, _, backend, binder = jit.device_caches[current_device()]
    bound_args, specialization, opts = binder(**full)
    key = str(compute_cache_key(key_cache, specialization, opts))
    parsed, signature, constexprs, attrs = jit._pack_args(backend, full, bound_args, specialization, opts)
    data = serialize_specialization_data(full_name(jit), signature, constexprs, attrs, parsed, key)
    return key, str(data)


def specialization_key(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """Triton's in-memory cache key for a launch (see :func:`specialize`)."""
    return specialize(jit, kwargs, options)[0]


def cache_files(compiled: Any) -> dict[str, str]:
    """A compiled kernel's metadata JSON and binary in the cache: child name -> path (3.6.0 ``metadata_group``)."""
    group = dict(getattr(compiled, "metadata_group", {}) or {})
    return {name: path for name, path in group.items() if name.endswith((".json", ".cubin", ".hsaco"))}


_touched: weakref.WeakSet[JITFunction] = weakref.WeakSet()


def warmup(jit: JITFunction, grid: tuple[int, ...], kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """Compile without launching (``JITFunction.warmup``); returns a CompiledKernel or FutureKernel."""
    _touched.add(jit)
    return jit.warmup(grid=grid, **kwargs, **options)


def forget_compiled() -> None:
    """Drop the in-memory kernels of every jit function warmreg warmed (Triton keeps them per
    device id in ``JITFunction.device_caches``), so the next warm reads the disk cache again."""
    for jit in list(_touched):
        jit.device_caches.clear()


_launcher_locks: dict[str, threading.Lock] = {}


def finish_load(compiled: Any) -> None:
    """Do at warm what Triton 3.6.0 otherwise leaves to the first launch: build the C launcher and
    load the binary onto the device (``CompiledKernel._init_handles``).

    Triton builds one C launcher per distinct launcher source (23 for the 71 DeepSeek-V4-Flash keys;
    constexpr values such as block sizes do not change it) and caches it on disk, but concurrent first
    loads of one launcher each run the C compiler. Loads that share a launcher therefore take turns:
    the first builds it, the others load it (a cold Flash warm on the H200 host: 23 compiler runs).
    """
    if getattr(compiled, "module", None) is not None:
        return
    src = compiled.src
    signature, constants = getattr(src, "signature", None), getattr(src, "constants", None)
    if signature is None or constants is None:  # not an ASTSource: no way to tell launchers apart
        compiled._init_handles()
        return
    identity = _launcher_identity(compiled, signature, constants)
    with _ids_lock:
        lock = _launcher_locks.setdefault(identity, threading.Lock())
    with lock:
        compiled._init_handles()


def _launcher_identity(compiled: Any, signature: Any, constants: Any) -> str:
    """What tells one C launcher from another: on CUDA, Triton's own cache key for the launcher's
    source (which constexpr values such as block sizes leave unchanged); elsewhere the signature and
    constants."""
    if getattr(getattr(compiled.metadata, "target", None), "backend", None) == "cuda":
        return _triton_launchers.launcher_source(compiled)[0]
    tensordesc = getattr(compiled.metadata, "tensordesc_meta", None)
    return repr((sorted(signature.items()), sorted(constants.items(), key=repr), tensordesc))


def is_jit(obj: Any) -> bool:
    """Whether ``obj`` is a ``@triton.jit`` function (compiled or, under TRITON_INTERPRET=1, interpreted)."""
    return isinstance(obj, (JITFunction, InterpretedFunction))


def full_name(jit: Any) -> str:
    """Triton's full name of a jit function (``module.qualname``), as its hooks report it."""
    fn = jit.fn
    return f"{fn.__module__}.{fn.__qualname__}"


def source_hash(jit: JITFunction) -> str:
    """Triton's hash of a kernel's source and its dependencies (``JITCallable.cache_key``)."""
    return str(jit.cache_key)


# -- hooks (monitor) ----------------------------------------------------------------------------


def get_jit_cache_hook() -> Any:
    """Triton's single pre-compile hook slot (``knobs.runtime.jit_cache_hook``, 3.6.0)."""
    return triton.knobs.runtime.jit_cache_hook


def set_jit_cache_hook(hook: Any) -> None:
    triton.knobs.runtime.jit_cache_hook = hook


def add_load_hook(hook: Any) -> None:
    """Add to Triton's kernel-load-start chain (called before a module is loaded onto the device)."""
    triton.knobs.runtime.kernel_load_start_hook.add(hook)


def remove_load_hook(hook: Any) -> None:
    triton.knobs.runtime.kernel_load_start_hook.remove(hook)


def load_hooks() -> tuple[Any, ...]:
    return tuple(triton.knobs.runtime.kernel_load_start_hook.calls)


_AUTOTUNER_BENCH = None


def wrap_autotuner_bench(before: Any) -> None:
    """Call ``before(autotuner)`` before every benchmark the autotuner runs (``Autotuner._bench``)."""
    global _AUTOTUNER_BENCH
    from triton.runtime.autotuner import Autotuner

    if _AUTOTUNER_BENCH is not None:
        return
    original = Autotuner._bench
    _AUTOTUNER_BENCH = original

    def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self)
        return original(self, *args, **kwargs)

    Autotuner._bench = _bench  # type: ignore[method-assign]


def unwrap_autotuner_bench() -> None:
    global _AUTOTUNER_BENCH
    from triton.runtime.autotuner import Autotuner

    if _AUTOTUNER_BENCH is not None:
        Autotuner._bench = _AUTOTUNER_BENCH  # type: ignore[method-assign]
        _AUTOTUNER_BENCH = None


def parse_specialization_key(key: str) -> tuple[list[Any], dict[str, Any]] | None:
    """Split Triton's in-memory key ``str(specialization) + str(options)`` back into its parts.

    :returns: ``None`` when a value is not a Python literal (e.g. a dtype constexpr).
    """
    import ast

    cut = key.rfind("]{")
    if cut < 0:
        return None
    try:
        return list(ast.literal_eval(key[: cut + 1])), dict(ast.literal_eval(key[cut + 1 :]))
    except (ValueError, SyntaxError):
        return None


def param_names(jit: Any) -> list[str]:
    """Names of a jit function's parameters, in order (``JITFunction.arg_names``)."""
    return list(jit.arg_names)
