"""The DeepSeek-V4 C4 indexer kernels, gathered under one name for importers (this module registers
nothing): Q RoPE + FP8 quant (:mod:`.indexer_q`), Q RoPE + MXFP4 quant (:mod:`.indexer_q_mxfp4`), KV
compress + insert, FP8 or MXFP4 (:mod:`.indexer_kv`), and ROCm's MXFP4 compressor pooling
(:mod:`.compress_pool`).

Which run follows ``serving.indexer_kv_dtype`` (:func:`._serving.indexer_kv_dtype`): FP8 everywhere by default;
MXFP4 on CUDA SM10x (our MXFP4 Q unless CuTeDSL, the MXFP4 K insert) and on ROCm gfx950 with aiter (our
compress_pool, then aiter's K store, Q quant and logits, none of them ours).
"""

from __future__ import annotations

from ._serving import INDEXER_KV_DTYPES, indexer_kv_dtype, mxfp4_indexer
from .compress_pool import CompressPool, CompressPoolKey, compress_pool_reference
from .indexer_kv import (
    IndexerKVCompressInsert,
    IndexerKVInsertKey,
    indexer_kv_compress_insert_reference,
    indexer_page_stride,
    token_bytes,
)
from .indexer_q import IndexerQKey, IndexerQRopeQuant, indexer_q_rope_quant_reference
from .indexer_q_mxfp4 import IndexerQMxfp4Key, IndexerQRopeMxfp4, indexer_q_rope_mxfp4_reference

__all__ = [
    "INDEXER_KV_DTYPES",
    "CompressPool",
    "CompressPoolKey",
    "IndexerKVInsertKey",
    "IndexerKVCompressInsert",
    "IndexerQKey",
    "IndexerQMxfp4Key",
    "IndexerQRopeMxfp4",
    "IndexerQRopeQuant",
    "compress_pool_reference",
    "indexer_kv_compress_insert_reference",
    "indexer_kv_dtype",
    "indexer_page_stride",
    "indexer_q_rope_mxfp4_reference",
    "indexer_q_rope_quant_reference",
    "mxfp4_indexer",
    "token_bytes",
]
