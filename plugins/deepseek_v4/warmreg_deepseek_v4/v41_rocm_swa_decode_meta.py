"""DeepSeek-V4.1 ROCm decode with ``--monokernel`` on gfx942 / gfx950: the sliding-window metadata of a decode batch
in ONE launch (vLLM 0.34 ``models/deepseek_v41/amd/ops/swa_decode_meta.py``: ``build`` -> ``launch`` ->
``_decode_swa_meta_kernel``).

For decode token ``t < T`` (request ``r = token_to_req[t]``, query ``[qs[r], qs[r+1])``, ``seq_lens[r]``), ``W`` the
index width, ``w`` the window and ``B`` the SWA cache block::

    valid[t]  = slot_mapping[t] >= 0;                prefix = seq_lens[r] - (qs[r+1] - qs[r])
    causal:     pos = prefix + t - qs[r];  start = max(pos - w + 1, 0, replay_start[r]);  len[t] = pos + 1 - start
    noncausal:  start = max(prefix - w, 0);  len[t] = seq_lens[r] - start          (the DSpark draft block)
    len[t] = 0 for an invalid token;  lens[T:] = 0  (the whole lens buffer)
    indices[t, c] = c < len[t] ? block_table[r, (start + c) // B] * B + (start + c) % B : -1        (c < W)
    indptr = [0, cumsum(#kept)];  ragged[indptr[t]:] = the kept indices[t, c] (c < len[t], >= 0), in column order

It replaces the builder's eight launches (``torch.ge``, the zero fill, ``_compute_swa_indices_and_lens_kernel``, the
ragged count, cumsum and compaction, two copies) with one program holding the batch as a ``ROWS x BLOCK`` int32 tile
(``ROWS = next_pow2(T)``, ``T <= 32``; ``BLOCK = next_pow2(W)``), 4 warps, as vLLM's ``launch``. Only
``ragged[:indptr[T]]`` is written.

Where it runs: ``DeepseekV41ROCMAiterSparseSWAMetadataBuilder.build`` (``amd/rocm.py``) of every SWA KV-cache group,
every step, when ``ops.monokernel_cdna3_or_4()`` (``--monokernel`` on gfx942 or gfx950: warmreg's ``serving.monokernel``)
and the batch is decode-only with ``0 < T <= 32`` tokens: causal rows ``sliding_window`` wide, or the DSpark draft's
non-causal block (``get_dspark_swa_index_width`` wide) under ``speculative_method`` ``dspark``.

Key: the tile rows, the index width (``BLOCK`` follows it), causal or not, and the warps. Sizes and strides are runtime
ints (``do_not_specialize``) and no pointer is specialized on alignment (views of persistent buffers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table
from ._v41_rocm import max_decode_tokens, monokernel
from .dspark import dspark_swa_index_width, num_speculative_tokens, speculative_method
from .model import DSV4

__all__ = ["MAX_ROWS", "V41RocmSwaDecodeMeta", "V41RocmSwaDecodeMetaKey", "register", "swa_decode_meta_reference"]

#: The most decode tokens the one-launch build takes (vLLM's ``MAX_ROWS``).
MAX_ROWS = 32
_TAIL = 1024  # the zero fill's tile of the lens tail (vLLM's TAIL_BLOCK)
_NUM_WARPS = 4
_POINTERS = [
    "slot_mapping_ptr", "valid_ptr", "indices_ptr", "lens_ptr", "ragged_ptr", "indptr_ptr", "query_start_ptr",
    "seq_lens_ptr", "token_to_req_ptr", "block_table_ptr", "replay_start_ptr",
]  # fmt: skip


@triton.jit(
    do_not_specialize=[
        "indices_stride", "lens_size", "block_table_stride", "num_tokens", "window_size", "block_size",
    ],
    do_not_specialize_on_alignment=_POINTERS,
)  # fmt: skip
def _decode_swa_meta_kernel(
    slot_mapping_ptr,
    valid_ptr,
    indices_ptr,
    indices_stride,
    lens_ptr,
    lens_size,
    ragged_ptr,
    indptr_ptr,
    query_start_ptr,
    seq_lens_ptr,
    token_to_req_ptr,
    block_table_ptr,
    block_table_stride,
    replay_start_ptr,
    num_tokens,
    window_size,
    block_size,
    WIDTH: tl.constexpr,  # the index rows' width
    BLOCK: tl.constexpr,  # next_pow2(WIDTH)
    ROWS: tl.constexpr,  # next_pow2(T): the batch in one tile
    TAIL: tl.constexpr,  # the lens tail's zero-fill tile
    NONCAUSAL: tl.constexpr,  # the DSpark draft block's rows
):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows < num_tokens
    valid = live & (tl.load(slot_mapping_ptr + rows, mask=live, other=-1) >= 0)
    req = tl.load(token_to_req_ptr + rows, mask=live, other=0)
    tl.store(valid_ptr + rows, valid, mask=live)
    q_start = tl.load(query_start_ptr + req, mask=valid, other=0)
    q_len = tl.load(query_start_ptr + req + 1, mask=valid, other=0) - q_start
    seq_len = tl.load(seq_lens_ptr + req, mask=valid, other=0)
    prefix = seq_len - q_len
    if NONCAUSAL:
        start = tl.maximum(prefix - window_size, 0)
        length = tl.where(valid, seq_len - start, 0)
    else:
        pos = prefix + rows - q_start
        first = tl.maximum(tl.maximum(pos - window_size + 1, 0), tl.load(replay_start_ptr + req, mask=valid, other=0))
        start = first
        length = tl.where(valid, pos + 1 - first, 0)
    tl.store(lens_ptr + rows, length, mask=live)
    inside = (cols[None, :] < length[:, None]) & (cols[None, :] < WIDTH)
    p = start[:, None] + cols[None, :]
    page = tl.load(
        block_table_ptr + req[:, None].to(tl.int64) * block_table_stride + p // block_size, mask=inside, other=0
    )
    slot = tl.where(inside, page * block_size + p % block_size, -1)
    row_mask = live[:, None] & (cols[None, :] < WIDTH)
    tl.store(indices_ptr + rows[:, None].to(tl.int64) * indices_stride + cols[None, :], slot, mask=row_mask)
    keep = inside & (slot >= 0)
    counts = tl.sum(keep.to(tl.int32), axis=1)
    ends = tl.cumsum(counts, axis=0)
    tl.store(indptr_ptr, 0)
    tl.store(indptr_ptr + 1 + rows, ends, mask=live)
    rank = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    tl.store(ragged_ptr + (ends - counts)[:, None] + rank, slot, mask=keep)
    i = num_tokens
    while i < lens_size:
        offs = i + tl.arange(0, TAIL)
        tl.store(lens_ptr + offs, 0, mask=offs < lens_size)
        i += TAIL


@attrs.frozen(kw_only=True)
class V41RocmSwaDecodeMetaKey(warmreg.CompileKey):
    """What changes the binary: the batch tile's rows, the index width, the draft block's rows or not, the warps."""

    rows: int
    width: int
    noncausal: bool
    num_warps: int


def _vector(name: str, what: str, t: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.ndim != 1 or t.shape[0] < size or (t.shape[0] > 1 and t.stride(0) != 1):
        raise warmreg.LaunchError(
            name, f"{what} must be a contiguous {dtype} [>= {size}] tensor (got {t.dtype} {tuple(t.shape)})"
        )


def _check_indices(name: str, indices: torch.Tensor, tokens: int) -> int:
    rows_ok = indices.ndim >= 2 and indices.shape[0] >= tokens and all(d == 1 for d in indices.shape[1:-1])
    if indices.dtype != torch.int32 or not rows_ok or indices.shape[-1] < 1 or indices.stride(-1) != 1:
        raise warmreg.LaunchError(name, f"indices must be int32 [>= {tokens}, (1,) W] with contiguous rows (got "
                                  f"{indices.dtype} {tuple(indices.shape)}, strides {indices.stride()})")  # fmt: skip
    return int(indices.shape[-1])


class V41RocmSwaDecodeMeta(warmreg.TritonKernel[V41RocmSwaDecodeMetaKey]):
    """A decode batch's SWA validity, index rows, lengths and ragged stream in one launch; see the module docstring."""

    name = "deepseek_v4.v41_rocm_swa_decode_meta"
    key_type = V41RocmSwaDecodeMetaKey
    jit = _decode_swa_meta_kernel

    def __init__(self, widths: Iterable[tuple[int, bool]] = ((128, False),), max_tokens: int = MAX_ROWS) -> None:
        """:param widths: ``(index width, non-causal)`` of each row kind the deployment builds; ``max_tokens``: the
        most decode tokens a step takes here."""
        self.widths, self.max_tokens = tuple(widths), max_tokens

    def dispatch(self, *, num_tokens: int, indices: torch.Tensor, noncausal: bool) -> V41RocmSwaDecodeMetaKey:
        return V41RocmSwaDecodeMetaKey(
            rows=triton.next_power_of_2(num_tokens), width=indices.shape[-1], noncausal=bool(noncausal),
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        tokens = range(1, min(self.max_tokens, MAX_ROWS) + 1)
        return [
            {"num_tokens": t, "indices": warmreg.meta((t, 1, w), torch.int32), "noncausal": nc}
            for t in tokens
            for w, nc in self.widths
        ]

    def warmup_inputs(self, key: V41RocmSwaDecodeMetaKey) -> Mapping[str, Any]:
        n, i32 = key.rows, torch.int32
        return {
            "slot_mapping": warmreg.meta((n,), torch.int64), "is_valid": warmreg.meta((n,), torch.bool),
            "indices": warmreg.meta((n, 1, key.width), i32), "lens": warmreg.meta((n,), i32),
            "ragged": warmreg.meta((n * key.width,), i32), "indptr": warmreg.meta((n + 1,), i32),
            "query_start_loc": warmreg.meta((n + 1,), i32), "seq_lens": warmreg.meta((n,), i32),
            "token_to_req": warmreg.meta((n,), i32), "block_table": warmreg.meta((n, 16), i32),
            "replay_start": warmreg.meta((n + 1,), i32), "num_tokens": n, "window_size": 128, "block_size": 32,
            "noncausal": key.noncausal,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        slot_mapping: torch.Tensor,
        is_valid: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        ragged: torch.Tensor,
        indptr: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req: torch.Tensor,
        block_table: torch.Tensor,
        replay_start: torch.Tensor,
        num_tokens: int,
        window_size: int,
        block_size: int,
        noncausal: bool = False,
    ) -> warmreg.LaunchSpec[V41RocmSwaDecodeMetaKey]:
        """Write ``is_valid[:T]``, ``indices[:T]``, all of ``lens`` and the ragged form (vLLM's ``launch``, same
        arguments); returns ``(is_valid, indices, lens, ragged, indptr)``.

        :param slot_mapping: int64 ``[>= T]``: each token's KV slot (-1: a padded token).
        :param is_valid: bool ``[>= T]``; ``indices``: int32 ``[>= T, (1,) W]`` with contiguous rows; ``lens``: int32
            ``[>= T]``; ``ragged``: int32 ``[>= T * W]``; ``indptr``: int32 ``[>= T + 1]`` (all contiguous, written).
        :param query_start_loc: int32 ``[R + 1]``; ``seq_lens`` int32 ``[R]``; ``token_to_req`` int32 ``[>= T]``;
            ``replay_start`` int32 ``[>= R]`` (each request's first visible position); ``block_table`` int32
            ``[R, P]`` with contiguous rows, ``block_size`` tokens a block.
        :param num_tokens: ``T``, 1..32; ``window_size``, ``block_size``: >= 1; ``noncausal``: the DSpark draft block.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or ``T``, window or block out of
            range.
        """
        name, i32 = self.name, torch.int32
        if not 0 < num_tokens <= MAX_ROWS or window_size < 1 or block_size < 1:
            raise warmreg.LaunchError(name, f"num_tokens must be 1..{MAX_ROWS}, window_size and block_size >= 1 "
                                      f"(got {num_tokens}, {window_size}, {block_size})")  # fmt: skip
        width = _check_indices(name, indices, num_tokens)  # the key's width
        _vector(name, "slot_mapping", slot_mapping, num_tokens, torch.int64)
        _vector(name, "is_valid", is_valid, num_tokens, torch.bool)
        _vector(name, "lens", lens, num_tokens, i32)
        _vector(name, "ragged", ragged, num_tokens * width, i32)
        _vector(name, "indptr", indptr, num_tokens + 1, i32)
        _vector(name, "token_to_req", token_to_req, num_tokens, i32)
        for what, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("replay_start", replay_start)):
            _vector(name, what, t, 1, i32)
        check_int32_table(name, "block_table", block_table, 0)
        key = self.dispatch(num_tokens=num_tokens, indices=indices, noncausal=noncausal)
        kwargs = dict(
            slot_mapping_ptr=slot_mapping, valid_ptr=is_valid, indices_ptr=indices, indices_stride=indices.stride(0),
            lens_ptr=lens, lens_size=lens.shape[0], ragged_ptr=ragged, indptr_ptr=indptr,
            query_start_ptr=query_start_loc, seq_lens_ptr=seq_lens, token_to_req_ptr=token_to_req,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), replay_start_ptr=replay_start,
            num_tokens=num_tokens, window_size=window_size, block_size=block_size, WIDTH=key.width,
            BLOCK=triton.next_power_of_2(key.width), ROWS=key.rows, TAIL=_TAIL, NONCAUSAL=key.noncausal,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,), kwargs, (is_valid, indices, lens, ragged, indptr))


def swa_decode_meta_reference(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    replay_start: torch.Tensor,
    num_tokens: int,
    window_size: int,
    block_size: int,
    width: int,
    noncausal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``(is_valid [T], indices [T, W], lens [T], ragged [indptr[T]], indptr [T + 1])``."""
    valid = slot_mapping[:num_tokens] >= 0
    req = token_to_req[:num_tokens].long()
    qs, qe = query_start_loc.long()[req], query_start_loc.long()[req + 1]
    seq = seq_lens.long()[req]
    prefix = seq - (qe - qs)
    if noncausal:
        start = (prefix - window_size).clamp(min=0)
        length = seq - start
    else:
        pos = prefix + torch.arange(num_tokens) - qs
        start = torch.maximum((pos - window_size + 1).clamp(min=0), replay_start.long()[req])
        length = pos + 1 - start
    length = torch.where(valid, length, 0)
    cols = torch.arange(width)
    inside = cols[None, :] < length[:, None]
    p = start[:, None] + cols[None, :]
    pages = block_table.long()[req[:, None], torch.where(inside, p // block_size, 0)]
    indices = torch.where(inside, pages * block_size + p % block_size, -1)
    keep = inside & (indices >= 0)
    indptr = torch.zeros(num_tokens + 1, dtype=torch.int64)
    indptr[1:] = keep.sum(dim=1).cumsum(0)
    i32 = torch.int32
    return valid, indices.to(i32), length.to(i32), indices[keep].to(i32), indptr.to(i32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the one-launch SWA decode metadata on gfx942 and gfx950 with ``--monokernel`` for a V4.1 model: causal
    rows ``sliding_window`` wide, and the DSpark draft block's under ``speculative_method`` ``dspark``.

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel`.
    """
    on = model.v41 and monokernel(config, platform)
    widths = [(model.sliding_window, False)]
    if on and speculative_method(config) == "dspark":
        widths.append((dspark_swa_index_width(model.sliding_window, num_speculative_tokens(config)), True))
    kernel = V41RocmSwaDecodeMeta(widths, max_tokens=max_decode_tokens(config) if on else 1)
    registry.add(kernel, when=warmreg.rocm_arch_in("gfx942", "gfx950") if on else False)
