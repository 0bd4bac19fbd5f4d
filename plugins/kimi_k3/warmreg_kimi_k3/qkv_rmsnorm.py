"""The fused Q/KV RMSNorm of Kimi-K3's MLA layers: the shared :class:`warmreg.ops.FusedQKVRMSNorm`
(vLLM 0.33 ``models/common/ops/fused_qk_rmsnorm.py``: ``fused_q_kv_rmsnorm``) sized for this model.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import FusedQKVRMSNorm

from .model import PLUGIN, KimiK3, positive_text_int, tensor_parallel_size

__all__ = ["register"]


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the Q/KV RMSNorm of the MLA layers, once per width of the qkv_a projection.

    The projection is ``[q_lora | kv_lora | rope]`` (2112 wide), and when the output gate shares that
    GEMM (``text.mla_use_output_gate``) it carries ``local_heads * v_head_dim`` more columns.

    :raises warmreg.ConfigError: for a missing or non-positive MLA field.
    """
    q, kv = positive_text_int(config, "q_lora_rank"), positive_text_int(config, "kv_lora_rank")
    rope = positive_text_int(config, "qk_rope_head_dim")
    widths = {q + kv + rope}
    if config.get("text.mla_use_output_gate", bool, plugin=PLUGIN, default=False):
        heads = positive_text_int(config, "num_attention_heads")
        tp = tensor_parallel_size(config)
        v_dim = positive_text_int(config, "v_head_dim")
        widths.add(q + kv + rope + (heads // tp) * v_dim)
    for width in sorted(widths):
        registry.add(FusedQKVRMSNorm(q_size=q, kv_size=kv, proj_width=width, dtype=m.dtype, plugin=PLUGIN))
