"""DeepSeek-V4.1's sparse-logits indexer: the candidate blocks of each row expanded into DeepGEMM's sorted sparse block
ids (vLLM 0.34 ``model_executor/kernels/attention/dsa/sparse_mqa_logits.py``: ``candidate_blocks_to_sparse_indices`` and
``_expand_candidates_kernel``).

For row ``r`` with candidates ``c = candidate_blocks[r, :K]`` (int32, ``-1`` padded, ``K`` a power of two), the ratio
``R = candidate_block_size / SBK`` (1 or 2; ``SBK`` the sparse block of 8 or 16 positions), ``ks, ke = row_ks[r],
row_ke[r]``::

    c' = c (R = 1), or interleave(2 c, 2 c + 1) (R = 2)                           (S = K R sparse blocks)
    valid = 0 <= c' < cdiv(max(ke - ks, 0), SBK);  n = count(valid);  last = max(c'[valid], default -1)
    sparse_indices[r, :n] = sorted(c'[valid]) + ks // SBK
    sparse_indices[r, n:] = last + ks // SBK (n > 0), else ks // SBK                (DeepGEMM's padding)
    end[r] = (n - 1) SBK + clamp(ke - (last SBK + ks), 1, SBK) if n > 0, else 0      (valid sparse-token columns)

One program per row, sixteen warps (vLLM's ``num_warps``); the sort is ``tl.sort``, as in vLLM.

Where it runs: the candidate consumers whose indexer scores only the candidate blocks (``SparseMQAIndexer``:
``attention_config.indexer_sparse_logits``, resolved on for a two-level checkpoint on the SM100 family with DeepGEMM's
sparse MQA kernels and DeepSelect), in ``sparse_mqa_logits_paged_decode`` and the specialized decode's
``decode_schedule`` (``CandidateOverlap``). Planned by :func:`register` (the SM100 family with ``+deepgemm``; the
assumptions are :mod:`._v41_candidates`').

Key: ``K``, ``S``, ``R``, ``SBK``, sixteen warps. Unlike vLLM (specialized ints, alignment-specialized pointers but
``end``), the row strides are unspecialized runtime ints and no pointer is specialized on alignment: one binary serves
every row layout.
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

__all__ = ["CandidateExpand", "CandidateExpandKey", "candidate_expand_reference", "register"]

_INTS = ["cand_stride", "ks_stride", "ke_stride", "si_stride", "end_stride"]
_PTRS = ["cand_ptr", "ks_ptr", "ke_ptr", "si_ptr", "end_ptr"]
_BIG = tl.constexpr(2**31 - 1)  # sorts after every valid block
_NUM_WARPS = 16  # vLLM's


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _candidate_expand_kernel(
    cand_ptr, cand_stride, ks_ptr, ks_stride, ke_ptr, ke_stride, si_ptr, si_stride, end_ptr, end_stride,
    K: tl.constexpr,  # candidates a row (a power of two: the sort)
    S: tl.constexpr,  # sparse blocks a row: K * RATIO
    RATIO: tl.constexpr,  # sparse blocks per candidate block (1 or 2)
    SBK: tl.constexpr,  # positions per sparse block
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ks = tl.load(ks_ptr + row * ks_stride)
    ke = tl.load(ke_ptr + row * ke_stride)
    cand = tl.load(cand_ptr + row * cand_stride + tl.arange(0, K))
    if RATIO == 2:
        cand = tl.interleave(cand * RATIO, cand * RATIO + 1)
    limit = (tl.maximum(ke - ks, 0) + SBK - 1) // SBK  # the sparse blocks inside [0, ke - ks)
    valid = (cand >= 0) & (cand < limit)
    ordered = tl.sort(tl.where(valid, cand, _BIG))
    base = ks // SBK
    n = tl.sum(valid.to(tl.int32))
    last = tl.max(tl.where(valid, cand, -1))
    pad = tl.where(n > 0, last + base, base)
    slots = tl.arange(0, S)
    blocks = tl.where(ordered != _BIG, ordered, 0) + base
    tl.store(si_ptr + row * si_stride + slots, tl.where(slots < n, blocks, pad))
    fill = tl.minimum(tl.maximum(ke - (last * SBK + ks), 1), SBK)  # only the last block can be partial
    tl.store(end_ptr + row * end_stride, tl.where(n > 0, (n - 1) * SBK + fill, 0))


@attrs.frozen(kw_only=True)
class CandidateExpandKey(warmreg.CompileKey):
    """What changes the binary of the candidate expansion."""

    k: int
    s: int
    ratio: int
    sparse_block_kv: int
    num_warps: int


class CandidateExpand(warmreg.TritonKernel[CandidateExpandKey]):
    """Candidate blocks to sorted sparse block ids and valid column counts (see the module docstring).

    :param topk_blocks: ``candidate_topk_blocks`` (domains only).
    :param block_size: ``candidate_block_size`` (domains only).
    :param sparse_block_kv: DeepGEMM's sparse block, ``pick_sparse_block_kv(block_size)`` (domains only).
    """

    name = "deepseek_v4.v41_candidate_expand"
    key_type = CandidateExpandKey
    jit = _candidate_expand_kernel

    def __init__(self, *, topk_blocks: int = 2048, block_size: int = 8, sparse_block_kv: int = 8) -> None:
        self.topk_blocks, self.block_size, self.sparse_block_kv = topk_blocks, block_size, sparse_block_kv

    def dispatch(
        self, *, candidate_blocks: torch.Tensor, candidate_block_size: int, sparse_block_kv: int
    ) -> CandidateExpandKey:
        ratio = candidate_block_size // sparse_block_kv
        k = candidate_blocks.shape[1]
        return CandidateExpandKey(k=k, s=k * ratio, ratio=ratio, sparse_block_kv=sparse_block_kv, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "candidate_blocks": [warmreg.meta((1, self.topk_blocks), torch.int32)],
            "candidate_block_size": [self.block_size], "sparse_block_kv": [self.sparse_block_kv],
        }  # fmt: skip

    def warmup_inputs(self, key: CandidateExpandKey) -> Mapping[str, Any]:
        ints = warmreg.meta((1,), torch.int32)
        return {
            "candidate_blocks": warmreg.meta((1, key.k), torch.int32), "row_ks": ints, "row_ke": ints,
            "candidate_block_size": key.ratio * key.sparse_block_kv, "sparse_block_kv": key.sparse_block_kv,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        candidate_blocks: torch.Tensor,
        row_ks: torch.Tensor,
        row_ke: torch.Tensor,
        candidate_block_size: int,
        sparse_block_kv: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[CandidateExpandKey]:
        """``(sparse_indices, end)``: int32 ``[rows, K * ratio]`` and ``[rows]`` (``out``, or fresh tensors), as
        ``candidate_blocks_to_sparse_indices`` returns them.

        :param candidate_blocks: int32 ``[rows, K]``, ``K`` a power of two, unit column stride (rows may be strided).
        :param row_ks: int32 ``[rows]`` row starts (zeros on the paged path), any stride.
        :param row_ke: int32 ``[rows]`` row ends, any stride.
        :param candidate_block_size: positions per candidate block: ``sparse_block_kv`` or twice it.
        :param sparse_block_kv: positions per sparse block.
        :param out: the buffers to write instead of fresh ones: exactly int32 ``[rows, K * ratio]`` and ``[rows]``,
            contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        rows, k = candidate_blocks.shape if candidate_blocks.ndim == 2 else (0, 0)
        ratio = candidate_block_size // sparse_block_kv if sparse_block_kv > 0 else 0
        if candidate_blocks.dtype != torch.int32 or k < 1 or k & (k - 1) or (k > 1 and candidate_blocks.stride(1) != 1):
            raise warmreg.LaunchError(
                self.name, f"candidate_blocks must be int32 [rows, 2^n] with unit column stride (got "
                f"{candidate_blocks.dtype} {tuple(candidate_blocks.shape)})",
            )  # fmt: skip
        if ratio not in (1, 2) or ratio * sparse_block_kv != candidate_block_size:
            raise warmreg.LaunchError(
                self.name, f"candidate_block_size ({candidate_block_size}) must be 1 or 2 times sparse_block_kv "
                f"({sparse_block_kv})",
            )  # fmt: skip
        for name, t in (("row_ks", row_ks), ("row_ke", row_ke)):
            if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] != rows:
                raise warmreg.LaunchError(self.name, f"{name} must be int32 [{rows}] (got {t.dtype} {tuple(t.shape)})")
        key = self.dispatch(candidate_blocks=candidate_blocks, candidate_block_size=candidate_block_size,
                            sparse_block_kv=sparse_block_kv)  # fmt: skip
        given = (None, None) if out is None else out
        if not isinstance(given, tuple) or len(given) != 2:
            raise warmreg.LaunchError(self.name, "out must be a tuple of 2 buffers (sparse_indices, end)")
        dev = candidate_blocks.device
        si = warmreg.output(self.name, "out[0]", given[0], (rows, key.s), torch.int32, dev)
        end = warmreg.output(self.name, "out[1]", given[1], (rows,), torch.int32, dev)
        kwargs = dict(
            cand_ptr=candidate_blocks, cand_stride=candidate_blocks.stride(0), ks_ptr=row_ks, ks_stride=row_ks.stride(0),
            ke_ptr=row_ke, ke_stride=row_ke.stride(0), si_ptr=si, si_stride=key.s, end_ptr=end, end_stride=1, K=key.k,
            S=key.s, RATIO=key.ratio, SBK=key.sparse_block_kv,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,) if rows else None, kwargs, (si, end))


def candidate_expand_reference(
    candidate_blocks: torch.Tensor, row_ks: torch.Tensor, row_ke: torch.Tensor, candidate_block_size: int,
    sparse_block_kv: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`CandidateExpand`."""
    ratio, sbk = candidate_block_size // sparse_block_kv, sparse_block_kv
    rows, k = candidate_blocks.shape
    si = torch.empty(rows, k * ratio, dtype=torch.int32)
    end = torch.empty(rows, dtype=torch.int32)
    for r in range(rows):
        c = candidate_blocks[r].long()
        if ratio == 2:
            c = torch.stack([2 * c, 2 * c + 1], dim=-1).reshape(-1)
        ks, ke = int(row_ks[r]), int(row_ke[r])
        limit = -(-max(ke - ks, 0) // sbk)
        kept = c[(c >= 0) & (c < limit)]
        n, base = kept.numel(), ks // sbk
        last = int(kept.max()) if n else -1
        si[r] = torch.cat([kept.sort().values + base, torch.full((k * ratio - n,), last + base if n else base)])
        end[r] = (n - 1) * sbk + min(max(ke - (last * sbk + ks), 1), sbk) if n else 0
    return si, end


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the expansion for a V4.1 checkpoint with an index layer above its candidate source, where its
    consumers take the sparse-logits indexer: the SM100 family with DeepGEMM's sparse kernels (the target's
    ``+deepgemm``) and :func:`._v41_candidates.sm100_keys`' conditions; ``K`` = ``candidate_topk_blocks``, ``R`` =
    ``candidate_block_size / SBK``.

    :raises warmreg.ConfigError: from :func:`._v41_candidates.candidate_roles` and :func:`._v41_candidates.sm100_keys`.
    """
    _, reads = candidate_roles(model)
    if not reads or not SM10X(platform):
        return
    sbk = sm100_keys(model, config).sparse_block_kv
    if sbk:
        op = CandidateExpand(
            topk_blocks=model.candidate_topk_blocks, block_size=model.candidate_block_size, sparse_block_kv=sbk
        )
        registry.add(op, when=SM10X & warmreg.has_feature("deepgemm"))
