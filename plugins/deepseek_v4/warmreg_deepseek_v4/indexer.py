"""The DeepSeek-V4 C4 indexer kernels, gathered under one name for importers (this module registers
nothing): Q RoPE + FP8 quant (:mod:`.indexer_q`) and KV compress + insert (:mod:`.indexer_kv`).

Only the FP8 indexer path is implemented; the MXFP4 path (``indexer_kv_dtype == "mxfp4"``, PTX E2M1
conversion on CUDA, aiter on ROCm) is left for later.
"""

from __future__ import annotations

from .indexer_kv import (
    IndexerKVCompressInsert,
    IndexerKVInsertKey,
    indexer_kv_compress_insert_reference,
    indexer_page_stride,
)
from .indexer_q import IndexerQKey, IndexerQRopeQuant, indexer_q_rope_quant_reference

__all__ = [
    "IndexerKVInsertKey",
    "IndexerKVCompressInsert",
    "IndexerQKey",
    "IndexerQRopeQuant",
    "indexer_kv_compress_insert_reference",
    "indexer_page_stride",
    "indexer_q_rope_quant_reference",
]
