"""The RMSNorm both MTP norms share, in Triton and in PyTorch: the fp32 recipe of the Q/KV RMSNorm, one
cast at the store::

    rms(x; w) = cast(x * rsqrt(sum(x * x) / H + eps) * w, out dtype)     x, w read as fp32
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_reference", "rms_row"]


@triton.jit
def rms_row(in_ptr, w_ptr, out_ptr, eps, keep, HIDDEN: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Normalize one row of ``HIDDEN`` (``keep`` False: store a zero row)."""
    offs = tl.arange(0, BLOCK_SIZE)
    mask = offs < HIDDEN
    x = tl.load(in_ptr + offs, mask=mask & keep, other=0.0).to(tl.float32)  # keep False: a zero row
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    tl.store(out_ptr + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch form of :func:`rms_row` over the last dim: fp32 math, one cast to ``x``'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()).to(x.dtype)
