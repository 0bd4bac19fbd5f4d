"""vLLM 0.33 and 0.34: a ``VllmConfig`` read into the canonical settings (vLLM's vocabulary is the canonical one)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from .reading import DSV4_ARCH, EngineRead, Reading, dotted, model_dict
from .settings import FLAGS

__all__ = ["VLLM_DSV4_BACKENDS", "VLLM_PATHS", "read_vllm"]


# -- vLLM 0.33 (vllm.config.VllmConfig) -------------------------------------------------------------
#: Canonical setting -> the ``VllmConfig`` attribute path it is read from. vLLM's vocabulary is the
#: canonical one, so values are only unwrapped: an ``AttentionBackendEnum`` member to its name, a
#: ``torch.dtype`` to its name.
VLLM_PATHS: Mapping[str, str] = {
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_model_len": "model_config.max_model_len",
    "block_size": "cache_config.block_size",
    "kv_cache_dtype": "cache_config.cache_dtype",
    "dtype": "model_config.dtype",
    "attention_backend": "attention_config.backend",
    "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    "speculative_method": "speculative_config.method",
    "indexer_kv_dtype": "attention_config.indexer_kv_dtype",
    "kda_prefill_backend": "additional_config.kda_prefill_backend",
    "kda_decode_backend": "additional_config.kda_decode_backend",
    "decode_context_parallel_size": "parallel_config.decode_context_parallel_size",
    "cp_kv_cache_interleave_size": "parallel_config.cp_kv_cache_interleave_size",
    "dcp_comm_backend": "parallel_config.dcp_comm_backend",
    "prefill_context_parallel_size": "parallel_config.prefill_context_parallel_size",
    "use_replayssm": "cache_config.use_replayssm",
    "swa_bounded_replay": "cache_config.swa_bounded_replay",
    "monokernel": "kernel_config.monokernel",
    "decode_backend": "additional_config.decode_backend",
    "draft_sample_method": "speculative_config.draft_sample_method",
    "moe_backend": "kernel_config.moe_backend",
    "enable_expert_parallel": "parallel_config.enable_expert_parallel",
    "data_parallel_size": "parallel_config.data_parallel_size",
    "all2all_backend": "parallel_config.all2all_backend",
}




#: vLLM's DeepSeek-V4 attention backend when none is set, or the generic sparse FlashMLA one: the
#: FlashMLA path on every CUDA arch but SM12x, where vLLM takes FlashInfer's SM120 kernels
#: (vllm/models/deepseek_v4/nvidia/model.py, _select_dsv4_attn_cls; there pass
#: serving={"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4"}). FLASHINFER_MLA_SPARSE(_SM120) it refuses.
VLLM_DSV4_BACKENDS: Mapping[str | None, str] = {None: "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE": "FLASHMLA_SPARSE_DSV4"}


_VLLM_DSV4_REFUSED = ("FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")


#: Under FlashMLA vLLM stores DeepSeek-V4's cache in the fp8_ds_mla block format whatever FP8 name it
#: is given, and writes ``fp8_ds_mla`` back onto ``cache_config.cache_dtype`` when the model is built
#: (vllm/models/deepseek_v4/attention.py, _resolve_dsv4_kv_cache_dtype; a non-FP8 name it refuses).
_VLLM_DSV4_FLASHMLA_CACHE = {"auto": "fp8_ds_mla", "fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla", "fp8_ds_mla": "fp8_ds_mla"}


#: The settings vLLM holds as ints; ``dtype`` is a ``torch.dtype``, the others names (strings; the attention
#: backend an ``AttentionBackendEnum`` member, read as its name).
_VLLM_INTS = frozenset(
    {"max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "tensor_parallel_size", "num_speculative_tokens",
     "decode_context_parallel_size", "cp_kv_cache_interleave_size", "prefill_context_parallel_size", "data_parallel_size"}
)  # fmt: skip


def _shown(value: Any) -> Any:
    """An enum member as ``Enum.NAME`` (its value is a class path), anything else as it is."""
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else value


def _value(r: Reading, name: str, path: str, raw: Any) -> Any:
    """The canonical value of ``raw``, read at ``path``: unwrapped, never converted from another type."""
    if name == "dtype":
        return r.dtype(raw, path)  # ModelConfig.dtype is a torch.dtype
    if name == "attention_backend":
        if isinstance(raw, enum.Enum) and isinstance(raw.name, str):
            return raw.name  # vllm/v1/attention/backends/registry.py: AttentionBackendEnum, whose value is a class path
        return r.name(raw, path, "FLASHMLA_SPARSE_DSV4", expected="an AttentionBackendEnum member or its name")
    if name in _VLLM_INTS:
        return r.count(raw, path)
    if name in FLAGS:
        return r.flag(raw, path)
    return r.name(raw, path, "auto" if name.endswith("dtype") else None)


def read_vllm(obj: Any) -> EngineRead:
    """Canonical settings from a ``VllmConfig``, read at :data:`VLLM_PATHS`.

    :raises ConfigError: for a value of the wrong type (a list, a bool for an int, ``-1`` for the dtype),
        naming the ``VllmConfig`` field; for an hf_config whose values are not a mapping.
    """
    engine = type(obj).__name__
    r = Reading(engine)
    model = model_dict(dotted(obj, "model_config.hf_config"), engine, "model_config.hf_config")
    for name, path in VLLM_PATHS.items():
        raw = dotted(obj, path)
        if raw is not None:
            value = _value(r, name, path, raw)
            r.set(name, value, path, _shown(raw) if value is not raw else None)
    if DSV4_ARCH in (model.get("architectures") or ()):
        _dsv4_names(r)
    return r.done(model)


def _dsv4_names(r: Reading) -> None:
    """DeepSeek-V4's backend when vLLM picks it, and the cache name vLLM writes back under FlashMLA."""
    backend = r.serving.get("attention_backend")
    if backend in _VLLM_DSV4_REFUSED:
        del r.serving["attention_backend"]
        r.refuse(
            "attention_backend", VLLM_PATHS["attention_backend"], backend, "which vLLM refuses for DeepSeek-V4",
            ["FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4", "none (FlashMLA)"],
        )  # fmt: skip
    elif backend in VLLM_DSV4_BACKENDS:
        r.set("attention_backend", VLLM_DSV4_BACKENDS[backend], VLLM_PATHS["attention_backend"], str(backend))
    cache = r.serving.get("kv_cache_dtype")
    if r.serving.get("attention_backend") == "FLASHMLA_SPARSE_DSV4" and cache is not None:
        if cache in _VLLM_DSV4_FLASHMLA_CACHE:
            r.set("kv_cache_dtype", _VLLM_DSV4_FLASHMLA_CACHE[cache], VLLM_PATHS["kv_cache_dtype"], cache)
        else:
            del r.serving["kv_cache_dtype"]
            r.refuse(
                "kv_cache_dtype", VLLM_PATHS["kv_cache_dtype"], cache,
                "which vLLM's FlashMLA DeepSeek-V4 cache (fp8_ds_mla) refuses", _VLLM_DSV4_FLASHMLA_CACHE,
            )  # fmt: skip
