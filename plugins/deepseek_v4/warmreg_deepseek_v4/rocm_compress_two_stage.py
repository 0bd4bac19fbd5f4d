"""ROCm's two-stage head-512 C128 compressor of the attention caches, for the prefill rows (vLLM 0.34
``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``: ``compress_norm_rope_store_two_stage_triton`` ->
``_launch_two_stage_sparse_attn_compressor``, which launches ``_compress_gather_split_sparse_attn`` then
``_finalize_norm_rope_quant_store_sparse_attn``).

The math of :mod:`.rocm_compress_insert` at ratio 128 (no overlap: state rows ``[kv 512 | score 512]``), split in
two launches over the ``S`` prefill rows. A row ``t`` writes only when ``slot_mapping[t] >= 0`` and
``(pos + 1) % 128 == 0`` (and, in stage 2, ``kv_slot_mapping[t] >= 0``).

Stage 1 (:class:`RocmCompressGatherSplit`, grid ``(S * n,)``): program ``(t, s)`` pools the columns
``[s * 512 / n, (s + 1) * 512 / n)`` of the window ``p_i = pos - 127 + i`` (valid when ``p_i >= 0``) into row ``t``
of the float32 scratch: ``c = sum_i softmax_i(score_i) * kv_i``. ``n`` (vLLM's ``_pick_compress_num_splits``) is the
largest power of two ``<= min(ceil(CU / max(1, S // 128)), 16)``: 1, 2, 4, 8 or 16.

Stage 2 (:class:`RocmCompressFinalize`, grid ``(S,)``): row ``t`` of the scratch through RMSNorm, UE8M0 FP8 quant of
the NoPE part and GPT-J RoPE of the last 64 dims into the ``fp8_ds_mla`` slot ``kv_slot_mapping[t]``::

    n = c * rsqrt(sum(c**2) / 512 + eps) * w;  x = float32(bf16(n));  e_b = ceil(log2(max(amax|x_b|, 1e-4) / 448))
    page bytes [576 j, 576 j + 448)       = e4m3fn(clamp(x_b * 2**-e_b, +-448))
    page bytes [576 j + 448, 576 j + 576) = bf16(rope(n, (pos // 128) * 128)[448:])     (NaN -> 0 on gfx950)
    page bytes [576 B + 8 j, +8)          = uint8(clamp(e_b + 127, 0, 254 on gfx950 else 255)), then a 0 pad byte

The bf16 and e4m3fn bits come from :mod:`._quant`'s exact encoders (round to nearest even, as a GPU's casts), not
from Triton's casts, which Triton's interpreter gets wrong.

Where it runs: ROCm's ``DeepseekCompressor.forward`` of the C128 layers (``_use_two_stage_fused_compressor``:
``_prefer_two_stage_compressor()``, i.e. ROCm, head 512, no overlap), on the rows ``[num_decode_tokens, num_actual)``
of every step with prefill rows; the decode rows take :mod:`.rocm_compress_insert`. CUDA takes CuTeDSL's compressor.

Keys: stage 1 the split count (vLLM's ``NUM_SPLITS`` / ``HEAD_TILE`` constexprs; every count is planned, since it
follows the device's CU count and the step's prefill rows, anything up to ``max_num_batched_tokens``) and whether the
state cache (a view of the KV pool) is past 2 GB; stage 2 the weight's dtype, gfx950's sanitizing and whether the KV
cache is past 2 GB (ROCm's ``tt.pointer_range = 32``). Both run vLLM's default 4 warps. The scratch is
``[max_num_batched_tokens, 512]`` float32, far below 2 GB. Strides, page sizes and the page stride are runtime ints.
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
from ._rocm_compress_two_stage import (
    check_ids,
    check_scratch,
    rocm_compress_finalize_reference,
    rocm_compress_gather_reference,
)
from .backends import compressed_block_size
from .metadata import C128_STATE_BLOCK_SIZE
from .model import DSV4
from .rocm_indexer_gather import meta_past_2gb, over_2gb_names

__all__ = [
    "SPLITS",
    "RocmCompressFinalize",
    "RocmCompressFinalizeKey",
    "RocmCompressGatherSplit",
    "RocmCompressGatherSplitKey",
    "compress_num_splits",
    "rocm_compress_finalize_reference",
    "rocm_compress_gather_reference",
    "register",
]

_HEAD, _ROPE, _QB, _TOKEN, _SCALE, _RATIO = 512, 64, 64, 576, 8, 128
_NOPE = _HEAD - _ROPE
#: The split counts vLLM's ``_pick_compress_num_splits`` can pick for head 512 (power-of-two tiles of >= 32 columns).
SPLITS = (1, 2, 4, 8, 16)


def compress_num_splits(num_rows: int, cu: int) -> int:
    """vLLM's ``_pick_compress_num_splits(num_rows, 128, 512)`` on a device of ``cu`` compute units."""
    target = -(-cu // max(1, num_rows // _RATIO))
    ns = 1
    while ns * 2 <= min(target, _HEAD // 32):
        ns *= 2
    return ns


@triton.jit(
    do_not_specialize=["state_stride0", "state_stride1", "block_table_stride", "state_block_size", "scratch_stride"],
    do_not_specialize_on_alignment=[
        "state_ptr", "positions_ptr", "slot_mapping_ptr", "token_to_req_ptr", "block_table_ptr", "scratch_ptr",
    ],
)  # fmt: skip
def _compress_gather_split_kernel(
    state_ptr,
    state_stride0,
    state_stride1,
    positions_ptr,
    slot_mapping_ptr,
    token_to_req_ptr,
    block_table_ptr,
    block_table_stride,
    state_block_size,
    scratch_ptr,
    scratch_stride,
    HEAD: tl.constexpr,  # 512 columns a state half
    RATIO: tl.constexpr,  # the window's rows (128)
    SPLITS: tl.constexpr,  # programs a row: HEAD // SPLITS columns each
):
    t = tl.program_id(0) // SPLITS
    s = tl.program_id(0) % SPLITS
    if tl.load(slot_mapping_ptr + t) < 0:
        return
    position = tl.load(positions_ptr + t)
    if (position + 1) % RATIO != 0:
        return
    req = tl.load(token_to_req_ptr + t)
    pos = position - RATIO + 1 + tl.arange(0, RATIO)
    valid = pos >= 0
    pages = tl.load(block_table_ptr + req * block_table_stride + pos // state_block_size, mask=valid, other=0)
    rows = state_ptr + pages.to(tl.int64) * state_stride0 + (pos % state_block_size) * state_stride1
    TILE: tl.constexpr = HEAD // SPLITS
    cols = s * TILE + tl.arange(0, TILE)
    both = valid[:, None] & (cols < HEAD)[None, :]
    score = tl.softmax(tl.load(rows[:, None] + HEAD + cols[None, :], mask=both, other=float("-inf")), dim=0)
    kv = tl.load(rows[:, None] + cols[None, :], mask=both, other=0.0)
    tl.store(scratch_ptr + t * scratch_stride + cols, tl.sum(kv * score, axis=0))


@triton.jit(
    do_not_specialize=["scratch_stride", "eps", "cos_sin_stride", "kv_block_size", "kv_block_stride"],
    do_not_specialize_on_alignment=[
        "scratch_ptr", "positions_ptr", "slot_mapping_ptr", "weight_ptr", "cos_sin_ptr", "kv_cache_ptr",
        "kv_slot_mapping_ptr",
    ],
)  # fmt: skip
def _compress_finalize_kernel(
    scratch_ptr,
    scratch_stride,
    positions_ptr,
    slot_mapping_ptr,
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
    RATIO: tl.constexpr,  # tokens a compressed entry (128)
    SANITIZE: tl.constexpr,  # gfx950: no NaN bytes in the cache
):
    t = tl.program_id(0)
    if tl.load(slot_mapping_ptr + t) < 0:
        return
    position = tl.load(positions_ptr + t)
    if (position + 1) % RATIO != 0:
        return
    cols = tl.arange(0, HEAD)
    c = tl.load(scratch_ptr + t * scratch_stride + cols)
    w = tl.load(weight_ptr + cols)
    n = c * tl.rsqrt(tl.sum(c * c, axis=0) / HEAD + eps) * w
    kv_slot = tl.load(kv_slot_mapping_ptr + t)
    if kv_slot < 0:
        return
    j = kv_slot % kv_block_size
    page_ptr = kv_cache_ptr + (kv_slot // kv_block_size).to(tl.int64) * kv_block_stride
    row_ptr = page_ptr + j * TOKEN
    scale_ptr = page_ptr + kv_block_size * TOKEN + j * SCALE

    blocks = tl.reshape(bf16_round(n), (HEAD // QB, QB))
    exponents = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(blocks), axis=1), 1e-4) * (1.0 / 448.0)))
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
    tl.store(bf16_ptr + cols - (HEAD - ROPE), out.to(tl.bfloat16), mask=cols >= HEAD - ROPE)


@attrs.frozen(kw_only=True)
class RocmCompressGatherSplitKey(warmreg.CompileKey):
    """What changes stage 1's binary: the split count, the warps, and which tensors' storage is past 2 GB."""

    num_splits: int
    num_warps: int
    over_2gb: tuple[str, ...]


class RocmCompressGatherSplit(warmreg.TritonKernel[RocmCompressGatherSplitKey]):
    """Stage 1: pool each closing C128 window's columns, ``num_splits`` programs a row, into the float32 scratch;
    see the module docstring.

    :param state_block_size: the C128 compressor state's tokens a page.
    """

    name = "deepseek_v4.rocm_compress_gather_split"
    key_type = RocmCompressGatherSplitKey
    jit = _compress_gather_split_kernel

    def __init__(self, *, state_block_size: int = C128_STATE_BLOCK_SIZE) -> None:
        self.state_block_size = state_block_size

    def dispatch(
        self,
        *,
        num_splits: int,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        scratch: torch.Tensor,
    ) -> RocmCompressGatherSplitKey:
        big = over_2gb_names(
            state_cache=state_cache, token_to_req_indices=token_to_req_indices, positions=positions,
            slot_mapping=slot_mapping, block_table=block_table, scratch=scratch,
        )  # fmt: skip
        return RocmCompressGatherSplitKey(num_splits=num_splits, num_warps=4, over_2gb=big)

    def _metas(self, big: bool) -> dict[str, Any]:
        ids = {n: meta_past_2gb((1,), torch.int64, False) for n in ("positions", "slot_mapping")}
        return {
            "state_cache": meta_past_2gb((2, self.state_block_size, 2 * _HEAD), torch.float32, big),
            "token_to_req_indices": meta_past_2gb((1,), torch.int32, False),
            **ids,
            "block_table": meta_past_2gb((1, 2), torch.int32, False),
            "scratch": meta_past_2gb((1, _HEAD), torch.float32, False),
        }

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        for splits in SPLITS:  # the CU count and the step's prefill rows pick it (module docstring)
            for big in (True, False):  # the state cache is a view of the KV pool
                yield {**self._metas(big), "num_splits": splits}

    def warmup_inputs(self, key: RocmCompressGatherSplitKey) -> Mapping[str, Any]:
        return {**self._metas("state_cache" in key.over_2gb), "num_splits": key.num_splits}

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        scratch: torch.Tensor,
        *,
        num_splits: int,
    ) -> warmreg.LaunchSpec[RocmCompressGatherSplitKey]:
        """Pool the closing windows of the ``S`` rows into ``scratch[:S]`` (in place; returned).

        :param state_cache: float32 ``[pages, page_size, 1024]`` C128 compressor states, last dim contiguous.
        :param token_to_req_indices: int32 ``[>= S]``; ``positions`` int64 ``[>= S]``.
        :param slot_mapping: int64 ``[S]``: each row's state slot, ``-1`` for none.
        :param block_table: int32 ``[R, W]`` (contiguous rows): the state pages of each request.
        :param scratch: float32 ``[>= S, 512]`` with contiguous rows.
        :param num_splits: programs a row, one of :data:`SPLITS` (:func:`compress_num_splits`).
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        s = check_ids(self.name, positions, slot_mapping, token_to_req_indices=token_to_req_indices)
        check_scratch(self.name, scratch, s)
        if num_splits not in SPLITS:
            raise warmreg.LaunchError(self.name, f"num_splits must be one of {SPLITS} (got {num_splits})")
        if state_cache.dtype != torch.float32 or state_cache.ndim != 3 or state_cache.shape[-1] != 2 * _HEAD or (
            state_cache.stride(-1) != 1
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"state_cache must be float32 [pages, page_size, {2 * _HEAD}] (got "
                                      f"{state_cache.dtype} {tuple(state_cache.shape)})")  # fmt: skip
        if block_table.dtype != torch.int32 or block_table.ndim != 2 or (
            block_table.shape[1] > 1 and block_table.stride(1) != 1
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, "block_table must be int32 [R, W] with contiguous rows")
        key = self.dispatch(
            num_splits=num_splits, state_cache=state_cache, token_to_req_indices=token_to_req_indices,
            positions=positions, slot_mapping=slot_mapping, block_table=block_table, scratch=scratch,
        )  # fmt: skip
        kwargs = dict(
            state_ptr=state_cache, state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            positions_ptr=positions, slot_mapping_ptr=slot_mapping, token_to_req_ptr=token_to_req_indices,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            state_block_size=state_cache.shape[1], scratch_ptr=scratch, scratch_stride=scratch.stride(0), HEAD=_HEAD,
            RATIO=_RATIO, SPLITS=key.num_splits,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (s * num_splits,) if s else None, kwargs, scratch)


@attrs.frozen(kw_only=True)
class RocmCompressFinalizeKey(warmreg.CompileKey):
    """What changes stage 2's binary: the weight's dtype, gfx950's sanitizing, the warps, and which tensors' storage
    is past 2 GB."""

    weight_dtype: str
    sanitize_nans: bool
    num_warps: int
    over_2gb: tuple[str, ...]


class RocmCompressFinalize(warmreg.TritonKernel[RocmCompressFinalizeKey]):
    """Stage 2: RMSNorm, FP8 quant, RoPE and insert of each closing row's pooled scratch row into the C128
    ``fp8_ds_mla`` cache; see the module docstring.

    :param kv_block_size: the compressed cache's tokens a page; ``weight_dtype`` the RMSNorm weight's dtype name;
        ``sanitize_nans``: gfx950.
    """

    name = "deepseek_v4.rocm_compress_finalize"
    key_type = RocmCompressFinalizeKey
    jit = _compress_finalize_kernel

    def __init__(self, *, kv_block_size: int = 64, weight_dtype: str = "bfloat16", sanitize_nans: bool = False) -> None:
        self.kv_block_size, self.weight_dtype, self.sanitize_nans = kv_block_size, weight_dtype, sanitize_nans

    def dispatch(
        self,
        *,
        sanitize_nans: bool,
        scratch: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
    ) -> RocmCompressFinalizeKey:
        big = over_2gb_names(
            scratch=scratch, positions=positions, slot_mapping=slot_mapping, norm_weight=norm_weight,
            cos_sin_cache=cos_sin_cache, kv_cache=kv_cache, kv_slot_mapping=kv_slot_mapping,
        )  # fmt: skip
        return RocmCompressFinalizeKey(
            weight_dtype=warmreg.dtype_name(norm_weight.dtype), sanitize_nans=sanitize_nans, num_warps=4, over_2gb=big
        )

    def _metas(self, weight_dtype: str, big: bool) -> dict[str, Any]:
        return {
            "scratch": meta_past_2gb((1, _HEAD), torch.float32, False),
            **{n: meta_past_2gb((1,), torch.int64, False) for n in ("positions", "slot_mapping")},
            "norm_weight": meta_past_2gb((_HEAD,), getattr(torch, weight_dtype), False),
            "cos_sin_cache": meta_past_2gb((2, _ROPE), torch.float32, False),
            "kv_cache": meta_past_2gb((2, self.kv_block_size, _TOKEN + _SCALE), torch.uint8, big),
            "kv_slot_mapping": meta_past_2gb((1,), torch.int64, False),
        }

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        for big in (True, False):  # the KV cache is a view of the KV pool
            yield {**self._metas(self.weight_dtype, big), "sanitize_nans": self.sanitize_nans}

    def warmup_inputs(self, key: RocmCompressFinalizeKey) -> Mapping[str, Any]:
        return {**self._metas(key.weight_dtype, "kv_cache" in key.over_2gb), "eps": 1e-6,
                "sanitize_nans": key.sanitize_nans}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        scratch: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        eps: float,
        *,
        sanitize_nans: bool = False,
    ) -> warmreg.LaunchSpec[RocmCompressFinalizeKey]:
        """Insert the entry of every closing row of ``scratch[:S]`` into ``kv_cache`` (in place; returned).

        :param scratch: float32 ``[>= S, 512]`` (contiguous rows): stage 1's pooled rows.
        :param positions: int64 ``[>= S]``; ``slot_mapping`` int64 ``[S]`` (``-1``: no state slot; ``S`` the grid).
        :param norm_weight: ``[512]`` contiguous RMSNorm weight; ``cos_sin_cache`` float32 ``[P, 64]``.
        :param kv_cache: uint8 ``[pages, B, 584]`` ``fp8_ds_mla`` cache (``stride(0)`` its page stride).
        :param kv_slot_mapping: int64 ``[>= S]``: each row's compressed slot, ``-1`` for none.
        :param sanitize_nans: gfx950's NaN-free cache.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        s = check_ids(self.name, positions, slot_mapping, kv_slot_mapping=kv_slot_mapping)
        check_scratch(self.name, scratch, s)
        problems = []
        if norm_weight.shape != (_HEAD,) or norm_weight.stride(0) != 1 or not norm_weight.dtype.is_floating_point:
            problems.append(f"norm_weight must be a contiguous float [{_HEAD}] (got {tuple(norm_weight.shape)})")
        cs = cos_sin_cache
        if cs.dtype != torch.float32 or cs.ndim != 2 or cs.shape[1] != _ROPE or cs.stride(1) != 1:
            problems.append(f"cos_sin_cache must be float32 [P, {_ROPE}] with contiguous rows (got {cs.dtype} "
                            f"{tuple(cs.shape)})")  # fmt: skip
        kv, row = kv_cache, _TOKEN + _SCALE
        if (kv.dtype != torch.uint8 or kv.ndim != 3 or kv.shape[2] != row or kv.stride(2) != 1 or kv.stride(1) != row
                or kv.stride(0) < kv.shape[1] * row or kv.data_ptr() % 2 or kv.stride(0) % 2):  # fmt: skip
            problems.append(f"kv_cache must be uint8 [pages, B, {row}] fp8_ds_mla pages (got {kv.dtype} "
                            f"{tuple(kv.shape)}, strides {kv.stride()})")  # fmt: skip
        if problems:
            raise warmreg.LaunchError(self.name, "; ".join(problems))
        key = self.dispatch(
            sanitize_nans=sanitize_nans, norm_weight=norm_weight, scratch=scratch, positions=positions,
            slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache, kv_cache=kv_cache, kv_slot_mapping=kv_slot_mapping,
        )  # fmt: skip
        kwargs = dict(
            scratch_ptr=scratch, scratch_stride=scratch.stride(0), positions_ptr=positions, slot_mapping_ptr=slot_mapping,
            weight_ptr=norm_weight, eps=eps, cos_sin_ptr=cs, cos_sin_stride=cs.stride(0), kv_cache_ptr=kv,
            kv_slot_mapping_ptr=kv_slot_mapping, kv_block_size=kv.shape[1], kv_block_stride=kv.stride(0), HEAD=_HEAD,
            ROPE=_ROPE, QB=_QB, TOKEN=_TOKEN, SCALE=_SCALE, RATIO=_RATIO, SANITIZE=key.sanitize_nans,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (s,) if s else None, kwargs, kv_cache)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register both stages on ROCm where the model has C128 layers (vLLM's ``_use_two_stage_fused_compressor``:
    ``_prefer_two_stage_compressor()`` is ROCm, the attention compressor's head is 512 with no overlap at ratio 128)."""
    if not model.has_c128:
        return
    registry.add(RocmCompressGatherSplit(state_block_size=C128_STATE_BLOCK_SIZE), when=warmreg.is_rocm)
    finalize = RocmCompressFinalize(
        kv_block_size=compressed_block_size(config, _RATIO), weight_dtype=model.dtype,
        sanitize_nans=platform.is_rocm and platform.arch == "gfx950",
    )  # fmt: skip
    registry.add(finalize, when=warmreg.is_rocm)
