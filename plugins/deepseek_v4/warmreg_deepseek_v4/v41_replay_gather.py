"""DeepSeek-V4.1's decoder-side SWA bounded replay: the replay layers' sub-batch of each request's kept rows (vLLM
0.34 ``models/deepseek_v41/nvidia/model_state.py``: ``_gather_replay_batch_kernel``, launched by
``DeepseekV41ModelState._kept_input_batch`` from ``_prepare_replay_batch``).

With bounded replay the layers from the last kv-source layer on (``DecoderReplayLayers``) run an eager prefill step on
each request's trailing ``window`` rows only. For request ``r < R`` with batch rows ``[b, e)``
(``query_start_loc``), ``d = dropped_before`` (the rows trimmed before each boundary, int32 ``[R + 1]``), kept rows
``[kb, ke) = [b - d[r], e - d[r + 1])``::

    kept_query_start_loc[0] = kb (r == 0),   kept_query_start_loc[r + 1] = ke
    kept_kv_start[r] = ke - kb < e - b ? max(replay_start[r], seq_lens[r] - window) : replay_start[r]
    for i < ke - kb, row = e - (ke - kb) + i:
        rows[kb + i] = row,   kept_positions[kb + i] = positions[row]
        kept_slot_mappings[g, kb + i] = slot_mappings[g, row]        for every KV-cache group g < G

``slot_mappings`` int64 ``[G, >= T]`` (unit column stride; under prefill context parallelism this rank's column chunk,
a view that may start off a 16-byte boundary), ``kept_slot_mappings`` int64 ``[G, >= kept rows]`` (a column prefix of
the persistent buffer), ``positions`` / ``rows`` / ``kept_positions`` int64, the others int32.

vLLM runs one program a request with ``G`` a constexpr (``NUM_GROUPS``, the KV-cache groups) unrolled. Here the groups
are a runtime loop, so one binary serves any group count: the same stores.

Where it runs: the eager prefill steps of a V4.1 deployment on CUDA whose batch trims a request (a prefill longer
than the window), when vLLM builds the replay layers (``DeepseekV4Model.__init__``: the last kv-source layer is not
the last layer, SWA bounded replay is on, no engram layer at or after it, the drafter, if any, reads within the
target's window, no sequence parallelism (expert parallelism at TP > 1 with a MegaMoE backend or DP > 1),
microbatching, pipeline split or LoRA: warmreg has no setting for the last three, which are off by vLLM's
defaults). vLLM warms it whenever the replay layers exist
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
from .dspark import speculative_method
from .model import DSV4, PLUGIN
from .v41_replay_pad import swa_bounded_replay

__all__ = ["GatherReplayBatch", "GatherReplayBatchKey", "decoder_replay", "gather_replay_batch_reference", "register"]

_BLOCK = 1024
#: vLLM 0.34 ``config/kernel.py``: ``MEGA_MOE_BACKENDS``
_MEGA_MOE_BACKENDS = frozenset({"deep_gemm_mega_moe", "flashinfer_moe_ep_cutedsl", "flashinfer_moe_ep_mega_deep_gemm"})
_NUM_WARPS = 4


@triton.jit(do_not_specialize=["num_groups", "slots_stride", "kept_slots_stride", "window"])
def _gather_replay_batch_kernel(
    qsl_ptr,  # int32 [R + 1]
    dropped_ptr,  # int32 [R + 1]: rows trimmed before each boundary
    seq_lens_ptr,  # int32 [R]
    replay_start_ptr,  # int32 [R]
    positions_ptr,  # int64 [T]
    slots_ptr,  # int64 [G, >= T], unit column stride
    slots_stride,
    num_groups,
    rows_ptr,  # int64 [>= kept]
    kept_qsl_ptr,  # int32 [R + 1]
    kept_positions_ptr,  # int64 [>= kept]
    kept_slots_ptr,  # int64 [G, >= kept], unit column stride
    kept_slots_stride,
    kept_kv_start_ptr,  # int32 [R]
    window,
    BLOCK: tl.constexpr,  # kept rows a loop step
):
    r = tl.program_id(0)
    b = tl.load(qsl_ptr + r)
    e = tl.load(qsl_ptr + r + 1)
    kb = b - tl.load(dropped_ptr + r)
    ke = e - tl.load(dropped_ptr + r + 1)
    if r == 0:
        tl.store(kept_qsl_ptr, kb)
    tl.store(kept_qsl_ptr + r + 1, ke)
    start = tl.load(replay_start_ptr + r)
    if ke - kb < e - b:  # trimmed: no window KV below the kept rows
        start = tl.maximum(start, tl.load(seq_lens_ptr + r) - window)
    tl.store(kept_kv_start_ptr + r, start)
    shift = e - ke  # batch row of kept row k: k + shift
    for k0 in range(kb, ke, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        live = k < ke
        row = k + shift
        tl.store(rows_ptr + k, row.to(tl.int64), mask=live)
        tl.store(kept_positions_ptr + k, tl.load(positions_ptr + row, mask=live), mask=live)
        for g in range(num_groups):
            slot = tl.load(slots_ptr + g * slots_stride + row, mask=live)
            tl.store(kept_slots_ptr + g * kept_slots_stride + k, slot, mask=live)


@attrs.frozen(kw_only=True)
class GatherReplayBatchKey(warmreg.CompileKey):
    """What changes the binary of the replay gather: the tile, the warps and the slot buffer's alignment."""

    block: int
    slots_aligned: bool
    num_warps: int


class GatherReplayBatch(warmreg.TritonKernel[GatherReplayBatchKey]):
    """Gather the replay layers' kept rows of a batch (the module docstring has the math).

    :param unaligned: whether a deployment's slot buffer may start off a 16-byte boundary (a PCP chunk; domains
        only).
    """

    name = "deepseek_v4.v41_gather_replay_batch"
    key_type = GatherReplayBatchKey
    jit = _gather_replay_batch_kernel

    def __init__(self, *, unaligned: bool = False) -> None:
        self.unaligned = unaligned

    def dispatch(self, *, slot_mappings: torch.Tensor) -> GatherReplayBatchKey:
        aligned = warmreg.is_aligned(slot_mappings)
        return GatherReplayBatchKey(block=_BLOCK, slots_aligned=aligned, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        buffer = warmreg.meta((2, 8), torch.int64)
        return {"slot_mappings": [buffer, buffer[:, 1:]] if self.unaligned else [buffer]}

    def warmup_inputs(self, key: GatherReplayBatchKey) -> Mapping[str, Any]:
        i32, i64 = torch.int32, torch.int64
        slots = warmreg.meta((2, 8), i64)
        return {
            "query_start_loc": warmreg.meta((2,), i32),
            "dropped_before": warmreg.meta((2,), i32),
            "seq_lens": warmreg.meta((1,), i32),
            "replay_start": warmreg.meta((1,), i32),
            "positions": warmreg.meta((4,), i64),
            "slot_mappings": slots if key.slots_aligned else slots[:, 1:],
            "rows": warmreg.meta((8,), i64),
            "kept_query_start_loc": warmreg.meta((2,), i32),
            "kept_positions": warmreg.meta((8,), i64),
            "kept_slot_mappings": warmreg.meta((2, 8), i64),
            "kept_kv_start": warmreg.meta((1,), i32),
            "window": 128,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        query_start_loc: torch.Tensor,
        dropped_before: torch.Tensor,
        seq_lens: torch.Tensor,
        replay_start: torch.Tensor,
        positions: torch.Tensor,
        slot_mappings: torch.Tensor,
        rows: torch.Tensor,
        kept_query_start_loc: torch.Tensor,
        kept_positions: torch.Tensor,
        kept_slot_mappings: torch.Tensor,
        kept_kv_start: torch.Tensor,
        *,
        window: int,
    ) -> warmreg.LaunchSpec[GatherReplayBatchKey]:
        """Write the kept rows' batch rows, positions and slots, the kept query offsets and the kept KV starts of the
        ``R = seq_lens.shape[0]`` requests; returns ``(rows, kept_query_start_loc, kept_positions,
        kept_slot_mappings, kept_kv_start)``, written in place.

        :param query_start_loc: int32 ``[>= R + 1]``, contiguous.
        :param dropped_before: int32 ``[>= R + 1]``, contiguous: rows trimmed before each boundary.
        :param seq_lens: int32 ``[R]``, contiguous.
        :param replay_start: int32 ``[>= R]``, contiguous: each request's replay start (0 for none).
        :param positions: int64 ``[T]``, contiguous.
        :param slot_mappings: int64 ``[G, >= T]`` with unit column stride.
        :param rows: int64, contiguous, as long as the kept rows.
        :param kept_query_start_loc: int32 ``[>= R + 1]``, contiguous.
        :param kept_positions: int64, as ``rows``.
        :param kept_slot_mappings: int64 ``[G, >= kept rows]`` with unit column stride.
        :param kept_kv_start: int32 ``[>= R]``, contiguous.
        :param window: the replay window (the sliding window, ``>= 1``).
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout, or too short.
        """
        reqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
        vectors = {
            "query_start_loc": (query_start_loc, torch.int32, reqs + 1),
            "dropped_before": (dropped_before, torch.int32, reqs + 1),
            "seq_lens": (seq_lens, torch.int32, 0),
            "replay_start": (replay_start, torch.int32, reqs),
            "positions": (positions, torch.int64, 0),
            "rows": (rows, torch.int64, 0),
            "kept_query_start_loc": (kept_query_start_loc, torch.int32, reqs + 1),
            "kept_positions": (kept_positions, torch.int64, 0),
            "kept_kv_start": (kept_kv_start, torch.int32, reqs),
        }
        _check(self.name, vectors, slot_mappings, kept_slot_mappings, positions.shape[0], window)
        key = self.dispatch(slot_mappings=slot_mappings)
        kwargs = dict(
            qsl_ptr=query_start_loc, dropped_ptr=dropped_before, seq_lens_ptr=seq_lens, replay_start_ptr=replay_start,
            positions_ptr=positions, slots_ptr=slot_mappings, slots_stride=slot_mappings.stride(0),
            num_groups=slot_mappings.shape[0], rows_ptr=rows, kept_qsl_ptr=kept_query_start_loc,
            kept_positions_ptr=kept_positions, kept_slots_ptr=kept_slot_mappings,
            kept_slots_stride=kept_slot_mappings.stride(0), kept_kv_start_ptr=kept_kv_start, window=window,
            BLOCK=key.block,
        )  # fmt: skip
        outputs = (rows, kept_query_start_loc, kept_positions, kept_slot_mappings, kept_kv_start)
        return warmreg.LaunchSpec(key, (reqs,) if reqs > 0 else None, kwargs, outputs)


def _check(
    name: str, vectors: Mapping[str, tuple[torch.Tensor, torch.dtype, int]], slots: torch.Tensor, kept: torch.Tensor,
    tokens: int, window: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's runner passes it."""
    for arg, (t, dtype, least) in vectors.items():
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < least or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous 1-D {dtype} of >= {least} entries (got {t.dtype} {tuple(t.shape)})"
            )
    for arg, t in (("slot_mappings", slots), ("kept_slot_mappings", kept)):
        if t.dtype != torch.int64 or t.ndim != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise warmreg.LaunchError(
                name,
                f"{arg} must be int64 [groups, tokens] with unit column stride (got {t.dtype} {tuple(t.shape)}, "
                f"stride {t.stride()})",
            )
    if slots.shape[0] != kept.shape[0] or slots.shape[1] < tokens or window < 1:
        raise warmreg.LaunchError(
            name,
            f"need kept_slot_mappings' {kept.shape[0]} groups equal to slot_mappings' {slots.shape[0]}, positions "
            f"({tokens} tokens) within its {slots.shape[1]} columns and window ({window}) >= 1",
        )


def gather_replay_batch_reference(
    query_start_loc: torch.Tensor, dropped_before: torch.Tensor, seq_lens: torch.Tensor, replay_start: torch.Tensor,
    positions: torch.Tensor, slot_mappings: torch.Tensor, rows: torch.Tensor, kept_query_start_loc: torch.Tensor,
    kept_positions: torch.Tensor, kept_slot_mappings: torch.Tensor, kept_kv_start: torch.Tensor, *, window: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """PyTorch reference of :class:`GatherReplayBatch`: updated copies of its five outputs."""
    out_rows, out_qsl, out_pos = rows.clone(), kept_query_start_loc.clone(), kept_positions.clone()
    out_slots, out_start = kept_slot_mappings.clone(), kept_kv_start.clone()
    qsl, dropped = query_start_loc.long().tolist(), dropped_before.long().tolist()
    for r in range(seq_lens.shape[0]):
        b, e = qsl[r], qsl[r + 1]
        kb, ke = b - dropped[r], e - dropped[r + 1]
        if r == 0:
            out_qsl[0] = kb
        out_qsl[r + 1] = ke
        start = int(replay_start[r])
        if ke - kb < e - b:
            start = max(start, int(seq_lens[r]) - window)
        out_start[r] = start
        if ke > kb:
            src = torch.arange(e - (ke - kb), e)
            out_rows[kb:ke] = src
            out_pos[kb:ke] = positions[src]
            out_slots[:, kb:ke] = slot_mappings[:, src]
    return out_rows, out_qsl, out_pos, out_slots, out_start


def decoder_replay(model: DSV4, config: warmreg.WarmConfig) -> bool:
    """Whether vLLM 0.34 builds V4.1's decoder replay layers (``DeepseekV4Model.__init__`` and
    ``_decoder_replay_supported``): SWA bounded replay on (``serving.swa_bounded_replay``), the last kv-source layer
    before the last backbone layer, no engram layer at or after it, and a drafter that reads within the target's
    window (no speculation, or the checkpoint's own MTP or DSpark layers, which share its config; another method's
    draft model is taken as not), and no sequence parallelism (``_use_sequence_parallel``: expert parallelism at
    tensor-parallel size > 1 with a MegaMoE backend or data parallelism). Microbatching, a pipeline split and LoRA,
    which also turn it off, have no warmreg setting and are off by vLLM's defaults.

    :raises warmreg.ConfigError: for a malformed ``serving.swa_bounded_replay`` or speculative method.
    """
    if not model.v41 or not model.kv_source_layer_ids or not swa_bounded_replay(config):
        return False
    cut = max(model.kv_source_layer_ids)
    engram = model.engram.layer_ids if model.engram is not None else ()
    drafter_ok = speculative_method(config) in (None, "mtp", "dspark")
    return cut < model.num_hidden_layers - 1 and not any(i >= cut for i in engram) and drafter_ok and not _sp(config)


def _sp(config: warmreg.WarmConfig) -> bool:
    """vLLM 0.34 ``nvidia/model.py: _use_sequence_parallel``: expert parallelism at tensor-parallel size > 1 with a
    MegaMoE backend (``MEGA_MOE_BACKENDS``) or data-parallel size > 1."""
    ep = config.get("serving.enable_expert_parallel", bool, plugin=PLUGIN, default=False)
    mega = config.get("serving.moe_backend", str, plugin=PLUGIN, default="auto") in _MEGA_MOE_BACKENDS
    return (
        ep
        and serving_int(config, "tensor_parallel_size", 1) > 1
        and (mega or serving_int(config, "data_parallel_size", 1) > 1)
    )


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the replay gather on CUDA where vLLM builds the decoder replay layers (:func:`decoder_replay`); both
    slot-buffer alignments under prefill context parallelism.

    :raises warmreg.ConfigError: for malformed settings.
    """
    if not decoder_replay(model, config):
        return
    pcp = serving_int(config, "prefill_context_parallel_size", 1)
    registry.add(GatherReplayBatch(unaligned=pcp > 1), when=warmreg.is_cuda)
