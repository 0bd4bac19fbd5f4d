"""Scaled add: ``out = x + alpha * y`` over ``[T, hidden]`` activations, e.g. a scaled residual.

Math, elementwise, in fp32 with one cast at the store::

    out[i] = cast(float32(x[i]) + alpha * float32(y[i]), dtype of x)

Grid ``(cdiv(T * hidden, BLOCK_SIZE),)``: one program per ``BLOCK_SIZE`` elements of the flattened
inputs. ``y`` may be a view into a wider fused projection (rows of ``hidden`` contiguous columns), so
its row stride and 16-byte alignment are part of the compile key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
import warmreg

__all__ = ["BLOCK_SIZE", "ScaledAdd", "ScaledAddKey", "scaled_add_reference"]

#: Elements per program: a power of two large enough to keep loads wide, small enough for any hidden size.
BLOCK_SIZE = 1024


# n_elements changes every step (T * hidden): do_not_specialize keeps one binary for every batch.
# Without it Triton 3.6 would compile a variant per class of the value (1, multiple of 16, other),
# and would turn n_elements == 1 into a constant.
@triton.jit(do_not_specialize=["n_elements"])
def _scaled_add_kernel(
    x_ptr,
    y_ptr,
    out_ptr,
    n_elements,
    y_row_stride,
    alpha,
    HIDDEN: tl.constexpr,  # row length: a model constant, so // and % by it become multiplies and shifts
    BLOCK_SIZE: tl.constexpr,  # elements per program: a power of two
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # T * hidden can pass 2**31
    mask = offs < n_elements
    row, col = offs // HIDDEN, offs % HIDDEN
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * y_row_stride + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + alpha * y).to(out_ptr.dtype.element_ty), mask=mask)


@attrs.frozen(kw_only=True)
class ScaledAddKey(warmreg.CompileKey):
    """What changes the binary of the scaled add (and nothing else)."""

    dtype: str  # x and out
    y_dtype: str
    hidden: int  # HIDDEN (constexpr)
    block_size: int  # BLOCK_SIZE (constexpr)
    y_row_stride: str  # warmreg.int_class of y.stride(0): specialized, a model constant
    x_aligned: bool  # x may be an offset view (a slice of a larger buffer)
    y_aligned: bool  # y may be a column slice of a fused projection
    num_warps: int  # a launch option: passed to Triton from the key, never in the kwargs



class ScaledAdd(warmreg.TritonKernel[ScaledAddKey]):
    """``out = x + alpha * y``, configured with one deployment's hidden size and dtype.

    The configuration only shapes :meth:`domains`: :meth:`dispatch` reads the tensors alone, so any
    instance can warm any key (warmreg merges registrations that share a ``name``).

    :param hidden: row length of x and y.
    :param dtype: activation dtype name.
    :param y_width: row length of the projection ``y`` is a view of (``hidden`` when y is its own tensor).
    :param y_offset: column where ``y`` starts in that projection.
    :param plugin: the registering plugin, named in config errors.
    """

    name = "warmreg_template.scaled_add"
    key_type = ScaledAddKey
    jit = _scaled_add_kernel

    def __init__(
        self,
        *,
        hidden: int,
        dtype: str = "bfloat16",
        y_width: int | None = None,
        y_offset: int = 0,
        plugin: str = "warmreg-template",
    ) -> None:
        self.hidden = hidden
        self.dtype = getattr(torch, dtype)
        self.y_width = hidden if y_width is None else y_width
        self.y_offset = y_offset
        self.plugin = plugin

    def dispatch(self, *, x: torch.Tensor, y: torch.Tensor) -> ScaledAddKey:
        return ScaledAddKey(
            dtype=warmreg.dtype_name(x.dtype),
            y_dtype=warmreg.dtype_name(y.dtype),
            hidden=x.shape[-1],
            block_size=BLOCK_SIZE,
            y_row_stride=warmreg.int_class(y.stride(0)),
            x_aligned=warmreg.is_aligned(x),
            y_aligned=warmreg.is_aligned(y),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = warmreg.token_counts(config, plugin=self.plugin)  # 0..max_num_batched_tokens, one per int class
        return {
            "x": [warmreg.meta((t, self.hidden), self.dtype) for t in tokens],
            "y": [
                warmreg.meta((t, self.hidden), self.dtype, stride=(self.y_width, 1), offset=self.y_offset)
                for t in tokens
            ],
        }

    def when(self, *, x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.shape == y.shape  # one step: x and y have the same token count

    def warmup_inputs(self, key: ScaledAddKey) -> Mapping[str, Any]:
        rows = 2  # two rows, so that y's row stride is really used
        y_stride = warmreg.int_class_rep(key.y_row_stride)  # type: ignore[arg-type]
        return {
            "x": warmreg.meta((rows, key.hidden), getattr(torch, key.dtype), offset=0 if key.x_aligned else 1),
            "y": warmreg.meta(
                (rows, key.hidden), getattr(torch, key.y_dtype), stride=(y_stride, 1), offset=0 if key.y_aligned else 1
            ),
            "alpha": 1.0,
        }

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, y: torch.Tensor, alpha: float) -> warmreg.LaunchSpec[ScaledAddKey]:
        """Return a fresh ``x + alpha * y``.

        :param x: ``[T, hidden]``, contiguous.
        :param y: ``[T, hidden]``, last dim contiguous (a view of a wider projection is fine).
        :param alpha: the scale of ``y``.
        :raises LaunchError: for mismatched shapes, a non-contiguous ``x``, or a ``y`` whose rows are not contiguous.
        """
        if x.ndim != 2 or y.shape != x.shape:
            raise warmreg.LaunchError(self.name, f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [T, hidden]")
        if not x.is_contiguous() or y.stride(-1) != 1:
            raise warmreg.LaunchError(
                self.name, "x must be contiguous and y's rows contiguous", fix="pass .contiguous()"
            )
        if x.device != y.device:
            raise warmreg.LaunchError(self.name, f"x and y are on {x.device} and {y.device}")
        key = self.dispatch(x=x, y=y)
        out = x.new_empty(x.shape)  # not empty_like: on warm's meta tensors it imports sympy
        n = x.numel()
        kwargs = dict(
            x_ptr=x, y_ptr=y, out_ptr=out, n_elements=n, y_row_stride=y.stride(0), alpha=float(alpha),
            HIDDEN=key.hidden, BLOCK_SIZE=key.block_size,
        )  # fmt: skip
        grid = ((n + key.block_size - 1) // key.block_size,) if n else None  # None: empty batch, no launch
        return warmreg.LaunchSpec(key, grid, kwargs, out)


def scaled_add_reference(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """PyTorch reference: the sum in fp32, one cast to x's dtype."""
    return (x.float() + alpha * y.float()).to(x.dtype)
