"""Token → KV-cache slot mapping through a block table (every paged-KV model, once per step and group).

Math, for request ``r`` and each of its tokens ``t`` in ``[qsl[r], qsl[r+1])``, in int64, with the
group's block size ``BS``, the decode-context-parallel (DCP) world ``Wd``, this rank ``RANK`` and the
interleave ``I`` (tokens dealt to one rank at a time)::

    p = positions[t];  V = BS * Wd;  vb = p // V;  vo = p % V      # one table entry spans BS*Wd positions
    mine = (vo // I) % Wd == RANK
    lo = (vo // (Wd * I)) * I + vo % I                              # offset inside this rank's block
    slot_mapping[t] = block_table[r, vb] * BS + lo if mine else -1

and ``slot_mapping[num_tokens:max_num_tokens] = -1`` (the graph-padding tail). With ``Wd = 1`` this is
``block_table[r, p // BS] * BS + p % BS``. Grid ``(num_reqs + 1,)``: one program per request and one
for the tail.

Key: the block size and the DCP world, rank and interleave are constexprs (one binary per group and
rank); the block table's row stride is a specialized int (its class is in the key); ``num_tokens``
and ``max_num_tokens`` are ``do_not_specialize``, so one binary serves every batch. Pointers are not
specialized on 16-byte alignment (``do_not_specialize_on_alignment``): the kernel moves a few
integers per token and gains nothing from vector loads, and callers may pass any view.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from ..contract.config import WarmConfig
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta
from ..values.errors import ConfigError, LaunchError
from ..values.key import CompileKey, IntClass, int_class, int_class_rep
from ..values.platform import Platform

__all__ = ["BlockTableSlotMapping", "SlotMappingKey", "block_table_slot_mapping_reference", "block_table_width"]

#: Tokens per loop iteration of one program.
_TILE = 1024
_POINTERS = ["query_start_loc_ptr", "positions_ptr", "block_table_ptr", "slot_mapping_ptr"]


@triton.jit(do_not_specialize=["num_tokens", "max_num_tokens"], do_not_specialize_on_alignment=_POINTERS)
def _block_table_slot_mapping_kernel(
    query_start_loc_ptr,
    positions_ptr,
    block_table_ptr,
    slot_mapping_ptr,
    num_tokens,
    max_num_tokens,
    block_table_stride,
    KV_BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block of this group: slot = block * KV_BLOCK_SIZE + offset
    DCP_WORLD: tl.constexpr,  # decode-context-parallel ranks sharing the sequence (1 = off)
    DCP_RANK: tl.constexpr,  # this rank: which interleaved chunks it owns
    INTERLEAVE: tl.constexpr,  # tokens dealt to one DCP rank at a time
    TILE: tl.constexpr,  # tokens per loop iteration
):
    req = tl.program_id(0)
    if req == tl.num_programs(0) - 1:  # the last program pads the tail of the persistent buffer
        pad = tl.full([TILE], -1, tl.int64)
        for start in range(num_tokens, max_num_tokens, TILE):
            offs = start + tl.arange(0, TILE)
            tl.store(slot_mapping_ptr + offs, pad, mask=offs < max_num_tokens)
    else:
        first = tl.load(query_start_loc_ptr + req)
        last = tl.load(query_start_loc_ptr + req + 1)
        row = block_table_ptr + req.to(tl.int64) * block_table_stride
        for start in range(first, last, TILE):
            offs = start + tl.arange(0, TILE)
            mask = offs < last
            pos = tl.load(positions_ptr + offs, mask=mask, other=0).to(tl.int64)
            vblock = pos // (KV_BLOCK_SIZE * DCP_WORLD)
            voffset = pos % (KV_BLOCK_SIZE * DCP_WORLD)
            mine = (voffset // INTERLEAVE) % DCP_WORLD == DCP_RANK
            local = (voffset // (DCP_WORLD * INTERLEAVE)) * INTERLEAVE + voffset % INTERLEAVE
            block = tl.load(row + vblock, mask=mask & mine, other=0).to(tl.int64)
            tl.store(slot_mapping_ptr + offs, tl.where(mine, block * KV_BLOCK_SIZE + local, -1), mask=mask)


@attrs.frozen(kw_only=True)
class SlotMappingKey(CompileKey):
    """What changes the binary of the block-table slot mapping."""

    block_size: int  # the KV-cache group's block size
    dcp_world: int
    dcp_rank: int
    interleave: int
    block_table_stride: IntClass  # the table's row width (persistent table)
    tile: int
    num_warps: int


def block_table_width(max_model_len: int, block_size: int, dcp_world: int = 1) -> int:
    """Row width of a KV-cache group's persistent block table.

    ``cdiv(max_model_len, block_size * dcp_world)`` entries (sharded under DCP), rounded up to a
    multiple of ``128 / gcd(128, block_size)`` so that a row covers a multiple of 128 tokens.
    """
    entries = -(-max_model_len // (block_size * dcp_world))
    multiple = 128 // math.gcd(128, block_size)
    return -(-entries // multiple) * multiple


def _check_positive(owner: str, name: str, value: int, plugin: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}", f"must be an int >= 1 (got {value!r})", plugin=plugin)


class BlockTableSlotMapping(TritonKernel[SlotMappingKey]):
    """The block-table slot mapping, declared for one deployment's KV-cache groups.

    The constructor only declares the warm space (:meth:`domains`); every value that reaches the
    binary is an argument of the launch, so one instance launches for any group and rank.

    :param block_sizes: block sizes of the KV-cache groups that map slots through a block table.
    :param max_model_len: the longest sequence (sizes each group's table row, see :func:`block_table_width`).
    :param dcp_world: decode-context-parallel ranks (1 = off).
    :param dcp_rank: the rank to warm, or ``None`` for every rank (a cache shared by all ranks).
    :param interleave: ``cp_kv_cache_interleave_size``: tokens dealt to one DCP rank at a time.
    :param plugin: the registering plugin, named in config errors.
    """

    name = "warmreg.ops.block_table_slot_mapping"
    key_type = SlotMappingKey
    jit = _block_table_slot_mapping_kernel

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        max_model_len: int,
        dcp_world: int = 1,
        dcp_rank: int | None = None,
        interleave: int = 1,
        plugin: str = "warmreg",
    ) -> None:
        owner = type(self).__name__
        self.block_sizes = tuple(block_sizes)
        if not self.block_sizes:
            raise ConfigError(
                f"{owner}.block_sizes", "is empty", plugin=plugin, fix="pass the KV-cache groups' block sizes"
            )
        for value in self.block_sizes:
            _check_positive(owner, "block_sizes", value, plugin)
        for name, value in (("max_model_len", max_model_len), ("dcp_world", dcp_world), ("interleave", interleave)):
            _check_positive(owner, name, value, plugin)
        if dcp_rank is not None and not 0 <= dcp_rank < dcp_world:
            raise ConfigError(f"{owner}.dcp_rank", f"must be in [0, {dcp_world}) (got {dcp_rank})", plugin=plugin)
        self.max_model_len, self.dcp_world, self.dcp_rank = max_model_len, dcp_world, dcp_rank
        self.interleave, self.plugin = interleave, plugin

    @classmethod
    def from_config(cls, config: WarmConfig, *, block_sizes: Sequence[int], plugin: str) -> BlockTableSlotMapping:
        """Read ``max_model_len``, ``decode_context_parallel_size`` and ``cp_kv_cache_interleave_size``.

        :raises ConfigError: naming the field, for a missing ``max_model_len`` or a DCP interleave
            that does not divide a block size.
        """
        world = config.get("serving.decode_context_parallel_size", int, plugin=plugin, default=1)
        interleave = config.get("serving.cp_kv_cache_interleave_size", int, plugin=plugin, default=1)
        if world > 1:
            for bs in block_sizes:
                if bs % interleave:
                    raise ConfigError(
                        "serving.cp_kv_cache_interleave_size",
                        f"must divide every KV-cache block size under DCP (got {interleave}, block size {bs})",
                        plugin=plugin,
                    )
        return cls(
            block_sizes=block_sizes,
            max_model_len=config.get("serving.max_model_len", int, plugin=plugin),
            dcp_world=world,
            interleave=interleave,
            plugin=plugin,
        )

    def dispatch(
        self, *, block_size: int, block_table: torch.Tensor, dcp_world: int, dcp_rank: int, interleave: int
    ) -> SlotMappingKey:
        return SlotMappingKey(
            block_size=block_size,
            dcp_world=dcp_world,
            dcp_rank=dcp_rank,
            interleave=interleave,
            block_table_stride=int_class(block_table.stride(0)),
            tile=_TILE,
            num_warps=4,
        )

    def domains(self, config: WarmConfig, platform: Platform) -> Mapping[str, Iterable[Any]]:
        # Rows never reach the key; one row keeps the meta tensors small.
        widths = sorted({block_table_width(self.max_model_len, bs, self.dcp_world) for bs in self.block_sizes})
        ranks = range(self.dcp_world) if self.dcp_rank is None else (self.dcp_rank,)
        return {
            "block_size": self.block_sizes,
            "block_table": [meta((1, w), torch.int32) for w in widths],
            "dcp_world": [self.dcp_world],
            "dcp_rank": ranks,
            "interleave": [self.interleave],
        }

    def when(self, *, block_size: int, block_table: torch.Tensor, **_: Any) -> bool:
        return block_table.shape[1] == block_table_width(self.max_model_len, block_size, self.dcp_world)

    def warmup_inputs(self, key: SlotMappingKey) -> Mapping[str, Any]:
        return {
            "query_start_loc": meta((2,), torch.int32),
            "positions": meta((17,), torch.int64),
            "block_table": meta((1, int_class_rep(key.block_table_stride)), torch.int32),
            "slot_mapping": meta((32,), torch.int64),
            "block_size": key.block_size,
            "dcp_world": key.dcp_world,
            "dcp_rank": key.dcp_rank,
            "interleave": key.interleave,
        }

    def _checked(
        self, query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor | None
    ) -> torch.Tensor:
        """The tensors checked (dtypes, ranks, shapes, strides); returns the slot mapping buffer (a fresh one for ``None``)."""
        if query_start_loc.ndim != 1 or query_start_loc.dtype != torch.int32 or query_start_loc.numel() < 1:
            raise LaunchError(self.name, "query_start_loc must be a non-empty 1-D int32 tensor")
        if positions.ndim != 1 or positions.dtype != torch.int64:
            raise LaunchError(
                self.name, f"positions must be 1-D int64 (got {tuple(positions.shape)} {positions.dtype})"
            )
        num_reqs, num_tokens = query_start_loc.shape[0] - 1, positions.shape[0]
        if block_table.ndim != 2 or block_table.dtype != torch.int32 or block_table.shape[0] < num_reqs:
            raise LaunchError(
                self.name, f"block_table must be int32 [>= {num_reqs}, W] (got {tuple(block_table.shape)})"
            )
        if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (block_table, query_start_loc, positions)):
            raise LaunchError(
                self.name, "inputs need a contiguous last dim", fix="pass the persistent buffers or slices of them"
            )
        if slot_mapping is None:
            slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=positions.device)
        if (
            slot_mapping.ndim != 1
            or slot_mapping.dtype != torch.int64
            or (slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1)
        ):
            raise LaunchError(self.name, "slot_mapping must be a contiguous 1-D int64 buffer")
        if slot_mapping.shape[0] < num_tokens:
            raise LaunchError(self.name, f"slot_mapping holds {slot_mapping.shape[0]} slots for {num_tokens} tokens")
        return slot_mapping

    @kernel_launcher
    def __call__(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor | None = None,
        *,
        block_size: int,
        dcp_world: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
    ) -> LaunchSpec[SlotMappingKey]:
        """Fill ``slot_mapping[:num_tokens]`` with slots and the rest of it with -1; returns it.

        :param query_start_loc: int32 ``[num_reqs + 1]``, token offsets of the requests.
        :param positions: int64 ``[num_tokens]``, absolute positions.
        :param block_table: int32 ``[>= num_reqs, W]`` with a contiguous last dim (row stride passed).
        :param slot_mapping: int64 ``[max_num_tokens >= num_tokens]`` persistent buffer, or ``None``
            for a fresh ``[num_tokens]`` one.
        :param block_size: the group's KV-cache block size.
        :raises LaunchError: for wrong dtypes, ranks or shapes, or a DCP interleave not dividing ``block_size``.
        """
        slot_mapping = self._checked(query_start_loc, positions, block_table, slot_mapping)
        num_reqs, num_tokens = query_start_loc.shape[0] - 1, positions.shape[0]
        if min(block_size, dcp_world, interleave) < 1 or not 0 <= dcp_rank < dcp_world:
            raise LaunchError(
                self.name,
                f"bad block_size {block_size}, dcp_world {dcp_world}, rank {dcp_rank} or interleave {interleave}",
            )
        if dcp_world > 1 and block_size % interleave:
            raise LaunchError(self.name, f"DCP interleave {interleave} must divide the block size {block_size}")
        key = self.dispatch(
            block_size=block_size,
            block_table=block_table,
            dcp_world=dcp_world,
            dcp_rank=dcp_rank,
            interleave=interleave,
        )
        kwargs = dict(
            query_start_loc_ptr=query_start_loc, positions_ptr=positions, block_table_ptr=block_table,
            slot_mapping_ptr=slot_mapping, num_tokens=num_tokens, max_num_tokens=slot_mapping.shape[0],
            block_table_stride=block_table.stride(0), KV_BLOCK_SIZE=key.block_size, DCP_WORLD=key.dcp_world,
            DCP_RANK=key.dcp_rank, INTERLEAVE=key.interleave, TILE=key.tile,
        )  # fmt: skip
        empty = num_reqs == 0 and slot_mapping.shape[0] == num_tokens
        return LaunchSpec(key, None if empty else (num_reqs + 1,), kwargs, slot_mapping)


def block_table_slot_mapping_reference(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    dcp_world: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    max_num_tokens: int | None = None,
) -> torch.Tensor:
    """PyTorch reference: int64 ``[max_num_tokens]`` (default ``num_tokens``) slots, -1 for tokens of
    other DCP ranks and for the padding tail."""
    num_tokens = positions.shape[0]
    out = torch.full((num_tokens if max_num_tokens is None else max_num_tokens,), -1, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for req in range(len(qsl) - 1):
        tokens = torch.arange(qsl[req], qsl[req + 1])
        pos = positions[tokens].long().cpu()
        span = block_size * dcp_world
        vblock, voffset = pos // span, pos % span
        mine = (voffset // interleave) % dcp_world == dcp_rank
        local = (voffset // (dcp_world * interleave)) * interleave + voffset % interleave
        blocks = block_table[req].long().cpu()[vblock[mine]]
        out[tokens[mine]] = blocks * block_size + local[mine]
    return out
