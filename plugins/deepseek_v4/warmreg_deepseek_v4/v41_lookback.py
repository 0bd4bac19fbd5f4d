"""DeepSeek-V4.1's engram look-back window: the token ids just before each request's chunk (vLLM 0.34
``models/deepseek_v41/nvidia/model_state.py``: ``_gather_lookback_kernel``, launched by
``DeepseekV41ModelState._fill_lookback`` from ``prepare_inputs``).

The engram n-gram hash (:mod:`.v41_engram_hash`) needs the ``D = engram_max_ngram_size - 1`` ids preceding each
request's first scheduled token; the V2 runner keeps every request's token history on the device
(``RequestState.all_token_ids``, int32 ``[max_num_reqs, max_model_len]``) and gathers the window every step into a
persistent buffer ``lookback`` (int32 ``[R, D]``, contiguous, ``R >= num_reqs``: ``max_num_reqs``, twice that under
prefill context parallelism), which a captured CUDA graph reads. For buffer row ``b`` with ``q = idx_mapping[b]``,
``[s, e) = query_start_loc[b : b + 2]`` and ``c = positions[s]`` (the tokens already computed)::

    lookback[b, j] = all_token_ids[q, c - 1 - j]    if b < num_reqs, e > s and c - 1 - j >= 0
    lookback[b, j] = -1                             otherwise (rows past the batch, empty requests, before the prompt)

with ``num_reqs = idx_mapping.shape[0]`` (int64, the runner's batch-row -> request-state map), ``query_start_loc``
int32 ``[>= num_reqs + 1]`` and ``positions`` int64. Grid ``(R,)``, one row a program, ``next_pow2(D)`` lanes,
Triton's default four warps, as in vLLM.

Where it runs: every step of a V4.1 deployment with engram layers on vLLM's V2 model runner (the only one), whose
model state is ``DeepseekV41ModelState`` (or its specialized-decode subclass, whose ``_fill_lookback`` runs the same
gather, at times on a side stream beside its metadata graph): ``token_lookback_depth`` is the engram hash's depth, 0
without engram layers (no buffer, no launch). This plugin plans V4.1 on CUDA.

Key: ``D`` and ``next_pow2(D)`` (constexprs, as in vLLM) and the warps. ``num_reqs`` and the history's row stride
are ``do_not_specialize`` here (vLLM specializes them; one binary serves every batch and ``max_model_len``).
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

__all__ = ["GatherLookback", "GatherLookbackKey", "gather_lookback_reference", "register"]

_NUM_WARPS = 4


@triton.jit(do_not_specialize=["history_stride", "num_reqs"])
def _gather_lookback_kernel(
    lookback_ptr,  # int32 [R, DEPTH], contiguous
    idx_mapping_ptr,  # int64 [num_reqs]
    query_start_loc_ptr,  # int32 [>= num_reqs + 1]
    positions_ptr,  # int64 [>= tokens]
    history_ptr,  # int32 [max_num_reqs, max_model_len] (all_token_ids)
    history_stride,
    num_reqs,
    DEPTH: tl.constexpr,  # ids a row: the engram hash's look-back
    BLOCK_DEPTH: tl.constexpr,  # next_pow2(DEPTH): the lanes
):
    row = tl.program_id(0)
    live = row < num_reqs
    state = tl.load(idx_mapping_ptr + row, mask=live, other=0).to(tl.int64)
    begin = tl.load(query_start_loc_ptr + row, mask=live, other=0)
    end = tl.load(query_start_loc_ptr + row + 1, mask=live, other=0)
    live = live & (end > begin)
    computed = tl.load(positions_ptr + begin, mask=live, other=0)
    j = tl.arange(0, BLOCK_DEPTH)
    pos = computed - 1 - j
    read = tl.where(live, (j < DEPTH) & (pos >= 0), False)  # a tensor mask gated by a scalar (Triton 3.9)
    ids = tl.load(history_ptr + state * history_stride + pos, mask=read, other=-1)
    tl.store(lookback_ptr + row * DEPTH + j, ids, mask=j < DEPTH)


@attrs.frozen(kw_only=True)
class GatherLookbackKey(warmreg.CompileKey):
    """What changes the binary of the look-back gather: the depth, its lanes and the warps."""

    depth: int
    block_depth: int
    num_warps: int


class GatherLookback(warmreg.TritonKernel[GatherLookbackKey]):
    """Each batch row's engram look-back ids into the runner's persistent buffer (the module docstring has the math).

    :param depth: the engram hash's look-back, ``engram_max_ngram_size - 1`` (domains only).
    """

    name = "deepseek_v4.v41_gather_lookback"
    key_type = GatherLookbackKey
    jit = _gather_lookback_kernel

    def __init__(self, *, depth: int) -> None:
        self.depth = depth

    def dispatch(self, *, lookback: torch.Tensor) -> GatherLookbackKey:
        depth = lookback.shape[1]
        return GatherLookbackKey(depth=depth, block_depth=triton.next_power_of_2(depth), num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"lookback": [warmreg.meta((2, self.depth), torch.int32)]}

    def warmup_inputs(self, key: GatherLookbackKey) -> Mapping[str, Any]:
        return {
            "lookback": warmreg.meta((2, key.depth), torch.int32),
            "idx_mapping": warmreg.meta((1,), torch.int64),
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "positions": warmreg.meta((1,), torch.int64),
            "all_token_ids": warmreg.meta((2, 64), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        lookback: torch.Tensor,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        all_token_ids: torch.Tensor,
    ) -> warmreg.LaunchSpec[GatherLookbackKey]:
        """Fill every row of ``lookback`` in place (rows past the batch with -1); returns ``lookback``.

        :param lookback: int32 ``[R >= num_reqs, D >= 1]``, contiguous: the runner's persistent buffer (required: a
            captured graph reads it; every row is written).
        :param idx_mapping: int64 ``[num_reqs]``, contiguous: each batch row's request-state row.
        :param query_start_loc: int32 ``[>= num_reqs + 1]``, contiguous.
        :param positions: int64 ``[tokens]``, contiguous: each scheduled token's position.
        :param all_token_ids: int32 ``[max_num_reqs, max_model_len]`` with unit column stride: every request's ids.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout, or too short.
        """
        _check(self.name, lookback, idx_mapping, query_start_loc, positions, all_token_ids)
        key = self.dispatch(lookback=lookback)
        kwargs = dict(
            lookback_ptr=lookback, idx_mapping_ptr=idx_mapping, query_start_loc_ptr=query_start_loc,
            positions_ptr=positions, history_ptr=all_token_ids, history_stride=all_token_ids.stride(0),
            num_reqs=idx_mapping.shape[0], DEPTH=key.depth, BLOCK_DEPTH=key.block_depth,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (lookback.shape[0],) if lookback.shape[0] else None, kwargs, lookback)


def _check(
    name: str, lookback: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
    positions: torch.Tensor, history: torch.Tensor,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's runner passes it."""
    if lookback.dtype != torch.int32 or lookback.ndim != 2 or lookback.shape[1] < 1 or not lookback.is_contiguous():
        raise warmreg.LaunchError(
            name, f"lookback must be contiguous int32 [R, D >= 1] (got {lookback.dtype} {tuple(lookback.shape)})"
        )
    reqs = idx_mapping.shape[0] if idx_mapping.ndim == 1 else -1
    vectors = (
        ("idx_mapping", idx_mapping, torch.int64, 0),
        ("query_start_loc", query_start_loc, torch.int32, reqs + 1),
        ("positions", positions, torch.int64, 0),
    )
    for arg, t, dtype, least in vectors:
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < least or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous 1-D {dtype} of >= {least} entries (got {t.dtype} {tuple(t.shape)})"
            )
    if reqs > lookback.shape[0]:
        raise warmreg.LaunchError(name, f"lookback has {lookback.shape[0]} rows for {reqs} requests (idx_mapping)")
    if history.dtype != torch.int32 or history.ndim != 2 or (history.shape[1] > 1 and history.stride(1) != 1):
        raise warmreg.LaunchError(
            name,
            f"all_token_ids must be int32 [reqs, len] with unit column stride (got {history.dtype} "
            f"{tuple(history.shape)}, stride {history.stride()})",
        )


def gather_lookback_reference(
    lookback: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`GatherLookback`: a new int32 tensor of ``lookback``'s shape."""
    out = torch.full_like(lookback, -1)
    qsl, depth = query_start_loc.long().tolist(), lookback.shape[1]
    for b, q in enumerate(idx_mapping.tolist()):
        if qsl[b + 1] <= qsl[b]:
            continue
        computed = int(positions[qsl[b]])
        for j in range(min(depth, max(computed, 0))):
            out[b, j] = all_token_ids[q, computed - 1 - j]
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the look-back gather for a V4.1 deployment with engram layers, on CUDA (``prepare_inputs``, every
    step), at the engram hash's depth."""
    layout = model.engram
    if layout is None:
        return
    registry.add(GatherLookback(depth=layout.max_ngram_size - 1), when=warmreg.is_cuda if model.v41 else False)
