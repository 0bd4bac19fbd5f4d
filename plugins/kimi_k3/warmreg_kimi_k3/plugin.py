"""Registration: which kernels a Kimi-K3 deployment launches on a platform.

Each op module decides its own predicates in its ``register(registry, model, config, platform)``;
this hook reads the shared values once and hands them to every module of :data:`OP_MODULES`.
"""

from __future__ import annotations

from types import ModuleType

import warmreg

from . import (
    attn_res,
    causal_conv1d,
    causal_conv1d_update,
    dcp_a2a_combine,
    dcp_a2a_pack,
    dcp_correct_attn_out,
    draft_fold,
    dsa_index_metadata,
    dsa_k_insert,
    dsa_mxfp4_k_insert,
    dsa_mxfp4_prologue,
    dsa_mxfp4_q_quant,
    dsa_prologue,
    dsa_q_quant,
    gated_rmsnorm,
    gather_initial_states,
    kda,
    kda_chunk,
    kda_packed_decode,
    kda_spec_metadata,
    kda_state_indices,
    kv_balanced_plan,
    markov_noise,
    markov_select,
    markov_step,
    mm_input_norm,
    mtp_input,
    num_accepted,
    packed_causal_conv1d,
    qkv_rmsnorm,
    recoverssm_align,
    recoverssm_commit,
    recoverssm_deferred,
    recoverssm_plan,
    recoverssm_verify,
    rocm_chunk_metadata,
    rocm_kda_recurrent,
    slot_mapping,
)
from .model import KimiK3

__all__ = ["MODEL_TYPES", "OP_MODULES", "warmreg_model_types", "warmreg_register_kernels"]

#: The model types this plugin serves: warmreg calls :func:`warmreg_register_kernels` for these only.
MODEL_TYPES = ("kimi_k3", "kimi_linear")
#: The op modules, in registration order: each exposes ``register(registry, model, config, platform)``.
OP_MODULES: tuple[ModuleType, ...] = (
    qkv_rmsnorm,
    slot_mapping,
    kda,
    kda_chunk,
    causal_conv1d,
    packed_causal_conv1d,
    causal_conv1d_update,
    kda_packed_decode,
    gated_rmsnorm,
    gather_initial_states,
    kda_state_indices,
    kda_spec_metadata,
    num_accepted,
    mtp_input,
    attn_res,
    dsa_prologue,
    dsa_k_insert,
    dsa_q_quant,
    dsa_mxfp4_prologue,
    dsa_mxfp4_k_insert,
    dsa_mxfp4_q_quant,
    dsa_index_metadata,
    recoverssm_verify,
    recoverssm_plan,
    recoverssm_commit,
    recoverssm_deferred,
    recoverssm_align,
    kv_balanced_plan,
    markov_noise,
    markov_step,
    markov_select,
    draft_fold,
    mm_input_norm,
    rocm_chunk_metadata,
    rocm_kda_recurrent,
    dcp_correct_attn_out,
    dcp_a2a_pack,
    dcp_a2a_combine,
)


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves."""
    return list(MODEL_TYPES)


@warmreg.hookimpl
def warmreg_register_kernels(
    registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """Register the kernels of a Kimi-K3 deployment: the shared Q/KV RMSNorm and slot mapping of the
    MLA layers; the KDA layers' decode step, chunked prefill (where vLLM runs it in Triton), short
    convolutions (stock or packed), output gated RMSNorm, prefill initial-state gather and metadata kernels (aligned state
    indices, speculative-decode staging); the attention residuals of every decoder layer; and the DSA layers'
    indexer kernels (fused prologue or key insert, query quant) with an FP8 or MXFP4 indexer cache, and the shared
    sparse-MLA metadata kernels (indexer builder's slots, chunk metadata, uniform decode; the top-k remap); the model
    runner's accepted-count update; the MTP draft layer's input norms; and under the specialized decode the
    KV-balanced MLA plan, the DSpark drafter's Markov sampling and its draft attention's balanced tables; and
    RecoverSSM's verify and commit (plan, conv-state compaction, SSM fold), deferred under the specialized decode
    (defer step, flush plan); the vision tower's input normalisation; on ROCm the KDA builder's chunk metadata and the KDA recurrent step; the MLA decode's DCP correction;
    RecoverSSM's align-mode postprocess is an op no deployment plans."""
    m = KimiK3.from_config(config)
    for module in OP_MODULES:
        module.register(registry, m, config, platform)
