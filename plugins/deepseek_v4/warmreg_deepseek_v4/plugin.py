"""Registration: which kernels a DeepSeek-V4 deployment launches on a platform.

Each kernel module decides its own predicates in its ``register`` (platform, attention backend,
compress ratios present); this hook only reads the config once and hands it to them.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from . import (
    backends,
    cache,
    combine_indices,
    flashinfer_indices,
    global_topk,
    indexer,
    inv_rope_quant,
    metadata,
    mtp_input_norm,
    mtp_shared_head_norm,
    sparse_mla,
    state_cache,
    swa_indices,
)
from .model import DSV4, PLUGIN

__all__ = ["warmreg_model_types", "warmreg_register_kernels"]

_MODULES = (
    metadata,
    sparse_mla,
    global_topk,
    swa_indices,
    combine_indices,
    flashinfer_indices,
    cache,
    state_cache,
    indexer,
    inv_rope_quant,
    mtp_input_norm,
    mtp_shared_head_norm,
)


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves."""
    return ["deepseek_v4"]


@warmreg.hookimpl
def warmreg_register_kernels(
    registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """Register the kernels of a DeepSeek-V4 deployment (see specs section 14 for the key space)."""
    if config.model_type != "deepseek_v4":
        return
    m = DSV4.from_config(config)
    backend = backends.attention_backend(config)
    if platform.is_cuda and backend not in backends.SPARSE_BACKENDS:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {backend!r}, an attention backend DeepSeek-V4 does not run on CUDA",
            plugin=PLUGIN,
            fix=f"use one of {', '.join(backends.SPARSE_BACKENDS)}",
        )
    # Q/KV RMSNorm (section 3): q = q_lora_rank, kv = head_dim, inputs are views of the fused
    # [q_lora_rank + head_dim] projection. On ROCm with aiter DSv4 uses aiter's fused op instead.
    registry.add(
        FusedQKVRMSNorm(
            q_size=m.q_lora_rank,
            kv_size=m.head_dim,
            proj_width=m.q_lora_rank + m.head_dim,
            dtype=m.dtype,
            plugin=PLUGIN,
        ),
        when=~(warmreg.is_rocm & warmreg.has_feature("aiter")),
    )
    for module in _MODULES:
        module.register(registry, m, config, platform)
