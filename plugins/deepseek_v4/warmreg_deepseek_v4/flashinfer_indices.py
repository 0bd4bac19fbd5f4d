"""DeepSeek-V4 FlashInfer mixed sparse indices: a decode-first batch as one index matrix (vLLM 0.33
``models/common/ops/cache_utils.py``: ``BuildFlashinferMixedSparseIndicesKernel``).

Row ``t`` of ``sparse_indices [T, SW_TOTAL + PADDED_TOP_K]`` lists the KV slots token ``t`` attends to:
the SWA region ``[0, SW_TOTAL)`` (``SW_TOTAL = SWA_INDEX_WIDTH + IMAGE_WIDTH``) then the compressed
region (``PADDED_TOP_K = round_up(max(TOP_K, DCT), 4)`` columns, so rows start 16-byte aligned). Every
slot is remapped ``v >= 0 ? (v // bs) * span + v % bs : -1`` with its cache's page size and span.

Decode rows (``t < nd``; causal: ``SWA_INDEX_WIDTH == WINDOW_SIZE``)::

    swa  = decode_swa_indices[t, :SWA_INDEX_WIDTH] (global SWA slots, :mod:`.swa_indices`), then -1 up to SW_TOTAL
    v[j] = j < DCT ? decode_compressed[t, j] : -1
    C4   (local):     v = v >= 0 ? cbt[req, v // cbs] * cbs + v % cbs : -1;  clen = #(v >= 0 & is_valid[t])
    C128 (has lens):  clen = decode_compressed_lens[t]          otherwise: clen = DCT
    lens[t] = SW_TOTAL + clen

Prefill rows (``r = token_to_req[t]``, ``pos = seq_lens[r] - qlen[r] + t - query_start_loc[r]``)::

    left_add = max(left_visible[t] - (W - 1), 0);   right = right_visible[t]        (images; else 0)
    start = max(pos - (W - 1) - left_add, 0);        swa_len = pos + right - start + 1
    swa[c] = c < swa_len ? sbt[r, (start + c) // sbs] * sbs + (start + c) % sbs : -1      for c < SW_TOTAL
    topk_len = min((pos + 1) // COMPRESS_RATIO, TOP_K)
    l = j < prefill_topk_width and j < topk_len ? prefill_topk[t - nd, j] : -1
    comp[j] = l >= 0 ? cbt[r, l // cbs] * cbs + l % cbs : -1;     lens[t] = SW_TOTAL + topk_len

DSpark's non-causal decode rows (``SWA_INDEX_WIDTH > WINDOW_SIZE``, the draft step's rows of
:mod:`.dspark_swa_indices`: ``L = min(ctx, W) + qlen`` live entries of every token of a request, ``ctx`` its
context before the draft block and ``q`` the token's place in the block)::

    wlen = min(ctx + q + 1, W);   spill = min(ctx, W) + qlen - wlen;   cstart = W + spill   (pad token: 0, 0)
    sparse[t, c] = c < wlen ? swa[c] : -1                                 for c < W
    sparse[t, c] = c < cstart ? swa[c - W + wlen] : -1                    for W <= c < SW_TOTAL (and c < cstart)
    sparse[t, cstart + j] = the compressed entries (as above);  -1 after them, to the row's end
    lens[t] = cstart + clen

so the causal window holds the first visible entries and no -1 sits inside either active range. A row entry
past the row (``c - W + wlen >= SWA_INDEX_WIDTH``, only when a block is wider than ``N``) reads as -1, where
vLLM's kernel would read the next row. Keys with a non-causal width are planned for the draft layers' ratios
only, without prefill tokens (a draft batch is all decode). Every integer that is not a constexpr is
``do_not_specialize`` and every pointer ``do_not_specialize_on_alignment`` (rows are addressed through
runtime strides), so the key is the vLLM one: the constexprs and ``num_warps``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import max_model_len
from .backends import FLASHINFER_SPARSE, attention_backend, c128_widths
from .dspark import DSparkDraft
from .model import DSV4

__all__ = [
    "FlashInferMixedSparseIndices",
    "FlashInferMixedSparseIndicesKey",
    "flashinfer_mixed_sparse_indices_reference",
    "register",
]

_INTS = [
    "out_stride", "decode_swa_stride", "decode_compressed_stride", "prefill_topk_stride", "prefill_topk_width",
    "swa_block_table_stride", "swa_block_size", "swa_span", "compressed_block_table_stride",
    "compressed_block_size", "compressed_span", "num_decode_tokens",
]  # fmt: skip
_POINTERS = [
    "out_ptr", "lens_ptr", "decode_swa_ptr", "decode_compressed_ptr", "decode_compressed_lens_ptr",
    "decode_is_valid_ptr", "prefill_topk_ptr", "token_to_req_ptr", "seq_lens_ptr", "query_start_loc_ptr",
    "left_visible_ptr", "right_visible_ptr", "swa_block_table_ptr", "compressed_block_table_ptr",
]  # fmt: skip


@triton.jit
def _remap(v, block_size, span):
    return tl.where(v >= 0, (v // block_size) * span + v % block_size, -1)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _flashinfer_mixed_sparse_indices_kernel(
    out_ptr,
    lens_ptr,
    decode_swa_ptr,
    decode_compressed_ptr,
    decode_compressed_lens_ptr,
    decode_is_valid_ptr,
    prefill_topk_ptr,
    token_to_req_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    left_visible_ptr,
    right_visible_ptr,
    swa_block_table_ptr,
    compressed_block_table_ptr,
    out_stride,
    decode_swa_stride,
    decode_compressed_stride,
    prefill_topk_stride,
    prefill_topk_width,
    swa_block_table_stride,
    swa_block_size,
    swa_span,
    compressed_block_table_stride,
    compressed_block_size,
    compressed_span,
    num_decode_tokens,
    WINDOW_SIZE: tl.constexpr,  # the sliding window (128)
    SWA_INDEX_WIDTH: tl.constexpr,  # SWA columns of a decode row (WINDOW_SIZE: causal; wider: DSpark non-causal)
    IMAGE_WIDTH: tl.constexpr,  # extra SWA columns for image spans (0 for text; else left/right visibility)
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio (1 SWA-only, 4, 128): causal compressed count
    TOP_K: tl.constexpr,  # prefill compressed top-k (0 when the batch has no prefill or the layer is SWA-only)
    PADDED_TOP_K: tl.constexpr,  # compressed columns: round_up(max(TOP_K, DCT), 4)
    DECODE_COMPRESSED_TOPK: tl.constexpr,  # decode compressed columns DCT (index_topk, the C128 width, or 0)
    DECODE_COMPRESSED_INDICES_ARE_LOCAL: tl.constexpr,  # C4: decode indices go through the block table
    HAS_DECODE_COMPRESSED_LENS: tl.constexpr,  # C128: decode lens come from the C128A metadata
    WINDOW_BLOCK_SIZE: tl.constexpr,  # SWA tile: next_pow2(SWA_INDEX_WIDTH)
    TOPK_BLOCK_SIZE: tl.constexpr,  # compressed tile: next_pow2(max(PADDED_TOP_K, 1))
):
    SW_TOTAL: tl.constexpr = SWA_INDEX_WIDTH + IMAGE_WIDTH
    t = tl.program_id(0).to(tl.int64)
    row = out_ptr + t * out_stride
    req = tl.load(token_to_req_ptr + t).to(tl.int64)
    k = tl.arange(0, TOPK_BLOCK_SIZE)
    cbt_row = compressed_block_table_ptr + req * compressed_block_table_stride
    if t < num_decode_tokens:
        # DSpark's non-causal rows (SWA_INDEX_WIDTH > WINDOW_SIZE): the first min(WINDOW_SIZE, causal count)
        # entries of the row fill the causal window, the rest of the row follows from column WINDOW_SIZE on,
        # and the compressed region starts right after it
        NONCAUSAL: tl.constexpr = SWA_INDEX_WIDTH > WINDOW_SIZE
        cstart = SW_TOTAL
        if NONCAUSAL:
            nq0 = tl.load(query_start_loc_ptr + req)
            nqlen = tl.load(query_start_loc_ptr + req + 1) - nq0
            ctx = tl.load(seq_lens_ptr + req) - nqlen
            in_q = (t - nq0).to(tl.int32)
            block_token = (in_q >= 0) & (in_q < nqlen)  # a graph pad token outside its request: a causal pad row
            wlen = tl.where(block_token, tl.minimum(ctx + in_q + 1, WINDOW_SIZE), 0)
            spill = tl.where(block_token, tl.minimum(ctx, WINDOW_SIZE) + nqlen - wlen, 0)
            cstart = WINDOW_SIZE + spill
        for c0 in tl.static_range(0, SW_TOTAL, WINDOW_BLOCK_SIZE):
            c = c0 + tl.arange(0, WINDOW_BLOCK_SIZE)
            if NONCAUSAL:
                src = tl.where(c >= WINDOW_SIZE, c - WINDOW_SIZE + wlen, c)
                ok = tl.where(c >= WINDOW_SIZE, c < cstart, c < wlen) & (src < SWA_INDEX_WIDTH)
                v = tl.load(decode_swa_ptr + t * decode_swa_stride + src, mask=ok, other=-1)
                tl.store(row + c, _remap(v, swa_block_size, swa_span), mask=(c < SW_TOTAL) & (c < cstart))
            else:
                v = tl.load(decode_swa_ptr + t * decode_swa_stride + c, mask=c < SWA_INDEX_WIDTH, other=-1)
                tl.store(row + c, _remap(v, swa_block_size, swa_span), mask=c < SW_TOTAL)
        if DECODE_COMPRESSED_TOPK > 0:
            v = tl.load(
                decode_compressed_ptr + t * decode_compressed_stride + k, mask=k < DECODE_COMPRESSED_TOPK, other=-1
            )
        else:
            v = tl.full((TOPK_BLOCK_SIZE,), -1, tl.int32)
        if DECODE_COMPRESSED_INDICES_ARE_LOCAL:
            ok = v >= 0
            page = tl.load(cbt_row + v // compressed_block_size, mask=ok, other=0)
            v = tl.where(ok, page * compressed_block_size + v % compressed_block_size, -1)
            token_ok = tl.load(decode_is_valid_ptr + t)
            clen = tl.sum((ok & token_ok).to(tl.int32), axis=0)
        elif HAS_DECODE_COMPRESSED_LENS:
            clen = tl.load(decode_compressed_lens_ptr + t)
        else:
            clen = tl.full((), DECODE_COMPRESSED_TOPK, tl.int32)
        tl.store(row + cstart + k, _remap(v, compressed_block_size, compressed_span), mask=k < PADDED_TOP_K)
        if NONCAUSAL:  # the columns the shifted compressed region leaves at the end of the row
            for f0 in tl.static_range(0, SW_TOTAL - WINDOW_SIZE, WINDOW_BLOCK_SIZE):
                f = f0 + tl.arange(0, WINDOW_BLOCK_SIZE)
                pad = tl.full((WINDOW_BLOCK_SIZE,), -1, tl.int32)
                tl.store(row + cstart + PADDED_TOP_K + f, pad, mask=f < SW_TOTAL - cstart)
        tl.store(lens_ptr + t, cstart + clen)
    else:  # names differ from the decode branch: a name bound in both arms must keep one type
        q0 = tl.load(query_start_loc_ptr + req)
        qlen = tl.load(query_start_loc_ptr + req + 1) - q0
        pos = (tl.load(seq_lens_ptr + req) - qlen + (t - q0)).to(tl.int64)
        if IMAGE_WIDTH > 0:
            left_add = tl.maximum(tl.load(left_visible_ptr + t).to(tl.int64) - (WINDOW_SIZE - 1), 0)
            right = tl.load(right_visible_ptr + t).to(tl.int64)
        else:
            left_add = 0
            right = 0
        start = tl.maximum(pos - (WINDOW_SIZE - 1) - left_add, 0)
        swa_len = pos + right - start + 1
        sbt_row = swa_block_table_ptr + req * swa_block_table_stride
        for s0 in tl.static_range(0, SW_TOTAL, WINDOW_BLOCK_SIZE):
            s = s0 + tl.arange(0, WINDOW_BLOCK_SIZE)
            s_live = (s < swa_len) & (s < SW_TOTAL)
            p = start + s
            s_page = tl.load(sbt_row + p // swa_block_size, mask=s_live, other=0)
            s_slot = tl.where(s_live, s_page * swa_block_size + p % swa_block_size, -1)
            tl.store(row + s, _remap(s_slot, swa_block_size, swa_span), mask=s < SW_TOTAL)
        topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
        if TOP_K > 0:
            local = tl.load(
                prefill_topk_ptr + (t - num_decode_tokens) * prefill_topk_stride + k,
                mask=(k < prefill_topk_width) & (k < topk_len),
                other=-1,
            )
            l_ok = local >= 0
            l_page = tl.load(cbt_row + local // compressed_block_size, mask=l_ok, other=0)
            slot = tl.where(l_ok, l_page * compressed_block_size + local % compressed_block_size, -1)
        else:
            slot = tl.full((TOPK_BLOCK_SIZE,), -1, tl.int32)
        tl.store(row + SW_TOTAL + k, _remap(slot, compressed_block_size, compressed_span), mask=k < PADDED_TOP_K)
        tl.store(lens_ptr + t, (SW_TOTAL + topk_len).to(tl.int32))


@attrs.frozen(kw_only=True)
class FlashInferMixedSparseIndicesKey(warmreg.CompileKey):
    """What changes the binary: the vLLM CompileKey (every constexpr) plus ``num_warps``.

    Optional pointers follow the constexprs: ``decode_compressed`` is None iff DCT == 0, the decode
    lens iff not ``has_decode_compressed_lens``, ``decode_is_valid_token`` iff not local,
    ``prefill_topk`` iff ``top_k == 0``, the visibility pair iff ``image_width == 0``.
    """

    window_size: int
    swa_index_width: int
    image_width: int
    compress_ratio: int
    top_k: int
    padded_top_k: int
    decode_compressed_topk: int
    decode_compressed_indices_are_local: bool
    has_decode_compressed_lens: bool
    window_block_size: int
    topk_block_size: int
    num_warps: int


class FlashInferMixedSparseIndices(warmreg.TritonKernel[FlashInferMixedSparseIndicesKey]):
    """The FlashInfer DeepSeek-V4 sparse index matrix of a decode-first batch (see the module docstring).

    One kernel serves the three layer types: SWA-only (ratio 1), C4 (local decode indices, per-layer)
    and C128 (global decode indices with lens, one width ``W`` per step).

    :param window_size: the sliding window (``sliding_window``).
    :param draft: the DSpark draft, if any: its non-causal width and draft-layer ratios widen the domains.
    """

    name = "deepseek_v4.flashinfer_mixed_sparse_indices"
    key_type = FlashInferMixedSparseIndicesKey
    jit = _flashinfer_mixed_sparse_indices_kernel

    def __init__(self, *, window_size: int, draft: DSparkDraft | None = None) -> None:
        self.window_size, self.draft = window_size, draft

    def dispatch(
        self, *, compress_ratio: int, swa_index_width: int, image_width: int, decode_compressed_topk: int, top_k: int
    ) -> FlashInferMixedSparseIndicesKey:
        padded = triton.cdiv(max(top_k, decode_compressed_topk), 4) * 4
        window_block, topk_block = warmreg.next_pow2(swa_index_width), warmreg.next_pow2(max(padded, 1))
        return FlashInferMixedSparseIndicesKey(
            window_size=self.window_size,
            swa_index_width=swa_index_width,
            image_width=image_width,
            compress_ratio=compress_ratio,
            top_k=top_k,
            padded_top_k=padded,
            decode_compressed_topk=decode_compressed_topk,
            decode_compressed_indices_are_local=compress_ratio == 4,
            has_decode_compressed_lens=compress_ratio == 128,
            window_block_size=window_block,
            topk_block_size=topk_block,
            num_warps=4 if max(window_block, topk_block) >= 256 else 1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        widths = c128_widths(max_model_len(config)) if model.has_c128 else []
        compressed = sorted({0, model.index_topk, *widths})
        return {
            "compress_ratio": sorted(set(model.ratios)),
            "swa_index_width": sorted({self.window_size, *([self.draft.index_width] if self.draft else [])}),
            "image_width": sorted({0, model.vision_max_n_token}),
            "decode_compressed_topk": compressed,
            "top_k": compressed,
            "c4_top_k": [model.index_topk],  # the two below are read by when() only
            "c128_widths": [tuple(widths)],
            "draft_ratios": [tuple(sorted(set(self.draft.ratios))) if self.draft else ()],
        }

    def when(
        self,
        *,
        compress_ratio: int,
        decode_compressed_topk: int,
        top_k: int,
        c4_top_k: int,
        c128_widths: tuple[int, ...],
        swa_index_width: int,
        draft_ratios: tuple[int, ...],
        **_: Any,
    ) -> bool:
        """The layer type fixes DCT; ``top_k`` is 0 (no prefill in the batch) or the layer's top-k; a non-causal
        width only for a draft layer's ratio, with no prefill."""
        if swa_index_width != self.window_size and (compress_ratio not in draft_ratios or top_k):
            return False
        if compress_ratio == 4:
            return decode_compressed_topk == c4_top_k and top_k in (0, c4_top_k)
        if compress_ratio == 128:
            return decode_compressed_topk in c128_widths and top_k in (0, decode_compressed_topk)
        return decode_compressed_topk == 0 and top_k == 0

    def warmup_inputs(self, key: FlashInferMixedSparseIndicesKey) -> Mapping[str, Any]:
        i32, dct = torch.int32, key.decode_compressed_topk
        vis = warmreg.meta((2,), i32) if key.image_width else None
        return {
            "decode_swa_indices": warmreg.meta((1, key.swa_index_width), i32),
            "decode_compressed": warmreg.meta((1, dct), i32) if dct else None,
            "decode_compressed_lens": warmreg.meta((1,), i32) if key.has_decode_compressed_lens else None,
            "decode_is_valid_token": warmreg.meta((1,), torch.bool)
            if key.decode_compressed_indices_are_local
            else None,
            "prefill_topk": warmreg.meta((1, key.top_k), i32),
            "token_to_req": warmreg.meta((2,), i32),
            "seq_lens": warmreg.meta((2,), i32),
            "query_start_loc": warmreg.meta((3,), i32),
            "swa_block_table": warmreg.meta((2, 1), i32),
            "compressed_block_table": warmreg.meta((2, 1), i32),
            "compress_ratio": key.compress_ratio,
            "top_k": key.top_k,
            "swa_block_size": 64,
            "compressed_block_size": 1,
            "image_width": key.image_width,
            "left_visible": vis,
            "right_visible": vis,
            # one decode token, plus one prefill token when the key has a prefill top-k
            "num_decode_tokens": 1,
            "num_tokens": 2 if key.top_k else 1,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        decode_swa_indices: torch.Tensor,
        decode_compressed: torch.Tensor | None,
        decode_compressed_lens: torch.Tensor | None,
        decode_is_valid_token: torch.Tensor | None,
        prefill_topk: torch.Tensor | None,
        token_to_req: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        swa_block_table: torch.Tensor,
        compressed_block_table: torch.Tensor | None = None,
        *,
        num_tokens: int,
        num_decode_tokens: int,
        compress_ratio: int,
        top_k: int,
        swa_block_size: int,
        compressed_block_size: int,
        swa_span: int | None = None,
        compressed_span: int | None = None,
        image_width: int = 0,
        left_visible: torch.Tensor | None = None,
        right_visible: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[FlashInferMixedSparseIndicesKey]:
        """Build ``(sparse_indices [T, SW_TOTAL + PADDED_TOP_K], sparse_topk_lens [T])`` int32.

        :param decode_swa_indices: int32 ``[>= nd, SWA_INDEX_WIDTH]`` global SWA slots of decode tokens: the window
            wide (causal, :class:`~.swa_indices.DecodeSwaIndices`) or wider (a DSpark draft's non-causal rows,
            :class:`~.dspark_swa_indices.DSparkSwaIndices`); a 0-row view for a prefill-only batch keeps the width.
        :param decode_compressed: int32 ``[>= nd, DCT]``: C4 local top-k (with ``decode_is_valid_token``
            bool ``[>= nd]``), C128 global slots (with ``decode_compressed_lens`` int32 ``[>= nd]``), or
            ``None`` for an SWA-only layer. Pass the same width for a batch without decode tokens.
        :param prefill_topk: int32 ``[>= T - nd, width]`` local compressed indices of the prefill tokens
            (C4: the indexer's; C128: the C128A ``prefill_local``); ``None`` for SWA-only or no prefill.
        :param token_to_req: int32 ``[>= T]``; ``seq_lens`` int32 ``[reqs]``; ``query_start_loc`` int32 ``[reqs + 1]``.
        :param swa_block_table: int32 ``[reqs, *]`` SWA table; ``compressed_block_table`` the compressed
            cache's (default: the SWA table, as SWA-only layers do).
        :param num_tokens: ``T``; ``num_decode_tokens``: ``nd``, the decode tokens first.
        :param compress_ratio: 1 (SWA-only), 4 or 128.
        :param top_k: the layer's prefill top-k (``index_topk``, the C128 width ``W``, 0 for SWA-only); the
            kernel uses 0 when the batch has no prefill token.
        :param swa_span: page span of the SWA cache in tokens (``page_stride / token_stride``; default the
            page size); likewise ``compressed_span``.
        :param image_width: extra SWA columns for image spans, with ``left_visible``/``right_visible`` int32 ``[T]``.
        :param out: optional persistent ``(indices [>= T, width], lens [>= T])`` buffers (rows past T untouched).
        :raises warmreg.LaunchError: for rows narrower than the window, missing layer inputs, wrong dtypes or sizes.
        """
        T, nd, name = num_tokens, num_decode_tokens, self.name
        swa_width = decode_swa_indices.shape[1] if decode_swa_indices.ndim == 2 else -1
        if swa_width < self.window_size:
            raise warmreg.LaunchError(
                name,
                f"decode_swa_indices width {swa_width} < window {self.window_size}",
                fix="pass causal rows (the window wide) or DSpark's non-causal rows (wider)",
            )
        if compress_ratio not in (1, 4, 128) or not 0 <= nd <= T:
            raise warmreg.LaunchError(
                name, f"compress_ratio={compress_ratio} must be 1, 4 or 128, 0 <= nd={nd} <= T={T}"
            )
        top_k = top_k if T > nd else 0
        cbt = swa_block_table if compressed_block_table is None else compressed_block_table
        _check_inputs(
            name,
            f"compress_ratio={compress_ratio}, top_k={top_k}, image_width={image_width}",
            decode_compressed=(decode_compressed, compress_ratio != 1, torch.int32, 2, nd),
            decode_compressed_lens=(decode_compressed_lens, compress_ratio == 128, torch.int32, 1, nd),
            decode_is_valid_token=(decode_is_valid_token, compress_ratio == 4, torch.bool, 1, nd),
            prefill_topk=(prefill_topk, top_k > 0, torch.int32, 2, T - nd),
            left_visible=(left_visible, image_width > 0, torch.int32, 1, T),
            right_visible=(right_visible, image_width > 0, torch.int32, 1, T),
            decode_swa_indices=(decode_swa_indices, True, torch.int32, 2, nd),
            token_to_req=(token_to_req, True, torch.int32, 1, T),
            seq_lens=(seq_lens, True, torch.int32, 1, 0),
            query_start_loc=(query_start_loc, True, torch.int32, 1, 0),
            swa_block_table=(swa_block_table, True, torch.int32, 2, 0),
            compressed_block_table=(cbt, True, torch.int32, 2, 0),
        )
        dct = decode_compressed.shape[1] if decode_compressed is not None and compress_ratio != 1 else 0
        key = self.dispatch(
            compress_ratio=compress_ratio, swa_index_width=swa_width, image_width=image_width,
            decode_compressed_topk=dct, top_k=top_k,
        )  # fmt: skip
        indices, lens = self._outputs(out, T, key, decode_swa_indices.device)
        img = key.image_width > 0
        kwargs = dict(
            out_ptr=indices, lens_ptr=lens, decode_swa_ptr=decode_swa_indices,
            decode_compressed_ptr=decode_compressed if key.decode_compressed_topk else None,
            decode_compressed_lens_ptr=decode_compressed_lens if key.has_decode_compressed_lens else None,
            decode_is_valid_ptr=decode_is_valid_token if key.decode_compressed_indices_are_local else None,
            prefill_topk_ptr=prefill_topk if key.top_k else None, token_to_req_ptr=token_to_req,
            seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
            left_visible_ptr=left_visible if img else None, right_visible_ptr=right_visible if img else None,
            swa_block_table_ptr=swa_block_table, compressed_block_table_ptr=cbt, out_stride=indices.stride(0),
            decode_swa_stride=decode_swa_indices.stride(0),
            decode_compressed_stride=decode_compressed.stride(0) if key.decode_compressed_topk else 0,  # type: ignore[union-attr]
            prefill_topk_stride=prefill_topk.stride(0) if key.top_k else 0,  # type: ignore[union-attr]
            prefill_topk_width=prefill_topk.shape[1] if key.top_k else 0,  # type: ignore[union-attr]
            swa_block_table_stride=swa_block_table.stride(0), swa_block_size=swa_block_size,
            swa_span=swa_span or swa_block_size, compressed_block_table_stride=cbt.stride(0),
            compressed_block_size=compressed_block_size, compressed_span=compressed_span or compressed_block_size,
            num_decode_tokens=nd, WINDOW_SIZE=key.window_size, SWA_INDEX_WIDTH=key.swa_index_width,
            IMAGE_WIDTH=key.image_width, COMPRESS_RATIO=key.compress_ratio, TOP_K=key.top_k,
            PADDED_TOP_K=key.padded_top_k, DECODE_COMPRESSED_TOPK=key.decode_compressed_topk,
            DECODE_COMPRESSED_INDICES_ARE_LOCAL=key.decode_compressed_indices_are_local,
            HAS_DECODE_COMPRESSED_LENS=key.has_decode_compressed_lens, WINDOW_BLOCK_SIZE=key.window_block_size,
            TOPK_BLOCK_SIZE=key.topk_block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, (indices[:T], lens[:T]))

    def _outputs(
        self,
        out: tuple[torch.Tensor, torch.Tensor] | None,
        T: int,
        key: FlashInferMixedSparseIndicesKey,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = key.swa_index_width + key.image_width + key.padded_top_k
        if out is None:
            return torch.empty((T, width), dtype=torch.int32, device=device), torch.empty(
                (T,), dtype=torch.int32, device=device
            )
        indices, lens = out
        if (
            indices.dtype != torch.int32
            or indices.ndim != 2
            or indices.shape[0] < T
            or indices.shape[1] < width
            or indices.stride(1) != 1
        ):
            raise warmreg.LaunchError(self.name, f"out indices must be int32 [>= {T}, >= {width}] with contiguous rows")
        if lens.dtype != torch.int32 or lens.ndim != 1 or lens.shape[0] < T:
            raise warmreg.LaunchError(self.name, f"out lens must be int32 [>= {T}]")
        return indices, lens


def _check_inputs(name: str, context: str, **inputs: tuple[torch.Tensor | None, bool, torch.dtype, int, int]) -> None:
    """Each input ``(tensor, needed, dtype, ndim, min_rows)``: present when needed, of that dtype, rank and rows."""
    for arg, (tensor, needed, dtype, ndim, rows) in inputs.items():
        if not needed:
            continue
        if tensor is None:
            raise warmreg.LaunchError(name, f"{arg} is required for {context}")
        bad_rows = tensor.ndim != ndim or tensor.shape[0] < rows or (ndim == 2 and tensor.stride(1) != 1)
        if tensor.dtype != dtype or bad_rows:
            raise warmreg.LaunchError(name, f"{arg} must be {dtype} {ndim}-D with >= {rows} rows (contiguous rows)")


def _noncausal_rows(
    rows: torch.Tensor,
    clen: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    window: int,
    width: int,
    sw_total: int,
) -> torch.Tensor:
    """Rewrite decode ``rows`` (remapped, in the causal layout) in place as DSpark's non-causal ones; returns lens."""
    lens = torch.empty(rows.shape[0], dtype=torch.int64)
    for t in range(rows.shape[0]):
        r = int(token_to_req[t])
        q0, qlen = int(query_start_loc[r]), int(query_start_loc[r + 1] - query_start_loc[r])
        ctx, q = int(seq_lens[r]) - qlen, t - q0
        wlen = min(ctx + q + 1, window) if 0 <= q < qlen else 0
        spill = min(ctx, window) + qlen - wlen if 0 <= q < qlen else 0
        cstart, swa, comp = window + spill, rows[t, :sw_total].clone(), rows[t, sw_total:].clone()
        rows[t] = -1
        rows[t, :wlen] = swa[:wlen]
        for c in range(window, min(cstart, sw_total)):
            src = c - window + wlen
            rows[t, c] = swa[src] if src < width else -1  # an entry past the row reads as -1
        n = max(0, min(comp.shape[0], rows.shape[1] - cstart))
        rows[t, cstart : cstart + n] = comp[:n]
        lens[t] = cstart + clen[t]
    return lens


def _remap_ref(v: torch.Tensor, block_size: int, span: int) -> torch.Tensor:
    return torch.where(v >= 0, (v // block_size) * span + v % block_size, -1)


def flashinfer_mixed_sparse_indices_reference(
    decode_swa_indices: torch.Tensor,
    decode_compressed: torch.Tensor | None,
    decode_compressed_lens: torch.Tensor | None,
    decode_is_valid_token: torch.Tensor | None,
    prefill_topk: torch.Tensor | None,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    swa_block_table: torch.Tensor,
    compressed_block_table: torch.Tensor | None = None,
    *,
    num_tokens: int,
    num_decode_tokens: int,
    compress_ratio: int,
    top_k: int,
    swa_block_size: int,
    compressed_block_size: int,
    swa_span: int | None = None,
    compressed_span: int | None = None,
    image_width: int = 0,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
    window_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`FlashInferMixedSparseIndices`.

    :param window_size: the sliding window (default: the decode rows' width, causal); decode rows wider than it
        are DSpark's non-causal rows.
    """
    T, nd, sw = num_tokens, num_decode_tokens, decode_swa_indices.shape[1]
    W = sw if window_size is None else window_size
    sbs, cbs = swa_block_size, compressed_block_size
    sspan, cspan = swa_span or sbs, compressed_span or cbs
    cbt = (swa_block_table if compressed_block_table is None else compressed_block_table).long()
    top_k = top_k if T > nd else 0
    dct = decode_compressed.shape[1] if decode_compressed is not None and compress_ratio != 1 else 0
    sw_total, padded = sw + image_width, triton.cdiv(max(top_k, dct), 4) * 4
    req = token_to_req[:T].long()
    k = torch.arange(padded)
    # decode rows
    swa = torch.full((nd, sw_total), -1, dtype=torch.int64)
    swa[:, :sw] = decode_swa_indices[:nd].long()
    v = torch.full((nd, padded), -1, dtype=torch.int64)
    if dct:
        v[:, :dct] = decode_compressed[:nd].long()  # type: ignore[index]
    if compress_ratio == 4:
        ok = v >= 0
        v = torch.where(ok, cbt[req[:nd, None], torch.where(ok, v // cbs, 0)] * cbs + v % cbs, -1)
        clen = (ok & decode_is_valid_token[:nd, None]).sum(1)  # type: ignore[index]
    elif compress_ratio == 128:
        clen = decode_compressed_lens[:nd].long()  # type: ignore[index]
    else:
        clen = torch.full((nd,), dct)
    decode_rows = torch.cat([_remap_ref(swa, sbs, sspan), _remap_ref(v, cbs, cspan)], dim=1)
    decode_lens = sw_total + clen
    if sw > W:
        decode_lens = _noncausal_rows(
            decode_rows, clen, token_to_req[:nd], seq_lens, query_start_loc, window=W, width=sw, sw_total=sw_total
        )
    # prefill rows
    preq = req[nd:]
    q0 = query_start_loc.long()[preq]
    qlen = query_start_loc.long()[preq + 1] - q0
    pos = seq_lens.long()[preq] - qlen + torch.arange(nd, T) - q0
    left_add: torch.Tensor | int = 0
    right: torch.Tensor | int = 0
    if image_width and left_visible is not None and right_visible is not None:
        left_add = (left_visible[nd:T].long() - (W - 1)).clamp(min=0)
        right = right_visible[nd:T].long()
    start = (pos - (W - 1) - left_add).clamp(min=0)
    swa_len = pos + right - start + 1
    c = torch.arange(sw_total)
    live = c[None, :] < swa_len[:, None]
    p = start[:, None] + c
    page = swa_block_table.long()[preq[:, None], torch.where(live, p // sbs, 0)]
    swa_p = torch.where(live, page * sbs + p % sbs, -1)
    topk_len = torch.clamp((pos + 1) // compress_ratio, max=top_k)
    comp = torch.full((T - nd, padded), -1, dtype=torch.int64)
    if top_k:
        width = min(prefill_topk.shape[1], padded)  # type: ignore[union-attr]
        local = prefill_topk[: T - nd, :width].long()  # type: ignore[index]
        local = torch.where(k[None, :width] < topk_len[:, None], local, -1)
        ok = local >= 0
        comp[:, :width] = torch.where(ok, cbt[preq[:, None], torch.where(ok, local // cbs, 0)] * cbs + local % cbs, -1)
    prefill_rows = torch.cat([_remap_ref(swa_p, sbs, sspan), _remap_ref(comp, cbs, cspan)], dim=1)
    indices = torch.cat([decode_rows, prefill_rows]).to(torch.int32)
    lens = torch.cat([decode_lens, sw_total + topk_len]).to(torch.int32)
    return indices, lens


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the mixed-indices kernel for the FlashInfer DeepSeek-V4 sparse backend (SM100 and newer), with the
    DSpark draft's non-causal rows when DSpark is on."""
    flashinfer = attention_backend(config) == FLASHINFER_SPARSE
    registry.add(
        FlashInferMixedSparseIndices(window_size=model.sliding_window, draft=DSparkDraft.from_config(config, model)),
        when=warmreg.sm_at_least(100) if flashinfer else False,
    )
