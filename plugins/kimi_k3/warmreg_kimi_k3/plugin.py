"""Registration: which kernels a Kimi-K3 deployment launches on a platform."""

from __future__ import annotations

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from . import PLUGIN

__all__ = ["warmreg_register_kernels"]

MODEL_TYPES = ("kimi_k3", "kimi_linear")


def _pos(config: warmreg.WarmConfig, field: str) -> int:
    return config.get(f"text.{field}", int, plugin=PLUGIN, check=lambda v: None if v > 0 else f"must be > 0 (got {v})")


@warmreg.hookimpl
def warmreg_register_kernels(registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the kernels of a Kimi-K3 deployment."""
    if config.model_type not in MODEL_TYPES:
        return
    q, kv = _pos(config, "q_lora_rank"), _pos(config, "kv_lora_rank")
    rope = _pos(config, "qk_rope_head_dim")
    dtype = config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16")
    # Q/KV RMSNorm for the MLA layers: the qkv_a projection is [q_lora | kv_lora | rope] (2112 wide),
    # and when the output gate shares that GEMM it carries local_heads * v_head_dim more columns.
    widths = {q + kv + rope}
    if config.get("text.mla_use_output_gate", bool, plugin=PLUGIN, default=False):
        heads = _pos(config, "num_attention_heads")
        tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
        v_dim = _pos(config, "v_head_dim")
        widths.add(q + kv + rope + (heads // tp) * v_dim)
    for width in sorted(widths):
        registry.add(FusedQKVRMSNorm(q_size=q, kv_size=kv, proj_width=width, dtype=dtype, plugin=PLUGIN))
