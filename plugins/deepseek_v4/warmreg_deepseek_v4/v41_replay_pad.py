"""DeepSeek-V4.1's SWA bounded replay: the replayed tokens' slots padded in the prefix-cacheable KV-cache groups
(vLLM 0.34 ``models/deepseek_v41/nvidia/model_state.py``: ``_pad_replayed_slots_kernel``, launched by
``DeepseekV41ModelState.prepare_attn``).

With SWA bounded replay (``CacheConfig.swa_bounded_replay``, vLLM's default) the sliding-window KV stays out of
prefix caching: after a prefix hit the scheduler recomputes the hit's last ``window`` tokens (the SWA spec's
``prefix_replay_tokens``, the sliding window) and tells the runner each prefilling request's ``replay_start`` (0 for
the others). Those tokens rebuild window KV only, so their slots in every prefix-cacheable group (every group but
the SWA one) become the pad slot and the cached KV there stays as is. For request ``r < R``
(``R = replay_start.shape[0]``) with ``s = replay_start[r] != 0``, each token ``t`` in ``[query_start_loc[r],
query_start_loc[r + 1])`` and each group ``g`` in ``cacheable_groups``::

    slot_mappings[g, t] = pad_slot_id        if s <= positions[t] < s + window
                                             (everything else untouched)

``slot_mappings`` is the runner's int64 ``[num_groups, num_tokens_padded]`` (unit column stride; under prefill context
parallelism this rank's column chunk of it, a view that may start off a 16-byte boundary), ``cacheable_groups`` int32
``[G]`` group indices, ``query_start_loc`` int32 ``[>= R + 1]``, ``positions`` int64 ``[T]`` covering every scheduled
token, ``replay_start`` int32 ``[R]``.

vLLM runs one program a request with a loop over its tokens in tiles of 1024 and an unrolled loop over the ``G``
groups (``NUM_GROUPS``, a constexpr). Here the grid is ``(R, cdiv(T, 1024), G)``, one program a tile of a request's
tokens and a group, so no loop has a runtime bound and ``G`` is not in the key: the same stores.

Where it runs: every step of a V4.1 deployment on CUDA's V2 runner whose batch has a prefill with a replay start
(after a prefix-cache hit), when bounded replay is on (warmreg's ``serving.swa_bounded_replay``, default true as in
vLLM; vLLM turns it off under prefill context parallelism without prefix caching, which warmreg has no setting for:
prefix caching is taken as on, vLLM's default). vLLM warms the kernel whenever the replay window is non-zero
(``_warm_up_replay_kernels``).

Key: the tile, the warps and whether ``slot_mappings`` is 16-byte aligned (not aligned only for a PCP chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from .model import DSV4, PLUGIN

__all__ = ["PadReplayedSlots", "PadReplayedSlotsKey", "pad_replayed_slots_reference", "register", "swa_bounded_replay"]

_BLOCK = 1024
_NUM_WARPS = 4
#: vLLM's ``PAD_SLOT_ID`` (``v1/attention/backends/utils.py``).
PAD_SLOT_ID = -1


@triton.jit(do_not_specialize=["group_stride", "window", "pad_slot_id"])
def _pad_replayed_slots_kernel(
    slots_ptr,  # int64 [num_groups, >= T], unit column stride
    group_stride,
    groups_ptr,  # int32 [G]: the prefix-cacheable groups
    query_start_loc_ptr,  # int32 [>= R + 1]
    positions_ptr,  # int64 [T]
    replay_start_ptr,  # int32 [R]
    window,
    pad_slot_id,
    BLOCK: tl.constexpr,  # tokens a program
):
    req = tl.program_id(0)
    group = tl.load(groups_ptr + tl.program_id(2)).to(tl.int64)
    start = tl.load(replay_start_ptr + req)
    begin = tl.load(query_start_loc_ptr + req)
    end = tl.load(query_start_loc_ptr + req + 1)
    t = begin + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = tl.where(start != 0, t < end, False)  # a tensor mask gated by a scalar (Triton 3.9)
    pos = tl.load(positions_ptr + t, mask=live, other=0)
    replayed = live & (pos >= start) & (pos < start + window)
    tl.store(slots_ptr + group * group_stride + t, pad_slot_id, mask=replayed)


@attrs.frozen(kw_only=True)
class PadReplayedSlotsKey(warmreg.CompileKey):
    """What changes the binary of the replay padding: the tile, the warps and the slot buffer's alignment."""

    block: int
    slots_aligned: bool
    num_warps: int


class PadReplayedSlots(warmreg.TritonKernel[PadReplayedSlotsKey]):
    """Pad the replayed tokens' slots in the prefix-cacheable groups, in place (the module docstring has the math).

    :param unaligned: whether a deployment's slot buffer may start off a 16-byte boundary (a PCP chunk; domains
        only).
    """

    name = "deepseek_v4.v41_pad_replayed_slots"
    key_type = PadReplayedSlotsKey
    jit = _pad_replayed_slots_kernel

    def __init__(self, *, unaligned: bool = False) -> None:
        self.unaligned = unaligned

    def dispatch(self, *, slot_mappings: torch.Tensor) -> PadReplayedSlotsKey:
        return PadReplayedSlotsKey(block=_BLOCK, slots_aligned=warmreg.is_aligned(slot_mappings), num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        buffer = warmreg.meta((2, 8), torch.int64)
        return {"slot_mappings": [buffer, buffer[:, 1:]] if self.unaligned else [buffer]}

    def warmup_inputs(self, key: PadReplayedSlotsKey) -> Mapping[str, Any]:
        slots = warmreg.meta((2, 8), torch.int64)
        return {
            "slot_mappings": slots if key.slots_aligned else slots[:, 1:],
            "cacheable_groups": warmreg.meta((1,), torch.int32),
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "positions": warmreg.meta((1,), torch.int64),
            "replay_start": warmreg.meta((1,), torch.int32),
            "window": 128,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        slot_mappings: torch.Tensor,
        cacheable_groups: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        replay_start: torch.Tensor,
        *,
        window: int,
        pad_slot_id: int = PAD_SLOT_ID,
    ) -> warmreg.LaunchSpec[PadReplayedSlotsKey]:
        """Write ``pad_slot_id`` over the replayed tokens' slots of every cacheable group; returns ``slot_mappings``.

        :param slot_mappings: int64 ``[num_groups, >= T]`` with unit column stride (the runner's, or this PCP rank's
            chunk of it), written in place.
        :param cacheable_groups: int32 ``[G]``, contiguous: rows of ``slot_mappings`` to pad.
        :param query_start_loc: int32 ``[>= R + 1]``, contiguous.
        :param positions: int64 ``[T]``, contiguous: every scheduled token's position.
        :param replay_start: int32 ``[R]``, contiguous: each request's replay start, 0 for none.
        :param window: the replay window (the sliding window, ``>= 1``).
        :param pad_slot_id: the slot written (vLLM's ``PAD_SLOT_ID``).
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout, or too short.
        """
        _check(self.name, slot_mappings, cacheable_groups, query_start_loc, positions, replay_start, window)
        key = self.dispatch(slot_mappings=slot_mappings)
        reqs, tokens, groups = replay_start.shape[0], positions.shape[0], cacheable_groups.shape[0]
        kwargs = dict(
            slots_ptr=slot_mappings, group_stride=slot_mappings.stride(0), groups_ptr=cacheable_groups,
            query_start_loc_ptr=query_start_loc, positions_ptr=positions, replay_start_ptr=replay_start,
            window=window, pad_slot_id=pad_slot_id, BLOCK=key.block,
        )  # fmt: skip
        grid = (reqs, triton.cdiv(tokens, key.block), groups) if reqs and tokens and groups else None
        return warmreg.LaunchSpec(key, grid, kwargs, slot_mappings)


def _check(
    name: str, slots: torch.Tensor, groups: torch.Tensor, qsl: torch.Tensor, positions: torch.Tensor,
    replay_start: torch.Tensor, window: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's runner passes it."""
    if slots.dtype != torch.int64 or slots.ndim != 2 or (slots.shape[1] > 1 and slots.stride(1) != 1):
        raise warmreg.LaunchError(
            name,
            f"slot_mappings must be int64 [groups, tokens] with unit column stride (got {slots.dtype} "
            f"{tuple(slots.shape)}, stride {slots.stride()})",
        )
    reqs = replay_start.shape[0] if replay_start.ndim == 1 else -1
    vectors = (
        ("cacheable_groups", groups, torch.int32, 0),
        ("query_start_loc", qsl, torch.int32, reqs + 1),
        ("positions", positions, torch.int64, 0),
        ("replay_start", replay_start, torch.int32, 0),
    )
    for arg, t, dtype, least in vectors:
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < least or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous 1-D {dtype} of >= {least} entries (got {t.dtype} {tuple(t.shape)})"
            )
    if positions.shape[0] > slots.shape[1] or window < 1:
        raise warmreg.LaunchError(
            name,
            f"need positions ({positions.shape[0]} tokens) within slot_mappings' {slots.shape[1]} columns and "
            f"window ({window}) >= 1",
        )


def pad_replayed_slots_reference(
    slot_mappings: torch.Tensor, cacheable_groups: torch.Tensor, query_start_loc: torch.Tensor,
    positions: torch.Tensor, replay_start: torch.Tensor, *, window: int, pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`PadReplayedSlots`: a padded copy of ``slot_mappings``."""
    out = slot_mappings.clone()
    qsl, groups = query_start_loc.long().tolist(), cacheable_groups.long()
    for r, start in enumerate(replay_start.tolist()):
        if start == 0:
            continue
        pos = positions[qsl[r] : qsl[r + 1]]
        replayed = ((pos >= start) & (pos < start + window)).nonzero().flatten() + qsl[r]
        out[groups[:, None], replayed[None, :]] = pad_slot_id
    return out


def swa_bounded_replay(config: warmreg.WarmConfig) -> bool:
    """``serving.swa_bounded_replay`` (default true, vLLM's ``CacheConfig.swa_bounded_replay``).

    :raises warmreg.ConfigError: for a value that is not a bool.
    """
    return config.get("serving.swa_bounded_replay", bool, plugin=PLUGIN, default=True)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the replay padding for a V4.1 deployment with SWA bounded replay, on CUDA (``prepare_attn`` of a
    batch with a replay start); both slot-buffer alignments under prefill context parallelism.

    :raises warmreg.ConfigError: for a malformed ``serving.swa_bounded_replay`` or PCP size.
    """
    if not model.v41:
        return
    pcp = serving_int(config, "prefill_context_parallel_size", 1)
    registry.add(PadReplayedSlots(unaligned=pcp > 1), when=warmreg.is_cuda if swa_bounded_replay(config) else False)
