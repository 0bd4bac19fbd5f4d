"""DeepSeek-V4.1's two-level indexer, candidate source: each row's top candidate blocks by maximum logit, the newest
block pinned (vLLM 0.34 ``model_executor/kernels/attention/dsa/candidate_blocks.py``: ``select_candidate_blocks``,
``_block_scores_kernel`` and ``_store_candidates_kernel``; :func:`select_candidate_blocks` here runs the whole call).

For ``logits`` ``[rows, W]`` (fp32, or the SM100 family's bf16 decode logits), ``N = cdiv(W, BS)``, ``s = row_ks[r //
RR]`` (0 without starts), ``e = row_ke[r // RR]`` and ``v = cdiv(max(min(e, W) - s, 0), BS)``, the scores step
(:class:`CandidateScores`, grid ``(rows, 32)``, 128-block tiles) writes::

    valid_blocks[r] = v
    scores[r, b] = max(logits[r, s + b BS : min(s + (b + 1) BS, e, W)])    (NaN-propagating; -inf for an empty block)
                   = +inf for the newest block b = (e - s - 1) // BS (when e > s), and, without FULL_WIDTH, a NaN block
    for b < N (FULL_WIDTH: torch.topk ranks every block) or b < v (DeepSelect: it reads each row's valid prefix)

``scores`` (``[rows, N]``, row stride ``stride_scores``) has ``score_dtype`` (the logits' dtype unless given: vLLM's
decode passes fp32 with the ``auto`` / ``persistent`` top-k backends). On the FULL_WIDTH path ``top = scores.topk(min(K,
N))`` (torch) and the store step (:class:`CandidateStore`, grid ``(rows, cdiv(K, 256))``) writes
``out[r, j] = top.indices[r, j] if top.values[r, j] != -inf else -1`` for ``j < K`` (``-1`` past ``min(K, N)``).
With DeepSelect (``has_deep_select()``: its extension built, sm_10x, ``N >= K``, aligned rows) vLLM ranks the valid
prefix with ``deep_select_topk`` instead: the scores step alone, FULL_WIDTH off, then a CUDA extension.

Where it runs: the candidate source (the index layer ``candidate_source_layer_id``, ``candidate_write``) in
``sparse_attn_indexer``'s prefill chunks and decode rows and the specialized decode's ``_decode_rows``. Planned on CUDA
by :func:`register` (:mod:`._v41_candidates` has the keys each target gets; the specialized decode's calls are not
planned yet).

Keys: scores: the logits' and scores' dtypes, ``BS``, starts or not, FULL_WIDTH, the 128-block tile, four warps; store:
the values' dtype, ``K``, the 256-column tile, four warps (vLLM's defaults). Unlike vLLM, ``RR`` (a constexpr there),
``W``, ``N``, ``k`` and the strides are unspecialized runtime ints and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_candidates import SM10X, candidate_roles, sm100_keys
from .model import DSV4
from .v41_candidate_flags import _check_starts

__all__ = [
    "CandidateScores", "CandidateScoresKey", "CandidateStore", "CandidateStoreKey", "candidate_scores_reference",
    "register", "select_candidate_blocks", "select_candidate_blocks_reference",
]  # fmt: skip

_S_INTS = ["stride_row", "stride_col", "stride_start", "stride_end", "stride_scores", "row_repeat", "width", "nblocks"]
_S_PTRS = ["logits_ptr", "starts_ptr", "ends_ptr", "scores_ptr", "valid_ptr"]
SCORE_TILE, STORE_TILE, SCORE_SPLITS = 128, 256, 32  # vLLM's
_NUM_WARPS = 4  # vLLM launches with Triton's default


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=_S_INTS, do_not_specialize_on_alignment=_S_PTRS)
def _candidate_scores_kernel(
    logits_ptr, starts_ptr, ends_ptr, scores_ptr, valid_ptr, stride_row, stride_col, stride_start, stride_end,
    stride_scores, row_repeat, width, nblocks,
    BLOCK_SIZE: tl.constexpr,  # logits columns per candidate block
    HAS_STARTS: tl.constexpr,  # rows start at starts[row // row_repeat] (else at column 0)
    TILE: tl.constexpr,  # blocks a program scores at a time
    FULL_WIDTH: tl.constexpr,  # score every block (torch.topk) or each row's valid prefix (DeepSelect)
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = row // row_repeat
    start = tl.load(starts_ptr + group * stride_start) if HAS_STARTS else 0
    end = tl.load(ends_ptr + group * stride_end)
    col_end = tl.minimum(end, width)
    num_valid = tl.cdiv(tl.maximum(col_end - start, 0), BLOCK_SIZE)
    if tl.program_id(1) == 0:
        tl.store(valid_ptr + row, num_valid)
    num_blocks = nblocks if FULL_WIDTH else num_valid
    offs = tl.arange(0, triton.next_power_of_2(BLOCK_SIZE))
    for tile in range(tl.program_id(1), tl.cdiv(num_blocks, TILE), tl.num_programs(1)):
        blocks = tile * TILE + tl.arange(0, TILE)
        cols = start + blocks[:, None] * BLOCK_SIZE + offs[None, :]
        values = tl.load(
            logits_ptr + row * stride_row + cols * stride_col, mask=(offs[None, :] < BLOCK_SIZE) & (cols < col_end),
            other=-float("inf"),
        ).to(tl.float32)  # fmt: skip
        best = tl.reduce(values, 1, _max_nan)
        pinned = (end > start) & (blocks == (end - start - 1) // BLOCK_SIZE)  # the newest block
        if not FULL_WIDTH:
            pinned |= best != best  # NaN blocks too (DeepSelect leaves NaN rows partly written)
        best = tl.where(pinned, float("inf"), best)
        tl.store(scores_ptr + row * stride_scores + blocks, best, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["k", "out_stride_row", "out_stride_col"],
            do_not_specialize_on_alignment=["values_ptr", "indices_ptr", "out_ptr"])  # fmt: skip
def _candidate_store_kernel(
    values_ptr, indices_ptr, out_ptr, out_stride_row, out_stride_col, k,
    OUT_K: tl.constexpr,  # the candidate buffer's width
    TILE: tl.constexpr,  # columns a program
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    value = tl.load(values_ptr + row * k + cols, mask=cols < k, other=-float("inf"))
    index = tl.load(indices_ptr + row * k + cols, mask=cols < k, other=-1)
    keep = value != -float("inf")  # NaN scores are kept: only -inf is padding
    tl.store(out_ptr + row * out_stride_row + cols * out_stride_col, tl.where(keep, index, -1), mask=cols < OUT_K)


@attrs.frozen(kw_only=True)
class CandidateScoresKey(warmreg.CompileKey):
    """What changes the binary of the block scores."""

    logits_dtype: str
    scores_dtype: str
    block_size: int
    has_starts: bool
    full_width: bool
    tile: int
    num_warps: int


class CandidateScores(warmreg.TritonKernel[CandidateScoresKey]):
    """Each row's block maxima (the newest block pinned) and valid block count (see the module docstring).

    :param block_size: ``candidate_block_size`` (domains only).
    :param dtypes: ``(logits, scores)`` dtype names the deployment scores (domains only).
    :param full_width: the deployment's FULL_WIDTH values (domains only).
    :param variants: ``(logits, scores, FULL_WIDTH)`` triples the deployment launches, in place of the product of
        ``dtypes[0]`` and ``full_width`` (domains only).
    """

    name = "deepseek_v4.v41_candidate_scores"
    key_type = CandidateScoresKey
    jit = _candidate_scores_kernel

    def __init__(self, *, block_size: int = 8, dtypes: Iterable[tuple[str, str]] = (("float32", "float32"),),
                 full_width: Iterable[bool] = (True,), variants: Iterable[tuple[str, str, bool]] = ()) -> None:  # fmt: skip
        self.block_size, self.dtypes, self.full_width = block_size, tuple(dtypes), tuple(full_width)
        self.variants = tuple(variants)

    def dispatch(
        self, *, logits: torch.Tensor, row_starts: torch.Tensor | None, scores: torch.Tensor, block_size: int,
        full_width: bool,
    ) -> CandidateScoresKey:  # fmt: skip
        return CandidateScoresKey(
            logits_dtype=warmreg.dtype_name(logits.dtype), scores_dtype=warmreg.dtype_name(scores.dtype),
            block_size=block_size, has_starts=row_starts is not None, full_width=full_width, tile=SCORE_TILE,
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Any:
        if self.variants:
            return [
                {"logits": warmreg.meta((1, 1024), getattr(torch, lg)), "row_starts": None,
                 "scores": warmreg.meta((1, 128), getattr(torch, sc)), "block_size": self.block_size, "full_width": fw}
                for lg, sc, fw in self.variants
            ]  # fmt: skip
        return {
            "logits": [warmreg.meta((1, 1024), getattr(torch, lg)) for lg, _ in self.dtypes[:1]], "row_starts": [None],
            "scores": [warmreg.meta((1, 128), getattr(torch, sc)) for _, sc in self.dtypes[:1]],
            "block_size": [self.block_size], "full_width": list(self.full_width),
        }  # fmt: skip

    def warmup_inputs(self, key: CandidateScoresKey) -> Mapping[str, Any]:
        ints = warmreg.meta((1,), torch.int32)
        return {
            "logits": warmreg.meta((1, 1024), getattr(torch, key.logits_dtype)),
            "row_starts": ints if key.has_starts else None, "row_ends": ints,
            "scores": warmreg.meta((1, 1024 // key.block_size), getattr(torch, key.scores_dtype)),
            "valid_blocks": ints, "block_size": key.block_size, "full_width": key.full_width, "row_repeat": 1,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        logits: torch.Tensor,
        row_starts: torch.Tensor | None,
        row_ends: torch.Tensor,
        scores: torch.Tensor,
        valid_blocks: torch.Tensor,
        *,
        block_size: int,
        full_width: bool,
        row_repeat: int = 1,
    ) -> warmreg.LaunchSpec[CandidateScoresKey]:
        """Write ``scores`` and ``valid_blocks`` (returned): ``select_candidate_blocks``' first launch.

        :param logits: float ``[rows, W]`` (fp32 or bf16), any strides.
        :param row_starts: int32 starts of each group of ``row_repeat`` rows, or None (0).
        :param row_ends: int32 ends of each group of ``row_repeat`` rows.
        :param scores: float ``[rows, N]`` (``N = cdiv(W, block_size)``), unit column stride, any row stride.
        :param valid_blocks: int32 ``[rows]``, contiguous.
        :param block_size: logits columns per block, ``>= 1``.
        :param full_width: score every block (else each row's valid prefix, NaN blocks pinned).
        :param row_repeat: rows sharing one start and end, ``>= 1``.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        if logits.ndim != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or block_size < 1:
            raise warmreg.LaunchError(self.name, f"logits must be a float [rows, width] tensor and block_size >= 1 "
                                                 f"(got {logits.dtype} {tuple(logits.shape)}, {block_size})")  # fmt: skip
        rows, width = logits.shape
        _check_starts(self.name, "row_starts", row_starts, rows, row_repeat)
        _check_starts(self.name, "row_ends", row_ends, rows, row_repeat)
        nblocks = -(-width // block_size)
        if (
            scores.shape != (rows, nblocks)
            or not scores.dtype.is_floating_point
            or (nblocks > 1 and scores.stride(1) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"scores must be a float [{rows}, {nblocks}] with unit column stride "
                                                 f"(got {scores.dtype} {tuple(scores.shape)})")  # fmt: skip
        if (
            valid_blocks.dtype != torch.int32
            or valid_blocks.shape != (rows,)
            or (rows > 1 and valid_blocks.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"valid_blocks must be a contiguous int32 [{rows}]")
        key = self.dispatch(logits=logits, row_starts=row_starts, scores=scores, block_size=block_size,
                            full_width=full_width)  # fmt: skip
        kwargs = dict(
            logits_ptr=logits, starts_ptr=row_ends if row_starts is None else row_starts, ends_ptr=row_ends,
            scores_ptr=scores, valid_ptr=valid_blocks, stride_row=logits.stride(0), stride_col=logits.stride(1),
            stride_start=0 if row_starts is None else row_starts.stride(0), stride_end=row_ends.stride(0),
            stride_scores=scores.stride(0), row_repeat=row_repeat, width=width, nblocks=nblocks,
            BLOCK_SIZE=key.block_size, HAS_STARTS=key.has_starts, TILE=key.tile, FULL_WIDTH=key.full_width,
        )  # fmt: skip
        grid = (rows, SCORE_SPLITS) if rows and width else None
        return warmreg.LaunchSpec(key, grid, kwargs, (scores, valid_blocks))


@attrs.frozen(kw_only=True)
class CandidateStoreKey(warmreg.CompileKey):
    """What changes the binary of the candidate store."""

    values_dtype: str
    out_k: int
    tile: int
    num_warps: int


class CandidateStore(warmreg.TritonKernel[CandidateStoreKey]):
    """The top-k block ids into the candidate buffer, ``-1`` for ``-inf`` scores (see the module docstring).

    :param topk_blocks: ``candidate_topk_blocks`` (domains only).
    :param values_dtypes: the scores' dtype names (domains only).
    """

    name = "deepseek_v4.v41_candidate_store"
    key_type = CandidateStoreKey
    jit = _candidate_store_kernel

    def __init__(self, *, topk_blocks: int = 2048, values_dtypes: Iterable[str] = ("float32",)) -> None:
        self.topk_blocks, self.values_dtypes = topk_blocks, tuple(values_dtypes)

    def dispatch(self, *, values: torch.Tensor, out: torch.Tensor) -> CandidateStoreKey:
        return CandidateStoreKey(
            values_dtype=warmreg.dtype_name(values.dtype), out_k=out.shape[1], tile=STORE_TILE, num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "values": [warmreg.meta((1, self.topk_blocks), getattr(torch, d)) for d in self.values_dtypes],
            "out": [warmreg.meta((1, self.topk_blocks), torch.int32)],
        }

    def warmup_inputs(self, key: CandidateStoreKey) -> Mapping[str, Any]:
        return {
            "values": warmreg.meta((1, key.out_k), getattr(torch, key.values_dtype)),
            "indices": warmreg.meta((1, key.out_k), torch.int64), "out": warmreg.meta((1, key.out_k), torch.int32),
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor
    ) -> warmreg.LaunchSpec[CandidateStoreKey]:
        """Write the candidate buffer ``out`` (returned): ``select_candidate_blocks``' store after ``torch.topk``.

        :param values: float ``[rows, k]``, contiguous (``top.values``).
        :param indices: int64 ``[rows, k]``, contiguous (``top.indices``).
        :param out: int32 ``[rows, K]``, any strides (``-1`` past ``k``).
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        if values.ndim != 2 or not values.dtype.is_floating_point or not values.is_contiguous():
            raise warmreg.LaunchError(self.name, f"values must be a contiguous float [rows, k] (got {values.dtype} "
                                                 f"{tuple(values.shape)})")  # fmt: skip
        if indices.dtype != torch.int64 or indices.shape != values.shape or not indices.is_contiguous():
            raise warmreg.LaunchError(self.name, f"indices must be a contiguous int64 {tuple(values.shape)}")
        if out.dtype != torch.int32 or out.ndim != 2 or out.shape[0] != values.shape[0] or out.shape[1] < 1:
            raise warmreg.LaunchError(self.name, f"out must be an int32 [{values.shape[0]}, K >= 1] (got {out.dtype} "
                                                 f"{tuple(out.shape)})")  # fmt: skip
        key = self.dispatch(values=values, out=out)
        rows = values.shape[0]
        kwargs = dict(
            values_ptr=values, indices_ptr=indices, out_ptr=out, out_stride_row=out.stride(0),
            out_stride_col=out.stride(1), k=values.shape[1], OUT_K=key.out_k, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows, triton.cdiv(key.out_k, STORE_TILE)) if rows else None, kwargs, out)


def select_candidate_blocks(
    scores_op: CandidateScores, store_op: CandidateStore, logits: torch.Tensor, row_ks: torch.Tensor | None,
    row_ke: torch.Tensor, topk_blocks: int, block_size: int, out: torch.Tensor, row_repeat: int = 1,
    score_dtype: torch.dtype | None = None,
) -> None:  # fmt: skip
    """vLLM's ``select_candidate_blocks`` without DeepSelect (its FULL_WIDTH path) on warmreg's ops: the scores, then
    ``torch.topk`` (vLLM's tie order), then the store into ``out``; ``out.fill_(-1)`` for zero-width logits."""
    rows, width = logits.shape
    if not rows:
        return
    if not width:
        out.fill_(-1)
        return
    nblocks = -(-width // block_size)
    scores = logits.new_empty((rows, nblocks), dtype=score_dtype or logits.dtype)
    valid = torch.empty(rows, dtype=torch.int32, device=logits.device)
    scores_op(logits, row_ks, row_ke, scores, valid, block_size=block_size, full_width=True, row_repeat=row_repeat)
    top = scores.topk(min(topk_blocks, nblocks), dim=-1)
    store_op(top.values, top.indices, out)


def candidate_scores_reference(
    logits: torch.Tensor, row_ks: torch.Tensor | None, row_ke: torch.Tensor, *, block_size: int, full_width: bool,
    row_repeat: int = 1, score_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`CandidateScores`: ``(scores, valid_blocks)``, unwritten scores as NaN."""
    rows, width = logits.shape
    nblocks = -(-width // block_size)
    scores = torch.full((rows, nblocks), float("nan"), dtype=torch.float32)
    valid = torch.empty(rows, dtype=torch.int32)
    for r in range(rows):
        s = 0 if row_ks is None else int(row_ks[r // row_repeat])
        e = int(row_ke[r // row_repeat])
        stop = min(e, width)
        v = -(-max(stop - s, 0) // block_size)
        valid[r] = v
        for b in range(nblocks if full_width else v):
            lo, hi = s + b * block_size, min(s + (b + 1) * block_size, stop)
            seg = logits[r, lo:hi].float()
            best = float("-inf") if seg.numel() == 0 else (float("nan") if seg.isnan().any() else float(seg.max()))
            if (e > s and b == (e - s - 1) // block_size) or (not full_width and best != best):
                best = float("inf")
            scores[r, b] = best
    return scores.to(score_dtype or logits.dtype), valid


def select_candidate_blocks_reference(
    logits: torch.Tensor, row_ks: torch.Tensor | None, row_ke: torch.Tensor, topk_blocks: int, block_size: int,
    row_repeat: int = 1, score_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :func:`select_candidate_blocks`: int32 ``[rows, topk_blocks]``."""
    scores, _ = candidate_scores_reference(logits, row_ks, row_ke, block_size=block_size, full_width=True,
                                           row_repeat=row_repeat, score_dtype=score_dtype)  # fmt: skip
    top = scores.topk(min(topk_blocks, scores.shape[1]), dim=-1)
    out = torch.full((logits.shape[0], topk_blocks), -1, dtype=torch.int32)
    out[:, : top.indices.shape[1]] = torch.where(top.values != float("-inf"), top.indices, -1).int()
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the scores and the store for a V4.1 checkpoint whose candidate source is an index layer, on CUDA
    (``sparse_attn_indexer``'s prefill chunks and decode rows): no starts, ``BS`` = ``candidate_block_size``, ``K`` =
    ``candidate_topk_blocks``; outside the SM100 family FP32 logits and scores with FULL_WIDTH, on it the variants of
    :func:`._v41_candidates.sm100_keys` (the store only where a FULL_WIDTH call remains).

    :raises warmreg.ConfigError: from :func:`._v41_candidates.candidate_roles` and :func:`._v41_candidates.sm100_keys`.
    """
    writes, _ = candidate_roles(model)
    if not writes or not platform.is_cuda:
        return
    variants: tuple[tuple[str, str, bool], ...] = (("float32", "float32", True),)
    store = True
    if SM10X(platform):
        keys = sm100_keys(model, config)
        variants, store = keys.scores, keys.store
    registry.add(CandidateScores(block_size=model.candidate_block_size, variants=variants), when=warmreg.is_cuda)
    store_op = CandidateStore(topk_blocks=model.candidate_topk_blocks, values_dtypes=("float32",))
    registry.add(store_op, when=warmreg.is_cuda if store else False)
