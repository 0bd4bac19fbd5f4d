"""Bit-exact FP8 and power-of-two scale helpers shared by the DeepSeek-V4 quantizing kernels.

Triton side (``@triton.jit`` helpers, inlined into the kernels):

* :func:`ceil_log2`: ``ceil(log2(y))`` of a positive normal fp32, read from its exponent and mantissa
  bits. ``tl.log2`` is ``lg2.approx`` on CUDA and can return ``k`` for ``y`` just above ``2**k``; the
  bit form is exact on every backend and in the interpreter.
* :func:`exp2i`: ``2**e`` for an int32 ``e`` in ``[-126, 127]``, built from the exponent field.
* :func:`bf16_round`: ``float32(bfloat16(x))`` with round to nearest even, from the bits (Triton 3.6.0's
  interpreter truncates fp32 to bf16, the GPU rounds to nearest even; the bit form is the same on both).
* :func:`fp8_bits`: fp32 to e4m3fn (bias 7, max 448, NaN ``0x7F``) or e4m3fnuz (bias 8, max 240, NaN
  ``0x80``, no negative zero) bytes, round to nearest even, saturating, subnormals included, as uint8.
  It gives the bytes of ``torch.Tensor.to(float8_*)`` (and of the hardware ``cvt`` for in-range values).
  Kernels store these bytes into uint8 storage: Triton 3.6.0's interpreter rounds fp8 subnormals
  wrongly, turns out-of-range values into NaN, and cannot represent ``float8_e4m3fnuz`` at all.

PyTorch side: :func:`ceil_log2_reference` and :func:`pow2_scale_reference` are the references' forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bf16_round", "ceil_log2", "ceil_log2_reference", "exp2i", "fp8_bits", "pow2_scale_reference"]


@triton.jit
def ceil_log2(y):
    """``ceil(log2(y))`` as int32, for positive normal fp32 ``y``."""
    bits = y.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def exp2i(e):
    """``2**e`` as fp32, for int32 ``e`` in ``[-126, 127]``."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def bf16_round(x):
    """``float32(bfloat16(x))``, round to nearest even (NaN kept)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def fp8_bits(x, FNUZ: tl.constexpr):
    """The e4m3fn (``FNUZ`` False) or e4m3fnuz byte of fp32 ``x``: RNE, saturating, as uint8."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    MAX_CODE: tl.constexpr = 0x7F if FNUZ else 0x7E  # 240 / 448
    NAN_CODE: tl.constexpr = 0x80 if FNUZ else 0x7F
    # fp32 2**(21 - BIAS) has an ulp of 2**(-2 - BIAS), the fp8 subnormal step: adding it rounds (RNE).
    MAGIC: tl.constexpr = 8192.0 if FNUZ else 16384.0
    MAGIC_BITS: tl.constexpr = (148 - BIAS) << 23
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits (RNE), then rebias the exponent
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)
    subnormal = (a + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(abits < ((128 - BIAS) << 23), subnormal, normal)
    code = tl.minimum(code, MAX_CODE)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    if FNUZ:  # 0x80 is NaN in fnuz: zero has no sign, NaN has one code
        code = tl.where(x != x, NAN_CODE, tl.where(code == 0, 0, code | sign))
    else:  # signed zeros and signed NaNs, as torch converts them
        code = tl.where(x != x, NAN_CODE, code) | sign
    return code.to(tl.uint8)


def ceil_log2_reference(y: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(y))`` (int32) of positive normal fp32 values, from ``torch.frexp``."""
    mantissa, exponent = torch.frexp(y)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def pow2_scale_reference(amax: torch.Tensor, floor: float, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``e = ceil(log2(max(amax, floor) / fp8_max))`` (fp32 division, correctly rounded) and ``2**e``.

    :returns: ``(e, s)``: the int32 exponent and the fp32 power-of-two scale.
    """
    y = torch.clamp(amax.float(), min=floor) / torch.tensor(fp8_max, dtype=torch.float32)
    e = ceil_log2_reference(y)
    return e, ((e + 127) << 23).view(torch.float32)
