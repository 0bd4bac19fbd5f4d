"""Launch-argument checks shared by the DeepSeek-V4 kernels: one function per rule.

Every check raises :class:`warmreg.LaunchError` naming the kernel and the offending argument; the
messages are part of the behaviour (tests match them), so a rule changes only with its callers.
"""

from __future__ import annotations

from typing import Any

import torch

import warmreg

__all__ = [
    "check_int32",
    "check_int32_table",
    "check_int32_vector",
    "check_norm_weights",
    "check_rope_cache",
    "is_pow2",
    "out_parts",
    "out_for_buffers",
    "unspecialized_int32_problem",
]


def check_int32(kernel: str, **tensors: torch.Tensor) -> None:
    """Each tensor is int32, of any rank and layout (the index kernels read through their strides).

    :raises warmreg.LaunchError: ``<name> must be int32 (got <dtype>)``.
    """
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise warmreg.LaunchError(kernel, f"{name} must be int32 (got {t.dtype})")


def check_int32_vector(kernel: str, **tensors: torch.Tensor) -> None:
    """Each tensor is a contiguous 1-D int32 tensor (the metadata kernels index it as ``ptr + i``).

    :raises warmreg.LaunchError: ``<name> must be a contiguous 1-D int32 tensor (got ...)``.
    """
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                kernel, f"{name} must be a contiguous 1-D int32 tensor (got {t.dtype} {tuple(t.shape)})"
            )


def check_int32_table(kernel: str, name: str, table: torch.Tensor, rows: int) -> None:
    """``table`` is an int32 ``[>= rows, W]`` block table with contiguous rows.

    :raises warmreg.LaunchError: ``<name> must be int32 [>= rows, W] with contiguous rows (got ...)``.
    """
    if (
        table.ndim != 2
        or table.dtype != torch.int32
        or (table.shape[1] > 1 and table.stride(1) != 1)
        or table.shape[0] < rows
    ):
        raise warmreg.LaunchError(
            kernel, f"{name} must be int32 [>= {rows}, W] with contiguous rows (got {tuple(table.shape)})"
        )


def check_rope_cache(kernel: str, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """``cos_sin_cache`` is float32 ``[P, rope_dim]`` with contiguous rows, and ``rope_dim / 2`` and the
    NoPE part ``head_dim - rope_dim`` are powers of two (the kernels tile each with one ``tl.arange``).

    :raises warmreg.LaunchError: naming ``cos_sin_cache`` or the dims.
    """
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2 or cos_sin_cache.stride(-1) != 1:
        raise warmreg.LaunchError(
            kernel,
            f"cos_sin_cache must be float32 [P, rope_dim] with a contiguous row (got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})",
        )
    rope = cos_sin_cache.shape[1]
    if rope % 2 or not is_pow2(rope // 2) or not is_pow2(head_dim - rope):
        raise warmreg.LaunchError(
            kernel, f"rope_dim {rope} and head_dim {head_dim} need power-of-two halves and NoPE part"
        )


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


def out_parts(kernel: str, out: tuple[Any, ...] | None, n: int, name: str = "out") -> tuple[Any, ...]:
    """The ``n`` buffers of an op's tuple ``out=`` (``n`` times ``None`` without one), each for
    :func:`warmreg.output` or the op's own buffer check; ``name`` is the tuple's (``"out[0]"`` when nested).

    :raises warmreg.LaunchError: ``<name> must be a tuple of <n> buffers (got ...)``.
    """
    if out is None:
        return (None,) * n
    if not isinstance(out, tuple) or len(out) != n:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise warmreg.LaunchError(
            kernel, f"{name} must be a tuple of {n} buffers (got {got})", fix="pass them in the order the op returns them"
        )
    return out


def out_for_buffers(kernel: str, out: tuple[Any, ...], **buffers: torch.Tensor | None) -> tuple[Any, ...]:
    """An op's persistent-buffer keywords given as one ``out=`` tuple, in the order of ``buffers`` (the
    op's return order); the op checks them as it checks the keywords. Call it only with an ``out``.

    :raises warmreg.LaunchError: if a keyword is given too, or ``out`` is not a tuple of that many.
    """
    given = [name for name, buf in buffers.items() if buf is not None]
    if given:
        raise warmreg.LaunchError(
            kernel, f"out and {', '.join(given)} are both given", fix="pass out or the per-buffer keywords, not both"
        )
    return out_parts(kernel, out, len(buffers))


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def unspecialized_int32_problem(*strides: int) -> str | None:
    """The problem with strides a binary takes as unspecialized ``i32`` arguments, if one does not fit
    (``None`` when all do); callers collect it with their other problems into one ``LaunchError``."""
    if any(not -(2**31) <= v < 2**31 for v in strides):
        return f"strides {strides} must fit in int32 (the binary takes them as i32)"
    return None
