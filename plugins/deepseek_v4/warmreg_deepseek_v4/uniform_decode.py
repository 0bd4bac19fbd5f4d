"""The uniform decode flattening of DeepSeek-V4's indexers: the shared :class:`warmreg.ops.PrepareUniformDecode`
(vLLM 0.34 ``v1/attention/backends/mla/indexer.py``: ``PrepareUniformDecodeKernel``), over the indexer group's table."""

from __future__ import annotations

import warmreg
from warmreg.ops import PrepareUniformDecode, block_table_width

from ._serving import max_model_len
from ._v41 import index_ratios, indexer_block_size
from .backends import cache_block_size
from .dspark import num_speculative_tokens
from .model import DSV4

__all__ = ["register"]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the uniform decode flattening of the C4 indexer, unless the varlen DeepGEMM path serves
    decode (SM100 with DeepGEMM).

    DeepSeek-V4.1 (CUDA): the same builder (``DeepseekV32IndexerMetadataBuilder``, subclassed by V4.1's indexer
    backends) for its index-source layers, over block tables of the indexer's kernel blocks
    (:func:`._v41.indexer_block_size`).

    :raises warmreg.ConfigError: for a KV-manager block size other than 256.
    """
    native_varlen = warmreg.sm_at_least(100) & warmreg.has_feature("deepgemm")
    decode_len, max_len = 1 + num_speculative_tokens(config), max_model_len(config)
    if model.v41:
        v41 = PrepareUniformDecode(
            table_width=block_table_width(max_len, indexer_block_size(platform)), max_decode_len=decode_len
        )
        registry.add(v41, when=warmreg.is_cuda & ~native_varlen if index_ratios(model) else False)
        return
    width = block_table_width(max_len, cache_block_size(config))
    kernel = PrepareUniformDecode(table_width=width, max_decode_len=decode_len)
    registry.add(kernel, when=~native_varlen if model.has_c4 else False)
