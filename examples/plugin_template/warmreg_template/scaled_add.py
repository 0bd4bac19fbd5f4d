"""Scaled add: ``out = x + alpha * y`` over ``[T, hidden]`` activations, e.g. a scaled residual.

Math, elementwise, in fp32 with one cast at the store::

    out[i] = cast(float32(x[i]) + alpha * float32(y[i]), dtype of x)

Grid ``(cdiv(T * hidden, BLOCK_SIZE),)``: one program per ``BLOCK_SIZE`` elements of the flattened
inputs. ``y`` may be a view into a wider fused projection (rows of ``hidden`` contiguous columns), so
its row stride and 16-byte alignment are part of the compile key.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl
import warmreg
from torch import Tensor

__all__ = ["PLUGIN", "ScaledAdd", "ScaledAddKey", "scaled_add_reference"]

PLUGIN = "warmreg-template"  # the distribution, named in config errors


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
    block_size: int  # BLOCK_SIZE (constexpr): 1024 keeps loads wide and suits any hidden size
    y_row_stride: str  # warmreg.int_class of y.stride(0): specialized, a model constant
    x_aligned: bool  # x may be an offset view (a slice of a larger buffer)
    y_aligned: bool  # y may be a column slice of a fused projection
    num_warps: int  # a launch option: passed to Triton from the key, never in the kwargs


class ScaledAdd(warmreg.TritonKernel[ScaledAddKey]):
    """``out = x + alpha * y``. Its key type comes from the base class, its name is ``module.QualName``, and
    warm launches each key on the domain point that produced it (the default ``warmup_inputs``)."""

    jit = _scaled_add_kernel

    def dispatch(self, *, x: Tensor, y: Tensor) -> ScaledAddKey:
        return ScaledAddKey(
            dtype=warmreg.dtype_name(x.dtype), y_dtype=warmreg.dtype_name(y.dtype), hidden=x.shape[-1], block_size=1024,
            y_row_stride=warmreg.int_class(y.stride(0)), x_aligned=warmreg.is_aligned(x), y_aligned=warmreg.is_aligned(y),
            num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, object]]:
        """One point per token count (``0..max_num_batched_tokens``, one per int class): ``x`` its own tensor, ``y``
        the second half of a fused ``[T, 2 * hidden]`` projection, ``alpha`` any float (it never reaches the key)."""
        hidden = config.get("text.hidden_size", int, plugin=PLUGIN, check=lambda h: None if h > 0 else "must be > 0")
        dtype = getattr(torch, config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16"))
        projections = [warmreg.meta((t, 2 * hidden), dtype) for t in warmreg.token_counts(config, plugin=PLUGIN)]
        return [{"x": warmreg.meta((len(p), hidden), dtype), "y": p[:, hidden:], "alpha": 0.5} for p in projections]

    @warmreg.kernel_launcher
    def __call__(self, x: Tensor, y: Tensor, alpha: float, *, out: Tensor | None = None) -> warmreg.LaunchSpec[ScaledAddKey]:  # fmt: skip
        """``x + alpha * y`` into ``out`` (checked by :func:`warmreg.output`), else into a fresh tensor.

        :param x: ``[T, hidden]``, contiguous.
        :param y: ``[T, hidden]`` on x's device, its rows contiguous (a view of a wider projection is fine).
        :raises LaunchError: for other shapes or devices, a non-contiguous ``x`` or rows of ``y``, or a wrong ``out``.
        """
        if x.ndim != 2 or y.shape != x.shape or y.device != x.device or not x.is_contiguous() or y.stride(-1) != 1:
            problem = f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [T, hidden] on one device, x contiguous"
            raise warmreg.LaunchError(self.name, problem + " and y's rows contiguous", fix="pass .contiguous()")
        key, n = self.dispatch(x=x, y=y), x.numel()
        out = warmreg.output(self.name, "out", out, tuple(x.shape), x.dtype, x.device)
        kwargs = dict(x_ptr=x, y_ptr=y, out_ptr=out, n_elements=n, y_row_stride=y.stride(0), alpha=float(alpha),
                      HIDDEN=key.hidden, BLOCK_SIZE=key.block_size)  # fmt: skip
        grid = ((n + key.block_size - 1) // key.block_size,) if n else None  # None: empty batch, no launch
        return warmreg.LaunchSpec(key, grid, kwargs, out)


def scaled_add_reference(x: Tensor, y: Tensor, alpha: float) -> Tensor:
    """PyTorch reference: the sum in fp32, one cast to x's dtype."""
    return (x.float() + alpha * y.float()).to(x.dtype)
