"""ROCm sparse MLA: dense index rows compacted to a ragged stream (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``build_ragged_indices_from_dense``, which launches
``_count_valid_row_entries_kernel`` then ``_compact_dense_row_to_ragged_kernel``).

ROCm's sparse attention kernels (in-tree Triton and aiter's) read their KV indices as a ragged stream plus an indptr,
without checking signs. Dense rows reserve slots they may not fill, so for row ``r`` of ``indices [n, W]`` with length
``len[r]`` and an optional bound ``L`` (``num_rows``; ``-1``: none)::

    keep(r, c)  = c < len[r]  and  indices[r, c] >= 0  and  (L < 0 or indices[r, c] < L)
    counts[r]   = #{c : keep(r, c)};     indptr = [0, cumsum(counts)]
    flat[indptr[r] + k] = the k-th kept indices[r, c], in column order           (flat has n * W slots)

Two launches and a ``torch.cumsum`` between them, as in vLLM: :class:`RocmRaggedCount` (grid ``cdiv(n, BLOCK_R)``,
``BLOCK_R`` rows a program; it also writes ``indptr[0] = 0``, so no zero fill) and :class:`RocmRaggedCompact` (a
program a row; a prefix sum ranks the kept entries). :func:`rocm_ragged_from_dense` is the whole entry point. Only
``flat[:indptr[n]]`` is written: the rest is whatever the buffer held.

Where it runs: every ROCm DeepSeek-V4 deployment (``DeepseekV4ROCMAiterMLAAttention``, ``amd/rocm.py``): the SWA
metadata builder compacts the decode SWA rows (width ``sliding_window``) every decode step, the C128 builder its dense
decode top-k rows (width: the step's C128 width); the in-tree prefill compacts the combined top-k + SWA rows
(``_rocm_sparse_attn_prefill_triton``: width ``round_up(top_k + window + image_width, 128)``, bounded by the
workspace rows); with aiter's sparse MLA prefill (:mod:`._rocm_attention`) the SWA prefill rows (``window +
image_width``) and the prefill top-k slots of :mod:`.rocm_prefill_topk` (``index_topk``, the C128 widths) instead.

Key: the tiles, ``BLOCK_W = min(next_pow2(W), 1024)`` and ``BLOCK_R = max(1, 1024 // BLOCK_W)`` (vLLM's), and the
warps. Sizes, strides and the bound are runtime ints (``do_not_specialize``; vLLM specializes them) and no pointer is
specialized on alignment (views of persistent buffers), so one binary a tile serves a deployment. Every buffer is
far below 2 GB, so ROCm's ``tt.pointer_range = 32`` specialization is the same for every launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._rocm_attention import aiter_sparse_mla_prefill
from ._serving import max_model_len
from .backends import c128_widths
from .model import DSV4

__all__ = [
    "RocmRaggedCompact", "RocmRaggedCompactKey", "RocmRaggedCount", "RocmRaggedCountKey", "ragged_from_dense_reference",
    "ragged_row_widths", "register", "rocm_ragged_from_dense",
]  # fmt: skip

_NUM_WARPS = 4  # vLLM's launches take Triton's default
_TILE = 1024  # the widest column tile and the rows x columns of a count program
_POINTERS = ["indices_ptr", "lengths_ptr", "counts_ptr", "indptr_ptr", "out_ptr"]


@triton.jit(
    do_not_specialize=["indices_stride", "num_rows_limit", "num_queries", "row_width"],
    do_not_specialize_on_alignment=_POINTERS[:4],
)
def _ragged_count_kernel(
    indices_ptr,
    lengths_ptr,
    counts_ptr,
    indptr_ptr,
    indices_stride,
    num_rows_limit,
    num_queries,
    row_width,
    BLOCK_R: tl.constexpr,  # rows a program: fills the 1024-element tile for narrow rows
    BLOCK_W: tl.constexpr,  # the column tile: min(next_pow2(W), 1024)
):
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(indptr_ptr, 0)  # the cumsum fills indptr[1:]
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_queries
    row_len = tl.load(lengths_ptr + rows, mask=row_ok, other=0)
    base = rows.to(tl.int64) * indices_stride
    acc = tl.zeros((BLOCK_R,), dtype=tl.int32)
    start = 0
    while start < row_width:
        cols = start + tl.arange(0, BLOCK_W)
        live = row_ok[:, None] & (cols[None, :] < row_width)
        vals = tl.load(indices_ptr + base[:, None] + cols[None, :], mask=live, other=-1)
        keep = live & (cols[None, :] < row_len[:, None]) & (vals >= 0)
        keep = keep & tl.where(num_rows_limit < 0, vals == vals, vals < num_rows_limit)
        acc += tl.sum(keep.to(tl.int32), axis=1)
        start += BLOCK_W
    tl.store(counts_ptr + rows, acc, mask=row_ok)


@triton.jit(
    do_not_specialize=["indices_stride", "num_rows_limit", "row_width"],
    do_not_specialize_on_alignment=["indices_ptr", "lengths_ptr", "indptr_ptr", "out_ptr"],
)
def _ragged_compact_kernel(
    indices_ptr,
    lengths_ptr,
    indptr_ptr,
    out_ptr,
    indices_stride,
    num_rows_limit,
    row_width,
    BLOCK_W: tl.constexpr,  # the column tile: min(next_pow2(W), 1024)
):
    row = tl.program_id(0).to(tl.int64)
    row_len = tl.load(lengths_ptr + row)
    dst = out_ptr + tl.load(indptr_ptr + row)
    start = 0
    while start < row_width:
        cols = start + tl.arange(0, BLOCK_W)
        live = cols < row_width
        vals = tl.load(indices_ptr + row * indices_stride + cols, mask=live, other=-1)
        keep = live & (cols < row_len) & (vals >= 0) & tl.where(num_rows_limit < 0, vals == vals, vals < num_rows_limit)
        rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(dst + rank, vals, mask=keep)
        dst += tl.sum(keep.to(tl.int32), axis=0)
        start += BLOCK_W


def _block_w(row_width: int) -> int:
    return min(warmreg.next_pow2(row_width), _TILE) if row_width > 0 else 1


@attrs.frozen(kw_only=True)
class RocmRaggedCountKey(warmreg.CompileKey):
    """What changes the binary of the count: the two tiles (from the row width) and the warps."""

    block_r: int
    block_w: int
    num_warps: int


@attrs.frozen(kw_only=True)
class RocmRaggedCompactKey(warmreg.CompileKey):
    """What changes the binary of the compaction: the column tile (from the row width) and the warps."""

    block_w: int
    num_warps: int


def _check_rows(name: str, indices: torch.Tensor, lengths: torch.Tensor) -> None:
    if indices.dtype != torch.int32 or indices.ndim != 2 or (indices.shape[1] > 1 and indices.stride(1) != 1):
        raise warmreg.LaunchError(name, f"indices must be int32 [n, W] with contiguous rows (got {indices.dtype} "
                                  f"{tuple(indices.shape)}, strides {indices.stride()})")  # fmt: skip
    n = indices.shape[0]
    if lengths.dtype != torch.int32 or lengths.ndim != 1 or lengths.shape[0] != n or (n > 1 and lengths.stride(0) != 1):
        raise warmreg.LaunchError(name, f"lengths must be a contiguous int32 [{n}] tensor, one length a row "
                                  f"(got {lengths.dtype} {tuple(lengths.shape)})")  # fmt: skip


def _check_vector(name: str, what: str, t: torch.Tensor, size: int) -> None:
    if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < size or (t.shape[0] > 1 and t.stride(0) != 1):
        raise warmreg.LaunchError(name, f"{what} must be a contiguous int32 [>= {size}] tensor (got {t.dtype} "
                                  f"{tuple(t.shape)})")  # fmt: skip


class _Ragged:
    """The domains both kernels share: the row widths a deployment compacts (:func:`ragged_row_widths`)."""

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        widths = ragged_row_widths(DSV4.from_config(config), config, platform)
        return {"indices": [warmreg.meta((1, w), torch.int32) for w in widths]}


class RocmRaggedCount(_Ragged, warmreg.TritonKernel[RocmRaggedCountKey]):
    """Kept entries a row (and ``indptr[0] = 0``); see the module docstring."""

    name = "deepseek_v4.rocm_ragged_count"
    key_type = RocmRaggedCountKey
    jit = _ragged_count_kernel

    def dispatch(self, *, indices: torch.Tensor) -> RocmRaggedCountKey:
        block_w = _block_w(indices.shape[1])
        return RocmRaggedCountKey(block_r=max(1, _TILE // block_w), block_w=block_w, num_warps=_NUM_WARPS)

    def warmup_inputs(self, key: RocmRaggedCountKey) -> Mapping[str, Any]:
        return {
            "indices": warmreg.meta((1, key.block_w), torch.int32),
            "lengths": warmreg.meta((1,), torch.int32),
            "indptr": warmreg.meta((2,), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        indices: torch.Tensor,
        lengths: torch.Tensor,
        indptr: torch.Tensor,
        *,
        num_rows: int = -1,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RocmRaggedCountKey]:
        """The int32 ``[n]`` counts of kept entries (fresh, or ``out``); writes ``indptr[0] = 0``.

        :param indices: int32 ``[n, W]`` dense rows, contiguous within a row (any row stride), ``-1`` for none.
        :param lengths: int32 ``[n]`` live columns of each row (contiguous).
        :param indptr: int32 ``[>= n + 1]`` (contiguous): element 0 is zeroed here, the rest is the caller's cumsum.
        :param num_rows: the exclusive bound on kept indices (the KV rows), or ``-1`` for none.
        :param out: the counts buffer to write instead of a fresh one: exactly int32 ``[n]``, contiguous, aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or an ``out`` unlike the fresh one.
        """
        _check_rows(self.name, indices, lengths)
        n, width = indices.shape
        _check_vector(self.name, "indptr", indptr, n + 1)
        key = self.dispatch(indices=indices)
        counts = warmreg.output(self.name, "out", out, (n,), torch.int32, indices.device)
        kwargs = dict(
            indices_ptr=indices, lengths_ptr=lengths, counts_ptr=counts, indptr_ptr=indptr,
            indices_stride=indices.stride(0), num_rows_limit=int(num_rows), num_queries=n, row_width=width,
            BLOCK_R=key.block_r, BLOCK_W=key.block_w,
        )  # fmt: skip
        grid = (triton.cdiv(n, key.block_r),) if n and width else None
        return warmreg.LaunchSpec(key, grid, kwargs, counts)


class RocmRaggedCompact(_Ragged, warmreg.TritonKernel[RocmRaggedCompactKey]):
    """The kept entries of each row at ``flat[indptr[r]:]``; see the module docstring."""

    name = "deepseek_v4.rocm_ragged_compact"
    key_type = RocmRaggedCompactKey
    jit = _ragged_compact_kernel

    def dispatch(self, *, indices: torch.Tensor) -> RocmRaggedCompactKey:
        return RocmRaggedCompactKey(block_w=_block_w(indices.shape[1]), num_warps=_NUM_WARPS)

    def warmup_inputs(self, key: RocmRaggedCompactKey) -> Mapping[str, Any]:
        return {
            "indices": warmreg.meta((1, key.block_w), torch.int32),
            "lengths": warmreg.meta((1,), torch.int32),
            "indptr": warmreg.meta((2,), torch.int32),
            "out": warmreg.meta((key.block_w,), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        indices: torch.Tensor,
        lengths: torch.Tensor,
        indptr: torch.Tensor,
        *,
        out: torch.Tensor,
        num_rows: int = -1,
    ) -> warmreg.LaunchSpec[RocmRaggedCompactKey]:
        """Write the kept entries of every row into ``out`` (the ragged stream); returns ``out``.

        :param indices: int32 ``[n, W]`` dense rows, contiguous within a row; ``lengths`` int32 ``[n]``.
        :param indptr: int32 ``[>= n + 1]``: each row's start in ``out`` (from :class:`RocmRaggedCount` and a cumsum).
        :param out: int32 ``[>= n * W]`` (contiguous): the stream, of which ``out[:indptr[n]]`` is written.
        :param num_rows: the exclusive bound on kept indices, or ``-1`` for none (as for the count).
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts.
        """
        _check_rows(self.name, indices, lengths)
        n, width = indices.shape
        _check_vector(self.name, "indptr", indptr, n + 1)
        _check_vector(self.name, "out", out, n * width)
        key = self.dispatch(indices=indices)
        kwargs = dict(
            indices_ptr=indices, lengths_ptr=lengths, indptr_ptr=indptr, out_ptr=out, indices_stride=indices.stride(0),
            num_rows_limit=int(num_rows), row_width=width, BLOCK_W=key.block_w,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n,) if n and width else None, kwargs, out)


def rocm_ragged_from_dense(
    indices: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: int = -1,
    *,
    count: RocmRaggedCount | None = None,
    compact: RocmRaggedCompact | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drop-in for vLLM's ``build_ragged_indices_from_dense``: ``(flat [n * W], indptr [n + 1])`` int32.

    :param indices: the dense rows, any shape ``[n, ...]`` (flattened to ``[n, W]`` as vLLM does), int32.
    :param lengths: one length a row, any integer dtype (converted to contiguous int32 as vLLM does).
    :param num_rows: the exclusive bound on kept indices, or ``-1``.
    :param count: the count op to launch (a fresh one by default); ``compact`` likewise.
    :raises warmreg.LaunchError: as the two ops.
    """
    if indices.ndim != 2:  # vLLM reshapes every input (which an empty 2-D one cannot take)
        indices = indices.reshape(indices.shape[0], -1)
    lengths = lengths.to(device=indices.device, dtype=torch.int32).reshape(-1).contiguous()
    n, width = indices.shape
    counts = torch.empty(n, dtype=torch.int32, device=indices.device)
    indptr = torch.empty(n + 1, dtype=torch.int32, device=indices.device)
    if n and width:
        (count or RocmRaggedCount())(indices, lengths, indptr, num_rows=num_rows, out=counts)
    else:
        counts.zero_()
        indptr.zero_()
    torch.cumsum(counts, dim=0, out=indptr[1:])
    flat = torch.empty(n * width, dtype=torch.int32, device=indices.device)
    if flat.numel():
        (compact or RocmRaggedCompact())(indices, lengths, indptr, num_rows=num_rows, out=flat)
    return flat, indptr


def ragged_from_dense_reference(
    indices: torch.Tensor, lengths: torch.Tensor, num_rows: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``(kept [indptr[n]], indptr [n + 1])`` int32 (the written prefix of the stream)."""
    indices = indices.reshape(indices.shape[0], -1).long()
    cols = torch.arange(indices.shape[1])
    keep = (cols[None, :] < lengths.long().reshape(-1, 1)) & (indices >= 0)
    if num_rows >= 0:
        keep &= indices < num_rows
    indptr = torch.zeros(indices.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = keep.sum(dim=1).cumsum(0)
    return indices[keep].to(torch.int32), indptr.to(torch.int32)


def ragged_row_widths(model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[int]:
    """Every dense row width a ROCm deployment compacts (see the module docstring for the call sites)."""
    window, image = model.sliding_window, model.vision_max_n_token
    c128 = c128_widths(max_model_len(config)) if model.has_c128 else []
    top_ks = ([0] if 1 in model.ratios else []) + ([model.index_topk] if model.has_c4 else []) + c128
    widths = {window, *c128}  # the decode SWA rows and the C128 decode rows
    if aiter_sparse_mla_prefill(config, model, platform):
        widths |= {window + image, *(k for k in top_ks if k)}  # SWA prefill rows, prefill top-k slots
    else:
        widths |= {triton.cdiv(k + window + image, 128) * 128 for k in top_ks}  # combined prefill rows
    return sorted(widths)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register both kernels on ROCm: every ROCm deployment compacts its decode SWA rows."""
    for kernel in (RocmRaggedCount(), RocmRaggedCompact()):
        registry.add(kernel, when=warmreg.is_rocm)
