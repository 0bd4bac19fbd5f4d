"""Launch checks and integer-class representatives shared by the MLA index-metadata ops.

Every check raises :class:`~warmreg.LaunchError` naming the kernel and the offending argument; the messages
are part of the behaviour (tests match them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..values.errors import LaunchError
from ..values.key import IntClass, int_class_rep

__all__ = [
    "HIGH_REPS",
    "LOW_REPS",
    "TILE",
    "check_int32_table",
    "check_int32_vector",
    "int_rep",
    "out_for_buffers",
    "out_parts",
]

#: Rows (metadata kernels) or columns (index kernels) handled per loop iteration, vLLM's
#: ``TRITON_BLOCK_SIZE`` of these kernels.
TILE = 1024
#: Representatives of the integer classes that keep ``0 <= start < stop`` and ``rank < world``.
LOW_REPS = {"div16": 0, "one": 1, "other": 3}
HIGH_REPS = {"one": 1, "other": 17, "div16": 32}


def int_rep(cls: IntClass, table: Mapping[str, int]) -> int:
    """A representative of ``cls`` from ``table``, else warmreg's own."""
    return table.get(cls, int_class_rep(cls))


def check_int32_vector(kernel: str, **tensors: torch.Tensor) -> None:
    """Each tensor is a contiguous 1-D int32 tensor (the metadata kernels index it as ``ptr + i``).

    :raises LaunchError: ``<name> must be a contiguous 1-D int32 tensor (got ...)``.
    """
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise LaunchError(kernel, f"{name} must be a contiguous 1-D int32 tensor (got {t.dtype} {tuple(t.shape)})")


def check_int32_table(kernel: str, name: str, table: torch.Tensor, rows: int) -> None:
    """``table`` is an int32 ``[>= rows, W]`` block table with contiguous rows.

    :raises LaunchError: ``<name> must be int32 [>= rows, W] with contiguous rows (got ...)``.
    """
    if (
        table.ndim != 2
        or table.dtype != torch.int32
        or (table.shape[1] > 1 and table.stride(1) != 1)
        or table.shape[0] < rows
    ):
        raise LaunchError(
            kernel, f"{name} must be int32 [>= {rows}, W] with contiguous rows (got {tuple(table.shape)})"
        )


def out_parts(kernel: str, out: tuple[Any, ...] | None, n: int, name: str = "out") -> tuple[Any, ...]:
    """The ``n`` buffers of an op's tuple ``out=`` (``n`` times ``None`` without one).

    :raises LaunchError: ``<name> must be a tuple of <n> buffers (got ...)``.
    """
    if out is None:
        return (None,) * n
    if not isinstance(out, tuple) or len(out) != n:
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise LaunchError(
            kernel,
            f"{name} must be a tuple of {n} buffers (got {got})",
            fix="pass them in the order the op returns them",
        )
    return out


def out_for_buffers(kernel: str, out: tuple[Any, ...], **buffers: torch.Tensor | None) -> tuple[Any, ...]:
    """An op's persistent-buffer keywords given as one ``out=`` tuple, in the order of ``buffers``.

    :raises LaunchError: if a keyword is given too, or ``out`` is not a tuple of that many.
    """
    given = [name for name, buf in buffers.items() if buf is not None]
    if given:
        raise LaunchError(
            kernel, f"out and {', '.join(given)} are both given", fix="pass out or the per-buffer keywords, not both"
        )
    return out_parts(kernel, out, len(buffers))
