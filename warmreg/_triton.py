"""Everything warmreg knows about Triton's internals, in one place.

Each rule names the Triton release it was checked against (3.6.0). ``tests/test_triton_adapter.py``
tests each internal this module relies on, so a Triton upgrade that moves one fails there first,
and :func:`check_version` refuses an unsupported release with one readable line.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver as _driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key

from .errors import TargetError, WarmregError
from .platform import Platform

__all__ = [
    "SUPPORTED_TRITON",
    "check_version",
    "cross_target",
    "gpu_target",
    "interpreted",
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


_key_thread: threading.Thread | None = None


def prefetch_triton_key() -> None:
    """Start computing Triton's ``triton_key()`` on a background thread, once per process.

    Triton 3.6.0 hashes its own sources and the 415 MB ``libtriton.so`` the first time any compile or
    cache lookup needs the key (~0.35 s on an H200 host); ``hashlib`` releases the GIL, so a warm
    overlaps it with loading plugins and planning. :func:`wait_triton_key` joins it.
    """
    global _key_thread
    with _ids_lock:
        if _key_thread is None:
            from triton.runtime import cache

            _key_thread = threading.Thread(target=cache.triton_key, name="warmreg-triton-key", daemon=True)
            _key_thread.start()


def wait_triton_key() -> None:
    """Wait for :func:`prefetch_triton_key` (a no-op when it never started or has finished), so the
    key is computed once rather than again on the calling thread."""
    thread = _key_thread
    if thread is not None:
        thread.join()


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

    Triton builds one C launcher per distinct signature and constants (23 for the 71 DeepSeek-V4-Flash
    keys) and caches it on disk, but concurrent first loads of one signature each run the C compiler.
    Loads that share a launcher therefore take turns: the first builds it, the others load it.
    """
    if getattr(compiled, "module", None) is not None:
        return
    src = compiled.src
    signature, constants = getattr(src, "signature", None), getattr(src, "constants", None)
    if signature is None or constants is None:  # not an ASTSource: no way to tell launchers apart
        compiled._init_handles()
        return
    tensordesc = getattr(compiled.metadata, "tensordesc_meta", None)
    identity = repr((sorted(signature.items()), sorted(constants.items(), key=repr), tensordesc))
    with _ids_lock:
        lock = _launcher_locks.setdefault(identity, threading.Lock())
    with lock:
        compiled._init_handles()


def _interpreted(jit: JITFunction) -> InterpretedFunction[Any]:
    # Cached on the object: hashing a JITFunction computes its cache_key, which must not happen
    # while the interpreter has patched triton.language.
    cached = jit.__dict__.get("_warmreg_interpreted")
    if cached is None:
        cached = InterpretedFunction(
            jit.fn,
            do_not_specialize=jit.do_not_specialize,
            do_not_specialize_on_alignment=jit.do_not_specialize_on_alignment,
        )
        jit.__dict__["_warmreg_interpreted"] = cached
    return cached


class _InterpretedLaunch:
    """``fn[grid](...)`` through Triton's interpreter, with nested ``@triton.jit`` helpers interpreted too."""

    def __init__(self, jit: Any) -> None:
        self.jit = jit

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            token = _INTERPRETING.set(True)
            saved = _snapshot_lang()
            try:
                return self.jit[grid](*args, **kwargs)
            finally:
                _restore_lang(saved)
                _INTERPRETING.reset(token)

        return launch


def interpreted(jit: Any) -> _InterpretedLaunch:
    """The same kernel run by Triton's interpreter (for CPU tensors), as ``TRITON_INTERPRET=1`` would.

    Under ``TRITON_INTERPRET=1`` the jit function already is interpreted. Otherwise a nested
    ``@triton.jit`` helper is a compiled ``JITFunction`` that refuses to be called from Python; while
    an interpreted launch runs, :func:`_jit_call` sends such calls to the interpreter instead
    (Triton 3.6.0: ``JITFunction.__call__`` only raises).
    """
    return _InterpretedLaunch(jit if isinstance(jit, InterpretedFunction) else _interpreted(jit))


def _lang_namespaces() -> list[Any]:
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


def _snapshot_lang() -> list[tuple[Any, dict[str, Any]]]:
    return [(ns, dict(vars(ns))) for ns in _lang_namespaces()]


def _restore_lang(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    """Undo every patch the interpreter left on triton.language.

    Triton 3.6.0's interpreter patches ``triton.language`` for a nested ``@triton.jit`` call and never
    restores it; later compiles in the same process would then fail deep in the code generator.
    """
    for ns, before in saved:
        now = dict(vars(ns))
        for name, value in now.items():
            if name.startswith("__"):
                continue
            if name not in before:
                delattr(ns, name)
            elif before[name] is not value:
                setattr(ns, name, before[name])


def _fix_interpreter_index() -> None:
    """Triton 3.6.0's interpreter converts a scalar with ``int(array_of_shape_1)``, which NumPy >= 2.4
    refuses, so ``for i in range(n)`` with a runtime ``n`` fails under the interpreter. Convert with
    ``.item()`` instead (interpreter only; compiled kernels are unaffected)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_warmreg_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._warmreg_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_interpreter_index()


_INTERPRETING: ContextVar[bool] = ContextVar("warmreg_interpreting", default=False)
_original_jit_call = JITFunction.__call__


def _jit_call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    if _INTERPRETING.get():
        return _interpreted(self)(*args, **kwargs)
    return _original_jit_call(self, *args, **kwargs)


JITFunction.__call__ = _jit_call  # type: ignore[method-assign]


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


def replay(fn_name: str, specialization_data: str, platform: Platform) -> Any:
    """Compile one recorded specialization with Triton's own ``JITFunction.preload``.

    :raises WarmregError: if the function cannot be imported.
    """
    jit = import_jit(fn_name)
    with cross_target(platform):
        return jit.preload(portable_specialization(specialization_data))


# -- cache (packs) ------------------------------------------------------------------------------


def cache_dir() -> str:
    """Triton's cache directory now (``knobs.cache.dir``, from TRITON_CACHE_DIR or ~/.triton/cache)."""
    path = triton.knobs.cache.dir
    if not path:
        raise WarmregError("Triton has no cache directory", fix="set TRITON_CACHE_DIR")
    return str(path)


def memory_kernel(jit: JITFunction, triton_key: str, platform: Platform) -> Any:
    """The CompiledKernel a warm left in ``jit``'s in-memory cache for ``platform`` (or ``None``)."""
    device = current_device() if platform.local else _device_id(platform)
    caches = jit.device_caches.get(device)  # a plain get: a missing device must not create a binder
    return caches[0].get(triton_key) if caches is not None else None


def cache_subdir(binary_hash: str) -> str:
    """Directory name of one cache entry: base32 of the hash (``triton.runtime.cache._base32``)."""
    from triton.runtime.cache import _base32

    return str(_base32(binary_hash))


def ptxas_version(platform: Platform) -> str | None:
    """The ptxas release Triton uses for this CUDA target (None for ROCm), first line only."""
    if not platform.is_cuda:
        return None
    from triton.backends.nvidia.compiler import get_ptxas_version

    return str(get_ptxas_version(platform.sm)).strip().splitlines()[-1]


#: Compile options that name files of the machine that recorded them (Triton 3.6.0: the libdevice
#: path); they are dropped so the local backend fills in its own, as a local compile would.
_MACHINE_OPTIONS = ("extern_libs",)


def portable_specialization(specialization_data: str) -> str:
    """Triton's serialized specialization without options that are paths on the recording machine."""
    import json

    data = json.loads(specialization_data)
    for name in _MACHINE_OPTIONS:
        data.get("options", {}).pop(name, None)
    return json.dumps(data)


def local_cache_hash(jit: JITFunction, specialization_data: str, platform: Platform) -> str:
    """The cache hash the *local* Triton gives a recorded specialization for ``platform``.

    Mirrors ``JITFunction.preload`` up to ``compile``'s ``get_cache_key`` (Triton 3.6.0): the hash
    includes ``triton_key()``, a digest of the Triton installation, so it differs between Python
    builds of one release and must be recomputed where a pack is installed.
    """
    wait_triton_key()
    import hashlib
    import json

    import triton.language as tl
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.cache import get_cache_key
    from triton.runtime.jit import convert_to_tuple_if_list

    data = json.loads(portable_specialization(specialization_data))
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    backend = make_backend(gpu_target(platform))
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    src = ASTSource(jit, signature, constexprs, attrs)
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def import_jit(fn_name: str) -> JITFunction:
    """Import a jit function by its full name (``package.module.function``).

    :raises WarmregError: if it cannot be imported or is not a jit function.
    """
    import importlib

    module_name, _, qual = fn_name.rpartition(".")
    obj: Any = None
    while module_name:
        try:
            obj = importlib.import_module(module_name)
            break
        except ImportError:
            module_name, _, head = module_name.rpartition(".")
            qual = f"{head}.{qual}"
    for part in qual.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if not isinstance(obj, JITFunction):
        raise WarmregError(f"cannot import the Triton function {fn_name!r}", fix="install the plugin that defines it")
    return obj
