"""The prefill chunk metadata of DeepSeek-V4's C4 indexer: the shared :class:`warmreg.ops.IndexerPrefillChunkMetadata`
(vLLM 0.34 ``v1/attention/backends/mla/indexer.py``: ``build_prefill_chunk_metadata``)."""

from __future__ import annotations

import warmreg
from warmreg.ops import IndexerPrefillChunkMetadata

from ._v41 import index_ratios
from .model import DSV4, PLUGIN

__all__ = ["register"]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the C4 indexer's prefill chunk metadata when the model has C4 layers (every platform).

    DeepSeek-V4.1 (CUDA): its indexer backends' builder is V4's (``DeepseekV32IndexerMetadataBuilder``), which calls
    ``build_prefill_chunk_metadata`` with its cache's ratio (``tokens_per_state``): each index-source ratio.
    """
    if model.v41:
        ratios = index_ratios(model)
        registry.add(
            IndexerPrefillChunkMetadata(compress_ratios=ratios, plugin=PLUGIN),
            when=warmreg.is_cuda if ratios else False,
        )
        return
    registry.add(IndexerPrefillChunkMetadata(compress_ratios=(4,), plugin=PLUGIN), when=model.has_c4)
