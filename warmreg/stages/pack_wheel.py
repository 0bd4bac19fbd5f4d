"""Packs as wheels: ``pip install`` of a prebuilt cache is all an engine image needs.

A pack wheel holds one directory pack under its own top-level package and registers it in the
``warmreg.packs`` entry-point group. :func:`warmreg.warm` looks the group up and installs every pack
built for its model type, target and Triton release before it compiles. An installed pack wheel is
data: it is found through its distribution's metadata and file list (``RECORD``), never through an
import, so nothing of it runs. Any other installed pack wheel is skipped with a logged reason
(:func:`installed_for`). The wheel itself is written here, file by file, as the wheel format (PEP
427) describes: the pack's files, ``METADATA``, ``WHEEL``, ``entry_points.txt`` and ``RECORD`` with
each file's sha256.

Its name comes from the pack: model type, target and a digest of its keys, so two deployments of
one model with other keys are two distributions and a rebuild of the same keys is the same one;
its version from the build (the warmreg release, then ``.post`` and the build's UTC time to the
millisecond), so ``pip install`` of a rebuilt wheel replaces the older build.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import triton

from ..support.entry_points import entry_points
from ..values.errors import WarmregError
from ..values.platform import Platform
from .pack_format import Manifest, PackError
from .pack_reader import Reader

__all__ = ["GROUP", "installed_for", "installed_packs", "keys_digest", "skip", "wheel_name", "wheel_version", "write_wheel"]

GROUP = "warmreg.packs"
log = logging.getLogger("warmreg.stages.pack")


def keys_digest(manifest: Manifest) -> str:
    """Eight hex digits of the sha256 of a pack's keys (each entry's kernel and key, in any order)."""
    keys = sorted(json.dumps([e.kernel, e.key], sort_keys=True) for e in manifest.entries)
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:8]


def wheel_name(manifest: Manifest) -> str:
    """``warmreg_pack_<model type>_<target>_<keys digest>`` (e.g. ``warmreg_pack_deepseek_v4_cuda90_1f0c2a9e``):
    the distribution and package name of a pack's wheel (:func:`keys_digest`)."""
    raw = f"warmreg_pack_{manifest.model_type}_{manifest.target.replace(':', '')}_{keys_digest(manifest)}"
    return re.sub(r"[^A-Za-z0-9]+", "_", raw).strip("_").lower()


def _release(version: str) -> str:
    """The release segment of a version (``0.1.0`` of ``0.1.0.dev3+g12ab``), normalized as PEP 440 does."""
    found = re.match(r"\d+(\.\d+)*", version)
    return ".".join(str(int(part)) for part in found.group().split(".")) if found else "0"


def wheel_version(manifest: Manifest) -> str:
    """The version of a pack's wheel, a valid PEP 440 version that grows with each build: the
    building warmreg's release, then ``.post<UTC build time, YYYYMMDDHHMMSSmmm>`` (e.g.
    ``0.1.0.post20250612093015123``)."""
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime(manifest.created)) + f"{int(manifest.created * 1000) % 1000:03d}"
    return f"{_release(manifest.warmreg_version)}.post{stamp}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(pack_dir: Path, manifest: Manifest, out_dir: Path) -> Path:
    """Write the wheel of the directory pack ``pack_dir`` into ``out_dir``; returns its path.

    Its name and version are :func:`wheel_name` and :func:`wheel_version`; the Triton release,
    target and model type are in its summary and, checked at install, in the pack's own manifest.
    """
    name, version = wheel_name(manifest), wheel_version(manifest)
    info = f"{name}-{version}.dist-info"
    files: dict[str, bytes] = {
        f"{name}/__init__.py": (
            f'"""A warmreg pack: {manifest.model_type} for {manifest.target}, Triton {manifest.triton_version} '
            '(data only; warmreg installs it, nothing imports it)."""\n'
        ).encode(),
    }
    for file in sorted(p for p in pack_dir.rglob("*") if p.is_file()):
        files[f"{name}/pack/{file.relative_to(pack_dir).as_posix()}"] = file.read_bytes()
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: warmreg pack: {len(manifest.entries)} compiled keys of {manifest.model_type} for "
        f"{manifest.target}, Triton {manifest.triton_version}\nRequires-Dist: warmreg>={_release(manifest.warmreg_version)}\n"
    ).encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: warmreg\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/entry_points.txt"] = f"[{GROUP}]\n{name} = {name}\n".encode()
    record = "".join(f"{member},{_record_hash(data)},{len(data)}\n" for member, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{version}-py3-none-any.whl"
    staged = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as whl:
        for member, data in files.items():
            whl.writestr(member, data)
    staged.replace(out)
    return out


def installed_packs() -> Iterator[tuple[str, Path | PackError]]:
    """``(wheel, pack directory)`` of every installed pack wheel (``wheel`` is ``name==version``), or
    ``(wheel, why it cannot be used)``. The pack is located through the distribution's file list:
    nothing of the wheel is imported, not even a parent package of the one its entry point names.
    """
    for ep in entry_points(GROUP):
        dist = getattr(ep, "dist", None)
        wheel = f"{dist.name}=={dist.version}" if dist is not None else ep.name
        try:
            yield wheel, _locate(ep, dist, wheel)
        except PackError as exc:
            yield wheel, exc


def _locate(ep: Any, dist: Any, wheel: str) -> Path:
    parts = ep.value.split(".")
    if not all(part.isidentifier() for part in parts):
        raise PackError(wheel, f"its entry point {ep.value[:120]!r} does not name a package", fix="rebuild it with warmreg build --wheel")
    manifest = "/".join([*parts, "pack", "manifest.json"])
    if dist is None or manifest not in {f.as_posix() for f in dist.files or ()}:
        raise PackError(wheel, f"its distribution does not list {manifest}", fix="reinstall it, or rebuild it with warmreg build --wheel")
    return Path(dist.locate_file(manifest)).parent


def installed_for(platform: Platform, model_type: str) -> tuple[list[tuple[str, Path]], list[tuple[str, str]]]:
    """The installed pack wheels built for ``model_type`` on ``platform`` with this Triton release,
    as ``(wheel, pack directory)``; and those of this model type (or whose manifest cannot be read)
    that are skipped, as ``(wheel, reason)``, each logged. Another model's packs are not this warm's.
    """
    found, skipped = [], []
    for wheel, path in installed_packs():
        try:
            if isinstance(path, PackError):
                raise path
            reader = Reader(path)
            try:
                m = reader.manifest()
            finally:
                reader.close()
        except WarmregError as exc:
            skipped.append(skip(wheel, str(exc).removeprefix(f"pack {wheel}: ").removeprefix(f"pack {path}: ")))
            continue
        if m.model_type != model_type:
            continue
        if m.target != platform.target:  # an image may carry packs for several GPUs: not a fault
            skipped.append(skip(wheel, f"built for {m.target}, this warm is for {platform.target}", level=logging.INFO))
        elif m.triton_version != triton.__version__:
            skipped.append(skip(wheel, f"built with Triton {m.triton_version}, this machine has {triton.__version__}"))
        else:
            found.append((wheel, path))
    return found, skipped


def skip(wheel: str, reason: str, *, level: int = logging.WARNING) -> tuple[str, str]:
    """Log that the installed pack wheel ``wheel`` is skipped and why; returns ``(wheel, reason)``."""
    log.log(level, "installed pack wheel %s skipped: %s", wheel, reason)
    return wheel, reason
