"""Building packs: a plan compiled into an empty Triton cache, its entries and C launchers staged, published whole.

:func:`build` runs the warm pipeline with the build's stages (:func:`warmreg.stages.compose.for_build`) into
a temporary cache directory, then writes the pack (the format: :mod:`warmreg.stages.pack_format`); readers
never see a half-written pack. :func:`build_wheel` wraps a pack as an installable wheel.
"""

from __future__ import annotations

import ctypes
import errno
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import triton

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton import launchers as _triton_launchers
from ..contract.config import WarmConfig
from ..pipeline.report import KeyResult
from ..support.outputs import check_output
from ..support.version import __version__
from ..values.platform import Platform, resolve_platform
from . import tuning
from .pack import entry_from_result
from .pack_format import _ARCHIVES, FORMAT, Manifest, PackChoice, PackEntry, PackError, PackFile, PackLauncher, _sha256
from .pack_reader import lock

__all__ = ["build", "build_wheel"]

log = logging.getLogger("warmreg.stages.build")




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
    progress: bool | None = None,
    tuning_choices: str | os.PathLike[str] | None = None,
    keep_in_cache: bool = False,
) -> Manifest:
    """Compile every key of ``config`` for ``target`` and write a pack (no GPU needed for a cross target).

    Every autotune candidate is compiled. Which one each tuning key uses is recorded in the pack
    (installed with it, so a serving host benchmarks nothing) when it is known: built on the local
    GPU, the build tunes them; a cross build takes them from ``tuning_choices``, a choice file a
    warm on the serving GPU model kept (``warmreg-tuning/<device>-triton-<release>.json`` in its
    Triton cache). Without either, a warm from the pack on the GPU benchmarks the compiled
    candidates (it compiles nothing).

    :param output: a directory, or a file ending in ``.tar``, ``.tar.gz`` or ``.zip``.
    :param force: replace an existing output.
    :param progress: show a progress bar while compiling (default: when stderr is a terminal).
    :param launcher_pythons: for CUDA targets, Python interpreters (names or paths; ``None`` is this
        one) whose ABI the pack carries Triton's C launchers for, so that a serving host with that
        Python neither runs a C compiler nor waits for one; empty for none. Default: this interpreter
        when a C compiler and its headers are at hand (the pack then simply has none otherwise).
    :param keep_in_cache: also copy each built entry into the process's own Triton cache (where it is
        missing), so that a warm there after the build compiles nothing (``warmreg build`` does).
    :raises PackError: if no kernel declares a key for the config, a key failed to compile (no pack is
        written), a launcher could not be built, or the output exists.
    """
    out = Path(output)
    the_plan = _plan(config, out, target, plugins, entry_points, force)
    from ..pipeline.run import default_workers, run
    own_cache = _triton_cache.cache_dir()  # a build after a warm copies what that warm compiled (stages/seed.py)
    with tempfile.TemporaryDirectory(prefix="warmreg-build-") as tmp:
        with _cache_at(os.path.join(tmp, "cache")):
            _triton.forget_compiled()  # compile into the empty cache, even keys this process has loaded
            workers = workers or default_workers()
            from . import compose  # the stages import torch: after the refusals above

            stages = compose.for_build(the_plan, workers=workers, seed_from=own_cache)
            tune = next((s for s in stages if isinstance(s, tuning.Tune)), None)
            results = run(the_plan, workers=workers, on_error="continue", stages=stages, progress=progress, verb="build")
            if failed := [r for r in results if r.status == "failed"]:
                raise PackError(str(out), f"{len(failed)} key(s) failed to compile; first: {failed[0].kernel}: {failed[0].error}", fix="fix the kernel")
            staged = Path(tmp) / "pack"
            entries = _stage_entries(the_plan, results, staged)
            if keep_in_cache:
                _keep(results, Path(own_cache))
            pythons: list[str | None] = [None] if launcher_pythons is None else list(launcher_pythons)
            launchers = _build_launchers(results, the_plan.platform, pythons, staged, str(out), workers, required=launcher_pythons is not None)
        manifest = _manifest(the_plan, entries, launchers, _choices(the_plan, tune, tuning_choices))
        (staged / "manifest.json").write_text(json.dumps(manifest.to_json(), indent=1))
        _publish_pack(staged, out, force=force)
    return manifest


def _plan(config: Any, out: Path, target: str | Platform | None, plugins: Iterable[Any], entry_points: bool, force: bool) -> Any:
    """The build's plan; an output that exists (without ``force``) or could not be written, a bad config or target
    are refused before the pipeline imports, a plan without keys after."""
    if out.exists() and not force:
        raise PackError(str(out), "already exists", fix="pass force=True (--force) or another path")
    check_output(out, "pack output", create_parents=True)  # before compiling, not after
    config = WarmConfig.load(config)
    resolve_platform(target)
    from ..pipeline.planning import plan

    the_plan = plan(config, target=target, plugins=plugins, entry_points=entry_points)
    if not the_plan.num_keys:
        raise PackError(
            str(out), f"no kernel declares a key for model_type {the_plan.config.model_type!r} on {the_plan.platform.target}",
            fix="install the model family's plugin (`warmreg plugins` lists what is loaded)",
        )
    return the_plan


def _manifest(the_plan: Any, entries: list[PackEntry], launchers: list[PackLauncher], choices: list[PackChoice]) -> Manifest:
    platform = the_plan.platform
    return Manifest(
        format=FORMAT, warmreg_version=__version__, triton_version=triton.__version__, ptxas_version=_triton_cache.ptxas_version(platform),
        target=platform.target, python=sys.version.split()[0], created=time.time(), model_type=the_plan.config.model_type,
        entries=entries, launchers=launchers, tuning=choices, knobs=_triton_cache.cache_knobs(),
    )  # fmt: skip


def _keep(results: list[KeyResult], own_cache: Path) -> None:
    """Copy each result's entry from the build's cache into ``own_cache`` where that has none (stages/seed.py)."""
    from .seed import copy_entry

    for r in results:
        where = {Path(p).parent for p in r.cache_files.values()}
        if len(where) == 1 and not (own_cache / (src := where.pop()).name).exists():
            copy_entry(src, own_cache / src.name)


def _stage_entries(the_plan: Any, results: list[KeyResult], staged: Path) -> list[PackEntry]:
    """Each result's entry, its files written under ``staged``."""
    entries = []
    for r in results:
        entry, blobs = entry_from_result(r, the_plan.kernel(r.kernel).kernel_for(r.key))
        for name, data in blobs.items():
            dest = staged / entry.member(PackFile(name, len(data), ""))
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        entries.append(entry)
    return entries


def _choices(the_plan: Any, tune: tuning.Tune | None, path: str | os.PathLike[str] | None) -> list[PackChoice]:
    if tune is not None:
        return tuning.pack_choices(the_plan, tune.choices, _triton.device_name())
    return tuning.choices_from_file(the_plan, path) if path is not None else []


def build_wheel(config: Any, out_dir: str | Path, **kwargs: Any) -> tuple[Path, Manifest]:
    """:func:`build` a pack and write it as an installable wheel into ``out_dir``; returns the wheel's
    path and the pack's manifest.

    The wheel is ``warmreg_pack_<model type>_<target>_<keys digest>-<version>-py3-none-any.whl``: one
    distribution per model type, target and set of keys, and a version that grows with each build,
    so ``pip install`` of a rebuilt wheel replaces the older one (:mod:`warmreg.stages.pack_wheel`).
    ``pip install`` of the wheel registers the pack in the ``warmreg.packs`` entry-point group, and
    :func:`warmreg.warm` installs it first wherever its model type, target and Triton release match.
    Keyword arguments are :func:`build`'s.
    """
    from .pack_wheel import write_wheel

    out = Path(out_dir)
    check_output(out / "probe.whl", "wheel output", create_parents=True)
    with tempfile.TemporaryDirectory(prefix="warmreg-wheel-") as tmp:
        pack_dir = Path(tmp) / "pack"
        manifest = build(config, pack_dir, **kwargs)
        return write_wheel(pack_dir, manifest, out), manifest


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


def _publish_pack(staged: Path, out: Path, *, force: bool) -> None:
    """Write the pack staged in ``staged`` beside ``out``, then publish it in one step: readers see
    the old pack or the new one, whole. Publishers of one directory take turns with each other and
    with readers of a directory pack there (:func:`_turn`); the last publisher wins, and without
    ``force`` an output that appeared meanwhile is refused. Nothing is left beside ``out``: neither
    the staging copy nor the pack it replaced.

    :raises PackError: without ``force``, if ``out`` exists.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _write_staged(staged, tmp, out.name)
        with _turn(out.parent):
            if os.path.lexists(out) and not force:
                raise PackError(str(out), "already exists (another build wrote it meanwhile)", fix="pass force=True (--force) or another path")
            if os.path.lexists(out) and (out.is_dir() or tmp.is_dir()):
                _exchange(tmp, out)  # tmp now holds the pack replaced
            else:
                os.replace(tmp, out)  # a file replaces a file in one step
    finally:
        _remove(tmp)


def _write_staged(staged: Path, tmp: Path, name: str) -> None:
    if not name.endswith(_ARCHIVES):
        shutil.copytree(staged, tmp)
        return
    members = [p for p in sorted(staged.rglob("*")) if p.is_file()]
    if name.endswith(".zip"):
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in members:
                zf.write(p, p.relative_to(staged).as_posix())
        return
    with tarfile.open(tmp, "w:gz" if name.endswith(("gz", "tgz")) else "w") as tar:
        for p in members:
            tar.add(p, p.relative_to(staged).as_posix(), recursive=False)


@contextmanager
def _turn(directory: Path) -> Iterator[None]:
    """Publish in turn: an exclusive lock on ``directory`` (:func:`~warmreg.stages.pack_reader.lock`),
    which waits for the readers of a directory pack there."""
    fd = lock(directory, shared=False)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths: atomically (Linux ``renameat2(RENAME_EXCHANGE)``) where the system and file
    system can, else in three renames (``b`` is then briefly absent)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is not None:
        at_cwd = -100  # AT_FDCWD: the paths are absolute or relative to the working directory
        if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))
    aside = a.with_name(f"{a.name}.old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(aside, b)  # the old pack back in place
        raise
    os.rename(aside, a)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()
