"""DeepSeek-V4.1's two-level indexer, candidate consumers, first step: the per-row flags of the candidate blocks (vLLM
0.34 ``model_executor/kernels/attention/dsa/candidate_blocks.py``: ``apply_candidate_mask`` and
``_candidate_flags_kernel``; :mod:`.v41_candidate_mask` is the second step and has the whole call).

The candidate source's indexer publishes each row's top candidate blocks (``candidate_blocks`` int32 ``[>= rows, K]``,
block ids of ``BS`` packed logits columns, ``-1`` padded); a later index layer keeps only the logits of its row's
candidate blocks. For row ``r < rows`` with ``s = starts[r // RR]`` (0 without starts), ``W`` the logits' width and
``N = cdiv(W, BS)``::

    flags[r, :] = 0                                             (flags uint8 [rows, N + 1], contiguous)
    for each column j < K, b = candidate_blocks[r, j]:
        b' = N if s + b * BS >= W else b                         (a block past the logits: the edge flag N)
        flags[r, b'] = 1 if b' >= 0                              (-1 padding sets nothing)

Zeroing and setting run in one program per row, separated by a barrier (``tl.debug_barrier``), as in vLLM.

Where it runs: the candidate consumers (index layers after ``candidate_source_layer_id``) whose indexer keeps dense
logits (``SparseAttnIndexer``: ``indexer_sparse_logits`` off, which vLLM resolves off outside the SM100 family), in
the prefill chunks and decode rows of ``sparse_attn_indexer``, and the V4.1 specialized decode's ``_decode_rows``.
Planned by :func:`.v41_candidate_mask.register` on CUDA where the consumers keep dense logits (:mod:`._v41_candidates`;
the specialized decode's calls are not planned yet).

Key: ``BS``, ``K`` (vLLM: constexprs; ``K`` sizes the column range), whether starts are given, the candidates' and
starts' dtypes, four warps (vLLM's default). Unlike vLLM, ``RR`` (a constexpr there), ``W``, ``N`` and the strides are
unspecialized runtime ints and no pointer is specialized on alignment: one binary serves every row layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

__all__ = ["CandidateFlags", "CandidateFlagsKey", "candidate_flags_reference"]

_INTS = ["stride_row", "stride_col", "stride_start", "row_repeat", "width", "nblocks"]
_NUM_WARPS = 4  # vLLM launches with Triton's default


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["cand_ptr", "starts_ptr", "flags_ptr"])
def _candidate_flags_kernel(
    cand_ptr, starts_ptr, flags_ptr, stride_row, stride_col, stride_start, row_repeat, width, nblocks,
    BLOCK_SIZE: tl.constexpr,  # logits columns per candidate block
    K: tl.constexpr,  # candidates per row
    HAS_STARTS: tl.constexpr,  # rows start at starts[row // row_repeat] (else at column 0)
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    span = nblocks + 1
    tile = tl.arange(0, 1024)
    for t in range(tl.cdiv(span, 1024)):
        slots = t * 1024 + tile
        tl.store(flags_ptr + row * span + slots, 0, mask=slots < span)
    start = tl.load(starts_ptr + row // row_repeat * stride_start) if HAS_STARTS else 0
    cols = tl.arange(0, triton.next_power_of_2(K))
    block = tl.load(cand_ptr + row * stride_row + cols * stride_col, mask=cols < K, other=-1).to(tl.int64)
    block = tl.where(start + block * BLOCK_SIZE >= width, nblocks, block)  # past the logits: the edge flag
    tl.debug_barrier()  # the zeros first
    tl.store(flags_ptr + row * span + block, 1, mask=(cols < K) & (block >= 0))


@attrs.frozen(kw_only=True)
class CandidateFlagsKey(warmreg.CompileKey):
    """What changes the binary of the candidate flags."""

    block_size: int
    k: int
    has_starts: bool
    candidates_dtype: str
    starts_dtype: str  # "" without starts
    num_warps: int


class CandidateFlags(warmreg.TritonKernel[CandidateFlagsKey]):
    """The flags of each row's candidate blocks (see the module docstring).

    :param block_size: ``candidate_block_size`` (domains only).
    :param topk_blocks: ``candidate_topk_blocks``, the candidate buffer's width (domains only).
    """

    name = "deepseek_v4.v41_candidate_flags"
    key_type = CandidateFlagsKey
    jit = _candidate_flags_kernel

    def __init__(self, *, block_size: int = 8, topk_blocks: int = 2048) -> None:
        self.block_size, self.topk_blocks = block_size, topk_blocks

    def dispatch(
        self, *, candidate_blocks: torch.Tensor, row_starts: torch.Tensor | None, block_size: int
    ) -> CandidateFlagsKey:
        return CandidateFlagsKey(
            block_size=block_size, k=candidate_blocks.shape[1], has_starts=row_starts is not None,
            candidates_dtype=warmreg.dtype_name(candidate_blocks.dtype),
            starts_dtype="" if row_starts is None else warmreg.dtype_name(row_starts.dtype), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "candidate_blocks": [warmreg.meta((1, self.topk_blocks), torch.int32)], "row_starts": [None],
            "block_size": [self.block_size],
        }  # fmt: skip

    def warmup_inputs(self, key: CandidateFlagsKey) -> Mapping[str, Any]:
        starts = warmreg.meta((1,), getattr(torch, key.starts_dtype)) if key.has_starts else None
        return {
            "candidate_blocks": warmreg.meta((1, key.k), getattr(torch, key.candidates_dtype)), "row_starts": starts,
            "width": key.block_size, "block_size": key.block_size, "row_repeat": 1,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        candidate_blocks: torch.Tensor,
        row_starts: torch.Tensor | None,
        *,
        width: int,
        block_size: int,
        row_repeat: int = 1,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[CandidateFlagsKey]:
        """The uint8 ``[rows, cdiv(width, block_size) + 1]`` flags (``out``, or a fresh tensor), ``rows =
        candidate_blocks.shape[0]``: ``apply_candidate_mask``'s first launch.

        :param candidate_blocks: int ``[rows, K]`` block ids (``-1`` padded), any strides.
        :param row_starts: int32 starts of each group of ``row_repeat`` rows (``stride(0)`` apart), or None (0).
        :param width: the logits' width (``W``), ``>= 1``.
        :param block_size: logits columns per block, ``>= 1``.
        :param row_repeat: rows sharing one start, ``>= 1``.
        :param out: the buffer to write instead of a fresh one: exactly uint8 ``[rows, N + 1]``, contiguous, 16-byte
            aligned.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        if candidate_blocks.ndim != 2 or candidate_blocks.dtype not in (torch.int32, torch.int64):
            raise warmreg.LaunchError(
                self.name, f"candidate_blocks must be an int [rows, K] tensor (got {candidate_blocks.dtype} "
                f"{tuple(candidate_blocks.shape)})",
            )  # fmt: skip
        rows = candidate_blocks.shape[0]
        _check_starts(self.name, "row_starts", row_starts, rows, row_repeat)
        if width < 1 or block_size < 1:
            raise warmreg.LaunchError(self.name, f"width ({width}) and block_size ({block_size}) must be >= 1")
        key = self.dispatch(candidate_blocks=candidate_blocks, row_starts=row_starts, block_size=block_size)
        nblocks = triton.cdiv(width, block_size)
        out = warmreg.output(self.name, "out", out, (rows, nblocks + 1), torch.uint8, candidate_blocks.device)
        kwargs = dict(
            cand_ptr=candidate_blocks, starts_ptr=candidate_blocks if row_starts is None else row_starts,
            flags_ptr=out, stride_row=candidate_blocks.stride(0), stride_col=candidate_blocks.stride(1),
            stride_start=0 if row_starts is None else row_starts.stride(0), row_repeat=row_repeat, width=width,
            nblocks=nblocks, BLOCK_SIZE=key.block_size, K=key.k, HAS_STARTS=key.has_starts,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,) if rows else None, kwargs, out)


def _check_starts(kernel: str, name: str, t: torch.Tensor | None, rows: int, repeat: int) -> None:
    """``t`` is None or a 1-D int32 tensor covering ``cdiv(rows, repeat)`` groups; ``repeat >= 1``.

    :raises warmreg.LaunchError: naming ``name`` (or ``row_repeat``).
    """
    if repeat < 1:
        raise warmreg.LaunchError(kernel, f"row_repeat must be >= 1 (got {repeat})")
    groups = -(-rows // repeat)
    if t is not None and (t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < groups):
        raise warmreg.LaunchError(
            kernel, f"{name} must be a 1-D int32 tensor of >= {groups} entries (got {t.dtype} {tuple(t.shape)})"
        )


def candidate_flags_reference(
    candidate_blocks: torch.Tensor, row_starts: torch.Tensor | None, *, width: int, block_size: int, row_repeat: int = 1
) -> torch.Tensor:
    """PyTorch reference of :class:`CandidateFlags`: uint8 ``[rows, N + 1]``."""
    rows, nblocks = candidate_blocks.shape[0], -(-width // block_size)
    flags = torch.zeros(rows, nblocks + 1, dtype=torch.uint8, device=candidate_blocks.device)
    for r in range(rows):
        start = 0 if row_starts is None else int(row_starts[r // row_repeat])
        for b in candidate_blocks[r].tolist():
            b = nblocks if start + b * block_size >= width else b  # before the sign test, as vLLM's kernel
            if b >= 0:
                flags[r, b] = 1
    return flags
