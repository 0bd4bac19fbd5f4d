"""Distributed warm: the ranks of a torch.distributed job split the keys, then share the binaries.

A stage of the warm pipeline (:class:`Shard`). Every rank plans and binds the same deduplicated key
list (each key's launch code runs once); rank ``r`` compiles keys ``r, r + world, ...`` into its
local Triton cache, then all ranks exchange what they compiled through torch.distributed
collectives (``all_gather`` of byte tensors: a JSON header plus the raw binaries, no pickle, no
shared filesystem) and install the other ranks' entries into their local cache through the pack
machinery (re-keyed for the local Triton); the pipeline then compiles the rest of the keys, every
one a cache hit (and, on a GPU, loads every module). On a local CUDA GPU the ranks also exchange the
C launchers their loads built (Triton builds one per distinct launcher source with the host's C
compiler), so a rank runs the compiler only for launchers of its own shard. A key that failed on its owner rank
is reported as failed on every rank, with the owner's error.

Fast path: each rank first checks its local cache; if every key is already there on every rank (one
small ``all_reduce``), nothing is exchanged and each rank warms locally.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from typing import Any

import attrs
import torch
import torch.distributed as dist

from .._triton import cache as _triton_cache
from .._triton import launchers as _triton_launchers
from ..pipeline.bind import Task
from ..pipeline.planning import Plan
from ..pipeline.report import KeyResult
from ..pipeline.stage import Stage
from ..values.errors import WarmregError
from ..values.key import CompileKey
from .pack import entry_from_result
from .pack_format import PackEntry, PackFile, _sha256
from .pack_install import install_entries

__all__ = ["Shard", "resolve_group"]


def resolve_group(group: Any, distributed: bool | None) -> Any:
    """The process group to shard over, or ``None`` for a single-process warm.

    :param group: an explicit ``torch.distributed`` group, or ``None`` for the default group.
    :param distributed: ``False`` turns sharding off; ``None`` (auto) shards when torch.distributed is
        initialized with more than one rank; ``True`` requires it.
    :raises WarmregError: for ``distributed=True`` without an initialized process group.
    """
    if distributed is False:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if distributed:
            raise WarmregError(
                "distributed=True but torch.distributed is not initialized",
                fix="call torch.distributed.init_process_group first, or start with torchrun",
            )
        return None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _device_for(group: Any) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _all_cached(plan: Plan, tasks: list[Task]) -> bool:
    """Whether every bound key is already in the local Triton cache (no compile needed)."""
    for task in tasks:
        if task.status == "failed" or task.captured is None or task.specialization_data is None:
            return False
        if not _triton_cache.in_disk_cache(task.captured[0], task.specialization_data, plan.platform):
            return False
    return True


def _encode(
    entries: list[tuple[PackEntry, dict[str, bytes]]], failures: list[KeyResult], launchers: Iterable[_triton_launchers.Launcher] = ()
) -> bytes:
    header: dict[str, Any] = {"entries": [], "failures": [[r.kernel, r.key.to_json(), r.error] for r in failures], "launchers": []}
    body = bytearray()
    for entry, blobs in entries:
        header["entries"].append(attrs.asdict(entry))
        for f in entry.files:
            body += blobs[f.name]
    for x in launchers:
        header["launchers"].append([x.cache_key, x.platform_key, x.python, x.name, len(x.data), _sha256(x.data)])
        body += x.data
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + bytes(body)


class _Decoded:
    """One rank's payload: its entries (or why one arrived corrupt), failures and C launchers."""

    def __init__(self, raw: bytes) -> None:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        self._raw, self._offset = raw, 8 + n
        self.entries: list[tuple[PackEntry, dict[str, bytes] | WarmregError]] = []
        for e in header["entries"]:
            entry = PackEntry(**{**e, "files": [PackFile(**f) for f in e["files"]]})
            blobs: dict[str, bytes] = {}
            problem: WarmregError | None = None
            for f in entry.files:
                blobs[f.name] = data = self._take(f.size)
                if len(data) != f.size or _sha256(data) != f.sha256:
                    problem = WarmregError(f"{entry.kernel}: {f.name} arrived corrupt from another rank", fix="re-run the warm")
            self.entries.append((entry, problem or blobs))
        self.failures = [(k, CompileKey.from_json(key), err) for k, key, err in header["failures"]]
        self.launchers: list[_triton_launchers.Launcher] = []
        for cache_key, platform_key, python, name, size, digest in header.get("launchers", []):
            data = self._take(size)
            if len(data) != size or _sha256(data) != digest:
                raise WarmregError(f"C launcher {name} ({cache_key[:12]}) arrived corrupt from another rank", fix="re-run the warm")
            self.launchers.append(_triton_launchers.Launcher(cache_key, platform_key, python, name, data))

    def _take(self, size: int) -> bytes:
        data = self._raw[self._offset : self._offset + size]
        self._offset += size
        return data


def _shard_launchers(shard: list[Task], plan: Plan) -> list[_triton_launchers.Launcher]:
    """The C launchers the loads of this rank's shard built (local CUDA GPU only; none otherwise)."""
    if not plan.platform.local or plan.platform.backend != "cuda":
        return []
    return _triton_launchers.built_here([t.compiled for t in shard if t.status != "failed" and t.compiled is not None])


def _all_gather_bytes(payload: bytes, group: Any) -> list[bytes]:
    device = _device_for(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t[: int(s.item())].cpu().numpy().tobytes()) for t, s in zip(gathered, sizes)]


class Shard(Stage):
    """The warm stage that splits the keys over the ranks of ``group`` and exchanges the binaries.

    Fast path: when every key is already in every rank's local cache (one small ``all_reduce``),
    nothing is exchanged and each rank warms every key locally.
    """

    name = "shard"

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.fast_path = False
        self.mine: list[Task] = []
        self.received = self.launchers = 0
        self.exchange_seconds = 0.0

    @classmethod
    def resolve(cls, group: Any, distributed: bool | None) -> Shard | None:
        """The stage for a warm's ``group`` and ``distributed`` arguments (see :func:`resolve_group`)."""
        resolved = resolve_group(group, distributed)
        return cls(resolved) if resolved is not None else None

    def first(self, plan: Plan, tasks: list[Task]) -> list[Task]:
        cached = torch.tensor([1 if _all_cached(plan, tasks) else 0], dtype=torch.int32, device=_device_for(self.group))
        dist.all_reduce(cached, op=dist.ReduceOp.MIN, group=self.group)
        self.fast_path = int(cached.item()) == 1
        self.mine = tasks if self.fast_path else tasks[self.rank :: self.world]
        return self.mine

    def after_first(self, plan: Plan, tasks: list[Task]) -> None:
        if self.fast_path:
            return
        entries, failures = [], []
        for task in self.mine:
            if task.status == "failed":
                failures.append(task.result())
            else:
                entries.append(entry_from_result(task.result(), task.kp.kernel_for(task.key)))
        start = time.perf_counter()
        gathered = _all_gather_bytes(_encode(entries, failures, _shard_launchers(self.mine, plan)), self.group)
        failed: dict[tuple[str, CompileKey], str] = {}
        for source, raw in enumerate(gathered):
            theirs = _Decoded(raw)
            for kernel, key, error in theirs.failures:
                failed[(kernel, key)] = f"failed on rank {source}: {error}"
            if source != self.rank:
                self._take(theirs, source, plan)
        for task in tasks:  # on every rank, the owner's included: the same error, naming the owner
            if (task.kp.name, task.key) in failed:
                task.fail(failed[(task.kp.name, task.key)])
        self.exchange_seconds = time.perf_counter() - start

    def _take(self, theirs: _Decoded, source: int, plan: Plan) -> None:
        """Install one other rank's entries and the C launchers that fit this machine."""
        installed, present, refused = install_entries(theirs.entries, plan.platform, pack=f"rank {source}", jits=plan.jits())
        self.received += installed + present
        for what, why in refused:
            raise WarmregError(f"entry {what} from rank {source} was refused: {why}", fix="check that all ranks run the same warmreg, Triton and plugins")
        for x in theirs.launchers:  # a rank of another Python or platform simply builds its own
            if _triton_launchers.fits_here(x.platform_key, x.name):
                self.launchers += _triton_launchers.install(x.cache_key, x.name, x.data)

    def section(self) -> dict[str, Any]:
        """This rank, the keys it compiled for the job and the entries and C launchers it received."""
        compiled = 0 if self.fast_path else sum(1 for t in self.mine if t.status == "compiled")
        return {
            "rank": self.rank, "world_size": self.world, "compiled": compiled, "received": self.received,
            "launchers_received": self.launchers, "fast_path": self.fast_path, "exchange_seconds": self.exchange_seconds,
            "summary": f"rank {self.rank} of {self.world}: {compiled} compiled for the job",
        }  # fmt: skip
