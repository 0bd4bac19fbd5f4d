"""Packs as wheels: ``pip install`` of a prebuilt cache is all an engine image needs.

A pack wheel holds one directory pack under its own top-level package and registers it in the
``warmreg.packs`` entry-point group. :func:`warmreg.warm` looks the group up (distribution metadata
and the package's location only: nothing of the wheel is imported) and installs every pack built for
its model type, target and Triton release before it compiles; any other is skipped with a logged
reason. The wheel itself is written here, file by file, as the wheel format (PEP 427) describes:
the pack's files, ``METADATA``, ``WHEEL``, ``entry_points.txt`` and ``RECORD`` with each file's
sha256.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import logging
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

from ..support.entry_points import entry_points
from .pack_format import Manifest

__all__ = ["GROUP", "installed_packs", "wheel_name", "write_wheel"]

GROUP = "warmreg.packs"
log = logging.getLogger("warmreg.stages.pack")


def wheel_name(label: str, manifest: Manifest) -> str:
    """``warmreg_pack_<label>_<target>`` (e.g. ``warmreg_pack_deepseek_v4_flash_cuda90``): the
    distribution and package name of a pack's wheel."""
    raw = f"warmreg_pack_{label}_{manifest.target.replace(':', '')}"
    return re.sub(r"[^A-Za-z0-9]+", "_", raw).strip("_").lower()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(pack_dir: Path, manifest: Manifest, out_dir: Path, label: str) -> Path:
    """Write the wheel of the directory pack ``pack_dir`` into ``out_dir``; returns its path.
    ``label`` names the deployment (e.g. the config file's stem) in the wheel's name.

    Its version is the warmreg version that built it; the Triton release, target and model type
    are in its summary and, checked at install, in the pack's own manifest.
    """
    name, version = wheel_name(label, manifest), manifest.warmreg_version
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
        f"{manifest.target}, Triton {manifest.triton_version}\nRequires-Dist: warmreg>={version}\n"
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


def installed_packs() -> Iterator[tuple[str, Path]]:
    """``(entry-point name, pack directory)`` of every installed pack wheel; never imports one."""
    for ep in entry_points(GROUP):
        try:
            spec = importlib.util.find_spec(ep.value)
        except (ImportError, ValueError) as exc:
            log.warning("installed pack %s skipped: %s", ep.name, exc)
            continue
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            log.warning("installed pack %s skipped: its package %s is not installed as a directory", ep.name, ep.value)
            continue
        yield ep.name, Path(locations[0]) / "pack"
