"""ROCm DeepSeek-V4 prefill on aiter's sparse MLA: the top-k rows as global compressed-cache slots (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``build_prefill_topk_ragged_indices``, which launches
``_prefill_topk_global_slots_kernel`` and compacts its dense rows with ``build_ragged_indices_from_dense``).

Prefill row ``i`` is batch token ``t = i + token_offset`` of request ``r = token_to_req[t]``; with ``qs = qsl[r]``,
``pos = seq_lens[r] - (qsl[r + 1] - qs) + t - qs``, ratio ``R``, width ``K`` and compressed block size ``B``::

    lens[i]   = is_valid[t] ? min((pos + 1) // R, K) : 0          (only that many compressed tokens exist yet)
    dense[i, j] = block_table[r, l // B] * B + l % B   if j < lens[i] and 0 <= l < num_compressed   (l = topk[i, j])
                  -1                                   otherwise, for every j < K

then :func:`~.rocm_ragged.rocm_ragged_from_dense` (bounded by the cache rows ``num_rows``) gives the stream aiter's
sparse MLA reads. Grid ``(n,)``, a program a row over ``BLOCK_W = min(next_pow2(K), 1024)`` column tiles.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_prefill_aiter`` of every C4 layer (``topk_indices_buffer``
rows, ``K = index_topk``, ``B = 64``) and C128 layer (the C128A ``prefill_local`` rows, ``K`` the step's C128 width,
``B = 2``), when prefill takes aiter's sparse MLA (:func:`._rocm_attention.aiter_sparse_mla_prefill`: gfx950,
``+aiter``, ``serving.rocm_aiter_triton_sparse_mla``, at most 64 heads a rank).

Key: ``K``, ``R``, ``B`` and the tile (constexprs, as in vLLM) and the warps. ``token_offset``, ``num_compressed`` and
the strides are runtime ints (``do_not_specialize``) and no input pointer is specialized on alignment (slices of
persistent buffers); the outputs are fresh or checked aligned buffers. Every buffer is far below 2 GB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table, out_parts
from ._rocm_attention import aiter_sparse_mla_prefill
from ._serving import max_model_len
from .backends import c128_widths, compressed_block_size
from .model import DSV4
from .rocm_ragged import RocmRaggedCompact, RocmRaggedCount, rocm_ragged_from_dense

__all__ = [
    "RocmPrefillTopkSlots",
    "RocmPrefillTopkSlotsKey",
    "prefill_topk_slots_reference",
    "register",
    "rocm_prefill_topk_ragged",
]

_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["topk_stride", "block_table_stride", "token_offset", "num_compressed"],
    do_not_specialize_on_alignment=[
        "topk_ptr", "token_to_req_ptr", "query_start_loc_ptr", "seq_lens_ptr", "is_valid_ptr", "block_table_ptr",
    ],
)  # fmt: skip
def _prefill_topk_slots_kernel(
    out_ptr,
    lens_ptr,
    topk_ptr,
    topk_stride,
    token_to_req_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    is_valid_ptr,
    block_table_ptr,
    block_table_stride,
    token_offset,
    num_compressed,
    TOPK: tl.constexpr,  # the row width K (index_topk, or the step's C128 width): also the out row stride
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio: causal compressed count
    BLOCK_SIZE: tl.constexpr,  # compressed tokens a cache page (256 // ratio)
    BLOCK_W: tl.constexpr,  # the column tile: min(next_pow2(K), 1024)
):
    row = tl.program_id(0).to(tl.int64)
    token = row + token_offset
    req = tl.load(token_to_req_ptr + token).to(tl.int64)
    q0 = tl.load(query_start_loc_ptr + req)
    pos = tl.load(seq_lens_ptr + req) - (tl.load(query_start_loc_ptr + req + 1) - q0) + token - q0
    row_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOPK)
    row_len = tl.where(tl.load(is_valid_ptr + token), row_len, 0)
    for start in tl.range(0, TOPK, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        local = tl.load(topk_ptr + row * topk_stride + cols, mask=cols < row_len, other=-1)
        valid = (cols < row_len) & (local >= 0) & (local < num_compressed)
        local = tl.where(valid, local, 0)
        page = tl.load(block_table_ptr + req * block_table_stride + local // BLOCK_SIZE, mask=valid, other=0)
        slot = tl.where(valid, page * BLOCK_SIZE + local % BLOCK_SIZE, -1)
        tl.store(out_ptr + row * TOPK + cols, slot.to(tl.int32), mask=cols < TOPK)
    tl.store(lens_ptr + row, row_len.to(tl.int32))


@attrs.frozen(kw_only=True)
class RocmPrefillTopkSlotsKey(warmreg.CompileKey):
    """What changes the binary of the slot mapping: the width, ratio, page size, tile (constexprs) and warps."""

    topk: int
    compress_ratio: int
    block_size: int
    block_w: int
    num_warps: int


class RocmPrefillTopkSlots(warmreg.TritonKernel[RocmPrefillTopkSlotsKey]):
    """Dense global slots of the prefill top-k rows and their lengths; see the module docstring."""

    name = "deepseek_v4.rocm_prefill_topk_slots"
    key_type = RocmPrefillTopkSlotsKey
    jit = _prefill_topk_slots_kernel

    def dispatch(self, *, topk_indices: torch.Tensor, compress_ratio: int, block_size: int) -> RocmPrefillTopkSlotsKey:
        topk = topk_indices.shape[1]
        return RocmPrefillTopkSlotsKey(
            topk=topk, compress_ratio=compress_ratio, block_size=block_size,
            block_w=min(warmreg.next_pow2(topk), 1024), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        widths = tuple(c128_widths(max_model_len(config))) if model.has_c128 else ()
        return {
            "compress_ratio": [r for r in (4, 128) if r in model.ratios],
            "topk_indices": [warmreg.meta((1, k), torch.int32) for k in sorted({model.index_topk, *widths})],
            "block_size": sorted({compressed_block_size(config, 4), compressed_block_size(config, 128)}),
            "c4_topk": [model.index_topk],  # the three below are read by when() only
            "c128_widths": [widths],
            "page": [compressed_block_size(config, 1)],
        }

    def when(
        self,
        *,
        compress_ratio: int,
        topk_indices: torch.Tensor,
        block_size: int,
        c4_topk: int,
        c128_widths: tuple[int, ...],
        page: int,
        **_: Any,
    ) -> bool:
        """A C4 layer's rows are ``index_topk`` wide, a C128 layer's a C128 width; pages hold ``256 // ratio``."""
        if block_size != page // compress_ratio:
            return False
        topk = topk_indices.shape[1]
        return topk == c4_topk if compress_ratio == 4 else topk in c128_widths

    def warmup_inputs(self, key: RocmPrefillTopkSlotsKey) -> Mapping[str, Any]:
        vector = warmreg.meta((1,), torch.int32)
        return {
            "topk_indices": warmreg.meta((1, key.topk), torch.int32),
            "token_to_req_indices": vector,
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "seq_lens": vector,
            "is_valid_token": warmreg.meta((1,), torch.bool),
            "block_table": warmreg.meta((1, 16), torch.int32),
            "block_size": key.block_size,
            "compress_ratio": key.compress_ratio,
            "num_compressed": 1,
            "token_offset": 0,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        *,
        block_size: int,
        compress_ratio: int,
        num_compressed: int,
        token_offset: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RocmPrefillTopkSlotsKey]:
        """``(dense [n, K], lens [n])`` int32 slots of the prefill rows (fresh, or ``out``).

        :param topk_indices: int32 ``[n, K]`` local compressed positions of the prefill tokens, contiguous within a
            row (any row stride: C128's rows are a column slice of a wider buffer).
        :param token_to_req_indices: int32 batch-wide token -> request; ``query_start_loc`` int32 ``[R + 1]``,
            ``seq_lens`` int32 ``[R]``, ``is_valid_token`` bool batch-wide, ``block_table`` int32 ``[R, W]`` (the
            layer's), all batch-wide: the prefill tokens sit at ``token_offset`` (the decode tokens before them).
        :param block_size: compressed tokens a page (``256 // compress_ratio``); ``compress_ratio`` the layer's.
        :param num_compressed: the exclusive bound on local positions (``cdiv(max_model_len, compress_ratio)``).
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[n, K]`` and ``[n]``, contiguous,
            16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or layouts, sizes below 1, or an ``out`` unlike the
            fresh outputs.
        """
        if (
            topk_indices.dtype != torch.int32
            or topk_indices.ndim != 2
            or (topk_indices.shape[1] > 1 and topk_indices.stride(1) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"topk_indices must be int32 [n, K] with contiguous rows (got "
                                      f"{topk_indices.dtype} {tuple(topk_indices.shape)}, strides {topk_indices.stride()})")  # fmt: skip
        for what, t, dtype in (
            ("token_to_req_indices", token_to_req_indices, torch.int32), ("query_start_loc", query_start_loc, torch.int32),
            ("seq_lens", seq_lens, torch.int32), ("is_valid_token", is_valid_token, torch.bool),
        ):  # fmt: skip
            if t.dtype != dtype or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(
                    self.name, f"{what} must be a contiguous 1-D {dtype} tensor (got {t.dtype} {tuple(t.shape)})"
                )
        check_int32_table(self.name, "block_table", block_table, 0)
        if min(block_size, compress_ratio) < 1 or token_offset < 0:
            raise warmreg.LaunchError(self.name, "block_size and compress_ratio must be >= 1, token_offset >= 0")
        rows, topk = topk_indices.shape
        key = self.dispatch(topk_indices=topk_indices, compress_ratio=compress_ratio, block_size=block_size)
        out_dense, out_lens = out_parts(self.name, out, 2)
        dense = warmreg.output(self.name, "out[0]", out_dense, (rows, topk), torch.int32, topk_indices.device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (rows,), torch.int32, topk_indices.device)
        kwargs = dict(
            out_ptr=dense, lens_ptr=lens, topk_ptr=topk_indices, topk_stride=topk_indices.stride(0),
            token_to_req_ptr=token_to_req_indices, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            is_valid_ptr=is_valid_token, block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            token_offset=token_offset, num_compressed=num_compressed, TOPK=key.topk, COMPRESS_RATIO=key.compress_ratio,
            BLOCK_SIZE=key.block_size, BLOCK_W=key.block_w,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,) if rows and topk else None, kwargs, (dense, lens))


def rocm_prefill_topk_ragged(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    num_compressed: int,
    token_offset: int,
    num_rows: int = -1,
    *,
    slots: RocmPrefillTopkSlots | None = None,
    count: RocmRaggedCount | None = None,
    compact: RocmRaggedCompact | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drop-in for vLLM's ``build_prefill_topk_ragged_indices`` (same positional arguments): ``(flat, indptr)``.

    :param slots: the slot-mapping op to launch (a fresh one by default); ``count`` and ``compact`` the ragged ops.
    :raises warmreg.LaunchError: as the ops.
    """
    topk_indices = topk_indices.reshape(topk_indices.shape[0], -1)
    rows, width = topk_indices.shape
    if rows and width:
        dense, lens = (slots or RocmPrefillTopkSlots())(
            topk_indices, token_to_req_indices, query_start_loc, seq_lens, is_valid_token, block_table,
            block_size=block_size, compress_ratio=compress_ratio, num_compressed=num_compressed, token_offset=token_offset,
        )  # fmt: skip
    else:
        dense = torch.empty((rows, width), dtype=torch.int32, device=topk_indices.device)
        lens = torch.zeros(rows, dtype=torch.int32, device=topk_indices.device)
    return rocm_ragged_from_dense(dense, lens, num_rows, count=count, compact=compact)


def prefill_topk_slots_reference(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    compress_ratio: int,
    num_compressed: int,
    token_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmPrefillTopkSlots`: ``(dense [n, K], lens [n])`` int32."""
    rows, topk = topk_indices.shape
    dense = torch.full((rows, topk), -1, dtype=torch.int64)
    lens = torch.zeros(rows, dtype=torch.int64)
    cols = torch.arange(topk)
    for i in range(rows):
        t = i + token_offset
        r = int(token_to_req_indices[t])
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        pos = int(seq_lens[r]) - (q1 - q0) + t - q0
        n = min((pos + 1) // compress_ratio, topk) if bool(is_valid_token[t]) else 0
        local = topk_indices[i].long()
        valid = (cols < n) & (local >= 0) & (local < num_compressed)
        safe = torch.where(valid, local, 0)
        pages = block_table[r].long()[safe // block_size]
        dense[i] = torch.where(valid, pages * block_size + safe % block_size, -1)
        lens[i] = n
    return dense.to(torch.int32), lens.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the slot mapping when prefill takes aiter's sparse MLA (see the module docstring) and the model has
    compressed (C4 or C128) layers."""
    on = aiter_sparse_mla_prefill(config, model, platform) and (model.has_c4 or model.has_c128)
    registry.add(RocmPrefillTopkSlots(), when=warmreg.is_rocm if on else False)
