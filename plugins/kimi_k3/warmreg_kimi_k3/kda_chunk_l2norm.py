"""Chunked KDA prefill, stage 1: the L2 norm of q and of k, row by row.

vLLM: ``chunk_kda_with_fused_gate(..., use_qk_l2norm_in_kernel=True)`` calls ``l2norm_fwd`` on q and on k
(``vllm/third_party/flash_linear_attention/ops/l2norm.py: l2norm_fwd_kernel``, autotuned on ``D`` over ``BT``
and ``num_warps``) before the chunked recurrence. Math, per row ``x`` of ``D`` elements (every ``(token, head)``),
in fp32, one cast to the input dtype::

    y = x / sqrt(sum(x * x) + 1e-6)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda import L2NORM_EPS
from .kda_chunk_base import ChunkStage

__all__ = ["L2NORM_TUNE_CONFIGS", "KDAChunkL2Norm", "KDAChunkL2NormKey", "l2norm_reference"]

#: vLLM tunes 25 candidates (BT 8..128 x 1..16 warps); these four span the same range of tile and warps.
L2NORM_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BT": 16}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BT": 32}, num_warps=4),
    warmreg.TuneConfig(constexprs={"BT": 64}, num_warps=4),
    warmreg.TuneConfig(constexprs={"BT": 128}, num_warps=8),
)


@triton.jit(do_not_specialize=["rows"])
def _kda_chunk_l2norm_kernel(
    x_ptr,
    y_ptr,
    rows,  # T * H: varies with every batch
    eps,
    D: tl.constexpr,  # the head dim: a model constant
    BD: tl.constexpr,  # next_pow2(D): one tile holds a row
    BT: tl.constexpr,  # rows per program (tuned)
):
    offs_r = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    mask = (offs_r < rows)[:, None] & (offs_d < D)[None, :]
    offs = offs_r[:, None] * D + offs_d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@attrs.frozen(kw_only=True)
class KDAChunkL2NormKey(warmreg.CompileKey):
    """What changes the binary of the L2 norm stage."""

    dtype: str  # x and y
    head_dim: int  # D
    block_d: int  # BD
    aligned: bool  # x's 16-byte alignment (y is fresh)
    config: int | None = None  # the autotune candidate (filled in by the core)


class KDAChunkL2Norm(ChunkStage[KDAChunkL2NormKey]):
    """The L2 norm of the chunked KDA prefill (one launch for q, one for k)."""

    name = "kimi_k3.kda_chunk_l2norm"
    key_type = KDAChunkL2NormKey
    jit = _kda_chunk_l2norm_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = L2NORM_TUNE_CONFIGS

    def dispatch(self, *, x: torch.Tensor) -> KDAChunkL2NormKey:
        return KDAChunkL2NormKey(
            dtype=warmreg.dtype_name(x.dtype), head_dim=x.shape[-1], block_d=warmreg.next_pow2(x.shape[-1]),
            aligned=warmreg.is_aligned(x),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # q and k after the short convolution: their own contiguous [T, H, K] tensors
        return {"x": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in self.token_counts()]}

    def warmup_inputs(self, key: KDAChunkL2NormKey) -> Mapping[str, Any]:
        return {"x": warmreg.meta((1, 1, key.head_dim), getattr(torch, key.dtype), offset=0 if key.aligned else 1)}

    def tuning_inputs(self, key: KDAChunkL2NormKey, device: torch.device) -> Mapping[str, Any]:
        tokens = self.tuning_batch(device)["tokens"]
        return {"x": torch.randn(tokens, self.num_heads, key.head_dim, device=device).to(getattr(torch, key.dtype))}

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> warmreg.LaunchSpec[KDAChunkL2NormKey]:
        """``x / sqrt(sum(x * x) + 1e-6)`` over the last dim; returns a tensor of x's shape and dtype (``out``, or
        a fresh one).

        :param x: ``[..., D]``, contiguous (floating point).
        :param out: a preallocated output, contiguous, x's shape and dtype (then nothing is allocated).
        :raises LaunchError: for a non-contiguous or non-floating x, or an ``out`` that is not the output's shape,
            dtype and layout.
        """
        if not x.is_contiguous() or not x.dtype.is_floating_point or x.ndim < 1:
            self.fail(
                f"x must be a contiguous floating tensor (got {x.dtype} strides {x.stride()})", fix="x.contiguous()"
            )
        key = self.dispatch(x=x)
        y = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)
        rows = x.numel() // max(key.head_dim, 1)
        kwargs = dict(x_ptr=x, y_ptr=y, rows=rows, eps=L2NORM_EPS, D=key.head_dim, BD=key.block_d)

        def grid(meta: Mapping[str, Any]) -> tuple[int, ...]:
            return ((rows + meta["BT"] - 1) // meta["BT"],)

        return warmreg.LaunchSpec(key, grid if rows else None, kwargs, y)


def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: in fp32, ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, one cast back."""
    xf = x.float()
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
