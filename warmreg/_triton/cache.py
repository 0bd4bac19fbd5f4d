"""Triton's disk cache and its key: what packs, distributed warms and replays rely on.

Part of the Triton adapter, checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0; tested in
``tests/test_triton_adapter.py``. The cache key formula (``get_cache_key``) is the same in all four;
how ``preload`` decodes serialized constants is not (:class:`warmreg._triton.release.Release`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import triton
from triton.runtime.jit import JITFunction

from ..values.errors import CacheError, WarmregError
from ..values.platform import Platform
from .release import RELEASE
from .target import _device_id, cross_target, current_device, gpu_target

log = logging.getLogger("warmreg.pipeline.compile")

__all__ = [
    "cache_knobs",
    "HOST",
    "alive",
    "cache_dir",
    "check_cache_writable",
    "fixed_env",
    "cache_subdir",
    "remove_unfinished",
    "import_jit",
    "in_disk_cache",
    "hashed_source",
    "local_cache_hash",
    "memory_kernel",
    "metadata_filename",
    "portable_specialization",
    "decoded_specializations",
    "specialize_remembered",
    "prefetch_triton_key",
    "ptxas_version",
    "replay",
    "wait_triton_key",
]

_key_lock = threading.Lock()
_key_thread: threading.Thread | None = None


def prefetch_triton_key() -> None:
    """Start computing Triton's ``triton_key()`` on a background thread, once per process.

    Triton hashes its own sources and the 415 MB ``libtriton.so`` the first time any compile or
    cache lookup needs the key (~0.35 s on an H200 host); ``hashlib`` releases the GIL, so a warm
    overlaps it with loading plugins and planning. The same thread then prepares the CUDA driver's
    utility module (see ``_prefetch``). :func:`wait_triton_key` joins it.
    """
    global _key_thread
    with _key_lock:
        if _key_thread is None:
            from triton.runtime import cache

            _key_thread = threading.Thread(target=_prefetch, args=(cache.triton_key,), name="warmreg-triton-key", daemon=True)
            _key_thread.start()


def _prefetch(triton_key: Any) -> None:
    triton_key()
    # Then the CUDA driver's utility module (``cuda_utils``: module loads and, from 3.7, every
    # launch), which Triton compiles with the host's C compiler into its cache at the first load:
    # a fresh cache (a pack installed into one) paid 0.4-0.9 s for it in the warm on the H200 host.
    # Building and loading the module initializes no CUDA context; without a driver (a CPU-only
    # machine) Triton refuses at once, before compiling.
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()
    except Exception as exc:
        log.debug("no CUDA driver utilities prefetched: %s", exc)


def wait_triton_key() -> None:
    """Wait for :func:`prefetch_triton_key` (a no-op when it never started or has finished), so the
    key is computed once rather than again on the calling thread."""
    thread = _key_thread
    if thread is not None:
        thread.join()


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


def remove_unfinished(jit: JITFunction, specialization_data: str, platform: Platform) -> int:
    """Remove what a failed compile of this specialization left in the cache: the stages Triton
    wrote (``.source``, ``.ttir``, ...) before the one that failed, in an entry that has no group
    file (``__grp__*``: Triton never reads such an entry), and the temporary directories of its
    writes that failed (``tmp.pid_<pid>_<id>``, e.g. on a full disk) of this process or of one that
    has exited (a compile process). Returns how many files were removed.

    Checked against Triton 3.6-3.9 (each writes every stage into the entry's directory as it goes
    and the group file last).
    """
    try:
        directory = Path(cache_dir()) / cache_subdir(local_cache_hash(jit, specialization_data, platform))
        files = list(directory.iterdir()) if directory.is_dir() else []
    except (OSError, WarmregError, ValueError, KeyError):
        return 0
    if not files or any(f.name.startswith("__grp__") for f in files):
        return 0
    removed = 0
    for f in files:
        with contextlib.suppress(OSError):
            if f.is_dir():
                pid = f.name.removeprefix("tmp.pid_").partition("_")[0]
                if f.name.startswith("tmp.pid_") and pid.isdigit() and (int(pid) == os.getpid() or not alive(int(pid))):
                    removed += sum(1 for _ in f.iterdir())
                    shutil.rmtree(f)
                continue
            f.unlink()
            removed += 1
    with contextlib.suppress(OSError):  # another process is writing there: its files are its own
        directory.rmdir()
    return removed


#: This host in the names of temporary files and folders that a later process removes once their writer died
#: (``alive``); another host sharing the directory keeps its own.
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one another user owns counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_cache_writable() -> Path:
    """Refuse early, in one line, a Triton cache directory that cannot be written; returns it.

    :raises CacheError: if it is not a directory or cannot be written.
    """
    directory = Path(cache_dir())
    if directory.exists() and not directory.is_dir():
        raise CacheError(str(directory), "is not a directory", fix="set TRITON_CACHE_DIR to a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=directory, prefix=".warmreg-probe-").close()  # removed on close
    except OSError as exc:
        raise CacheError(str(directory), f"is not writable ({exc.strerror})", fix="set TRITON_CACHE_DIR to a writable directory") from exc
    return directory


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


def in_disk_cache(jit: JITFunction, specialization_data: str | None, platform: Platform) -> bool:
    """Whether Triton's disk cache holds this specialization's binary for ``platform`` (its group
    file, which Triton publishes last): what ``compile`` would find instead of compiling. ``False``
    for no specialization or one the local Triton cannot hash (its compile says why)."""
    if specialization_data is None:
        return False
    try:
        binary_hash, src = hashed_source(jit, specialization_data, platform)
    except Exception:
        return False
    return os.path.exists(os.path.join(cache_dir(), cache_subdir(binary_hash), f"__grp__{metadata_filename(src)}"))


def metadata_filename(src: Any) -> str:
    """The name of a kernel's metadata file in its cache entry (``compile``: the name cut to 150 characters)."""
    return f"{src.name[:150]}.json"


def local_cache_hash(jit: JITFunction, specialization_data: str, platform: Platform) -> str:
    """The cache hash the *local* Triton gives a recorded specialization for ``platform``.

    Mirrors ``JITFunction.preload`` up to ``compile``'s ``get_cache_key``, decoding constants as the
    installed release does (3.7 resolves jit-function constants, 3.8 turns lists into tuples): the hash
    includes ``triton_key()``, a digest of the Triton installation, so it differs between Python
    builds of one release and must be recomputed where a pack is installed.

    Remembered for the process (a warm asks for each key up to three times: the forked compile's and
    the compile step's cache lookups, the pack install), keyed by everything else the hash covers:
    the kernel's source hash and the cache-invalidating environment variables.
    """
    return hashed_source(jit, specialization_data, platform)[0]


def hashed_source(jit: JITFunction, specialization_data: str, platform: Platform) -> tuple[str, Any]:
    """:func:`local_cache_hash` with the ``ASTSource`` it hashed, remembered for the process."""
    env = _env()
    memo = (jit, jit.cache_key, specialization_data, platform.target, env)
    found = _hashes.get(memo)
    if found is None:
        parts = _sources.pop(memo, None)  # what the warm's binding specialized, not decoded again
        found = _hashed(*parts, dict(env)) if parts is not None else _local_cache_hash(jit, specialization_data, platform, env)
        _bounded(_hashes)[memo] = found
    return found


_hashes: dict[tuple[Any, ...], tuple[str, Any]] = {}
_sources: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
#: Specializations decoded in this process (a pack's, another rank's), by what binding computes first:
#: ``(jit, its source hash, Triton's in-memory key, target, environment)`` -> ``(data, parsed options)``.
_decoded: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
_fixed_env: list[tuple[tuple[str, Any], ...]] = []  # the environment while :func:`fixed_env` blocks run


def decoded_specializations() -> set[str]:
    """The serialized specializations this process decoded (a pack's, another rank's, a cache's kept ones)."""
    return {data for data, _ in list(_decoded.values())}


def _env() -> tuple[tuple[str, Any], ...]:
    """Triton's cache-invalidating environment variables that are set, sorted (read once per :func:`fixed_env` block)."""
    fixed = _fixed_env[:1]  # one read: a block on another thread may end meanwhile
    if fixed:
        return fixed[0]
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return tuple(sorted(get_cache_invalidating_env_vars().items()))


@contextlib.contextmanager
def fixed_env() -> Iterator[None]:
    """While the block runs (a warm's binding and compiling), the cache-invalidating environment is
    read once, not three times a key (9 us each); nested and concurrent blocks share the outermost's."""
    _fixed_env.append(_env())  # (append and pop are atomic: concurrent blocks need no lock)
    try:
        yield
    finally:
        _fixed_env.pop()


def _bounded(memo: dict[Any, Any]) -> dict[Any, Any]:
    if len(memo) >= 4096:
        memo.clear()
    return memo


def _hashed(src: Any, backend: Any, options: Any, env: dict[str, Any]) -> tuple[str, Any]:
    """The cache hash of what ``compile`` would compile (its ``get_cache_key``), with the source."""
    import hashlib

    from triton.runtime.cache import get_cache_key

    wait_triton_key()
    return hashlib.sha256(get_cache_key(src, backend, options, env_vars=env).encode("utf-8")).hexdigest(), src


def specialize_remembered(jit: JITFunction, kwargs: Any, options: Any, platform: Platform) -> tuple[str, str]:
    """:func:`warmreg._triton.specialize` of a launch a warm compiles for ``platform`` (inside its compile
    scope), remembering the source, backend and options Triton would compile from, so that
    :func:`local_cache_hash` hashes them as they are instead of decoding the specialization (it needs
    ``triton_key()``, which binding does not wait for).

    A specialization this process already decoded (a pack's, at its install) whose in-memory key and
    parsed options binding gives again is returned as it was recorded, already hashed: binding skips
    Triton's ``_pack_args`` and the serialization (0.1 ms a key on the CPU machine)."""
    from .compiler import bind_launch, pack_bound

    env = _env()
    key, bound = bind_launch(jit, kwargs, options)
    decoded = _decoded.get((jit, jit.cache_key, key, platform.target, env))
    full, _target, backend = bound[:3]
    if decoded is not None and vars(backend.parse_options(full)) == decoded[1]:
        return key, decoded[0]  # the key fixes the signature, constants and attributes; the options are compared
    key, data, backend, parsed, src = pack_bound(jit, key, bound)
    memo = (jit, jit.cache_key, data, platform.target, env)
    if memo not in _hashes:
        _bounded(_sources)[memo] = (src, backend, parsed)
    return key, data


def _local_cache_hash(jit: JITFunction, specialization_data: str, platform: Platform, env: tuple[tuple[str, Any], ...]) -> tuple[str, Any]:
    import json

    import triton.language as tl
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    data = json.loads(portable_specialization(specialization_data))
    lists = convert_to_tuple_if_list if RELEASE.constexpr_lists_as_tuples else (lambda value: value)

    def decode(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(lists(value["constexpr"]))
        if isinstance(value, dict) and "jit_function" in value and RELEASE.jit_function_constants:
            return _registered_jit(value["jit_function"])
        return lists(value)

    constexprs = {tuple(k): decode(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    backend = make_backend(gpu_target(platform))
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    if isinstance(data.get("key"), str):
        _bounded(_decoded)[(jit, jit.cache_key, data["key"], platform.target, env)] = (specialization_data, dict(vars(options)))
    return _hashed(ASTSource(jit, signature, constexprs, attrs), backend, options, dict(env))


def _registered_jit(name: str) -> Any:
    """A jit function by Triton's ``module:qualname`` registry name (3.7+: how ``preload`` resolves
    jit-function constants; Triton registers a function when it is first bound)."""
    from triton.runtime import jit as jit_module

    found = getattr(jit_module, "_triton_jit_function_registry", {}).get(name)
    if found is None:
        raise WarmregError(f"the Triton function {name!r} a specialization names is not loaded", fix="install the plugin that defines it")
    return found


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


def cache_knobs() -> dict[str, str]:
    """The environment knobs of this process that enter Triton's cache key or its numerics: Triton's own
    cache-invalidating variables that are set, and the default FP fusion (``TRITON_DEFAULT_FP_FUSION``, part
    of every compile's options: on by default through 3.9, off from 3.10). Checked: 3.6.0, 3.7.1, 3.8.0, 3.9.0."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    knobs = {name: str(value) for name, value in get_cache_invalidating_env_vars().items()}
    knobs["default_fp_fusion"] = "1" if triton.knobs.language.default_fp_fusion else "0"
    return dict(sorted(knobs.items()))
