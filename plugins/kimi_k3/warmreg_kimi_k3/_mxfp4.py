"""MXFP4 (OCP microscaling FP4) as the Kimi-K3.1 DSA indexer writes it on an MXFP4 key cache (vLLM 0.34
``models/kimi_k3/nvidia/ops/dsa_indexer_mxfp4.py``: ``_mxfp4_quant``, ``_fp32x2_to_fp4x2``), shared by the
MXFP4 key insert, the fused MXFP4 prologue and the MXFP4 query quant.

Per block of 32 fp32 values ``x`` (the even elements ``x[2j]`` and the odd ones ``x[2j + 1]``), in fp32::

    k = clamp(ceil(log2(max(max|x|, 6 * 2**-126) / 6)), -127, 127)          # the UE8M0 scale byte is k + 127
    nibble(v) = E2M1 of v * (1 / 2**k): round to nearest even, saturating at +-6, sign in bit 3
    byte j of the block = nibble(x[2j]) | nibble(x[2j + 1]) << 4              # the even element in the low nibble

E2M1 codes 0..7 are the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. vLLM converts with the PTX instruction
``cvt.rn.satfinite.e2m1x2.f32`` (inline assembly: SM10x only, and not runnable by Triton's interpreter);
:func:`e2m1` gives the same nibble with comparisons against the midpoints of the grid (a tie goes to the even
code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; above 5 -> 6), and the sign from
the fp32 sign bit, so one kernel runs in the interpreter and on every GPU. The scale is vLLM's own sequence of
fp32 operations (``/``, ``log2``, ``ceil``, ``exp2``, a reciprocal), so the same instructions compute it on the
GPU (``lg2.approx``: a value a few ulps above ``6 * 2**k`` may keep ``k`` and then saturate to 6, in both).

Cache layout (DeepSeek-V4's MXFP4 indexer cache, what DeepGEMM's ``fp8_fp4_*mqa_logits`` read): a block of
``B`` tokens is ``[B x D/2 packed E2M1 | B x D/32 UE8M0]``, :func:`entry_bytes` (68 for ``D = 128``) a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "E2M1_GRID",
    "MXFP4_BLOCK",
    "e2m1",
    "e2m1_reference",
    "entry_bytes",
    "fill_row",
    "layer_norm_mxfp4_insert",
    "mxfp4_reference",
    "mxfp4_row",
    "round_to",
]

MXFP4_BLOCK = 32  # values per UE8M0 scale (vLLM's MXFP4_BLOCK_SIZE)
#: The E2M1 magnitudes, by code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def entry_bytes(head_dim: int) -> int:
    """Bytes a token of the MXFP4 indexer cache takes: ``D / 2`` packed values and ``D / 32`` scale bytes
    (vLLM's ``indexer_cache_entry_bytes(head_dim, True)``)."""
    return head_dim // 2 + head_dim // MXFP4_BLOCK


@triton.jit
def e2m1(v):
    """The E2M1 nibble (int32, 0..15) of fp32 ``v``: round to nearest even, saturating, sign in bit 3."""
    a = tl.abs(v)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def mxfp4_row(x, N: tl.constexpr):
    """MXFP4 of one fp32 row ``x [N]`` (``N`` a multiple of 32; blocks never straddle a row boundary of the
    caller's heads). Returns ``(packed uint8 [N / 2], ue8m0 uint8 [N / 32])``."""
    NUM_BLOCKS: tl.constexpr = N // 32
    even, odd = tl.split(tl.reshape(x, (NUM_BLOCKS, 16, 2)))
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    k = tl.math.ceil(tl.math.log2(tl.maximum(amax, 6.0 * (2.0**-126)) / 6.0))
    k = tl.minimum(tl.maximum(k, -127.0), 127.0)
    inv = (1.0 / tl.math.exp2(k))[:, None]
    packed = e2m1(even * inv) | (e2m1(odd * inv) << 4)
    return tl.reshape(packed.to(tl.uint8), (N // 2,)), (k + 127.0).to(tl.uint8)


@triton.jit
def round_to(y, DTYPE: tl.constexpr):
    """``float32(DTYPE(y))``: fp32 ``y`` rounded to nearest even in ``DTYPE``. bfloat16 from the bits (Triton's
    interpreter truncates fp32 to bf16; a GPU's ``cvt.rn`` rounds to nearest even, as this does; NaN kept);
    other dtypes by a cast (the interpreter's numpy casts round to nearest even too)."""
    if DTYPE == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(y != y, y, rounded)
    else:
        return y.to(DTYPE).to(tl.float32)


@triton.jit
def fill_row(row_ptr, TOPK: tl.constexpr, TOPK_BLOCK: tl.constexpr):
    """``row[:TOPK] = -1``, ``TOPK_BLOCK`` entries at a time (the top-k row of a token nothing selected yet)."""
    for i in range(0, TOPK, TOPK_BLOCK):
        offs = i + tl.arange(0, TOPK_BLOCK)
        tl.store(row_ptr + offs, -1, mask=offs < TOPK)


@triton.jit
def layer_norm_mxfp4_insert(
    tok,
    k_row_ptr,
    w_ptr,
    b_ptr,
    eps,
    slot_ptr,
    num_slots,
    cache_ptr,
    block_size,
    block_stride,
    D: tl.constexpr,
):
    """LayerNorm of key row ``tok`` (fp32, rounded to the key's dtype), then its MXFP4 bytes into the cache slot
    ``slot_ptr[tok]``; nothing for ``tok >= num_slots`` or a negative slot (padding, another DCP rank's token).

    ``y = round_to((x - mean) * rsqrt(var + eps) * w + b)``, in vLLM's order of operations (its
    ``_index_k_insert``, ``_mxfp4_k_insert``): the population variance over ``D``, the weight and bias in fp32."""
    slot = tl.load(slot_ptr + tok, mask=tok < num_slots, other=-1)
    if slot >= 0:
        offs = tl.arange(0, D)
        x = tl.load(k_row_ptr + offs).to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        diff = x - mean
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / D + eps)
        w = tl.load(w_ptr + offs).to(tl.float32)
        b = tl.load(b_ptr + offs).to(tl.float32)
        y = round_to(diff * rstd * w + b, k_row_ptr.dtype.element_ty)
        packed, scales = mxfp4_row(y, D)
        block = (slot // block_size) * block_stride
        pos = slot % block_size
        tl.store(cache_ptr + block + pos * (D // 2) + tl.arange(0, D // 2), packed)
        scale_at = block + block_size * (D // 2) + pos * (D // 32)
        tl.store(cache_ptr + scale_at + tl.arange(0, D // 32), scales)


def e2m1_reference(v: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (uint8) of ``v``: the nearest grid magnitude in float64, a tie to the even code, sign bit 3."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64, device=v.device)
    dist = (v.double().abs().clamp(max=6.0)[..., None] - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    prefer_even = nearest.int() * (2 - torch.arange(len(E2M1_GRID), device=v.device) % 2)
    code = prefer_even.argmax(dim=-1)
    return (code | torch.signbit(v).long() << 3).to(torch.uint8)


def mxfp4_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``x [..., D]`` (``D`` a multiple of 32) in PyTorch, the module docstring's math: the scale in
    fp32 as the kernel takes it (torch's ``log2``), the nibbles by nearest grid point in float64.

    :returns: ``(packed uint8 [..., D / 2], ue8m0 uint8 [..., D / 32])``.
    """
    blocks = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp(min=6 * 2.0**-126)
    k = torch.log2(amax / torch.tensor(6.0)).ceil().clamp(-127, 127)
    codes = e2m1_reference(blocks.double() * torch.exp2(-k.double())[..., None])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.flatten(-2), (k + 127).to(torch.uint8)
