"""DeepSeek-V4.1's two-level indexer, candidate consumers, second step: mask the packed logits outside each row's causal
bounds and candidate blocks (vLLM 0.34 ``model_executor/kernels/attention/dsa/candidate_blocks.py``:
``apply_candidate_mask`` and ``_mask_candidates_kernel``; :func:`apply_candidate_mask` here runs both steps).

``apply_candidate_mask(logits, row_ks, row_ke, candidate_blocks, block_size, row_repeat)``: ``logits`` ``[rows, W]``
(fp32, or the SM100 family's bf16 decode logits), ``N = cdiv(W, BS)``, the flags of :mod:`.v41_candidate_flags`,
``s = row_ks[r // RR]`` (0 without starts) and ``e = row_ke[r // RR]``; in place, for every column ``c < W``::

    valid = s <= c < min(e, W)
    keep = flags[r, (c - s) // BS] != 0  or  (c == W - 1 and flags[r, N] != 0)      (read only where valid)
    logits[r, c] = -inf                   unless valid and keep

Grid ``(rows, cdiv(W, 1024))``, one 1024-column tile a program. Nothing launches for an empty ``logits``.

Where it runs: see :mod:`.v41_candidate_flags` (planned with it by :func:`register`).

Key: the logits' dtype, ``BS``, whether starts are given, the starts' and ends' dtypes, the 1024-column tile, four
warps (vLLM's default). Unlike vLLM, ``RR`` (a constexpr there), ``W``, ``N`` and the strides are unspecialized runtime
ints and no pointer is specialized on alignment: one binary serves every row layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_candidates import DENSE_FP32, SM10X, candidate_roles, sm100_keys
from .model import DSV4
from .v41_candidate_flags import CandidateFlags, _check_starts, candidate_flags_reference

__all__ = ["CandidateMask", "CandidateMaskKey", "apply_candidate_mask", "candidate_mask_reference", "register"]

_INTS = ["stride_row", "stride_col", "stride_start", "stride_end", "row_repeat", "width", "nblocks"]
_PTRS = ["logits_ptr", "starts_ptr", "ends_ptr", "flags_ptr"]
TILE = 1024  # vLLM's columns a program
_NUM_WARPS = 4  # vLLM launches with Triton's default


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _candidate_mask_kernel(
    logits_ptr, starts_ptr, ends_ptr, flags_ptr, stride_row, stride_col, stride_start, stride_end, row_repeat, width,
    nblocks,
    BLOCK_SIZE: tl.constexpr,  # logits columns per candidate block
    HAS_STARTS: tl.constexpr,  # rows start at starts[row // row_repeat] (else at column 0)
    TILE: tl.constexpr,  # columns a program
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    group = row // row_repeat
    start = tl.load(starts_ptr + group * stride_start) if HAS_STARTS else 0
    end = tl.load(ends_ptr + group * stride_end)
    valid = (cols >= start) & (cols < end) & (cols < width)
    flags = flags_ptr + row * (nblocks + 1)
    keep = tl.load(flags + (cols - start) // BLOCK_SIZE, mask=valid, other=0)
    edge = tl.load(flags + nblocks)
    keep = (keep != 0) | tl.where(edge != 0, cols == width - 1, False)
    tl.store(logits_ptr + row * stride_row + cols * stride_col, -float("inf"), mask=(cols < width) & ~(valid & keep))


@attrs.frozen(kw_only=True)
class CandidateMaskKey(warmreg.CompileKey):
    """What changes the binary of the candidate mask."""

    logits_dtype: str
    block_size: int
    has_starts: bool
    starts_dtype: str  # "" without starts
    ends_dtype: str
    tile: int
    num_warps: int


class CandidateMask(warmreg.TritonKernel[CandidateMaskKey]):
    """The in-place mask of the logits outside bounds and candidates (see the module docstring).

    :param block_size: ``candidate_block_size`` (domains only).
    :param logits_dtypes: the logits' dtype names the deployment masks (domains only).
    """

    name = "deepseek_v4.v41_candidate_mask"
    key_type = CandidateMaskKey
    jit = _candidate_mask_kernel

    def __init__(self, *, block_size: int = 8, logits_dtypes: Iterable[str] = ("float32",)) -> None:
        self.block_size, self.logits_dtypes = block_size, tuple(logits_dtypes)

    def dispatch(
        self, *, logits: torch.Tensor, row_starts: torch.Tensor | None, row_ends: torch.Tensor, block_size: int
    ) -> CandidateMaskKey:
        return CandidateMaskKey(
            logits_dtype=warmreg.dtype_name(logits.dtype), block_size=block_size, has_starts=row_starts is not None,
            starts_dtype="" if row_starts is None else warmreg.dtype_name(row_starts.dtype),
            ends_dtype=warmreg.dtype_name(row_ends.dtype), tile=TILE, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "logits": [warmreg.meta((1, TILE), getattr(torch, d)) for d in self.logits_dtypes], "row_starts": [None],
            "row_ends": [warmreg.meta((1,), torch.int32)], "block_size": [self.block_size],
        }  # fmt: skip

    def warmup_inputs(self, key: CandidateMaskKey) -> Mapping[str, Any]:
        starts = warmreg.meta((1,), getattr(torch, key.starts_dtype)) if key.has_starts else None
        return {
            "logits": warmreg.meta((1, TILE), getattr(torch, key.logits_dtype)), "row_starts": starts,
            "row_ends": warmreg.meta((1,), getattr(torch, key.ends_dtype)),
            "flags": warmreg.meta((1, TILE // key.block_size + 1), torch.uint8), "block_size": key.block_size,
            "row_repeat": 1,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        logits: torch.Tensor,
        row_starts: torch.Tensor | None,
        row_ends: torch.Tensor,
        flags: torch.Tensor,
        *,
        block_size: int,
        row_repeat: int = 1,
    ) -> warmreg.LaunchSpec[CandidateMaskKey]:
        """Mask ``logits`` in place (returned): ``apply_candidate_mask``'s second launch.

        :param logits: float ``[rows, W]`` (fp32 or bf16), any strides.
        :param row_starts: int32 starts of each group of ``row_repeat`` rows (``stride(0)`` apart), or None (0).
        :param row_ends: int32 ends of each group of ``row_repeat`` rows (``stride(0)`` apart).
        :param flags: uint8 ``[rows, cdiv(W, block_size) + 1]``, contiguous (:class:`.v41_candidate_flags.
            CandidateFlags`' output).
        :param block_size: logits columns per block, ``>= 1``.
        :param row_repeat: rows sharing one start and end, ``>= 1``.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        if logits.ndim != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise warmreg.LaunchError(
                self.name, f"logits must be a float [rows, width] tensor (got {logits.dtype} {tuple(logits.shape)})"
            )
        rows, width = logits.shape
        _check_starts(self.name, "row_starts", row_starts, rows, row_repeat)
        _check_starts(self.name, "row_ends", row_ends, rows, row_repeat)
        nblocks = -(-width // block_size) if block_size >= 1 else 0
        if block_size < 1 or flags.dtype != torch.uint8 or flags.shape != (rows, nblocks + 1) or (
            rows and not flags.is_contiguous()
        ):  # fmt: skip
            raise warmreg.LaunchError(
                self.name, f"flags must be a contiguous uint8 [{rows}, {nblocks + 1}] and block_size >= 1 (got "
                f"{flags.dtype} {tuple(flags.shape)}, block_size {block_size})",
            )  # fmt: skip
        key = self.dispatch(logits=logits, row_starts=row_starts, row_ends=row_ends, block_size=block_size)
        kwargs = dict(
            logits_ptr=logits, starts_ptr=row_ends if row_starts is None else row_starts, ends_ptr=row_ends,
            flags_ptr=flags, stride_row=logits.stride(0), stride_col=logits.stride(1),
            stride_start=0 if row_starts is None else row_starts.stride(0), stride_end=row_ends.stride(0),
            row_repeat=row_repeat, width=width, nblocks=nblocks, BLOCK_SIZE=key.block_size,
            HAS_STARTS=key.has_starts, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows, triton.cdiv(width, TILE)) if rows and width else None, kwargs, logits)


def apply_candidate_mask(
    flags_op: CandidateFlags, mask_op: CandidateMask, logits: torch.Tensor, row_ks: torch.Tensor | None,
    row_ke: torch.Tensor, candidate_blocks: torch.Tensor, block_size: int, row_repeat: int = 1,
) -> None:  # fmt: skip
    """vLLM's ``apply_candidate_mask`` on warmreg's two ops: the flags of ``candidate_blocks`` (its first
    ``logits.shape[0]`` rows are read), then the in-place mask of ``logits``. Nothing launches for an empty
    ``logits``."""
    rows, width = logits.shape
    if not rows or not width:
        return
    flags = flags_op(candidate_blocks[:rows], row_ks, width=width, block_size=block_size, row_repeat=row_repeat)
    mask_op(logits, row_ks, row_ke, flags, block_size=block_size, row_repeat=row_repeat)


def candidate_mask_reference(
    logits: torch.Tensor, row_ks: torch.Tensor | None, row_ke: torch.Tensor, candidate_blocks: torch.Tensor,
    block_size: int, row_repeat: int = 1,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :func:`apply_candidate_mask`: a masked copy of ``logits``."""
    rows, width = logits.shape
    flags = candidate_flags_reference(
        candidate_blocks[:rows], row_ks, width=width, block_size=block_size, row_repeat=row_repeat
    ).bool()
    nblocks = flags.shape[1] - 1
    out = logits.clone()
    cols = torch.arange(width, device=logits.device)
    for r in range(rows):
        s = 0 if row_ks is None else int(row_ks[r // row_repeat])
        e = int(row_ke[r // row_repeat])
        valid = (cols >= s) & (cols < e)
        block = ((cols - s) // block_size).clamp(0, nblocks)
        keep = flags[r, block] | ((cols == width - 1) & flags[r, nblocks])
        out[r, ~(valid & keep)] = float("-inf")
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the flags and the mask for a V4.1 checkpoint with an index layer above its candidate source, on CUDA
    where the consumers keep dense logits (``sparse_attn_indexer``'s prefill chunks and decode rows): no starts, int32
    ends and candidates, ``BS`` = ``candidate_block_size``, ``K`` = ``candidate_topk_blocks``; FP32 logits outside the
    SM100 family; on it the prefill's FP32 and the decode's dtype, unless the sparse-logits indexer takes over
    (:func:`._v41_candidates.sm100_keys`, the target's ``+deepgemm``).

    :raises warmreg.ConfigError: from :func:`._v41_candidates.candidate_roles`.
    """
    _, reads = candidate_roles(model)
    if not reads or not platform.is_cuda:
        return
    dtypes: tuple[str, ...] = ("float32",)
    when = DENSE_FP32
    if SM10X(platform):
        keys = sm100_keys(model, config)
        dtypes = keys.mask_logits
        when = SM10X & ~warmreg.has_feature("deepgemm") if keys.sparse_block_kv else SM10X
    flags = CandidateFlags(block_size=model.candidate_block_size, topk_blocks=model.candidate_topk_blocks)
    registry.add(flags, when=when)
    registry.add(CandidateMask(block_size=model.candidate_block_size, logits_dtypes=dtypes), when=when)
