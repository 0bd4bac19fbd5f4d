"""The Triton kernel and the PyTorch reference of :mod:`.v41_flashinfer_indices` (the math is in its docstring)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["v41_flashinfer_mixed_kernel", "v41_flashinfer_mixed_reference"]

_UNSPECIALIZED = [
    "out_stride", "decode_swa_stride", "decode_topk_stride", "prefill_topk_stride", "swa_bt_stride", "swa_block_size",
    "swa_span", "c_bt_stride", "c_block_size", "c_span", "num_decode_tokens", "prefill_topk_width",
]  # fmt: skip
_UNALIGNED = [
    "out_ptr", "lens_ptr", "decode_swa_ptr", "decode_topk_ptr", "decode_lens_ptr", "decode_valid_ptr",
    "prefill_topk_ptr", "query_start_loc_ptr", "seq_lens_ptr", "token_to_req_ptr", "replay_start_ptr", "swa_bt_ptr",
    "c_bt_ptr",
]  # fmt: skip


@triton.jit
def _remap(values, block_size, span):
    """Slot ``v`` to FlashInfer's storage offset ``(v // block_size) * span + v % block_size``; -1 stays -1."""
    ok = values >= 0
    safe = tl.where(ok, values, 0)
    return tl.where(ok, (safe // block_size) * span + safe % block_size, -1)


@triton.jit(do_not_specialize=_UNSPECIALIZED, do_not_specialize_on_alignment=_UNALIGNED)
def v41_flashinfer_mixed_kernel(
    out_ptr, out_stride, lens_ptr, decode_swa_ptr, decode_swa_stride, decode_topk_ptr, decode_topk_stride,
    decode_lens_ptr, decode_valid_ptr, prefill_topk_ptr, prefill_topk_stride, query_start_loc_ptr, seq_lens_ptr,
    token_to_req_ptr, replay_start_ptr, swa_bt_ptr, swa_bt_stride, swa_block_size, swa_span, c_bt_ptr, c_bt_stride,
    c_block_size, c_span, num_decode_tokens, prefill_topk_width,
    WINDOW_SIZE: tl.constexpr,  # the sliding window: a model constant
    SWA_INDEX_WIDTH: tl.constexpr,  # SWA columns of a row (the decode rows' width)
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio: 0 (SWA-only), 1 or 2
    TOP_K: tl.constexpr,  # prefill top-k columns (0: SWA-only layer or a step without prefill tokens)
    PADDED_TOP_K: tl.constexpr,  # compressed columns: max(TOP_K, DECODE_TOPK) rounded up to 4 (16-byte rows)
    DECODE_TOPK: tl.constexpr,  # decode compressed columns (0: none)
    DECODE_LOCAL: tl.constexpr,  # decode indices are local: map them through the compressed block table
    HAS_DECODE_LENS: tl.constexpr,  # decode compressed lengths are read, not DECODE_TOPK
    WINDOW_BLOCK: tl.constexpr,  # SWA column tile
    TOPK_BLOCK: tl.constexpr,  # compressed column tile
):  # fmt: skip
    t = tl.program_id(0)
    row = out_ptr + t.to(tl.int64) * out_stride
    req = tl.load(token_to_req_ptr + t)
    if t < num_decode_tokens:
        for i in range(0, SWA_INDEX_WIDTH, WINDOW_BLOCK):
            c = i + tl.arange(0, WINDOW_BLOCK)
            v = tl.load(decode_swa_ptr + t.to(tl.int64) * decode_swa_stride + c, mask=c < SWA_INDEX_WIDTH, other=-1)
            tl.store(row + c, _remap(v, swa_block_size, swa_span), mask=c < SWA_INDEX_WIDTH)
        count = tl.zeros((), dtype=tl.int32)
        for i in range(0, PADDED_TOP_K, TOPK_BLOCK):
            c = i + tl.arange(0, TOPK_BLOCK)
            v = tl.full((TOPK_BLOCK,), -1, tl.int32)
            if DECODE_TOPK > 0:
                v = tl.load(decode_topk_ptr + t.to(tl.int64) * decode_topk_stride + c, mask=c < DECODE_TOPK, other=-1)
            if DECODE_LOCAL:
                ok = v >= 0
                page = tl.load(c_bt_ptr + req.to(tl.int64) * c_bt_stride + v // c_block_size, mask=ok, other=-1)
                v = tl.where(ok, page * c_block_size + v % c_block_size, -1)
                count += tl.sum((ok & (tl.load(decode_valid_ptr + t) != 0)).to(tl.int32), axis=0)
            tl.store(row + SWA_INDEX_WIDTH + c, _remap(v, c_block_size, c_span), mask=c < PADDED_TOP_K)
        if DECODE_TOPK == 0:
            count = tl.zeros((), dtype=tl.int32)
        elif not DECODE_LOCAL:
            if HAS_DECODE_LENS:
                count = tl.load(decode_lens_ptr + t)
            else:
                count = tl.full((), DECODE_TOPK, tl.int32)
        tl.store(lens_ptr + t, SWA_INDEX_WIDTH + count)
    else:
        q0 = tl.load(query_start_loc_ptr + req)
        qlen = tl.load(query_start_loc_ptr + req + 1) - q0
        pos = tl.load(seq_lens_ptr + req) - qlen + (t - q0)
        start = tl.maximum(tl.maximum(pos - (WINDOW_SIZE - 1), 0), tl.load(replay_start_ptr + req))
        swa_len = pos - start + 1
        if COMPRESS_RATIO > 0:
            topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
        else:
            topk_len = 0
        for i in range(0, SWA_INDEX_WIDTH, WINDOW_BLOCK):
            c = i + tl.arange(0, WINDOW_BLOCK)
            live = c < swa_len
            p = start + c
            page = tl.load(swa_bt_ptr + req.to(tl.int64) * swa_bt_stride + p // swa_block_size, mask=live, other=-1)
            v = tl.where(live, page * swa_block_size + p % swa_block_size, -1)
            tl.store(row + c, _remap(v, swa_block_size, swa_span), mask=c < SWA_INDEX_WIDTH)
        prefill_row = prefill_topk_ptr + (t - num_decode_tokens).to(tl.int64) * prefill_topk_stride
        for i in range(0, PADDED_TOP_K, TOPK_BLOCK):
            c = i + tl.arange(0, TOPK_BLOCK)
            live = (c < prefill_topk_width) & (c < topk_len)
            local = tl.load(prefill_row + c, mask=live, other=-1)
            ok = live & (local >= 0)
            page = tl.load(c_bt_ptr + req.to(tl.int64) * c_bt_stride + local // c_block_size, mask=ok, other=-1)
            v = tl.where(ok, page * c_block_size + local % c_block_size, -1)
            tl.store(row + SWA_INDEX_WIDTH + c, _remap(v, c_block_size, c_span), mask=c < PADDED_TOP_K)
        tl.store(lens_ptr + t, SWA_INDEX_WIDTH + topk_len)


def _remap_reference(v: torch.Tensor, block_size: int, span: int) -> torch.Tensor:
    safe = v.clamp(min=0)
    return torch.where(v >= 0, safe // block_size * span + safe % block_size, -1)


def v41_flashinfer_mixed_reference(
    decode_swa_indices: torch.Tensor,
    decode_compressed_indices: torch.Tensor | None,
    decode_compressed_topk_lens: torch.Tensor | None,
    prefill_topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    swa_block_table: torch.Tensor,
    compressed_block_table: torch.Tensor | None,
    replay_start: torch.Tensor,
    *,
    window_size: int,
    swa_block_size: int,
    compressed_block_size: int,
    compress_ratio: int,
    top_k: int,
    decode_compressed_indices_are_local: bool = False,
    decode_is_valid_token: torch.Tensor | None = None,
    swa_block_span: int | None = None,
    compressed_block_span: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`.v41_flashinfer_indices.V41FlashinferMixedIndices` (a loop over tokens)."""
    nd, sw = decode_swa_indices.shape
    dk = 0 if decode_compressed_indices is None else decode_compressed_indices.shape[1]
    pk = (max(top_k, dk) + 3) // 4 * 4
    swa_span = swa_block_size if swa_block_span is None else swa_block_span
    c_span = compressed_block_size if compressed_block_span is None else compressed_block_span
    cbt = (swa_block_table if compressed_block_table is None else compressed_block_table).long()
    T = nd + prefill_topk_indices.shape[0]
    out = torch.full((T, sw + pk), -1, dtype=torch.int64)
    lens = torch.zeros(T, dtype=torch.int64)
    local = decode_compressed_indices_are_local and dk > 0

    def page(table: torch.Tensor, r: int, v: torch.Tensor, bs: int) -> torch.Tensor:
        ok = v >= 0
        return torch.where(ok, table[r, torch.where(ok, v // bs, 0)] * bs + v.clamp(min=0) % bs, -1)

    for t in range(T):
        r = int(token_to_req_indices[t])
        if t < nd:
            out[t, :sw] = _remap_reference(decode_swa_indices[t].long(), swa_block_size, swa_span)
            v = torch.full((pk,), -1, dtype=torch.int64)
            if dk:
                v[:dk] = decode_compressed_indices[t].long()  # type: ignore[index]
            count = 0
            if local:
                v = page(cbt, r, v, compressed_block_size)
                count = int((v >= 0).sum()) if bool(decode_is_valid_token[t]) else 0  # type: ignore[index]
            out[t, sw:] = _remap_reference(v, compressed_block_size, c_span)
            if dk and not local:
                count = int(decode_compressed_topk_lens[t]) if decode_compressed_topk_lens is not None else dk
            lens[t] = sw + count
            continue
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        pos = int(seq_lens[r]) - (q1 - q0) + t - q0
        start = max(pos - (window_size - 1), 0, int(replay_start[r]))
        swa_len = pos - start + 1
        topk_len = min((pos + 1) // compress_ratio, top_k) if compress_ratio else 0
        c = torch.arange(sw)
        v = torch.where(c < swa_len, page(swa_block_table.long(), r, start + c.clamp(max=max(swa_len - 1, 0)),
                                          swa_block_size), -1)  # fmt: skip
        out[t, :sw] = _remap_reference(v, swa_block_size, swa_span)
        n = max(min(topk_len, prefill_topk_indices.shape[1], pk), 0)
        v = torch.full((pk,), -1, dtype=torch.int64)
        v[:n] = page(cbt, r, prefill_topk_indices[t - nd, :n].long(), compressed_block_size)
        out[t, sw:] = _remap_reference(v, compressed_block_size, c_span)
        lens[t] = sw + topk_len
    return out.to(torch.int32), lens.to(torch.int32)
