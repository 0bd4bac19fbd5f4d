"""A disk-cache hit loaded directly: what ``JITFunction.warmup`` returns on a hit, without running it.

Part of the Triton adapter, checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0; tested in
``tests/test_triton_adapter.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import triton
from triton.compiler.compiler import AsmDict
from triton.runtime.jit import JITFunction

from ..support import bounded_json
from ..values.platform import Platform
from .cache import cache_dir, cache_subdir, hashed_source, metadata_filename
from .compiler import touch
from .hooks import only_own_compile_hook
from .target import current_device

__all__ = ["load_hit", "remember_found_group", "remember_group"]

#: Cache entries a pack install published (or found whole) in this process, or the prefetch found whole for a kept
#: specialization, ``(cache directory, hash, metadata file) -> child paths``:
#: a warm's hit of one reads its metadata and binary without Triton's ``get_group`` (its directory
#: created again, the group file read, every child's existence checked: 0.08 ms a key on the CPU machine).
_published: dict[tuple[str, str, str], dict[str, str]] = {}


def remember_group(cache: str, binary_hash: str, name: str, children: dict[str, str]) -> None:
    """Remember the child paths of a cache entry just published (or found whole) under ``cache``."""
    if len(_published) >= 4096:
        _published.clear()
    _published[(cache, binary_hash, name)] = dict(children)


def remember_found_group(cache: str, binary_hash: str, name: str) -> bool:
    """Remember the child paths of a cache entry found whole under ``cache`` (its group file read, every child a
    file), as :func:`remember_group` does for one just published: a pack install's entry already there, or a
    disk-cache entry the prefetch finds for a kept specialization (:mod:`warmreg.stages.remember`), read here off
    the warm's path. Nothing is created: an entry missing, damaged or in part removed is left to Triton's read.

    :returns: whether the entry is whole (and now remembered).
    """
    group = os.path.join(cache, cache_subdir(binary_hash), f"__grp__{name}")
    try:
        with open(group, "rb") as f:
            children = bounded_json.loads(f.read(), max_depth=4, max_values=1024)["child_paths"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(children, dict) or not all(isinstance(p, str) and os.path.isfile(p) for p in children.values()):
        return False
    remember_group(str(Path(cache)), binary_hash, name, children)
    return True


def load_hit(jit: JITFunction, triton_key: str | None, specialization_data: str | None, platform: Platform) -> Any:
    """What ``JITFunction.warmup`` returns for a launch whose binary is in Triton's disk cache, without
    running it: the ``CompiledKernel`` of the cache entry (Triton's ``compile`` on a hit), the compilation
    listener called, the kernel put in ``jit``'s in-memory cache under ``triton_key``
    (``JITFunction._do_compile``). Call it inside the warm's compile scope.

    A warm already bound the launch and hashed its specialization; ``warmup`` would bind and hash it
    again (0.5 ms a key on the H200 host). The kernel reads its metadata and binary now, and the text of
    each intermediate representation (``kernel.asm["ptx"]`` and the like, which a launch never reads)
    from the entry when first asked for (:class:`_LazyAsm`). An entry a pack install of this process published or the
    prefetch found (:func:`remember_group`, :func:`remember_found_group`) is read without Triton's ``get_group``; one
    removed since, as Triton reads it.

    ``None`` where Triton's own path must run: no entry, a pre- or post-compile hook other than warmreg's
    own monitor (which ignores a warm's compiles), or a knob that changes what a hit does
    (``always_compile``, a stages-inspection hook).
    """
    from triton.compiler.compiler import CompiledKernel, CompileTimer
    from triton.runtime.cache import get_cache_manager

    knobs = triton.knobs
    if triton_key is None or specialization_data is None or knobs.compilation.always_compile:
        return None
    if knobs.runtime.add_stages_inspection_hook is not None or knobs.runtime.jit_post_compile_hook is not None:
        return None
    if not only_own_compile_hook():
        return None
    try:
        binary_hash, src = hashed_source(jit, specialization_data, platform)
    except Exception:  # Triton's own path reports it
        return None
    timer, name = CompileTimer(), metadata_filename(src)
    binary = f".{jit.device_caches[current_device()][3].binary_ext}"  # the backend's (cubin, hsaco)
    published = _published.pop((str(Path(cache_dir())), binary_hash, name), None) if knobs.cache.manager_class is None else None
    whole = published and name in published and all(os.path.isfile(p) for c, p in published.items() if c.endswith((".json", binary)))
    group = published if whole else get_cache_manager(binary_hash).get_group(name)  # else: read as Triton reads it
    if not group or name not in group:
        return None
    kernel = _kernel(CompiledKernel, src, group, binary, binary_hash)
    if (listener := knobs.compilation.listener) is not None:
        listener(src=src, metadata=kernel.metadata._asdict(), metadata_group=group, times=timer.end(), cache_hit=True)
    jit.device_caches[current_device()][0][triton_key] = kernel
    touch(jit)
    return kernel


def _kernel(cls: Any, src: Any, group: dict[str, str], binary: str, binary_hash: str) -> Any:
    """The ``CompiledKernel`` of one cache entry's group, its IR texts read when first asked for."""
    later = {os.path.splitext(path)[1][1:]: path for child, path in group.items() if not child.endswith((".json", binary))}
    kernel = cls(src, {child: path for child, path in group.items() if child.endswith((".json", binary))}, binary_hash)
    kernel.metadata_group, kernel.asm = group, _LazyAsm(kernel.asm, later)
    return kernel


class _LazyAsm(AsmDict):
    """``CompiledKernel.asm`` whose intermediate representations (TTIR, TTGIR, LLIR, PTX: text files, the
    largest part of an entry) are read from the cache entry when first asked for; every dict operation
    sees them, and Triton's own ``AsmDict`` derives the rest (``sass``)."""

    def __init__(self, loaded: dict[str, Any], later: dict[str, str]) -> None:
        super().__init__(loaded)
        self._later = dict(later)

    def __missing__(self, key: str) -> Any:
        path = self._later.pop(key, None)
        if path is None:
            return super().__missing__(key)  # Triton's own derivation (or its KeyError)
        value = self[key] = Path(path).read_text()
        return value

    def _read_all(self) -> None:
        for key in list(self._later):
            self[key]

    def __contains__(self, key: object) -> bool:
        return key in self._later or super().__contains__(key)

    def __len__(self) -> int:
        return super().__len__() + len(self._later)

    def __iter__(self) -> Any:
        self._read_all()
        return super().__iter__()

    def keys(self) -> Any:
        self._read_all()
        return super().keys()

    def items(self) -> Any:
        self._read_all()
        return super().items()

    def values(self) -> Any:
        self._read_all()
        return super().values()

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default
