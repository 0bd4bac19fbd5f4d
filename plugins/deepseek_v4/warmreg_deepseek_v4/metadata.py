"""The DeepSeek-V4 attention metadata kernels, gathered under one name for importers (this module
registers nothing; each op module has its own ``register``):

- :class:`SparseSWAPrefillMetadata` (:mod:`.swa_prefill_metadata`): rows each prefill gathers for
  sparse-SWA attention.
- :class:`~warmreg.ops.IndexerPrefillChunkMetadata` (shared, declared by :mod:`.indexer_chunk_metadata`): K windows
  of the C4 indexer's prefill logits.
- :class:`~warmreg.ops.PrepareUniformDecode` (shared, declared by :mod:`.uniform_decode`): flattens a uniform
  multi-token decode into 1-token rows.
- :class:`~warmreg.ops.CompressedSlotMapping` (shared, declared by :mod:`.compressed_slot_mapping`): cache slots of
  the compressed (C4/C128) states.

:mod:`.slot_mapping` declares the shared block-table slot mapping once per DSv4 KV-cache group.
Every output is integer metadata, so tests compare with ``torch.equal``.

Pointers that are not key fields are excluded from Triton's 16-byte alignment specialization
(``do_not_specialize_on_alignment``): these kernels move a few integers per row and gain nothing from
vector loads, and then no caller's view can produce an unwarmed binary.
"""

from __future__ import annotations

from warmreg.ops import (
    CompressedSlotMapping,
    CompressedSlotMappingKey,
    IndexerPrefillChunkMetadata,
    PrefillChunkMetadataKey,
    PrepareUniformDecode,
    UniformDecodeKey,
    compressed_slot_mapping_reference,
    indexer_prefill_chunk_metadata_reference,
    prepare_uniform_decode_reference,
)

from ._metadata_common import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from .swa_prefill_metadata import SparseSWAPrefillMetadata, SWAPrefillMetadataKey, sparse_swa_prefill_metadata_reference

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
    "sparse_swa_prefill_metadata_reference",
]
