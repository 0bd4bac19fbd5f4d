"""Kernels shared by several model families (registered by their plugins, never at import)."""

from __future__ import annotations

from .compressed_slot_mapping import CompressedSlotMapping, CompressedSlotMappingKey, compressed_slot_mapping_reference
from .index_remap import (
    IndexRemapKey,
    RemapLaunch,
    SparseMLAIndexRemap,
    remap_tiling,
    sparse_mla_index_remap_reference,
)
from .indexer_chunk_metadata import (
    IndexerPrefillChunkMetadata,
    PrefillChunkMetadataKey,
    indexer_prefill_chunk_metadata_reference,
)
from .qkv_rmsnorm import FusedQKVRMSNorm, QKVRMSNormKey, fused_qkv_rmsnorm_reference
from .slot_mapping import BlockTableSlotMapping, SlotMappingKey, block_table_slot_mapping_reference, block_table_width
from .uniform_decode import PrepareUniformDecode, UniformDecodeKey, prepare_uniform_decode_reference

__all__ = [
    "BlockTableSlotMapping",
    "CompressedSlotMapping",
    "CompressedSlotMappingKey",
    "FusedQKVRMSNorm",
    "IndexRemapKey",
    "IndexerPrefillChunkMetadata",
    "PrefillChunkMetadataKey",
    "PrepareUniformDecode",
    "QKVRMSNormKey",
    "RemapLaunch",
    "SlotMappingKey",
    "SparseMLAIndexRemap",
    "UniformDecodeKey",
    "block_table_slot_mapping_reference",
    "block_table_width",
    "compressed_slot_mapping_reference",
    "fused_qkv_rmsnorm_reference",
    "indexer_prefill_chunk_metadata_reference",
    "prepare_uniform_decode_reference",
    "remap_tiling",
    "sparse_mla_index_remap_reference",
]
