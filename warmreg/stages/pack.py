"""Packs: warm caches built ahead of time (on any machine), verified, and installed into Triton's cache.

A pack is a directory or a single ``.tar`` / ``.tar.gz`` / ``.zip`` file holding ``manifest.json``,
``files/<builder hash>/<kernel>.{json,cubin|hsaco}`` and, for CUDA targets, Triton's C launchers
prebuilt for named Python versions, ``launchers/<Triton's launcher key>/__triton_launcher<ABI suffix>``
(see :mod:`warmreg._triton.launchers`; installed only where the platform and Python ABI match). The manifest names the warmreg, Triton and
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

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import triton

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton import launchers as _triton_launchers
from ..contract.hookspecs import PROJECT
from ..pipeline.report import KeyResult
from ..pipeline.stage import Stage
from ..support.entry_points import entry_points as installed_entry_points
from ..values.errors import CacheError, WarmregError
from ..values.key import CompileKey
from ..values.platform import Platform, resolve_platform
from . import tuning
from .pack_format import FORMAT, Manifest, PackEntry, PackError, PackFile, PackLauncher, _sha256
from .pack_install import entry_label, install_entries, local_hash
from .pack_reader import Reader, check_entries, check_launchers
from .pack_report import InstallReport, pack_section, plan_labels
from .pack_wheel import installed_for, skip

# The planning and compiling modules (and torch with them) are imported where a build or an entry
# check needs them, so that a pack refused for what it is costs no torch import.

__all__ = [
    "FORMAT", "InstallReport", "Manifest", "PackError", "PackInstall", "PackLauncher", "entry_from_result", "entry_keys", "inspect_pack", "install", "install_entries", "installed_for", "loaded_jits", "plugin_packages", "prefetch_install", "prefetched", "verify",
]

log = logging.getLogger("warmreg.stages.pack")

def _check_machine(reader: Reader, manifest: Manifest, platform: Platform | None) -> None:
    if manifest.triton_version != triton.__version__:
        raise PackError(
            reader.name,
            f"was built with Triton {manifest.triton_version}, this machine has {triton.__version__}",
            fix=f"install triton=={manifest.triton_version} or rebuild the pack here",
        )
    if platform is not None and Platform.parse(manifest.target).target.split("+")[0] != platform.target.split("+")[0]:
        raise PackError(reader.name, f"targets {manifest.target}, this warm targets {platform.target}", fix="build a pack for this target")
    _check_knobs(reader.name, manifest.knobs)
    if manifest.ptxas_version is not None:
        local = _triton_cache.ptxas_version(Platform.parse(manifest.target))
        if local != manifest.ptxas_version:
            raise PackError(
                reader.name, f"was built with ptxas {manifest.ptxas_version!r}, this Triton uses {local!r}", fix="rebuild the pack here"
            )


#: the environment variable behind each recorded knob that is not one itself
_KNOB_VARIABLE = {"default_fp_fusion": "TRITON_DEFAULT_FP_FUSION"}


def _check_knobs(pack: str, built: Mapping[str, str]) -> None:
    """A pack serves only a process whose Triton knobs match its build's: each enters the cache key, so a
    mismatch would be a pack of misses (a pack of an older warmreg recorded none: not checked)."""
    if not built:
        return
    here = _triton_cache.cache_knobs()
    for name in sorted(set(built) | set(here)):
        if built.get(name) != here.get(name):
            variable = _KNOB_VARIABLE.get(name, name)
            was, now = (f"{name}={v}" if v is not None else f"{variable} unset" for v in (built.get(name), here.get(name)))
            raise PackError(
                pack, f"was built with {was}, this process has {now} (part of Triton's cache key: every entry would miss)",
                fix=f"set {variable} as the build had it, or rebuild the pack in this environment",
            )


def _open(path: str | Path) -> Reader:
    return Reader(Path(path))


@attrs.frozen
class _Checked:
    """A pack read whole and checked as far as it can be without the plugins: what verify and
    install both start from."""

    name: str
    manifest: Manifest
    platform: Platform
    entries: list[tuple[PackEntry, dict[str, bytes] | PackError]]  # each entry's files, or why it is refused
    launchers: list[tuple[PackLauncher, bytes]]


def _read_checked(path: str | Path, target: str | Platform | None) -> _Checked:
    reader = _open(path)
    try:
        manifest = reader.manifest()
        platform = resolve_platform(target) if target is not None else Platform.parse(manifest.target)
        _check_machine(reader, manifest, platform)
        entries = check_entries(reader, manifest)
        launchers = check_launchers(reader, manifest)  # every launcher verified, whether it fits here or not
    finally:
        reader.close()
    return _Checked(reader.name, manifest, platform, entries, launchers)


def verify(path: str | Path, *, target: str | Platform | None = None, jits: Mapping[str, Any] | None = None) -> Manifest:
    """Check a pack completely, exactly as install does before it writes: manifest digest and fields,
    member names and types, every file's size and sha256, each entry's metadata, Triton/ptxas/target,
    and each entry's Triton function (among ``jits``, as for :func:`install`; never imported), its
    source hash and its specialization.

    :returns: the manifest.
    :raises PackError: on the first problem, saying which and why.
    """
    read = _read_checked(path, target)
    known = _installed_jits(read.manifest) if jits is None else jits
    for entry, blobs in read.entries:
        if isinstance(blobs, PackError):
            raise blobs
        local_hash(entry, known, read.platform, read.name)
    return read.manifest


def inspect_pack(path: str | Path) -> Manifest:
    """Read a pack's manifest (digest and fields checked; files not verified)."""
    reader = _open(path)
    try:
        return reader.manifest()
    finally:
        reader.close()


def plugin_packages() -> frozenset[str]:
    """The top-level packages whose kernels installed plugins can register: ``warmreg`` (its shared
    ops) and the package of each entry point in the ``warmreg`` group, read from the distributions'
    metadata without importing them."""
    eps = installed_entry_points(PROJECT)
    return frozenset({"warmreg", *(ep.module.split(".")[0] for ep in eps)})


def _installed_jits(manifest: Manifest) -> Mapping[str, Any]:
    """The jit functions of the kernels defined in this process once the installed plugins are loaded,
    by full name; without loading the plugins (nor torch) when no entry names a function of a package
    that a plugin provides or this process has imported (every entry is then refused, as it would be
    after loading them)."""
    packages = plugin_packages() | {name.split(".", 1)[0] for name in list(sys.modules)}
    if manifest.engine is None and not any(e.jit_name.split(".", 1)[0] in packages for e in manifest.entries):
        return {}
    return loaded_jits(names=frozenset(e.jit_name for e in manifest.entries), engine=manifest.engine)


# -- installing ---------------------------------------------------------------------------------


def install(
    path: str | Path, *, target: str | Platform | None = None, all_or_nothing: bool = False, jits: Mapping[str, Any] | None = None
) -> InstallReport:
    """Install a pack into Triton's cache directory (``TRITON_CACHE_DIR``), under local cache keys.

    Everything :func:`verify` checks is checked before the first write. A pack never causes an
    import: each entry's Triton function is looked up among ``jits``.

    :param target: the platform this machine warms for (default: the pack's target).
    :param all_or_nothing: refuse the whole pack if any entry is refused.
    :param jits: the Triton functions entries may be installed for, by full name (default: those of
        every kernel class defined in this process once the installed plugins are loaded,
        :func:`loaded_jits`); entries for any other function are refused.
    :raises PackError: for a pack that does not fit this machine at all, or under ``all_or_nothing``.
    :raises CacheError: if the cache directory cannot be written (nothing unverified is left in it).
    """
    start = time.perf_counter()
    return _install_read(_read_checked(path, target), start, all_or_nothing=all_or_nothing, jits=jits)


def _jits_for(read: _Checked) -> Mapping[str, Any]:
    """The functions an install of ``read`` may install for (:func:`_installed_jits`), after checking the cache."""
    _triton_cache.check_cache_writable()  # before the plugins load: an unusable cache is one quick line
    return _installed_jits(read.manifest)


def _install_read(read: _Checked, start: float, *, all_or_nothing: bool, jits: Mapping[str, Any] | None) -> InstallReport:
    launcher_blobs = [(x, data) for x, data in read.launchers if _triton_launchers.fits_here(x.platform_key, x.file.name)]
    jits = _jits_for(read) if jits is None else jits
    installed, present, refused = install_entries(read.entries, read.platform, pack=read.name, jits=jits, all_or_nothing=all_or_nothing)
    try:
        launchers = sum(_triton_launchers.install(x.cache_key, x.file.name, data) for x, data in launcher_blobs)
        choices = tuning.keep(read.manifest.tuning)
    except OSError as exc:
        raise CacheError(_triton_cache.cache_dir(), f"cannot take the pack's C launchers or choices ({exc.strerror or exc})") from exc
    names = {what for what, _ in refused}
    usable = frozenset(label for e, _ in read.entries if (label := entry_label(e.kernel, e.key)) not in names)
    return InstallReport(
        read.name, installed, present, tuple(refused), time.perf_counter() - start, launchers, choices,
        model_type=read.manifest.model_type, usable=usable,
    )  # fmt: skip


class PackInstall(Stage):
    """The warm stage that installs packs into Triton's cache: after every key is bound (its launch
    code ran while Triton's installation was still being hashed), before any cache lookup, on every
    branch of a warm (local or distributed). A pack :func:`prefetch_install` installed into this
    cache for this target is waited for, not installed again.

    The pack the warm was asked for must fit: one refused as a whole raises :class:`PackError`.
    An installed pack wheel never fails a warm: one that cannot be used is skipped, with a logged
    warning naming it and the reason; both are in the section (:mod:`warmreg.stages.pack_report`).
    """

    name = "pack"

    def __init__(
        self, pack: str | os.PathLike[str] | None = None, wheels: Iterable[tuple[str, Path]] = (), skipped: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.pack = os.fspath(pack) if pack is not None else None
        self.wheels = list(wheels)
        self.skipped = list(skipped)
        self.reports: list[tuple[str | None, InstallReport]] = []  # (wheel, or None for the pack asked for)
        self._section: dict[str, Any] | None = None

    @classmethod
    def for_plan(cls, plan: Any, pack: str | os.PathLike[str] | None = None) -> PackInstall | None:
        """The stage for a warm of ``plan``: the installed pack wheels that fit it
        (:func:`installed_for`), then ``pack``; ``None`` when there is none of either."""
        wheels, skipped = installed_for(plan.platform, plan.config.model_type)
        return cls(pack, wheels, skipped) if pack is not None or wheels or skipped else None

    def before_compile(self, plan: Any, tasks: Any) -> None:
        for wheel, path in self.wheels:
            try:
                self.reports.append((wheel, install(path, target=plan.platform, jits=plan.jits())))
            except PackError as exc:  # a bad installed wheel is skipped, whatever is wrong with it
                self.skipped.append(skip(wheel, str(exc).removeprefix(f"pack {path}: ")))
        if self.pack is not None:
            report = _prefetched_install(self.pack, plan.platform)
            self.reports.append((None, report or install(self.pack, target=plan.platform, jits=plan.jits())))
        self._section = pack_section(self.reports, self.skipped, keys=plan_labels(plan), model_type=plan.config.model_type)

    def section(self) -> dict[str, Any] | None:
        """What each pack did and which installed pack wheels were skipped
        (:func:`~warmreg.stages.pack_report.pack_section`), with one line for them all (``summary``)."""
        return self._section


#: Packs :func:`warmreg.prefetch` installs in the background, by (real path, cache directory): the
#: outcome and the target it was installed for.
_PREFETCHED: dict[tuple[str, str], Future[tuple[InstallReport, str]]] = {}
_prefetch_lock = threading.Lock()


def prefetch_install(path: str | os.PathLike[str], after: threading.Event | None = None) -> None:
    """Install the pack at ``path`` into the current cache directory on a background thread, for its
    own target and the kernels of the installed plugins (once ``after`` is set: they are imported),
    so that a warm with that pack finds it installed (see :func:`warmreg.prefetch`). Errors
    are not raised here: the warm then installs the pack itself and reports them."""
    key = (os.path.realpath(path), _triton_cache.cache_dir())
    with _prefetch_lock:
        if key in _PREFETCHED:
            return
        future: Future[tuple[InstallReport, str]] = Future()
        _PREFETCHED[key] = future

    def run() -> None:
        try:
            if after is not None:
                after.wait()
            start = time.perf_counter()
            _check_cache_is(key[1])
            read = _read_checked(os.fspath(path), None)
            jits = _jits_for(read)
            report = attrs.evolve(_install_read(read, start, all_or_nothing=False, jits=jits), prefetched=True)
            _check_cache_is(key[1])  # the install wrote where the warm will look
            try:  # the binders Triton makes at each function's first launch on a device, made here for the pack's target
                _triton.prepare_binders({jits[e.jit_name] for e in read.manifest.entries if e.jit_name in jits}, _triton.gpu_target(read.platform))
            except Exception as exc:  # only a head start: binding makes what is missing, as Triton does
                log.debug("prefetch made no binders for %s: %r", path, exc)
            future.set_result((report, read.platform.target))
        except BaseException as exc:  # the warm installs the pack again and reports this
            log.debug("prefetch could not install %s: %r", path, exc)
            future.set_exception(exc)

    # not a daemon: an interpreter exiting waits for the entries being published (~0.1 s) rather
    # than leave temporary files in the cache
    threading.Thread(target=run, name="warmreg-pack-prefetch").start()


def prefetched() -> list[Future[tuple[InstallReport, str]]]:
    """The installs :func:`prefetch_install` started that no warm has taken yet (to wait for them)."""
    with _prefetch_lock:
        return list(_PREFETCHED.values())


def _check_cache_is(directory: str) -> None:
    if _triton_cache.cache_dir() != directory:
        raise CacheError(directory, f"is no longer Triton's cache directory ({_triton_cache.cache_dir()} is)", fix="prefetch again")


def _prefetched_install(path: str | os.PathLike[str], platform: Platform) -> InstallReport | None:
    """The report of :func:`prefetch_install` of ``path`` into the current cache, once every prefetch
    of that pack is done (none writes while the warm installs), if it installed the whole pack for
    ``platform``'s target; else ``None``: the warm installs it, for the plan's kernels, reporting
    what is wrong."""
    real = os.path.realpath(path)
    with _prefetch_lock:
        mine = {k: _PREFETCHED.pop(k) for k in [k for k in _PREFETCHED if k[0] == real]}
    for pending in mine.values():
        pending.exception()  # waits
    future = mine.get((real, _triton_cache.cache_dir()))
    if future is None or future.exception() is not None:
        return None
    report, target = future.result()
    return report if target == platform.target and not report.refused else None


def entry_keys(manifest: Manifest) -> list[CompileKey | None]:
    """The compile keys of a manifest's entries (``None`` where the key type is not importable)."""
    keys: list[CompileKey | None] = []
    for e in manifest.entries:
        try:
            keys.append(CompileKey.from_json(e.key))
        except WarmregError:
            keys.append(None)
    return keys


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


def loaded_jits(
    plugins: Iterable[Any] = (), *, entry_points: bool = True, names: frozenset[str] = frozenset(), engine: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``@triton.jit`` functions of every kernel class defined in this process, by Triton's full
    name, once the installed plugins (and ``plugins``) are loaded: what a pack may supply binaries
    for. Nothing is imported on behalf of a pack by the core; a plugin that fails to load is skipped.

    :param names: the functions a pack names; those no kernel class defines are asked of the plugins'
        ``warmreg_pack_functions`` (an engine's own kernels), with the pack's ``engine`` section. A plugin
        whose hook raises is skipped with a logged warning (its entries are then refused).
    """
    from ..contract.kernel import TritonKernel  # torch with it: not for a pack refused before the plugins load
    from ..pipeline.plugins import load_plugins

    loaded = load_plugins(plugins, entry_points=entry_points, on_plugin_error="skip")
    found: dict[str, Any] = {}
    todo: list[type[Any]] = [TritonKernel]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        jit = cls.__dict__.get("jit")
        if _triton.is_jit(jit):
            found[_triton.full_name(jit)] = jit
    if missing := names - set(found):
        found.update(_engine_functions(loaded.manager, frozenset(missing), engine))
    return found


def _engine_functions(manager: Any, names: frozenset[str], engine: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the plugins' ``warmreg_pack_functions`` supply among ``names``: jit functions under their own full
    name only (a plugin cannot answer for another function)."""
    found: dict[str, Any] = {}
    for impl in manager.hook.warmreg_pack_functions.get_hookimpls():
        kwargs = {"names": names, "engine": engine}
        try:
            answer = impl.function(**{a: kwargs[a] for a in impl.argnames}) or {}
        except Exception as exc:  # a plugin's failure refuses only the entries it would have answered for
            log.warning("warmreg plugin %s: warmreg_pack_functions raised %r; its functions are not installed", impl.plugin_name, exc)
            continue
        for name, jit in dict(answer).items():
            if name in names and _triton.is_jit(jit) and _triton.full_name(jit) == name:
                found.setdefault(name, jit)
    return found
