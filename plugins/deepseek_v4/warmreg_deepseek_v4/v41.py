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

On ROCm vLLM 0.34 imports V4.1's separate ``amd`` model (``models/deepseek_v41/__init__.py``), whose attention is
``DeepseekV41ROCMAiterMLAAttention`` (``amd/rocm.py``) under ``ROCM_FLASHMLA_SPARSE_DSV41`` and whose decode helpers
switch on with ``--monokernel`` (:mod:`._v41_rocm`). :data:`OP_MODULES` lists the modules whose ``register`` a V4.1
deployment calls: the V4.1 ops, and the DeepSeek-V4 ops whose kernel V4.1 launches unchanged (shared vLLM code, same
arguments); their predicates are CUDA ones. :data:`ROCM_OP_MODULES` lists the ROCm ones (planned so far: the decode
metadata of ``amd/rocm.py`` and ``amd/ops``, the gfx942 mono decode's key lists, the decoder layer's mHC seam, the
mHC head collapse, the common engram ops and SWA builder rows, and DSpark's Markov draft steps).
"""

from __future__ import annotations

from types import ModuleType

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from . import (
    compressed_slot_mapping,
    dspark_inputs,
    dspark_swa_indices,
    gather_block_tables,
    indexer_chunk_metadata,
    indexer_q,
    inv_rope_quant,
    short_context_topk,
    swa_prefill_metadata,
    uniform_decode,
    v41_candidate_expand,
    v41_candidate_mask,
    v41_candidate_select,
    v41_combine_indices,
    v41_compress,
    v41_engram_gate,
    v41_engram_hash,
    v41_engram_lookup,
    v41_engram_peer,
    v41_engram_select,
    v41_engram_unpack,
    v41_flashinfer_indices,
    v41_global_topk,
    v41_hc_collapse,
    v41_hc_expand,
    v41_indexer_k_store,
    v41_lookback,
    v41_markov_sample,
    v41_markov_select,
    v41_nvfp4_gather,
    v41_pad_q,
    v41_q_norm_quant,
    v41_replay_gather,
    v41_replay_pad,
    v41_ring_rows,
    v41_ring_slots,
    v41_rocm_attention,
    v41_rocm_candidate_mask,
    v41_rocm_decode_topk,
    v41_rocm_engram_gate,
    v41_rocm_gather_k,
    v41_rocm_inverse_rope_mxfp8,
    v41_rocm_keylist,
    v41_rocm_markov,
    v41_rocm_mhc_post_collapse,
    v41_rocm_shared,
    v41_rocm_swa_decode_meta,
    v41_rocm_topk_pack,
    v41_rope_insert,
    v41_specialized_candidates,
    v41_specialized_k_store,
    v41_upcast_logits,
)
from ._serving import serving_int
from ._v41_rocm import check_rocm_deployment
from .backends import attention_backend
from .model import DSV4, PLUGIN
from .swa_indices import DecodeSwaIndices

__all__ = [
    "ATTENTION_KINDS",
    "OP_MODULES",
    "ROCM_OP_MODULES",
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
#: table lookup and the gate, and the V2 runner's look-back gather the hash reads (the peer lookup, row selection and
#: FP8 staging of engram data or sequence parallelism register nothing: no warmreg setting expresses them). With SWA bounded replay (vLLM's
#: default) the V2 runner's padding of the replayed tokens' slots. With NVFP4 compressed records, the prefill gather
#: of them into bf16. Then the indexers' BF16 logits upcast (sm_10x) and the specialized decode's FP32 key store
#: (``serving.decode_backend``); with two-level candidate filtering (``candidate_source_layer_id``) the stock candidate
#: selection, the dense consumers' mask and (sm_10x with DeepGEMM) the sparse consumers' expansion
#: (:mod:`._v41_candidates`; the specialized decode's cooperative selection registers nothing yet).
#: With the decoder replay layers (bounded replay, the last kv source before the last layer) the V2 runner's gather
#: of their kept rows follows the replay padding. Last, a V4.1 DSpark draft's fused Markov sampler
#: (``additional_config.dspark_fused_markov``): its sample and select steps. Any V4.1 DSpark draft
#: (``serving.speculative_method`` ``dspark``) also launches DeepSeek-V4's DSpark kernels with V4.1's values
#: (:class:`.dspark.DSparkDraft`: the text model's fields, 32-token SWA pages): the speculator's input preparation
#: (``v1/worker/gpu/spec_decode/dspark/speculator.py``) and the SWA builder's non-causal draft rows
#: (``sparse_swa.py``); these two register on every platform, as vLLM's ROCm model launches them too.
#: :func:`register` adds the two whose V4 registration reads V4's backend names: the
#: shared Q/KV RMSNorm and the decode SWA indices.
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
    v41_engram_peer,
    v41_engram_select,
    v41_engram_unpack,
    v41_lookback,
    v41_nvfp4_gather,
    v41_replay_pad,
    v41_replay_gather,
    v41_specialized_k_store,
    v41_upcast_logits,
    v41_candidate_select,
    v41_candidate_mask,
    v41_candidate_expand,
    v41_specialized_candidates,
    v41_markov_sample,
    v41_markov_select,
    dspark_inputs,
    dspark_swa_indices,
)

#: The op modules of V4.1's ROCm model (``models/deepseek_v41/amd``), each with ``register(registry, model, config,
#: platform)`` and ROCm predicates: the one-launch SWA decode metadata (gfx942 / gfx950 ``--monokernel``), the
#: one-launch decode top-k pack (gfx942 ``--monokernel``) and the two-launch one it replaces (DeepSeek-V4's ROCm ops);
#: the gfx942 mono decode's key lists of the index layers;
#: the decoder layer's mHC seam (gfx950 with aiter); the shared V4.1 ops the ROCm model launches (the head collapse);
#: the two-level indexer's candidate mask (registers nothing yet: :mod:`._v41_candidates`); the engram gate's
#: TP-sharded partials and finish (gfx942 / gfx950); gfx950's MXFP8 prefill rows (inverse RoPE + quant); DSpark's
#: one-launch Markov draft steps (gfx942 / gfx950 ``--monokernel``); the sparse MLA decode (gfx942's partial pass
#: and reduce, the single-pass decode off gfx942 and gfx950); the in-tree prefill's K gather.
ROCM_OP_MODULES: tuple[ModuleType, ...] = (
    v41_rocm_shared,
    v41_rocm_swa_decode_meta,
    v41_rocm_topk_pack,
    v41_rocm_decode_topk,
    v41_rocm_keylist,
    v41_rocm_mhc_post_collapse,
    v41_rocm_candidate_mask,
    v41_rocm_engram_gate,
    v41_rocm_inverse_rope_mxfp8,
    v41_rocm_markov,
    v41_rocm_attention,
    v41_rocm_gather_k,
)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register a V4.1 deployment's kernels: the shared Q/KV RMSNorm where the fused query quant does not replace it
    (``_split_qkv_and_norm``), the decode SWA indices (every V4.1 CUDA backend: ``DeepseekV4Attention.__init__``
    warms ``_COMPUTE_SWA_INDICES_AND_LENS_KERNEL`` for each), then every module of :data:`OP_MODULES`; on ROCm first
    every module of :data:`ROCM_OP_MODULES`.

    :raises warmreg.ConfigError: from :func:`attention_kind` on a CUDA target, from
        :func:`._v41_rocm.check_rocm_deployment` on a ROCm one, or any field an op cannot read.
    """
    if platform.is_cuda:
        attention_kind(config, model, platform)  # refuses a backend or topology vLLM does not build
    if platform.is_rocm:
        check_rocm_deployment(config)  # refuses a backend or prefill CP that V4.1's amd model refuses
        for module in ROCM_OP_MODULES:
            module.register(registry, model, config, platform)
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
