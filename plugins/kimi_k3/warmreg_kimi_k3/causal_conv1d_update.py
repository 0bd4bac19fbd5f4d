"""Kimi-K3's short causal convolution for decode and speculative decode: one step on the packed q/k/v channels.

The op of ``vllm/model_executor/layers/mamba/ops/causal_conv1d.py: causal_conv1d_update``
(``_causal_conv1d_update_kernel``) as ``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward`` calls it
on all ``3 * P`` packed channels at once, with the packed float32 weight, no bias and ``activation="silu"``:

* **plain decode** (a batch with decodes only, the decode backend resolved to ``"triton"``): ``x`` ``[B, 3P]``
  (a row slice of the projection), one token per sequence, ``conv_state_indices = non_spec_state_indices[:B]``;
* **speculative decode** (every step with speculative rows, unless FlashInfer's packed kernel takes a batch of
  speculative rows alone): varlen ``x`` ``[T, 3P]`` with ``query_start_loc``, ``max_query_len = 1 + spec``,
  ``num_accepted_tokens`` and ``conv_state_indices = spec_state_indices[:, 0]`` (also the RecoverSSM verify's
  Triton path, ``_recoverssm_verify``, with ``max_query_len = spec_query_len`` and the builder's one-column
  ``spec_state_indices``: the same key but for the index stride, 1; :func:`warmreg_kimi_k3.recoverssm.state_slots`).

Math, per sequence ``s`` and channel ``c`` (width ``W``), in fp32::

    line = conv_state_indices[s];  skip if line == null_block_id (HAS_NULL_BLOCK)
    tokens: x[s] (plain decode, L = 1), or x[bos:eos] with L = eos - bos (varlen; L = 0: skip)
    off = num_accepted_tokens[s] - 1  if speculative  else 0
    u = concat(state[line, c, off : off + W - 1], x[tokens, c])              # W - 1 + L inputs
    y[token t, c] = silu(bias[c] + sum_{j < W} weight[c, j] * u[t + j])      # as the prefill op
    plain decode:  state[line, c, 0 : W - 1] = u[1 : W]                      # the last W - 1 inputs
    speculative:   state[line, c, 0 : W - 2 + L] = u[1 : W - 1 + L]          # history minus its oldest, drafts

So a speculative step leaves ``[h_off+1 .. h_off+W-2, draft_1 .. draft_L]`` in the state, and the next step, with
``a`` tokens accepted, starts its history at row ``a - 1``: the ``W - 1`` inputs before the first unaccepted one.

Differences from vLLM's launch, so that one binary serves every engine layout of this deployment: the conv
state's page stride is a specialized integer (vLLM: a constexpr the engine's KV layout decides); the output is a
fresh ``[rows, 3P]`` tensor (vLLM's ``empty_like`` of x, whose row stride is x's own for a batch of one and ``3P``
otherwise, two binaries); ``batch`` and ``num_cache_lines`` are not arguments (the grid carries the batch). Varlen
launches are speculative ones (the only varlen call of Kimi-K3), and x is 2-D.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from .backends import KDALayout, kda_decode_backend, kda_layout
from .causal_conv1d import (
    BLOCK_N,
    NULL_BLOCK_ID,
    check_conv_inputs,
    conv_outputs,
    conv_state_pool,
    conv_window,
    fail,
    projection_row_stride,
    same_device,
)
from .model import PLUGIN, KimiK3, positive_text_int
from .recoverssm import state_slots

__all__ = ["CausalConv1dUpdate", "CausalConv1dUpdateKey", "causal_conv1d_update_reference", "overlap_rows", "register"]

#: The projection-overlap path's packed q/k/v/g row (``4 * P``) exists for this local layout only
#: (``vllm/models/kimi_k3/nvidia/low_latency_gemm.py: _enable_kda_projection_overlap``): TP 8, hidden 7168, a
#: 6288-wide packed projection, on the SMs with a low-latency GEMM table.
_OVERLAP_TP, _OVERLAP_HIDDEN, _OVERLAP_ROW, _OVERLAP_SMS = 8, 7168, 6288, (90, 100, 103)
_SCALARS = ["bias_ptr", "state_indices_ptr", "num_accepted_ptr", "query_start_loc_ptr"]


# Pointers read one scalar at a time (and the bias, read once a program) cannot vectorize: no alignment keys.
@triton.jit(do_not_specialize_on_alignment=_SCALARS)
def _causal_conv1d_update_kernel(
    x_ptr,  # [B, DIM] or varlen [T, DIM], channels contiguous
    w_ptr,  # [DIM, W] float32
    bias_ptr,  # [DIM], or None
    state_ptr,  # [lines, DIM, >= STATE_LEN]
    state_indices_ptr,  # [B] int32
    num_accepted_ptr,  # [B] int32 (speculative), else unused
    query_start_loc_ptr,  # [B + 1] int32 (varlen), else unused
    o_ptr,  # like x, fresh and contiguous
    stride_x_token: tl.int64,  # the row stride of a varlen x (1 otherwise: one token per sequence)
    stride_state_seq,  # the engine's page stride: specialized on its class only
    DIM: tl.constexpr,  # the packed q/k/v channels on this rank: a model constant
    SEQLEN: tl.constexpr,  # tokens a sequence may have: 1, or 1 + spec (max_query_len)
    STATE_LEN: tl.constexpr,  # rows the step rewrites at SEQLEN tokens: W - 1 (+ SEQLEN - 1 speculative)
    STRIDE_X_SEQ: tl.constexpr,  # the projection's row stride for one-token rows (0 when varlen)
    STRIDE_X_DIM: tl.constexpr,  # 1
    STRIDE_W_DIM: tl.constexpr,  # W
    STRIDE_W_WIDTH: tl.constexpr,  # 1
    STRIDE_STATE_DIM: tl.constexpr,  # 1 in vLLM's default (state_len, dim) layout
    STRIDE_STATE_TOKEN: tl.constexpr,  # DIM in that layout
    STRIDE_STATE_INDICES: tl.constexpr,  # the block table's row width, or 1 for a staged copy
    NULL_BLOCK_ID: tl.constexpr,  # the null cache line (0)
    HAS_BIAS: tl.constexpr,
    KERNEL_WIDTH: tl.constexpr,  # W: unrolls the taps
    SILU_ACTIVATION: tl.constexpr,
    IS_VARLEN: tl.constexpr,  # tokens from query_start_loc
    IS_SPEC_DECODING: tl.constexpr,  # history from row num_accepted - 1, the state slides by one
    NP2_STATELEN: tl.constexpr,  # next_pow2(STATE_LEN): rows of the state tile
    HAS_NULL_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # channels per program
    USE_PDL: tl.constexpr,  # programmatic dependent launch
):
    if USE_PDL:
        tl_cuda.gdc_wait()
    seq = tl.program_id(0).to(tl.int64)
    line = tl.load(state_indices_ptr + seq * STRIDE_STATE_INDICES).to(tl.int64)
    if HAS_NULL_BLOCK:
        if line == NULL_BLOCK_ID:
            if USE_PDL:
                tl_cuda.gdc_launch_dependents()
            return
    if IS_VARLEN:
        bos = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        n = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - bos
        x_seq = x_ptr + bos * stride_x_token
    else:
        bos = seq
        n = bos * 0 + SEQLEN  # a tensor, as in the varlen branch
        x_seq = x_ptr + seq * STRIDE_X_SEQ
    if n == 0:
        if USE_PDL:
            tl_cuda.gdc_launch_dependents()
        return
    state_len = STATE_LEN - (SEQLEN - n)  # rows rewritten at n tokens
    if IS_SPEC_DECODING:
        off = tl.load(num_accepted_ptr + seq).to(tl.int64) - 1
    else:
        off = bos * 0
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < DIM
    x_seq = x_seq + feats * STRIDE_X_DIM
    s_base = state_ptr + line * stride_state_seq + feats * STRIDE_STATE_DIM
    h_base = s_base + off * STRIDE_STATE_TOKEN
    hist1 = tl.load(h_base + (KERNEL_WIDTH - 2) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
    hist2 = tl.zeros([BLOCK_N], tl.float32)
    hist3 = tl.zeros([BLOCK_N], tl.float32)
    if KERNEL_WIDTH >= 3:
        hist2 = tl.load(h_base + (KERNEL_WIDTH - 3) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
    if KERNEL_WIDTH >= 4:
        hist3 = tl.load(h_base + (KERNEL_WIDTH - 4) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
    # New rows i < keep come from the old state (shifted by 1 speculative, by n otherwise), the rest from x.
    rows = tl.arange(0, NP2_STATELEN)
    keep = state_len - n
    tile = (rows < state_len)[:, None] & fmask[None, :]
    old_row = (rows < keep)[:, None]
    if IS_SPEC_DECODING:
        shift = n * 0 + 1
    else:
        shift = n
    old = tl.load(h_base[None, :] + (rows + shift)[:, None] * STRIDE_STATE_TOKEN, mask=tile & old_row, other=0.0)
    new = tl.load(x_seq[None, :] + (rows - keep)[:, None] * stride_x_token, mask=tile & ~old_row, other=0.0)
    new = tl.where(old_row, old, new)
    tl.debug_barrier()  # every thread's loads of the old rows happen before any store to them
    tl.store(s_base[None, :] + rows[:, None] * STRIDE_STATE_TOKEN, new, mask=tile)
    conv_outputs(x_seq, o_ptr + bos * DIM + feats, n, stride_x_token, w_ptr + feats * STRIDE_W_DIM, bias_ptr, feats,
                  fmask, hist1, hist2, hist3, DIM, STRIDE_W_WIDTH, KERNEL_WIDTH, HAS_BIAS, SILU_ACTIVATION, BLOCK_N,
                  USE_PDL)  # fmt: skip


@attrs.frozen(kw_only=True)
class CausalConv1dUpdateKey(warmreg.CompileKey):
    """What changes the binary of the decode / speculative-decode conv1d."""

    dtype: str  # x, the conv state and the output
    weight_dtype: str
    bias_dtype: str | None  # None: HAS_BIAS off
    dim: int
    seqlen: int  # SEQLEN: 1, or max_query_len
    state_len: int  # STATE_LEN
    np2_statelen: int
    stride_x_seq: int  # the projection's row stride (plain decode), 0 varlen
    stride_x_dim: int
    stride_x_token: warmreg.IntClass  # varlen: the row stride's class; plain decode: 1
    stride_w_dim: int
    stride_w_width: int
    stride_state_seq: warmreg.IntClass
    stride_state_dim: int
    stride_state_token: int
    stride_state_indices: int
    null_block_id: int | None  # None: HAS_NULL_BLOCK off
    kernel_width: int
    silu: bool
    is_varlen: bool
    is_spec_decoding: bool
    block_n: int
    x_aligned: bool  # x may start at a later row of the projection (a mixed batch's speculative slice)
    w_aligned: bool
    state_aligned: bool
    num_warps: int
    launch_pdl: bool


class CausalConv1dUpdate(warmreg.TritonKernel[CausalConv1dUpdateKey]):
    """The decode / speculative-decode conv1d of one deployment; the configuration shapes :meth:`domains` only.

    :param layout: the KDA layout (:func:`warmreg_kimi_k3.backends.kda_layout`).
    :param plain_decode: whether plain decode steps run it (the decode backend resolved to ``"triton"``).
    :param overlap_rows: whether decode steps may see the projection-overlap path's ``[T, 4P]`` rows.
    :param max_num_seqs: the most sequences in a step.
    :param state_slots: the width of the KDA group's block-table rows (:func:`warmreg_kimi_k3.recoverssm.state_slots`:
        ``1 + spec``, or 1 under RecoverSSM; default ``1 + spec``).
    """

    name = "kimi_k3.causal_conv1d_update"
    key_type = CausalConv1dUpdateKey
    jit = _causal_conv1d_update_kernel

    def __init__(
        self,
        *,
        layout: KDALayout,
        plain_decode: bool,
        overlap_rows: bool = False,
        max_num_seqs: int = 1,
        state_slots: int | None = None,
    ) -> None:
        self.layout, self.plain_decode, self.overlap_rows = layout, plain_decode, overlap_rows
        self.max_num_seqs = max_num_seqs
        self.state_slots = 1 + layout.num_speculative_tokens if state_slots is None else state_slots

    def dispatch(
        self,
        *,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        conv_state_indices: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None,
        query_start_loc: torch.Tensor | None,
        max_query_len: int,
        activation: str | None,
        null_block_id: int | None,
        launch_pdl: bool,
    ) -> CausalConv1dUpdateKey:
        width, varlen, spec = weight.shape[1], query_start_loc is not None, num_accepted_tokens is not None
        seqlen = max_query_len if varlen else 1
        state_len = width - 1 + (seqlen - 1 if spec else 0)
        return CausalConv1dUpdateKey(
            dtype=warmreg.dtype_name(x.dtype), weight_dtype=warmreg.dtype_name(weight.dtype),
            bias_dtype=None if bias is None else warmreg.dtype_name(bias.dtype), dim=x.shape[1], seqlen=seqlen,
            state_len=state_len, np2_statelen=warmreg.next_pow2(state_len),
            stride_x_seq=0 if varlen else x.stride(0), stride_x_dim=x.stride(1),
            stride_x_token=warmreg.int_class(x.stride(0) if varlen else 1), stride_w_dim=weight.stride(0),
            stride_w_width=weight.stride(1), stride_state_seq=warmreg.int_class(conv_state.stride(0)),
            stride_state_dim=conv_state.stride(1), stride_state_token=conv_state.stride(2),
            stride_state_indices=conv_state_indices.stride(0), null_block_id=null_block_id, kernel_width=width,
            silu=activation in ("silu", "swish"), is_varlen=varlen, is_spec_decoding=spec, block_n=BLOCK_N,
            x_aligned=warmreg.is_aligned(x), w_aligned=warmreg.is_aligned(weight),
            state_aligned=warmreg.is_aligned(conv_state), num_warps=4, launch_pdl=bool(launch_pdl),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """Speculative steps (``spec > 0``): varlen x as the projection's rows (from row 0, or later in a batch that
        mixes prefills), or their gathered ``[T, 3P]`` copy; state indices ``spec_state_indices[:, 0]``, whose row is
        :attr:`state_slots` wide in every case (block table, staged copy, gathered rows: ``1 + spec``, or 1 under
        RecoverSSM). Plain decode (when planned): x the projection's rows (or the ``4P`` rows of the
        projection-overlap path), indices ``block_table[:, 0]`` (stride :attr:`state_slots`) or the staged
        CUDA-graph copy (stride 1)."""
        lay, n, slots = self.layout, self.max_num_seqs, self.state_slots
        dt, conv_dim, spec = getattr(torch, lay.dtype), 3 * lay.projection_size, lay.num_speculative_tokens
        row = projection_row_stride(lay)
        common = {"weight": warmreg.meta((conv_dim, lay.conv_width), torch.float32), "bias": None,
                  "conv_state": conv_state_pool(lay, n + 1, dt), "activation": "silu",
                  "null_block_id": NULL_BLOCK_ID, "launch_pdl": platform.supports_pdl}  # fmt: skip
        points = []
        if spec:
            qsl, accepted = warmreg.meta((n + 1,), torch.int32), warmreg.meta((n,), torch.int32)
            indices = warmreg.meta((n, slots), torch.int32)[:, 0]
            for width, first in ((row, 0), (row, 1), (conv_dim, 0)):
                x = warmreg.meta((first + 2, width), dt)[first:, :conv_dim]
                points.append({**common, "x": x, "conv_state_indices": indices, "num_accepted_tokens": accepted,
                               "query_start_loc": qsl, "max_query_len": 1 + spec})  # fmt: skip
        if self.plain_decode:
            for width in (row, 4 * lay.projection_size) if self.overlap_rows else (row,):
                for stride in sorted({1, slots}):
                    points.append({**common, "x": warmreg.meta((n, width), dt)[:, :conv_dim],
                                   "conv_state_indices": warmreg.meta((n, stride), torch.int32)[:, 0],
                                   "num_accepted_tokens": None, "query_start_loc": None, "max_query_len": -1})  # fmt: skip
        return points

    def warmup_inputs(self, key: CausalConv1dUpdateKey) -> Mapping[str, Any]:
        dt, d, w = getattr(torch, key.dtype), key.dim, key.kernel_width
        x_row = warmreg.int_class_rep(key.stride_x_token) if key.is_varlen else key.stride_x_seq
        rows = 2 if key.is_varlen else 1
        state_stride = (warmreg.int_class_rep(key.stride_state_seq), key.stride_state_dim, key.stride_state_token)
        return {
            "x": warmreg.meta((rows, d), dt, stride=(x_row, key.stride_x_dim), offset=0 if key.x_aligned else 1),
            "weight": warmreg.meta((d, w), getattr(torch, key.weight_dtype), stride=(key.stride_w_dim, key.stride_w_width),
                                   offset=0 if key.w_aligned else 1),
            "bias": None if key.bias_dtype is None else warmreg.meta((d,), getattr(torch, key.bias_dtype)),
            "conv_state": warmreg.meta((1, d, key.state_len), dt, stride=state_stride, offset=0 if key.state_aligned else 1),
            "conv_state_indices": warmreg.meta((1,), torch.int32, stride=(key.stride_state_indices,)),
            "num_accepted_tokens": warmreg.meta((1,), torch.int32) if key.is_spec_decoding else None,
            "query_start_loc": warmreg.meta((2,), torch.int32) if key.is_varlen else None,
            "max_query_len": key.seqlen if key.is_varlen else -1,
            "activation": "silu" if key.silu else None,
            "null_block_id": key.null_block_id,
            "launch_pdl": key.launch_pdl,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = "silu",
        conv_state_indices: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        max_query_len: int = -1,
        null_block_id: int | None = NULL_BLOCK_ID,
        *,
        launch_pdl: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[CausalConv1dUpdateKey]:
        """One conv step of each sequence, updating its conv state; returns the output shaped like ``x``
        (``out``, or a fresh tensor).

        The arguments follow vLLM's ``causal_conv1d_update``; the math is in the module docstring. Rows of
        sequences on the null line are left unwritten.

        :param x: ``[B, D]`` (one token per sequence) or, with ``query_start_loc``, ``[T, D]``; channels contiguous.
        :param conv_state: ``[lines, D, >= STATE_LEN]`` in x's dtype, updated in place; strides free.
        :param weight: ``[D, W]``, ``W`` in (2, 3, 4).
        :param bias: ``[D]`` contiguous, or None.
        :param activation: ``"silu"`` (or ``"swish"``) or None.
        :param conv_state_indices: int32 ``[B]``, each sequence's line (required); stride free.
        :param num_accepted_tokens: int32 ``[B]`` for a speculative step (needs ``query_start_loc``), else None.
        :param query_start_loc: int32 ``[B + 1]`` for a speculative step, else None.
        :param max_query_len: the most tokens a sequence of the step may have (``1 + spec``), with ``query_start_loc``.
        :param null_block_id: the null line, or None for none.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated output, contiguous, x's shape and dtype (then nothing is allocated; rows of
            null-line sequences keep what they held).
        :raises LaunchError: for shapes, dtypes, layouts, combinations or devices the kernel cannot take, or an
            ``out`` that is not the output's shape, dtype and layout.
        """
        indices = self._check(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                              query_start_loc, max_query_len)  # fmt: skip
        if launch_pdl is None:
            local = warmreg.runtime_platform()
            launch_pdl = bool(local and local.supports_pdl)
        key = self.dispatch(
            x=x, weight=weight, bias=bias, conv_state=conv_state, conv_state_indices=indices,
            num_accepted_tokens=num_accepted_tokens, query_start_loc=query_start_loc, max_query_len=max_query_len,
            activation=activation, null_block_id=null_block_id, launch_pdl=launch_pdl,
        )  # fmt: skip
        out = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)
        kwargs = dict(
            x_ptr=x, w_ptr=weight, bias_ptr=bias, state_ptr=conv_state, state_indices_ptr=indices,
            num_accepted_ptr=indices if num_accepted_tokens is None else num_accepted_tokens,
            query_start_loc_ptr=indices if query_start_loc is None else query_start_loc, o_ptr=out,
            stride_x_token=x.stride(0) if key.is_varlen else 1, stride_state_seq=conv_state.stride(0),
            DIM=key.dim, SEQLEN=key.seqlen, STATE_LEN=key.state_len, STRIDE_X_SEQ=key.stride_x_seq,
            STRIDE_X_DIM=key.stride_x_dim, STRIDE_W_DIM=key.stride_w_dim, STRIDE_W_WIDTH=key.stride_w_width,
            STRIDE_STATE_DIM=key.stride_state_dim, STRIDE_STATE_TOKEN=key.stride_state_token,
            STRIDE_STATE_INDICES=key.stride_state_indices,
            NULL_BLOCK_ID=0 if key.null_block_id is None else key.null_block_id, HAS_BIAS=key.bias_dtype is not None,
            KERNEL_WIDTH=key.kernel_width, SILU_ACTIVATION=key.silu, IS_VARLEN=key.is_varlen,
            IS_SPEC_DECODING=key.is_spec_decoding, NP2_STATELEN=key.np2_statelen,
            HAS_NULL_BLOCK=key.null_block_id is not None, BLOCK_N=key.block_n, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        batch = indices.shape[0]
        grid = (batch, (key.dim + key.block_n - 1) // key.block_n) if batch else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
        indices: torch.Tensor | None,
        accepted: torch.Tensor | None,
        qsl: torch.Tensor | None,
        max_query_len: int,
    ) -> torch.Tensor:
        check_conv_inputs(self.name, x, weight, bias, conv_state, activation)
        if indices is None or indices.ndim != 1 or indices.dtype != torch.int32:
            fail(self.name, "conv_state_indices must be int32 [B]", fix="pass each sequence's cache line")
        b = indices.shape[0]
        if (accepted is None) != (qsl is None):
            fail(self.name, "num_accepted_tokens and query_start_loc go together (a speculative step) or not at all")
        if qsl is None or accepted is None:
            if x.shape[0] != b:
                fail(
                    self.name,
                    f"x must have one row per sequence ([{b}, D]) without query_start_loc (got {tuple(x.shape)})",
                )
            rows = weight.shape[1] - 1
        else:
            if (
                qsl.shape != (b + 1,)
                or qsl.dtype != torch.int32
                or accepted.shape != (b,)
                or accepted.dtype != torch.int32
            ):
                fail(self.name, f"query_start_loc and num_accepted_tokens must be int32 [B + 1] and [B] with B = {b}")
            if max_query_len < 1:
                fail(self.name, f"max_query_len must be >= 1 with query_start_loc (got {max_query_len})")
            rows = weight.shape[1] - 2 + max_query_len
        if conv_state.shape[2] < rows:
            fail(self.name, f"conv_state needs >= {rows} rows a line for this step (got {conv_state.shape[2]})")
        same_device(self.name, x, conv_state, weight, bias, indices, accepted, qsl)
        return indices


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_indices: torch.Tensor,
    *,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    activation: str | None = "silu",
    null_block_id: int | None = NULL_BLOCK_ID,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's math.

    :returns: ``(y, state)``: ``y`` shaped like x in x's dtype (zeros for skipped sequences) and a copy of
        ``conv_state`` with the new rows; the input is not modified.
    """
    width = weight.shape[1]
    state = conv_state.clone()
    y = torch.zeros(x.shape, dtype=torch.float32)
    bounds = query_start_loc.tolist() if query_start_loc is not None else list(range(x.shape[0] + 1))
    for s, line in enumerate(conv_state_indices.tolist()):
        bos, eos = bounds[s], bounds[s + 1]
        if (null_block_id is not None and line == null_block_id) or eos == bos:
            continue
        off = int(num_accepted_tokens[s]) - 1 if num_accepted_tokens is not None else 0
        window = torch.cat([state[line, :, off : off + width - 1].float(), x[bos:eos].float().T], dim=1)
        y[bos:eos] = conv_window(window, weight, bias, activation in ("silu", "swish"))
        kept = window[:, 1:] if num_accepted_tokens is not None else window[:, eos - bos :]
        state[line, :, : kept.shape[1]] = kept.to(state.dtype)
    return y.to(x.dtype), state


def overlap_rows(layout: KDALayout, config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether vLLM's projection-overlap path can feed decode steps (``low_latency_gemm.py``): TP 8, bf16, hidden
    7168, the 6288-wide packed projection, SM 9.0 / 10.0 / 10.3 (unquantized weights assumed: no config here
    describes a quantization)."""
    return (
        layout.tensor_parallel_size == _OVERLAP_TP and layout.dtype == "bfloat16"
        and projection_row_stride(layout) == _OVERLAP_ROW and platform.is_cuda and platform.sm in _OVERLAP_SMS
        and positive_text_int(config, "hidden_size") == _OVERLAP_HIDDEN
    )  # fmt: skip


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the conv update on CUDA where the deployment launches it: speculative decoding
    (``num_speculative_tokens > 0``: every batch with speculative rows and prefills, and with any backend), and
    plain decode when :func:`warmreg_kimi_k3.backends.kda_decode_backend` is ``"triton"`` (native and FlashInfer
    fuse the conv; with speculation vLLM resolves every decode backend to Triton, and its plain-decode steps, e.g.
    one-token prompt chunks with prior state, run this kernel). Under RecoverSSM the verify runs it on the
    speculative rows (``KimiK3DeltaAttention._recoverssm_verify``) and every state-index column is one slot wide
    (:func:`warmreg_kimi_k3.recoverssm.state_slots`). Not planned on ROCm (see
    :func:`warmreg_kimi_k3.causal_conv1d.register`).

    :raises warmreg.ConfigError: for an unknown or refused ``serving.kda_decode_backend``, or an invalid
        ``serving.use_replayssm``.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return
    plain = kda_decode_backend(m, config, platform) == "triton"
    if not (plain or layout.num_speculative_tokens):
        return
    kernel = CausalConv1dUpdate(
        layout=layout, plain_decode=plain, overlap_rows=plain and overlap_rows(layout, config, platform),
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN), state_slots=state_slots(config, layout),
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
