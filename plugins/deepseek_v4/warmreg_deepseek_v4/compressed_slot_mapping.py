"""The compressed slot mapping of DeepSeek-V4's compressed caches: the shared
:class:`warmreg.ops.CompressedSlotMapping` (vLLM 0.34 ``v1/attention/backends/mla/compressor_utils.py``:
``get_compressed_slot_mapping``), declared at each of its call sites.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import CompressedSlotMapping

from ._serving import dcp_world_size, serving_int
from ._v41 import index_ratios, indexer_block_size
from .backends import cache_block_size
from .model import DSV4

__all__ = ["register"]


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
