"""Fused KV compress + RMSNorm + RoPE + quant + insert for the C4 indexer (head 128; vLLM 0.33
``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``: ``FusedKVCompressNormRopeInsertIndexerTritonKernel``,
whose ``use_fp4_cache`` picks ``_fused_kv_compress_norm_rope_insert_indexer_attn`` (FP8) or
``_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn`` (MXFP4); here the key's ``use_fp4_cache`` picks one of
two ``@triton.jit`` functions that share the compress + norm + RoPE part).

``rope(x, p)`` below is GPT-J interleaved RoPE on the last ``R = cos_sin_cache.shape[1]`` dims: pairs
``(e, o) = (x[2i], x[2i+1])`` of that part, ``c, s = cos_sin_cache[p, i], cos_sin_cache[p, R/2 + i]``,
``e' = e*c - o*s``, ``o' = o*c + e*s``. FP8 scales are exact powers of two,
``s = 2**ceil(log2(max(amax, 1e-4) / FP8_MAX))`` (``ceil(log2)`` from the exponent bits), and FP8
bytes come from a bit-exact encoder (see :mod:`._quant`); MXFP4 is :mod:`._mxfp4`'s.

Grid ``(S,)`` with ``S = slot_mapping.shape[0]`` (under DP padding fewer than the tokens); a token writes
only if ``slot_mapping[t] >= 0``, ``(pos + 1) % cr == 0`` and ``compressed_slot_mapping[t] >= 0``. With
window ``L = 2*cr`` (overlap) ending at ``pos``, state rows read through the state block table, the older
``cr`` positions from the first half of each state (kv ``[0, hd)``, score ``[SW, SW+hd)``), the newer ones
from the second::

    c = sum_i softmax_i(score_i) * kv_i             (per column; positions < 0 excluded)
    n = c * rsqrt(mean(c**2) + eps) * w
    x = float32(bf16(rope(n, (pos // cr) * cr)))     (every dim through bf16, the NoPE part too)
    page, j = divmod(compressed_slot_mapping[t], kv_block_size)
    FP8:   s = pow2 scale of amax(|x|) with 448
           kv_cache page bytes [j*hd, (j+1)*hd) = e4m3fn(clamp(x / s, +-448))
           kv_cache page bytes [kv_block_size*hd + 4j, +4) = float32 s, or (MX_SCALE) the UE8M0 byte x4 as int32
    MXFP4: packed, scales = MXFP4 of x (hd/32 blocks of 32)
           kv_cache page bytes [j*hd/2, (j+1)*hd/2) = packed;  [kv_block_size*hd/2 + j*hd/32, +hd/32) = scales

FP8 K is always OCP e4m3fn (max 448), even on gfx942. The MXFP4 variant runs on CUDA only (vLLM's uses PTX;
ROCm writes its MXFP4 cache through aiter, after :mod:`.compress_pool`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_rope_cache, is_pow2, unspecialized_int32_problem
from ._indexer_common import K_FP8_MAX, SCALE_BYTES, SCALE_FLOOR, cos_sin_meta, rope_pairs
from ._mxfp4 import MXFP4_BLOCK, mxfp4_quant, mxfp4_quant_reference, mxfp4_row_bytes
from ._quant import bf16_round, ceil_log2, exp2i, fp8_bits, pow2_scale_reference
from ._serving import mxfp4_indexer
from .backends import compressed_block_size, kv_cache_layout
from .model import DSV4

__all__ = [
    "IndexerKVCompressInsert",
    "IndexerKVInsertKey",
    "indexer_kv_compress_insert_reference",
    "indexer_page_stride",
    "register",
    "token_bytes",
]


@triton.jit
def _compress_norm_rope(
    state_ptr, block_table_ptr, token_to_req_ptr, norm_weight_ptr, cos_sin_ptr, t, pos, state_stride0, state_stride1,
    block_table_stride, cos_sin_stride, eps, state_block_size, HEAD_SIZE: tl.constexpr, STATE_WIDTH: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr, OVERLAP: tl.constexpr, HALF_ROT: tl.constexpr,
):  # fmt: skip
    """The closing window of token ``t`` softmax-pooled, RMS-normed and RoPE'd: its even and odd dims (fp32)."""
    WINDOW: tl.constexpr = 2 * COMPRESS_RATIO if OVERLAP else COMPRESS_RATIO
    i = tl.arange(0, WINDOW)
    p = pos - WINDOW + 1 + i
    valid = p >= 0
    req = tl.load(token_to_req_ptr + t).to(tl.int64)
    page = tl.load(block_table_ptr + req * block_table_stride + p // state_block_size, mask=valid, other=0)
    rows = state_ptr + page.to(tl.int64) * state_stride0 + (p % state_block_size) * state_stride1
    if OVERLAP:  # older window: first half of its state; current window: second half
        rows += tl.where(i >= COMPRESS_RATIO, HEAD_SIZE, 0)
    d = tl.arange(0, HEAD_SIZE)
    ptrs = rows[:, None] + d[None, :]
    score = tl.load(ptrs + STATE_WIDTH, mask=valid[:, None], other=float("-inf"))
    kv = tl.load(ptrs, mask=valid[:, None], other=0.0)
    prob = tl.exp(score - tl.max(score, axis=0)[None, :])
    prob = prob / tl.sum(prob, axis=0)[None, :]
    c = tl.sum(prob * kv, axis=0)
    n = c * tl.rsqrt(tl.sum(c * c, axis=0) / HEAD_SIZE + eps) * tl.load(norm_weight_ptr + d).to(tl.float32)
    # RoPE on the last 2 * HALF_ROT dims at the compressed position, as pairs (2k, 2k+1)
    even, odd = tl.split(tl.reshape(n, (HEAD_SIZE // 2, 2)))
    k = tl.arange(0, HEAD_SIZE // 2) - (HEAD_SIZE // 2 - HALF_ROT)
    is_rot = k >= 0
    cs = cos_sin_ptr + (pos // COMPRESS_RATIO * COMPRESS_RATIO) * cos_sin_stride + k
    cos = tl.load(cs, mask=is_rot, other=1.0)
    sin = tl.load(cs + HALF_ROT, mask=is_rot, other=0.0)
    return tl.where(is_rot, even * cos - odd * sin, even), tl.where(is_rot, odd * cos + even * sin, odd)


_DO_NOT_SPECIALIZE = ["state_stride0", "state_stride1", "block_table_stride", "cos_sin_stride", "eps"]
_UNALIGNED = [
    "state_ptr",  # rows sit at runtime strides: never vectorized, so alignment buys nothing
    "block_table_ptr",
    "token_to_req_ptr",
    "positions_ptr",
    "slot_mapping_ptr",
    "compressed_slot_mapping_ptr",
    "cos_sin_ptr",
]


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=_UNALIGNED)
def _indexer_kv_compress_insert_kernel(
    state_ptr,
    block_table_ptr,
    token_to_req_ptr,
    positions_ptr,
    slot_mapping_ptr,
    compressed_slot_mapping_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    kv_cache_ptr,
    state_stride0,
    state_stride1,
    block_table_stride,
    cos_sin_stride,
    eps,
    state_block_size,
    kv_block_size,
    HEAD_SIZE: tl.constexpr,  # indexer head_dim (128): one fp8 quant block per compressed token
    STATE_WIDTH: tl.constexpr,  # state_cache.shape[-1] // 2: kv state columns, then score + APE
    COMPRESS_RATIO: tl.constexpr,  # 4: a state closes every COMPRESS_RATIO positions
    OVERLAP: tl.constexpr,  # the window spans 2 * COMPRESS_RATIO positions over two state halves
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32)
    KV_BLOCK_STRIDE: tl.constexpr,  # kv_cache.stride(0): bytes per indexer cache page
    MX_SCALE: tl.constexpr,  # store the scale as UE8M0 x4 in an int32 (CUDA sm100 family) not fp32
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    kv_slot = tl.load(compressed_slot_mapping_ptr + t).to(tl.int64)
    if (tl.load(slot_mapping_ptr + t) >= 0) & ((pos + 1) % COMPRESS_RATIO == 0) & (kv_slot >= 0):
        even_r, odd_r = _compress_norm_rope(
            state_ptr, block_table_ptr, token_to_req_ptr, norm_weight_ptr, cos_sin_ptr, t, pos, state_stride0,
            state_stride1, block_table_stride, cos_sin_stride, eps, state_block_size, HEAD_SIZE, STATE_WIDTH,
            COMPRESS_RATIO, OVERLAP, HALF_ROT,
        )  # fmt: skip
        x = bf16_round(tl.reshape(tl.join(even_r, odd_r), (HEAD_SIZE,)))
        e = ceil_log2(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4), 448.0))
        q = fp8_bits(tl.clamp(x * exp2i(-e), -448.0, 448.0), False)  # K is OCP e4m3fn on every platform
        base = kv_cache_ptr + (kv_slot // kv_block_size) * KV_BLOCK_STRIDE
        j = kv_slot % kv_block_size
        tl.store(base + j * HEAD_SIZE + tl.arange(0, HEAD_SIZE), q)
        scale_ptr = base + kv_block_size * HEAD_SIZE + j * 4
        if MX_SCALE:
            b = e + 127
            tl.store(scale_ptr.to(tl.pointer_type(tl.int32)), b | (b << 8) | (b << 16) | (b << 24))
        else:
            tl.store(scale_ptr.to(tl.pointer_type(tl.float32)), exp2i(e))


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=_UNALIGNED)
def _indexer_kv_compress_insert_mxfp4_kernel(
    state_ptr,
    block_table_ptr,
    token_to_req_ptr,
    positions_ptr,
    slot_mapping_ptr,
    compressed_slot_mapping_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    kv_cache_ptr,
    state_stride0,
    state_stride1,
    block_table_stride,
    cos_sin_stride,
    eps,
    state_block_size,
    kv_block_size,
    HEAD_SIZE: tl.constexpr,  # indexer head_dim (128): HEAD_SIZE / 32 MXFP4 blocks per compressed token
    STATE_WIDTH: tl.constexpr,  # state_cache.shape[-1] // 2: kv state columns, then score + APE
    COMPRESS_RATIO: tl.constexpr,  # 4: a state closes every COMPRESS_RATIO positions
    OVERLAP: tl.constexpr,  # the window spans 2 * COMPRESS_RATIO positions over two state halves
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32)
    KV_BLOCK_STRIDE: tl.constexpr,  # kv_cache.stride(0): bytes per indexer cache page
    BLOCK: tl.constexpr,  # MXFP4 block (32 values per UE8M0 scale)
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    kv_slot = tl.load(compressed_slot_mapping_ptr + t).to(tl.int64)
    if (tl.load(slot_mapping_ptr + t) >= 0) & ((pos + 1) % COMPRESS_RATIO == 0) & (kv_slot >= 0):
        even_r, odd_r = _compress_norm_rope(
            state_ptr, block_table_ptr, token_to_req_ptr, norm_weight_ptr, cos_sin_ptr, t, pos, state_stride0,
            state_stride1, block_table_stride, cos_sin_stride, eps, state_block_size, HEAD_SIZE, STATE_WIDTH,
            COMPRESS_RATIO, OVERLAP, HALF_ROT,
        )  # fmt: skip
        # every dim, NoPE included, goes through bf16 (as vLLM's); then HEAD_SIZE / BLOCK blocks of BLOCK / 2 pairs
        even = tl.reshape(bf16_round(even_r), (HEAD_SIZE // BLOCK, BLOCK // 2))
        odd = tl.reshape(bf16_round(odd_r), (HEAD_SIZE // BLOCK, BLOCK // 2))
        packed, scale = mxfp4_quant(even, odd)
        base = kv_cache_ptr + (kv_slot // kv_block_size) * KV_BLOCK_STRIDE
        j = kv_slot % kv_block_size
        tl.store(base + j * (HEAD_SIZE // 2) + tl.arange(0, HEAD_SIZE // 2), tl.reshape(packed, (HEAD_SIZE // 2,)))
        scales = base + kv_block_size * (HEAD_SIZE // 2) + j * (HEAD_SIZE // BLOCK)
        tl.store(scales + tl.arange(0, HEAD_SIZE // BLOCK), scale)


@attrs.frozen(kw_only=True)
class IndexerKVInsertKey(warmreg.CompileKey):
    """What changes the binary of the indexer KV compress + RMSNorm + RoPE + FP8 quant + insert."""

    weight_dtype: str  # compressor RMSNorm weight
    head_size: int
    rope_dim: int
    state_width: int
    compress_ratio: int
    overlap: bool
    kv_block_stride: int  # indexer cache page stride in bytes (a constexpr)
    mx_scale: bool
    use_fp4_cache: bool  # MXFP4 K cache (packed E2M1 + UE8M0 per 32 dims) instead of FP8 + one scale
    state_block_size: str  # int class of the state page size (4: "other")
    kv_block_size: str  # int class of the compressed tokens per page (64: "div16")
    kv_cache_aligned: bool  # pages may live in a shared allocation
    weight_aligned: bool
    num_warps: int
    launch_pdl: bool  # always False: PDL raced with the state writes (as in save_partial_states)


def token_bytes(head_dim: int, fp4: bool) -> int:
    """Bytes of one compressed token in the indexer cache: FP8 ``head_dim + 4`` (a 4-byte scale), MXFP4
    ``head_dim / 2 + head_dim / 32`` (vLLM 0.33 ``DeepseekV4Indexer``'s ``k_cache_head_dim``)."""
    return mxfp4_row_bytes(head_dim) if fp4 else head_dim + SCALE_BYTES


def indexer_page_stride(
    config: warmreg.WarmConfig,
    tokens_per_page: int,
    head_dim: int,
    *,
    fp4: bool = False,
    platform: warmreg.Platform | None = None,
) -> int:
    """The indexer cache's page stride as the KV manager allocates it (our best knowledge of vLLM 0.33's KV manager).

    ``round_up(tokens_per_page * token_bytes, 576)`` when the attention caches are ``fp8_ds_mla`` on ``platform``
    (:func:`warmreg_deepseek_v4.backends.kv_cache_layout`: vLLM's ``DeepseekV4IndexerCache`` aligns to 576 when
    ``cache_config.cache_dtype`` ends up ``fp8_ds_mla``), else rounded to 512 (FlashInfer's plain rows on SM10x).
    The launch reads the real stride from ``kv_cache.stride(0)``. ``platform`` may be omitted where the layout does
    not depend on it (every backend but FlashInfer's).
    """
    unit = 576 if kv_cache_layout(config, platform) == "fp8_ds_mla" else 512
    return triton.cdiv(tokens_per_page * token_bytes(head_dim, fp4), unit) * unit


class IndexerKVCompressInsert(warmreg.TritonKernel[IndexerKVInsertKey]):
    """The C4 indexer's fused KV compress + RMSNorm + RoPE + quant + cache insert, FP8 or MXFP4 by the key's
    ``use_fp4_cache`` (see the module docstring).

    :param head_dim: indexer head dim (128).
    :param rope_dim: ``qk_rope_head_dim`` (64).
    :param compress_ratio: 4 (the indexer runs on C4 layers only).
    :param state_block_size: compressor state page size (4 for C4).
    :param weight_dtype: dtype name of the compressor RMSNorm weight.
    """

    name = "deepseek_v4.indexer_kv_compress_insert"
    key_type = IndexerKVInsertKey
    jit = _indexer_kv_compress_insert_kernel

    def jit_for(self, key: IndexerKVInsertKey) -> Any:
        return _indexer_kv_compress_insert_mxfp4_kernel if key.use_fp4_cache else _indexer_kv_compress_insert_kernel

    def jits(self) -> tuple[Any, ...]:
        return (_indexer_kv_compress_insert_kernel, _indexer_kv_compress_insert_mxfp4_kernel)

    def __init__(
        self,
        *,
        head_dim: int = 128,
        rope_dim: int = 64,
        compress_ratio: int = 4,
        state_block_size: int = 4,
        weight_dtype: str = "bfloat16",
    ) -> None:
        self.head_dim, self.rope_dim, self.compress_ratio = head_dim, rope_dim, compress_ratio
        self.state_block_size = state_block_size
        self.weight_dtype = getattr(torch, weight_dtype)

    def dispatch(
        self,
        *,
        state_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        compress_ratio: int,
        mx_scale: bool,
        use_fp4_cache: bool = False,
    ) -> IndexerKVInsertKey:
        head = norm_weight.shape[0]
        width = state_cache.shape[-1] // 2
        return IndexerKVInsertKey(
            weight_dtype=warmreg.dtype_name(norm_weight.dtype),
            head_size=head,
            rope_dim=cos_sin_cache.shape[-1],
            state_width=width,
            compress_ratio=compress_ratio,
            overlap=width == 2 * head,
            kv_block_stride=kv_cache.stride(0),
            mx_scale=mx_scale and not use_fp4_cache,  # MXFP4 scales are UE8M0 bytes on every platform
            use_fp4_cache=use_fp4_cache,
            state_block_size=warmreg.int_class(state_cache.shape[1]),
            kv_block_size=warmreg.int_class(kv_cache.shape[1]),
            kv_cache_aligned=warmreg.is_aligned(kv_cache),
            weight_aligned=warmreg.is_aligned(norm_weight),
            num_warps=1,
            launch_pdl=False,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        per_page = compressed_block_size(config, self.compress_ratio)
        fp4 = mxfp4_indexer(config, DSV4.from_config(config), platform)
        stride = indexer_page_stride(config, per_page, self.head_dim, fp4=fp4, platform=platform)
        row = token_bytes(self.head_dim, fp4)
        state_width = (2 if self.compress_ratio == 4 else 1) * self.head_dim
        return {
            "state_cache": [warmreg.meta((1024, self.state_block_size, 2 * state_width), torch.float32)],
            "kv_cache": [warmreg.meta((1024, per_page, row), torch.uint8, stride=(stride, row, 1))],
            "norm_weight": [warmreg.meta((self.head_dim,), self.weight_dtype)],
            "cos_sin_cache": [cos_sin_meta(config, self.rope_dim)],
            "compress_ratio": [self.compress_ratio],
            "mx_scale": [platform.is_cuda and 100 <= platform.sm < 110],
            "use_fp4_cache": [fp4],
        }

    def warmup_inputs(self, key: IndexerKVInsertKey) -> Mapping[str, Any]:
        row = token_bytes(key.head_size, key.use_fp4_cache)
        ids = warmreg.meta((1,), torch.int64)
        return {
            "state_cache": warmreg.meta((2, warmreg.int_class_rep(key.state_block_size), 2 * key.state_width), torch.float32),
            "state_block_table": warmreg.meta((1, 1), torch.int32),
            "token_to_req_indices": warmreg.meta((1,), torch.int32),
            "positions": ids,
            "slot_mapping": ids,
            "compressed_slot_mapping": ids,
            "norm_weight": warmreg.meta(
                (key.head_size,), getattr(torch, key.weight_dtype), offset=0 if key.weight_aligned else 1
            ),
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), torch.float32),
            "kv_cache": warmreg.meta(
                (2, warmreg.int_class_rep(key.kv_block_size), row),
                torch.uint8,
                stride=(key.kv_block_stride, row, 1),
                offset=0 if key.kv_cache_aligned else 4,  # scales need 4-byte alignment
            ),
            "eps": 1e-6,
            "compress_ratio": key.compress_ratio,
            "mx_scale": key.mx_scale,
            "use_fp4_cache": key.use_fp4_cache,
        }

    def _check(
        self,
        state_cache: torch.Tensor,
        state_block_table: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        compressed_slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        compress_ratio: int,
        use_fp4_cache: bool,
    ) -> None:
        t = slot_mapping.shape[0] if slot_mapping.ndim == 1 else 0
        problems = []
        if slot_mapping.ndim != 1 or slot_mapping.dtype != torch.int64:
            problems.append(f"slot_mapping must be int64 [S] (got {slot_mapping.dtype} {tuple(slot_mapping.shape)})")
        for name, ids in (("positions", positions), ("compressed_slot_mapping", compressed_slot_mapping)):
            if ids.ndim != 1 or ids.dtype != torch.int64 or ids.shape[0] < t:
                problems.append(f"{name} must be int64 [>= {t}] (got {ids.dtype} {tuple(ids.shape)})")
        if (
            token_to_req_indices.dtype != torch.int32
            or token_to_req_indices.ndim != 1
            or token_to_req_indices.shape[0] < t
        ):
            problems.append(f"token_to_req_indices must be int32 [>= {t}]")
        if state_block_table.dtype != torch.int32 or state_block_table.ndim != 2 or state_block_table.stride(1) != 1:
            problems.append("state_block_table must be int32 [num_reqs, blocks] with contiguous rows")
        head = norm_weight.shape[0] if norm_weight.ndim == 1 else -1
        if not is_pow2(head) or norm_weight.stride(0) != 1:
            problems.append(
                f"norm_weight must be a contiguous power-of-two [head_dim] (got {tuple(norm_weight.shape)})"
            )
        width = state_cache.shape[-1] // 2 if state_cache.ndim == 3 else -1
        if state_cache.dtype != torch.float32 or width not in (head, 2 * head) or state_cache.stride(-1) != 1:
            problems.append(
                f"state_cache must be float32 [pages, page_size, 2 * (1 or 2) * {head}] (got {state_cache.dtype} {tuple(state_cache.shape)})"
            )
        if not is_pow2(compress_ratio) or (width == 2 * head and compress_ratio != 4):
            problems.append(f"compress_ratio {compress_ratio} must be a power of two, and 4 with overlapping states")
        row = token_bytes(head, use_fp4_cache) if head > 0 else -1
        ok_cache = kv_cache.dtype == torch.uint8 and kv_cache.ndim == 3 and tuple(kv_cache.shape[2:]) == (row,)
        if (
            not ok_cache
            or kv_cache.stride(2) != 1
            or kv_cache.stride(1) != row
            or kv_cache.stride(0) < kv_cache.shape[1] * row
        ):
            problems.append(
                f"kv_cache must be uint8 [pages, tokens_per_page, {row}] with packed pages (got {kv_cache.dtype} {tuple(kv_cache.shape)} strides {kv_cache.stride()})"
            )
        if use_fp4_cache and (head % MXFP4_BLOCK or head < MXFP4_BLOCK):
            problems.append(f"an MXFP4 cache needs head_dim a multiple of {MXFP4_BLOCK} (got {head})")
        if not use_fp4_cache and (kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4):
            problems.append("kv_cache pages must start 4-byte aligned (the scales are 4-byte words)")
        if (problem := unspecialized_int32_problem(*(state_cache.stride(0), state_cache.stride(1), state_block_table.stride(0)))) is not None:
            problems.append(problem)
        if problems:
            raise warmreg.LaunchError(self.name, "; ".join(problems))

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_cache: torch.Tensor,
        state_block_table: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        compressed_slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        eps: float,
        *,
        compress_ratio: int = 4,
        mx_scale: bool | None = None,
        use_fp4_cache: bool = False,
    ) -> warmreg.LaunchSpec[IndexerKVInsertKey]:
        """Compress each closing token's window and insert it into ``kv_cache`` (in place; returned).

        :param state_cache: float32 ``[pages, page_size, 2 * STATE_WIDTH]`` compressor states (as :class:`~.state_cache.SavePartialStates` writes them).
        :param state_block_table: int32 ``[num_reqs, blocks]``: state pages of each request.
        :param token_to_req_indices: int32 ``[>= S]``.
        :param positions: int64 ``[>= S]``.
        :param slot_mapping: int64 ``[S]``: the token's own state slot, ``-1`` for PAD; ``S`` is the grid (vLLM's
            ``num_actual``: under DP padding fewer than the ``T`` tokens of ``positions``).
        :param compressed_slot_mapping: int64 ``[>= S]``: indexer cache slot, or ``-1`` (from :class:`~.compressed_slot_mapping.CompressedSlotMapping`).
        :param norm_weight: ``[head_dim]`` compressor RMSNorm weight.
        :param cos_sin_cache: float32 ``[P, rope_dim]``.
        :param kv_cache: uint8 ``[pages, tokens_per_page, head_dim + 4]`` (FP8) or ``[..., head_dim / 2 + head_dim / 32]``
            (MXFP4); ``stride(0)`` is the page stride.
        :param mx_scale: FP8: UE8M0 x4 int32 scales (default: the local GPU is CUDA sm100 family); MXFP4 ignores it.
        :param use_fp4_cache: write MXFP4 (the C4 indexer on an MXFP4 K cache) instead of FP8.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        self._check(
            state_cache, state_block_table, token_to_req_indices, positions, slot_mapping, compressed_slot_mapping,
            norm_weight, kv_cache, compress_ratio, use_fp4_cache,
        )  # fmt: skip
        check_rope_cache(self.name, cos_sin_cache, norm_weight.shape[0])
        if mx_scale is None:
            local = warmreg.runtime_platform()
            mx_scale = local is not None and local.is_cuda and 100 <= local.sm < 110
        key = self.dispatch(
            state_cache=state_cache, kv_cache=kv_cache, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache,
            compress_ratio=compress_ratio, mx_scale=mx_scale, use_fp4_cache=use_fp4_cache,
        )  # fmt: skip
        kwargs: dict[str, Any] = dict(
            state_ptr=state_cache, block_table_ptr=state_block_table, token_to_req_ptr=token_to_req_indices,
            positions_ptr=positions, slot_mapping_ptr=slot_mapping, compressed_slot_mapping_ptr=compressed_slot_mapping,
            norm_weight_ptr=norm_weight, cos_sin_ptr=cos_sin_cache, kv_cache_ptr=kv_cache,
            state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            block_table_stride=state_block_table.stride(0), cos_sin_stride=cos_sin_cache.stride(0), eps=float(eps),
            state_block_size=state_cache.shape[1], kv_block_size=kv_cache.shape[1],
            HEAD_SIZE=key.head_size, STATE_WIDTH=key.state_width, COMPRESS_RATIO=key.compress_ratio,
            OVERLAP=key.overlap, HALF_ROT=key.rope_dim // 2, KV_BLOCK_STRIDE=key.kv_block_stride,
        )  # fmt: skip
        if key.use_fp4_cache:
            kwargs["BLOCK"] = MXFP4_BLOCK
        else:
            kwargs["MX_SCALE"] = key.mx_scale
        t = slot_mapping.shape[0]
        return warmreg.LaunchSpec(key, (t,) if t else None, kwargs, kv_cache)


def indexer_kv_compress_insert_reference(
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    eps: float,
    *,
    compress_ratio: int = 4,
    mx_scale: bool = False,
    use_fp4_cache: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :class:`IndexerKVCompressInsert`; writes ``kv_cache`` in place and returns it."""
    head, rope = norm_weight.shape[0], cos_sin_cache.shape[1]
    width = state_cache.shape[-1] // 2
    overlap = width == 2 * head
    window = (2 if overlap else 1) * compress_ratio
    state_bs, kv_bs = state_cache.shape[1], kv_cache.shape[1]
    for t in range(slot_mapping.shape[0]):
        pos, kv_slot = int(positions[t]), int(compressed_slot_mapping[t])
        if int(slot_mapping[t]) < 0 or (pos + 1) % compress_ratio or kv_slot < 0:
            continue
        req = int(token_to_req_indices[t])
        score = torch.full((window, head), float("-inf"))
        kv = torch.zeros((window, head))
        for i in range(window):
            p = pos - window + 1 + i
            if p < 0:
                continue
            row = state_cache[int(state_block_table[req, p // state_bs]), p % state_bs]
            col = head if overlap and i >= compress_ratio else 0
            score[i], kv[i] = row[width + col : width + col + head], row[col : col + head]
        c = (torch.softmax(score, dim=0) * kv).sum(dim=0)
        n = c * torch.rsqrt(c.pow(2).mean() + eps) * norm_weight.float()
        cs = cos_sin_cache[pos // compress_ratio * compress_ratio]
        x = torch.cat([n[:-rope], rope_pairs(n[-rope:], cs[: rope // 2], cs[rope // 2 :])])
        x = x.to(torch.bfloat16).float()
        page = kv_cache[kv_slot // kv_bs].view(-1)
        j = kv_slot % kv_bs
        if use_fp4_cache:
            packed, scales = mxfp4_quant_reference(x)
            page[j * (head // 2) : (j + 1) * (head // 2)] = packed
            blocks = head // MXFP4_BLOCK
            page[kv_bs * (head // 2) + j * blocks : kv_bs * (head // 2) + (j + 1) * blocks] = scales
            continue
        e, s = pow2_scale_reference(x.abs().amax(), SCALE_FLOOR, K_FP8_MAX)
        q = (x / s).clamp(-K_FP8_MAX, K_FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        page[j * head : (j + 1) * head] = q
        scale = ((e + 127) * 0x01010101).to(torch.int32).reshape(1) if mx_scale else s.reshape(1)
        page[kv_bs * head + 4 * j : kv_bs * head + 4 * j + 4] = scale.view(torch.uint8)
    return kv_cache


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the indexer KV compress + insert when the model has C4 layers: Triton on every platform for an
    FP8 indexer cache, and on CUDA (SM10x) for an MXFP4 one; ROCm writes its MXFP4 cache with
    :mod:`.compress_pool` and aiter's ``rocm_mxfp4_indexer_k_store`` instead (vLLM 0.33's
    ``get_warmup_keys`` returns no key there either).

    :raises warmreg.ConfigError: for a ``serving.indexer_kv_dtype`` the platform cannot serve.
    """
    kernel = IndexerKVCompressInsert(
        head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, compress_ratio=4, weight_dtype=model.dtype
    )
    rocm_mxfp4 = platform.is_rocm and mxfp4_indexer(config, model, platform)
    registry.add(kernel, when=model.has_c4 and not rocm_mxfp4)
