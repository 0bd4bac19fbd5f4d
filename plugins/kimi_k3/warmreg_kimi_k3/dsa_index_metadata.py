"""The shared sparse-MLA metadata kernels Kimi-K3.1's DSA layers launch (``warmreg.ops``), declared where vLLM 0.34
launches them:

* the DSA indexer's metadata builder (``models/kimi_k3/common/dsa_cache.py: KimiK3IndexerMetadataBuilder``, a
  ``DeepseekV32IndexerMetadataBuilder``): every step, the compressed slot mapping at ratio 1
  (:class:`~warmreg.ops.CompressedSlotMapping`: the key slots of the indexer's 64-token kernel pages, which manager
  slots of a packed block row do not address); for prefill chunks, the prefill chunk metadata
  (:class:`~warmreg.ops.IndexerPrefillChunkMetadata`, ratio 1, the builder's DCP rank and world); for a uniform
  decode batch flattened to one-token rows, :class:`~warmreg.ops.PrepareUniformDecode` (not where DeepGEMM's varlen
  paged-MQA logits serve decode: sm_10x with DeepGEMM);
* the sparse MLA attention (``v1/attention/backends/mla/flashmla_sparse.py: FlashMLASparseImpl``) over the
  ``fp8_ds_mla`` cache: the top-k remap (:class:`~warmreg.ops.SparseMLAIndexRemap`) into 64-token pages. With fewer
  than ``MIN_HEADS_FOR_BF16_PREFILL`` (32) query heads a rank, the FP8 mixed batch converts every row without counts
  (``triton_convert_req_index_to_global_index``), under DCP through ``triton_filter_and_convert_dcp_index`` with or
  without counts (``use_topk_length``: per step); with 32 or more, the separate decode converts with counts and the
  prefill rows into the upconverted workspace.

The indexer's block table addresses 64-token kernel pages (``KimiK3IndexerBackend.get_supported_kernel_block_sizes``
on CUDA: ``[64]``): a row of ``block_table_width(max_model_len, B) * B / 64`` pages for the manager block ``B``
(``v1/worker/utils.py``: the kernel block table's width). Not planned (left): the remap over a non-``fp8_ds_mla``
cache (FlashMLA's BF16 flat cache or FlashInfer's sparse backends), whose row stride between blocks is the packed
block row's, a layout warmreg does not model; HiSparse (``idx_mapping``) and PCP, which this plugin assumes off.
"""

from __future__ import annotations

from typing import Any

import warmreg
from warmreg.ops import (
    CompressedSlotMapping,
    IndexerPrefillChunkMetadata,
    PrepareUniformDecode,
    RemapLaunch,
    SparseMLAIndexRemap,
    block_table_width,
)

from .backends import kv_block_size
from .dsa import DSALayout, dsa_layout, mla_cache_is_fp8_ds_mla
from .model import PLUGIN, KimiK3, tensor_parallel_size

__all__ = ["KERNEL_PAGE", "dsa_kernel_table_width", "register", "remap_launches"]

#: Tokens per kernel page of the DSA caches (the indexer's and FlashMLA's FP8 sparse pages).
KERNEL_PAGE = 64
#: ``flashmla_sparse.py: MIN_HEADS_FOR_BF16_PREFILL``: below it the FP8 cache runs the mixed batch.
_MIN_HEADS_FOR_BF16_PREFILL = 32


def _serving(config: warmreg.WarmConfig, name: str, default: int | None = None) -> int:
    return config.get(f"serving.{name}", int, plugin=PLUGIN, default=default)


def dsa_kernel_table_width(m: KimiK3, config: warmreg.WarmConfig) -> int:
    """The row width of the DSA group's kernel-page block table: ``block_table_width(max_model_len, B, dcp) * B / 64``
    for the manager block ``B`` (:func:`~warmreg_kimi_k3.backends.kv_block_size`).

    :raises warmreg.ConfigError: for a block size that is not a multiple of 64 (vLLM aligns the DSA group's block to
        its 64-token kernel pages), or a missing field the block size reads.
    """
    block = kv_block_size(m, config)
    if block % KERNEL_PAGE:
        raise warmreg.ConfigError(
            "serving.block_size", f"is {block}: Kimi-K3.1's DSA caches need a multiple of {KERNEL_PAGE}", plugin=PLUGIN,
            fix="use the block size a started vLLM engine reports",
        )  # fmt: skip
    dcp = _serving(config, "decode_context_parallel_size", 1)
    return block_table_width(_serving(config, "max_model_len"), block, dcp) * (block // KERNEL_PAGE)


def remap_launches(
    layout: DSALayout, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> tuple[RemapLaunch, ...]:
    """The top-k remap launches of the FlashMLA sparse attention over the ``fp8_ds_mla`` cache (none over others,
    see the module docstring).

    :raises warmreg.ConfigError: for a missing ``text.num_attention_heads``.
    """
    if not mla_cache_is_fp8_ds_mla(config, platform):
        return ()
    heads = config.get("text.num_attention_heads", int, plugin=PLUGIN) // tensor_parallel_size(config)
    page: dict[str, Any] = dict(block_size=KERNEL_PAGE, block_stride_rows=KERNEL_PAGE, num_topk=layout.index_topk)
    if heads >= _MIN_HEADS_FOR_BF16_PREFILL:  # the separate decode (counted) and prefill (workspace) conversions
        return (RemapLaunch(**page, count_valid=True, compact_to_front=True),
                RemapLaunch(**page, has_prefill=True, count_valid=True, compact_to_front=True))  # fmt: skip
    dcp = _serving(config, "decode_context_parallel_size", 1)
    if dcp == 1:
        return (RemapLaunch(**page),)
    interleave = _serving(config, "cp_kv_cache_interleave_size", 1)
    return tuple(
        RemapLaunch(
            **page,
            count_valid=counted,
            compact_to_front=counted,
            dcp_size=dcp,
            dcp_rank=rank,
            dcp_interleave=interleave,
        )
        for rank in range(dcp)
        for counted in (False, True)
    )


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Declare the four kernels where a deployment with DSA layers runs them (CUDA; see the module docstring).

    :raises warmreg.ConfigError: for a malformed ``dsa_config``, a block size not a multiple of 64, or a missing
        ``serving.max_model_len`` / ``serving.max_num_batched_tokens``.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None:
        return
    dcp, interleave = (
        _serving(config, "decode_context_parallel_size", 1),
        _serving(config, "cp_kv_cache_interleave_size", 1),
    )
    slots = CompressedSlotMapping(compress_ratios=(1,), dcp_world_size=dcp, cp_interleave=interleave,
                                  cache_block_size=KERNEL_PAGE)  # fmt: skip
    registry.add(slots, when=warmreg.is_cuda)
    registry.add(IndexerPrefillChunkMetadata(compress_ratios=(1,), dcp_world=dcp, plugin=PLUGIN), when=warmreg.is_cuda)
    decode_len = 1 + _serving(config, "num_speculative_tokens", 0)
    uniform = PrepareUniformDecode(table_width=dsa_kernel_table_width(m, config), max_decode_len=decode_len)
    native_varlen = warmreg.sm_at_least(100) & warmreg.has_feature("deepgemm")
    registry.add(uniform, when=warmreg.is_cuda & ~native_varlen)
    launches = remap_launches(layout, config, platform)
    if launches:
        registry.add(SparseMLAIndexRemap(launches=launches), when=warmreg.is_cuda)
