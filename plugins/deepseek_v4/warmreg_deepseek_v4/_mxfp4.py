"""MXFP4 (OCP microscaling FP4) quantization shared by the DeepSeek-V4 indexer's MXFP4 kernels: blocks of 32
values, each an E2M1 nibble, with one UE8M0 scale byte per block.

Per block of 32 fp32 values ``x`` (vLLM 0.33 ``models/deepseek_v4/common/ops/fused_indexer_q.py``:
``_quantize_mxfp4_pair``, and the compressor's ``_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn``)::

    amax = max(max|x|, 6 * 2**-126)
    k = clamp(ceil(log2(amax * float32(1/6))), -127, 127);   scale byte = k + 127
    nibble(v) = E2M1 of v * 2**-k, round to nearest even, saturating at +-6
    byte j of the block = nibble(x[2j]) | nibble(x[2j + 1]) << 4        (low nibble: the even element)

E2M1 is sign bit 3 and codes 0..7 for magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. vLLM converts with the PTX
instruction ``cvt.rn.satfinite.e2m1x2.f32`` (inline asm), which Triton's interpreter cannot run and which exists
only on CUDA. :func:`e2m1_code` computes the same nibble with comparisons against the exact midpoints of the grid
(each tie goes to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, above
5 -> 6), so one kernel runs bit-identically in the interpreter and on every GPU backend. The sign bit is the
fp32 sign bit, so a negative value that rounds to zero gives ``0x8`` (as IEEE rounding keeps the sign of zero).
NaN, which the indexer never produces from finite activations, gives a zero nibble here.

``ceil(log2(.))`` is exact (:func:`._quant.ceil_log2`, from the bits; vLLM's ``tl.log2`` may be an approximation
at exact powers of two). ``amax * float32(1/6)`` rounds to exactly ``2**k`` when ``amax == 6 * 2**k``, so such a
block keeps ``k`` and its largest value encodes as 6; one ulp above, ``k`` grows by one. ``k`` reaches 127 only
for an infinite amax; ``2**-127`` is subnormal, so the kernels scale by ``2**-(k >> 1)`` then
``2**((k >> 1) - k)``, two exact normal powers of two: an infinity stays infinite (nibble 6) and finite values
of that block round to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._quant import ceil_log2, exp2i

__all__ = ["MXFP4_BLOCK", "e2m1_code", "e2m1_reference", "mxfp4_quant", "mxfp4_quant_reference", "mxfp4_row_bytes"]

MXFP4_BLOCK = 32  # values per UE8M0 scale (vLLM's MXFP4_BLOCK_SIZE)
#: The E2M1 magnitudes, by code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_row_bytes(head_dim: int) -> int:
    """Bytes of one MXFP4 vector of ``head_dim`` values: ``head_dim / 2`` packed nibbles + one scale per 32."""
    return head_dim // 2 + head_dim // MXFP4_BLOCK


@triton.jit
def e2m1_code(v):
    """The E2M1 nibble (int32, 0..15) of fp32 ``v``: RNE onto the grid, saturating, sign in bit 3."""
    a = tl.abs(v)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def mxfp4_quant(lo, hi):
    """Quantize blocks given as their even (``lo``) and odd (``hi``) elements, fp32 ``[N, 16]`` each.

    :returns: ``(packed, scale)``: uint8 ``[N, 16]`` (``nibble(lo) | nibble(hi) << 4``) and uint8 ``[N]``
        UE8M0 bytes ``k + 127``.
    """
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    amax = tl.maximum(amax, 6.0 * 2.0**-126)
    k = tl.minimum(tl.maximum(ceil_log2(amax * (1.0 / 6.0)), -127), 127)
    half = k >> 1  # arithmetic shift: floor on the GPU and in the interpreter alike
    inv_a = exp2i(-half)[:, None]
    inv_b = exp2i(half - k)[:, None]
    packed = e2m1_code(lo * inv_a * inv_b) | (e2m1_code(hi * inv_a * inv_b) << 4)
    return packed.to(tl.uint8), (k + 127).to(tl.uint8)


def e2m1_reference(v: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (uint8) of ``v`` by nearest grid point in float64, ties to the even code, sign bit 3."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64, device=v.device)
    dist = (v.double().abs().clamp(max=6.0)[..., None] - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    even_first = nearest.int() * (2 - torch.arange(len(E2M1_GRID), device=v.device) % 2)  # a tie: the even code
    code = even_first.argmax(dim=-1)
    return (code | torch.signbit(v).long() << 3).to(torch.uint8)


def mxfp4_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of float32 ``x [..., D]`` (``D`` a multiple of 32) in PyTorch (the module docstring's math).

    ``ceil(log2)`` is taken in float64 and the scaling done in float64 (exact): an independent route to the
    kernels' bit forms.

    :returns: ``(packed uint8 [..., D / 2], scale uint8 [..., D / 32])``.
    """
    blocks = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp(min=6 * 2.0**-126)
    ratio = amax * torch.tensor(1 / 6, dtype=torch.float32)
    k = torch.log2(ratio.double()).ceil().clamp(-127, 127)
    codes = e2m1_reference(blocks.double() * torch.exp2(-k)[..., None])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.flatten(-2), (k + 127).to(torch.uint8)

