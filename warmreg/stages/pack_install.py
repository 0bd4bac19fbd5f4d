"""Writing verified pack entries into Triton's cache (see :mod:`warmreg.stages.pack`): each under the hash
the local Triton computes, as uniquely named files, then published by atomically replacing the
entry's group file. Shared by pack install and the distributed warm.

Every name is checked by the path rule (:func:`~warmreg.stages.pack_format.check_name`) before it is
joined; a Triton function is looked up in a given map, never imported.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import _triton
from .._triton import cache as _triton_cache
from .._triton.hits import remember_found_group, remember_group
from ..support import bounded_json as _json
from ..values.errors import CacheError, WarmregError
from ..values.platform import Platform
from .pack_format import PackEntry, PackError, _one_line, check_name

__all__ = ["atomic_write", "entry_label", "install_entries", "local_hash", "sweep_temporaries"]


def install_entries(
    items: Iterable[tuple[PackEntry, dict[str, bytes] | WarmregError]],
    platform: Platform,
    *,
    pack: str,
    jits: Mapping[str, Any],
    all_or_nothing: bool = False,
) -> tuple[int, int, tuple[tuple[str, str], ...]]:
    """Write verified entries into the local Triton cache under the keys the local Triton computes.

    Shared by pack install and the distributed warm (entries received from other ranks).

    :param items: each entry with its files' bytes (already checked against the manifest), or the
        error that refused it.
    :param jits: the Triton functions that may be installed for, by full name (never imported).
    :returns: ``(installed, already present, refused (entry, reason))``.
    :raises PackError: under ``all_or_nothing`` if any entry is refused; nothing is written then.
    :raises CacheError: if the cache directory cannot be written.
    """
    ready: list[tuple[PackEntry, dict[str, bytes], str]] = []
    refused: list[tuple[str, str]] = []
    for entry, blobs in items:
        try:
            if isinstance(blobs, WarmregError):
                raise blobs
            ready.append((entry, blobs, local_hash(entry, jits, platform, pack)))
        except WarmregError as exc:
            refused.append((entry_label(entry.kernel, entry.key), str(exc)))
    if refused and all_or_nothing:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise PackError(pack, f"{len(refused)} entries refused (all-or-nothing): {refused[0][1]}{more}", fix="rebuild the pack")
    if not ready:
        return 0, 0, tuple(refused)
    cache = _triton_cache.check_cache_writable()
    try:
        # entries are independent, and each file's fsync waits on the disk with the GIL released
        with ThreadPoolExecutor(max_workers=min(8, len(ready)), thread_name_prefix="warmreg-install") as pool:
            published = list(pool.map(lambda item: _publish(cache, *item), ready))
    except OSError as exc:
        raise CacheError(str(cache), f"cannot take the pack's entries ({exc.strerror or exc})") from exc
    installed = sum(published)
    return installed, len(published) - installed, tuple(refused)


def entry_label(kernel: str, key: Mapping[str, Any]) -> str:
    """How a refusal names an entry: its kernel and its serialized key's fields (``key`` as
    :meth:`~warmreg.CompileKey.to_json` gives it, so a plan's key and a pack's entry for it match)."""
    return f"{kernel} {key.get('fields')}"


def local_hash(entry: PackEntry, jits: Mapping[str, Any], platform: Platform, pack: str) -> str:
    """The cache hash the local Triton gives an entry (what install writes it under).

    :raises PackError: if its Triton function is not among ``jits``, changed since the build, or
        its specialization is not one this Triton reads.
    """
    jit = jits.get(entry.jit_name)
    if jit is None:
        raise PackError(
            pack,
            f"names the Triton function {entry.jit_name!r}, which no kernel of the loaded plugins defines",
            fix="install the plugin that defines it (warmreg plugins lists them); a pack never imports code",
        )
    if _triton.source_hash(jit) != entry.source_hash:
        raise PackError(pack, f"kernel {entry.jit_name} changed since the pack was built (source hash differs)", fix="rebuild the pack")
    try:
        return _triton_cache.local_cache_hash(jit, entry.specialization_data, platform)
    except WarmregError:
        raise
    except Exception as exc:  # data from the pack reaches Triton's option parsing: any error refuses the entry
        raise PackError(
            pack, f"the specialization of {entry.jit_name} is not one this Triton reads ({type(exc).__name__}: {_one_line(exc)})", fix="rebuild the pack"
        ) from None


def _publish(cache: Path, entry: PackEntry, blobs: dict[str, bytes], local_hash: str) -> bool:
    """Write one entry's files under unique names, then atomically publish its group file."""
    directory = cache / check_name(_triton_cache.cache_subdir(local_hash), "cache directory", "<local>")
    names = {name: check_name(name, "file", f"entry {entry.kernel}") for name in blobs}  # never joined raw
    meta_name = next((n for n in names if n.endswith(".json")), None)
    if meta_name is None:
        raise PackError(f"entry {entry.kernel}", "has no .json metadata file", fix="rebuild the pack")
    group = directory / f"__grp__{meta_name}"
    if directory.is_dir():
        sweep_temporaries(directory)
    if remember_found_group(str(cache), local_hash, meta_name):
        return False  # already installed (by us, another installer, or Triton itself); a damaged one is replaced below
    directory.mkdir(parents=True, exist_ok=True)
    writer = uuid.uuid4().hex[:12]
    children: dict[str, str] = {}
    try:
        for name, data in blobs.items():
            if name == meta_name:
                meta = _json.loads(data, max_depth=16, max_values=100_000)
                if not isinstance(meta, dict):
                    raise PackError(f"entry {entry.kernel}", f"{name} is not Triton metadata (a JSON object)", fix="rebuild the pack")
                meta["hash"] = local_hash  # the entry now lives under the local key
                data = json.dumps(meta).encode()
            stem, _, ext = name.rpartition(".")
            final = directory / f"{stem}.{writer}.{ext}"
            atomic_write(final, data)
            children[name] = str(final)
        atomic_write(group, json.dumps({"child_paths": children}).encode())
        remember_group(str(cache), local_hash, meta_name, children)
    except BaseException:
        for path in children.values():  # a failed entry leaves none of its files (a kill may leave some)
            Path(path).unlink(missing_ok=True)
        raise
    return True


#: Temporary files carry this host and the writing process, so a later install can tell those of a
#: process that died (removed) from those of one still writing (left alone).
_HOST = _triton_cache.HOST


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it (named for this host and process), synced,
    then renamed over it; a failure or an interrupt removes the temporary file."""
    tmp = path.with_name(f"{path.name}.tmp.{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or an interrupt leaves no temporary file behind
        raise


def sweep_temporaries(directory: Path) -> None:
    """Remove the temporary files :func:`atomic_write` calls on this host left in ``directory`` when their process
    died (SIGKILL); those of other hosts and of live processes stay."""
    for tmp in directory.glob(f"*.tmp.{_HOST}-*"):
        pid = tmp.name.rpartition(f".tmp.{_HOST}-")[2].partition(".")[0]
        if pid.isdigit() and not _triton_cache.alive(int(pid)):
            tmp.unlink(missing_ok=True)
