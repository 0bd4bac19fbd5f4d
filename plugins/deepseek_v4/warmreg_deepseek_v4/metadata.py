"""DeepSeek-V4 attention metadata kernels: index arithmetic run once per step (specs sections 12, 17-20).

- :class:`SparseSWAPrefillMetadata` (section 12): rows each prefill gathers for sparse-SWA attention.
- :class:`IndexerPrefillChunkMetadata` (section 17): K windows of the C4 indexer's prefill logits.
- :class:`PrepareUniformDecode` (section 18): flattens a uniform multi-token decode into 1-token rows.
- :class:`CompressedSlotMapping` (sections 2, 20): cache slots of the compressed (C4/C128) states.

:func:`register` also declares the shared block-table slot mapping (section 19) once per DSv4
KV-cache group. Every output is integer metadata, so tests compare with ``torch.equal``.

Pointers that are not key fields are excluded from Triton's 16-byte alignment specialization
(``do_not_specialize_on_alignment``): these kernels move a few integers per row and gain nothing from
vector loads, and then no caller's view can produce an unwarmed binary.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import BlockTableSlotMapping

from ._metadata_common import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from ._serving import serving_int
from .compressed_slot_mapping import CompressedSlotMapping, CompressedSlotMappingKey, compressed_slot_mapping_reference
from .indexer_chunk_metadata import (
    IndexerPrefillChunkMetadata,
    PrefillChunkMetadataKey,
    indexer_prefill_chunk_metadata_reference,
)
from .model import DSV4, PLUGIN, SPARSE_BLOCK_SIZE, SWA_PAGE_SIZE
from .swa_prefill_metadata import SparseSWAPrefillMetadata, SWAPrefillMetadataKey, sparse_swa_prefill_metadata_reference
from .uniform_decode import PrepareUniformDecode, UniformDecodeKey, prepare_uniform_decode_reference

__all__ = [
    "C4_STATE_BLOCK_SIZE",
    "C128_STATE_BLOCK_SIZE",
    "CompressedSlotMapping",
    "CompressedSlotMappingKey",
    "IndexerPrefillChunkMetadata",
    "PrefillChunkMetadataKey",
    "PrepareUniformDecode",
    "SWAPrefillMetadataKey",
    "SparseSWAPrefillMetadata",
    "UniformDecodeKey",
    "compressed_slot_mapping_reference",
    "indexer_prefill_chunk_metadata_reference",
    "prepare_uniform_decode_reference",
    "register",
    "sparse_swa_prefill_metadata_reference",
]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Declare the metadata kernels of a DeepSeek-V4 deployment and the shared slot mapping (section 19)
    once per KV-cache group: 64 (SWA), 256 (compressed and indexer caches), 4 and 8 (compressor states).

    :raises warmreg.ConfigError: for a KV-manager block size other than 256 or DCP with C4 layers
        (neither is supported by the DSv4 backends).
    """
    cache_block = config.get("serving.block_size", int, plugin=PLUGIN, default=SPARSE_BLOCK_SIZE)
    if cache_block != SPARSE_BLOCK_SIZE:
        raise warmreg.ConfigError(
            "serving.block_size",
            f"must be {SPARSE_BLOCK_SIZE} for the DeepSeek-V4 sparse backends (got {cache_block})",
            plugin=PLUGIN,
        )
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    interleave = serving_int(config, "cp_kv_cache_interleave_size", 1)
    if dcp > 1 and model.has_c4:
        raise warmreg.ConfigError(
            "serving.decode_context_parallel_size",
            "must be 1: the DeepSeek-V4 C4 indexer does not support DCP",
            plugin=PLUGIN,
        )
    compressed = model.has_c4 or model.has_c128
    groups = (
        (SWA_PAGE_SIZE, True),
        (cache_block, compressed),
        (C4_STATE_BLOCK_SIZE, model.has_c4),
        (C128_STATE_BLOCK_SIZE, model.has_c128),
    )
    for block_size, used in groups:
        if used:  # built only when used: under DCP, from_config checks the interleave against the size
            registry.add(BlockTableSlotMapping.from_config(config, block_sizes=(block_size,), plugin=PLUGIN))
    registry.add(SparseSWAPrefillMetadata())
    # The C4 indexer: prefill chunks always; uniform decode flattening unless the varlen DeepGEMM
    # path serves decode (SM100 with DeepGEMM).
    registry.add(IndexerPrefillChunkMetadata(compress_ratios=(4,)), when=model.has_c4)
    native_varlen = warmreg.sm_at_least(100) & warmreg.has_feature("deepgemm")
    registry.add(PrepareUniformDecode(cache_block_size=cache_block), when=~native_varlen if model.has_c4 else False)
    # Compressed slots: the sparse-MLA builder (every compressed ratio, no DCP arguments) and the
    # C4 indexer builder (the configured DCP world and interleave).
    ratios = tuple(r for r in sorted(set(model.ratios)) if r > 1)
    registry.add(CompressedSlotMapping(compress_ratios=ratios, cache_block_size=cache_block), when=compressed)
    indexer_site = CompressedSlotMapping(
        compress_ratios=(4,), dcp_world_size=dcp, cp_interleave=interleave, cache_block_size=cache_block
    )
    registry.add(indexer_site, when=model.has_c4)
