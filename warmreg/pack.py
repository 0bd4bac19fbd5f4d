"""Packs: warm caches built ahead of time (on any machine), verified, and installed into Triton's cache.

A pack is a directory or a single ``.tar`` / ``.tar.gz`` / ``.zip`` file holding ``manifest.json``,
``files/<builder hash>/<kernel>.{json,cubin|hsaco}`` and, for CUDA targets, Triton's C launchers
prebuilt for named Python versions, ``launchers/<Triton's launcher key>/__triton_launcher<ABI suffix>``
(see :mod:`warmreg._triton_launchers`; installed only where the platform and Python ABI match). The manifest names the warmreg, Triton and
ptxas versions, the target, each entry's kernel, key, source hash and Triton specialization, and
each file's size and sha256; it carries a digest of itself, so an edited manifest is refused. No
pickle anywhere: JSON and raw binaries only.

Install does not copy directories: Triton's cache key hashes its own installation, which differs
between Python builds of one release, so each entry is written under the hash the *local* Triton
computes. Every file is verified before anything is written. Each entry is written as uniquely named
files, then published by atomically replacing Triton's group file (``__grp__<name>.json``), which is
how Triton finds a cache entry: readers see a whole entry or none, and a crash leaves only unused
files behind. Packs are installed into the writable cache (not layered in front of it), so Triton's
ordinary JIT path finds every binary with no hook.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import triton

from . import _triton, _triton_cache, _triton_launchers
from ._pack_format import (
    _ARCHIVES,
    FORMAT,
    Manifest,
    PackEntry,
    PackError,
    PackFile,
    PackLauncher,
    _check_file,
    _Reader,
    _sha256,
)
from .compile import compile_keys
from .errors import WarmregError
from .key import CompileKey
from .platform import Platform
from .report import KeyResult
from .warm import default_workers, plan, resolve_platform

__all__ = ["FORMAT", "InstallReport", "Manifest", "PackError", "PackLauncher", "build", "install", "verify"]

log = logging.getLogger("warmreg.pack")

def _check_machine(reader: _Reader, manifest: Manifest, platform: Platform | None) -> None:
    if manifest.triton_version != triton.__version__:
        raise PackError(
            reader.name,
            f"was built with Triton {manifest.triton_version}, this machine has {triton.__version__}",
            fix=f"install triton=={manifest.triton_version} or rebuild the pack here",
        )
    if platform is not None and Platform.parse(manifest.target).target.split("+")[0] != platform.target.split("+")[0]:
        raise PackError(reader.name, f"targets {manifest.target}, this warm targets {platform.target}", fix="build a pack for this target")
    if manifest.ptxas_version is not None:
        local = _triton_cache.ptxas_version(Platform.parse(manifest.target))
        if local != manifest.ptxas_version:
            raise PackError(
                reader.name, f"was built with ptxas {manifest.ptxas_version!r}, this Triton uses {local!r}", fix="rebuild the pack here"
            )


def verify(path: str | Path, *, target: str | Platform | None = None) -> Manifest:
    """Check a pack completely: manifest digest, every file's size and sha256, Triton/ptxas/target.

    :returns: the manifest.
    :raises PackError: on the first problem, saying which and why.
    """
    reader = _Reader(Path(path))
    manifest = reader.manifest()
    _check_machine(reader, manifest, resolve_platform(target) if target is not None else None)
    for entry in manifest.entries:
        for f in entry.files:
            _check_file(reader, entry, f)
    for launcher in manifest.launchers:
        _check_file(reader, launcher, launcher.file)
    return manifest


def inspect_pack(path: str | Path) -> Manifest:
    """Read a pack's manifest (digest checked; files not verified)."""
    return _Reader(Path(path)).manifest()


# -- installing ---------------------------------------------------------------------------------


@attrs.frozen
class InstallReport:
    """What an install did: entries written, already present, and refused with reasons."""

    pack: str
    installed: int
    present: int
    refused: tuple[tuple[str, str], ...]
    seconds: float
    #: prebuilt C launchers written into the cache (those for this machine's Python ABI, not yet there)
    launchers: int = 0


def install(path: str | Path, *, target: str | Platform | None = None, all_or_nothing: bool = False) -> InstallReport:
    """Install a pack into Triton's cache directory (``TRITON_CACHE_DIR``), under local cache keys.

    :param target: the platform this machine warms for (default: the pack's target).
    :param all_or_nothing: refuse the whole pack if any entry is refused.
    :raises PackError: for a pack that does not fit this machine at all, or under ``all_or_nothing``.
    """
    start = time.perf_counter()
    reader = _Reader(Path(path))
    manifest = reader.manifest()
    platform = resolve_platform(target) if target is not None else Platform.parse(manifest.target)
    _check_machine(reader, manifest, platform)
    blobs: list[tuple[PackEntry, dict[str, bytes] | WarmregError]] = []
    for entry in manifest.entries:
        try:
            blobs.append((entry, {f.name: _check_file(reader, entry, f) for f in entry.files}))
        except WarmregError as exc:
            blobs.append((entry, exc))
    fitting = [x for x in manifest.launchers if _triton_launchers.fits_here(x.platform_key, x.file.name)]
    launcher_blobs = [(x, _check_file(reader, x, x.file)) for x in fitting]  # verified before anything is written
    installed, present, refused = install_entries(blobs, platform, pack=reader.name, all_or_nothing=all_or_nothing)
    launchers = sum(_triton_launchers.install(x.cache_key, x.file.name, data) for x, data in launcher_blobs)
    return InstallReport(reader.name, installed, present, tuple(refused), time.perf_counter() - start, launchers)


def install_entries(
    items: Iterable[tuple[PackEntry, dict[str, bytes] | WarmregError]],
    platform: Platform,
    *,
    pack: str,
    all_or_nothing: bool = False,
) -> tuple[int, int, tuple[tuple[str, str], ...]]:
    """Write verified entries into the local Triton cache under the keys the local Triton computes.

    Shared by pack install and the distributed warm (entries received from other ranks).

    :param items: each entry with its files' bytes (already checked against the manifest), or the
        error that refused it.
    :returns: ``(installed, already present, refused (entry, reason))``.
    :raises PackError: under ``all_or_nothing`` if any entry is refused; nothing is written then.
    """
    ready: list[tuple[PackEntry, dict[str, bytes], str]] = []
    refused: list[tuple[str, str]] = []
    for entry, blobs in items:
        try:
            if isinstance(blobs, WarmregError):
                raise blobs
            jit = _triton_cache.import_jit(entry.jit_name)
            if _triton.source_hash(jit) != entry.source_hash:
                raise PackError(pack, f"kernel {entry.jit_name} changed since the pack was built (source hash differs)", fix="rebuild the pack")
            ready.append((entry, blobs, _triton_cache.local_cache_hash(jit, entry.specialization_data, platform)))
        except WarmregError as exc:
            refused.append((f"{entry.kernel} {entry.key.get('fields')}", str(exc)))
    if refused and all_or_nothing:
        raise PackError(pack, f"{len(refused)} entries refused (all-or-nothing): {refused[0][1]}", fix="rebuild the pack")
    cache = Path(_triton_cache.cache_dir())
    # entries are independent, and each file's fsync waits on the disk with the GIL released
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(ready))), thread_name_prefix="warmreg-install") as pool:
        published = list(pool.map(lambda item: _publish(cache, *item), ready))
    installed = sum(published)
    return installed, len(published) - installed, tuple(refused)


def entry_from_result(result: KeyResult, kernel: Any) -> tuple[PackEntry, dict[str, bytes]]:
    """A pack entry and its files' bytes for one warmed key (read from the local Triton cache).

    :raises PackError: if the result has no binary in the cache.
    """
    if result.status == "failed" or not result.cache_files or not result.specialization_data or not result.jit_name:
        raise PackError("<build>", f"no binary was recorded for {result.kernel} {result.key}", fix="report this as a warmreg bug")
    blobs = {name: Path(path).read_bytes() for name, path in sorted(result.cache_files.items())}
    files = [PackFile(name, len(data), _sha256(data)) for name, data in blobs.items()]
    entry = PackEntry(
        kernel=result.kernel, key=result.key.to_json(), jit_name=result.jit_name,
        source_hash=_triton.source_hash(kernel.jit_for(result.key)), specialization_data=result.specialization_data,
        binary_hash=result.binary_hash or "", files=files,
    )  # fmt: skip
    return entry, blobs


def _publish(cache: Path, entry: PackEntry, blobs: dict[str, bytes], local_hash: str) -> bool:
    """Write one entry's files under unique names, then atomically publish its group file."""
    directory = cache / _triton_cache.cache_subdir(local_hash)
    meta_name = next(n for n in blobs if n.endswith(".json"))
    group = directory / f"__grp__{meta_name}"
    if group.exists():
        try:
            existing = json.loads(group.read_text())["child_paths"]
            if all(Path(p).is_file() for p in existing.values()):
                return False  # already installed (by us, another installer, or Triton itself)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged group file is replaced below
    directory.mkdir(parents=True, exist_ok=True)
    writer = uuid.uuid4().hex[:12]
    children: dict[str, str] = {}
    for name, data in blobs.items():
        if name == meta_name:
            meta = json.loads(data)
            meta["hash"] = local_hash  # the entry now lives under the local key
            data = json.dumps(meta).encode()
        stem, _, ext = name.rpartition(".")
        final = directory / f"{stem}.{writer}.{ext}"
        _atomic_write(final, data)
        children[name] = str(final)
    _atomic_write(group, json.dumps({"child_paths": children}).encode())
    return True


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- building -----------------------------------------------------------------------------------


@contextmanager
def _cache_at(directory: str) -> Iterator[None]:
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous


def build(
    config: Any,
    output: str | Path,
    *,
    target: str | Platform | None = None,
    workers: int | None = None,
    plugins: Iterable[Any] = (),
    entry_points: bool = True,
    force: bool = False,
    launcher_pythons: Iterable[str | None] | None = None,
) -> Manifest:
    """Compile every key of ``config`` for ``target`` and write a pack (no GPU needed for a cross target).

    :param output: a directory, or a file ending in ``.tar``, ``.tar.gz`` or ``.zip``.
    :param force: replace an existing output.
    :param launcher_pythons: for CUDA targets, Python interpreters (names or paths; ``None`` is this
        one) whose ABI the pack carries Triton's C launchers for, so that a serving host with that
        Python neither runs a C compiler nor waits for one; empty for none. Default: this interpreter
        when a C compiler and its headers are at hand (the pack then simply has none otherwise).
    :raises PackError: if no kernel declares a key for the config, a key failed to compile (no pack is
        written), a launcher could not be built, or the output exists.
    """
    out = Path(output)
    if out.exists() and not force:
        raise PackError(str(out), "already exists", fix="pass force=True (--force) or another path")
    the_plan = plan(config, target=target, plugins=plugins, entry_points=entry_points)
    platform = the_plan.platform
    if not the_plan.num_keys:
        raise PackError(
            str(out), f"no kernel declares a key for model_type {the_plan.config.model_type!r} on {platform.target}",
            fix="install the model family's plugin (`warmreg plugins` lists what is loaded)",
        )
    with tempfile.TemporaryDirectory(prefix="warmreg-build-") as tmp:
        with _cache_at(os.path.join(tmp, "cache")):
            _triton.forget_compiled()  # compile into the empty cache, even keys this process has loaded
            results = compile_keys(the_plan.items(), platform=platform, workers=workers or default_workers(), on_error="continue")
            failed = [r for r in results if r.status == "failed"]
            if failed:
                raise PackError(str(out), f"{len(failed)} key(s) failed to compile; first: {failed[0].kernel}: {failed[0].error}", fix="fix the kernel")
            entries = []
            staged = Path(tmp) / "pack"
            for r in results:
                entry, blobs = entry_from_result(r, the_plan.kernel(r.kernel).kernel_for(r.key))
                for name, data in blobs.items():
                    dest = staged / entry.member(PackFile(name, len(data), ""))
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                entries.append(entry)
            pythons: list[str | None] = [None] if launcher_pythons is None else list(launcher_pythons)
            launchers = _build_launchers(
                results, platform, pythons, staged, str(out), workers or default_workers(), required=launcher_pythons is not None
            )
        from . import __version__

        manifest = Manifest(
            format=FORMAT, warmreg_version=__version__, triton_version=triton.__version__, ptxas_version=_triton_cache.ptxas_version(platform),
            target=platform.target, python=sys.version.split()[0], created=time.time(), model_type=the_plan.config.model_type,
            entries=entries, launchers=launchers,
        )  # fmt: skip
        (staged / "manifest.json").write_text(json.dumps(manifest.to_json(), indent=1))
        _publish_pack(staged, out)
    return manifest


def _build_launchers(
    results: list[KeyResult], platform: Platform, pythons: list[str | None], staged: Path, out: str, workers: int, *, required: bool
) -> list[PackLauncher]:
    if not pythons or platform.backend != "cuda" or not _triton_launchers.PER_KERNEL:
        return []  # Triton 3.7+ launches every kernel through one generic launcher: nothing to carry
    compiled = []
    for r in results:
        kernel = _triton_cache.memory_kernel(_triton_cache.import_jit(r.jit_name or ""), r.triton_key or "", platform)
        if kernel is None:
            raise PackError(out, f"the compiled kernel of {r.kernel} {r.key} is not in memory", fix="report this as a warmreg bug")
        compiled.append(kernel)
    try:
        built = _triton_launchers.build(compiled, pythons, workers=workers)
    except _triton_launchers.LauncherError as exc:
        if not required:
            log.warning("pack %s carries no C launchers: %s", out, exc)
            return []
        raise PackError(out, f"cannot build Triton's C launchers: {exc}", fix="fix the above, or pass --no-launchers") from exc
    launchers = []
    for x in built:
        launcher = PackLauncher(cache_key=x.cache_key, platform_key=x.platform_key, python=x.python, file=PackFile(x.name, len(x.data), _sha256(x.data)))
        dest = staged / launcher.member()
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(x.data)
        launchers.append(launcher)
    return launchers


def _publish_pack(staged: Path, out: Path) -> None:
    """Stage, then rename: readers never see a half-written pack."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    if out.name.endswith(_ARCHIVES):
        if out.name.endswith(".zip"):
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
                for p in sorted(staged.rglob("*")):
                    if p.is_file():
                        zf.write(p, p.relative_to(staged).as_posix())
        else:
            with tarfile.open(tmp, "w:gz" if out.name.endswith(("gz", "tgz")) else "w") as tar:
                for p in sorted(staged.rglob("*")):
                    if p.is_file():
                        tar.add(p, p.relative_to(staged).as_posix(), recursive=False)
    else:
        shutil.copytree(staged, tmp)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)


def entry_keys(manifest: Manifest) -> list[CompileKey | None]:
    """The compile keys of a manifest's entries (``None`` where the key type is not importable)."""
    keys: list[CompileKey | None] = []
    for e in manifest.entries:
        try:
            keys.append(CompileKey.from_json(e.key))
        except WarmregError:
            keys.append(None)
    return keys

