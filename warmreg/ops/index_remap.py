"""Sparse-MLA top-k index remap: per-request top-k token ids as KV-cache or prefill-workspace rows.

vLLM 0.34 ``v1/attention/backends/mla/sparse_utils.py``: ``triton_convert_req_index_to_global_index`` and
``triton_filter_and_convert_dcp_index`` → ``ConvertReqIndexToGlobalIndexKernel.sparse_mla_index_remap_kernel``,
launched by the sparse MLA backends (e.g. ``flashmla_sparse.py: FlashMLASparseImpl`` for Kimi-K3.1's DSA layers).

Math, for query row ``t`` of request ``r = req_id[t]`` (``r = max(idx_mapping[r], 0)`` with an ``idx_mapping``), and
each column ``j < K`` with index ``x = token_indices[t, j]``, DCP world ``W``, rank ``R`` and interleave ``I``::

    owner = (x // I) % W;  local = (x // (W * I)) * I + x % I          # with W = 1: owner 0, local x
    b, o = local // BS, local % BS
    prefill = prefill_ids is given and prefill_ids[t] >= 0
    invalid = x < 0 or not 0 <= b < max_blocks or (owner != R and not prefill)
    row = owner * rank_stride + ws_starts[prefill_ids[t]] + local    if prefill
        = block_table[r, b] * BSR + o                                otherwise   (BSR: rows between blocks)
    out[t, j] = -1 if invalid else row

With ``count_valid`` the op also returns ``valid_counts[t]``, the valid columns of row ``t``; with
``compact_to_front`` the valid rows are written to a prefix ``out[t, :valid_counts[t]]`` (in column order here; vLLM
leaves the order of racing tiles unspecified, the set is the same) and the rest of the row is -1.

Tiling (vLLM's ``_remap_tiling``): a counting launch with ``K`` a power of two or ``next_pow2(K) <= 4096`` takes the
whole row in one program (``BLOCK_N = next_pow2(K)``, 8 warps, the count a plain store); otherwise ``K / BLOCK_N``
programs of ``BLOCK_N`` columns (4 warps), counting with atomics into a zeroed ``valid_counts``.

Key: the block size and row stride, the tile, ``K``, the five mode flags, the DCP world, rank and interleave, and
``num_warps``. Sizes, strides and the workspace rank stride are runtime ints (``do_not_specialize``), and no pointer
is specialized on alignment: the kernel moves one int32 per column and callers pass views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from ..contract.config import WarmConfig
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta
from ..values.errors import LaunchError
from ..values.key import CompileKey
from ..values.platform import Platform

__all__ = ["IndexRemapKey", "RemapLaunch", "SparseMLAIndexRemap", "remap_tiling", "sparse_mla_index_remap_reference"]

_INTS = [
    "max_blocks", "rank_stride", "bt_stride0", "bt_stride1", "ti_stride0", "ti_stride1", "out_stride0", "out_stride1"
]  # fmt: skip
_POINTERS = ["req_id_ptr", "block_table_ptr", "token_indices_ptr", "out_ptr", "valid_counts_ptr", "idx_mapping_ptr",
             "prefill_ids_ptr", "ws_starts_ptr"]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _sparse_mla_index_remap_kernel(
    req_id_ptr, block_table_ptr, token_indices_ptr, out_ptr, valid_counts_ptr, idx_mapping_ptr, prefill_ids_ptr,
    ws_starts_ptr, max_blocks, rank_stride, bt_stride0, bt_stride1, ti_stride0, ti_stride1, out_stride0, out_stride1,
    BLOCK_SIZE: tl.constexpr,  # tokens per block-table entry
    BLOCK_STRIDE_ROWS: tl.constexpr,  # cache rows between consecutive blocks (== BLOCK_SIZE unless pages interleave)
    BLOCK_N: tl.constexpr,  # columns per program
    NUM_TOPK: tl.constexpr,  # columns of a row (K)
    HAS_PREFILL: tl.constexpr,  # prefill rows map into a workspace
    HAS_IDX_MAPPING: tl.constexpr,  # the block-table row of a request is idx_mapping[request]
    COUNT_VALID: tl.constexpr,  # write valid_counts
    SINGLE_TILE: tl.constexpr,  # one program per row: the count is a store, not an atomic
    COMPACT: tl.constexpr,  # valid rows to a prefix of the row (needs COUNT_VALID)
    DCP_SIZE: tl.constexpr,  # decode-context-parallel world (1 = off)
    DCP_RANK: tl.constexpr,  # this rank
    DCP_INTERLEAVE: tl.constexpr,  # tokens dealt to one rank at a time
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < NUM_TOPK
    req = tl.load(req_id_ptr + t).to(tl.int64)
    if HAS_IDX_MAPPING:
        req = tl.maximum(tl.load(idx_mapping_ptr + req), 0).to(tl.int64)
    x = tl.load(token_indices_ptr + t * ti_stride0 + cols * ti_stride1, mask=in_row, other=-1)
    bad = x < 0
    x = tl.where(bad, 0, x)  # the arithmetic below on non-negative ids only; bad columns end as -1
    owner = (x // DCP_INTERLEAVE) % DCP_SIZE
    local = (x // (DCP_SIZE * DCP_INTERLEAVE)) * DCP_INTERLEAVE + x % DCP_INTERLEAVE
    block = local // BLOCK_SIZE
    in_table = block < max_blocks
    pid = tl.load(prefill_ids_ptr + t) if HAS_PREFILL else -1
    prefill = pid >= 0  # a row of a prefill request: its ids address the request's workspace part
    cached = tl.where(prefill, False, in_table & (owner == DCP_RANK))  # read from this rank's table
    bad = bad | ~in_table | tl.where(prefill, False, owner != DCP_RANK)
    entry = tl.load(block_table_ptr + req * bt_stride0 + block * bt_stride1, mask=cached, other=0)
    row = entry * BLOCK_STRIDE_ROWS + local % BLOCK_SIZE
    if HAS_PREFILL:
        start = tl.load(ws_starts_ptr + tl.maximum(pid, 0), mask=prefill, other=0)
        row = tl.where(prefill, owner * rank_stride + start + local, row)
    row = tl.where(bad, -1, row).to(tl.int32)
    good = (~bad & in_row).to(tl.int32)
    if COMPACT:
        count = tl.sum(good, axis=0)
        if SINGLE_TILE:
            base = 0
            tl.store(valid_counts_ptr + t, count)
        else:
            base = tl.atomic_add(valid_counts_ptr + t, count)
        dest = base + tl.cumsum(good, axis=0) - good
        tl.store(out_ptr + t * out_stride0 + dest * out_stride1, row, mask=good == 1)
        if SINGLE_TILE:  # the program owns the row: it writes the padding after the prefix
            tl.store(out_ptr + t * out_stride0 + cols * out_stride1, tl.full([BLOCK_N], -1, tl.int32),
                     mask=in_row & (cols >= count))  # fmt: skip
    else:
        tl.store(out_ptr + t * out_stride0 + cols * out_stride1, row, mask=in_row)
        if COUNT_VALID:
            if SINGLE_TILE:
                tl.store(valid_counts_ptr + t, tl.sum(good, axis=0))
            else:
                tl.atomic_add(valid_counts_ptr + t, tl.sum(good, axis=0))


def _launch_of(
    *, token_indices: torch.Tensor, block_size: int, block_stride_rows: int | None, block_n: int,
    prefill_workspace_request_ids: torch.Tensor | None, idx_mapping: torch.Tensor | None, return_valid_counts: bool,
    compact_to_front: bool | None, dcp_size: int, dcp_rank: int, dcp_interleave: int,
) -> RemapLaunch:  # fmt: skip
    """The launch kind of a launcher call (``compact_to_front`` None: ``return_valid_counts``, as vLLM's wrapper)."""
    compact = return_valid_counts if compact_to_front is None else compact_to_front
    return RemapLaunch(
        block_size=block_size, block_stride_rows=block_size if block_stride_rows is None else block_stride_rows,
        num_topk=token_indices.shape[-1], block_n=block_n, has_prefill=prefill_workspace_request_ids is not None,
        has_idx_mapping=idx_mapping is not None, count_valid=return_valid_counts or compact, compact_to_front=compact,
        dcp_size=dcp_size, dcp_rank=dcp_rank, dcp_interleave=dcp_interleave,
    )  # fmt: skip


def remap_tiling(num_topk: int, block_n: int, count_valid: bool) -> tuple[bool, int, int, int]:
    """``(single_tile, block_n, tiles_per_row, num_warps)`` of a launch (vLLM's ``_remap_tiling``)."""
    padded = triton.next_power_of_2(num_topk)
    if count_valid and (padded == num_topk or padded <= 4096):
        return True, padded, 1, 8
    return False, block_n, num_topk // block_n, 4


@attrs.frozen(kw_only=True)
class RemapLaunch:
    """One kind of launch a call site makes: what reaches the binary, before tiling.

    :param block_size: tokens per block-table entry (the attention metadata's block size).
    :param block_stride_rows: cache rows between consecutive blocks (the block size unless pages interleave).
    :param num_topk: ``K``, the top-k width; ``block_n``: vLLM's column tile (128).
    :param has_prefill: prefill rows map into a workspace; ``has_idx_mapping``: the table row is ``idx_mapping[r]``.
    :param count_valid: return valid counts; ``compact_to_front``: valid rows to a prefix.
    :param dcp_size: the DCP world the call passes (1 where the call site passes none), ``dcp_rank``, ``dcp_interleave``.
    """

    block_size: int
    block_stride_rows: int
    num_topk: int
    block_n: int = 128
    has_prefill: bool = False
    has_idx_mapping: bool = False
    count_valid: bool = False
    compact_to_front: bool = False
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1


@attrs.frozen(kw_only=True)
class IndexRemapKey(CompileKey):
    """What changes the binary of the sparse-MLA index remap."""

    block_size: int
    block_stride_rows: int
    block_n: int
    num_topk: int
    has_prefill: bool
    has_idx_mapping: bool
    count_valid: bool
    single_tile: bool
    compact_to_front: bool
    dcp_size: int
    dcp_rank: int
    dcp_interleave: int
    num_warps: int


class SparseMLAIndexRemap(TritonKernel[IndexRemapKey]):
    """The sparse-MLA index remap, declared for the launches of one deployment.

    :param launches: the kinds of launch its call sites make (the warm space is their keys; empty for an instance
        used only to launch).
    """

    name = "warmreg.ops.sparse_mla_index_remap"
    key_type = IndexRemapKey
    jit = _sparse_mla_index_remap_kernel

    def __init__(self, *, launches: Sequence[RemapLaunch] = ()) -> None:
        self.launches = tuple(launches)

    def dispatch(
        self,
        *,
        token_indices: torch.Tensor,
        block_size: int,
        block_stride_rows: int | None,
        block_n: int,
        prefill_workspace_request_ids: torch.Tensor | None,
        idx_mapping: torch.Tensor | None,
        return_valid_counts: bool,
        compact_to_front: bool | None,
        dcp_size: int,
        dcp_rank: int,
        dcp_interleave: int,
    ) -> IndexRemapKey:
        launch = _launch_of(**{k: v for k, v in locals().items() if k != "self"})
        single, tile, _, warps = remap_tiling(launch.num_topk, launch.block_n, launch.count_valid)
        fields = attrs.asdict(launch)
        fields.update(block_n=tile, single_tile=single, num_warps=warps)
        return IndexRemapKey(**fields)

    def domains(self, config: WarmConfig, platform: Platform) -> Iterable[Mapping[str, Any]]:  # type: ignore[override]
        i32 = torch.int32
        return [
            {
                "token_indices": meta((1, x.num_topk), i32),
                "block_size": x.block_size,
                "block_stride_rows": x.block_stride_rows,
                "block_n": x.block_n,
                "prefill_workspace_request_ids": meta((1,), i32) if x.has_prefill else None,
                "idx_mapping": meta((1,), i32) if x.has_idx_mapping else None,
                "return_valid_counts": x.count_valid,
                "compact_to_front": x.compact_to_front,
                "dcp_size": x.dcp_size,
                "dcp_rank": x.dcp_rank,
                "dcp_interleave": x.dcp_interleave,
            }
            for x in self.launches
        ]

    def warmup_inputs(self, key: IndexRemapKey) -> Mapping[str, Any]:
        i32 = torch.int32
        return {
            "req_id": meta((1,), i32),
            "block_table": meta((1, 4), i32),
            "token_indices": meta((1, key.num_topk), i32),
            "prefill_workspace_request_ids": meta((1,), i32) if key.has_prefill else None,
            "prefill_workspace_starts": meta((1,), i32) if key.has_prefill else None,
            "idx_mapping": meta((1,), i32) if key.has_idx_mapping else None,
            "block_size": key.block_size,
            "block_stride_rows": key.block_stride_rows,
            # a single tile is the padded row whatever the tile asked: any divisor of the width asks
            "block_n": key.block_n if not key.single_tile else 128 if key.num_topk % 128 == 0 else key.num_topk,
            "dcp_size": key.dcp_size,
            "dcp_rank": key.dcp_rank,
            "dcp_interleave": key.dcp_interleave,
            "return_valid_counts": key.count_valid,
            "compact_to_front": key.compact_to_front,
        }

    def _check(self, req_id: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor, *,
               prefill: tuple[torch.Tensor | None, torch.Tensor | None], idx_mapping: torch.Tensor | None,
               launch: RemapLaunch) -> None:  # fmt: skip
        for name, t, ndim in (
            ("req_id", req_id, 1),
            ("block_table", block_table, 2),
            ("token_indices", token_indices, 2),
        ):
            if t.dtype != torch.int32 or t.ndim != ndim:
                raise LaunchError(self.name, f"{name} must be a {ndim}-D int32 tensor (got {t.dtype} {tuple(t.shape)})")
        if req_id.shape[0] != token_indices.shape[0]:
            raise LaunchError(self.name, f"req_id ({req_id.shape[0]} rows) and token_indices ({token_indices.shape[0]}) "
                              "must cover the same tokens")  # fmt: skip
        if (prefill[0] is None) != (prefill[1] is None):
            raise LaunchError(self.name, "prefill_workspace_request_ids and prefill_workspace_starts go together")
        for name, v in (("prefill_workspace_request_ids", prefill[0]), ("prefill_workspace_starts", prefill[1]),
                        ("idx_mapping", idx_mapping), ("req_id", req_id)):  # fmt: skip
            if v is not None and (v.dtype != torch.int32 or v.ndim != 1 or (v.shape[0] > 1 and v.stride(0) != 1)):
                raise LaunchError(self.name, f"{name} must be a contiguous 1-D int32 tensor")
        if (
            launch.num_topk % launch.block_n
            or min(launch.block_size, launch.block_stride_rows, launch.dcp_interleave) < 1
        ):
            raise LaunchError(self.name, f"the top-k width {launch.num_topk} must be a multiple of block_n "
                              f"{launch.block_n}, and the block size, row stride and interleave >= 1")  # fmt: skip
        if not 0 <= launch.dcp_rank < launch.dcp_size or launch.block_size % launch.dcp_interleave:
            raise LaunchError(self.name, f"bad DCP rank {launch.dcp_rank} of {launch.dcp_size}, or interleave "
                              f"{launch.dcp_interleave} not dividing the block size {launch.block_size}")  # fmt: skip

    def _buffers(
        self, key: IndexRemapKey, token_indices: torch.Tensor, out: torch.Tensor | None, counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output rows and valid counts (the caller's, checked, or fresh), prepared as the launch needs them."""
        t, k = token_indices.shape
        if out is None:
            out = token_indices.new_empty((t, k))
        if out.dtype != torch.int32 or out.shape != (t, k):
            raise LaunchError(self.name, f"out must be int32 {(t, k)} (got {out.dtype} {tuple(out.shape)})")
        if key.compact_to_front and not key.single_tile:
            out.fill_(-1)  # racing tiles leave the tail of each row unwritten
        if not key.count_valid:
            return out, None
        counts = token_indices.new_empty((t,)) if counts is None else counts
        if counts.dtype != torch.int32 or counts.shape != (t,) or (t > 1 and counts.stride(0) != 1):
            raise LaunchError(self.name, f"valid_counts_out must be a contiguous int32 [{t}] buffer")
        if not key.single_tile:
            counts.zero_()  # the tiles accumulate into it
        return out, counts

    @kernel_launcher
    def __call__(
        self,
        req_id: torch.Tensor,
        block_table: torch.Tensor,
        token_indices: torch.Tensor,
        *,
        block_size: int,
        block_stride_rows: int | None = None,
        block_n: int = 128,
        prefill_workspace_request_ids: torch.Tensor | None = None,
        prefill_workspace_starts: torch.Tensor | None = None,
        prefill_workspace_rank_stride: int = 0,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        dcp_interleave: int = 1,
        return_valid_counts: bool = False,
        compact_to_front: bool | None = None,
        idx_mapping: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        valid_counts_out: torch.Tensor | None = None,
    ) -> LaunchSpec[IndexRemapKey]:
        """Returns int32 ``out [T, K]``, and ``valid_counts [T]`` with ``return_valid_counts``.

        :param req_id: int32 ``[T]``, the request of each query row.
        :param block_table: int32 ``[R, max_blocks]`` (any strides).
        :param token_indices: int32 ``[T, K]`` per-request token ids, -1 for none (any strides).
        :param block_stride_rows: rows between blocks; ``None``: ``block_size``.
        :param prefill_workspace_request_ids: int32 ``[T]`` (-1 for decode rows) with ``prefill_workspace_starts``.
        :param compact_to_front: ``None``: ``return_valid_counts`` (``triton_convert_req_index_to_global_index``);
            ``triton_filter_and_convert_dcp_index`` passes its own (counting whenever it compacts).
        :param out: int32 ``[T, K]`` buffer; ``valid_counts_out``: int32 ``[T]``, contiguous.
        :raises LaunchError: naming the argument, for wrong dtypes or shapes, a width not a multiple of ``block_n``
            or bad DCP values.
        """
        point: dict[str, Any] = dict(
            token_indices=token_indices, block_size=block_size, block_stride_rows=block_stride_rows, block_n=block_n,
            prefill_workspace_request_ids=prefill_workspace_request_ids, idx_mapping=idx_mapping,
            return_valid_counts=return_valid_counts, compact_to_front=compact_to_front, dcp_size=dcp_size,
            dcp_rank=dcp_rank, dcp_interleave=dcp_interleave,
        )  # fmt: skip
        prefill = (prefill_workspace_request_ids, prefill_workspace_starts)
        self._check(req_id, block_table, token_indices, prefill=prefill, idx_mapping=idx_mapping, launch=_launch_of(**point))
        key = self.dispatch(**point)
        t = token_indices.shape[0]
        out, counts = self._buffers(key, token_indices, out, valid_counts_out)
        kwargs = dict(
            req_id_ptr=req_id, block_table_ptr=block_table, token_indices_ptr=token_indices, out_ptr=out,
            valid_counts_ptr=counts, idx_mapping_ptr=idx_mapping, prefill_ids_ptr=prefill_workspace_request_ids,
            ws_starts_ptr=prefill_workspace_starts, max_blocks=block_table.shape[1],
            rank_stride=prefill_workspace_rank_stride, bt_stride0=block_table.stride(0), bt_stride1=block_table.stride(1),
            ti_stride0=token_indices.stride(0), ti_stride1=token_indices.stride(1), out_stride0=out.stride(0),
            out_stride1=out.stride(1), BLOCK_SIZE=key.block_size, BLOCK_STRIDE_ROWS=key.block_stride_rows,
            BLOCK_N=key.block_n, NUM_TOPK=key.num_topk, HAS_PREFILL=key.has_prefill, HAS_IDX_MAPPING=key.has_idx_mapping,
            COUNT_VALID=key.count_valid, SINGLE_TILE=key.single_tile, COMPACT=key.compact_to_front,
            DCP_SIZE=key.dcp_size, DCP_RANK=key.dcp_rank, DCP_INTERLEAVE=key.dcp_interleave,
        )  # fmt: skip
        tiles = remap_tiling(key.num_topk, block_n, key.count_valid)[2]
        grid = (t, tiles) if t and tiles else None
        return LaunchSpec(key, grid, kwargs, (out, counts) if return_valid_counts else out)


def sparse_mla_index_remap_reference(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    block_size: int,
    block_stride_rows: int | None = None,
    block_n: int = 128,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    prefill_workspace_rank_stride: int = 0,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    dcp_interleave: int = 1,
    return_valid_counts: bool = False,
    compact_to_front: bool | None = None,
    idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`SparseMLAIndexRemap` (a compacted prefix in column order; ``block_n``, the
    launch's tiling, does not change the result)."""
    del block_n
    stride = block_size if block_stride_rows is None else block_stride_rows
    compact = return_valid_counts if compact_to_front is None else compact_to_front
    x = token_indices.long().cpu()
    req = req_id.long().cpu()
    if idx_mapping is not None:
        req = idx_mapping.long().cpu()[req].clamp(min=0)
    w, i = dcp_size, dcp_interleave
    xs = x.clamp(min=0)
    owner, local = (xs // i) % w, (xs // (w * i)) * i + xs % i
    block = local // block_size
    in_table = block < block_table.shape[1]
    entry = block_table.long().cpu()[req[:, None].expand_as(block), block.clamp(max=block_table.shape[1] - 1)]
    row = entry * stride + local % block_size
    prefill = torch.zeros_like(x, dtype=torch.bool)
    if prefill_workspace_request_ids is not None and prefill_workspace_starts is not None:
        pid = prefill_workspace_request_ids.long().cpu()
        prefill = (pid >= 0)[:, None].expand_as(x)
        starts = prefill_workspace_starts.long().cpu()[pid.clamp(min=0)]
        row = torch.where(prefill, owner * prefill_workspace_rank_stride + starts[:, None] + local, row)
    bad = (x < 0) | ~in_table | ((owner != dcp_rank) & ~prefill)
    out = torch.where(bad, -1, row).to(torch.int32)
    counts = (~bad).sum(1).to(torch.int32)
    if compact:
        packed = torch.full_like(out, -1)
        for t in range(out.shape[0]):
            keep = out[t][~bad[t]]
            packed[t, : keep.numel()] = keep
        out = packed
    return (out, counts) if return_valid_counts else out
