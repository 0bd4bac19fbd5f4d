"""The canonical serving settings: each name with its validator and meaning.

vLLM's vocabulary is the canonical one (:mod:`warmreg.engines`); :class:`warmreg.WarmConfig` refuses any other
name and any value its validator refuses, naming the field and the fix, so no value reaches a plugin's arithmetic
unchecked. Every int setting has a range (documented in the README).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["FLAGS", "SERVING_FIELDS"]


def _int_in(low: int, high: int) -> Callable[[Any], str | None]:
    """A validator of an int in ``low..high`` (``bool`` is not an int here)."""

    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an int (got {type(value).__name__} {repr(value)[:40]})"
        if not low <= value <= high:
            shown = value if abs(value) < 10**12 else f"an int of {value.bit_length()} bits"
            return f"must be in {low}..{high} (got {shown})"
        return None

    return check


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"must be a non-empty string (got {repr(value)[:60]})"


_ACTIVATION_DTYPES = ("bfloat16", "float16", "float32")  # what vLLM and SGLang serve in: torch's names


def _dtype(value: Any) -> str | None:
    ok = isinstance(value, str) and value in _ACTIVATION_DTYPES
    return None if ok else f"must be one of {', '.join(_ACTIVATION_DTYPES)} (got {repr(value)[:60]})"


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false (got {repr(value)[:40]})"


#: Serving settings understood by the core, each with its validator and meaning.
SERVING_FIELDS: Mapping[str, tuple[Callable[[Any], str | None], str]] = MappingProxyType(
    {
        "max_num_batched_tokens": (_int_in(1, 2**24), "tokens in one engine step (prefill chunk budget)"),
        "max_num_seqs": (_int_in(1, 2**16), "requests in one engine step"),
        "max_model_len": (_int_in(1, 2**24), "longest sequence, prompt plus output"),
        "block_size": (_int_in(1, 2**16), "KV-cache block size in tokens (the KV manager's page)"),
        "kv_cache_dtype": (_string, "KV-cache storage format, e.g. fp8_ds_mla or auto"),
        "dtype": (_dtype, "model activation dtype: bfloat16, float16 or float32"),
        "attention_backend": (_string, "attention backend name, e.g. FLASHMLA_SPARSE_DSV4"),
        "tensor_parallel_size": (_int_in(1, 1024), "tensor-parallel ranks"),
        "num_speculative_tokens": (_int_in(0, 64), "draft tokens per decode step (0 = no speculation)"),
        "speculative_method": (_string, "speculative decoding method in vLLM's names, e.g. mtp, eagle or dspark"),
        "indexer_kv_dtype": (_string, "sparse-attention indexer K cache format in vLLM's names, e.g. auto, fp8 or mxfp4"),
        "kda_prefill_backend": (_string, "KDA (linear attention) prefill kernels in vLLM's names, e.g. auto or triton"),
        "kda_decode_backend": (_string, "KDA (linear attention) decode kernels in vLLM's names, e.g. auto or triton"),
        "decode_context_parallel_size": (_int_in(1, 1024), "decode context-parallel ranks (1 = off)"),
        "cp_kv_cache_interleave_size": (_int_in(1, 2**16), "tokens dealt to one DCP rank at a time"),
        "dcp_comm_backend": (_string, "how DCP ranks combine MLA decode outputs in vLLM's names: ag_rs or a2a"),
        "direct_dcp_a2a": (_flag, "DCP a2a through the direct symmetric-memory workspace (VLLM_USE_DIRECT_DCP_A2A)"),
        "prefill_context_parallel_size": (_int_in(1, 1024), "prefill context-parallel ranks (1 = off)"),
        "decode_backend": (_string, "decode kernels in vLLM's names, e.g. auto or latency_specialized (Kimi-K3, DeepSeek-V4.1)"),
        "draft_sample_method": (_string, "how the drafter samples in vLLM's names: greedy or probabilistic"),
        "dspark_markov_rank": (_int_in(1, 2**16), "the DSpark draft checkpoint's markov_rank"),
        "draft_num_attention_heads": (_int_in(1, 2**16), "the draft model's attention heads over all ranks"),
        "use_replayssm": (_flag, "RecoverSSM: KDA states replayed from checkpoints after speculative verification"),
        "monokernel": (_flag, "vLLM's --monokernel: persistent mono decode layers and their decode helpers (ROCm)"),
        "swa_bounded_replay": (_flag, "DeepSeek-V4.1's sliding-window KV out of prefix caching, replayed"),
        "dspark_fused_markov": (_flag, "DeepSeek-V4.1 DSpark drafts sampled by the fused Markov kernels"),
        "moe_backend": (_string, "MoE expert kernels in vLLM's names, e.g. auto or aiter_mega_moe (DeepSeek-V4, ROCm)"),
        "enable_expert_parallel": (_flag, "MoE experts sharded over the expert-parallel ranks (vLLM's --enable-expert-parallel)"),
        "data_parallel_size": (_int_in(1, 1024), "data-parallel ranks (attention replicas; with expert parallelism, MoE ranks)"),
        "all2all_backend": (_string, "expert-parallel all-to-all in vLLM's names, e.g. allgather_reducescatter or mori"),
        "aiter_fusion_shared_experts": (_flag, "ROCm aiter's fused shared expert (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS)"),
    }
)

#: The settings that are switches (true or false): an engine reads them as flags, never as names or counts.
FLAGS: frozenset[str] = frozenset(name for name, (check, _) in SERVING_FIELDS.items() if check is _flag)
