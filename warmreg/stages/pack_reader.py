"""The one reader of packs, for every format (directory, ``.tar``, ``.tar.gz``, ``.zip``), used by
``verify`` and ``install`` alike, and the checks both run on what it reads.

Only regular files and directories are opened (never a FIFO, device or socket, which could block or
never end), links are refused, every member name obeys the path rule, and only the members the
manifest lists are read, each within the limits of :data:`~warmreg.stages.pack_format.LIMITS`. Archive
members are indexed in one pass and read in the order they are stored.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

from ..support import bounded_json as _json
from .pack_format import (
    LIMITS,
    Manifest,
    PackEntry,
    PackError,
    PackFile,
    PackLauncher,
    _one_line,
    _sha256,
    check_name,
    parse_manifest,
)

__all__ = ["IN_MEMORY", "Reader", "check_entries", "check_entry", "check_launchers", "lock"]

#: A ``.tar.gz`` pack whose tar is at most this many bytes (the Flash example's: 2 MB) is
#: decompressed once into memory; a larger one is read as a stream, so memory stays bounded either way.
IN_MEMORY = 16 * 1024 * 1024

_BROKEN = (tarfile.TarError, zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError, RuntimeError)
_NO_LINKS = "do not use this pack; links and special files are never installed"


def lock(directory: Path, *, shared: bool) -> int | None:
    """Take ``flock`` on ``directory`` (no lock file is made): shared while a directory pack in it is
    read, exclusive while a build publishes one there (:func:`warmreg.stages.build.build`), so a
    reader sees a pack before or after a publish, whole. Returns the descriptor to close to
    release it, or ``None`` where the directory cannot be opened or locked (then nothing waits)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


class Reader:
    """Read-only, bounded access to a pack's members. A directory pack is read under one open
    directory and a shared :func:`lock` of its parent, until :meth:`close`.

    :raises PackError: if the path is missing, not a regular file or directory, not a readable
        archive, or holds a member that is a link, a special file, over a limit or unsafely named.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self._dir: Path | None = None
        self._tar: tarfile.TarFile | None = None
        self._zip: zipfile.ZipFile | None = None
        self._index: dict[str, Any] = {}
        self._dir_fd: int | None = None
        self._lock: int | None = None
        try:
            info = os.stat(path)  # the pack's own path may be a link the user made; its members may not
        except FileNotFoundError:
            raise PackError(self.name, "does not exist", fix="pass the path written by warmreg build") from None
        except OSError as exc:
            raise PackError(self.name, f"cannot be read ({exc.strerror})", fix="check the path and its permissions") from None
        if stat.S_ISDIR(info.st_mode):
            self._dir = path
            self._lock = lock(path.parent, shared=True)  # a build publishes here after this reader is done
            try:  # every member is opened under this one directory
                self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as exc:
                self.close()
                raise PackError(self.name, f"cannot be read ({exc.strerror})", fix="check the path and its permissions") from None
            return
        if not stat.S_ISREG(info.st_mode):
            raise PackError(self.name, "is not a regular file or a directory (a FIFO, device or socket)", fix="pass a pack file or directory")
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic.startswith(b"PK"):
                self._kind = "zip archive"
                self._index_zip()
            else:
                self._kind = "tar.gz archive" if magic.startswith(b"\x1f\x8b") else "tar archive"
                self._index_tar(gz=magic.startswith(b"\x1f\x8b"))
        except PackError:
            self.close()
            raise
        except _BROKEN as exc:
            self.close()
            raise PackError(self.name, f"is not a readable {self._kind} ({_one_line(exc)})", fix="download or rebuild it; it may be truncated") from None

    def close(self) -> None:
        for handle in (self._tar, self._zip):
            if handle is not None:
                handle.close()
        self._tar = self._zip = None
        for fd in (self._dir_fd, self._lock):
            if fd is not None:
                os.close(fd)  # closing the lock's descriptor releases it
        self._dir_fd = self._lock = None

    # -- indexing -------------------------------------------------------------------------------
    def _member_name(self, name: str, *, directory: bool = False) -> str:
        parts = name.removesuffix("/").split("/") if directory else name.split("/")
        for part in parts:
            if not part or part in (".", "..") or "\\" in part:
                raise PackError(self.name, f"member {name[:120]!r} has an unsafe path", fix="do not use this pack; it may be malicious")
            check_name(part, f"member {name[:120]!r}: component", self.name)
        if len(parts) > 3:
            raise PackError(self.name, f"member {name[:120]!r} has an unsafe path (too deep)", fix="do not use this pack; it may be malicious")
        return name

    def _add(self, name: str, info: Any) -> None:
        if len(self._index) >= LIMITS.members:
            raise PackError(self.name, f"has more than {LIMITS.members} members", fix="split the pack")
        if name in self._index:
            raise PackError(self.name, f"member {name!r} appears twice", fix="rebuild the pack")
        self._index[name] = info

    def _index_tar(self, *, gz: bool) -> None:
        unpacked = self._gunzip() if gz else None
        if unpacked is not None:  # seeks in memory: the index, manifest, entries and launchers in one decompression
            self._tar = tar = tarfile.open(fileobj=unpacked, mode="r:")
        else:  # seeking back in a gzip stream decompresses it again from its start
            self._tar = tar = tarfile.open(self.path, "r:gz" if gz else "r:")
        while (member := tar.next()) is not None:
            if member.isdir():
                self._member_name(member.name, directory=True)
                continue
            name = self._member_name(member.name)
            if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise PackError(self.name, f"member {name!r} is a link or special file", fix=_NO_LINKS)
            if member.size > LIMITS.member:
                raise PackError(self.name, f"member {name!r} is too large ({member.size} bytes)", fix="do not use this pack")
            self._add(name, member)
        # tarfile reads a damaged header after the first as the end of the archive: what follows
        # the last member must be the end-of-archive zeros (reading it also checks gzip's CRC)
        stream = tar.fileobj
        tail = b""
        if stream is not None:  # always set by tarfile.open
            stream.seek(tar.offset)
            tail = stream.read(1 << 20)
            tail += stream.read(1 << 16) if len(tail) == 1 << 20 else b""
        if len(tail) < tarfile.BLOCKSIZE or tail.strip(b"\0"):  # no end-of-archive block: cut or damaged
            raise PackError(self.name, f"is not a readable {self._kind} (damaged after byte {tar.offset})", fix="download or rebuild it; it may be truncated")

    def _gunzip(self) -> io.BytesIO | None:
        """The whole tar of a ``.tar.gz`` pack of at most :data:`IN_MEMORY` bytes, decompressed once
        (gzip's CRC and length checked), or ``None`` for a larger one (then read as a stream)."""
        inflate = zlib.decompressobj(wbits=31)  # one gzip member; anything after it takes the stream path
        out = io.BytesIO()
        with open(self.path, "rb") as f:
            data = f.read(1 << 20)
            while data:
                out.write(inflate.decompress(data, 1 << 20))  # at most 1 MiB at a time: memory stays bounded
                if out.tell() > IN_MEMORY:
                    return None
                if inflate.eof:
                    if inflate.unused_data or f.read(1):
                        return None
                    break
                data = inflate.unconsumed_tail or f.read(1 << 20)
        if not inflate.eof:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")
        out.seek(0)
        return out

    def _index_zip(self) -> None:
        self._zip = zf = zipfile.ZipFile(self.path)
        for info in zf.infolist():
            if info.is_dir():
                self._member_name(info.filename, directory=True)
                continue
            name = self._member_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG) or info.flag_bits & 0x1:  # 0: no type recorded
                raise PackError(self.name, f"member {name!r} is a link, special or encrypted file", fix=_NO_LINKS)
            if info.file_size > LIMITS.member:
                raise PackError(self.name, f"member {name!r} is too large ({info.file_size} bytes)", fix="do not use this pack")
            self._add(name, info)

    # -- reading --------------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        """The validated manifest (see :func:`~warmreg.stages.pack_format.parse_manifest`)."""
        raw = self.read({"manifest.json": None}, limit=LIMITS.manifest)["manifest.json"]
        if isinstance(raw, str):
            raise PackError(self.name, f"manifest.json {raw}" if raw != "is missing" else "has no manifest.json", fix="rebuild the pack with warmreg build")
        return parse_manifest(raw, self.name)

    def read(self, wanted: dict[str, int | None], *, limit: int = LIMITS.member) -> dict[str, bytes | str]:
        """Read the named members (each with its expected size, or ``None``): bytes, or a problem.

        :raises PackError: for a member that is a link or special file (directory packs).
        """
        if self._dir is not None:
            return {name: self._read_file(name, size, limit) for name, size in wanted.items()}
        out: dict[str, bytes | str] = {n: "is missing" for n in wanted if n not in self._index}
        present = [n for n in wanted if n in self._index]
        offset = (lambda n: self._index[n].offset_data) if self._tar is not None else (lambda n: self._index[n].header_offset)
        try:
            for name in sorted(present, key=offset):  # storage order: one forward pass through a stream
                out[name] = self._read_member(name, wanted[name], limit)
        except _BROKEN as exc:
            raise PackError(self.name, f"is not a readable {self._kind} ({_one_line(exc)})", fix="download or rebuild it; it may be truncated") from None
        return out

    def _read_member(self, name: str, size: int | None, limit: int) -> bytes | str:
        info = self._index[name]
        stored = info.size if self._tar is not None else info.file_size
        if size is not None and stored != size:
            return f"has {stored} bytes, the manifest says {size}"
        if stored > limit:
            return f"has {stored} bytes, more than the {limit} warmreg reads"
        if self._tar is not None:
            handle = self._tar.extractfile(info)
            data = handle.read(stored) if handle is not None else b""
        elif self._zip is not None:
            with self._zip.open(info) as f:
                data = f.read(stored + 1)  # reading to the end checks the CRC
        else:  # pragma: no cover - archives only
            return "is missing"
        return data if len(data) == stored else f"has {len(data)} bytes, the archive says {stored}"

    def _read_file(self, name: str, size: int | None, limit: int) -> bytes | str:
        """One file of a directory pack, opened component by component without following links."""
        parts = self._member_name(name).split("/")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        fds: list[int] = []  # those opened here (not the pack's own directory)
        try:
            parent = self._dir_fd
            if parent is None:
                raise PackError(self.name, "was closed before it was read", fix="report this as a warmreg bug")
            for part in parts[:-1]:
                fds.append(os.open(part, flags | os.O_DIRECTORY, dir_fd=parent))
                parent = fds[-1]
            fd = os.open(parts[-1], flags, dir_fd=parent)
            fds.append(fd)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PackError(self.name, f"member {name!r} is not a regular file", fix=_NO_LINKS)
            if size is not None and info.st_size != size:
                return f"has {info.st_size} bytes, the manifest says {size}"
            if info.st_size > limit:
                return f"has {info.st_size} bytes, more than the {limit} warmreg reads"
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(info.st_size + 1)
            return data if len(data) == info.st_size else f"changed size while it was read ({len(data)} bytes)"
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return "is missing"
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise PackError(self.name, f"member {name!r} is a link or sits under one", fix=_NO_LINKS) from None
            raise PackError(self.name, f"member {name!r} cannot be read ({exc.strerror})", fix="check the pack's permissions") from None
        finally:
            for fd in fds:
                os.close(fd)


# -- checks (verify and install run the same ones) ----------------------------------------------


def _files_of(reader: Reader, members: dict[str, PackFile]) -> dict[str, bytes | str]:
    got = reader.read({m: f.size for m, f in members.items()})
    for member, f in members.items():
        data = got[member]
        if isinstance(data, bytes) and _sha256(data) != f.sha256:
            got[member] = "does not match its sha256 (corrupt)"
    return got


def check_entry(reader: Reader, entry: PackEntry, got: dict[str, bytes | str]) -> dict[str, bytes] | PackError:
    """An entry's verified files by name, or why it is refused (a missing, resized or corrupt file,
    or Triton metadata that is not a JSON object)."""
    blobs: dict[str, bytes] = {}
    for f in entry.files:
        member = entry.member(f)
        data = got[member]
        if isinstance(data, str):
            return PackError(reader.name, f"{member} {data}", fix="rebuild the pack")
        blobs[f.name] = data
    meta = entry.metadata()
    try:
        parsed = _json.loads(blobs[meta.name], max_depth=16, max_values=100_000)
    except ValueError as exc:
        return PackError(reader.name, f"{entry.member(meta)} is not JSON warmreg reads ({_one_line(exc)})", fix="rebuild the pack")
    if not isinstance(parsed, dict):
        return PackError(reader.name, f"{entry.member(meta)} is not Triton metadata (a JSON object)", fix="rebuild the pack")
    return blobs


def check_entries(reader: Reader, manifest: Manifest) -> list[tuple[PackEntry, dict[str, bytes] | PackError]]:
    """Every entry with its verified files, or the reason it is refused (in manifest order)."""
    got = _files_of(reader, {e.member(f): f for e in manifest.entries for f in e.files})
    return [(e, check_entry(reader, e, got)) for e in manifest.entries]


def check_launchers(reader: Reader, manifest: Manifest) -> list[tuple[PackLauncher, bytes]]:
    """Every launcher with its verified bytes.

    :raises PackError: for a missing, resized or corrupt launcher.
    """
    got = _files_of(reader, {x.member(): x.file for x in manifest.launchers})
    out = []
    for x in manifest.launchers:
        data = got[x.member()]
        if isinstance(data, str):
            raise PackError(reader.name, f"{x.member()} {data}", fix="rebuild the pack")
        out.append((x, data))
    return out
