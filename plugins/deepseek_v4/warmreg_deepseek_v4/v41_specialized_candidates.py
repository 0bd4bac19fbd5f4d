"""DeepSeek-V4.1's specialized decode, candidate source: the block scores before and the finalization after vLLM's
``cooperative_topk`` (vLLM 0.34 ``models/deepseek_v41/nvidia/specialized_decode/attention/candidate_topk.py``:
``select_candidate_blocks_cooperative``, ``_block_scores_kernel`` and ``_finalize_candidates_kernel``).

For fp32 ``logits`` ``[rows, W]``, ``N = cdiv(W, BS)``, ``e = row_ends[r]`` and ``L = min(cdiv(max(e, 0), BS), N)``,
the scores step (:class:`CooperativeScores`, grid ``(rows, cdiv(N, 128))``) writes::

    lengths[r] = L;  out[r, :K] = -1                                       (program (r, 0); out int32 [rows, K])
    scores[r, b] = max(logits[r, b BS : min((b + 1) BS, e, W)])  for b < L   (NaN-propagating; scores [rows, N])
                   = +inf for the newest block b = (e - 1) // BS (e > 0)

then ``cooperative_topk(scores, lengths, out, workspace, K, N)`` (a CUDA op, not Triton) writes up to ``K`` block ids
of each row's prefix, in any order, and the finalize step (:class:`CooperativeFinalize`, grid ``(rows, cdiv(K,
1024))``) keeps an id only if it is in ``[0, L)`` with a score other than ``-inf``::

    out[r, j] = out[r, j] if 0 <= out[r, j] < L and scores[r, out[r, j]] != -inf, else -1

Where it runs: the specialized decode's candidate source (``_decode_rows`` with ``fast_candidates``:
``supports_cooperative_candidates``, up to 64 rows a rank, ``K`` in 512 / 1024 / 2048, ``N % 4 == 0``) when the
selection is not taken from the BF16 logits (``_selects_from_bf16``: ``decode_topk``, a CuTe kernel, takes it for
candidate blocks of 8 within its row limits). Not planned yet: :mod:`._v41_candidates` plans the stock
indexer's calls only (:mod:`.v41_specialized` has the switch).

Keys: scores: the logits' and scores' dtypes, ``BS``, ``K``, the 128-block tile; finalize: ``K``, the 1024-column
tile; four warps (vLLM's default). Unlike vLLM, ``W``, ``N`` and the strides are unspecialized runtime ints and no
pointer is specialized on alignment: one binary serves every row layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4

__all__ = [
    "CooperativeFinalize", "CooperativeFinalizeKey", "CooperativeScores", "CooperativeScoresKey",
    "cooperative_finalize_reference", "cooperative_scores_reference", "register", "select_candidate_blocks_cooperative",
]  # fmt: skip

SCORE_TILE, FINAL_TILE = 128, 1024  # vLLM's
_NUM_WARPS = 4  # vLLM launches with Triton's default
_PTRS = ["logits_ptr", "ends_ptr", "scores_ptr", "lengths_ptr", "out_ptr"]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=["stride_row", "stride_col", "width", "nblocks"], do_not_specialize_on_alignment=_PTRS)
def _cooperative_scores_kernel(
    logits_ptr, ends_ptr, scores_ptr, lengths_ptr, out_ptr, stride_row, stride_col, width, nblocks,
    BLOCK_SIZE: tl.constexpr,  # logits columns per candidate block
    K: tl.constexpr,  # candidates per row (the -1 fill of the output row)
    TILE: tl.constexpr,  # blocks a program
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * TILE + tl.arange(0, TILE)
    end = tl.load(ends_ptr + row)
    limit = tl.minimum((tl.maximum(end, 0) + BLOCK_SIZE - 1) // BLOCK_SIZE, nblocks)  # the scored prefix
    if tl.program_id(1) == 0:
        tl.store(lengths_ptr + row, limit.to(tl.int32))
        for t in range(0, K, TILE):  # slots the top-k may leave unwritten must read -1
            slots = t + tl.arange(0, TILE)
            tl.store(out_ptr + row * K + slots, -1, mask=slots < K)
    offs = tl.arange(0, triton.next_power_of_2(BLOCK_SIZE))
    cols = blocks[:, None] * BLOCK_SIZE + offs[None, :]
    inside = (blocks[:, None] < nblocks) & (offs[None, :] < BLOCK_SIZE) & (cols < end) & (cols < width)
    values = tl.load(logits_ptr + row * stride_row + cols * stride_col, mask=inside, other=-float("inf"))
    best = tl.reduce(values, 1, _max_nan)
    best = tl.where((end > 0) & (blocks == (end - 1) // BLOCK_SIZE), float("inf"), best)  # the newest block
    tl.store(scores_ptr + row * nblocks + blocks, best, mask=blocks < limit)


@triton.jit(do_not_specialize=["nblocks"], do_not_specialize_on_alignment=["out_ptr", "scores_ptr", "lengths_ptr"])
def _cooperative_finalize_kernel(
    out_ptr, scores_ptr, lengths_ptr, nblocks,
    K: tl.constexpr,  # candidates per row
    TILE: tl.constexpr,  # columns a program
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    index = tl.load(out_ptr + row * K + cols, mask=cols < K, other=-1)
    valid = (index >= 0) & (index < tl.load(lengths_ptr + row))
    value = tl.load(scores_ptr + row * nblocks + index, mask=(cols < K) & valid, other=-float("inf"))
    tl.store(out_ptr + row * K + cols, tl.where(valid & (value != -float("inf")), index, -1), mask=cols < K)


@attrs.frozen(kw_only=True)
class CooperativeScoresKey(warmreg.CompileKey):
    """What changes the binary of the cooperative block scores."""

    logits_dtype: str
    scores_dtype: str
    block_size: int
    k: int
    tile: int
    num_warps: int


class CooperativeScores(warmreg.TritonKernel[CooperativeScoresKey]):
    """Block scores of each row's prefix, its length, and the ``-1`` fill of its output row (module docstring).

    :param block_size: ``candidate_block_size`` (domains only).
    :param topk_blocks: ``candidate_topk_blocks`` (domains only).
    """

    name = "deepseek_v4.v41_specialized_candidate_scores"
    key_type = CooperativeScoresKey
    jit = _cooperative_scores_kernel

    def __init__(self, *, block_size: int = 8, topk_blocks: int = 2048) -> None:
        self.block_size, self.topk_blocks = block_size, topk_blocks

    def dispatch(
        self, *, logits: torch.Tensor, scores: torch.Tensor, out: torch.Tensor, block_size: int
    ) -> CooperativeScoresKey:
        return CooperativeScoresKey(
            logits_dtype=warmreg.dtype_name(logits.dtype), scores_dtype=warmreg.dtype_name(scores.dtype),
            block_size=block_size, k=out.shape[1], tile=SCORE_TILE, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "logits": [warmreg.meta((1, 1024), torch.float32)], "scores": [warmreg.meta((1, 128), torch.float32)],
            "out": [warmreg.meta((1, self.topk_blocks), torch.int32)], "block_size": [self.block_size],
        }  # fmt: skip

    def warmup_inputs(self, key: CooperativeScoresKey) -> Mapping[str, Any]:
        ints = warmreg.meta((1,), torch.int32)
        return {
            "logits": warmreg.meta((1, 1024), getattr(torch, key.logits_dtype)), "row_ends": ints,
            "scores": warmreg.meta((1, -(-1024 // key.block_size)), getattr(torch, key.scores_dtype)), "lengths": ints,
            "out": warmreg.meta((1, key.k), torch.int32), "block_size": key.block_size,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        logits: torch.Tensor,
        row_ends: torch.Tensor,
        scores: torch.Tensor,
        lengths: torch.Tensor,
        out: torch.Tensor,
        *,
        block_size: int,
    ) -> warmreg.LaunchSpec[CooperativeScoresKey]:
        """Write ``scores``, ``lengths`` and the ``-1`` fill of ``out`` (returned): the first launch.

        :param logits: float ``[rows, W]`` (vLLM: fp32), any strides.
        :param row_ends: int32 ``[rows]``, contiguous.
        :param scores: float ``[rows, N]`` (``N = cdiv(W, block_size)``), contiguous.
        :param lengths: int32 ``[rows]``, contiguous.
        :param out: int32 ``[rows, K]``, contiguous (the candidate rows).
        :param block_size: logits columns per block, ``>= 1``.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        rows, width = _check(self.name, logits, row_ends, lengths, out, block_size)
        nblocks = -(-width // block_size)
        if scores.shape != (rows, nblocks) or not scores.dtype.is_floating_point or not scores.is_contiguous():
            raise warmreg.LaunchError(self.name, f"scores must be a contiguous float [{rows}, {nblocks}] (got "
                                                 f"{scores.dtype} {tuple(scores.shape)})")  # fmt: skip
        key = self.dispatch(logits=logits, scores=scores, out=out, block_size=block_size)
        kwargs = dict(
            logits_ptr=logits, ends_ptr=row_ends, scores_ptr=scores, lengths_ptr=lengths, out_ptr=out,
            stride_row=logits.stride(0), stride_col=logits.stride(1), width=width, nblocks=nblocks,
            BLOCK_SIZE=key.block_size, K=key.k, TILE=key.tile,
        )  # fmt: skip
        grid = (rows, triton.cdiv(nblocks, SCORE_TILE)) if rows and nblocks else None
        return warmreg.LaunchSpec(key, grid, kwargs, (scores, lengths, out))


@attrs.frozen(kw_only=True)
class CooperativeFinalizeKey(warmreg.CompileKey):
    """What changes the binary of the cooperative finalization."""

    k: int
    scores_dtype: str
    tile: int
    num_warps: int


class CooperativeFinalize(warmreg.TritonKernel[CooperativeFinalizeKey]):
    """``-1`` for the top-k's out-of-prefix, stale or ``-inf`` ids (module docstring).

    :param topk_blocks: ``candidate_topk_blocks`` (domains only).
    """

    name = "deepseek_v4.v41_specialized_candidate_finalize"
    key_type = CooperativeFinalizeKey
    jit = _cooperative_finalize_kernel

    def __init__(self, *, topk_blocks: int = 2048) -> None:
        self.topk_blocks = topk_blocks

    def dispatch(self, *, out: torch.Tensor, scores: torch.Tensor) -> CooperativeFinalizeKey:
        return CooperativeFinalizeKey(
            k=out.shape[1], scores_dtype=warmreg.dtype_name(scores.dtype), tile=FINAL_TILE, num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "out": [warmreg.meta((1, self.topk_blocks), torch.int32)],
            "scores": [warmreg.meta((1, 128), torch.float32)],
        }

    def warmup_inputs(self, key: CooperativeFinalizeKey) -> Mapping[str, Any]:
        return {
            "out": warmreg.meta((1, key.k), torch.int32), "scores": warmreg.meta((1, 128), getattr(torch, key.scores_dtype)),
            "lengths": warmreg.meta((1,), torch.int32),
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor
    ) -> warmreg.LaunchSpec[CooperativeFinalizeKey]:
        """Finalize the candidate rows ``out`` in place (returned): the last launch.

        :param out: int32 ``[rows, K]``, contiguous, as the top-k left it.
        :param scores: float ``[rows, N]``, contiguous (the scores step's).
        :param lengths: int32 ``[rows]``, contiguous (the scores step's).
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        rows = out.shape[0] if out.ndim == 2 else 0
        if out.dtype != torch.int32 or out.ndim != 2 or out.shape[1] < 1 or not out.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"out must be a contiguous int32 [rows, K] (got {out.dtype} {tuple(out.shape)})"
            )
        if (
            scores.ndim != 2
            or scores.shape[0] != rows
            or not scores.dtype.is_floating_point
            or not scores.is_contiguous()
        ):
            raise warmreg.LaunchError(self.name, f"scores must be a contiguous float [{rows}, N]")
        if lengths.dtype != torch.int32 or lengths.shape != (rows,) or (rows > 1 and lengths.stride(0) != 1):
            raise warmreg.LaunchError(self.name, f"lengths must be a contiguous int32 [{rows}]")
        key = self.dispatch(out=out, scores=scores)
        kwargs = dict(
            out_ptr=out, scores_ptr=scores, lengths_ptr=lengths, nblocks=scores.shape[1], K=key.k, TILE=key.tile
        )
        return warmreg.LaunchSpec(key, (rows, triton.cdiv(key.k, FINAL_TILE)) if rows else None, kwargs, out)


def _check(name: str, logits: torch.Tensor, ends: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
           block_size: int) -> tuple[int, int]:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the scores step cannot take; ``(rows, W)``."""
    if logits.ndim != 2 or not logits.dtype.is_floating_point or block_size < 1:
        raise warmreg.LaunchError(name, f"logits must be a float [rows, width] tensor and block_size >= 1 (got "
                                        f"{logits.dtype} {tuple(logits.shape)}, {block_size})")  # fmt: skip
    rows, width = logits.shape
    for arg, t in (("row_ends", ends), ("lengths", lengths)):
        if t.dtype != torch.int32 or t.shape != (rows,) or (rows > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be a contiguous int32 [{rows}] (got {t.dtype} {tuple(t.shape)})"
            )
    if out.dtype != torch.int32 or out.ndim != 2 or out.shape[0] != rows or out.shape[1] < 1 or not out.is_contiguous():
        raise warmreg.LaunchError(
            name, f"out must be a contiguous int32 [{rows}, K] (got {out.dtype} {tuple(out.shape)})"
        )
    return rows, width


def select_candidate_blocks_cooperative(
    scores_op: CooperativeScores, finalize_op: CooperativeFinalize, logits: torch.Tensor, row_ends: torch.Tensor,
    block_size: int, out: torch.Tensor, topk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None],
) -> None:  # fmt: skip
    """vLLM's ``select_candidate_blocks_cooperative`` on warmreg's ops, with ``topk(scores, lengths, out, k)`` in
    the place of ``torch.ops._C.cooperative_topk`` (a CUDA op warmreg does not build)."""
    rows, width = logits.shape
    scores = logits.new_empty((rows, -(-width // block_size)))
    lengths = torch.empty(rows, dtype=torch.int32, device=logits.device)
    scores_op(logits, row_ends, scores, lengths, out, block_size=block_size)
    topk(scores, lengths, out, out.shape[1])
    finalize_op(out, scores, lengths)


def cooperative_scores_reference(
    logits: torch.Tensor, row_ends: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`CooperativeScores`' scores and lengths (unwritten scores as NaN)."""
    rows, width = logits.shape
    nblocks = -(-width // block_size)
    scores = torch.full((rows, nblocks), float("nan"))
    lengths = torch.empty(rows, dtype=torch.int32)
    for r in range(rows):
        e = int(row_ends[r])
        limit = min(-(-max(e, 0) // block_size), nblocks)
        lengths[r] = limit
        for b in range(limit):
            seg = logits[r, b * block_size : min((b + 1) * block_size, e, width)].float()
            best = float("-inf") if not seg.numel() else (float("nan") if seg.isnan().any() else float(seg.max()))
            scores[r, b] = float("inf") if e > 0 and b == (e - 1) // block_size else best
    return scores, lengths


def cooperative_finalize_reference(out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`CooperativeFinalize`: the finalized copy of ``out``."""
    result = out.clone()
    for r in range(out.shape[0]):
        for j, b in enumerate(out[r].tolist()):
            ok = 0 <= b < int(lengths[r]) and float(scores[r, b]) != float("-inf")
            result[r, j] = b if ok else -1
    return result


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM's specialized decode (sm_10x) selects candidates only for a checkpoint with two-level
    candidate filtering, not planned yet (:mod:`._v41_candidates` plans the stock indexer's calls); a deployment that
    serves one registers :class:`CooperativeScores` and :class:`CooperativeFinalize` itself."""
