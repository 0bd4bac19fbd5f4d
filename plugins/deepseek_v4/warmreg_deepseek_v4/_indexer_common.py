"""Shared pieces of the C4 indexer kernels: scale constants, the RoPE cache's meta tensor, GPT-J RoPE for the
references, and what the two indexer Q kernels (FP8 and MXFP4) share: :class:`IndexerQBase`."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

import warmreg

from .model import PLUGIN

__all__ = ["K_FP8_MAX", "SCALE_BYTES", "SCALE_FLOOR", "IndexerQBase", "cos_sin_meta", "rope_pairs"]

K = TypeVar("K", bound=warmreg.CompileKey)

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


class IndexerQBase(warmreg.TritonKernel[K]):
    """What the indexer Q RoPE + quant kernels share: their sizes, the domains of ``index_q``, ``index_weights``
    and ``cos_sin_cache``, those warmup inputs, and the checks of the launch's Q-side inputs. A subclass's key has
    the fields ``dtype``, ``weights_dtype``, ``head_dim``, ``rope_dim``, ``q_stride_t``, ``q_stride_h``,
    ``weights_stride``, ``cos_sin_stride`` and ``q_aligned``.

    :param num_heads: ``index_n_heads`` (domains only: the launch reads the tensors).
    :param head_dim: ``index_head_dim``.
    :param rope_dim: ``qk_rope_head_dim``.
    :param dtype: activation dtype name of ``index_q`` and ``index_weights``.
    """

    def __init__(
        self, *, num_heads: int = 64, head_dim: int = 128, rope_dim: int = 64, dtype: str = "bfloat16"
    ) -> None:
        self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
        self.dtype = getattr(torch, dtype)

    def q_domains(self, config: warmreg.WarmConfig) -> dict[str, list[Any]]:
        """``index_q = wq_b(qr).view(T, H, D)`` and ``index_weights = weights_proj(hidden)`` (fresh GEMM outputs)
        for every token count, and the deployment's RoPE cache."""
        tokens = warmreg.token_counts(config, plugin=PLUGIN)
        return {
            "index_q": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in tokens],
            "index_weights": [warmreg.meta((t, self.num_heads), self.dtype) for t in tokens],
            "cos_sin_cache": [cos_sin_meta(config, self.rope_dim)],
        }

    @staticmethod
    def q_key_fields(index_q: torch.Tensor, index_weights: torch.Tensor, cos_sin_cache: torch.Tensor) -> dict[str, Any]:
        """The key fields both indexer Q kernels take from their inputs, and their launch options."""
        return dict(
            dtype=warmreg.dtype_name(index_q.dtype),
            weights_dtype=warmreg.dtype_name(index_weights.dtype),
            head_dim=index_q.shape[-1],
            rope_dim=cos_sin_cache.shape[-1],
            q_stride_t=warmreg.int_class(index_q.stride(0)),
            q_stride_h=warmreg.int_class(index_q.stride(1)),
            weights_stride=warmreg.int_class(index_weights.stride(0)),
            cos_sin_stride=warmreg.int_class(cos_sin_cache.stride(0)),
            q_aligned=warmreg.is_aligned(index_q),
            num_warps=1,
            enable_fp_fusion=True,
        )

    def when(self, *, index_q: torch.Tensor, index_weights: torch.Tensor, **_: Any) -> bool:
        return index_q.shape[0] == index_weights.shape[0]

    def q_warmup_inputs(self, key: Any) -> dict[str, Any]:
        """The Q-side launch arguments that reproduce ``key`` (unit scales)."""
        rep = warmreg.int_class_rep
        return {
            "positions": warmreg.meta((1,), torch.int64),
            "index_q": warmreg.meta(
                (1, 1, key.head_dim),
                getattr(torch, key.dtype),
                stride=(rep(key.q_stride_t), rep(key.q_stride_h), 1),
                offset=0 if key.q_aligned else 1,
            ),
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), torch.float32, stride=(rep(key.cos_sin_stride), 1)),
            "index_weights": warmreg.meta((1, 1), getattr(torch, key.weights_dtype), stride=(rep(key.weights_stride), 1)),
            "softmax_scale": 1.0,
            "head_scale": 1.0,
        }

    def check_q_inputs(self, positions: torch.Tensor, index_q: torch.Tensor, index_weights: torch.Tensor) -> None:
        """bfloat16 ``index_q [T, H, D]``, ``index_weights [T, H]`` (contiguous last dims), int64 ``positions [T]``.

        :raises warmreg.LaunchError: naming the first argument that is not so.
        """
        if index_q.ndim != 3 or index_q.stride(-1) != 1 or index_q.dtype != torch.bfloat16:
            raise warmreg.LaunchError(
                self.name,
                f"index_q must be bfloat16 [T, H, D] with a contiguous last dim (got {index_q.dtype} {tuple(index_q.shape)})",
            )
        t, h, _ = index_q.shape
        if tuple(index_weights.shape) != (t, h) or index_weights.stride(-1) != 1:
            raise warmreg.LaunchError(self.name, f"index_weights must be [T, H] = {(t, h)} with a contiguous last dim")
        if positions.dtype != torch.int64 or tuple(positions.shape) != (t,):
            raise warmreg.LaunchError(
                self.name, f"positions must be int64 [{t}] (got {positions.dtype} {tuple(positions.shape)})"
            )

