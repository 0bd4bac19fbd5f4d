"""The V2 model runner's gather of a step's block-table rows, all KV-cache groups in one launch (vLLM 0.34
``v1/worker/gpu/block_table.py``: ``_gather_block_tables_kernel``, launched by ``BlockTables.gather_block_tables``).

The runner keeps, per KV-cache group ``g``, a persistent source table ``src_g`` (int32 ``[max_num_reqs, W_g]``,
one row per request state) and a forward-pass table ``dst_g`` of the same shape, which the attention metadata
reads. Both are reached through device tables of their addresses (uint64 ``[G]``), so one launch serves every
group whatever its width. Each step copies the batch's rows: for batch row ``b < num_rows`` and group ``g``, with
``q = idx_mapping[b]``, ``n = num_blocks[g, q]``, ``W_g = block_table_strides[g]``::

    b >= num_reqs:   dst_g[b, :W_g] = 0                                  (padding rows, and a larger batch's leftovers)
    b <  num_reqs:   dst_g[b, j] = 0 if j < z else src_g[q, j]    for j < n;   dst_g[b, n:] untouched
    z = floor(max(num_computed_tokens[q] - reach[g], 0) / block_sizes[g])   if MASK_SLIDING_WINDOW and reach[g] > 0
    z = 0                                                                    otherwise

``z`` nulls the leading blocks of a sliding-window group that no query of the step can read any more (its
``reach`` is ``SlidingWindowSpec.num_retained_tokens``, ``sliding_window - 1`` plus retained tokens): the
sliding-window manager may have freed and reused them, and an attention tile straddling the window start would
load them. Grid ``(G, num_rows)``; the columns in tiles of 1024, as in vLLM.

Where it runs: every model on vLLM 0.34's V2 model runner (the only runner: V1 is removed), every step,
``GPUModelRunner.prepare_attn``, on CUDA, ROCm and XPU (``XPUModelRunner`` subclasses it). There the mask is on
whenever a group is a sliding-window group, unless decode context parallelism (DCP > 1) zeroes every reach. Under
prefill context parallelism (``PCPManager.prepare_attn``) and in the DFlash / target-dependent speculators' PCP
re-gathers the mask is off; warmreg has no PCP setting. A DeepSeek-V4 deployment always has sliding-window groups:
the SWA cache (``SlidingWindowMLASpec``, window 128) and the compressor states.

Key: ``MASK_SLIDING_WINDOW``, the tile and the warps. The number of groups is the grid; the widths are loaded from
``block_table_strides`` (runtime, as in vLLM: one binary for every table layout); ``num_reqs`` and the stride of
``num_blocks`` are unspecialized integers (vLLM specializes the stride, ``max_num_reqs``), and no pointer is
specialized on alignment (the address tables and per-request values are read one scalar at a time).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from .model import DSV4

__all__ = [
    "BLOCK",
    "GatherBlockTables",
    "GatherBlockTablesKey",
    "block_table_pointers",
    "gather_block_tables_reference",
    "register",
]

#: Columns a tile (vLLM's ``BLOCK_SIZE=1024``).
BLOCK = 1024
_PTRS = [
    "idx_mapping_ptr", "src_ptrs_ptr", "dst_ptrs_ptr", "strides_ptr", "num_blocks_ptr", "num_computed_tokens_ptr",
    "reach_ptr", "block_sizes_ptr",
]  # fmt: skip


@triton.jit(do_not_specialize=["num_blocks_stride", "num_reqs"], do_not_specialize_on_alignment=_PTRS)
def _gather_block_tables_kernel(
    idx_mapping_ptr,  # [>= num_reqs]: batch row -> request state row
    src_ptrs_ptr,  # [G] uint64: the source tables' addresses
    dst_ptrs_ptr,  # [G] uint64: the forward-pass tables' addresses
    strides_ptr,  # [G] int64: each group's row stride, which is its width
    num_blocks_ptr,  # [G, max_num_reqs]: blocks each request holds in each group
    num_computed_tokens_ptr,  # [max_num_reqs] (read only under MASK_SLIDING_WINDOW)
    reach_ptr,  # [G]: tokens below the first scheduled one attention may read; 0: not a sliding-window group
    block_sizes_ptr,  # [G]
    num_blocks_stride,
    num_reqs,
    MASK_SLIDING_WINDOW: tl.constexpr,  # null the blocks below the window (vLLM's runner with num_computed_tokens)
    BLOCK: tl.constexpr,  # column tile
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    width = tl.load(strides_ptr + g)
    dst = tl.load(dst_ptrs_ptr + g).to(tl.pointer_type(tl.int32)) + b.to(tl.int64) * width
    cols = tl.arange(0, BLOCK)
    if b >= num_reqs:
        j0 = 0
        while j0 < width:  # runtime bounds: while loops (see warmreg_deepseek_v4.sparse_mla)
            tl.store(dst + j0 + cols, tl.zeros((BLOCK,), dtype=tl.int32), mask=j0 + cols < width)
            j0 += BLOCK
    else:
        q = tl.load(idx_mapping_ptr + b).to(tl.int64)
        n = tl.load(num_blocks_ptr + g.to(tl.int64) * num_blocks_stride + q)
        src = tl.load(src_ptrs_ptr + g).to(tl.pointer_type(tl.int32)) + q * width
        nulled = 0
        if MASK_SLIDING_WINDOW:
            reach = tl.load(reach_ptr + g)
            first = tl.load(num_computed_tokens_ptr + q)
            nulled = tl.where(reach > 0, tl.maximum(first - reach, 0) // tl.load(block_sizes_ptr + g), 0)
        j0 = 0
        while j0 < n:
            j = j0 + cols
            ids = tl.load(src + j, mask=(j >= nulled) & (j < n), other=0)
            tl.store(dst + j, ids, mask=j < n)
            j0 += BLOCK


@attrs.frozen(kw_only=True)
class GatherBlockTablesKey(warmreg.CompileKey):
    """What changes the binary of the block-table gather: the mask, the tile and the warps (no size, width,
    group count or alignment does)."""

    mask_sliding_window: bool
    block: int
    num_warps: int


def block_table_pointers(tables: Sequence[torch.Tensor]) -> torch.Tensor:
    """The address table of ``tables`` (uint64 ``[G]`` on their device), as vLLM's ``BlockTables._make_ptr_tensor``
    builds it once per table set: the ``src_ptrs`` / ``dst_ptrs`` of :class:`GatherBlockTables`.

    :raises warmreg.LaunchError: for an empty sequence or tables on different devices.
    """
    devices = {t.device for t in tables}
    if len(devices) != 1:
        raise warmreg.LaunchError(
            GatherBlockTables.name,
            f"tables must be a non-empty sequence on one device (got {len(tables)} on {devices})",
        )
    return torch.tensor([t.data_ptr() for t in tables], dtype=torch.uint64, device=devices.pop())


class GatherBlockTables(warmreg.TritonKernel[GatherBlockTablesKey]):
    """The step's block-table rows of every KV-cache group into the forward-pass tables (module docstring).

    :param mask_sliding_window: whether the runner's main gather nulls the blocks below sliding windows in this
        deployment (domains only).
    """

    name = "deepseek_v4.gather_block_tables"
    key_type = GatherBlockTablesKey
    jit = _gather_block_tables_kernel

    def __init__(self, *, mask_sliding_window: bool) -> None:
        self.mask_sliding_window = mask_sliding_window

    def dispatch(self, *, mask_sliding_window: bool) -> GatherBlockTablesKey:
        return GatherBlockTablesKey(mask_sliding_window=bool(mask_sliding_window), block=BLOCK, num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"mask_sliding_window": [self.mask_sliding_window]}

    def warmup_inputs(self, key: GatherBlockTablesKey) -> Mapping[str, Any]:
        g = warmreg.meta((1,), torch.int32)
        return {
            "idx_mapping": g, "src_ptrs": warmreg.meta((1,), torch.uint64), "dst_ptrs": warmreg.meta((1,), torch.uint64),
            "block_table_strides": warmreg.meta((1,), torch.int64), "num_blocks": warmreg.meta((1, 1), torch.int32),
            "num_computed_tokens": g, "sliding_window_reach": g, "block_sizes": g, "num_rows": 1,
            "mask_sliding_window": key.mask_sliding_window,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        idx_mapping: torch.Tensor,
        src_ptrs: torch.Tensor,
        dst_ptrs: torch.Tensor,
        block_table_strides: torch.Tensor,
        num_blocks: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        sliding_window_reach: torch.Tensor,
        block_sizes: torch.Tensor,
        *,
        num_rows: int,
        mask_sliding_window: bool,
    ) -> warmreg.LaunchSpec[GatherBlockTablesKey]:
        """Gather rows ``[0, num_reqs)`` (``num_reqs = idx_mapping.shape[0]``) and zero rows ``[num_reqs,
        num_rows)`` of every group's forward-pass table, in place; returns None (the tables are the caller's).

        :param idx_mapping: int32 ``[num_reqs]``, contiguous: each batch row's request state row.
        :param src_ptrs: uint64 ``[G]`` addresses of the source tables (:func:`block_table_pointers`), each a
            contiguous int32 ``[max_num_reqs, W_g]``; ``dst_ptrs`` those of the forward-pass tables, of the same
            shapes (at least ``num_rows`` rows).
        :param block_table_strides: int64 ``[G]``, each group's ``W_g``.
        :param num_blocks: int32 ``[G, max_num_reqs]`` with contiguous rows: blocks held per group and request.
        :param num_computed_tokens: int32 ``[max_num_reqs]``, contiguous (any contiguous int32 vector when the mask is
            off: it is not read).
        :param sliding_window_reach: int32 ``[G]`` (0 for a group that is no sliding window); ``block_sizes``
            int32 ``[G]``.
        :param num_rows: the rows to write, ``>= num_reqs`` (the padded batch, or the rows a larger batch dirtied).
        :param mask_sliding_window: null the blocks below each sliding window (vLLM's main gather when the
            deployment has sliding-window groups).
        :raises warmreg.LaunchError: for a dtype, rank, length or device the kernel cannot take (the tables
            behind the addresses are the caller's to get right).
        """
        self._check(
            idx_mapping, src_ptrs, dst_ptrs, block_table_strides, num_blocks, num_computed_tokens,
            sliding_window_reach, block_sizes, num_rows,
        )  # fmt: skip
        if mask_sliding_window and num_computed_tokens.shape[0] < num_blocks.shape[1]:
            raise warmreg.LaunchError(
                self.name,
                f"num_computed_tokens ({num_computed_tokens.shape[0]} requests) must cover the "
                f"{num_blocks.shape[1]} request rows of num_blocks when mask_sliding_window is on",
            )
        key = self.dispatch(mask_sliding_window=mask_sliding_window)
        kwargs = dict(
            idx_mapping_ptr=idx_mapping, src_ptrs_ptr=src_ptrs, dst_ptrs_ptr=dst_ptrs, strides_ptr=block_table_strides,
            num_blocks_ptr=num_blocks, num_computed_tokens_ptr=num_computed_tokens, reach_ptr=sliding_window_reach,
            block_sizes_ptr=block_sizes, num_blocks_stride=num_blocks.stride(0), num_reqs=idx_mapping.shape[0],
            MASK_SLIDING_WINDOW=key.mask_sliding_window, BLOCK=key.block,
        )  # fmt: skip
        groups = src_ptrs.shape[0]
        return warmreg.LaunchSpec(key, (groups, num_rows) if groups and num_rows else None, kwargs, None)

    def _check(
        self,
        idx_mapping: torch.Tensor,
        src_ptrs: torch.Tensor,
        dst_ptrs: torch.Tensor,
        strides: torch.Tensor,
        num_blocks: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        reach: torch.Tensor,
        block_sizes: torch.Tensor,
        num_rows: int,
    ) -> None:
        groups = src_ptrs.shape[0] if src_ptrs.ndim == 1 else -1
        per_group = {
            "src_ptrs": (src_ptrs, torch.uint64), "dst_ptrs": (dst_ptrs, torch.uint64),
            "block_table_strides": (strides, torch.int64), "sliding_window_reach": (reach, torch.int32),
            "block_sizes": (block_sizes, torch.int32),
        }  # fmt: skip
        for name, (t, dtype) in per_group.items():
            if t.dtype != dtype or t.ndim != 1 or t.shape[0] != groups or (groups > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(
                    self.name,
                    f"{name} must be a contiguous {dtype} [G] with G = {groups} groups "
                    f"(got {t.dtype} {tuple(t.shape)})",
                )
        if (
            num_blocks.dtype != torch.int32
            or num_blocks.ndim != 2
            or num_blocks.shape[0] != groups
            or (num_blocks.shape[1] > 1 and num_blocks.stride(1) != 1)
        ):
            raise warmreg.LaunchError(
                self.name,
                f"num_blocks must be int32 [G = {groups}, max_num_reqs] with contiguous rows "
                f"(got {num_blocks.dtype} {tuple(num_blocks.shape)})",
            )
        for name, t in (("idx_mapping", idx_mapping), ("num_computed_tokens", num_computed_tokens)):
            if t.dtype != torch.int32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(
                    self.name, f"{name} must be a contiguous 1-D int32 tensor (got {t.dtype} {tuple(t.shape)})"
                )
        if num_rows < idx_mapping.shape[0]:
            raise warmreg.LaunchError(
                self.name, f"num_rows ({num_rows}) must be >= the batch's {idx_mapping.shape[0]} requests"
            )
        tensors = (idx_mapping, src_ptrs, dst_ptrs, strides, num_blocks, num_computed_tokens, reach, block_sizes)
        if len({t.device for t in tensors}) != 1:
            raise warmreg.LaunchError(self.name, "inputs on several devices: use one device")


def gather_block_tables_reference(
    idx_mapping: torch.Tensor,
    src_tables: Sequence[torch.Tensor],
    dst_tables: Sequence[torch.Tensor],
    num_blocks: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    sliding_window_reach: torch.Tensor,
    block_sizes: torch.Tensor,
    *,
    num_rows: int,
    mask_sliding_window: bool,
) -> tuple[torch.Tensor, ...]:
    """PyTorch reference of :class:`GatherBlockTables` on the tables themselves: writes ``dst_tables`` in place
    and returns them."""
    for g, (src, dst) in enumerate(zip(src_tables, dst_tables, strict=True)):
        dst[idx_mapping.shape[0] : num_rows] = 0
        reach, bs = int(sliding_window_reach[g]), int(block_sizes[g])
        for b, q in enumerate(idx_mapping.tolist()):
            n = int(num_blocks[g, q])
            z = max(int(num_computed_tokens[q]) - reach, 0) // bs if mask_sliding_window and reach > 0 else 0
            dst[b, :n] = src[q, :n]
            dst[b, : min(z, n)] = 0
    return tuple(dst_tables)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather on every platform, its mask on unless DCP (``serving.decode_context_parallel_size``
    > 1) zeroes the sliding-window reaches (see the module docstring).

    :raises warmreg.ConfigError: for a malformed ``serving.decode_context_parallel_size``.
    """
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    registry.add(GatherBlockTables(mask_sliding_window=dcp == 1))
