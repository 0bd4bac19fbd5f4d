"""Shared pieces of the C4 indexer kernels: scale constants, checks, GPT-J RoPE for the references."""

from __future__ import annotations

import torch

import warmreg

from .model import PLUGIN

_SCALE_FLOOR = 1e-4
_K_FP8_MAX = 448.0
_SCALE_BYTES = 4  # one fp32 (or UE8M0 x4 int32) scale per 128-dim token




def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _cos_sin_meta(config: warmreg.WarmConfig, rope_dim: int) -> torch.Tensor:
    rows = config.get("model.max_position_embeddings", int, plugin=PLUGIN, default=1 << 20)
    return warmreg.meta((rows, rope_dim), torch.float32)


def _check_rope(kernel: str, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2 or cos_sin_cache.stride(-1) != 1:
        raise warmreg.LaunchError(
            kernel,
            f"cos_sin_cache must be float32 [P, rope_dim] with a contiguous row (got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})",
        )
    rope = cos_sin_cache.shape[1]
    if rope % 2 or not _is_pow2(rope // 2) or not _is_pow2(head_dim - rope):
        raise warmreg.LaunchError(
            kernel, f"rope_dim {rope} and head_dim {head_dim} need power-of-two halves and NoPE part"
        )


def _rope_pairs(
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
