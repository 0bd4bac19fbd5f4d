"""Chunked KDA prefill, stage 1: the L2 norm of q and of k, row by row.

vLLM: ``chunk_kda_with_fused_gate(..., use_qk_l2norm_in_kernel=True)`` calls ``l2norm_fwd(q.contiguous())`` and
``l2norm_fwd(k.contiguous())`` (``vllm/third_party/flash_linear_attention/ops/l2norm.py``), which with
``USE_DEFAULT_FLA_NORM`` unset (its default) launches ``l2norm_fwd_kernel2``: 32 rows a program, Triton's
default launch options, no autotuning. Math, per row ``x`` of ``D`` elements (every ``(token, head)``), in fp32,
one cast to the input dtype, as that kernel computes it (a product by ``rsqrt``, not a division)::

    y = x * rsqrt(sum(x * x) + 1e-6)

Deliberate difference: ``USE_DEFAULT_FLA_NORM=1`` makes vLLM take its autotuned ``l2norm_fwd_kernel``
(``x / sqrt(..)``); warmreg follows the default only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda import L2NORM_EPS
from .kda_chunk_base import ChunkStage, tuning_tensor

__all__ = ["ROWS_PER_PROGRAM", "KDAChunkL2Norm", "KDAChunkL2NormKey", "l2norm_reference"]

#: Rows per program (vLLM's ``MBLOCK``).
ROWS_PER_PROGRAM = 32
_MAX_FUSED_BYTES = 65536  # vLLM's BD = min(65536 // element_size, next_pow2(D))


@triton.jit(do_not_specialize=["rows"])
def _kda_chunk_l2norm_kernel(
    x_ptr,
    y_ptr,
    eps,
    rows,  # T * H: varies with every batch
    D: tl.constexpr,  # the head dim: a model constant
    BD: tl.constexpr,  # next_pow2(D): one tile holds a row
    MBLOCK: tl.constexpr,  # rows per program (32)
):
    row = tl.program_id(0).to(tl.int64) * MBLOCK + tl.arange(0, MBLOCK)[:, None]
    m_row = row < rows
    col = tl.arange(0, BD)[None, :]
    mask = m_row & (col < D)
    x = tl.load(x_ptr + col + D * row, mask, other=0.0).to(tl.float32)
    square_sum = tl.sum(tl.where(m_row, tl.broadcast_to(x * x, [MBLOCK, BD]), 0), 1)[:, None]
    tl.store(y_ptr + col + D * row, x * tl.rsqrt(square_sum + eps), mask)


@attrs.frozen(kw_only=True)
class KDAChunkL2NormKey(warmreg.CompileKey):
    """What changes the binary of the L2 norm stage."""

    dtype: str  # x and y
    head_dim: int  # D
    block_d: int  # BD
    aligned: bool  # x's 16-byte alignment (y is fresh)


class KDAChunkL2Norm(ChunkStage[KDAChunkL2NormKey]):
    """The L2 norm of the chunked KDA prefill (one launch for q, one for k): replaces ``l2norm_fwd`` inside
    ``chunk_kda_with_fused_gate`` (module docstring). Not tuned: vLLM's kernel has one configuration."""

    name = "kimi_k3.kda_chunk_l2norm"
    key_type = KDAChunkL2NormKey
    jit = _kda_chunk_l2norm_kernel

    def dispatch(self, *, x: torch.Tensor) -> KDAChunkL2NormKey:
        return KDAChunkL2NormKey(
            dtype=warmreg.dtype_name(x.dtype), head_dim=x.shape[-1],
            block_d=min(_MAX_FUSED_BYTES // x.element_size(), warmreg.next_pow2(x.shape[-1])), aligned=warmreg.is_aligned(x),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # q and k after the short convolution: their own contiguous [T, H, K] tensors
        return {"x": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in self.token_counts()]}

    def warmup_inputs(self, key: KDAChunkL2NormKey) -> Mapping[str, Any]:
        return {"x": warmreg.meta((1, 1, key.head_dim), getattr(torch, key.dtype), offset=0 if key.aligned else 1)}

    def tuning_inputs(self, key: KDAChunkL2NormKey, device: torch.device) -> Mapping[str, Any]:
        tokens = self.tuning_batch(device)["tokens"]
        return {"x": tuning_tensor(device, (tokens, self.num_heads, key.head_dim), getattr(torch, key.dtype))}

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> warmreg.LaunchSpec[KDAChunkL2NormKey]:
        """``x * rsqrt(sum(x * x) + 1e-6)`` over the last dim; returns a tensor of x's shape and dtype (``out``, or
        a fresh one), as vLLM's ``l2norm_fwd(x)``.

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
        if key.head_dim > key.block_d:
            self.fail(f"the last dim must be at most {key.block_d} elements (got {key.head_dim}), as vLLM's")
        y = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)
        rows = x.numel() // max(key.head_dim, 1)
        kwargs = dict(
            x_ptr=x, y_ptr=y, eps=L2NORM_EPS, rows=rows, D=key.head_dim, BD=key.block_d, MBLOCK=ROWS_PER_PROGRAM
        )
        grid = ((rows + ROWS_PER_PROGRAM - 1) // ROWS_PER_PROGRAM,) if rows else None
        return warmreg.LaunchSpec(key, grid, kwargs, y)


def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: in fp32, ``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, one cast back."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
