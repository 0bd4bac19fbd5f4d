"""An op equals its reference: ``assert_close`` with tolerances per dtype, exact for integer, index and FP8 outputs.

Outputs may be one tensor or tuples (nested) of tensors and ``None``; they are compared leaf by leaf. Float outputs
use the tolerance given, else :data:`TOLERANCES` of their dtype; integer and bool outputs (indices, lengths, codes)
are compared exactly, and FP8 outputs as their byte codes, exactly (a float comparison of FP8 values would
accept a code that rounds the other way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["EXACT", "FP8_DTYPES", "TOLERANCES", "Tolerance", "assert_matches", "leaves", "tolerance"]

#: ``{"rtol": ..., "atol": ...}``, as :func:`torch.testing.assert_close` takes them.
Tolerance = Mapping[str, float]
#: No difference at all.
EXACT: Tolerance = {"rtol": 0.0, "atol": 0.0}
#: The FP8 dtypes of this torch build: compared as byte codes.
FP8_DTYPES = frozenset(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz") if hasattr(torch, name)
)
#: Default tolerances of float outputs, for an op that computes in fp32 and casts once at the store, as its
#: reference does: one rounding step of the output dtype apart (``rtol`` about two units in the last place,
#: ``atol`` the same near zero); fp32 allows for another summation order. Ops that differ more (a reduction
#: in lower precision, an approximated exp) pass their own, with a comment on why.
TOLERANCES: Mapping[torch.dtype, Tolerance] = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The default tolerance of an output of ``dtype``: :data:`EXACT` unless it is a float dtype of :data:`TOLERANCES`.

    :raises KeyError: for a float dtype without a default (pass a tolerance for it).
    """
    if not dtype.is_floating_point or dtype in FP8_DTYPES:
        return EXACT
    return TOLERANCES[dtype]


def leaves(x: Any) -> list[Any]:
    """The tensors (and ``None``) of a nested tuple or list, depth first: the outputs in the order an op names them
    (``out[0][1]`` before ``out[1]``)."""
    return [leaf for item in x for leaf in leaves(item)] if isinstance(x, (tuple, list)) else [x]


def assert_matches(
    got: Any,
    want: Any,
    tol: Tolerance | None = None,
    *,
    masks: Sequence[torch.Tensor | None] = (),
    msg: str = "",
) -> None:
    """Assert that an op's outputs equal the reference's, leaf by leaf.

    :param got: the op's outputs: a tensor, ``None``, or tuples of them.
    :param want: the reference's, nested the same way.
    :param tol: the tolerance of float leaves (default: :func:`tolerance` of each leaf's dtype); integer, bool
        and FP8 leaves are always exact.
    :param masks: per leaf, where it is compared (``None`` or missing: everywhere), for outputs an op writes
        only in part (a triangle of a block).
    :param msg: prefixed to the failure message (the case).
    :raises AssertionError: naming the leaf (``[1]``) and what differs.
    """
    got_leaves, want_leaves = leaves(got), leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise AssertionError(f"{msg}{len(got_leaves)} outputs, the reference has {len(want_leaves)}")
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        where = f"{msg}output [{i}]" if len(got_leaves) > 1 else f"{msg}output"
        if g is None or w is None:
            if g is not w:
                raise AssertionError(f"{where} is {_show(g)}, the reference's {_show(w)}")
            continue
        exact = not g.dtype.is_floating_point or g.dtype in FP8_DTYPES
        limits = EXACT if exact else tolerance(g.dtype) if tol is None else tol
        if g.dtype in FP8_DTYPES and w.dtype == g.dtype:
            g, w = g.view(torch.uint8), w.view(torch.uint8)  # the codes, exactly
        mask = masks[i] if i < len(masks) else None
        if mask is not None:
            g, w = torch.where(mask, g, torch.zeros((), dtype=g.dtype)), torch.where(mask, w, torch.zeros((), dtype=w.dtype))
        rtol, atol = limits["rtol"], limits["atol"]
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, where=where: f"{where}: {m}")  # type: ignore[misc]


def _show(x: Any) -> str:
    return "None" if x is None else f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}"
