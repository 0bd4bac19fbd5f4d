"""Packs of compiles that someone else's code runs: an engine's own kernels, compiled by the engine's own warmup.

:func:`record_pack` gives the block a fresh Triton cache and Triton's driver for the pack's target, records every
compile Triton starts in it (Triton's pre-compile hook: the function and its serialized specialization), each under
the label of the key being compiled, and writes what compiled as a pack in warmreg's format (the writer of
:mod:`warmreg.stages.build`): entries per binary, every file with its sha256, the manifest's ``engine`` section as
the builder gives it. ``warmreg pack install`` installs it like any pack, once a plugin's
``warmreg_pack_functions`` supplies the engine's functions (:mod:`warmreg.contract.hookspecs`), and an engine's
integration installs it at start-up with :func:`install_engine_pack` (no warmreg plan holds the engine's kernels).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import triton

from .. import _triton
from .._triton import cache as _triton_cache
from ..support import bounded_json as _json
from ..support.outputs import check_output
from ..support.version import __version__
from ..values.platform import Platform, resolve_platform
from .build import _cache_at, _publish_pack
from .pack import InstallReport, _prefetched_install, inspect_pack, install
from .pack_format import FORMAT, Manifest, PackEntry, PackError, PackFile, _sha256

__all__ = ["PackRecording", "install_engine_pack", "record_pack"]

#: what Triton's cache entry holds that a pack carries (``cache_files``: the metadata and the binary)
_CARRIED = (".json", ".cubin", ".hsaco")


@attrs.frozen
class _Compile:
    """One compile Triton started in the block, and the key it was started for."""

    kernel: str
    key: dict[str, Any]
    jit: Any
    specialization_data: str


class PackRecording:
    """The compiles of a :func:`record_pack` block; label each key's compiles with :meth:`key`.

    After the block, :attr:`manifest` is the pack's manifest and :attr:`failed` the labels of keys whose compile
    left no binary (the pack is then not written).
    """

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.compiles: list[_Compile] = []
        self.failed: list[tuple[str, str]] = []
        self.manifest: Manifest | None = None
        self._label: tuple[str, dict[str, Any]] | None = None

    @contextlib.contextmanager
    def key(self, *, kernel: str, key: str, kind: str) -> Iterator[None]:
        """Label the compiles the block starts (on this thread) as ``kernel``'s ``key``.

        :param kernel: the kernel's name, as the pack's entries give it.
        :param key: the engine's key, as text (the same in every process).
        :param kind: the engine's key type (``module.QualName``).
        """
        previous, self._label = self._label, (kernel, {"type": kind, "fields": {"key": key}})
        try:
            yield
        finally:
            self._label = previous

    def _on_compile(self, request: Any) -> None:
        if self._label is None or request.jit is None or request.specialization_data is None:
            raise PackError(
                "<record>",
                f"Triton compiled {request.jit_name} outside a labelled key",
                fix="compile inside recording.key(...)",
            )
        kernel, key = self._label
        self.compiles.append(_Compile(kernel, key, request.jit, request.specialization_data))

    def _entries(self, staged: Path) -> list[PackEntry]:
        """One entry per binary the block compiled, its files written under ``staged``; a compile whose cache
        entry is missing (it failed) is listed in :attr:`failed`."""
        entries: dict[str, PackEntry] = {}
        cache = Path(_triton_cache.cache_dir())
        for c in self.compiles:
            binary = _triton_cache.local_cache_hash(c.jit, c.specialization_data, self.platform)
            if binary in entries:
                continue
            files = _group_files(cache / _triton_cache.cache_subdir(binary))
            if files is None:
                self.failed.append((c.kernel, c.key["fields"]["key"]))
                continue
            for name, data in files.items():
                dest = staged / "files" / binary / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            entries[binary] = PackEntry(
                kernel=c.kernel, key=c.key, jit_name=_triton.full_name(c.jit), source_hash=_triton.source_hash(c.jit),
                specialization_data=c.specialization_data, binary_hash=binary,
                files=[PackFile(name, len(data), _sha256(data)) for name, data in sorted(files.items())],
            )  # fmt: skip
        return list(entries.values())


def _group_files(directory: Path) -> dict[str, bytes] | None:
    """The carried files of the cache entry in ``directory`` (through its group file, which Triton publishes
    last), or ``None`` where there is no whole entry."""
    groups = sorted(directory.glob("__grp__*.json")) if directory.is_dir() else []
    if not groups:
        return None
    children = _json.loads(groups[0].read_bytes()).get("child_paths", {})
    files = {
        name: Path(path).read_bytes()
        for name, path in children.items()
        if name.endswith(_CARRIED) and Path(path).is_file()
    }
    return files if sum(name.endswith(".json") for name in files) == 1 and len(files) > 1 else None


@contextlib.contextmanager
def record_pack(
    output: str | os.PathLike[str],
    *,
    target: str | Platform,
    model_type: str,
    engine: Mapping[str, Any],
    force: bool = False,
) -> Iterator[PackRecording]:
    """Record every Triton compile of the block, and write what compiled as a pack at ``output``.

    The block runs with a fresh Triton cache (``TRITON_CACHE_DIR``), Triton's driver for ``target`` (a cross
    target needs no GPU) and a pre-compile hook that records each compile under the key labelled with
    :meth:`PackRecording.key`. Run it in a fresh process: a specialization a function already holds in memory is
    not compiled again, so not recorded. Compiles may run on Triton's async compile pool
    (``triton.AsyncCompileMode``, ``ignore_errors=True``) opened inside the block; the pack is written after it.

    :param output: a directory, or a file ending in ``.tar``, ``.tar.gz`` or ``.zip``.
    :param model_type: the deployment's model type (the manifest's ``model_type``).
    :param engine: the manifest's engine section: ``name`` and ``version`` of the engine, and what else the
        builder records (JSON values).
    :param force: replace an existing output.
    :raises PackError: if the output exists (without ``force``) or cannot be written, if the block compiled
        nothing, compiled outside a labelled key, or a compile left no binary (the pack is not written then).
    """
    out = Path(output)
    if out.exists() and not force:
        raise PackError(str(out), "already exists", fix="pass force=True (--force) or another path")
    check_output(out, "pack output", create_parents=True)
    platform = resolve_platform(target)
    section = json.loads(json.dumps(dict(engine)))  # JSON values only, copied
    recording = PackRecording(platform)
    with tempfile.TemporaryDirectory(prefix="warmreg-record-") as tmp:
        with _cache_at(os.path.join(tmp, "cache")), _triton.cross_target(platform):
            handle = _triton.install_compile_hook(recording._on_compile)
            try:
                yield recording
            finally:
                _triton.remove_compile_hook(handle)
            staged = Path(tmp) / "pack"
            entries = recording._entries(staged)
        if recording.failed:
            kernel, key = recording.failed[0]
            raise PackError(
                str(out),
                f"{len(recording.failed)} compile(s) left no binary; first: {kernel} {key}",
                fix="fix the kernel (a compile on Triton's AsyncCompileMode pool with ignore_errors=True drops its error: "
                "compile that key without the pool to see it); no pack was written",
            )
        if not entries:
            raise PackError(
                str(out), "the block compiled nothing", fix="compile the keys inside record_pack, in a fresh process"
            )
        recording.manifest = manifest = Manifest(
            format=FORMAT, warmreg_version=__version__, triton_version=triton.__version__,
            ptxas_version=_triton_cache.ptxas_version(platform), target=platform.target, python=sys.version.split()[0],
            created=time.time(), model_type=model_type, entries=entries, knobs=_triton_cache.cache_knobs(), engine=section,
        )  # fmt: skip
        (staged / "manifest.json").write_text(json.dumps(manifest.to_json(), indent=1))
        _publish_pack(staged, out, force=force)


def install_engine_pack(
    path: str | os.PathLike[str], *, engine: str, target: str | Platform | None = None
) -> InstallReport | None:
    """Install a pack of ``engine``'s own kernels (a :func:`record_pack` pack whose manifest's ``engine`` section
    names it) into Triton's cache, without a warm: as ``warmreg pack install`` does, each entry's Triton function
    from the installed plugins' ``warmreg_pack_functions``. A :func:`warmreg.prefetch` of the same pack into this
    cache for this target is waited for, not repeated.

    :param engine: the engine's name (``"vllm"``); a pack of any other engine, or of warmreg's own kernels, is left
        alone (those go to :func:`warmreg.warm`'s ``pack``).
    :param target: the platform this machine serves (default: the pack's target).
    :returns: what the install did, or ``None`` for a pack that is not ``engine``'s.
    :raises PackError: if the pack cannot be read or does not fit this machine (Triton, ptxas, knobs, target).
    :raises CacheError: if Triton's cache directory cannot be written.
    """
    manifest = inspect_pack(Path(path))
    if manifest.engine is None or manifest.engine.get("name") != engine:
        return None
    platform = resolve_platform(target) if target is not None else Platform.parse(manifest.target)
    return _prefetched_install(path, platform) or install(Path(path), target=platform)
