"""Everything warmreg knows about Triton's internals: this module and its siblings ``_triton_release``
(what each release does differently), ``_triton_cache`` (the disk cache and its key),
``_triton_interp`` (the interpreter), ``_triton_fast`` (the guarded fast launch) and
``_triton_launchers`` (C launchers for packs, Triton 3.6 only).

Each function names the releases it was checked against (3.6.0, 3.7.1, 3.8.0, 3.9.0 unless it says
otherwise); where they differ, it reads a field of :data:`warmreg._triton.release.RELEASE`.
``tests/test_triton_adapter.py`` tests each internal this module relies on, on every supported
release in CI, so a Triton upgrade that moves one fails there first, and :func:`check_version`
refuses an unsupported release with one readable line.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import attrs
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver as _driver
from triton.runtime.jit import JITFunction, compute_cache_key

from ..values.errors import TargetError
from ..values.platform import Platform
from . import launchers as _triton_launchers
from .release import RELEASE, SUPPORTED_TRITON, UnsupportedTriton, check_version

if TYPE_CHECKING:
    import torch

log = logging.getLogger("warmreg.pipeline.compile")

__all__ = [
    "CompileRequest", "HookHandle", "SUPPORTED_TRITON", "UnsupportedTriton", "add_load_hook", "async_compile", "benchmark",
    "builds_on_load", "cache_files", "check_version", "compile_listener", "compile_worker", "cross_target", "current_device", "device_name", "finish_load", "forget_compiled",
    "full_name", "get_jit_cache_hook", "gpu_target", "in_memory", "install_compile_hook", "is_future_kernel", "is_jit",
    "knob", "load_hooks", "param_names", "preimport", "parse_specialization_key", "remove_compile_hook", "remove_load_hook",
    "retrying_ast_race", "run_kwargs", "set_device", "set_jit_cache_hook", "shared_kernel_objects", "source_hash", "specialization_key",
    "specialize", "torch_device", "unwrap_autotuner_bench", "warmup", "wrap_autotuner_bench",
]  # fmt: skip


def gpu_target(platform: Platform) -> GPUTarget:
    """Triton's ``GPUTarget`` for a platform (backend ``cuda``/``hip``, warp 32/64).

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
        import torch

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
        previous = _driver._active  # DriverConfig keeps the active driver here
        _driver.set_active(_CrossTargetDriver(platform))
        try:
            yield
        finally:
            _driver._active = previous


def compile_worker(platform: Platform) -> None:
    """Make this process one that only compiles ``platform``'s kernels into Triton's disk cache: a
    child forked by a warm (:mod:`warmreg.stages.processes`), whose parent then loads each binary as a hit.

    Triton's driver becomes the stand-in for ``platform``'s target, so a compile here never touches
    the GPU (CUDA cannot be used in a child forked after it started), and the parent's pre-compile
    hook and compilation listener are removed (the parent's own compile of the cached binary calls
    them).
    """
    _driver.set_active(_CrossTargetDriver(attrs.evolve(platform, local=False)))
    triton.knobs.runtime.jit_cache_hook = None
    triton.knobs.compilation.listener = None


def current_device() -> int:
    """The device id Triton's ``JITFunction.run`` uses right now."""
    return int(_driver.active.get_current_device())


def device_name() -> str:
    """The name of the current GPU (e.g. ``NVIDIA H200``)."""
    import torch

    return str(torch.cuda.get_device_name(current_device()))


def torch_device() -> torch.device:
    """The current GPU as a torch device."""
    import torch

    return torch.device(_driver.active.get_active_torch_device().type, current_device())


def benchmark(fn: Callable[[], Any], *, warmup_ms: float, rep_ms: float) -> float:
    """The median time of ``fn`` in milliseconds, by Triton's own ``do_bench`` (as its autotuner)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def set_device(device: int) -> None:
    """Make ``device`` current on this thread (Triton loads modules onto the current device)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(device)


def specialize(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, str]:
    """Triton's in-memory cache key for a launch and its serialized specialization.

    The key is ``JITFunction.run``'s ``key``, the string Triton's JIT hooks receive, so warmed
    launches and runtime compiles can be matched exactly. The specialization data is what Triton's
    hooks report as ``specialization_data`` and what ``JITFunction.preload`` compiles from: packs and
    distributed warms ship it instead of anything pickled.
    """
    from triton.runtime.jit import serialize_specialization_data

    full = run_kwargs(jit, kwargs, options)
    _, key_cache, target, backend, binder = jit.device_caches[current_device()]
    bound_args, specialization, opts = binder(**full)
    key = str(compute_cache_key(key_cache, specialization, opts))
    parsed, signature, constexprs, attributes = jit._pack_args(backend, full, bound_args, specialization, opts)
    extra = (target,) if RELEASE.specialization_has_target else ()
    data = serialize_specialization_data(full_name(jit), signature, constexprs, attributes, parsed, key, *extra)
    return key, str(data)


def run_kwargs(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """A launch's arguments and options as ``JITFunction.run`` completes them before binding: the
    ``debug`` flag and the knobs of :attr:`Release.run_option_knobs` (3.9 adds
    ``fpsan_homomorphic_casts``), which are part of Triton's in-memory key."""
    full = dict(kwargs)
    full.update(options)
    full["debug"] = full.get("debug", jit.debug) or triton.knobs.runtime.debug
    for name, path in RELEASE.run_option_knobs:
        full[name] = knob(path)
    return full


def knob(path: str) -> Any:
    """The value of a Triton knob by its path under ``triton.knobs`` (``"compilation.instrumentation_mode"``)."""
    group, _, name = path.partition(".")
    return getattr(getattr(triton.knobs, group), name)


def in_memory(jit: JITFunction, key: str) -> bool:
    """Whether ``jit`` holds a kernel under Triton's in-memory ``key`` for the current device."""
    return key in jit.device_caches[current_device()][0]


def is_future_kernel(obj: Any) -> bool:
    """Whether ``obj`` is an async compile's ``FutureKernel`` (3.7+ forwards its attributes to
    ``result()``, so reading one waits for the compile)."""
    from triton.runtime._async_compile import FutureKernel

    return isinstance(obj, FutureKernel)


@contextlib.contextmanager
def async_compile(executor: Executor) -> Iterator[None]:
    """Triton's async compile mode (``triton.runtime._async_compile.AsyncCompileMode``, errors left to
    each future): ``JITFunction.warmup`` inside the block submits its compile to ``executor`` and
    returns a future kernel; leaving the block waits for every compile."""
    from triton.runtime._async_compile import AsyncCompileMode

    with AsyncCompileMode(executor, ignore_errors=True):
        yield


@contextlib.contextmanager
def compile_listener(on_compiled: Callable[[bool, Any], None]) -> Iterator[None]:
    """Call ``on_compiled(cache_hit, metadata)`` for every binary Triton produces or finds in its disk
    cache while the block runs (``knobs.compilation.listener``, chained to the one installed before)."""
    previous = triton.knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        on_compiled(cache_hit, metadata)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    triton.knobs.compilation.listener = listener
    try:
        yield
    finally:
        triton.knobs.compilation.listener = previous


#: ``collections.namedtuple`` as it was when the outermost :func:`shared_kernel_objects` block began
_namedtuple = collections.namedtuple
_metadata_classes: dict[tuple[str, ...], type] = {}
_shared_depth = 0


def _namedtuple_sharing_kernel_metadata(typename: str, field_names: Any, **kwargs: Any) -> type:
    """``collections.namedtuple``, except that Triton's compiler gets one ``KernelMetadata`` class per
    set of fields instead of a new one per kernel. Anyone else gets exactly what ``namedtuple`` gives
    (with the caller's module, which ``namedtuple`` would otherwise read off this frame)."""
    module = sys._getframe(1).f_globals.get("__name__", "__main__")
    if typename != "KernelMetadata" or kwargs or module != "triton.compiler.compiler":
        kwargs.setdefault("module", module)
        return _namedtuple(typename, field_names, **kwargs)
    fields = tuple(field_names)
    cls = _metadata_classes.get(fields)
    if cls is None:
        cls = _metadata_classes[fields] = _namedtuple(typename, fields, module=module)
    return cls


@contextlib.contextmanager
def shared_kernel_objects() -> Iterator[None]:
    """While the block runs, Triton builds one ``KernelMetadata`` class per set of metadata fields
    and, on 3.6, one C-launcher source and module per distinct launcher
    (:func:`warmreg._triton.launchers.shared_launchers`).

    ``CompiledKernel.__init__`` (3.6.0-3.9.0) makes a new ``namedtuple`` class for every kernel it
    compiles or finds in the disk cache: ``exec`` of its generated source and a descriptor per field,
    0.5 ms a kernel, a third of a disk-cache hit (a Flash warm from a pack: 0.036 of 0.105 s). Its
    classes differ only by identity (same name, fields and module), so warm shares one. The function
    resolves ``namedtuple`` from ``collections`` at each call, so the block swaps the attribute there
    (nested and concurrent blocks keep it swapped until the last one leaves); a module importing
    ``namedtuple`` meanwhile keeps the replacement, which then behaves as ``namedtuple`` does.
    """
    global _shared_depth, _namedtuple
    with _ids_lock:
        if not _shared_depth:
            _namedtuple = collections.namedtuple
        _shared_depth += 1
        collections.namedtuple = _namedtuple_sharing_kernel_metadata  # type: ignore[assignment]
    try:
        with _triton_launchers.shared_launchers():
            yield
    finally:
        with _ids_lock:
            _shared_depth -= 1
            if not _shared_depth:
                collections.namedtuple = _namedtuple  # type: ignore[assignment]


def specialization_key(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """Triton's in-memory cache key for a launch (see :func:`specialize`)."""
    return specialize(jit, kwargs, options)[0]


def cache_files(compiled: Any) -> dict[str, str]:
    """A compiled kernel's metadata JSON and binary in the cache: child name -> path (``metadata_group``)."""
    group = dict(getattr(compiled, "metadata_group", {}) or {})
    return {name: path for name, path in group.items() if name.endswith((".json", ".cubin", ".hsaco"))}


_touched: weakref.WeakSet[JITFunction] = weakref.WeakSet()


def warmup(jit: JITFunction, grid: tuple[int, ...], kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """Compile without launching (``JITFunction.warmup``); returns a CompiledKernel or FutureKernel."""
    _touched.add(jit)
    return jit.warmup(grid=grid, **kwargs, **options)


#: CPython without gh-113035 (December 2023; 3.11.7 has the bug) keeps ``ast.parse``'s recursion
#: depth in interpreter-wide state: two threads parsing at once (Triton parses each kernel's source
#: while compiling) can then fail with this ``SystemError`` although both sources are fine (gh-106905).
_AST_RACE = "AST constructor recursion depth mismatch"
_AST_RACE_ATTEMPTS = 4


def retrying_ast_race(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run again when it fails only by CPython's ``ast.parse`` thread race.

    The race fails a parse before Triton writes anything, so running the compile again is safe; each
    attempt needs another thread parsing at the same instant to fail again.
    """
    for attempt in range(1, _AST_RACE_ATTEMPTS + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not _is_ast_race(exc) or attempt == _AST_RACE_ATTEMPTS:
                raise
            log.debug("CPython ast.parse thread race (attempt %d), compiling again: %s", attempt, exc)
    raise AssertionError("unreachable")


def _is_ast_race(exc: BaseException) -> bool:
    """The race itself, or an error Triton raised from it: its code generator parses a called jit
    function's source while generating the caller and wraps what that raises in a CompilationError."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, SystemError) and _AST_RACE in str(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def forget_compiled() -> None:
    """Drop the in-memory kernels of every jit function warmreg warmed (Triton keeps them per
    device id in ``JITFunction.device_caches``), so the next warm reads the disk cache again."""
    for jit in list(_touched):
        jit.device_caches.clear()


_launcher_locks: dict[str, threading.Lock] = {}


def finish_load(compiled: Any) -> None:
    """Do at warm what Triton otherwise leaves to a kernel's first launch: load its binary onto the
    device (``CompiledKernel._init_handles``), and on Triton 3.6 also build its C launcher.

    Triton 3.6 builds one C launcher per distinct launcher source (23 for the 71 DeepSeek-V4-Flash
    keys; constexpr values such as block sizes do not change it) and caches it on disk, but
    concurrent first loads of one launcher each run the C compiler. Loads that share a launcher
    therefore take turns: the first builds it, the others load it (a cold Flash warm on the H200
    host: 23 compiler runs). From 3.7 on a load builds nothing (one generic launcher serves every
    kernel), so loads run side by side.
    """
    if getattr(compiled, "module", None) is not None:
        return
    src = compiled.src
    signature, constants = getattr(src, "signature", None), getattr(src, "constants", None)
    if not RELEASE.per_signature_launcher or signature is None or constants is None:
        compiled._init_handles()  # nothing to build, or not an ASTSource: no way to tell launchers apart
        return
    identity = _launcher_identity(compiled, signature, constants)
    with _ids_lock:
        lock = _launcher_locks.setdefault(identity, threading.Lock())
    with lock:
        compiled._init_handles()


def builds_on_load(compiled: Any) -> bool:
    """Whether :func:`finish_load` of ``compiled`` may run the C compiler: on Triton 3.6 when the
    cache lacks its CUDA launcher (or it is not a CUDA kernel of an ``ASTSource``, or its launcher
    cannot be looked up: where that cannot be told); never from 3.7 on, nor for a kernel already
    loaded or failed (``None``). Never raises."""
    if compiled is None or not RELEASE.per_signature_launcher or getattr(compiled, "module", None) is not None:
        return False
    src = getattr(compiled, "src", None)
    if getattr(src, "signature", None) is None or getattr(src, "constants", None) is None:
        return True
    if getattr(getattr(getattr(compiled, "metadata", None), "target", None), "backend", None) != "cuda":
        return True
    try:
        return not _triton_launchers.is_built(compiled)
    except Exception:  # the load itself reports what is wrong with the kernel
        return True


def _launcher_identity(compiled: Any, signature: Any, constants: Any) -> str:
    """What tells one C launcher from another (Triton 3.6): on CUDA, Triton's own cache key for the
    launcher's source (which constexpr values such as block sizes leave unchanged); elsewhere the
    signature and constants."""
    if getattr(getattr(compiled.metadata, "target", None), "backend", None) == "cuda":
        return _triton_launchers.launcher_source(compiled)[0]
    tensordesc = getattr(compiled.metadata, "tensordesc_meta", None)
    return repr((sorted(signature.items()), sorted(constants.items(), key=repr), tensordesc))


def is_jit(obj: Any) -> bool:
    """Whether ``obj`` is a ``@triton.jit`` function (compiled or, under TRITON_INTERPRET=1, interpreted).

    Triton's interpreter (which imports numpy) is looked at only if something already imported it.
    """
    if isinstance(obj, JITFunction):
        return True
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(obj, interpreter.InterpretedFunction)


def full_name(jit: Any) -> str:
    """Triton's full name of a jit function (``module.qualname``), as its hooks report it."""
    fn = jit.fn
    return f"{fn.__module__}.{fn.__qualname__}"


#: What Triton imports on a process's first specialization and compile rather than at ``import
#: triton``: all of ``triton.experimental.gluon`` (the native specializer looks gluon's layout types
#: up: ~0.15 s, the largest part of a first warm's binding on the 2-core CPU machine, 3.8.0), the
#: code generator, libdevice and tensor descriptors. A release without one skips it.
_LAZY_IMPORTS = (
    "triton.experimental.gluon", "triton.compiler.code_generator", "triton.language.extra.libdevice",
    "triton.tools.tensor_descriptor",
)  # fmt: skip


def preimport() -> None:
    """Import :data:`_LAZY_IMPORTS` now (``warmreg.prefetch`` does, on its background thread)."""
    for name in _LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            log.debug("Triton %s has no %s: %s", triton.__version__, name, exc)


def source_hash(jit: JITFunction) -> str:
    """Triton's hash of a kernel's source and its dependencies (``JITCallable.cache_key``)."""
    return str(jit.cache_key)


# -- hooks (monitor) ----------------------------------------------------------------------------


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

    triton.knobs.runtime.jit_cache_hook = hook
    return HookHandle(hook, previous)


def remove_compile_hook(handle: HookHandle) -> None:
    """Undo :func:`install_compile_hook` (only if nobody replaced the hook since)."""
    if triton.knobs.runtime.jit_cache_hook is handle.hook:
        triton.knobs.runtime.jit_cache_hook = handle.previous


def get_jit_cache_hook() -> Any:
    """Triton's single pre-compile hook slot (``knobs.runtime.jit_cache_hook``)."""
    return triton.knobs.runtime.jit_cache_hook


def set_jit_cache_hook(hook: Any) -> None:
    triton.knobs.runtime.jit_cache_hook = hook


_load_wrappers: dict[Callable[[str], None], Callable[..., None]] = {}


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
