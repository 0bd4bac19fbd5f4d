"""Compressor: save partial states into the compressor state cache (vLLM 0.33's DeepSeek-V4
``compressor.py`` and ``save_partial_states.py``).

The compressor of every cr > 1 layer (and of the C4 indexer) keeps, per request, the projected
``kv`` and ``score + ape`` rows of the tokens of its current compression window in an fp32 state
cache ``[num_pages, page_bs, 2 * STATE_WIDTH]``. For each slot-mapping entry ``t`` with ``slot >= 0``::

    row = state_cache[slot // page_bs, slot % page_bs]
    row[0:HEAD_SIZE]                         = kv[t]
    row[HEAD_SIZE:2*HEAD_SIZE]               = score[t] + ape[positions[t] % COMPRESS_RATIO]

with ``STATE_WIDTH == HEAD_SIZE = coff * head_dim``: 1024 (main C4, coff 2), 512 (main C128, coff 1),
256 (indexer C4, head 128, coff 2). Grid ``(slot_mapping.shape[0],)``, which can be smaller than T
under DP padding. PDL stays off: with it this kernel raced (read after write) in vLLM, so the key
carries ``launch_pdl=False`` on every platform.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._metadata_common import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from .model import DSV4, PLUGIN

__all__ = [
    "COFF",
    "STATE_PAGE_SIZE",
    "SavePartialStates",
    "SavePartialStatesKey",
    "register",
    "save_partial_states_reference",
]

#: State-cache slots per page by compress ratio.
STATE_PAGE_SIZE = {4: C4_STATE_BLOCK_SIZE, 128: C128_STATE_BLOCK_SIZE}
#: Rows kept per compressed entry by compress ratio: 2 for C4's overlapping windows, 1 for C128.
COFF = {4: 2, 128: 1}


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _save_partial_states_kernel(
    kv_ptr,
    score_ptr,
    ape_ptr,
    positions_ptr,
    slot_mapping_ptr,
    state_ptr,
    kv_stride,
    score_stride,
    ape_stride,
    state_stride0,
    state_stride1,
    HEAD_SIZE: tl.constexpr,  # coff * head_dim: the row length (and STATE_WIDTH)
    BLOCK_SIZE: tl.constexpr,  # next_pow2(HEAD_SIZE): one tile covers a row
    COMPRESS_RATIO: tl.constexpr,  # ape rows: a position's place in its compression window
    STATE_BLOCK_SIZE: tl.constexpr,  # state-cache slots per page (4 for C4, 8 for C128)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    live = tl.where(slot >= 0, True, False)  # -1: a padded token, nothing saved
    s = tl.where(live, slot, 0)
    row = state_ptr + (s // STATE_BLOCK_SIZE) * state_stride0 + (s % STATE_BLOCK_SIZE) * state_stride1
    cols = tl.arange(0, BLOCK_SIZE)
    mask = (cols < HEAD_SIZE) & live
    pos = tl.load(positions_ptr + t)
    kv = tl.load(kv_ptr + t.to(tl.int64) * kv_stride + cols, mask=mask)
    score = tl.load(score_ptr + t.to(tl.int64) * score_stride + cols, mask=mask)
    ape = tl.load(ape_ptr + (pos % COMPRESS_RATIO) * ape_stride + cols, mask=mask)
    tl.store(row + cols, kv, mask=mask)
    tl.store(row + HEAD_SIZE + cols, score + ape, mask=mask)


@attrs.frozen(kw_only=True)
class SavePartialStatesKey(warmreg.CompileKey):
    """What changes the binary of save-partial-states."""

    head_size: int
    block_size: int
    compress_ratio: int
    state_block_size: int
    kv_stride: str  # int classes of the specialized strides
    score_stride: str
    ape_stride: str
    state_stride0: str
    state_stride1: str
    kv_aligned: bool  # kv and score are column views of one kv_score projection
    score_aligned: bool
    num_warps: int
    launch_pdl: bool  # always False (a launch option; False is Triton's default, so nothing is passed)


class SavePartialStates(warmreg.TritonKernel[SavePartialStatesKey]):
    """Save ``kv`` and ``score + ape`` rows into the compressor state cache (see the module docstring).

    One instance per compressor kind of the deployment (their keys merge under one name); any
    instance launches any compressor's save.

    :param head_size: ``coff * head_dim`` of the compressor.
    :param compress_ratio: its compress ratio (4 or 128).
    :param state_block_size: state-cache slots per page.
    :param plugin: the registering plugin, named in config errors.
    """

    name = "deepseek_v4.save_partial_states"
    key_type = SavePartialStatesKey
    jit = _save_partial_states_kernel

    def __init__(self, *, head_size: int, compress_ratio: int, state_block_size: int, plugin: str = PLUGIN) -> None:
        self.head_size, self.compress_ratio, self.state_block_size = head_size, compress_ratio, state_block_size
        self.plugin = plugin

    def dispatch(
        self, *, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, state_cache: torch.Tensor
    ) -> SavePartialStatesKey:
        head = kv.shape[-1]
        return SavePartialStatesKey(
            head_size=head,
            block_size=warmreg.next_pow2(head),
            compress_ratio=ape.shape[0],
            state_block_size=state_cache.shape[1],
            kv_stride=warmreg.int_class(kv.stride(0)),
            score_stride=warmreg.int_class(score.stride(0)),
            ape_stride=warmreg.int_class(ape.stride(0)),
            state_stride0=warmreg.int_class(state_cache.stride(0)),
            state_stride1=warmreg.int_class(state_cache.stride(1)),
            kv_aligned=warmreg.is_aligned(kv),
            score_aligned=warmreg.is_aligned(score),
            num_warps=4,
            launch_pdl=False,
        )

    def _kv_score(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv_score = warmreg.meta((tokens, 2 * self.head_size), torch.float32)
        return kv_score[:, : self.head_size], kv_score[:, self.head_size :]

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        views = [self._kv_score(t) for t in warmreg.token_counts(config, plugin=self.plugin)]
        return {
            "kv": [kv for kv, _ in views],
            "score": [score for _, score in views],
            "ape": [warmreg.meta((self.compress_ratio, self.head_size), torch.float32)],
            "state_cache": [warmreg.meta((2, self.state_block_size, 2 * self.head_size), torch.float32)],
        }

    def when(self, *, kv: torch.Tensor, score: torch.Tensor, **_: Any) -> bool:
        return kv.shape[0] == score.shape[0]  # both are views of one kv_score

    def warmup_inputs(self, key: SavePartialStatesKey) -> Mapping[str, Any]:
        def rep(cls: str) -> int:
            return warmreg.int_class_rep(cls)

        h = key.head_size
        return {
            "kv": warmreg.meta(
                (1, h), torch.float32, stride=(rep(key.kv_stride), 1), offset=0 if key.kv_aligned else 1
            ),
            "score": warmreg.meta(
                (1, h), torch.float32, stride=(rep(key.score_stride), 1), offset=0 if key.score_aligned else 1
            ),
            "ape": warmreg.meta((key.compress_ratio, h), torch.float32, stride=(rep(key.ape_stride), 1)),
            "positions": warmreg.meta((1,), torch.int64),
            "slot_mapping": warmreg.meta((1,), torch.int64),
            "state_cache": warmreg.meta(
                (1, key.state_block_size, 2 * h),
                torch.float32,
                stride=(rep(key.state_stride0), rep(key.state_stride1), 1),
            ),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        ape: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        state_cache: torch.Tensor,
    ) -> warmreg.LaunchSpec[SavePartialStatesKey]:
        """Save the rows of the ``slot_mapping.shape[0]`` first tokens (in place; returns ``state_cache``).

        :param kv: fp32 ``[T, HEAD_SIZE]``, last dim contiguous (a column view of ``kv_score``).
        :param score: fp32 ``[T, HEAD_SIZE]``, last dim contiguous.
        :param ape: fp32 ``[COMPRESS_RATIO, HEAD_SIZE]`` positional bias, 16-byte aligned.
        :param positions: int64 ``[>= S]`` absolute positions.
        :param slot_mapping: int64 ``[S]`` state-cache slots (``page * page_bs + row``), ``S <= T``; -1 skips.
        :param state_cache: fp32 ``[num_pages, page_bs, 2 * HEAD_SIZE]``, last dim contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, shapes or layouts.
        """
        self._check(kv, score, ape, positions, slot_mapping, state_cache)
        key = self.dispatch(kv=kv, score=score, ape=ape, state_cache=state_cache)
        kwargs = dict(
            kv_ptr=kv, score_ptr=score, ape_ptr=ape, positions_ptr=positions, slot_mapping_ptr=slot_mapping,
            state_ptr=state_cache, kv_stride=kv.stride(0), score_stride=score.stride(0), ape_stride=ape.stride(0),
            state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            HEAD_SIZE=key.head_size, BLOCK_SIZE=key.block_size, COMPRESS_RATIO=key.compress_ratio,
            STATE_BLOCK_SIZE=key.state_block_size,
        )  # fmt: skip
        grid = (slot_mapping.shape[0],) if slot_mapping.shape[0] else None
        return warmreg.LaunchSpec(key, grid, kwargs, state_cache)

    def _check(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        ape: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        state_cache: torch.Tensor,
    ) -> None:
        problem = None
        rows = (kv, score, ape, state_cache)
        if any(x.dtype != torch.float32 or x.stride(-1) != 1 for x in rows):
            problem = "kv, score, ape and state_cache must be fp32 with a contiguous last dim"
        elif kv.ndim != 2 or score.shape != kv.shape or ape.ndim != 2 or ape.shape[1] != kv.shape[1]:
            shapes = f"kv {tuple(kv.shape)}, score {tuple(score.shape)}, ape {tuple(ape.shape)}"
            problem = f"{shapes} must be [T, H], [T, H], [compress_ratio, H]"
        elif state_cache.ndim != 3 or state_cache.shape[2] != 2 * kv.shape[1]:
            problem = f"state_cache {tuple(state_cache.shape)} must be [num_pages, page_bs, 2 * {kv.shape[1]}]"
        elif not (warmreg.is_aligned(ape) and warmreg.is_aligned(state_cache)):
            problem = "ape and state_cache must be 16-byte aligned (a parameter and a cache, never offset views)"
        elif slot_mapping.dtype != torch.int64 or slot_mapping.ndim != 1 or slot_mapping.shape[0] > kv.shape[0]:
            got = f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            problem = f"slot_mapping must be int64 [S <= {kv.shape[0]}] (got {got})"
        elif positions.dtype != torch.int64 or positions.ndim != 1 or positions.shape[0] < slot_mapping.shape[0]:
            problem = (
                f"positions must be int64 [>= {slot_mapping.shape[0]}] (got {positions.dtype} {tuple(positions.shape)})"
            )
        if problem:
            raise warmreg.LaunchError(self.name, problem)


def save_partial_states_reference(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
) -> torch.Tensor:
    """PyTorch reference of :class:`SavePartialStates` (writes ``state_cache`` in place and returns it)."""
    head, page_bs, ratio = kv.shape[1], state_cache.shape[1], ape.shape[0]
    for t in range(slot_mapping.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        row = state_cache[slot // page_bs, slot % page_bs]
        row[:head] = kv[t]
        row[head:] = score[t] + ape[int(positions[t]) % ratio]
    return state_cache


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register one save per compressor kind present: main C4 and indexer C4 (cr 4), main C128 (cr 128).

    Every platform: the compressor's state saving is this Triton kernel on CUDA, ROCm and XPU.
    """
    for ratio in (4, 128):
        if ratio not in model.ratios:
            continue
        heads = [COFF[ratio] * model.head_dim] + ([COFF[ratio] * model.index_head_dim] if ratio == 4 else [])
        for head in heads:
            registry.add(
                SavePartialStates(head_size=head, compress_ratio=ratio, state_block_size=STATE_PAGE_SIZE[ratio])
            )
