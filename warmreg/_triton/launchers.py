"""Triton's C launchers, built ahead of time for a pack.

Part of the Triton adapter, checked against Triton 3.6.0's CUDA backend; tested in ``tests/test_pack_launchers.py``.

Only Triton 3.6 builds a launcher per kernel signature. From 3.7 on (checked: 3.7.1, 3.8.0, 3.9.0)
``make_launcher`` is gone: one generic launcher, compiled once with the driver's own utilities,
launches every kernel, so there is nothing per kernel to prebuild, ship or exchange. On those
releases :func:`build` and :func:`built_here` return no launchers and :data:`PER_KERNEL` is False.

Before a compiled kernel's first launch, Triton 3.6.0 generates a small C extension per distinct
signature (``make_launcher``), compiles it with the host's C compiler and caches the shared object
under ``sha256(source + platform_key())`` as ``__triton_launcher<EXT_SUFFIX>``. A warm does that on
the GPU host: 23 compiler runs for the 71 DeepSeek-V4-Flash keys, about a second on 16 cores, more
than everything else a warm from a pack does, and a serving image may have no C compiler at all.

So a pack can carry them. The source depends only on the kernel's signature and constants, and the
file name carries the Python ABI, so :func:`build` can compile them anywhere, for any Python whose
headers it can read (``--launcher-python``): against Triton's own ``cuda.h``, linked to a stub that
only names ``libcuda.so.1`` (the soname the real driver library resolves at load time, exactly as
CUDA's own link stubs work). :func:`install` writes each one where Triton looks for it when the
machine's ABI and platform match. A carried launcher that fails to load anyway is not a risk:
Triton logs it and rebuilds, as for any damaged cache file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from ..support.threads import quiet_pool
from ..values.errors import LauncherError
from .release import RELEASE

__all__ = [
    "Launcher", "LauncherError", "PER_KERNEL", "PythonABI", "build", "built_here", "fits_here", "install", "is_built",
    "launcher_source", "local_abi", "platform_key", "prebuild", "python_abi", "shared_launchers",
]  # fmt: skip

#: Whether the installed Triton builds a C launcher per kernel signature (3.6 only).
PER_KERNEL: bool = RELEASE.per_signature_launcher

_NAME = "__triton_launcher"


@attrs.frozen
class PythonABI:
    """A Python build launchers are compiled for: its header directory and extension suffix."""

    version: str  # "3.12"
    include: str
    ext_suffix: str  # ".cpython-312-x86_64-linux-gnu.so"


@attrs.frozen
class Launcher:
    """One built launcher: Triton's cache key for its source, its file name and its bytes."""

    cache_key: str
    platform_key: str
    python: str
    name: str
    data: bytes = attrs.field(repr=False)


def platform_key() -> str:
    """Triton's ``platform_key()`` (machine, system, architecture), part of the launcher cache key."""
    from triton.runtime.build import platform_key as key

    return str(key())


def launcher_source(compiled: Any) -> tuple[str, str]:
    """``(cache key, C source)`` of the launcher Triton builds for a compiled CUDA kernel, computed as
    ``CudaLauncher.__init__`` and ``compile_module_from_src`` do (Triton 3.6.0); each distinct
    source is generated once per process (:func:`_source`).

    :raises LauncherError: on a Triton that builds no launcher per kernel (3.7+).
    """
    if not PER_KERNEL:
        raise LauncherError(f"Triton {RELEASE.series} builds no C launcher per kernel", fix="nothing to build on this release")
    found = _BY_KERNEL.get(compiled)
    if found is None:
        src = compiled.src
        arg_names = src.fn.arg_names
        constants = {((arg_names.index(k),) if isinstance(k, str) else k): v for k, v in src.constants.items()}
        found = _BY_KERNEL[compiled] = _source(constants, dict(src.signature), getattr(compiled.metadata, "tensordesc_meta", None))
    return found


#: ``make_launcher``'s ``(cache key, source)`` by its arguments, and by compiled kernel: Triton 3.6
#: generates a launcher's C source (about 12 KB, 0.28 ms with its hash on the CPU machine) at every
#: kernel's load, and a warm asks for it up to three times a key (whether the load builds, which
#: loads take turns, the load itself) for 25 distinct sources among the Flash example's 73 keys.
_SOURCES: dict[str, tuple[str, str]] = {}
_BY_KERNEL: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
#: Triton's ``make_launcher`` and ``compile_module_from_src`` as the outermost :func:`shared_launchers` block found them
_ORIGINAL: dict[str, Any] = {}
_MODULES: dict[str, Any] = {}  # launcher modules loaded in the current shared_launchers block, by source
_shared_depth = 0
_lock = threading.Lock()


def _source(constants: dict[Any, Any], signature: dict[Any, Any], tensordesc_meta: Any) -> tuple[str, str]:
    """``(cache key, source)`` of ``make_launcher(constants, signature, tensordesc_meta)``, generated once."""
    memo = repr((sorted(constants.items(), key=repr), sorted(signature.items(), key=repr), tensordesc_meta))
    found = _SOURCES.get(memo)
    if found is None:
        from triton.backends.nvidia import driver

        make = _ORIGINAL["make_launcher"] if _shared_depth else driver.make_launcher
        text = make(constants, signature, tensordesc_meta)
        found = (hashlib.sha256((text + platform_key()).encode("utf-8")).hexdigest(), text)
        if len(_SOURCES) < 4096:
            _SOURCES[memo] = found
    return found


def _shared_make_launcher(constants: dict[Any, Any], signature: dict[Any, Any], tensordesc_meta: Any) -> str:
    return _source(constants, signature, tensordesc_meta)[1]


def _shared_module(src: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """``compile_module_from_src``, except that a launcher module loaded once in the block serves every
    kernel of that source (the module holds only the stateless ``launch`` function)."""
    if name != _NAME:
        return _ORIGINAL["compile_module_from_src"](src, name, *args, **kwargs)
    module = _MODULES.get(src)  # keyed by the source itself: the memo's one string, whose hash Python keeps
    if module is None:
        module = _MODULES[src] = _ORIGINAL["compile_module_from_src"](src, name, *args, **kwargs)
    return module


@contextlib.contextmanager
def shared_launchers() -> Iterator[None]:
    """While the block runs, Triton 3.6's ``CudaLauncher`` (a kernel's first load) generates each
    distinct launcher source once and loads each launcher module once, instead of per kernel: a warm
    loads 73 Flash keys through 25 launchers. Outside the block (and on 3.7+, where there is no
    launcher per kernel) Triton is untouched; nested and concurrent blocks keep the sharing until the
    last one leaves. Checked against Triton 3.6.0 (``triton/backends/nvidia/driver.py`` binds both
    names at import and ``CudaLauncher.__init__`` looks them up at each call).
    """
    global _shared_depth
    if not PER_KERNEL:
        yield
        return
    from triton.backends.nvidia import driver

    with _lock:
        if not _shared_depth:
            _ORIGINAL.update(make_launcher=driver.make_launcher, compile_module_from_src=driver.compile_module_from_src)
            driver.make_launcher, driver.compile_module_from_src = _shared_make_launcher, _shared_module
        _shared_depth += 1
    try:
        yield
    finally:
        with _lock:
            _shared_depth -= 1
            if not _shared_depth:
                driver.make_launcher = _ORIGINAL["make_launcher"]
                driver.compile_module_from_src = _ORIGINAL["compile_module_from_src"]
                _MODULES.clear()


@functools.cache
def local_abi() -> PythonABI:
    """This interpreter's ABI, with the header directory Triton's own build uses."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; Triton 3.6.0 maps it the same way
        scheme = "posix_prefix"
    return PythonABI(
        f"{sys.version_info[0]}.{sys.version_info[1]}",
        sysconfig.get_paths(scheme=scheme)["include"],
        str(sysconfig.get_config_var("EXT_SUFFIX")),
    )


_PROBE = (
    "import json, sys, sysconfig\n"
    "s = sysconfig.get_default_scheme()\n"
    "s = 'posix_prefix' if s == 'posix_local' else s\n"
    "print(json.dumps(['%d.%d' % sys.version_info[:2], sysconfig.get_paths(scheme=s)['include'], sysconfig.get_config_var('EXT_SUFFIX')]))"
)


def python_abi(python: str | None) -> PythonABI:
    """The ABI of ``python`` (an interpreter name or path; ``None``: this one).

    :raises LauncherError: when the interpreter cannot be run or has no ``Python.h``.
    """
    if python is None:
        abi = local_abi()
    else:
        exe = shutil.which(python) or python
        fix = "pass the path of the serving host's Python, e.g. /usr/bin/python3.12"
        try:
            out = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LauncherError(f"cannot run Python {python!r} to ask for its headers ({exc})", fix=fix) from exc
        try:
            abi = PythonABI(*json.loads(out.stdout.strip().splitlines()[-1]))
        except (ValueError, TypeError, IndexError) as exc:
            said = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise LauncherError(f"Python {python!r} did not report its headers (exit {out.returncode}: {said})", fix=fix) from exc
    if not os.path.isfile(os.path.join(abi.include, "Python.h")):
        raise LauncherError(
            f"Python {abi.version} ({python or sys.executable}) has no Python.h in {abi.include}",
            fix=f"install its headers (e.g. apt install python{abi.version}-dev) or leave it out of --launcher-python",
        )
    return abi


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise LauncherError("no C compiler found to build Triton's launchers", fix="install gcc, set CC, or pass --no-launchers")
    return cc


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise LauncherError(f"{' '.join(cmd[:3])} ... failed: {out.stderr.strip()[-800:]}", fix="check the C compiler and headers")


def build(compiled: Iterable[Any], pythons: Iterable[str | None], *, workers: int = 4) -> list[Launcher]:
    """Build the distinct launchers of ``compiled`` (CUDA kernels) for each Python in ``pythons``.

    Returns none on Triton 3.7+, which builds no launcher per kernel.

    :raises LauncherError: naming the interpreter or the compiler error.
    """
    if not PER_KERNEL:
        return []
    from triton.backends.nvidia.driver import include_dirs

    sources = dict(launcher_source(c) for c in compiled)
    abis = [python_abi(p) for p in pythons]
    cc = _compiler()
    pkey = platform_key()
    with tempfile.TemporaryDirectory(prefix="warmreg-launchers-") as tmp:
        stub_dir = os.path.join(tmp, "stub")
        os.makedirs(stub_dir)
        with open(os.path.join(tmp, "stub.c"), "w") as f:
            f.write("int warmreg_libcuda_link_stub;\n")
        _run([cc, os.path.join(tmp, "stub.c"), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(stub_dir, "libcuda.so.1")])

        def one(job: tuple[str, PythonABI]) -> Launcher:
            key, abi = job
            work = os.path.join(tmp, f"{key}-{abi.version}")
            os.makedirs(work)
            src = os.path.join(work, f"{_NAME}.c")
            with open(src, "w") as f:
                f.write(sources[key])
            so = os.path.join(work, f"{_NAME}{abi.ext_suffix}")
            includes = [f"-I{d}" for d in (*include_dirs, work, abi.include)]
            _run([cc, src, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", so, "-Wl,--no-as-needed", f"-L{stub_dir}", "-l:libcuda.so.1", *includes])
            with open(so, "rb") as f:
                return Launcher(key, pkey, abi.version, os.path.basename(so), f.read())

        jobs = [(key, abi) for key in sorted(sources) for abi in abis]
        with quiet_pool(workers, "warmreg-launcher") as pool:  # a Ctrl-C stops the build, not cc mid-file
            return list(pool.map(one, jobs))


def built_here(compiled: Iterable[Any]) -> list[Launcher]:
    """The launchers of ``compiled`` (CUDA kernels) that this machine's Triton cache holds for its own
    Python ABI: those the loads of a warm on this GPU built, read back to hand to other hosts (none
    on Triton 3.7+)."""
    if not PER_KERNEL:
        return []
    from triton.runtime.cache import get_cache_manager

    name = f"{_NAME}{local_abi().ext_suffix}"
    pkey, version = platform_key(), local_abi().version
    found: dict[str, Launcher] = {}
    for c in compiled:
        key, _ = launcher_source(c)
        if key in found:
            continue
        path = get_cache_manager(key).get_file(name)
        if path is not None:
            with open(path, "rb") as f:
                found[key] = Launcher(key, pkey, version, name, f.read())
    return list(found.values())


def prebuild(compiled: Any, claim: Callable[[str], bool]) -> bool:
    """Build a compiled CUDA kernel's launcher into Triton's cache now, exactly as its first load
    would (``CudaLauncher``, which loads nothing onto the GPU): what a compile process
    (:mod:`warmreg.stages.processes`) does beside compiling, so the warm's loads find it built. Nothing when
    the cache holds it, when ``claim(cache key)`` is false (another process builds it) or on 3.7+.

    :returns: whether this call built it.
    """
    if not PER_KERNEL:
        return False
    from triton.backends.nvidia.driver import CudaLauncher

    key, _ = launcher_source(compiled)
    if is_built(compiled, key) or not claim(key):
        return False
    CudaLauncher(compiled.src, compiled.metadata)
    return True


def is_built(compiled: Any, key: str | None = None) -> bool:
    """Whether Triton's cache holds the C launcher of a compiled CUDA kernel for this Python ABI
    (its first load then builds nothing); always true from Triton 3.7 on. ``key``: its
    :func:`launcher_source` cache key, if known."""
    if not PER_KERNEL:
        return True
    from triton.runtime.cache import get_cache_manager

    key = key if key is not None else launcher_source(compiled)[0]
    return get_cache_manager(key).get_file(f"{_NAME}{local_abi().ext_suffix}") is not None


def install(cache_key: str, name: str, data: bytes) -> bool:
    """Put a launcher where Triton's ``compile_module_from_src`` looks for it (its cache manager
    writes atomically). Returns ``False`` if one is there already."""
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager(cache_key)
    if manager.get_file(name) is not None:
        return False
    manager.put(data, name, binary=True)
    return True


def fits_here(launcher_platform_key: str, name: str) -> bool:
    """Whether a carried launcher is for this machine's platform and Python ABI."""
    return launcher_platform_key == platform_key() and name == f"{_NAME}{local_abi().ext_suffix}"
