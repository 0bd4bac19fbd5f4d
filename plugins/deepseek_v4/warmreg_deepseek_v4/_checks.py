"""Launch-argument checks shared by the DeepSeek-V4 kernels: one function per rule.

Every check raises :class:`warmreg.LaunchError` naming the kernel and the offending argument; the
messages are part of the behaviour (tests match them), so a rule changes only with its callers.
"""

from __future__ import annotations

import torch

import warmreg

__all__ = ["check_norm_weights"]


def check_norm_weights(kernel: str, hidden: int, *weights: torch.Tensor) -> None:
    """Each RMSNorm weight is a contiguous, 16-byte aligned ``[hidden]`` tensor, all of one dtype.

    :raises warmreg.LaunchError: naming the weights.
    """
    for w in weights:
        if w.shape != (hidden,) or not w.is_contiguous() or not warmreg.is_aligned(w):
            raise warmreg.LaunchError(
                kernel, f"weights must be contiguous, 16-byte aligned [{hidden}] (got {tuple(w.shape)})"
            )
    if len({w.dtype for w in weights}) != 1:
        raise warmreg.LaunchError(kernel, "the weights must share one dtype")
