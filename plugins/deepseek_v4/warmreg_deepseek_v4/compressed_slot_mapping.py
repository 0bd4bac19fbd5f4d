"""Compressed slot mapping: cache slots of the compressed (C4/C128) states (vLLM 0.33
``v1/attention/backends/mla/compressor_utils.py``: ``get_compressed_slot_mapping``, ``CompressedSlotMappingKernel``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table, check_int32_vector
from ._metadata_common import HIGH_REPS, TILE, int_rep
from ._serving import dcp_world_size, serving_int
from ._v41 import index_ratios, indexer_block_size
from .backends import cache_block_size
from .model import DSV4, SPARSE_BLOCK_SIZE

__all__ = [
    "CompressedSlotMapping",
    "CompressedSlotMappingKey",
    "compressed_slot_mapping_reference",
    "register",
]

_I32 = torch.int32


@triton.jit(
    do_not_specialize=["block_table_stride"],
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
    COMPRESS_RATIO: tl.constexpr,  # positions per compressed state
    TILE: tl.constexpr,  # tokens per loop iteration
):
    b = tl.program_id(0)
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
class CompressedSlotMappingKey(warmreg.CompileKey):
    """What changes the binary of the compressed slot mapping."""

    compress_ratio: int
    tile: int
    block_size: warmreg.IntClass  # compressed states per block (256 // ratio)
    dcp_world_size: warmreg.IntClass
    cp_interleave: warmreg.IntClass
    num_warps: int


def _multiple_in_class(step: int, cls: warmreg.IntClass) -> int:
    """The smallest positive multiple of ``step`` in an integer class (or the class's representative)."""
    return next(
        (v for v in range(step, 64 * step + 1, step) if warmreg.int_class(v) == cls), warmreg.int_class_rep(cls)
    )


class CompressedSlotMapping(warmreg.TritonKernel[CompressedSlotMappingKey]):
    """Cache slots of compressed states. Token ``t = qsl[b] + j`` at position
    ``p = seq_lens[b] - qlen + j`` writes state ``k`` only when it closes it::

        lp = (p // (I * Wd)) * I + p % I;  k = lp // CR          # rank-local; lp = p when Wd == 1
        out[t] = bt[b, k // bs] * bs + k % bs  if (p + 1) % CR == 0 and slot_mapping[t] != -1  else -1

    The launcher first fills the whole ``out`` buffer with -1.

    :param compress_ratios: the ratios this call site serves.
    :param dcp_world_size: the DCP world this call site passes.
    :param cp_interleave: the (uncompressed) interleave this call site passes.
    :param cache_block_size: the compressed caches' KV-manager block size; ``block_size = it // ratio``.
    """

    name = "deepseek_v4.compressed_slot_mapping"
    key_type = CompressedSlotMappingKey
    jit = _compressed_slot_mapping_kernel

    def __init__(
        self,
        *,
        compress_ratios: Sequence[int],
        dcp_world_size: int = 1,
        cp_interleave: int = 1,
        cache_block_size: int = SPARSE_BLOCK_SIZE,
    ) -> None:
        self.compress_ratios = tuple(compress_ratios)
        self.dcp_world_size, self.cp_interleave, self.cache_block_size = dcp_world_size, cp_interleave, cache_block_size

    def dispatch(
        self, *, compress_ratio: int, block_size: int, dcp_world_size: int, cp_interleave: int
    ) -> CompressedSlotMappingKey:
        return CompressedSlotMappingKey(
            compress_ratio=compress_ratio,
            tile=TILE,
            block_size=warmreg.int_class(block_size),
            dcp_world_size=warmreg.int_class(dcp_world_size),
            cp_interleave=warmreg.int_class(cp_interleave),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
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
        interleave = warmreg.int_class_rep(key.cp_interleave)
        return {
            "slot_mapping": warmreg.meta((16,), torch.int64),
            "query_start_loc": warmreg.meta((2,), _I32),
            "seq_lens": warmreg.meta((1,), _I32),
            "block_table": warmreg.meta((1, 4), _I32),
            "num_tokens": 16,
            "block_size": warmreg.int_class_rep(key.block_size),
            "compress_ratio": key.compress_ratio,
            "dcp_world_size": world,
            "cp_interleave": interleave if world == 1 else _multiple_in_class(key.compress_ratio, key.cp_interleave),
        }

    @warmreg.kernel_launcher
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
    ) -> warmreg.LaunchSpec[CompressedSlotMappingKey]:
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
            raise warmreg.LaunchError(self.name, f"query_start_loc and seq_lens must cover the table's {rows} rows")
        if slot_mapping.dtype != torch.int64 or slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
            raise warmreg.LaunchError(self.name, f"slot_mapping must be int64 [>= {num_tokens}]")
        if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
            raise warmreg.LaunchError(self.name, "slot_mapping must be contiguous")
        if min(block_size, compress_ratio, dcp_world_size, cp_interleave) < 1:
            raise warmreg.LaunchError(
                self.name, "block_size, compress_ratio, dcp_world_size and cp_interleave must be >= 1"
            )
        if dcp_world_size > 1 and cp_interleave % compress_ratio:
            raise warmreg.LaunchError(
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
            raise warmreg.LaunchError(self.name, f"out must be a contiguous int64 buffer of >= {num_tokens} slots")
        out.fill_(-1)
        key = self.dispatch(
            compress_ratio=compress_ratio,
            block_size=block_size,
            dcp_world_size=dcp_world_size,
            cp_interleave=cp_interleave,
        )
        kwargs = dict(
            out_ptr=out, slot_mapping_ptr=slot_mapping, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_size=block_size,
            dcp_world_size=dcp_world_size, cp_interleave=cp_interleave, COMPRESS_RATIO=key.compress_ratio, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,) if rows else None, kwargs, out[:num_tokens])


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


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the compressed slot mapping at its two call sites, when the model has compressed layers:
    the sparse-MLA builder (every compressed ratio, no DCP arguments) and the C4 indexer builder (the
    configured DCP world and interleave).

    DeepSeek-V4.1 (CUDA): the same two builders call ``get_compressed_slot_mapping``: V4.1's FlashMLA sparse builder
    (``models/deepseek_v41/sparse_mla.py``) for each kv-source cache of ratio 2 (ratio 1 keeps the step's slots), and
    the indexer builder (``DeepseekV32IndexerMetadataBuilder``, V4.1's indexer backends subclass it) for each
    index-source ratio above 1, with ``num_states`` of its kernel blocks (:func:`._v41.indexer_block_size`).

    :raises warmreg.ConfigError: for a KV-manager block size other than 256 or DCP with C4 layers.
    """
    if model.v41:
        _register_v41(registry, model, config, platform)
        return
    cache_block = cache_block_size(config)
    dcp = dcp_world_size(config, model)
    interleave = serving_int(config, "cp_kv_cache_interleave_size", 1)
    ratios = tuple(r for r in sorted(set(model.ratios)) if r > 1)
    mla_site = CompressedSlotMapping(compress_ratios=ratios, cache_block_size=cache_block)
    registry.add(mla_site, when=model.has_c4 or model.has_c128)
    indexer_site = CompressedSlotMapping(
        compress_ratios=(4,), dcp_world_size=dcp, cp_interleave=interleave, cache_block_size=cache_block
    )
    registry.add(indexer_site, when=model.has_c4)


def _register_v41(
    registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """The V4.1 call sites (see :func:`register`): CUDA only, as this plugin's V4.1 plan."""
    mla = tuple(r for r in model.v41_compressed_ratios if r > 1)
    mla_site = CompressedSlotMapping(compress_ratios=mla, cache_block_size=cache_block_size(config))
    registry.add(mla_site, when=warmreg.is_cuda if mla else False)
    indexed = tuple(r for r in index_ratios(model) if r > 1)
    indexer_site = CompressedSlotMapping(
        compress_ratios=indexed, dcp_world_size=serving_int(config, "decode_context_parallel_size", 1),
        cp_interleave=serving_int(config, "cp_kv_cache_interleave_size", 1), cache_block_size=indexer_block_size(platform),
    )  # fmt: skip
    registry.add(indexer_site, when=warmreg.is_cuda if indexed else False)
