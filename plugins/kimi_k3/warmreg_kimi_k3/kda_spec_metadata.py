"""Stage a speculative-decode step's KDA metadata into the CUDA-graph buffers (vLLM 0.33 and 0.34
``models/kimi_k3/nvidia/kda_metadata.py``: ``stage_spec_decode_metadata``, ``_stage_spec_decode_metadata_kernel``).

A full CUDA graph of a speculative-decode step was captured for a padded batch of ``B`` requests and reads its
metadata from persistent buffers. Before a replay, the metadata of the ``n <= B`` real requests is copied into
those buffers and the ``B - n`` padding requests are given values that make them inert: no state slot, no
tokens, one accepted token.

Math, with ``S`` state slots per request (the staged buffer's width)::

    staged_state[r, s] = state[r, s]   for r < n,          s < S
                         NULL (0)      for n <= r < B,     s < S        # vLLM's NULL_BLOCK_ID
    staged_qsl[r]      = qsl[min(r, n)]  for r <= B                      # padding: zero-length requests at the end
    staged_accepted[r] = accepted[r]   for r < n
                         1             for n <= r < B

``state`` must have ``n`` rows and at least ``S`` columns (only columns ``< S`` are read), ``qsl`` ``n + 1``
entries, ``accepted`` ``n``; the staged buffers have ``B``, ``B + 1`` and ``B`` rows and nothing past them is
written. Grid ``(cdiv(B + 1, 32),)``: 32 rows a program, one warp, as in vLLM.

Where it runs: ``KimiK3KDAMetadataBuilder.build`` on every step whose requests are all speculative decodes
(``num_speculative_tokens > 0``, no prefill and no plain decode), when full CUDA graphs are on (vLLM's default
for Kimi-K3: ``FULL_AND_PIECEWISE`` under breakable CUDA graphs) and the padded batch fits the graph buffers. It
runs for either speculative-decode KDA backend (native or FlashInfer's packed kernel) and does not depend on the
KDA prefill or decode backend. Registered on CUDA (vLLM asserts CUDA tensors) when
``serving.num_speculative_tokens > 0``, with ``S = 1 + num_speculative_tokens``; under RecoverSSM
(``serving.use_replayssm``, :func:`warmreg_kimi_k3.recoverssm.use_recoverssm`) with ``S = 1``: vLLM 0.34's builder
then keeps ``spec_state_slots = 1`` and stages into its own ``[max_num_seqs, 1]`` buffer
(``KimiK3KDAMetadataBuilder.__init__``), and the step's accepted counts are its all-ones
``recoverssm_num_accepted_tokens`` (int32, as without RecoverSSM).

Key: the three dtypes, ``S`` and its power-of-two tile, the NULL id, the rows per program and PDL. vLLM makes the
four strides constexprs; here they, ``n`` and ``B`` are runtime integers that are not specialized, and no pointer
is specialized on alignment (the buffers are views of persistent ones): one binary serves every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from .backends import kda_layout
from .model import PLUGIN, KimiK3, local_pdl
from .recoverssm import state_slots

__all__ = [
    "BLOCK_ROWS",
    "NULL_STATE_ID",
    "StageSpecDecodeMetadata",
    "StageSpecDecodeMetadataKey",
    "register",
    "stage_spec_decode_metadata_reference",
]

#: Rows per program (vLLM's ``BLOCK_ROWS``).
BLOCK_ROWS = 32
#: The state id of a padding request (vLLM's ``v1/attention/backends/utils.py: NULL_BLOCK_ID``).
NULL_STATE_ID = 0
_INTS = [
    "state_stride_row",
    "state_stride_col",
    "staged_stride_row",
    "staged_stride_col",
    "num_spec_decodes",
    "batch_size",
]
_POINTERS = ["state_ptr", "qsl_ptr", "accepted_ptr", "staged_state_ptr", "staged_qsl_ptr", "staged_accepted_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _stage_spec_decode_metadata_kernel(
    state_ptr,
    qsl_ptr,
    accepted_ptr,
    staged_state_ptr,
    staged_qsl_ptr,
    staged_accepted_ptr,
    state_stride_row,
    state_stride_col,
    staged_stride_row,
    staged_stride_col,
    num_spec_decodes,  # n: the real requests
    batch_size,  # B: the padded batch the graph was captured for
    NUM_STATE_SLOTS: tl.constexpr,  # S: 1 + num_speculative_tokens, a deployment constant
    BLOCK_STATE_SLOTS: tl.constexpr,  # next_pow2(S)
    NULL_STATE_ID: tl.constexpr,  # the state id of a padding request
    BLOCK_ROWS: tl.constexpr,  # rows per program
    USE_PDL: tl.constexpr,  # wait for the previous kernel first; matches the launch option launch_pdl
):
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    real = rows < num_spec_decodes
    slots = tl.arange(0, BLOCK_STATE_SLOTS)
    in_row = (slots < NUM_STATE_SLOTS)[None, :]
    r64, s64 = rows.to(tl.int64)[:, None], slots.to(tl.int64)[None, :]
    state = tl.load(
        state_ptr + r64 * state_stride_row + s64 * state_stride_col, mask=real[:, None] & in_row, other=NULL_STATE_ID
    )
    staged = staged_state_ptr + r64 * staged_stride_row + s64 * staged_stride_col
    tl.store(staged, state, mask=(rows < batch_size)[:, None] & in_row)
    qsl = tl.load(qsl_ptr + tl.minimum(rows, num_spec_decodes), mask=rows <= batch_size)
    tl.store(staged_qsl_ptr + rows, qsl, mask=rows <= batch_size)
    accepted = tl.load(accepted_ptr + rows, mask=real, other=1)
    tl.store(staged_accepted_ptr + rows, accepted, mask=rows < batch_size)


@attrs.frozen(kw_only=True)
class StageSpecDecodeMetadataKey(warmreg.CompileKey):
    """What changes the binary of the staging: no stride, count or alignment does."""

    index_dtype: str  # the state indices, source and staged
    qsl_dtype: str  # query_start_loc, source and staged
    accepted_dtype: str  # num_accepted_tokens, source and staged
    num_state_slots: int
    block_state_slots: int
    null_state_id: int
    block_rows: int
    launch_pdl: bool  # USE_PDL and the launch option
    num_warps: int


class StageSpecDecodeMetadata(warmreg.TritonKernel[StageSpecDecodeMetadataKey]):
    """Copy a speculative-decode step's metadata into the graph buffers, padding requests made inert (the module
    docstring has the math).

    :param max_num_seqs: requests in a step (domains only).
    :param num_speculative_tokens: draft tokens per step (``> 0``); ``S = 1 +`` this (domains only).
    :param num_state_slots: ``S`` when it is not ``1 + num_speculative_tokens`` (1 under RecoverSSM:
        :func:`warmreg_kimi_k3.recoverssm.state_slots`; domains only).
    """

    name = "kimi_k3.stage_spec_decode_metadata"
    key_type = StageSpecDecodeMetadataKey
    jit = _stage_spec_decode_metadata_kernel

    def __init__(self, *, max_num_seqs: int, num_speculative_tokens: int, num_state_slots: int | None = None) -> None:
        self.max_num_seqs, self.num_speculative_tokens = max_num_seqs, num_speculative_tokens
        self.num_state_slots = 1 + num_speculative_tokens if num_state_slots is None else num_state_slots

    def dispatch(
        self,
        *,
        staged_state_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_accepted_tokens: torch.Tensor,
        launch_pdl: bool,
    ) -> StageSpecDecodeMetadataKey:
        slots = staged_state_indices.shape[1]
        return StageSpecDecodeMetadataKey(
            index_dtype=warmreg.dtype_name(staged_state_indices.dtype),
            qsl_dtype=warmreg.dtype_name(query_start_loc.dtype),
            accepted_dtype=warmreg.dtype_name(num_accepted_tokens.dtype),
            num_state_slots=slots,
            block_state_slots=warmreg.next_pow2(slots),
            null_state_id=NULL_STATE_ID,
            block_rows=BLOCK_ROWS,
            launch_pdl=bool(launch_pdl),
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # The builder's int32 graph buffers: spec_state_indices_tensor [max_bs, S] (S = 1 + spec; under RecoverSSM
        # [max_num_seqs, 1]), query_start_loc, num_accepted_tokens (their lengths are not in the key).
        rows = self.max_num_seqs * (1 + self.num_speculative_tokens)
        return {
            "staged_state_indices": [warmreg.meta((rows, self.num_state_slots), torch.int32)],
            "query_start_loc": [warmreg.meta((rows + 1,), torch.int32)],
            "num_accepted_tokens": [warmreg.meta((rows,), torch.int32)],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: StageSpecDecodeMetadataKey) -> Mapping[str, Any]:
        s, idx = key.num_state_slots, getattr(torch, key.index_dtype)
        qsl, acc = getattr(torch, key.qsl_dtype), getattr(torch, key.accepted_dtype)
        return {
            "state_indices": warmreg.meta((1, s), idx),
            "query_start_loc": warmreg.meta((2,), qsl),
            "num_accepted_tokens": warmreg.meta((1,), acc),
            "staged_state_indices": warmreg.meta((1, s), idx),
            "staged_query_start_loc": warmreg.meta((2,), qsl),
            "staged_num_accepted_tokens": warmreg.meta((1,), acc),
            "num_spec_decodes": 1,
            "launch_pdl": key.launch_pdl,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_accepted_tokens: torch.Tensor,
        staged_state_indices: torch.Tensor,
        staged_query_start_loc: torch.Tensor,
        staged_num_accepted_tokens: torch.Tensor,
        *,
        num_spec_decodes: int,
        launch_pdl: bool | None = None,
    ) -> warmreg.LaunchSpec[StageSpecDecodeMetadataKey]:
        """Write the staged buffers in place; returns them, ``(staged_state_indices, staged_query_start_loc,
        staged_num_accepted_tokens)``. The argument order is vLLM's ``stage_spec_decode_metadata``.

        :param state_indices: ``[n, >= S]``, the real requests' state slots (any strides, e.g. block-table rows).
        :param query_start_loc: ``[n + 1]`` contiguous, the real requests' token offsets.
        :param num_accepted_tokens: ``[n]`` contiguous.
        :param staged_state_indices: ``[B, S]`` (any strides), of ``state_indices``' dtype.
        :param staged_query_start_loc: ``[B + 1]`` contiguous, of ``query_start_loc``'s dtype.
        :param staged_num_accepted_tokens: ``[B]`` contiguous, of ``num_accepted_tokens``' dtype.
        :param num_spec_decodes: ``n``, in ``[0, B]``.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :raises warmreg.LaunchError: for shapes, dtypes, counts or devices the kernel cannot take.
        """
        tensors = (state_indices, query_start_loc, num_accepted_tokens,
                   staged_state_indices, staged_query_start_loc, staged_num_accepted_tokens)  # fmt: skip
        self._check(*tensors, num_spec_decodes)
        launch_pdl = local_pdl(launch_pdl)
        key = self.dispatch(
            staged_state_indices=staged_state_indices, query_start_loc=query_start_loc,
            num_accepted_tokens=num_accepted_tokens, launch_pdl=launch_pdl,
        )  # fmt: skip
        batch = staged_state_indices.shape[0]
        kwargs = dict(
            state_ptr=state_indices, qsl_ptr=query_start_loc, accepted_ptr=num_accepted_tokens,
            staged_state_ptr=staged_state_indices, staged_qsl_ptr=staged_query_start_loc,
            staged_accepted_ptr=staged_num_accepted_tokens,
            state_stride_row=state_indices.stride(0), state_stride_col=state_indices.stride(1),
            staged_stride_row=staged_state_indices.stride(0), staged_stride_col=staged_state_indices.stride(1),
            num_spec_decodes=num_spec_decodes, batch_size=batch,
            NUM_STATE_SLOTS=key.num_state_slots, BLOCK_STATE_SLOTS=key.block_state_slots,
            NULL_STATE_ID=key.null_state_id, BLOCK_ROWS=key.block_rows, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = ((batch + 1 + key.block_rows - 1) // key.block_rows,)
        return warmreg.LaunchSpec(key, grid, kwargs, tensors[3:])

    def _check(
        self,
        state: torch.Tensor,
        qsl: torch.Tensor,
        accepted: torch.Tensor,
        staged_state: torch.Tensor,
        staged_qsl: torch.Tensor,
        staged_accepted: torch.Tensor,
        n: int,
    ) -> None:
        def fail(problem: str) -> None:
            raise warmreg.LaunchError(self.name, problem)

        if staged_state.ndim != 2 or state.ndim != 2:
            fail(
                f"state_indices and staged_state_indices must be 2-D (got {tuple(state.shape)}, {tuple(staged_state.shape)})"
            )
        b, s = staged_state.shape
        if not 0 <= n <= b:
            fail(f"num_spec_decodes ({n}) must be in [0, B = {b}] (B: rows of staged_state_indices)")
        if state.shape[0] < n or state.shape[1] < s:
            fail(f"state_indices {tuple(state.shape)} needs at least {n} rows and S = {s} columns")
        for name, x, rows in (("query_start_loc", qsl, n + 1), ("num_accepted_tokens", accepted, n),
                              ("staged_query_start_loc", staged_qsl, b + 1),
                              ("staged_num_accepted_tokens", staged_accepted, b)):  # fmt: skip
            if x.ndim != 1 or x.shape[0] < rows or (x.shape[0] > 1 and x.stride(0) != 1):
                fail(f"{name} must be a contiguous 1-D tensor of at least {rows} entries (got {tuple(x.shape)})")
        ints = (torch.int32, torch.int64)
        pairs = ((state, staged_state), (qsl, staged_qsl), (accepted, staged_accepted))
        if any(src.dtype not in ints or dst.dtype != src.dtype for src, dst in pairs):
            fail("each source and its staged buffer must share one dtype, int32 or int64 "
                 f"(got {[(str(a.dtype), str(c.dtype)) for a, c in pairs]})")  # fmt: skip
        if len({x.device for pair in pairs for x in pair}) > 1:
            fail("all tensors must be on one device")


def stage_spec_decode_metadata_reference(
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    staged_state_indices: torch.Tensor,
    staged_query_start_loc: torch.Tensor,
    staged_num_accepted_tokens: torch.Tensor,
    *,
    num_spec_decodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`StageSpecDecodeMetadata` (vLLM's "equivalent PyTorch staging" comment in
    ``KimiK3KDAMetadataBuilder.build``), on copies of the staged buffers; returns them."""
    n = num_spec_decodes
    state, qsl, acc = staged_state_indices.clone(), staged_query_start_loc.clone(), staged_num_accepted_tokens.clone()
    b, s = state.shape
    state[:n] = state_indices[:n, :s]
    state[n:] = NULL_STATE_ID
    qsl[: n + 1] = query_start_loc[: n + 1]
    qsl[n + 1 : b + 1] = query_start_loc[n]
    acc[:n] = num_accepted_tokens[:n]
    acc[n:b] = 1
    return state, qsl, acc


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the staging on CUDA when there are KDA layers and ``serving.num_speculative_tokens > 0``, with
    :func:`warmreg_kimi_k3.recoverssm.state_slots` slots a request.

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, a missing ``serving.max_num_seqs`` or an
        invalid ``serving.use_replayssm``.
    """
    layout = kda_layout(m, config)
    if layout is None or layout.num_speculative_tokens <= 0:
        return
    kernel = StageSpecDecodeMetadata(
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
        num_speculative_tokens=layout.num_speculative_tokens,
        num_state_slots=state_slots(config, layout),
    )
    registry.add(kernel, when=warmreg.is_cuda)
