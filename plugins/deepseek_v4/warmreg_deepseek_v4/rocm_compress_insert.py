"""ROCm's head-512 KV compressor of the attention caches: fused compress + RMSNorm + UE8M0 FP8 quant + RoPE + insert
into ``fp8_ds_mla`` pages (vLLM 0.34 ``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``:
``compress_norm_rope_store_triton`` with ``head_dim == 512``, which launches
``_fused_kv_compress_norm_rope_insert_sparse_attn``).

Token ``t`` (grid ``(S,)``, ``S`` = vLLM's ``num_actual``) writes only when its state slot ``slot_mapping[t] >= 0``,
``(pos + 1) % cr == 0`` and its compressed slot ``kv_slot_mapping[t] >= 0``. With the window ``L = (1 + overlap) * cr``
ending at ``pos`` (``p_i = pos - L + 1 + i``, valid when ``p_i >= 0``), state rows read through the state block table,
the older ``cr`` positions from the first half of each state (kv ``[0, 512)``, score ``[SW, SW + 512)``), the newer
from the second (overlap: the C4 layers)::

    c = sum_i softmax_i(score_i) * kv_i                         (per column, fp32; invalid positions excluded)
    n = c * rsqrt(sum(c**2) / 512 + eps) * w
    x = float32(bf16(n));  per 64-block b < 7: e_b = ceil(log2(max(amax|x_b|, 1e-4) / 448))
    page, j = divmod(kv_slot_mapping[t], B)
    page bytes [576 j, 576 j + 448)       = e4m3fn(clamp(x_b * 2**-e_b, +-448))        (the NoPE part)
    page bytes [576 j + 448, 576 j + 576) = bf16(rope(n, (pos // cr) * cr)[448:])     (NaN -> 0 on gfx950)
    page bytes [576 B + 8 j, +8)          = uint8(clamp(e_b + 127, 0, 254 on gfx950 else 255)), then a 0 pad byte

``rope`` is GPT-J interleaved RoPE on the last 64 dims (pairs ``(x[2i], x[2i+1])``, ``cos_sin_cache[p, i]`` and
``cos_sin_cache[p, 32 + i]``). The operations are vLLM's, in its order, except its two casts: where vLLM converts to
bf16 and to e4m3fn with Triton's casts (the hardware's round to nearest even, saturating), the bits come from
:mod:`._quant`'s exact encoders (``bf16_round``, ``fp8_bits``): the same bytes on a GPU, and under Triton's
interpreter too (whose casts truncate, or round wrongly: 127.6 -> 64).

Where it runs: ROCm's ``DeepseekCompressor.forward`` of every attention layer with compressed caches, which on
ROCm calls ``compress_norm_rope_store_triton`` for the C4 layers (every token of the step) and, through
``compress_norm_rope_store_two_stage_triton`` (``_prefer_two_stage_compressor``: ROCm), for the decode rows
``[0, num_decode_tokens)`` of the C128 layers (their prefill rows take the two-stage split kernels, not this op).
CUDA always takes CuTeDSL's compressor for head 512. ``SANITIZE_CACHE_NANS`` is vLLM's ``_ON_GFX950``.

Key: the ratio and overlap (the state width), the RMSNorm weight's dtype, the sanitizing, vLLM's 4 warps, and which
tensors' storage lies past 2 GB (ROCm's ``tt.pointer_range = 32``, as for :mod:`.rocm_indexer_gather`): the state
cache and the KV cache are views of the KV pool, each planned both ways; the step's id buffers and tables are small.
Strides, page sizes and the page stride (vLLM's ``KV_BLOCK_STRIDE`` constexpr) are runtime ints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._quant import bf16_round, fp8_bits
from .backends import compressed_block_size
from .metadata import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from .model import DSV4
from .rocm_indexer_gather import meta_past_2gb, over_2gb_names

__all__ = [
    "RocmSparseCompressInsert",
    "RocmSparseCompressInsertKey",
    "rocm_sparse_compress_insert_reference",
    "register",
]

_HEAD, _ROPE, _QB, _TOKEN, _SCALE = 512, 64, 64, 576, 8  # fp8_ds_mla: 448 FP8 + 64 bf16, 7 UE8M0 scales + a pad
_NOPE = _HEAD - _ROPE


@triton.jit(
    do_not_specialize=[
        "state_stride0", "state_stride1", "block_table_stride", "state_block_size", "eps", "cos_sin_stride",
        "kv_block_size", "kv_block_stride",
    ],
    do_not_specialize_on_alignment=[
        "state_ptr", "token_to_req_ptr", "positions_ptr", "slot_mapping_ptr", "block_table_ptr", "weight_ptr",
        "cos_sin_ptr", "kv_cache_ptr", "kv_slot_mapping_ptr",
    ],
)  # fmt: skip
def _sparse_compress_insert_kernel(
    state_ptr,
    state_stride0,
    state_stride1,
    token_to_req_ptr,
    positions_ptr,
    slot_mapping_ptr,
    block_table_ptr,
    block_table_stride,
    state_block_size,
    weight_ptr,
    eps,
    cos_sin_ptr,
    cos_sin_stride,
    kv_cache_ptr,
    kv_slot_mapping_ptr,
    kv_block_size,
    kv_block_stride,
    HEAD: tl.constexpr,  # 512: one row of columns
    ROPE: tl.constexpr,  # the rotated tail (64)
    QB: tl.constexpr,  # columns a UE8M0 scale (64)
    TOKEN: tl.constexpr,  # bytes a token's row (576)
    SCALE: tl.constexpr,  # bytes a token's scales (8)
    STATE_WIDTH: tl.constexpr,  # score columns start here in a state row
    RATIO: tl.constexpr,  # tokens a compressed entry
    OVERLAP: tl.constexpr,  # the window also covers the previous entry's tokens (C4)
    SANITIZE: tl.constexpr,  # gfx950: no NaN bytes in the cache
):
    t = tl.program_id(0)
    if tl.load(slot_mapping_ptr + t) < 0:
        return
    position = tl.load(positions_ptr + t)
    if (position + 1) % RATIO != 0:
        return
    req = tl.load(token_to_req_ptr + t)
    window = tl.arange(0, (1 + OVERLAP) * RATIO)
    pos = position - (1 + OVERLAP) * RATIO + 1 + window
    valid = pos >= 0
    pages = tl.load(block_table_ptr + req * block_table_stride + pos // state_block_size, mask=valid, other=0)
    half = (window >= RATIO).to(tl.int32) * HEAD
    rows = state_ptr + pages.to(tl.int64) * state_stride0 + (pos % state_block_size) * state_stride1 + half
    cols = tl.arange(0, HEAD)
    both = valid[:, None] & (cols < HEAD)[None, :]
    score = tl.load(rows[:, None] + STATE_WIDTH + cols[None, :], mask=both, other=float("-inf"))
    score = tl.softmax(score, dim=0)
    kv = tl.load(rows[:, None] + cols[None, :], mask=both, other=0.0)
    c = tl.sum(kv * score, axis=0)
    w = tl.load(weight_ptr + cols, mask=cols < HEAD, other=0.0)
    variance = tl.sum(c * c, axis=0) / HEAD
    n = c * tl.rsqrt(variance + eps) * w

    kv_slot = tl.load(kv_slot_mapping_ptr + t)
    if kv_slot < 0:
        return
    page = kv_slot // kv_block_size
    j = kv_slot % kv_block_size
    page_ptr = kv_cache_ptr + page.to(tl.int64) * kv_block_stride
    row_ptr = page_ptr + j * TOKEN
    scale_ptr = page_ptr + kv_block_size * TOKEN + j * SCALE

    blocks = tl.reshape(bf16_round(n), (HEAD // QB, QB))
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=1), 1e-4)
    exponents = tl.ceil(tl.log2(amax * (1.0 / 448.0)))
    scaled = blocks * tl.reshape(tl.exp2(-exponents), (HEAD // QB, 1))
    codes = fp8_bits(tl.clamp(scaled, -448.0, 448.0), False)  # OCP e4m3fn on gfx942 too
    tl.store(row_ptr + cols, tl.reshape(codes, (HEAD,)), mask=cols < HEAD - ROPE)
    sidx = tl.arange(0, HEAD // QB)
    top: tl.constexpr = 254.0 if SANITIZE else 255.0
    encoded = tl.maximum(tl.minimum(exponents + 127.0, top), 0.0)
    tl.store(scale_ptr + sidx, encoded.to(tl.uint8), mask=sidx < (HEAD - ROPE) // QB)
    tl.store(scale_ptr + (HEAD - ROPE) // QB, tl.zeros((), dtype=tl.uint8))

    even, odd = tl.split(tl.reshape(n, (HEAD // 2, 2)))
    pair = tl.arange(0, HEAD // 2) - (HEAD - ROPE) // 2
    rotated = pair >= 0
    k = tl.maximum(pair, 0)
    cs = cos_sin_ptr + (position // RATIO) * RATIO * cos_sin_stride
    cos = tl.load(cs + k, mask=rotated, other=1.0)
    sin = tl.load(cs + ROPE // 2 + k, mask=rotated, other=0.0)
    out = bf16_round(tl.interleave(even * cos - odd * sin, odd * cos + even * sin))
    if SANITIZE:
        out = tl.where(out == out, out, 0.0)
    bf16_ptr = (row_ptr + HEAD - ROPE).to(tl.pointer_type(tl.bfloat16))
    tail = cols - (HEAD - ROPE)
    tl.store(bf16_ptr + tail, out.to(tl.bfloat16), mask=(cols >= HEAD - ROPE) & (cols < HEAD))


@attrs.frozen(kw_only=True)
class RocmSparseCompressInsertKey(warmreg.CompileKey):
    """What changes the binary: the ratio and overlap, the weight's dtype, the gfx950 sanitizing, the warps, and which
    tensors' storage is past 2 GB."""

    compress_ratio: int
    overlap: bool
    weight_dtype: str
    sanitize_nans: bool
    num_warps: int
    over_2gb: tuple[str, ...]


class RocmSparseCompressInsert(warmreg.TritonKernel[RocmSparseCompressInsertKey]):
    """Compress each closing window of the attention compressor's states into an ``fp8_ds_mla`` token; see the
    module docstring.

    :param compress_ratio: 4 (overlapping windows) or 128.
    :param state_block_size: the compressor state's tokens a page; ``kv_block_size`` the compressed cache's.
    :param weight_dtype: the compressor RMSNorm weight's dtype name; ``sanitize_nans``: gfx950.
    """

    name = "deepseek_v4.rocm_sparse_compress_insert"
    key_type = RocmSparseCompressInsertKey
    jit = _sparse_compress_insert_kernel

    def __init__(
        self, *, compress_ratio: int = 4, state_block_size: int = 4, kv_block_size: int = 64,
        weight_dtype: str = "bfloat16", sanitize_nans: bool = False,
    ) -> None:  # fmt: skip
        self.compress_ratio, self.state_block_size, self.kv_block_size = compress_ratio, state_block_size, kv_block_size
        self.weight_dtype, self.sanitize_nans = getattr(torch, weight_dtype), sanitize_nans

    def dispatch(
        self,
        *,
        compress_ratio: int,
        sanitize_nans: bool,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
    ) -> RocmSparseCompressInsertKey:
        big = over_2gb_names(
            state_cache=state_cache, token_to_req_indices=token_to_req_indices, positions=positions,
            slot_mapping=slot_mapping, block_table=block_table, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache,
            kv_cache=kv_cache, kv_slot_mapping=kv_slot_mapping,
        )  # fmt: skip
        return RocmSparseCompressInsertKey(
            compress_ratio=compress_ratio, overlap=state_cache.shape[-1] == 4 * _HEAD,
            weight_dtype=warmreg.dtype_name(norm_weight.dtype), sanitize_nans=sanitize_nans, num_warps=4, over_2gb=big,
        )  # fmt: skip

    def _metas(self, key_ratio: int, big: set[str]) -> dict[str, Any]:
        width = (2 if key_ratio == 4 else 1) * _HEAD
        ids = {n: meta_past_2gb((1,), torch.int64, n in big) for n in ("positions", "slot_mapping", "kv_slot_mapping")}
        return {
            "state_cache": meta_past_2gb((2, self.state_block_size, 2 * width), torch.float32, "state_cache" in big),
            "token_to_req_indices": meta_past_2gb((1,), torch.int32, "token_to_req_indices" in big),
            **ids,
            "block_table": meta_past_2gb((1, 2), torch.int32, "block_table" in big),
            "norm_weight": meta_past_2gb((_HEAD,), self.weight_dtype, "norm_weight" in big),
            "cos_sin_cache": meta_past_2gb((2, _ROPE), torch.float32, "cos_sin_cache" in big),
            "kv_cache": meta_past_2gb((2, self.kv_block_size, _TOKEN + _SCALE), torch.uint8, "kv_cache" in big),
        }

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        # the state cache and the KV cache are views of the KV pool: at or below 2 GB (a small pool) or above it
        for big in ({"state_cache", "kv_cache"}, {"state_cache"}, {"kv_cache"}, set()):
            yield {**self._metas(self.compress_ratio, big), "compress_ratio": self.compress_ratio,
                   "sanitize_nans": self.sanitize_nans}  # fmt: skip

    def warmup_inputs(self, key: RocmSparseCompressInsertKey) -> Mapping[str, Any]:
        kernel = RocmSparseCompressInsert(
            compress_ratio=key.compress_ratio, state_block_size=self.state_block_size, kv_block_size=self.kv_block_size,
            weight_dtype=key.weight_dtype,
        )  # fmt: skip
        return {**kernel._metas(key.compress_ratio, set(key.over_2gb)), "eps": 1e-6,
                "compress_ratio": key.compress_ratio, "sanitize_nans": key.sanitize_nans}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        eps: float,
        *,
        compress_ratio: int,
        sanitize_nans: bool = False,
    ) -> warmreg.LaunchSpec[RocmSparseCompressInsertKey]:
        """Insert the compressed entry of every closing window into ``kv_cache`` (in place; returned).

        :param state_cache: float32 ``[pages, page_size, 2 * (1 + overlap) * 512]`` compressor states, last dim
            contiguous.
        :param token_to_req_indices: int32 ``[>= S]``; ``positions`` int64 ``[>= S]``.
        :param slot_mapping: int64 ``[S]``: each token's state slot, ``-1`` for none; ``S`` is the grid.
        :param block_table: int32 ``[R, W]`` (contiguous rows): the state pages of each request.
        :param norm_weight: ``[512]`` contiguous RMSNorm weight; ``cos_sin_cache`` float32 ``[P, 64]``.
        :param kv_cache: uint8 ``[pages, B, 584]`` ``fp8_ds_mla`` cache (``stride(0)`` its page stride).
        :param kv_slot_mapping: int64 ``[>= S]``: each token's compressed slot, ``-1`` for none.
        :param compress_ratio: 4 (with overlapping states) or 128; ``sanitize_nans``: gfx950's NaN-free cache.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        self._check(state_cache, token_to_req_indices, positions, slot_mapping, block_table, norm_weight, kv_cache,
                    kv_slot_mapping, compress_ratio)  # fmt: skip
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != _ROPE or (
            cos_sin_cache.stride(1) != 1
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"cos_sin_cache must be float32 [P, {_ROPE}] with contiguous rows (got "
                                      f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})")  # fmt: skip
        key = self.dispatch(
            compress_ratio=compress_ratio, sanitize_nans=sanitize_nans, state_cache=state_cache,
            token_to_req_indices=token_to_req_indices, positions=positions, slot_mapping=slot_mapping,
            block_table=block_table, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache,
            kv_slot_mapping=kv_slot_mapping,
        )  # fmt: skip
        kwargs = dict(
            state_ptr=state_cache, state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            token_to_req_ptr=token_to_req_indices, positions_ptr=positions, slot_mapping_ptr=slot_mapping,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            state_block_size=state_cache.shape[1], weight_ptr=norm_weight, eps=eps, cos_sin_ptr=cos_sin_cache,
            cos_sin_stride=cos_sin_cache.stride(0), kv_cache_ptr=kv_cache, kv_slot_mapping_ptr=kv_slot_mapping,
            kv_block_size=kv_cache.shape[1], kv_block_stride=kv_cache.stride(0), HEAD=_HEAD, ROPE=_ROPE, QB=_QB,
            TOKEN=_TOKEN, SCALE=_SCALE, STATE_WIDTH=state_cache.shape[-1] // 2, RATIO=key.compress_ratio,
            OVERLAP=key.overlap, SANITIZE=key.sanitize_nans,
        )  # fmt: skip
        tokens = slot_mapping.shape[0]
        return warmreg.LaunchSpec(key, (tokens,) if tokens else None, kwargs, kv_cache)

    def _check(self, state: torch.Tensor, to_req: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               table: torch.Tensor, weight: torch.Tensor, kv: torch.Tensor, kv_slots: torch.Tensor,
               ratio: int) -> None:  # fmt: skip
        s = slots.shape[0] if slots.ndim == 1 else -1
        problems = []
        if slots.dtype != torch.int64 or s < 0:
            problems.append(f"slot_mapping must be int64 [S] (got {slots.dtype} {tuple(slots.shape)})")
        for name, ids, dtype in (("positions", positions, torch.int64), ("kv_slot_mapping", kv_slots, torch.int64),
                                 ("token_to_req_indices", to_req, torch.int32)):  # fmt: skip
            if ids.dtype != dtype or ids.ndim != 1 or ids.shape[0] < s or (ids.shape[0] > 1 and ids.stride(0) != 1):
                problems.append(f"{name} must be contiguous {dtype} [>= {s}] (got {ids.dtype} {tuple(ids.shape)})")
        if table.dtype != torch.int32 or table.ndim != 2 or (table.shape[1] > 1 and table.stride(1) != 1):
            problems.append("block_table must be int32 [R, W] with contiguous rows")
        if weight.shape != (_HEAD,) or weight.stride(0) != 1 or not weight.dtype.is_floating_point:
            problems.append(f"norm_weight must be a contiguous float [{_HEAD}] (got {tuple(weight.shape)})")
        if (state.dtype != torch.float32 or state.ndim != 3 or state.shape[-1] not in (2 * _HEAD, 4 * _HEAD)
                or state.stride(-1) != 1):  # fmt: skip
            problems.append(f"state_cache must be float32 [pages, page_size, 1024 or 2048] (got {state.dtype} "
                            f"{tuple(state.shape)})")  # fmt: skip
        if ratio not in (4, 128) or (state.ndim == 3 and (state.shape[-1] == 4 * _HEAD) != (ratio == 4)):
            problems.append(f"compress_ratio must be 4 (overlapping states) or 128 (got {ratio})")
        row = _TOKEN + _SCALE
        if (kv.dtype != torch.uint8 or kv.ndim != 3 or kv.shape[2] != row or kv.stride(2) != 1 or kv.stride(1) != row
                or kv.stride(0) < kv.shape[1] * row or kv.data_ptr() % 2 or kv.stride(0) % 2):  # fmt: skip
            problems.append(f"kv_cache must be uint8 [pages, B, {row}] fp8_ds_mla pages (got {kv.dtype} "
                            f"{tuple(kv.shape)}, strides {kv.stride()})")  # fmt: skip
        if problems:
            raise warmreg.LaunchError(self.name, "; ".join(problems))


def rocm_sparse_compress_insert_reference(
    state_cache: torch.Tensor, token_to_req_indices: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    block_table: torch.Tensor, norm_weight: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor, eps: float, *, compress_ratio: int, sanitize_nans: bool = False,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`RocmSparseCompressInsert`: a copy of ``kv_cache``'s pages (uint8
    ``[pages, page_stride]``) with the entries written (bf16 and e4m3fn rounded to nearest even)."""
    f32, ratio, width = torch.float32, compress_ratio, state_cache.shape[-1] // 2
    overlap, bs = width == 2 * _HEAD, kv_cache.shape[1]
    pages = torch.as_strided(kv_cache, (kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1)).clone()
    for t in range(slot_mapping.shape[0]):
        pos = int(positions[t])
        if int(slot_mapping[t]) < 0 or (pos + 1) % ratio or int(kv_slot_mapping[t]) < 0:
            continue
        req, n_win = int(token_to_req_indices[t]), (1 + overlap) * ratio
        kv_rows, score_rows = [], []
        for i in range(n_win):
            p = pos - n_win + 1 + i
            if p < 0:
                continue
            row = state_cache[int(block_table[req, p // state_cache.shape[1]]), p % state_cache.shape[1]]
            half = _HEAD if i >= ratio else 0
            kv_rows.append(row[half : half + _HEAD])
            score_rows.append(row[width + half : width + half + _HEAD])
        c = (torch.stack(kv_rows) * torch.softmax(torch.stack(score_rows), dim=0)).sum(0)
        n = c * torch.rsqrt((c * c).sum() / _HEAD + eps) * norm_weight.to(f32)
        x = n.to(torch.bfloat16).to(f32).reshape(-1, _QB)
        e = torch.ceil(torch.log2(x.abs().amax(1).clamp_min(1e-4) / 448.0))
        codes = (x * torch.exp2(-e)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        pairs = n.reshape(-1, 2)[_NOPE // 2 :]
        cs = cos_sin_cache[(pos // ratio) * ratio].to(f32)
        cos, sin = cs[: _ROPE // 2], cs[_ROPE // 2 :]
        rope = torch.stack([pairs[:, 0] * cos - pairs[:, 1] * sin, pairs[:, 1] * cos + pairs[:, 0] * sin], 1)
        rope = rope.reshape(-1)
        if sanitize_nans:
            rope = torch.nan_to_num(rope, nan=0.0)
        page, j = divmod(int(kv_slot_mapping[t]), bs)
        pages[page, j * _TOKEN : j * _TOKEN + _NOPE] = codes.reshape(-1)[:_NOPE]
        pages[page, j * _TOKEN + _NOPE : (j + 1) * _TOKEN] = rope.to(torch.bfloat16).view(torch.uint8)
        scales = (e[: _NOPE // _QB] + 127).clamp(0, 254 if sanitize_nans else 255).to(torch.uint8)
        pages[page, bs * _TOKEN + j * _SCALE : bs * _TOKEN + (j + 1) * _SCALE] = torch.cat(
            [scales, scales.new_zeros(1)]
        )
    return pages


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the compressor on ROCm for the C4 and C128 layers present (vLLM's ROCm ``DeepseekCompressor`` of the
    attention caches: every C4 token, the C128 decode rows)."""
    ratios = [r for r, on in ((4, model.has_c4), (128, model.has_c128)) if on]
    states = {4: C4_STATE_BLOCK_SIZE, 128: C128_STATE_BLOCK_SIZE}
    for r in ratios:
        kernel = RocmSparseCompressInsert(
            compress_ratio=r, state_block_size=states[r], kv_block_size=compressed_block_size(config, r),
            weight_dtype=model.dtype, sanitize_nans=platform.is_rocm and platform.arch == "gfx950",
        )  # fmt: skip
        registry.add(kernel, when=warmreg.is_rocm)
