"""The pack format: manifest, entries, files and prebuilt launchers as attrs values, and a reader that
yields only safe member names from a directory or an archive (see :mod:`warmreg.pack`)."""

from __future__ import annotations

import hashlib
import json
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from .errors import WarmregError

__all__ = ["FORMAT", "Manifest", "PackEntry", "PackError", "PackFile", "PackLauncher"]

FORMAT = 2  # 2: optional prebuilt C launchers (format 1 packs still install)
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")
_MAX_MEMBER = 256 * 1024 * 1024


class PackError(WarmregError):
    """A pack is malformed, corrupt, or does not fit this machine; nothing was written to the cache."""

    def __init__(self, pack: str, problem: str, *, fix: str | None = None) -> None:
        self.pack = pack
        super().__init__(f"pack {pack}: {problem}", fix=fix)


def _files(items: Any) -> tuple[PackFile, ...]:
    return tuple(items)


def _launchers(items: Any) -> tuple[PackLauncher, ...]:
    return tuple(items)


def _entries(items: Any) -> tuple[PackEntry, ...]:
    return tuple(items)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@attrs.frozen
class PackFile:
    """One binary or metadata file of an entry."""

    name: str
    size: int
    sha256: str


@attrs.frozen(kw_only=True)
class PackEntry:
    """One compiled key: what it is, where it came from, and its files."""

    kernel: str
    key: dict[str, Any] = attrs.field(eq=False)
    jit_name: str
    source_hash: str
    specialization_data: str
    binary_hash: str
    files: tuple[PackFile, ...] = attrs.field(converter=_files)

    def member(self, file: PackFile) -> str:
        return f"files/{self.binary_hash}/{file.name}"


@attrs.frozen(kw_only=True)
class PackLauncher:
    """A C launcher Triton would otherwise build on the serving host, for one Python ABI."""

    cache_key: str  # Triton's: sha256(launcher source + platform key)
    platform_key: str
    python: str
    file: PackFile

    def member(self) -> str:
        return f"launchers/{self.cache_key}/{self.file.name}"


@attrs.frozen(kw_only=True)
class Manifest:
    """The manifest of a pack."""

    format: int
    warmreg_version: str
    triton_version: str
    ptxas_version: str | None
    target: str
    python: str
    created: float
    model_type: str
    entries: tuple[PackEntry, ...] = attrs.field(converter=_entries)
    complete: bool = True
    launchers: tuple[PackLauncher, ...] = attrs.field(default=(), converter=_launchers)

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self)
        body["entries"] = [attrs.asdict(e) for e in self.entries]
        body["launchers"] = [attrs.asdict(x) for x in self.launchers]
        return {"body": body, "sha256": _sha256(_canonical(body))}

    @classmethod
    def from_json(cls, data: Any, pack: str) -> Manifest:
        if not isinstance(data, dict) or "body" not in data or "sha256" not in data:
            raise PackError(pack, "manifest.json is not a warmreg manifest", fix="rebuild the pack with warmreg build")
        body = data["body"]
        if _sha256(_canonical(body)) != data["sha256"]:
            raise PackError(pack, "manifest.json was edited (its digest does not match)", fix="rebuild the pack")
        if not isinstance(body.get("format"), int) or body["format"] > FORMAT:
            raise PackError(
                pack, f"was written by a newer warmreg (format {body.get('format')}, this warmreg reads {FORMAT})", fix="upgrade warmreg"
            )
        if body.get("complete") is not True:
            raise PackError(pack, "is incomplete (no completion marker)", fix="rebuild the pack")
        try:
            entries = [
                PackEntry(**{**e, "files": [PackFile(**f) for f in e["files"]]}) for e in body["entries"]
            ]
            launchers = [PackLauncher(**{**x, "file": PackFile(**x["file"])}) for x in body.get("launchers", [])]
            return cls(**{**body, "entries": entries, "launchers": launchers})
        except (TypeError, KeyError) as exc:
            raise PackError(pack, f"manifest.json has a malformed entry ({exc})", fix="rebuild the pack") from exc


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# -- reading ------------------------------------------------------------------------------------


class _Reader:
    """Read-only access to a pack's members, from a directory or an archive, with safe names only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self._members: dict[str, bytes] = {}
        self._dir: Path | None = None
        if not path.exists():
            raise PackError(self.name, "does not exist", fix="pass the path written by warmreg build")
        if path.is_dir():
            self._dir = path
            return
        try:
            if path.suffix == ".zip":
                self._read_zip()
            else:
                self._read_tar()
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
            raise PackError(self.name, f"is not a readable archive ({exc})", fix="download or rebuild it; it may be truncated") from exc

    def _safe(self, name: str) -> str:
        pure = PurePosixPath(name)
        if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name:
            raise PackError(self.name, f"member {name!r} has an unsafe path", fix="do not use this pack; it may be malicious")
        return str(pure)

    def _check_name(self, name: str) -> str:
        safe = self._safe(name)
        if safe in self._members:
            raise PackError(self.name, f"member {name!r} appears twice", fix="rebuild the pack")
        return safe

    def _read_tar(self) -> None:
        with tarfile.open(self.path, "r:*") as tar:
            for member in tar.getmembers():
                if member.isdir():
                    continue
                name = self._check_name(member.name)
                if not member.isfile():
                    raise PackError(self.name, f"member {name!r} is a link or special file", fix="do not use this pack")
                if member.size > _MAX_MEMBER:
                    raise PackError(self.name, f"member {name!r} is too large ({member.size} bytes)")
                handle = tar.extractfile(member)
                self._members[name] = handle.read() if handle else b""

    def _read_zip(self) -> None:
        with zipfile.ZipFile(self.path) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                name = self._check_name(info.filename)
                if info.file_size > _MAX_MEMBER:
                    raise PackError(self.name, f"member {name!r} is too large")
                self._members[name] = zf.read(info)

    def read(self, name: str) -> bytes | None:
        name = self._safe(name)
        if self._dir is None:
            return self._members.get(name)
        target = (self._dir / name).resolve()
        if not target.is_relative_to(self._dir.resolve()) or target.is_symlink() or not target.is_file():
            return None
        return target.read_bytes()

    def manifest(self) -> Manifest:
        raw = self.read("manifest.json")
        if raw is None:
            raise PackError(self.name, "has no manifest.json", fix="rebuild the pack with warmreg build")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PackError(self.name, f"manifest.json is not JSON ({exc})", fix="rebuild the pack") from exc
        manifest = Manifest.from_json(data, self.name)
        seen: set[str] = set()
        for entry in manifest.entries:
            for f in entry.files:
                member = entry.member(f)
                if member in seen:
                    raise PackError(self.name, f"lists {member} twice (duplicate entries)", fix="rebuild the pack")
                seen.add(member)
                self._safe(member)
        for launcher in manifest.launchers:
            member = launcher.member()
            if member in seen:
                raise PackError(self.name, f"lists {member} twice (duplicate launchers)", fix="rebuild the pack")
            seen.add(member)
            self._safe(member)
        return manifest


def _check_file(reader: _Reader, entry: PackEntry | PackLauncher, f: PackFile) -> bytes:
    member = entry.member(f) if isinstance(entry, PackEntry) else entry.member()
    data = reader.read(member)
    if data is None:
        raise PackError(reader.name, f"lists {member}, which is missing", fix="rebuild the pack")
    if len(data) != f.size:
        raise PackError(reader.name, f"{member} has {len(data)} bytes, the manifest says {f.size}", fix="rebuild the pack")
    if _sha256(data) != f.sha256:
        raise PackError(reader.name, f"{member} does not match its sha256 (corrupt)", fix="rebuild the pack")
    return data
