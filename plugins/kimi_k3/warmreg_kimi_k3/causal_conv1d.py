"""Kimi-K3's short causal convolution of q, k and v over a varlen prefill batch, reading and updating the conv state.

The op of ``vllm/model_executor/layers/mamba/ops/causal_conv1d.py: causal_conv1d_fn`` (``_causal_conv1d_fwd_kernel``)
as the KDA layer of ``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward`` calls it whenever a batch
has prefills (``num_prefills > 0``), with every prefill backend (FlashKDA and FlashInfer consume its output too):
three calls per KDA layer and step, one each for q, k and v, each a column slice of the packed projection with
its slice of the float32 conv weight and of the conv state, no bias, ``activation="silu"``, the non-speculative
``query_start_loc`` / ``cache_indices`` / ``has_initial_state`` and the chunk table of the metadata builder
(``compute_causal_conv1d_metadata``: one program per ``BLOCK_M`` = 8 tokens of a sequence).

Math, per sequence ``s`` (tokens ``bos .. eos - 1``, ``L = eos - bos``, width ``W``) and channel ``c``, in fp32::

    line = cache_indices[s];  skip the sequence if line == null_block_id (HAS_NULL_BLOCK)
    h = conv_states[line, c, 0 : W - 1]  if has_initial_state[s]  else zeros(W - 1)      # oldest first
    u = concat(h, x[bos:eos, c])                                                         # W - 1 + L inputs
    y[bos + t, c] = silu(bias[c] + sum_{j < W} weight[c, j] * u[t + j])      for t < L   (bias 0 if None)
    conv_states[line, c, 0 : W - 1] = u[L : L + W - 1]                       # the last W - 1 inputs

``silu(a) = a / (1 + exp(-a))``, the sum in the order ``j = 0, 1, ..`` from ``bias``; ``y`` is cast once to x's
dtype. The state keeps x's dtype (x and the state share one dtype, the model's).

Differences from vLLM's launch, all chosen so that one binary serves every engine layout of this deployment:
the conv state's sequence (page) stride is a specialized integer, not a constexpr (vLLM's value is the KV page
size the engine picks at start-up from the attention page and the cache layout, which no config states); the
output is a fresh ``[T, D]`` tensor (vLLM's ``empty_like`` of the transposed input, the same layout); and
``num_cache_lines`` (vLLM's bound check on the cache line) is not an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from .backends import KDALayout, kda_layout
from .model import PLUGIN, KimiK3
from .recoverssm import state_slots

__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "CausalConv1d",
    "CausalConv1dKey",
    "ConvChunks",
    "causal_conv1d_reference",
    "conv1d_chunks",
    "conv_outputs",
    "conv_state_pool",
    "packed_prefill_conv",
    "projection_row_stride",
    "register",
]

#: Tokens per program (vLLM's ``BLOCK_M``) and channels per program (``BLOCK_N``).
BLOCK_M, BLOCK_N = 8, 256
#: A padding entry of the chunk table (``vllm/v1/attention/backends/utils.py: PAD_SLOT_ID``).
PAD_SLOT_ID = -1
#: The cache line of padded requests (``NULL_BLOCK_ID``): block 0 of the pool is the null block.
NULL_BLOCK_ID = 0
#: Widths the kernel unrolls (Kimi-K3 uses 4).
KERNEL_WIDTHS = (2, 3, 4)
_SCALARS = ["bias_ptr", "cache_indices_ptr", "has_initial_state_ptr", "query_start_loc_ptr", "seq_ids_ptr",
            "chunk_ids_ptr"]  # fmt: skip


# Pointers read one scalar at a time (and the bias, read once a program) cannot vectorize: no alignment keys.
@triton.jit(do_not_specialize_on_alignment=_SCALARS)
def _causal_conv1d_fwd_kernel(
    x_ptr,  # [T, DIM], token stride free (a column slice of the packed projection)
    w_ptr,  # [DIM, W] float32
    bias_ptr,  # [DIM], or None
    state_ptr,  # [lines, DIM, >= W - 1]
    cache_indices_ptr,  # [N] int32
    has_initial_state_ptr,  # [N] bool
    query_start_loc_ptr,  # [N + 1] int32
    seq_ids_ptr,  # [programs] int32: the sequence of each program, PAD_SLOT_ID for padding
    chunk_ids_ptr,  # [programs] int32: the BLOCK_M-token chunk of that sequence
    o_ptr,  # [T, DIM], fresh
    stride_x_token: tl.int64,  # the projection's row stride
    stride_state_seq,  # the engine's page stride: specialized on its class only
    DIM: tl.constexpr,  # channels of one of q, k, v on this rank: a model constant
    STRIDE_X_DIM: tl.constexpr,  # 1: channels are contiguous
    STRIDE_W_DIM: tl.constexpr,  # W: the weight is a [DIM, W] slice of the packed parameter
    STRIDE_W_WIDTH: tl.constexpr,  # 1
    STRIDE_STATE_DIM: tl.constexpr,  # 1 in vLLM's default (state_len, dim) layout
    STRIDE_STATE_TOKEN: tl.constexpr,  # the packed conv dim (3 * DIM) in that layout
    STRIDE_CACHE_INDICES: tl.constexpr,  # the block table's row width, or 1 for a gathered copy
    PAD_SLOT_ID: tl.constexpr,  # the chunk table's padding entry (-1)
    NULL_BLOCK_ID: tl.constexpr,  # the null cache line (0)
    HAS_BIAS: tl.constexpr,  # add the conv bias
    KERNEL_WIDTH: tl.constexpr,  # W: unrolls the taps
    SILU_ACTIVATION: tl.constexpr,  # apply silu
    HAS_NULL_BLOCK: tl.constexpr,  # skip sequences on the null line
    NP2_STATELEN: tl.constexpr,  # next_pow2(W - 1): rows of the state tile
    BLOCK_M: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,  # channels per program
    USE_PDL: tl.constexpr,  # wait on the previous kernel (programmatic dependent launch)
):
    if USE_PDL:
        tl_cuda.gdc_wait()
    pid = tl.program_id(0)
    seq = tl.load(seq_ids_ptr + pid)
    if seq == PAD_SLOT_ID:
        if USE_PDL:
            tl_cuda.gdc_launch_dependents()
        return
    seq = seq.to(tl.int64)
    line = tl.load(cache_indices_ptr + seq * STRIDE_CACHE_INDICES).to(tl.int64)
    if HAS_NULL_BLOCK:
        if line == NULL_BLOCK_ID:
            if USE_PDL:
                tl_cuda.gdc_launch_dependents()
            return
    chunk = tl.load(chunk_ids_ptr + pid).to(tl.int64)
    bos = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seqlen = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - bos
    first = chunk * BLOCK_M
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < DIM
    x_seq = x_ptr + bos * stride_x_token + feats * STRIDE_X_DIM
    s_base = state_ptr + line * stride_state_seq + feats * STRIDE_STATE_DIM
    w_base = w_ptr + feats * STRIDE_W_DIM
    # hist1 is the input one step back, hist2 two, hist3 three (unused taps stay zero and are never added).
    hist1 = tl.zeros([BLOCK_N], tl.float32)
    hist2 = tl.zeros([BLOCK_N], tl.float32)
    hist3 = tl.zeros([BLOCK_N], tl.float32)
    if chunk == 0:
        init = tl.load(has_initial_state_ptr + seq)
        if init:
            hist1 = tl.load(s_base + (KERNEL_WIDTH - 2) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
            if KERNEL_WIDTH >= 3:
                hist2 = tl.load(s_base + (KERNEL_WIDTH - 3) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
            if KERNEL_WIDTH >= 4:
                hist3 = tl.load(s_base + (KERNEL_WIDTH - 4) * STRIDE_STATE_TOKEN, mask=fmask, other=0.0).to(tl.float32)
        # The new state: rows i of concat(old rows, x) at L + i; the old rows are read before any is rewritten.
        rows = tl.arange(0, NP2_STATELEN)
        src = seqlen + rows
        tile = (rows < KERNEL_WIDTH - 1)[:, None] & fmask[None, :]
        from_x = (src >= KERNEL_WIDTH - 1)[:, None]
        new = tl.load(
            x_seq[None, :] + (src - (KERNEL_WIDTH - 1))[:, None] * stride_x_token, mask=tile & from_x, other=0.0
        )
        if init:
            old = tl.load(s_base[None, :] + src[:, None] * STRIDE_STATE_TOKEN, mask=tile & ~from_x, other=0.0)
            new = tl.where(from_x, new, old)
        tl.debug_barrier()  # every thread's loads of the old rows happen before any store to them
        tl.store(s_base[None, :] + rows[:, None] * STRIDE_STATE_TOKEN, new, mask=tile)
    else:
        hist1 = tl.load(x_seq + (first - 1) * stride_x_token, mask=fmask, other=0.0).to(tl.float32)
        if KERNEL_WIDTH >= 3:
            hist2 = tl.load(x_seq + (first - 2) * stride_x_token, mask=fmask, other=0.0).to(tl.float32)
        if KERNEL_WIDTH >= 4:
            hist3 = tl.load(x_seq + (first - 3) * stride_x_token, mask=fmask, other=0.0).to(tl.float32)
    x_tok = x_ptr + (bos + first) * stride_x_token + feats * STRIDE_X_DIM
    o_tok = o_ptr + (bos + first) * DIM + feats
    count = tl.minimum(first + BLOCK_M, seqlen) - first
    conv_outputs(x_tok, o_tok, count, stride_x_token, w_base, bias_ptr, feats, fmask, hist1, hist2, hist3,
                  DIM, STRIDE_W_WIDTH, KERNEL_WIDTH, HAS_BIAS, SILU_ACTIVATION, BLOCK_N, USE_PDL)  # fmt: skip


@triton.jit
def conv_outputs(
    x_tok,  # [BLOCK_N] pointers to the first token's channels
    o_tok,  # [BLOCK_N] pointers to its output row
    count,  # tokens to run
    stride_x_token,
    w_base,  # [BLOCK_N] pointers to the channels' weight rows
    bias_ptr,
    feats,
    fmask,
    hist1,  # the input one step before the first token (fp32), hist2 two, hist3 three
    hist2,
    hist3,
    O_STRIDE: tl.constexpr,  # the output's row stride: its channel count
    STRIDE_W_WIDTH: tl.constexpr,
    KERNEL_WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The taps of both conv kernels: ``count`` outputs from the history and the tokens, oldest tap first."""
    w_cur = tl.load(w_base + (KERNEL_WIDTH - 1) * STRIDE_W_WIDTH, mask=fmask, other=0.0).to(tl.float32)
    w_b1 = tl.load(w_base + (KERNEL_WIDTH - 2) * STRIDE_W_WIDTH, mask=fmask, other=0.0).to(tl.float32)
    w_b2 = tl.zeros([BLOCK_N], tl.float32)
    w_b3 = tl.zeros([BLOCK_N], tl.float32)
    if KERNEL_WIDTH >= 3:
        w_b2 = tl.load(w_base + (KERNEL_WIDTH - 3) * STRIDE_W_WIDTH, mask=fmask, other=0.0).to(tl.float32)
    if KERNEL_WIDTH >= 4:
        w_b3 = tl.load(w_base + (KERNEL_WIDTH - 4) * STRIDE_W_WIDTH, mask=fmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + feats, mask=fmask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], tl.float32)
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()
    # A while loop: Triton 3.6's interpreter cannot take loaded values as range bounds.
    t = count * 0
    while t < count:
        xt = tl.load(x_tok + t * stride_x_token, mask=fmask, other=0.0).to(tl.float32)
        acc = acc0
        if KERNEL_WIDTH >= 4:
            acc += w_b3 * hist3
        if KERNEL_WIDTH >= 3:
            acc += w_b2 * hist2
        acc += w_b1 * hist1
        acc += w_cur * xt
        hist3 = hist2
        hist2 = hist1
        hist1 = xt
        if SILU_ACTIVATION:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(o_tok + t * O_STRIDE, acc.to(o_tok.dtype.element_ty), mask=fmask)
        t += 1


@attrs.frozen(kw_only=True)
class CausalConv1dKey(warmreg.CompileKey):
    """What changes the binary of the prefill conv1d."""

    dtype: str  # x, the conv state and the output
    weight_dtype: str
    bias_dtype: str | None  # None: HAS_BIAS off
    dim: int  # DIM
    stride_x_dim: int
    stride_x_token: warmreg.IntClass  # tl.int64, still specialized on 1 / 16
    stride_w_dim: int
    stride_w_width: int
    stride_state_seq: warmreg.IntClass
    stride_state_dim: int
    stride_state_token: int
    stride_cache_indices: int
    pad_slot_id: int
    null_block_id: int | None  # None: HAS_NULL_BLOCK off
    kernel_width: int
    silu: bool
    np2_statelen: int
    block_m: int
    block_n: int
    x_aligned: bool  # q, k, v are column slices of one projection
    w_aligned: bool  # their weights are row slices of one parameter
    state_aligned: bool  # and their states channel slices of one conv state
    num_warps: int
    num_stages: int  # 2, as vLLM launches it
    launch_pdl: bool  # USE_PDL and the launch option (SM >= 90)


@attrs.frozen
class ConvChunks:
    """The chunk table of one prefill batch: program ``p`` runs tokens ``chunk_ids[p] * BLOCK_M ..`` of sequence
    ``seq_ids[p]`` (``PAD_SLOT_ID``: a padding program). Build it with :func:`conv1d_chunks`, once per batch
    for the three calls of every layer (vLLM's ``compute_causal_conv1d_metadata``)."""

    seq_ids: torch.Tensor
    chunk_ids: torch.Tensor
    num_programs: int


def conv1d_chunks(query_start_loc: torch.Tensor | list[int], *, device: torch.device | str | None = None) -> ConvChunks:
    """The chunk table of a batch from its token offsets (host values: pass the CPU copy to avoid a sync).

    :param query_start_loc: ``[N + 1]`` token offsets of the N sequences.
    :param device: where the table goes (default: where ``query_start_loc`` is).
    """
    offsets = query_start_loc.tolist() if isinstance(query_start_loc, torch.Tensor) else list(query_start_loc)
    if device is None:
        device = query_start_loc.device if isinstance(query_start_loc, torch.Tensor) else "cpu"
    seq_ids: list[int] = []
    chunk_ids: list[int] = []
    for s in range(len(offsets) - 1):
        n = -(-(offsets[s + 1] - offsets[s]) // BLOCK_M)
        seq_ids += [s] * n
        chunk_ids += range(n)
    return ConvChunks(
        torch.tensor(seq_ids or [PAD_SLOT_ID], dtype=torch.int32, device=device),
        torch.tensor(chunk_ids or [0], dtype=torch.int32, device=device),
        len(seq_ids),
    )


def projection_row_stride(layout: KDALayout) -> int:
    """Row stride of the KDA layer's packed ``in_proj_qkvgfab`` output on one rank: q, k, v, g (``4 * P``), the
    gate's low-rank ``f_a`` (head_dim), beta (heads), padded to 16 elements
    (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention.__init__``; 128 under ModelOpt FP8_PB_WO
    quantization, which no config here describes)."""
    width = 4 * layout.projection_size + layout.head_dim + layout.num_heads
    return width + (-width % 16)


def conv_state_pool(layout: KDALayout, lines: int, dtype: torch.dtype) -> torch.Tensor:
    """The conv state of one KDA layer as the kernels see it: ``[lines, 3 * P, W - 1 + spec]`` (vLLM's default
    (state_len, dim) layout, transposed by the layer), each line at the start of a KV page whose stride is the
    unpadded KDA page (conv state plus the float32 recurrent state,
    ``MambaStateShapeCalculator.kda_state_shape``) in elements of ``dtype``."""
    conv_dim, rows = 3 * layout.projection_size, layout.conv_width - 1 + layout.num_speculative_tokens
    elem = torch.empty((), dtype=dtype).element_size()
    page = rows * conv_dim + -(-layout.num_heads * layout.head_dim**2 * 4 // elem)
    return warmreg.meta((lines, conv_dim, rows), dtype, stride=(page, 1, conv_dim))


class CausalConv1d(warmreg.TritonKernel[CausalConv1dKey]):
    """The prefill conv1d of one deployment; the layout shapes :meth:`domains` only.

    :param layout: the KDA layout (:func:`warmreg_kimi_k3.backends.kda_layout`).
    :param max_num_seqs: the most sequences in a step (the cache-index tensors' length in the domains).
    :param state_slots: the width of the KDA group's block-table rows (:func:`warmreg_kimi_k3.recoverssm.state_slots`:
        ``1 + spec``, or 1 under RecoverSSM; default ``1 + spec``).
    """

    name = "kimi_k3.causal_conv1d"
    key_type = CausalConv1dKey
    jit = _causal_conv1d_fwd_kernel

    def __init__(self, *, layout: KDALayout, max_num_seqs: int = 1, state_slots: int | None = None) -> None:
        self.layout = layout
        self.max_num_seqs = max_num_seqs
        self.state_slots = 1 + layout.num_speculative_tokens if state_slots is None else state_slots

    def dispatch(
        self,
        *,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        cache_indices: torch.Tensor,
        activation: str | None,
        pad_slot_id: int,
        null_block_id: int | None,
        launch_pdl: bool,
    ) -> CausalConv1dKey:
        width = weight.shape[1]
        return CausalConv1dKey(
            dtype=warmreg.dtype_name(x.dtype), weight_dtype=warmreg.dtype_name(weight.dtype),
            bias_dtype=None if bias is None else warmreg.dtype_name(bias.dtype), dim=x.shape[1],
            stride_x_dim=x.stride(1), stride_x_token=warmreg.int_class(x.stride(0)),
            stride_w_dim=weight.stride(0), stride_w_width=weight.stride(1),
            stride_state_seq=warmreg.int_class(conv_states.stride(0)), stride_state_dim=conv_states.stride(1),
            stride_state_token=conv_states.stride(2), stride_cache_indices=cache_indices.stride(0),
            pad_slot_id=pad_slot_id, null_block_id=null_block_id, kernel_width=width,
            silu=activation in ("silu", "swish"), np2_statelen=warmreg.next_pow2(width - 1), block_m=BLOCK_M,
            block_n=BLOCK_N, x_aligned=warmreg.is_aligned(x), w_aligned=warmreg.is_aligned(weight),
            state_aligned=warmreg.is_aligned(conv_states), num_warps=4, num_stages=2, launch_pdl=bool(launch_pdl),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """q, k and v of every prefill batch: column slices of the packed projection (row stride
        :func:`projection_row_stride`), or of the gathered ``[T, 3P]`` copy of a batch that mixes prefills with
        speculative rows (``index_select``), starting at row 0 or later (``mixed_qkv[non_spec_slice]``); the cache
        indices are ``block_table[:, 0]`` (stride :attr:`state_slots`, the Mamba group's block-table width:
        ``1 + num_speculative_tokens``, or 1 under RecoverSSM) or, in a mixed speculative batch, a gathered copy
        (stride 1)."""
        lay, n = self.layout, self.max_num_seqs
        dt = getattr(torch, lay.dtype)
        p, tokens = lay.projection_size, 2
        widths = {projection_row_stride(lay)} | ({3 * p} if lay.num_speculative_tokens else set())
        index_strides = {1, self.state_slots}
        state = conv_state_pool(lay, n + 1, dt)
        weight = warmreg.meta((3 * p, lay.conv_width), torch.float32)
        points = []
        for width in sorted(widths):
            for row in (0, 1) if lay.num_speculative_tokens else (0,):
                proj = warmreg.meta((tokens + row, width), dt)[row:]
                for c in range(3):
                    for s in sorted(index_strides):
                        points.append({
                            "x": proj[:, c * p : (c + 1) * p], "weight": weight[c * p : (c + 1) * p],
                            "bias": None, "conv_states": state[:, c * p : (c + 1) * p],
                            "cache_indices": warmreg.meta((n, s), torch.int32)[:, 0], "activation": "silu",
                            "pad_slot_id": PAD_SLOT_ID, "null_block_id": NULL_BLOCK_ID,
                            "launch_pdl": platform.supports_pdl,
                        })  # fmt: skip
        return points

    def warmup_inputs(self, key: CausalConv1dKey) -> Mapping[str, Any]:
        dt, d, w = getattr(torch, key.dtype), key.dim, key.kernel_width
        rows = w - 1
        state_stride = (warmreg.int_class_rep(key.stride_state_seq), key.stride_state_dim, key.stride_state_token)
        return {
            "x": warmreg.meta((2, d), dt, stride=(warmreg.int_class_rep(key.stride_x_token), key.stride_x_dim),
                              offset=0 if key.x_aligned else 1),
            "weight": warmreg.meta((d, w), getattr(torch, key.weight_dtype), stride=(key.stride_w_dim, key.stride_w_width),
                                   offset=0 if key.w_aligned else 1),
            "bias": None if key.bias_dtype is None else warmreg.meta((d,), getattr(torch, key.bias_dtype)),
            "conv_states": warmreg.meta((1, d, rows), dt, stride=state_stride, offset=0 if key.state_aligned else 1),
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "cache_indices": warmreg.meta((1,), torch.int32, stride=(key.stride_cache_indices,)),
            "has_initial_state": warmreg.meta((1,), torch.bool),
            "chunks": ConvChunks(warmreg.meta((1,), torch.int32), warmreg.meta((1,), torch.int32), 1),
            "activation": "silu" if key.silu else None,
            "pad_slot_id": key.pad_slot_id,
            "null_block_id": key.null_block_id,
            "launch_pdl": key.launch_pdl,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        query_start_loc: torch.Tensor,
        cache_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        *,
        chunks: ConvChunks | None = None,
        activation: str | None = "silu",
        pad_slot_id: int = PAD_SLOT_ID,
        null_block_id: int | None = NULL_BLOCK_ID,
        launch_pdl: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[CausalConv1dKey]:
        """Convolve each sequence of a varlen batch and update its conv state; returns the ``[T, D]`` output
        (``out``, or a fresh tensor).

        Rows of sequences on the null line are left unwritten (as in vLLM). The math is in the module docstring.

        :param x: ``[T, D]``, channels contiguous, token stride free (vLLM passes the transpose, ``[D, T]``).
        :param weight: ``[D, W]``, ``W`` in (2, 3, 4), any float dtype (float32 in Kimi-K3).
        :param bias: ``[D]`` contiguous, or None.
        :param conv_states: ``[lines, D, >= W - 1]`` in x's dtype, updated in place; strides free.
        :param query_start_loc: int32 ``[N + 1]``.
        :param cache_indices: int32 ``[N]``, each sequence's line; stride free.
        :param has_initial_state: bool ``[N]``: whether the line holds the sequence's history.
        :param chunks: the batch's chunk table (:func:`conv1d_chunks`); built here from ``query_start_loc`` (a
            device-to-host copy) when omitted.
        :param activation: ``"silu"`` (or ``"swish"``) or None.
        :param pad_slot_id: the chunk table's padding entry.
        :param null_block_id: the null line (sequences on it are skipped), or None for none.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated output, contiguous ``[T, D]`` of x's dtype (then nothing is allocated; rows of
            null-line sequences keep what they held).
        :raises LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out`` that is
            not the output's shape, dtype and layout.
        """
        self._check(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)
        if launch_pdl is None:
            local = warmreg.runtime_platform()
            launch_pdl = bool(local and local.supports_pdl)
        key = self.dispatch(
            x=x, weight=weight, bias=bias, conv_states=conv_states, cache_indices=cache_indices,
            activation=activation, pad_slot_id=pad_slot_id, null_block_id=null_block_id, launch_pdl=launch_pdl,
        )  # fmt: skip
        if chunks is None:
            chunks = conv1d_chunks(query_start_loc)
        out = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)
        kwargs = dict(
            x_ptr=x, w_ptr=weight, bias_ptr=bias, state_ptr=conv_states, cache_indices_ptr=cache_indices,
            has_initial_state_ptr=has_initial_state, query_start_loc_ptr=query_start_loc,
            seq_ids_ptr=chunks.seq_ids, chunk_ids_ptr=chunks.chunk_ids, o_ptr=out,
            stride_x_token=x.stride(0), stride_state_seq=conv_states.stride(0),
            DIM=key.dim, STRIDE_X_DIM=key.stride_x_dim, STRIDE_W_DIM=key.stride_w_dim,
            STRIDE_W_WIDTH=key.stride_w_width, STRIDE_STATE_DIM=key.stride_state_dim,
            STRIDE_STATE_TOKEN=key.stride_state_token, STRIDE_CACHE_INDICES=key.stride_cache_indices,
            PAD_SLOT_ID=key.pad_slot_id, NULL_BLOCK_ID=0 if key.null_block_id is None else key.null_block_id,
            HAS_BIAS=key.bias_dtype is not None, KERNEL_WIDTH=key.kernel_width, SILU_ACTIVATION=key.silu,
            HAS_NULL_BLOCK=key.null_block_id is not None, NP2_STATELEN=key.np2_statelen, BLOCK_M=key.block_m,
            BLOCK_N=key.block_n, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        feature_blocks = (key.dim + key.block_n - 1) // key.block_n
        grid = (chunks.num_programs, feature_blocks) if chunks.num_programs and x.shape[0] else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        query_start_loc: torch.Tensor,
        cache_indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        activation: str | None,
    ) -> None:
        check_conv_inputs(self.name, x, weight, bias, conv_states, activation)
        n = query_start_loc.shape[0] - 1 if query_start_loc.ndim == 1 else -1
        if n < 0 or query_start_loc.dtype != torch.int32:
            fail(
                self.name,
                f"query_start_loc must be int32 [N + 1] (got {query_start_loc.dtype} {tuple(query_start_loc.shape)})",
            )
        if cache_indices.shape != (n,) or cache_indices.dtype != torch.int32:
            fail(
                self.name,
                f"cache_indices must be int32 [N] = [{n}] (got {cache_indices.dtype} {tuple(cache_indices.shape)})",
            )
        if has_initial_state.shape != (n,) or has_initial_state.dtype != torch.bool:
            fail(
                self.name,
                f"has_initial_state must be bool [N] = [{n}] (got {has_initial_state.dtype} {tuple(has_initial_state.shape)})",
            )
        same_device(self.name, x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state)


def fail(kernel: str, problem: str, fix: str | None = None) -> NoReturn:
    """Raise the launcher's LaunchError."""
    raise warmreg.LaunchError(kernel, problem, fix=fix)


def check_conv_inputs(
    kernel: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    activation: str | None,
) -> None:
    """The checks both conv1d launchers share: x ``[T, D]`` with contiguous channels, weight ``[D, W]``, bias
    ``[D]``, a ``[lines, D, rows]`` state in x's dtype, a known activation.

    :raises warmreg.LaunchError: naming the argument.
    """
    if x.ndim != 2 or x.stride(1) != 1:
        fail(kernel, f"x must be [T, D] with contiguous channels (got {tuple(x.shape)}, strides {x.stride()})",
             fix="pass the token-major slice of the projection (vLLM's causal_conv1d_fn takes its transpose)")  # fmt: skip
    d = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != d or weight.shape[1] not in KERNEL_WIDTHS:
        fail(kernel, f"weight must be [D, W] = [{d}, W] with W in {KERNEL_WIDTHS} (got {tuple(weight.shape)})")
    if bias is not None and (bias.shape != (d,) or bias.stride(0) != 1):
        fail(kernel, f"bias must be [D] = [{d}] contiguous or None (got {tuple(bias.shape)})")
    if conv_states.ndim != 3 or conv_states.shape[1] != d or conv_states.shape[2] < weight.shape[1] - 1:
        fail(
            kernel,
            f"conv_states must be [lines, D, >= W - 1] = [*, {d}, >= {weight.shape[1] - 1}] (got {tuple(conv_states.shape)})",
        )
    if conv_states.dtype != x.dtype:
        fail(kernel, f"conv_states must have x's dtype {x.dtype} (got {conv_states.dtype})")
    if activation not in (None, "silu", "swish"):
        fail(kernel, f"activation must be 'silu', 'swish' or None (got {activation!r})")


def same_device(kernel: str, *tensors: torch.Tensor | None) -> None:
    """:raises warmreg.LaunchError: unless every given tensor is on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        fail(kernel, f"all inputs must be on one device (got {sorted(map(str, devices))})")


def conv_window(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """``y[:, t] = act(bias + sum_j weight[:, j] * window[:, t + j])`` in fp32, the taps added oldest first.

    :param window: ``[D, W - 1 + L]`` fp32 inputs, history first.
    :returns: ``[L, D]`` fp32.
    """
    width, steps = weight.shape[1], window.shape[1] - weight.shape[1] + 1
    acc = (
        torch.zeros((window.shape[0], steps), dtype=torch.float32)
        if bias is None
        else bias.float()[:, None].repeat(1, steps)
    )
    w = weight.float()
    for j in range(width):
        acc = acc + w[:, j : j + 1] * window[:, j : j + steps]
    if silu:
        acc = acc / (1.0 + torch.exp(-acc))
    return acc.T


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    activation: str | None = "silu",
    null_block_id: int | None = NULL_BLOCK_ID,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's math.

    :returns: ``(y, states)``: ``y`` ``[T, D]`` in x's dtype (zeros in the rows of skipped sequences) and a copy of
        ``conv_states`` with the new states; the input is not modified.
    """
    width = weight.shape[1]
    states = conv_states.clone()
    y = torch.zeros(x.shape, dtype=torch.float32)
    bounds = query_start_loc.tolist()
    for s, line in enumerate(cache_indices.tolist()):
        if null_block_id is not None and line == null_block_id:
            continue
        bos, eos = bounds[s], bounds[s + 1]
        hist = (
            states[line, :, : width - 1].float()
            if bool(has_initial_state[s])
            else x.new_zeros((x.shape[1], width - 1), dtype=torch.float32)
        )
        window = torch.cat([hist, x[bos:eos].float().T], dim=1)
        y[bos:eos] = conv_window(window, weight, bias, activation in ("silu", "swish"))
        states[line, :, : width - 1] = window[:, eos - bos :].to(states.dtype)
    return y.to(x.dtype), states


def packed_prefill_conv(layout: KDALayout) -> bool:
    """Whether vLLM 0.34's CUDA layer convolves the prefill rows with the packed conv
    (:mod:`warmreg_kimi_k3.packed_causal_conv1d`) instead of this op: ``packed_causal_conv1d_supported`` in
    ``KimiK3DeltaAttention._forward`` asks for an fp32 conv state and fp32 weights (Kimi-K3's conv weights are
    always fp32), width 4 and ``P % 64 == 0`` (bf16, fp16 or fp32 activations). The conv state has the model dtype
    (``mamba_cache_dtype`` ``auto``, assumed throughout this plugin), so that is ``serving.dtype`` float32."""
    return layout.dtype == "float32" and layout.conv_width == 4 and layout.projection_size % 64 == 0


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the prefill conv1d on CUDA for a deployment with KDA layers: every prefill backend runs it
    (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward``, ``num_prefills > 0``), unless vLLM
    0.34 runs the packed conv instead (:func:`packed_prefill_conv`).

    ROCm's Kimi-K3 layer (``vllm/models/kimi_k3/amd/kda.py``) launches the same op unless aiter's fused split-qkv
    conv replaces it; its projection padding and that switch are not modelled here, so it is not planned there.
    """
    layout = kda_layout(m, config)
    if layout is None or packed_prefill_conv(layout):
        return
    kernel = CausalConv1d(layout=layout, max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
                          state_slots=state_slots(config, layout))  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
