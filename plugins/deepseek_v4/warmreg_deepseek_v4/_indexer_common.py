"""Shared pieces of the C4 indexer kernels: scale constants, the RoPE cache's meta tensor, and GPT-J
RoPE for the references."""

from __future__ import annotations

import torch

import warmreg

from .model import PLUGIN

__all__ = ["K_FP8_MAX", "SCALE_BYTES", "SCALE_FLOOR", "cos_sin_meta", "rope_pairs"]

SCALE_FLOOR = 1e-4
K_FP8_MAX = 448.0
SCALE_BYTES = 4  # one fp32 (or UE8M0 x4 int32) scale per 128-dim token


def cos_sin_meta(config: warmreg.WarmConfig, rope_dim: int) -> torch.Tensor:
    """The deployment's ``cos_sin_cache`` as a meta tensor: ``[max_position_embeddings, rope_dim]`` fp32."""
    rows = config.get("model.max_position_embeddings", int, plugin=PLUGIN, default=1 << 20)
    return warmreg.meta((rows, rope_dim), torch.float32)


def rope_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False, fma: bool = False
) -> torch.Tensor:
    """GPT-J interleaved rotation of ``x [..., R]`` (fp32) by ``cos, sin [..., R/2]``, in fp32 steps.

    ``fma`` emulates ``fma(e, c, -(o*s))``: the exact float64 product, one rounding of the sum to fp32
    (a second, float64 rounding can differ from a true fma only on exact ties, never seen in practice).
    """
    even, odd = x[..., 0::2], x[..., 1::2]
    if inverse:
        sin = -sin
    if fma:
        even_r = (even.double() * cos.double() - (odd * sin).double()).float()
        odd_r = (odd.double() * cos.double() + (even * sin).double()).float()
    else:
        even_r = even * cos - odd * sin
        odd_r = odd * cos + even * sin
    return torch.stack([even_r, odd_r], dim=-1).flatten(-2)
