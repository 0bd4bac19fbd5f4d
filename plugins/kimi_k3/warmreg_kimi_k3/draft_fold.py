"""The DSpark draft attention's length-balanced split tiers under DCP: which rows the split launches take, and the row
copies in and out of them (vLLM 0.34 ``models/kimi_k3/nvidia/specialized_decode/drafter/attention.py``:
``_plan_kernel.plan``, ``_row_copy_kernel.row_copy``, called by ``_balanced_tables`` and ``balanced_decode``).

The specialized drafter folds a request's ``k`` draft tokens into the heads of one decode row. Under DCP the
cute-dsl decode returns an LSE and splits every row alike, so ``balanced_decode`` moves the ``S = sum(tiers)``
longest rows (``TIERS`` 4, 8, 16 as the batch allows) to split launches of their own. The plan, one program, for
``N`` rows of lengths ``L`` (int32) and ``P`` SM pairs::

    rank[i] = #{j : L[j] > L[i] or (L[j] == L[i] and j < i)}        # longest first, ties: lower row first
    move[i] = rank[i] < S and L[i] * P > sum(L)                     # MOVE = 1/1 of a pair's share
    rest[i] = 0 if move[i] else L[i]                                # the unsplit launch's lengths
    dst[rank[i]] = i if move[i] else N;  tier_sl[rank[i]] = L[i] if move[i] else 0
    tier_tot[rank[i]] = tot[i]                                      # for rank[i] < S

The row copy moves int32 words of whole rows for the rows ``i`` whose ``target[i] < bound``: gathers (``dst[i] =
src[target[i]]``: the block table and the queries into the tiers) or scatters (``dst[target[i]] = src[i]``: the
tiers' outputs and LSEs back). Grid ``(len(target), cdiv(words, 4096))``.

Where it runs: the specialized decode's DSpark drafter under DCP > 1 (``DraftDcp``, the LSE decode on cute-dsl),
for draft batches of more than ``sms / 4`` decode rows (``balanced_tiers``), on the SM100 family: one plan and one
block-table gather per step (cached per batch across the draft layers), a query gather and two scatters per layer.

Key (plan): ``BLOCK = max(32, next_pow2(N))``, ``MOVE`` and the length dtype; (copy): ``GATHER`` and the block.
Unlike vLLM's, no integer is specialized (vLLM specializes the row counts, pitches and widths) and no pointer on its
alignment: one copy binary per direction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import KimiK3
from .specialized import SM100_FAMILY, dspark_draft

__all__ = ["MIN_SMS", "MOVE", "RowCopy", "RowCopyKey", "TierPlan", "TierPlanKey", "draft_fold_rows", "register",
           "row_copy_reference", "tier_plan_reference"]  # fmt: skip

#: vLLM's ``MOVE``: a row moves when longer than this (num, den) of a pair's share of the batch's keys.
MOVE = (1, 1)
#: The fewest SMs of an SM100-family GPU (B200; GB300: 152): the tiers run from ``4 * rows > sms``.
MIN_SMS = 148
#: Words a copy program moves (vLLM's ``block``).
COPY_BLOCK = 4096
#: cute-dsl's most heads of one decode row (vLLM's ``CUTE_DSL_MAX_HEADS``).
_CUTE_DSL_MAX_HEADS = 128
_PLAN_PTRS = ["sl_ptr", "tot_ptr", "rest_ptr", "dst_ptr", "tier_sl_ptr", "tier_tot_ptr"]


@triton.jit(do_not_specialize=["rows", "split_rows", "pairs"], do_not_specialize_on_alignment=_PLAN_PTRS)
def _tier_plan_kernel(
    sl_ptr, tot_ptr,  # [N] lengths (this rank's) and global lengths
    rest_ptr,  # [N] the unsplit launch's lengths
    dst_ptr, tier_sl_ptr, tier_tot_ptr,  # [S] each tier row's batch row (N: none), length, global length
    rows, split_rows, pairs,
    MOVE_NUM: tl.constexpr, MOVE_DEN: tl.constexpr,  # the share a moved row exceeds
    BLOCK: tl.constexpr,  # rows held at once: max(32, next_pow2(N))
):  # fmt: skip
    i = tl.arange(0, BLOCK)
    live = i < rows
    length = tl.load(sl_ptr + i, mask=live, other=0)
    total = tl.sum(length.to(tl.int64), axis=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(0, rows):
        lj = tl.load(sl_ptr + j)
        rank += ((lj > length) | ((lj == length) & (j < i))).to(tl.int32)
    split = live & (rank < split_rows)
    move = split & (length.to(tl.int64) * (MOVE_DEN * pairs) > MOVE_NUM * total)
    tl.store(rest_ptr + i, tl.where(move, 0, length), mask=live)
    tl.store(dst_ptr + rank, tl.where(move, i, rows), mask=split)
    tl.store(tier_sl_ptr + rank, tl.where(move, length, 0), mask=split)
    tl.store(tier_tot_ptr + rank, tl.load(tot_ptr + i, mask=live, other=0), mask=split)


@triton.jit(do_not_specialize=["bound", "words", "src_pitch", "dst_pitch"],
            do_not_specialize_on_alignment=["src_ptr", "dst_ptr", "target_ptr"])  # fmt: skip
def _row_copy_kernel(
    src_ptr, dst_ptr,  # int32 words, rows `pitch` apart
    target_ptr,  # [rows] the other side's row
    bound, words, src_pitch, dst_pitch,
    GATHER: tl.constexpr,  # dst[i] = src[target[i]]; else dst[target[i]] = src[i]
    BLOCK: tl.constexpr,  # words a program moves
):  # fmt: skip
    i = tl.program_id(0)
    t = tl.load(target_ptr + i)
    if t < bound:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < words
        if GATHER:
            s_row, d_row = t, i
        else:
            s_row, d_row = i, t
        v = tl.load(src_ptr + s_row.to(tl.int64) * src_pitch + cols, mask=mask)
        tl.store(dst_ptr + d_row.to(tl.int64) * dst_pitch + cols, v, mask=mask)


def draft_fold_rows(k: int, heads: int, max_num_seqs: int) -> range:
    """The decode-row counts of the balanced draft decodes: ``fold_plan``'s LSE fold (the largest divisor ``f`` of
    ``k`` with ``f * heads <= 128``) gives ``k / f`` rows a request; tiers from ``4 * rows > MIN_SMS``."""
    fold = max(d for d in range(1, k + 1) if k % d == 0 and d * heads <= _CUTE_DSL_MAX_HEADS) if heads <= 128 else 1
    return range(MIN_SMS // 4 + 1, max_num_seqs * (k // fold) + 1)


@attrs.frozen(kw_only=True)
class TierPlanKey(warmreg.CompileKey):
    """What changes the binary of the tier plan."""

    lens_dtype: str
    move_num: int
    move_den: int
    block: int
    num_warps: int


class TierPlan(warmreg.TritonKernel[TierPlanKey]):
    """Which rows the split tiers take (the module docstring has the math).

    :param rows: the decode-row counts the deployment plans (domains only; :func:`draft_fold_rows`).
    """

    name = "kimi_k3.draft_tier_plan"
    key_type = TierPlanKey
    jit = _tier_plan_kernel

    def __init__(self, *, rows: Iterable[int]) -> None:
        self.rows = tuple(rows)

    def dispatch(self, *, seq_lens: torch.Tensor) -> TierPlanKey:
        return TierPlanKey(
            lens_dtype=warmreg.dtype_name(seq_lens.dtype), move_num=MOVE[0], move_den=MOVE[1],
            block=max(32, warmreg.next_pow2(seq_lens.shape[0])), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"seq_lens": [warmreg.meta((n,), torch.int32) for n in self.rows]}

    def warmup_inputs(self, key: TierPlanKey) -> Mapping[str, Any]:
        lens = warmreg.meta((key.block,), getattr(torch, key.lens_dtype))
        return {"seq_lens": lens, "totals": lens, "split_rows": 4, "pairs": 74}

    @warmreg.kernel_launcher
    def __call__(
        self, seq_lens: torch.Tensor, totals: torch.Tensor, *, split_rows: int, pairs: int
    ) -> warmreg.LaunchSpec[TierPlanKey]:
        """``(dst, rest, tier_sl, tier_tot)`` of ``N = len(seq_lens)`` rows (fresh int32 tensors, ``_balanced_tables``'s
        order but for the block table).

        :param seq_lens: int32 ``[N]`` contiguous: this rank's lengths. ``totals``: the global ones (or the same).
        :param split_rows: ``S``, the tier rows (``1 <= S <= N``). ``pairs``: the SM pairs (``sms // 2``).
        :raises warmreg.LaunchError: for shapes, dtypes or counts the kernel cannot take.
        """
        n = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
        if n < 1 or seq_lens.dtype != torch.int32 or seq_lens.stride(0) != 1:
            raise warmreg.LaunchError(self.name, f"seq_lens must be contiguous int32 [N >= 1] (got {seq_lens.dtype} "
                                                 f"{tuple(seq_lens.shape)})")  # fmt: skip
        if totals.shape != seq_lens.shape or totals.dtype != torch.int32 or totals.stride(0) != 1:
            raise warmreg.LaunchError(self.name, f"totals must be contiguous int32 [{n}] (got {totals.dtype} "
                                                 f"{tuple(totals.shape)})")  # fmt: skip
        if not 1 <= split_rows <= n or pairs < 1:
            raise warmreg.LaunchError(self.name, f"split_rows must be in [1, {n}] and pairs >= 1 (got {split_rows}, "
                                                 f"{pairs})")  # fmt: skip
        key = self.dispatch(seq_lens=seq_lens)
        rest = torch.empty(n, dtype=torch.int32, device=seq_lens.device)
        dst, tier_sl, tier_tot = (torch.empty(split_rows, dtype=torch.int32, device=seq_lens.device) for _ in range(3))
        kwargs = dict(
            sl_ptr=seq_lens, tot_ptr=totals, rest_ptr=rest, dst_ptr=dst, tier_sl_ptr=tier_sl, tier_tot_ptr=tier_tot,
            rows=n, split_rows=split_rows, pairs=pairs, MOVE_NUM=key.move_num, MOVE_DEN=key.move_den, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,), kwargs, (dst, rest, tier_sl, tier_tot))


@attrs.frozen(kw_only=True)
class RowCopyKey(warmreg.CompileKey):
    """What changes the binary of a row copy: the direction and the block."""

    gather: bool
    target_dtype: str
    block: int
    num_warps: int


class RowCopy(warmreg.TritonKernel[RowCopyKey]):
    """Whole rows moved as int32 words, for the rows whose target is below ``bound`` (the module docstring)."""

    name = "kimi_k3.draft_row_copy"
    key_type = RowCopyKey
    jit = _row_copy_kernel

    def dispatch(self, *, target: torch.Tensor, gather: bool) -> RowCopyKey:
        return RowCopyKey(gather=bool(gather), target_dtype=warmreg.dtype_name(target.dtype), block=COPY_BLOCK,
                          num_warps=4)  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"target": [warmreg.meta((4,), torch.int32)], "gather": [True, False]}

    def warmup_inputs(self, key: RowCopyKey) -> Mapping[str, Any]:
        rows = warmreg.meta((1, 4), torch.int32)
        return {"src": rows, "dst": rows, "target": warmreg.meta((1,), getattr(torch, key.target_dtype)), "bound": 1,
                "gather": key.gather}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, src: torch.Tensor, dst: torch.Tensor, target: torch.Tensor, bound: int, gather: bool
    ) -> warmreg.LaunchSpec[RowCopyKey]:
        """vLLM's ``_row_copy(src, dst, target, bound, gather)``: returns ``dst``.

        :param src: ``[rows, ...]`` with contiguous rows of a whole number of int32 words; ``dst`` likewise, the
            same row width.
        :param target: int32 ``[M]``: the other side's row of each program's row (``>= bound``: skipped).
        :raises warmreg.LaunchError: for layouts the copy cannot take.
        """
        s, d = self._words("src", src), self._words("dst", dst)
        if s.shape[1] != d.shape[1]:
            raise warmreg.LaunchError(self.name, f"dst rows must be as wide as src's (got {d.shape[1]} and "
                                                 f"{s.shape[1]} int32 words)")  # fmt: skip
        if target.ndim != 1 or target.dtype != torch.int32:
            raise warmreg.LaunchError(self.name, f"target must be int32 [M] (got {target.dtype} {tuple(target.shape)})")
        key = self.dispatch(target=target, gather=gather)
        words = s.shape[1]
        kwargs = dict(src_ptr=s, dst_ptr=d, target_ptr=target, bound=bound, words=words, src_pitch=s.stride(0),
                      dst_pitch=d.stride(0), GATHER=key.gather, BLOCK=key.block)  # fmt: skip
        grid = (target.shape[0], triton.cdiv(words, key.block)) if target.shape[0] and words else None
        return warmreg.LaunchSpec(key, grid, kwargs, dst)

    def _words(self, arg: str, t: torch.Tensor) -> torch.Tensor:
        try:
            return t.reshape(t.shape[0], -1).view(torch.int32)
        except RuntimeError as e:
            raise warmreg.LaunchError(self.name, f"{arg} rows must be contiguous int32 words ({e})") from None


def tier_plan_reference(seq_lens: torch.Tensor, totals: torch.Tensor, split_rows: int, pairs: int):  # type: ignore[no-untyped-def]
    """PyTorch reference of :class:`TierPlan`: ``(dst, rest, tier_sl, tier_tot)``."""
    n, lens = seq_lens.shape[0], seq_lens.long()
    rank = torch.argsort(torch.argsort(-lens, stable=True), stable=True)  # longest first, ties by row
    move = (rank < split_rows) & (lens * MOVE[1] * pairs > MOVE[0] * lens.sum())
    order = torch.argsort(rank)[:split_rows]
    rows = torch.arange(n, dtype=torch.int32)
    dst = torch.where(move[order], rows[order], torch.full_like(rows[order], n))
    tier_sl = torch.where(move[order], seq_lens[order], torch.zeros_like(seq_lens[order]))
    return dst, torch.where(move, 0, seq_lens), tier_sl, totals[order].clone()


def row_copy_reference(
    src: torch.Tensor, dst: torch.Tensor, target: torch.Tensor, bound: int, gather: bool
) -> torch.Tensor:
    """PyTorch reference of :class:`RowCopy` on a copy of ``dst``."""
    out = dst.clone()
    for i, t in enumerate(target.tolist()):
        if t < bound:
            if gather:
                out[i] = src[t]
            else:
                out[t] = src[i]
    return out


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the tier plan and the row copies on the SM100 family for the specialized decode's DSpark drafter
    under DCP > 1, when a draft batch can have more than ``MIN_SMS / 4`` decode rows.

    :raises warmreg.ConfigError: for malformed specialized-decode settings.
    """
    draft = dspark_draft(config)
    if draft is None or draft.dcp <= 1:
        return
    rows = draft_fold_rows(draft.num_speculative_tokens, draft.heads, draft.max_num_seqs)
    if not rows:
        return
    registry.add(TierPlan(rows=rows), when=SM100_FAMILY)
    registry.add(RowCopy(), when=SM100_FAMILY)
