"""Compressed slot mapping: the cache slot of each token that closes a compressed state (sparse-MLA models).

vLLM 0.34 ``v1/attention/backends/mla/compressor_utils.py``: ``get_compressed_slot_mapping`` →
``CompressedSlotMappingKernel``, for compressed and indexer caches.

DeepSeek-V4 launches it for its C4/C128 caches (ratios 4 and 128) and its C4 indexer; Kimi-K3.1's DSA indexer
(``models/kimi_k3/common/dsa_cache.py: KimiK3IndexerMetadataBuilder.build``) with ratio 1, to address the 64-token
kernel pages of its packed block rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from ..contract.config import WarmConfig
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta
from ..values.errors import LaunchError
from ..values.key import CompileKey, IntClass, int_class, int_class_rep
from ..values.platform import Platform
from ._index_checks import HIGH_REPS, TILE, check_int32_table, check_int32_vector, int_rep

__all__ = ["CompressedSlotMapping", "CompressedSlotMappingKey", "compressed_slot_mapping_reference"]

#: DeepSeek-V4's compressed-cache KV-manager block size, the default ``cache_block_size``.
_DSV4_CACHE_BLOCK_SIZE = 256
_I32 = torch.int32


@triton.jit
def _unowned(out_ptr, start, stop, TILE: tl.constexpr):
    """-1 in ``out[start:stop]``."""
    for j0 in range(start, stop, TILE):
        j = j0 + tl.arange(0, TILE)
        tl.store(out_ptr + j, tl.full((TILE,), -1, tl.int64), mask=j < stop)


@triton.jit(
    do_not_specialize=["block_table_stride", "out_len"],
    do_not_specialize_on_alignment=[
        "out_ptr",
        "slot_mapping_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "block_table_ptr",
    ],
)
def _compressed_slot_mapping_kernel(
    out_ptr,
    slot_mapping_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    dcp_world_size,
    cp_interleave,
    out_len,  # the whole out buffer's slots
    COMPRESS_RATIO: tl.constexpr,  # positions per compressed state
    TILE: tl.constexpr,  # tokens per loop iteration
):
    b = tl.program_id(0)
    rows = tl.num_programs(0) - 1
    if b == rows:  # the last program: -1 in every slot no request owns (before qsl[0], from qsl[rows] on)
        _unowned(out_ptr, 0, tl.load(query_start_loc_ptr), TILE)
        _unowned(out_ptr, tl.load(query_start_loc_ptr + rows), out_len, TILE)
    else:
        first = tl.load(query_start_loc_ptr + b)
        qlen = tl.load(query_start_loc_ptr + b + 1) - first
        context = tl.load(seq_lens_ptr + b) - qlen
        row = block_table_ptr + b.to(tl.int64) * block_table_stride
        for j0 in range(0, qlen, TILE):
            j = j0 + tl.arange(0, TILE)
            mask = j < qlen
            tok = first + j
            pos = context + j
            own = tl.load(slot_mapping_ptr + tok, mask=mask, other=-1)
            valid = mask & ((pos + 1) % COMPRESS_RATIO == 0) & (own != -1)
            local = (pos // (cp_interleave * dcp_world_size)) * cp_interleave + pos % cp_interleave
            state = local // COMPRESS_RATIO
            block = tl.load(row + state // block_size, mask=valid, other=0).to(tl.int64)
            tl.store(out_ptr + tok, tl.where(valid, block * block_size + state % block_size, -1), mask=mask)


@attrs.frozen(kw_only=True)
class CompressedSlotMappingKey(CompileKey):
    """What changes the binary of the compressed slot mapping."""

    compress_ratio: int
    tile: int
    block_size: IntClass  # compressed states per block (256 // ratio)
    dcp_world_size: IntClass
    cp_interleave: IntClass
    num_warps: int


def _multiple_in_class(step: int, cls: IntClass) -> int:
    """The smallest positive multiple of ``step`` in an integer class (or the class's representative)."""
    return next((v for v in range(step, 64 * step + 1, step) if int_class(v) == cls), int_class_rep(cls))


class CompressedSlotMapping(TritonKernel[CompressedSlotMappingKey]):
    """Cache slots of compressed states. Token ``t = qsl[b] + j`` at position
    ``p = seq_lens[b] - qlen + j`` writes state ``k`` only when it closes it::

        lp = (p // (I * Wd)) * I + p % I;  k = lp // CR          # rank-local; lp = p when Wd == 1
        out[t] = bt[b, k // bs] * bs + k % bs  if (p + 1) % CR == 0 and slot_mapping[t] != -1  else -1

    One program a request, and a last one that writes -1 to every slot of ``out`` no request owns
    (``[0, qsl[0])`` and ``[qsl[R], len(out))``): vLLM fills the whole buffer with torch's fill kernel first, one
    launch more (and, in a process, the load of torch's fill kernel at its first use).

    :param compress_ratios: the ratios this call site serves.
    :param dcp_world_size: the DCP world this call site passes.
    :param cp_interleave: the (uncompressed) interleave this call site passes.
    :param cache_block_size: the compressed caches' KV-manager block size; ``block_size = it // ratio``.
    """

    name = "warmreg.ops.compressed_slot_mapping"
    key_type = CompressedSlotMappingKey
    jit = _compressed_slot_mapping_kernel

    def __init__(
        self,
        *,
        compress_ratios: Sequence[int],
        dcp_world_size: int = 1,
        cp_interleave: int = 1,
        cache_block_size: int = _DSV4_CACHE_BLOCK_SIZE,
    ) -> None:
        self.compress_ratios = tuple(compress_ratios)
        self.dcp_world_size, self.cp_interleave, self.cache_block_size = dcp_world_size, cp_interleave, cache_block_size

    def dispatch(
        self, *, compress_ratio: int, block_size: int, dcp_world_size: int, cp_interleave: int
    ) -> CompressedSlotMappingKey:
        return CompressedSlotMappingKey(
            compress_ratio=compress_ratio,
            tile=TILE,
            block_size=int_class(block_size),
            dcp_world_size=int_class(dcp_world_size),
            cp_interleave=int_class(cp_interleave),
            num_warps=4,
        )

    def domains(self, config: WarmConfig, platform: Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "compress_ratio": self.compress_ratios,
            "block_size": sorted({self.cache_block_size // r for r in self.compress_ratios}),
            "dcp_world_size": [self.dcp_world_size],
            "cp_interleave": [self.cp_interleave],
        }

    def when(self, *, compress_ratio: int, block_size: int, **_: Any) -> bool:
        return block_size == self.cache_block_size // compress_ratio

    def warmup_inputs(self, key: CompressedSlotMappingKey) -> Mapping[str, Any]:
        world = int_rep(key.dcp_world_size, HIGH_REPS)
        interleave = int_class_rep(key.cp_interleave)
        return {
            "slot_mapping": meta((16,), torch.int64),
            "query_start_loc": meta((2,), _I32),
            "seq_lens": meta((1,), _I32),
            "block_table": meta((1, 4), _I32),
            "num_tokens": 16,
            "block_size": int_class_rep(key.block_size),
            "compress_ratio": key.compress_ratio,
            "dcp_world_size": world,
            "cp_interleave": interleave if world == 1 else _multiple_in_class(key.compress_ratio, key.cp_interleave),
        }

    @kernel_launcher
    def __call__(
        self,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        num_tokens: int,
        block_size: int,
        compress_ratio: int,
        dcp_world_size: int = 1,
        cp_interleave: int = 1,
        out: torch.Tensor | None = None,
    ) -> LaunchSpec[CompressedSlotMappingKey]:
        """Returns ``out[:num_tokens]`` (int64); the rest of a persistent ``out`` is set to -1.

        :param slot_mapping: int64 ``[>= num_tokens]``, the group's uncompressed slots (PAD flags).
        :param query_start_loc: int32 ``[R + 1]``; ``seq_lens``: int32 ``[R]``.
        :param block_table: int32 ``[R, W]`` of the compressed group; ``R`` is the grid.
        :param block_size: compressed states per block (``256 // compress_ratio`` for DSv4).
        :param out: persistent int64 buffer ``[>= num_tokens]``, or ``None`` for a fresh one.
        :raises LaunchError: for wrong dtypes or lengths, or a DCP interleave not a multiple of the ratio.
        """
        rows = block_table.shape[0] if block_table.ndim == 2 else 0
        check_int32_table(self.name, "block_table", block_table, rows)
        check_int32_vector(self.name, query_start_loc=query_start_loc, seq_lens=seq_lens)
        if query_start_loc.shape[0] < rows + 1 or seq_lens.shape[0] < rows:
            raise LaunchError(self.name, f"query_start_loc and seq_lens must cover the table's {rows} rows")
        if slot_mapping.dtype != torch.int64 or slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
            raise LaunchError(self.name, f"slot_mapping must be int64 [>= {num_tokens}]")
        if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
            raise LaunchError(self.name, "slot_mapping must be contiguous")
        if min(block_size, compress_ratio, dcp_world_size, cp_interleave) < 1:
            raise LaunchError(self.name, "block_size, compress_ratio, dcp_world_size and cp_interleave must be >= 1")
        if dcp_world_size > 1 and cp_interleave % compress_ratio:
            raise LaunchError(
                self.name, f"under DCP the interleave {cp_interleave} must be a multiple of {compress_ratio}"
            )
        if out is None:
            out = torch.empty(num_tokens, dtype=torch.int64, device=slot_mapping.device)
        if (
            out.dtype != torch.int64
            or out.ndim != 1
            or out.shape[0] < num_tokens
            or (out.shape[0] > 1 and out.stride(0) != 1)
        ):
            raise LaunchError(self.name, f"out must be a contiguous int64 buffer of >= {num_tokens} slots")
        key = self.dispatch(
            compress_ratio=compress_ratio,
            block_size=block_size,
            dcp_world_size=dcp_world_size,
            cp_interleave=cp_interleave,
        )
        kwargs = dict(
            out_ptr=out, slot_mapping_ptr=slot_mapping, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_size=block_size,
            dcp_world_size=dcp_world_size, cp_interleave=cp_interleave, out_len=out.shape[0],
            COMPRESS_RATIO=key.compress_ratio, TILE=key.tile,
        )  # fmt: skip
        return LaunchSpec(key, (rows + 1,), kwargs, out[:num_tokens])


def compressed_slot_mapping_reference(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    compress_ratio: int,
    dcp_world_size: int = 1,
    cp_interleave: int = 1,
) -> torch.Tensor:
    """PyTorch reference of :class:`CompressedSlotMapping`."""
    out = torch.full((num_tokens,), -1, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        qlen = qsl[b + 1] - qsl[b]
        tok = torch.arange(qsl[b], qsl[b + 1])
        pos = int(seq_lens[b]) - qlen + torch.arange(qlen)
        valid = ((pos + 1) % compress_ratio == 0) & (slot_mapping[tok] != -1)
        local = (pos // (cp_interleave * dcp_world_size)) * cp_interleave + pos % cp_interleave
        state = local[valid] // compress_ratio
        out[tok[valid]] = block_table[b].long()[state // block_size] * block_size + state % block_size
    return out
