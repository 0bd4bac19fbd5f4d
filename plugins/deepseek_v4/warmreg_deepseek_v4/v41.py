"""DeepSeek-V4.1 (``model_type`` ``deepseek_v41``): which attention class a deployment runs, and which kernels it
launches, as vLLM 0.34 decides them (``vllm/models/deepseek_v41/``).

A V4.1 checkpoint is recognised by its ``model_type`` (vLLM's ``DeepseekV41Config``; architecture
``DeepseekV41ForCausalLM``); :meth:`.model.DSV4.from_config` reads its text model (``text_config`` or the flat fields
vLLM's config class writes) into a :class:`.model.DSV4` with ``v41`` set. What differs from DeepSeek-V4:

* compress ratios 0 (sliding window only), 1 (a full-length compressed cache) and 2, where V4 has 4 and 128; only
  the ``kv_source_layer_ids`` layers run a compressor and own a compressed cache, only the
  ``index_source_layer_ids`` layers run an indexer, and the others reuse the latest source below them;
* its own copies of the compressor, cache and indexer-key kernels (``models/deepseek_v41/common/ops``), the
  MXFP8 query quant of a checkpoint with MXFP8 linears (``query_quant.py``), the mHC stream expand
  (``nvidia/ops/mhc.py``), the padded interleaved Q of mega attention (``attention.py``) and a ring-buffer
  compressor state (``compressor.py``);
* its own attention backends (:data:`V41_BACKENDS`), picked by ``nvidia/model.py: _select_dsv4_attn_cls``.

This plugin plans V4.1 on CUDA only: vLLM's V4.1 ROCm model (``models/deepseek_v41/amd``) is a separate code path
whose kernels stay gaps. :data:`OP_MODULES` lists the modules whose ``register`` a V4.1 deployment calls: the V4.1
ops, and the DeepSeek-V4 ops whose kernel V4.1 launches unchanged (shared vLLM code, same arguments).
"""

from __future__ import annotations

from types import ModuleType

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from . import (
    compressed_slot_mapping,
    gather_block_tables,
    indexer_chunk_metadata,
    indexer_q,
    inv_rope_quant,
    short_context_topk,
    swa_prefill_metadata,
    uniform_decode,
    v41_combine_indices,
    v41_compress,
    v41_engram_gate,
    v41_engram_hash,
    v41_engram_lookup,
    v41_flashinfer_indices,
    v41_global_topk,
    v41_hc_collapse,
    v41_hc_expand,
    v41_indexer_k_store,
    v41_pad_q,
    v41_q_norm_quant,
    v41_ring_rows,
    v41_ring_slots,
    v41_rope_insert,
)
from ._serving import serving_int
from .backends import attention_backend
from .model import DSV4, PLUGIN
from .swa_indices import DecodeSwaIndices

__all__ = [
    "ATTENTION_KINDS",
    "OP_MODULES",
    "V41_BACKENDS",
    "attention_kind",
    "fused_query_quant",
    "padded_heads",
    "register",
    "tensor_parallel_size",
]

#: ``serving.attention_backend`` -> the attention class vLLM 0.34 builds for V4.1 on CUDA
#: (``nvidia/model.py: _select_dsv4_attn_cls``): FlashMLA's split-KV path (``DeepseekV4FlashMLAAttention``), FlashInfer's
#: (``DeepseekV4FlashInferMLAAttention``, or its SM120 class on SM12x) or FlashMLA's mega attention
#: (``DeepseekV4MegaAttnAttention``, SM10x only). The V4 names are accepted for V4.1 as vLLM accepts them.
V41_BACKENDS = {
    "FLASHMLA_SPARSE": "flashmla",
    "FLASHMLA_SPARSE_DSV4": "flashmla",
    "FLASHMLA_SPARSE_DSV41": "flashmla",
    "FLASHINFER_MLA_SPARSE_DSV4": "flashinfer",
    "FLASHINFER_MLA_SPARSE_DSV41": "flashinfer",
    "FLASHMLA_MEGA_ATTN_DSV41": "mega",
}
#: What :func:`attention_kind` returns.
ATTENTION_KINDS = ("flashmla", "flashinfer", "flashinfer_sm120", "mega")


def tensor_parallel_size(config: warmreg.WarmConfig) -> int:
    """``serving.tensor_parallel_size`` (default 1)."""
    return serving_int(config, "tensor_parallel_size", 1)


def attention_kind(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> str:
    """The attention class of a V4.1 deployment on a CUDA ``platform``, one of :data:`ATTENTION_KINDS`.

    ``serving.attention_backend`` is required (warmreg's vLLM reading maps an unset backend for DeepSeek-V4 only;
    vLLM's own V4.1 default, mega attention on SM10x where the topology allows it, FlashInfer on SM12x and FlashMLA
    elsewhere, is named explicitly here).

    :raises warmreg.ConfigError: for a backend that is not a V4.1 one (:data:`V41_BACKENDS`; vLLM refuses
        ``FLASHINFER_MLA_SPARSE`` and its SM120 name for V4.1), or mega attention on a target outside SM10x or with
        a tensor-parallel size that leaves a ``wo_a`` group other than 8 heads (``is_available_for``).
    """
    backend = attention_backend(config)
    kind = V41_BACKENDS.get(backend)
    if kind is None:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {backend!r}, which vLLM 0.34 does not run DeepSeek-V4.1 on (CUDA)",
            plugin=PLUGIN,
            fix=f"use one of {', '.join(V41_BACKENDS)}",
        )
    if kind == "flashinfer" and platform.is_cuda and platform.sm // 10 == 12:
        return "flashinfer_sm120"
    if kind == "mega":
        tp = tensor_parallel_size(config)
        heads, groups = model.num_attention_heads, model.o_groups
        fits = heads % tp == 0 and groups % tp == 0 and groups >= tp and heads // groups == 8
        if not (platform.is_cuda and platform.sm // 10 == 10) or not fits:
            raise warmreg.ConfigError(
                "serving.attention_backend",
                f"is FLASHMLA_MEGA_ATTN_DSV41, which needs sm_10x and 8 heads a wo_a group at TP {tp} "
                f"({heads} heads, {groups} groups; target {platform})",
                plugin=PLUGIN,
                fix="use FLASHMLA_SPARSE_DSV41 there",
            )
    return kind


def padded_heads(kind: str, local_heads: int) -> int:
    """The Q head count the attention buffers are allocated at (``get_padded_num_q_heads``): FlashMLA's and mega
    attention's FP8 decode kernel takes 64 or 128 heads (``nvidia/flashmla.py``); FlashInfer pads to its supported
    counts, which warmreg does not model (no V4.1 op reads them), so its count is returned unpadded."""
    if kind in ("flashmla", "mega"):
        return 64 if local_heads <= 64 else 128
    return local_heads


def fused_query_quant(model: DSV4, platform: warmreg.Platform) -> bool:
    """Whether V4.1 normalizes Q/KV and quantizes Q to MXFP8 in one kernel (:mod:`.v41_q_norm_quant`) instead of the
    shared Q/KV RMSNorm: ``DeepseekV4Attention._split_qkv_and_norm`` when ``q_lora_rank % 32 == 0`` and
    ``can_fuse_query_quant``: CUDA, MXFP8 linears (:attr:`.model.DSV4.mxfp8_checkpoint`) on a kernel that takes
    swizzled scales, FlashInfer's CuTeDSL / CUTLASS MXFP8 GEMMs (vLLM's first choices, ``>= sm_100``). On Hopper
    vLLM's MXFP8 linear is Marlin's, which is not one of them."""
    return platform.is_cuda and platform.sm >= 100 and model.mxfp8_checkpoint and model.q_lora_rank % 32 == 0


#: The op modules a V4.1 deployment registers, each with ``register(registry, model, config, platform)``. The V4 ops
#: here launch the same vLLM kernel with the same arguments for V4.1: the V2 runner's block-table gather
#: (``v1/worker/gpu/block_table.py``) and the sparse-SWA prefill metadata (``v1/attention/backends/mla/sparse_swa.py``,
#: whose warmup V4.1's ``DeepseekV4Attention.__init__`` registers); and those whose ``register`` has a V4.1 branch
#: (``model.v41``) with V4.1's predicates: the compressed slot mapping, the indexer's prefill-chunk metadata and
#: uniform decode (V4's indexer builder, which V4.1's indexer backends subclass), the short-context top-k fill, the
#: indexer Q quant and the inverse RoPE quant (V4's kernels, imported or re-exported by ``models/deepseek_v41``).
#: V4.1's own index kernels follow: the global top-k (V4's op with V4.1's domains), the prefill combine, FlashInfer's
#: mixed sparse indices and the indexer key store. With engram layers (``engram_layer_ids``): the n-gram hash, the
#: table lookup and the gate. :func:`register` adds the two whose V4 registration reads V4's
#: backend names: the shared Q/KV RMSNorm and the
#: decode SWA indices.
OP_MODULES: tuple[ModuleType, ...] = (
    gather_block_tables,
    swa_prefill_metadata,
    compressed_slot_mapping,
    indexer_chunk_metadata,
    uniform_decode,
    short_context_topk,
    indexer_q,
    inv_rope_quant,
    v41_ring_slots,
    v41_q_norm_quant,
    v41_pad_q,
    v41_hc_expand,
    v41_hc_collapse,
    v41_compress,
    v41_ring_rows,
    v41_rope_insert,
    v41_global_topk,
    v41_combine_indices,
    v41_flashinfer_indices,
    v41_indexer_k_store,
    v41_engram_hash,
    v41_engram_lookup,
    v41_engram_gate,
)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register a V4.1 deployment's kernels: the shared Q/KV RMSNorm where the fused query quant does not replace it
    (``_split_qkv_and_norm``), the decode SWA indices (every V4.1 CUDA backend: ``DeepseekV4Attention.__init__``
    warms ``_COMPUTE_SWA_INDICES_AND_LENS_KERNEL`` for each), then every module of :data:`OP_MODULES`. CUDA only
    (see the module docstring).

    :raises warmreg.ConfigError: from :func:`attention_kind` on a CUDA target, or any field an op cannot read.
    """
    if platform.is_cuda:
        attention_kind(config, model, platform)  # refuses a backend or topology vLLM does not build
    norm = FusedQKVRMSNorm(
        q_size=model.q_lora_rank,
        kv_size=model.head_dim,
        proj_width=model.q_lora_rank + model.head_dim,
        dtype=model.dtype,
        plugin=PLUGIN,
    )
    registry.add(norm, when=warmreg.is_cuda if not fused_query_quant(model, platform) else False)
    registry.add(DecodeSwaIndices(), when=warmreg.is_cuda)
    for module in OP_MODULES:
        module.register(registry, model, config, platform)
