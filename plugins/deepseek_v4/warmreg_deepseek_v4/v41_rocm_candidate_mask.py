"""DeepSeek-V4.1's two-level indexer on ROCm gfx942 / gfx950: the decode logits masked to each row's candidate blocks
in one launch (vLLM 0.34 ``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_apply_candidate_mask_strided`` ->
``_mask_candidates_fused_kernel``).

``logits`` ``[rows, W]`` (fp32), ``s = row_ks[r // RR]`` (0 without starts), ``e = min(row_ke[r // RR], W)``, the
candidate block size ``BS`` and row ``r``'s candidate blocks ``cand[r, :K]`` (block ids counted from ``s``, ``-1``
padded); in place::

    live   = cdiv(e - s, BS) blocks;   chosen(b) = some k: cand[r, k] == b  and  0 <= b < live
    edge   = some k < next_pow2(K) (padding: -1): s + cand[r, k] * BS >= W
    logits[r, c] = -inf   for c < min(s, e) (with starts), and for s <= c < e unless chosen((c - s) // BS)
                          or (c == W - 1 and edge)
    columns at or past e: untouched

(vLLM builds per-row block flags in a scratch buffer with each program's own tiles and reads them back across
barriers, an ``s_waitcnt`` inline-asm wait before each; the flags are not an output. This kernel tests the
membership of each block in the row's candidate list directly, so it needs no scratch and no barrier, and writes the
same ``-inf`` at the same columns.) Grid ``(rows, min(128, cdiv(W, 1024)))``: each program takes every
``grid_cols``-th 256-column tile from ``s`` until ``e``.

Where it runs: V4.1's index layers that mask their scores with the candidate blocks of the
``candidate_source_layer_id`` indexer (a checkpoint with ``candidate_source_layer_id >= 0`` and
``candidate_topk_blocks > 0``; ``amd/model.py``'s ``candidate_block_buffer``), at every decode step on gfx942 and
gfx950: ``rocm_aiter_sparse_attn_indexer`` (FP8 cache) and the MXFP4 paged indexer call
``_apply_candidate_mask_strided(logits, None, seq_lens, candidate_blocks, block_size, row_repeat)``. Not planned
yet: :mod:`._v41_candidates` plans the two-level kernels on CUDA only (the CUDA mask, :mod:`.v41_candidate_mask`).

Key: ``BS``, ``K`` (constexprs), whether starts are given, the tile, the warps. ``RR``, ``W`` and the strides are
runtime ints (``do_not_specialize``) and no pointer is specialized on alignment.

Off gfx942 / gfx950 the same call builds the flags first (``_candidate_flags_kernel``: uint8 ``[rows, N + 1]``,
``N = cdiv(W, BS)``, the last column the edge flag; warmreg's :class:`.v41_candidate_flags.CandidateFlags`) and then
masks with ``_mask_candidates_strided_kernel`` (:class:`RocmCandidateMaskStrided`): 1024-column tiles from column 0,
while a tile starts before ``e = row_ke[r // RR]``::

    logits[r, c] = -inf   for every c < W of those tiles, unless s <= c < min(e, W) and (flags[r, (c - s) // BS]
                          or (c == W - 1 and flags[r, N]))

so it also masks the head ``[0, s)`` and the columns from ``e`` to the end of ``e``'s tile (which nothing reads).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4

__all__ = [
    "RocmCandidateMask", "RocmCandidateMaskKey", "RocmCandidateMaskStrided", "RocmCandidateMaskStridedKey",
    "candidate_flags_reference", "rocm_candidate_mask_reference", "rocm_candidate_mask_strided_reference", "register",
]  # fmt: skip

_TILE = 256  # columns a step of a program
_GRID_COLS, _GRID_TILE = 128, 1024  # the programs a row: min(128, cdiv(W, 1024)), as vLLM's narrowest tile
_NUM_WARPS = 4
_INTS = ["stride_row", "stride_col", "stride_start", "stride_end", "stride_cand_row", "stride_cand_col", "row_repeat",
         "width"]  # fmt: skip


@triton.jit(
    do_not_specialize=_INTS, do_not_specialize_on_alignment=["logits_ptr", "starts_ptr", "ends_ptr", "cand_ptr"]
)
def _rocm_candidate_mask_kernel(
    logits_ptr,  # [rows, W] fp32
    starts_ptr,  # [groups] int32 (unused without starts)
    ends_ptr,  # [groups] int32
    cand_ptr,  # [rows, K] int32 candidate block ids
    stride_row,
    stride_col,
    stride_start,
    stride_end,
    stride_cand_row,
    stride_cand_col,
    row_repeat,
    width,
    BLOCK_SIZE: tl.constexpr,  # the candidate block's columns
    K: tl.constexpr,  # candidates a row
    HAS_STARTS: tl.constexpr,  # rows start at row_ks (else 0)
    TILE: tl.constexpr,  # columns a step
):
    row = tl.program_id(0).to(tl.int64)
    group = row // row_repeat
    start = tl.load(starts_ptr + group * stride_start) if HAS_STARTS else 0
    end = tl.minimum(tl.load(ends_ptr + group * stride_end), width)
    pid, nprog = tl.program_id(1), tl.num_programs(1)
    base = logits_ptr + row * stride_row
    if HAS_STARTS:
        head_end = tl.minimum(start, end)
        c0 = pid * TILE
        while c0 < head_end:
            cols = c0 + tl.arange(0, TILE)
            tl.store(base + cols * stride_col, -float("inf"), mask=cols < head_end)
            c0 += nprog * TILE
    k = tl.arange(0, triton.next_power_of_2(K))
    cand = tl.load(cand_ptr + row * stride_cand_row + k * stride_cand_col, mask=k < K, other=-1)
    edge = tl.max((start + cand * BLOCK_SIZE >= width).to(tl.int32), axis=0) != 0
    live_blocks = tl.cdiv(end - start, BLOCK_SIZE)
    cand = tl.where((cand >= 0) & (cand < live_blocks), cand, -1)
    c0 = start + pid * TILE
    while c0 < end:
        cols = c0 + tl.arange(0, TILE)
        block = (cols - start) // BLOCK_SIZE
        chosen = tl.max((block[:, None] == cand[None, :]).to(tl.int32), axis=1) != 0
        keep = chosen | tl.where(edge, cols == width - 1, False)
        tl.store(base + cols * stride_col, -float("inf"), mask=(cols < end) & ~keep)
        c0 += nprog * TILE


@attrs.frozen(kw_only=True)
class RocmCandidateMaskKey(warmreg.CompileKey):
    """What changes the binary: the block size, the candidates a row, starts or not, the tile, the warps."""

    block_size: int
    k: int
    has_starts: bool
    tile: int
    num_warps: int


def _vector(name: str, what: str, t: torch.Tensor, groups: int) -> None:
    if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < groups:
        raise warmreg.LaunchError(
            name, f"{what} must be a 1-D int32 [>= {groups}] tensor (got {t.dtype} {tuple(t.shape)})"
        )


class RocmCandidateMask(warmreg.TritonKernel[RocmCandidateMaskKey]):
    """The decode logits masked to each row's candidate blocks, in place; see the module docstring.

    :param block_size: the candidate block size; ``k``: ``candidate_topk_blocks`` (domains only).
    """

    name = "deepseek_v4.v41_rocm_candidate_mask"
    key_type = RocmCandidateMaskKey
    jit = _rocm_candidate_mask_kernel

    def __init__(self, *, block_size: int = 64, k: int = 64) -> None:
        self.block_size, self.k = block_size, k

    def dispatch(
        self, *, candidate_blocks: torch.Tensor, row_ks: torch.Tensor | None, block_size: int
    ) -> RocmCandidateMaskKey:
        return RocmCandidateMaskKey(
            block_size=block_size, k=candidate_blocks.shape[1], has_starts=row_ks is not None, tile=_TILE,
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "candidate_blocks": [warmreg.meta((1, self.k), torch.int32)], "row_ks": [None],
            "block_size": [self.block_size],
        }  # fmt: skip

    def warmup_inputs(self, key: RocmCandidateMaskKey) -> Mapping[str, Any]:
        i32 = torch.int32
        return {
            "logits": warmreg.meta((1, 4096), torch.float32), "row_ks": warmreg.meta((1,), i32) if key.has_starts else None,
            "row_ke": warmreg.meta((1,), i32), "candidate_blocks": warmreg.meta((1, key.k), i32),
            "block_size": key.block_size,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        logits: torch.Tensor,
        row_ks: torch.Tensor | None,
        row_ke: torch.Tensor,
        candidate_blocks: torch.Tensor,
        block_size: int,
        row_repeat: int = 1,
    ) -> warmreg.LaunchSpec[RocmCandidateMaskKey]:
        """Mask ``logits`` in place (vLLM's ``_apply_candidate_mask_strided`` on gfx942 / gfx950, same arguments);
        returns ``logits``.

        :param logits: fp32 ``[rows, W]``, any strides.
        :param row_ks: None, or int32 ``[>= cdiv(rows, row_repeat)]`` row starts; ``row_ke``: likewise, the ends.
        :param candidate_blocks: int32 ``[>= rows, K]`` block ids (``-1``: none), any strides.
        :param block_size: the candidate block's columns (>= 1); ``row_repeat``: rows sharing a start and end (>= 1).
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or a block size or repeat below 1.
        """
        name = self.name
        if logits.dtype != torch.float32 or logits.ndim != 2:
            raise warmreg.LaunchError(name, f"logits must be fp32 [rows, W] (got {logits.dtype} {tuple(logits.shape)})")
        rows, width = logits.shape
        if block_size < 1 or row_repeat < 1:
            raise warmreg.LaunchError(name, f"block_size and row_repeat must be >= 1 (got {block_size}, {row_repeat})")
        groups = triton.cdiv(rows, row_repeat)
        _vector(name, "row_ke", row_ke, groups)
        if row_ks is not None:
            _vector(name, "row_ks", row_ks, groups)
        cand = candidate_blocks
        if cand.dtype != torch.int32 or cand.ndim != 2 or cand.shape[0] < rows or cand.shape[1] < 1:
            raise warmreg.LaunchError(name, f"candidate_blocks must be int32 [>= {rows}, K >= 1] (got {cand.dtype} "
                                      f"{tuple(cand.shape)})")  # fmt: skip
        key = self.dispatch(candidate_blocks=cand, row_ks=row_ks, block_size=block_size)
        kwargs = dict(
            logits_ptr=logits, starts_ptr=row_ke if row_ks is None else row_ks, ends_ptr=row_ke, cand_ptr=cand,
            stride_row=logits.stride(0), stride_col=logits.stride(1), stride_start=0 if row_ks is None else row_ks.stride(0),
            stride_end=row_ke.stride(0), stride_cand_row=cand.stride(0), stride_cand_col=cand.stride(1),
            row_repeat=row_repeat, width=width, BLOCK_SIZE=key.block_size, K=key.k, HAS_STARTS=key.has_starts,
            TILE=key.tile,
        )  # fmt: skip
        grid = (rows, min(_GRID_COLS, triton.cdiv(width, _GRID_TILE))) if rows and width else None
        return warmreg.LaunchSpec(key, grid, kwargs, logits)


def rocm_candidate_mask_reference(
    logits: torch.Tensor,
    row_ks: torch.Tensor | None,
    row_ke: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int = 1,
) -> torch.Tensor:
    """PyTorch reference: a masked copy of ``logits``."""
    out = logits.clone()
    rows, width = logits.shape
    k = candidate_blocks.shape[1]
    for r in range(rows):
        g = r // row_repeat
        s = int(row_ks[g]) if row_ks is not None else 0
        e = min(int(row_ke[g]), width)
        cand = candidate_blocks[r].long().tolist() + [-1] * (triton.next_power_of_2(k) - k)
        edge = any(s + c * block_size >= width for c in cand)
        live = -(-(e - s) // block_size)
        chosen = {c for c in cand if 0 <= c < live}
        if row_ks is not None:
            out[r, : max(min(s, e), 0)] = -float("inf")
        for c in range(max(s, 0), e):
            if (c - s) // block_size not in chosen and not (c == width - 1 and edge):
                out[r, c] = -float("inf")
    return out


@triton.jit(
    do_not_specialize=["stride_row", "stride_col", "stride_start", "stride_end", "row_repeat", "width", "nblocks"],
    do_not_specialize_on_alignment=["logits_ptr", "starts_ptr", "ends_ptr", "flags_ptr"],
)
def _rocm_candidate_mask_strided_kernel(
    logits_ptr,  # [rows, W] fp32
    starts_ptr,  # [groups] int32 (unused without starts)
    ends_ptr,  # [groups] int32
    flags_ptr,  # [rows, nblocks + 1] uint8, contiguous; column nblocks: the edge flag
    stride_row,
    stride_col,
    stride_start,
    stride_end,
    row_repeat,
    width,
    nblocks,
    BLOCK_SIZE: tl.constexpr,  # the candidate block's columns
    HAS_STARTS: tl.constexpr,  # rows start at row_ks (else 0)
    TILE: tl.constexpr,  # columns a step; tiles start at multiples of TILE from column 0
):
    row = tl.program_id(0).to(tl.int64)
    group = row // row_repeat
    start = tl.load(starts_ptr + group * stride_start) if HAS_STARTS else 0
    end = tl.load(ends_ptr + group * stride_end)
    flags = flags_ptr + row * (nblocks + 1)
    edge = tl.load(flags + nblocks) != 0
    c0 = tl.program_id(1) * TILE
    while c0 < end:
        cols = c0 + tl.arange(0, TILE)
        valid = (cols >= start) & (cols < end) & (cols < width)
        keep = tl.load(flags + (cols - start) // BLOCK_SIZE, mask=valid, other=0) != 0
        keep = keep | tl.where(edge, cols == width - 1, False)
        tl.store(
            logits_ptr + row * stride_row + cols * stride_col, -float("inf"), mask=(cols < width) & ~(valid & keep)
        )
        c0 += tl.num_programs(1) * TILE


@attrs.frozen(kw_only=True)
class RocmCandidateMaskStridedKey(warmreg.CompileKey):
    """What changes the binary: the block size, starts or not, the tile (vLLM's 1024), the warps."""

    block_size: int
    has_starts: bool
    tile: int
    num_warps: int


class RocmCandidateMaskStrided(warmreg.TritonKernel[RocmCandidateMaskStridedKey]):
    """The logits masked by prebuilt candidate flags, in place (off gfx942 / gfx950; see the module docstring).

    :param block_size: the candidate block size (domains only).
    """

    name = "deepseek_v4.v41_rocm_candidate_mask_strided"
    key_type = RocmCandidateMaskStridedKey
    jit = _rocm_candidate_mask_strided_kernel

    def __init__(self, *, block_size: int = 64) -> None:
        self.block_size = block_size

    def dispatch(self, *, row_ks: torch.Tensor | None, block_size: int) -> RocmCandidateMaskStridedKey:
        return RocmCandidateMaskStridedKey(
            block_size=block_size, has_starts=row_ks is not None, tile=_GRID_TILE, num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"row_ks": [None], "block_size": [self.block_size]}

    def warmup_inputs(self, key: RocmCandidateMaskStridedKey) -> Mapping[str, Any]:
        i32 = torch.int32
        return {
            "logits": warmreg.meta((1, 4096), torch.float32), "row_ks": warmreg.meta((1,), i32) if key.has_starts else None,
            "row_ke": warmreg.meta((1,), i32), "flags": warmreg.meta((1, 4096 // key.block_size + 1), torch.uint8),
            "block_size": key.block_size,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        logits: torch.Tensor,
        row_ks: torch.Tensor | None,
        row_ke: torch.Tensor,
        flags: torch.Tensor,
        block_size: int,
        row_repeat: int = 1,
    ) -> warmreg.LaunchSpec[RocmCandidateMaskStridedKey]:
        """Mask ``logits`` in place with ``flags`` (vLLM's ``_mask_candidates_strided_kernel`` launch); returns
        ``logits``.

        :param logits: fp32 ``[rows, W]``, any strides; ``row_ks`` / ``row_ke``: as :class:`RocmCandidateMask`.
        :param flags: uint8 ``[rows, cdiv(W, block_size) + 1]``, contiguous (the candidate flags, edge last).
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or a block size or repeat below 1.
        """
        name = self.name
        if logits.dtype != torch.float32 or logits.ndim != 2:
            raise warmreg.LaunchError(name, f"logits must be fp32 [rows, W] (got {logits.dtype} {tuple(logits.shape)})")
        rows, width = logits.shape
        if block_size < 1 or row_repeat < 1:
            raise warmreg.LaunchError(name, f"block_size and row_repeat must be >= 1 (got {block_size}, {row_repeat})")
        nblocks, groups = triton.cdiv(width, block_size), triton.cdiv(rows, row_repeat)
        _vector(name, "row_ke", row_ke, groups)
        if row_ks is not None:
            _vector(name, "row_ks", row_ks, groups)
        if flags.dtype != torch.uint8 or tuple(flags.shape) != (rows, nblocks + 1) or not flags.is_contiguous():
            raise warmreg.LaunchError(name, f"flags must be a contiguous uint8 {(rows, nblocks + 1)} tensor (got "
                                      f"{flags.dtype} {tuple(flags.shape)})")  # fmt: skip
        key = self.dispatch(row_ks=row_ks, block_size=block_size)
        kwargs = dict(
            logits_ptr=logits, starts_ptr=row_ke if row_ks is None else row_ks, ends_ptr=row_ke, flags_ptr=flags,
            stride_row=logits.stride(0), stride_col=logits.stride(1), stride_start=0 if row_ks is None else row_ks.stride(0),
            stride_end=row_ke.stride(0), row_repeat=row_repeat, width=width, nblocks=nblocks,
            BLOCK_SIZE=key.block_size, HAS_STARTS=key.has_starts, TILE=key.tile,
        )  # fmt: skip
        grid = (rows, min(_GRID_COLS, triton.cdiv(width, key.tile))) if rows and width else None
        return warmreg.LaunchSpec(key, grid, kwargs, logits)


def candidate_flags_reference(
    candidate_blocks: torch.Tensor, row_ks: torch.Tensor | None, width: int, block_size: int, row_repeat: int = 1
) -> torch.Tensor:
    """The flags ``_candidate_flags_kernel`` builds (uint8 ``[rows, N + 1]``): a block past ``W`` sets the edge flag."""
    rows, n = candidate_blocks.shape[0], triton.cdiv(width, block_size)
    flags = torch.zeros(rows, n + 1, dtype=torch.uint8)
    for r in range(rows):
        s = int(row_ks[r // row_repeat]) if row_ks is not None else 0
        for b in candidate_blocks[r].tolist():
            b = n if s + b * block_size >= width else b
            if b >= 0:
                flags[r, b] = 1
    return flags


def rocm_candidate_mask_strided_reference(
    logits: torch.Tensor,
    row_ks: torch.Tensor | None,
    row_ke: torch.Tensor,
    flags: torch.Tensor,
    block_size: int,
    row_repeat: int = 1,
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmCandidateMaskStrided`: a masked copy of ``logits``."""
    out = logits.clone()
    rows, width = logits.shape
    n = flags.shape[1] - 1
    for r in range(rows):
        g = r // row_repeat
        s, e = (int(row_ks[g]) if row_ks is not None else 0), int(row_ke[g])
        if e <= 0:
            continue
        for c in range(min(-(-e // _GRID_TILE) * _GRID_TILE, width)):
            valid = s <= c < min(e, width)
            keep = (valid and bool(flags[r, (c - s) // block_size])) or (c == width - 1 and bool(flags[r, n]))
            if not (valid and keep):
                out[r, c] = -float("inf")
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM launches the masks only for a checkpoint with two-level candidate filtering, which warmreg
    plans on CUDA only so far (see the module docstring); a deployment that serves one registers
    :class:`RocmCandidateMask` itself (``warmreg.rocm_arch_in("gfx942", "gfx950")``), and elsewhere on ROCm
    :class:`.v41_candidate_flags.CandidateFlags` with :class:`RocmCandidateMaskStrided`."""
