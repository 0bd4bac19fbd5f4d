"""Triton's compile path as warmreg drives it: specialization, compile-only warmup, async compiles, loads.

Part of the Triton adapter (:mod:`warmreg._triton`); each function names the releases it was checked against
(3.6.0, 3.7.1, 3.8.0, 3.9.0 unless it says otherwise); where they differ it reads :data:`~warmreg._triton.release.RELEASE`.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any

import triton
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction, compute_cache_key

from .deferred import deferring
from .launchers import is_built, launcher_source, shared_launchers
from .release import RELEASE
from .target import _ids_lock, current_device

__all__ = ["async_compile", "bind_launch", "binding_started", "builds_on_load", "cache_files", "compile_listener", "finish_load", "forget_compiled", "full_name", "in_memory", "is_future_kernel", "is_jit", "knob", "pack_bound", "param_names", "parse_specialization_key", "preimport", "prepare_binders", "retrying_ast_race", "run_kwargs", "shared_kernel_objects", "source_hash", "specialization_key", "specialize", "specialize_parts", "touch", "warmup"]

log = logging.getLogger("warmreg._triton")


def specialize(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, str]:
    """Triton's in-memory cache key for a launch and its serialized specialization.

    The key is ``JITFunction.run``'s ``key``, the string Triton's JIT hooks receive, so warmed
    launches and runtime compiles can be matched exactly. The specialization data is what Triton's
    hooks report as ``specialization_data`` and what ``JITFunction.preload`` compiles from: packs and
    distributed warms ship it instead of anything pickled.
    """
    return specialize_parts(jit, kwargs, options)[:2]


def specialize_parts(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, str, Any, Any, Any]:
    """:func:`specialize`'s key and data, with what ``JITFunction._do_compile`` compiles from: the
    backend, the parsed options and the ``ASTSource``."""
    return pack_bound(jit, *bind_launch(jit, kwargs, options))


def bind_launch(jit: JITFunction, kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, Any]:
    """The first half of :func:`specialize_parts`: Triton's in-memory key (``JITFunction.run``'s binder
    and ``compute_cache_key``), with what :func:`pack_bound` takes to finish it."""
    full = run_kwargs(jit, kwargs, options)
    device = current_device()
    if not _binding.is_set():
        _binding.set()
    if _binders and device not in jit.device_caches:
        _take_binder(jit, device)
    _, key_cache, target, backend, binder = jit.device_caches[device]
    bound_args, specialization, opts = binder(**full)
    return str(compute_cache_key(key_cache, specialization, opts)), (full, target, backend, bound_args, specialization, opts)


#: Binders made ahead of a warm (:func:`prepare_binders`), by jit function and ``GPUTarget``: ``(backend, binder)``.
_binders: dict[tuple[JITFunction, Any], tuple[Any, Any]] = {}
_binding = threading.Event()  # set at the first binding of this process (:func:`bind_launch`)


def binding_started() -> bool:
    """Whether a warm of this process has started binding (:func:`bind_launch`): work done ahead of it stops there."""
    return _binding.is_set()


def prepare_binders(jits: Iterable[JITFunction], target: Any, *, until_binding: bool = False) -> None:
    """Make Triton's binder of each function for ``target`` (a ``GPUTarget``) ahead of a warm, as
    ``JITFunction.create_binder`` makes it at a function's first launch on a device (0.3-0.7 ms each on the
    CPU machine: its Python source generated and compiled), without asking the device anything: a
    prefetched pack's functions, or every plugin function for the local GPUs, on a prefetch thread.
    :func:`bind_launch` takes one for a function that has none yet for the current device, if that
    device's target is ``target``. ``until_binding``: stop once a warm has started binding (the rest
    would only take the GIL from it; binding makes what it needs, as Triton does).
    ``create_binder`` is the same in 3.6.0, 3.7.1, 3.8.0 and 3.9.0."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    for jit in jits:
        if until_binding and binding_started():
            return
        own = getattr(type(jit), "create_binder", None) is JITFunction.create_binder  # not a subclass's own binder
        if own and (jit, target) not in _binders and len(_binders) < 4096:
            backend = make_backend(target)
            _binders[(jit, target)] = (backend, create_function_from_signature(jit.signature, jit.params, backend))


def _take_binder(jit: JITFunction, device: int) -> None:
    """Give ``jit`` the binder :func:`prepare_binders` made for ``device``'s target, as ``create_binder`` would."""
    from triton.compiler.compiler import ASTSource, CompiledKernel, compile

    target = triton.runtime.driver.active.get_current_target()
    made = _binders.pop((jit, target), None)
    if made is not None:
        jit.CompiledKernel, jit.compile, jit.ASTSource = CompiledKernel, compile, ASTSource
        jit.device_caches[device] = ({}, {}, target, *made)


def pack_bound(jit: JITFunction, key: str, bound: Any) -> tuple[str, str, Any, Any, Any]:
    """The rest of :func:`specialize_parts` for a :func:`bind_launch`: ``JITFunction._pack_args``, the
    serialized specialization and the ``ASTSource``."""
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import serialize_specialization_data

    full, target, backend, bound_args, specialization, opts = bound
    parsed, signature, constexprs, attributes = jit._pack_args(backend, full, bound_args, specialization, opts)
    extra = (target,) if RELEASE.specialization_has_target else ()
    data = serialize_specialization_data(full_name(jit), signature, constexprs, attributes, parsed, key, *extra)
    return key, str(data), backend, parsed, ASTSource(jit, signature, constexprs, attributes)


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
        with shared_launchers():
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


def touch(jit: JITFunction) -> None:
    """Remember that warmreg put kernels in ``jit``'s in-memory cache (:func:`forget_compiled` drops them)."""
    _touched.add(jit)


def warmup(jit: JITFunction, grid: tuple[int, ...], kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """Compile without launching (``JITFunction.warmup``); returns a CompiledKernel or FutureKernel."""
    touch(jit)
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
#: Triton 3.6 launchers (by cache key) this process found in Triton's cache or built there
_built: set[str] = set()


def _launcher_cls() -> Any:
    """The active driver's launcher class (``None`` where there is none: nothing to defer)."""
    try:
        return driver.active.launcher_cls
    except (RuntimeError, AttributeError):
        return None


def _is_cuda(compiled: Any) -> bool:
    return getattr(getattr(compiled.metadata, "target", None), "backend", None) == "cuda"


def finish_load(compiled: Any) -> None:
    """Do at warm what Triton otherwise leaves to a kernel's first launch: load its binary onto the
    device (``CompiledKernel._init_handles``), and on Triton 3.6 also build its C launcher where the cache lacks
    it. Triton's launcher object (``CompiledKernel.run``) is made at its first use (:mod:`~warmreg._triton.deferred`).

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
    if not RELEASE.per_signature_launcher:
        with deferring(compiled, _launcher_cls()):  # nothing to build: the launcher object waits
            compiled._init_handles()
        return
    if signature is None or constants is None:
        compiled._init_handles()  # not an ASTSource: no way to tell launchers apart
        return
    identity = _launcher_identity(compiled, signature, constants)
    with _ids_lock:
        lock = _launcher_locks.setdefault(identity, threading.Lock())
    # a launcher already in the cache waits for its first use; one not yet there is built now (a C compile)
    built = identity in _built or (_is_cuda(compiled) and is_built(compiled, identity))
    with lock, deferring(compiled, _launcher_cls()) if built else contextlib.nullcontext():
        compiled._init_handles()
    if _is_cuda(compiled):
        _built.add(identity)  # in the cache now: the next kernel of this launcher waits too


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
        key = launcher_source(compiled)[0]
        return not (key in _built or is_built(compiled, key))
    except Exception:  # the load itself reports what is wrong with the kernel
        return True


def _launcher_identity(compiled: Any, signature: Any, constants: Any) -> str:
    """What tells one C launcher from another (Triton 3.6): on CUDA, Triton's own cache key for the
    launcher's source (which constexpr values such as block sizes leave unchanged); elsewhere the
    signature and constants."""
    if _is_cuda(compiled):
        return launcher_source(compiled)[0]
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
