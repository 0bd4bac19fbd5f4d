"""The ``fp8_ds_mla`` paged K cache layout, shared by its reader (:mod:`.cache`) and writer (:mod:`.cache_insert`).

One page of ``bs`` tokens (uint8; vLLM 0.33 ``--kv-cache-dtype fp8_ds_mla``, read by
``models/common/ops/cache_utils.py``: ``DequantizeAndGatherKCacheKernel``)::

    [0, bs*576)              token j at j*576: 448 x e4m3 (NoPE, 7 blocks of 64) | 64 x bf16 (RoPE)
    [bs*576, bs*576 + bs*8)  token j at bs*576 + j*8: 7 UE8M0 scale bytes + 1 pad byte (= 0)
    [bs*584, page stride)    padding; the page stride is ``k_cache.stride(0)``, always read, never derived

A UE8M0 byte ``s`` stands for the scale ``2**(s - 127)``. The e4m3 bytes are OCP e4m3fn (bias 7,
max 448) or, for the SWA cache on gfx942, e4m3fnuz (bias 8, max 240).

The kernels convert FP8 with integer bit operations rather than Triton's fp8 dtypes. The decode puts
the byte's sign, exponent and mantissa in an fp16's bit fields, which is exactly the value times
``2**-8`` (e4m3fn) or ``2**-7`` (e4m3fnuz), subnormals included. The encode rounds the fp32 mantissa to
3 bits (round to nearest even). Both are exact and the same on every backend. They also run under
Triton 3.6's interpreter, which cannot represent ``fp8e4b8`` at all and rounds fp32 -> ``fp8e4nv``
wrongly (ties away from even, and 7.97 -> 4.0). The writer never produces the NaN codes (0x7F/0xFF
of e4m3fn, 0x80 of e4m3fnuz); the decode reads them as +-480 and -0.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kv_cache_layout
from .model import DSV4, PLUGIN, SPARSE_BLOCK_SIZE, SWA_PAGE_SIZE

__all__ = [
    "FP8_MAX",
    "HEAD_DIM",
    "NOPE",
    "NOPE_DIM",
    "NQB",
    "QB",
    "QUANT_BLOCK",
    "ROPE",
    "ROPE_DIM",
    "SCALES",
    "SCALE_BYTES",
    "TOKEN",
    "TOKEN_BYTES",
    "uses_fp8_ds_mla",
    "PagedCache",
    "e4m3_to_f32",
    "f32_to_e4m3",
    "cache_problem",
    "check_model_layout",
    "page_bytes",
    "paged_caches",
    "ue8m0_to_f32",
    "value_in_class",
]

NOPE_DIM, ROPE_DIM, QUANT_BLOCK = 448, 64, 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
TOKEN_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = NOPE_DIM // QUANT_BLOCK + 1  # 7 scales + 1 pad byte
FP8_MAX = {False: 448.0, True: 240.0}  # e4m3fn / e4m3fnuz

NOPE = tl.constexpr(NOPE_DIM)  # quantized bytes per token
QB = tl.constexpr(QUANT_BLOCK)  # elements per UE8M0 scale
NQB = tl.constexpr(NOPE_DIM // QUANT_BLOCK)  # 7 quant blocks (tiles have 8 rows; row 7 is masked)
ROPE = tl.constexpr(ROPE_DIM)  # bf16 elements per token after the quantized part
TOKEN = tl.constexpr(TOKEN_BYTES)  # bytes of token data
SCALES = tl.constexpr(SCALE_BYTES)  # scale bytes per token


@triton.jit
def e4m3_to_f32(byte, USE_FNUZ: tl.constexpr):
    """Exact e4m3fn (or e4m3fnuz) byte -> fp32."""
    b = byte.to(tl.uint16)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
    return half * (128.0 if USE_FNUZ else 256.0)  # fp16 bias 15 vs e4m3 bias 7 (fnuz 8)


@triton.jit
def ue8m0_to_f32(byte):
    """UE8M0 byte -> ``2**(byte - 127)``, built in the fp32 exponent field (byte 0: subnormal 2**-127)."""
    s = byte.to(tl.int32)
    return tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e4m3(x, USE_FNUZ: tl.constexpr):
    """fp32 with ``|x| <= fp8 max`` -> e4m3fn (e4m3fnuz) byte, rounding to nearest even."""
    BIAS: tl.constexpr = 8 if USE_FNUZ else 7
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - BIAS) << 3)  # RNE to 3 mantissa bits
    f = a * (2.0 ** (BIAS + 2))  # subnormals are multiples of 2**-(BIAS + 2): round f to an even integer
    i = f.to(tl.int32)
    frac = f - i.to(tl.float32)
    sub = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    mag = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    neg = (x.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    if USE_FNUZ:
        neg = neg * (mag != 0).to(tl.int32)  # 0x80 is NaN in e4m3fnuz: zero has no sign
    return (mag | (neg << 7)).to(tl.uint8)


def page_bytes(block_size: int) -> int:
    """Page stride of an ``fp8_ds_mla`` cache as allocated: ``block_size * 584`` rounded up to 576.

    Only for realistic domain values; launch code reads ``k_cache.stride(0)``.
    """
    return -(-block_size * (TOKEN_BYTES + SCALE_BYTES) // TOKEN_BYTES) * TOKEN_BYTES


def cache_problem(k_cache: torch.Tensor, block_size: int) -> str | None:
    """What makes ``k_cache`` unusable as ``fp8_ds_mla`` pages of ``block_size`` tokens, or None.

    A cache is uint8 ``[num_pages, ...]``, 16-byte aligned, each page a contiguous run of at least
    ``block_size * 584`` bytes at the page stride ``k_cache.stride(0)``.
    """
    need = block_size * (TOKEN_BYTES + SCALE_BYTES)
    if k_cache.dtype != torch.uint8 or k_cache.ndim < 2 or k_cache.shape[0] < 1 or block_size < 1:
        return f"k_cache must be uint8 [num_pages >= 1, ...] (got {k_cache.dtype} {tuple(k_cache.shape)})"
    if not warmreg.is_aligned(k_cache):
        return "k_cache must be 16-byte aligned (pass the cache tensor, not an offset view)"
    if k_cache.stride(0) < need or k_cache[0].numel() < need or not k_cache[0].is_contiguous():
        return f"a page of {block_size} tokens needs {need} contiguous bytes (page stride {k_cache.stride(0)})"
    return None


def value_in_class(cls: str, at_least: int) -> int:
    """The smallest integer ``>= at_least`` in a Triton integer class (an ``int_class`` name).

    Warmup inputs use it for strides that must be large enough to pass the launcher's checks.
    """
    if cls == "one":
        return 1
    lo = max(at_least, 2**32) if cls.endswith("_i64") else max(at_least, 2)
    if cls.startswith("div16"):
        return -(-lo // 16) * 16
    return lo + 1 if lo % 16 == 0 else lo


@attrs.frozen
class PagedCache:
    """One ``fp8_ds_mla`` cache group of a deployment.

    :param kind: ``"swa"`` (window gathers: gather lens, an offset, FNUZ on gfx942) or ``"c4"`` /
        ``"c128"`` (compressed gathers: the whole compressed sequence at offset 0, always OCP).
    :param block_size: tokens per page (64, 64, 2).
    :param page_strides: page strides the cache can have (its own, and the unified page).
    :param width: block-table row width.
    """

    kind: str
    block_size: int
    page_strides: tuple[int, ...]
    width: int


def paged_caches(model: DSV4, config: warmreg.WarmConfig) -> tuple[PagedCache, ...]:
    """The ``fp8_ds_mla`` cache groups of a deployment, SWA first.

    Tokens per page: SWA 64 (``DeepseekV4SWACache``); compressed ``256 // cr`` (the sparse backends
    support only a 256-token KV block): 64 for C4, 2 for C128. Block-table widths: a page covers 64
    raw tokens (SWA) or ``(256 // cr) * cr = 256`` raw tokens (compressed), so
    ``cdiv(max_model_len, 64)`` and ``cdiv(max_model_len, 256)`` (16384 and 4096 at 1M tokens).
    Page strides: each group's own :func:`page_bytes`, and the largest of them, since the hybrid
    allocator may unify pages across groups.

    :raises warmreg.ConfigError: if ``serving.max_model_len`` is missing.
    """
    max_len = config.get("serving.max_model_len", int, plugin=PLUGIN)
    groups = [("swa", SWA_PAGE_SIZE, -(-max_len // SWA_PAGE_SIZE))]
    groups += [
        (f"c{cr}", SPARSE_BLOCK_SIZE // cr, -(-max_len // SPARSE_BLOCK_SIZE)) for cr in (4, 128) if cr in model.ratios
    ]
    unified = max(page_bytes(bs) for _, bs, _ in groups)
    return tuple(PagedCache(kind, bs, tuple(sorted({page_bytes(bs), unified})), width) for kind, bs, width in groups)


def uses_fp8_ds_mla(config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether the deployment's attention caches on ``platform`` are ``fp8_ds_mla`` pages
    (:func:`warmreg_deepseek_v4.backends.kv_cache_layout` of ``serving.kv_cache_dtype``).

    :raises warmreg.ConfigError: for a ``kv_cache_dtype`` this plugin does not know, or one the backend refuses on
        ``platform``.
    """
    return kv_cache_layout(config, platform) == "fp8_ds_mla"


def check_model_layout(model: DSV4) -> None:
    """Refuse a model whose attention head does not fit the layout (448 NoPE + 64 RoPE).

    :raises warmreg.ConfigError: naming ``model.head_dim``.
    """
    if model.head_dim != HEAD_DIM or model.qk_rope_head_dim != ROPE_DIM:
        raise warmreg.ConfigError(
            "model.head_dim",
            f"must be {HEAD_DIM} with qk_rope_head_dim {ROPE_DIM} for the fp8_ds_mla cache",
            plugin=PLUGIN,
        )
