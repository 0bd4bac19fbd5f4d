"""Registration: which kernels a Kimi-K3 deployment launches on a platform."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import warmreg
from warmreg.ops import BlockTableSlotMapping, FusedQKVRMSNorm

from . import PLUGIN
from .kda import KDARecurrent

__all__ = ["warmreg_model_types", "warmreg_register_kernels"]

MODEL_TYPES = ("kimi_k3", "kimi_linear")


def _positive(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an int (got {type(value).__name__} {value!r})"
    return None if value > 0 else f"must be > 0 (got {value})"


def _pos(config: warmreg.WarmConfig, field: str) -> int:
    return config.get(f"text.{field}", int, plugin=PLUGIN, check=_positive)


def _linear_attn(config: warmreg.WarmConfig, name: str, value: Any) -> int:
    """A positive int of ``text.linear_attn_config``, or a ConfigError naming it."""
    problem = _positive(value) if value is not None else "is missing"
    if problem:
        raise warmreg.ConfigError(
            f"text.linear_attn_config.{name}", problem, plugin=PLUGIN, fix=f"correct it in {config.source}"
        )
    return int(value)


def _register_mla(registry: warmreg.Registry, config: warmreg.WarmConfig, dtype: str) -> None:
    q, kv = _pos(config, "q_lora_rank"), _pos(config, "kv_lora_rank")
    rope = _pos(config, "qk_rope_head_dim")
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
    # The MLA layers' paged KV cache maps tokens to slots through the block table (section 19);
    # the KDA layers keep per-request state slots instead and need no slot mapping.
    block = config.get("serving.block_size", int, plugin=PLUGIN)
    max_len = config.get("serving.max_model_len", int, plugin=PLUGIN)
    registry.add(BlockTableSlotMapping(block_sizes=(block,), max_model_len=max_len, plugin=PLUGIN))


def _register_kda(registry: warmreg.Registry, config: warmreg.WarmConfig, dtype: str) -> None:
    linear = config.text.get("linear_attn_config")
    if linear is None:
        return  # a pure-MLA config
    if not isinstance(linear, Mapping):
        raise warmreg.ConfigError(
            "text.linear_attn_config",
            f"must be an object (got {linear!r})",
            plugin=PLUGIN,
            fix=f"correct it in {config.source}",
        )
    if not linear.get("kda_layers"):
        return  # no KDA layers
    heads = _linear_attn(config, "num_heads", linear.get("num_heads"))
    head_dim = _linear_attn(config, "head_dim", linear.get("head_dim"))
    tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
    if heads % tp:
        raise warmreg.ConfigError(
            "text.linear_attn_config.num_heads",
            f"({heads}) is not divisible by serving.tensor_parallel_size ({tp})",
            plugin=PLUGIN,
            fix="use a tensor-parallel size that divides the KDA head count",
        )
    registry.add(
        KDARecurrent(
            num_heads=heads // tp,
            head_k_dim=head_dim,
            head_v_dim=head_dim,
            dtype=dtype,
            use_qk_l2norm=True,  # Kimi-Linear normalises q and k inside the kernel
            max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
            num_speculative_tokens=config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0),
            plugin=PLUGIN,
        )
    )


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves."""
    return list(MODEL_TYPES)


@warmreg.hookimpl
def warmreg_register_kernels(
    registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """Register the kernels of a Kimi-K3 deployment: the shared Q/KV RMSNorm and the KDA decode step."""
    if config.model_type not in MODEL_TYPES:
        return
    dtype = config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16")
    _register_mla(registry, config, dtype)
    _register_kda(registry, config, dtype)
