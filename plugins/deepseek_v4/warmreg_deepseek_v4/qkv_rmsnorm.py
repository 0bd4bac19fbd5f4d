"""The fused Q/KV RMSNorm of DeepSeek-V4's attention: the shared :class:`warmreg.ops.FusedQKVRMSNorm`
(vLLM 0.33 ``models/common/ops/fused_qk_rmsnorm.py``: ``fused_q_kv_rmsnorm``) sized for this model.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from .model import DSV4, PLUGIN

__all__ = ["register"]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the Q/KV RMSNorm: q = ``q_lora_rank``, kv = ``head_dim``, both views of the fused
    ``[q_lora_rank + head_dim]`` projection. Every platform but ROCm with aiter, where DSv4 uses aiter's
    fused op instead.
    """
    kernel = FusedQKVRMSNorm(
        q_size=model.q_lora_rank,
        kv_size=model.head_dim,
        proj_width=model.q_lora_rank + model.head_dim,
        dtype=model.dtype,
        plugin=PLUGIN,
    )
    registry.add(kernel, when=~(warmreg.is_rocm & warmreg.has_feature("aiter")))
