"""Registration: which kernels a DeepSeek-V4 deployment launches on a platform.

Each op module decides its own predicates in its ``register(registry, model, config, platform)``
(platform, attention backend, compress ratios present); this hook reads the config once, checks the
attention backend, and hands both to every module of :data:`OP_MODULES`.
"""

from __future__ import annotations

from types import ModuleType

import warmreg

from . import (
    backends,
    cache,
    cache_insert,
    combine_indices,
    compress_pool,
    compressed_slot_mapping,
    dspark_inputs,
    dspark_swa_indices,
    flashinfer_indices,
    gather_block_tables,
    global_topk,
    image_visibility,
    indexer_chunk_metadata,
    indexer_kv,
    indexer_q,
    indexer_q_mxfp4,
    inv_rope_quant,
    mtp_input_norm,
    mtp_shared_head_norm,
    pack_seq,
    qkv_rmsnorm,
    rocm_combine_indices,
    rocm_compress_insert,
    rocm_compress_two_stage,
    rocm_decode_topk,
    rocm_indexer_gather,
    rocm_indexer_logits,
    rocm_inverse_rope,
    rocm_localize_topk,
    rocm_mega_moe,
    rocm_prefill_topk,
    rocm_ragged,
    rocm_sparse_attn_decode,
    rocm_sparse_attn_decode_gfx950,
    rocm_sparse_attn_decode_ragged,
    rocm_sparse_attn_prefill,
    rocm_sparse_attn_reduce,
    short_context_topk,
    slot_mapping,
    sparse_mla,
    state_cache,
    swa_indices,
    swa_prefill_metadata,
    uniform_decode,
    unpack_seq,
    v41,
    v41_upcast_logits,
    xpu_dequant_gather,
    xpu_qnorm_rope,
    xpu_sparse_mla,
)
from .model import DSV4, MODEL_TYPES, PLUGIN

__all__ = ["OP_MODULES", "warmreg_model_types", "warmreg_register_kernels"]

#: The op modules, in registration order: each exposes ``register(registry, model, config, platform)``.
#: ``slot_mapping`` comes first among the metadata ops: it refuses an unsupported KV block size or
#: DCP with C4 layers before any metadata kernel is declared.
OP_MODULES: tuple[ModuleType, ...] = (
    qkv_rmsnorm,
    slot_mapping,
    gather_block_tables,
    swa_prefill_metadata,
    indexer_chunk_metadata,
    uniform_decode,
    compressed_slot_mapping,
    sparse_mla,
    global_topk,
    short_context_topk,
    swa_indices,
    image_visibility,
    dspark_swa_indices,
    combine_indices,
    flashinfer_indices,
    rocm_ragged,
    rocm_decode_topk,
    rocm_prefill_topk,
    rocm_combine_indices,
    rocm_localize_topk,
    rocm_mega_moe,
    rocm_indexer_gather,
    rocm_indexer_logits,
    rocm_compress_insert,
    rocm_compress_two_stage,
    rocm_sparse_attn_prefill,
    rocm_sparse_attn_decode,
    rocm_sparse_attn_decode_gfx950,
    rocm_sparse_attn_decode_ragged,
    rocm_sparse_attn_reduce,
    rocm_inverse_rope,
    cache,
    cache_insert,
    xpu_qnorm_rope,
    xpu_dequant_gather,
    xpu_sparse_mla,
    state_cache,
    indexer_q,
    indexer_q_mxfp4,
    v41_upcast_logits,
    pack_seq,
    unpack_seq,
    indexer_kv,
    compress_pool,
    inv_rope_quant,
    mtp_input_norm,
    mtp_shared_head_norm,
    dspark_inputs,
)


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves (DeepSeek-V4 and V4.1): warmreg calls :func:`warmreg_register_kernels` for
    these only."""
    return list(MODEL_TYPES)


@warmreg.hookimpl
def warmreg_register_kernels(
    registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """Register the kernels of a DeepSeek-V4 deployment: every op module's ``register``, in order.

    :raises warmreg.ConfigError: for an attention backend DeepSeek-V4 does not run on CUDA, a cache dtype the
        backend refuses on the target (:func:`.backends.kv_cache_layout`), or any field an op module cannot read.
    """
    m = DSV4.from_config(config)
    if m.v41:  # DeepSeek-V4.1: its own backends and kernel set (warmreg_deepseek_v4.v41)
        v41.register(registry, m, config, platform)
        return
    backend = backends.attention_backend(config)
    if platform.is_cuda and backend not in backends.SPARSE_BACKENDS:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {backend!r}, an attention backend DeepSeek-V4 does not run on CUDA",
            plugin=PLUGIN,
            fix=f"use one of {', '.join(backends.SPARSE_BACKENDS)}",
        )
    backends.kv_cache_layout(config, platform)  # refuses a backend, cache dtype and target vLLM does not pair
    for module in OP_MODULES:
        module.register(registry, m, config, platform)
