"""Kimi-K3's prefill short convolution of q, k and v in one launch over the packed projection (vLLM 0.34
``models/kimi_k3/nvidia/ops/kda_conv.py``: ``packed_causal_conv1d_fn``, ``_packed_causal_conv1d_fwd_kernel``).

The math of :mod:`warmreg_kimi_k3.causal_conv1d` (width 4, fp32), for all ``D = parts * P`` channels of the
packed ``[T, D]`` q|k|v columns at once, with an fp32 conv state and fp32 weights; per sequence ``s`` (tokens
``bos .. eos - 1``, ``L = eos - bos``) and channel ``c``::

    line = cache_indices[s];  skip the sequence if line == null_block_id (HAS_NULL_BLOCK)
    h = conv_states[line, c, 0:3]  if has_initial_state[s]  else zeros(3)               # oldest first
    u = concat(h, x[bos:eos, c])                                                        # fp32
    a = fma(u[t+3], w[c,3], fma(u[t+2], w[c,2], fma(u[t+1], w[c,1], fma(u[t], w[c,0], bias[c]))))
    out[c // P, bos + t, c % P] = silu(a)  for t < L          (bias 0 if None; silu(a) = a / (1 + exp(-a)))
    conv_states[line, c, 0:3] = u[L : L + 3]                 # the last 3 inputs; columns past 3 untouched

``out`` is ``[parts, T, P]`` in x's dtype, plane ``i`` the dense output of channels ``i * P ..``: the layout of
vLLM's three stock calls. The taps are explicit fused multiply-adds, oldest first, as in vLLM (the stock kernel's
contracted ``acc += w * x`` on a GPU): outputs and states are bit-identical to the stock conv.

Programs: ``(cdiv(T, 64) + N) * D / BLOCK_N``, channel blocks fastest. Sequence ``s`` owns the programs from
``g(s) = (query_start_loc[s] - query_start_loc[0]) // 64 + s`` (at least ``cdiv(L, 64)`` of them); a program finds
its sequence by a radix-32 search over ``g`` (one level up to 32 sequences, two up to 1024, ...), runs 64 tokens
of it in ``8``-token tiles and, for the first 64 tokens, reads the old state and writes the new one. No host
table: the grid depends on ``T`` and ``N`` only (CUDA-graph safe), as in vLLM.

Where it runs: ``KimiK3DeltaAttention._forward`` (``models/kimi_k3/nvidia/kda.py``), for the prefill rows of
a step, instead of three ``causal_conv1d_fn`` calls when ``packed_causal_conv1d_supported``: CUDA tensors, an
fp32 conv state and fp32 weights (Kimi-K3's are always fp32), width 4, ``P % 64 == 0``. The conv state is in the
model dtype (``mamba_cache_dtype`` ``auto``, which warmreg assumes), so vLLM 0.34 takes it exactly for
``serving.dtype`` float32; the plan then holds this op and not ``kimi_k3.causal_conv1d``
(:func:`warmreg_kimi_k3.causal_conv1d.packed_prefill_conv`). ROCm's and XPU's layers never call it.

Key: the dtypes, ``P`` and the number of parts, the weight and state strides other than the page (constexprs),
the integer classes of x's row stride and the state's page stride, bias / null block / silu, the tiles
(``BLOCK_N`` 128 when it divides ``P``, else 64; one warp), and the alignment of x, weight and state. vLLM
specializes every integer argument; here the sequence count, the search steps, the cache-index stride and the
output's plane stride are runtime integers that are not specialized, so one binary serves every batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import KDALayout, kda_layout
from .causal_conv1d import (
    NULL_BLOCK_ID,
    causal_conv1d_reference,
    conv_state_pool,
    packed_prefill_conv,
    projection_row_stride,
)
from .model import PLUGIN, KimiK3

__all__ = [
    "BLOCK_M",
    "NUM_BLOCKS",
    "PackedCausalConv1d",
    "PackedCausalConv1dKey",
    "packed_causal_conv1d_reference",
    "register",
]

#: Tokens per tile and tiles per program (64 tokens a program, vLLM's chunk).
BLOCK_M, NUM_BLOCKS = 8, 8
#: Taps of the kernel (vLLM's packed conv is width 4 only).
WIDTH = 4
_RUNTIME = ["num_seqs", "search_levels", "search_stride", "stride_cache_indices", "stride_out_part"]
_SCALARS = ["bias_ptr", "cache_indices_ptr", "has_initial_state_ptr", "query_start_loc_ptr"]


@triton.jit
def _tap(x_seq, s_base, pos, live, init, stride_x_token, STRIDE_STATE_TOKEN: tl.constexpr):
    """Inputs ``u`` at sequence positions ``pos`` ([BLOCK_M]) as fp32 ``[BLOCK_M, BLOCK_N]``: x rows, or for
    ``pos < 0`` the old state's column ``3 + pos`` (zeros without an initial state)."""
    in_x = (live & (pos >= 0))[:, None]
    from_x = tl.load(x_seq[None, :] + pos.to(tl.int64)[:, None] * stride_x_token, mask=in_x, other=0.0)
    in_state = tl.where(init, (live & (pos < 0))[:, None], False)
    old = tl.load(s_base[None, :] + (3 + pos)[:, None] * STRIDE_STATE_TOKEN, mask=in_state, other=0.0)
    return tl.where(in_x, from_x.to(tl.float32), old.to(tl.float32))


@triton.jit(do_not_specialize=_RUNTIME, do_not_specialize_on_alignment=_SCALARS)
def _packed_causal_conv1d_kernel(
    x_ptr,  # [T, PARTS * PART_DIM], channels contiguous
    w_ptr,  # [PARTS * PART_DIM, 4] float32
    bias_ptr,  # [PARTS * PART_DIM], or None
    state_ptr,  # [lines, PARTS * PART_DIM, >= 3] float32
    cache_indices_ptr,  # [N]
    has_initial_state_ptr,  # [N] bool
    query_start_loc_ptr,  # [N + 1]
    out_ptr,  # [PARTS, T, PART_DIM], contiguous
    num_seqs,
    search_levels,  # radix-32 levels: 32 ** levels >= N
    search_stride,  # 32 ** (levels - 1), or 1
    stride_cache_indices,
    stride_out_part,  # T * PART_DIM
    stride_x_token: tl.int64,  # the projection's row stride: specialized on its class
    stride_state_seq,  # the engine's page stride: specialized on its class
    PART_DIM: tl.constexpr,  # P: channels of each of q, k, v on this rank
    NUM_COL_BLOCKS: tl.constexpr,  # PARTS * PART_DIM / BLOCK_N
    STRIDE_W_DIM: tl.constexpr,  # 4: the weight is the packed [D, 4] parameter
    STRIDE_W_WIDTH: tl.constexpr,  # 1
    STRIDE_STATE_DIM: tl.constexpr,  # 1 in vLLM's default (state_len, dim) layout
    STRIDE_STATE_TOKEN: tl.constexpr,  # D in that layout
    HAS_BIAS: tl.constexpr,  # add the conv bias
    HAS_NULL_BLOCK: tl.constexpr,  # skip sequences on the null line
    NULL_BLOCK_ID: tl.constexpr,  # that line (0)
    SILU_ACTIVATION: tl.constexpr,  # apply silu
    BLOCK_M: tl.constexpr,  # tokens per tile
    NUM_BLOCKS: tl.constexpr,  # tiles per program
    BLOCK_N: tl.constexpr,  # channels per program; divides PART_DIM
):
    CHUNK: tl.constexpr = BLOCK_M * NUM_BLOCKS
    prog = tl.program_id(0) // NUM_COL_BLOCKS
    col0 = (tl.program_id(0) % NUM_COL_BLOCKS) * BLOCK_N
    # The last sequence s whose first program g(s) is <= prog, 32 candidates a level.
    qsl0 = tl.load(query_start_loc_ptr)
    seq = prog * 0
    step = search_stride
    for _ in range(search_levels):
        cand = seq + tl.arange(0, 32) * step
        ok = cand < num_seqs
        first_prog = (tl.load(query_start_loc_ptr + cand, mask=ok, other=0) - qsl0) // CHUNK + cand
        seq += (tl.sum((ok & (first_prog <= prog)).to(tl.int32), axis=0) - 1) * step
        step = step // 32
    bos = tl.load(query_start_loc_ptr + seq)
    chunk = prog - ((bos - qsl0) // CHUNK + seq)
    seqlen = tl.load(query_start_loc_ptr + seq + 1) - bos
    if chunk * CHUNK >= seqlen:  # a spare program (or an empty sequence)
        return
    line = tl.load(cache_indices_ptr + seq.to(tl.int64) * stride_cache_indices).to(tl.int64)
    if HAS_NULL_BLOCK:
        if line == NULL_BLOCK_ID:
            return
    init = tl.load(has_initial_state_ptr + seq) != 0
    feats = col0 + tl.arange(0, BLOCK_N)
    bos64 = bos.to(tl.int64)
    x_seq = x_ptr + bos64 * stride_x_token + feats
    s_base = state_ptr + line * stride_state_seq + feats * STRIDE_STATE_DIM
    part = col0 // PART_DIM
    o_seq = out_ptr + part.to(tl.int64) * stride_out_part + bos64 * PART_DIM + (col0 - part * PART_DIM)
    o_seq = o_seq + tl.arange(0, BLOCK_N)
    w0 = tl.load(w_ptr + feats * STRIDE_W_DIM).to(tl.float32)
    w1 = tl.load(w_ptr + feats * STRIDE_W_DIM + STRIDE_W_WIDTH).to(tl.float32)
    w2 = tl.load(w_ptr + feats * STRIDE_W_DIM + 2 * STRIDE_W_WIDTH).to(tl.float32)
    w3 = tl.load(w_ptr + feats * STRIDE_W_DIM + 3 * STRIDE_W_WIDTH).to(tl.float32)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + feats).to(tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N], tl.float32)
    end = tl.minimum(seqlen, (chunk + 1) * CHUNK)
    r0 = chunk * CHUNK
    while r0 < end:  # a while loop: the interpreter takes no loaded values as range bounds
        rows = r0 + tl.arange(0, BLOCK_M)
        live = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + acc0[None, :]
        acc = tl.fma(_tap(x_seq, s_base, rows - 3, live, init, stride_x_token, STRIDE_STATE_TOKEN), w0[None, :], acc)
        acc = tl.fma(_tap(x_seq, s_base, rows - 2, live, init, stride_x_token, STRIDE_STATE_TOKEN), w1[None, :], acc)
        acc = tl.fma(_tap(x_seq, s_base, rows - 1, live, init, stride_x_token, STRIDE_STATE_TOKEN), w2[None, :], acc)
        acc = tl.fma(_tap(x_seq, s_base, rows, live, init, stride_x_token, STRIDE_STATE_TOKEN), w3[None, :], acc)
        if SILU_ACTIVATION:
            acc = acc / (1 + tl.exp(-acc))
        dst = o_seq[None, :] + rows.to(tl.int64)[:, None] * PART_DIM
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=live[:, None])
        r0 += BLOCK_M
    if chunk == 0:
        # The new state, rows j < 3: input L - 3 + j, or before the sequence the old column j + L.
        j = tl.arange(0, 4)
        new = _tap(x_seq, s_base, seqlen - 3 + j, j < 3, init, stride_x_token, STRIDE_STATE_TOKEN)
        tl.debug_barrier()  # every thread's reads of the old columns happen before any store to them
        tl.store(s_base[None, :] + j[:, None] * STRIDE_STATE_TOKEN, new, mask=(j < 3)[:, None])


@attrs.frozen(kw_only=True)
class PackedCausalConv1dKey(warmreg.CompileKey):
    """What changes the binary of the packed prefill conv."""

    dtype: str  # x and the output
    weight_dtype: str
    state_dtype: str
    bias_dtype: str | None  # None: HAS_BIAS off
    part_dim: int
    num_parts: int
    stride_x_token: warmreg.IntClass
    stride_w_dim: int
    stride_w_width: int
    stride_state_seq: warmreg.IntClass
    stride_state_dim: int
    stride_state_token: int
    null_block_id: int | None  # None: HAS_NULL_BLOCK off
    silu: bool
    block_m: int
    num_blocks: int
    block_n: int
    x_aligned: bool
    w_aligned: bool
    state_aligned: bool
    num_warps: int


class PackedCausalConv1d(warmreg.TritonKernel[PackedCausalConv1dKey]):
    """The packed prefill conv of one deployment (the module docstring has the math); the layout shapes
    :meth:`domains` only.

    :param layout: the KDA layout (:func:`warmreg_kimi_k3.backends.kda_layout`).
    :param max_num_seqs: the most sequences in a step (the cache-index tensors' length in the domains).
    """

    name = "kimi_k3.packed_causal_conv1d"
    key_type = PackedCausalConv1dKey
    jit = _packed_causal_conv1d_kernel

    def __init__(self, *, layout: KDALayout, max_num_seqs: int = 1) -> None:
        self.layout, self.max_num_seqs = layout, max_num_seqs

    def dispatch(
        self,
        *,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_states: torch.Tensor,
        part_dim: int,
        activation: str | None,
        null_block_id: int | None,
    ) -> PackedCausalConv1dKey:
        return PackedCausalConv1dKey(
            dtype=warmreg.dtype_name(x.dtype), weight_dtype=warmreg.dtype_name(weight.dtype),
            state_dtype=warmreg.dtype_name(conv_states.dtype),
            bias_dtype=None if bias is None else warmreg.dtype_name(bias.dtype),
            part_dim=part_dim, num_parts=x.shape[1] // part_dim, stride_x_token=warmreg.int_class(x.stride(0)),
            stride_w_dim=weight.stride(0), stride_w_width=weight.stride(1),
            stride_state_seq=warmreg.int_class(conv_states.stride(0)), stride_state_dim=conv_states.stride(1),
            stride_state_token=conv_states.stride(2), null_block_id=null_block_id,
            silu=activation in ("silu", "swish"), block_m=BLOCK_M, num_blocks=NUM_BLOCKS,
            block_n=128 if part_dim % 128 == 0 else 64, x_aligned=warmreg.is_aligned(x),
            w_aligned=warmreg.is_aligned(weight), state_aligned=warmreg.is_aligned(conv_states), num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """The layer's ``mixed_qkv_ns``: the projection's first ``3P`` columns (row stride
        :func:`~warmreg_kimi_k3.causal_conv1d.projection_row_stride`), from row 0 or later, or under speculation
        the gathered ``[T, 3P]`` copy of a batch mixing prefills with speculative rows; the packed fp32 weight
        ``[3P, 4]`` and the whole conv state."""
        lay = self.layout
        p, dt = lay.projection_size, getattr(torch, lay.dtype)
        widths = {projection_row_stride(lay)} | ({3 * p} if lay.num_speculative_tokens else set())
        state = conv_state_pool(lay, self.max_num_seqs + 1, torch.float32)
        points = []
        for width in sorted(widths):
            for row in (0, 1) if lay.num_speculative_tokens else (0,):
                points.append({
                    "x": warmreg.meta((2 + row, width), dt)[row:, : 3 * p],
                    "weight": warmreg.meta((3 * p, lay.conv_width), torch.float32), "bias": None,
                    "conv_states": state, "part_dim": p, "activation": "silu", "null_block_id": NULL_BLOCK_ID,
                })  # fmt: skip
        return points

    def warmup_inputs(self, key: PackedCausalConv1dKey) -> Mapping[str, Any]:
        d = key.part_dim * key.num_parts
        state_stride = (warmreg.int_class_rep(key.stride_state_seq), key.stride_state_dim, key.stride_state_token)
        return {
            "x": warmreg.meta((2, d), getattr(torch, key.dtype), stride=(warmreg.int_class_rep(key.stride_x_token), 1),
                              offset=0 if key.x_aligned else 1),
            "weight": warmreg.meta((d, WIDTH), getattr(torch, key.weight_dtype),
                                   stride=(key.stride_w_dim, key.stride_w_width), offset=0 if key.w_aligned else 1),
            "bias": None if key.bias_dtype is None else warmreg.meta((d,), getattr(torch, key.bias_dtype)),
            "conv_states": warmreg.meta((1, d, WIDTH - 1), getattr(torch, key.state_dtype), stride=state_stride,
                                        offset=0 if key.state_aligned else 1),
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "cache_indices": warmreg.meta((1,), torch.int32),
            "has_initial_state": warmreg.meta((1,), torch.bool),
            "part_dim": key.part_dim,
            "activation": "silu" if key.silu else None,
            "null_block_id": key.null_block_id,
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
        part_dim: int,
        activation: str | None = "silu",
        null_block_id: int | None = NULL_BLOCK_ID,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[PackedCausalConv1dKey]:
        """Convolve each sequence of a varlen batch over all ``D`` channels and update its conv state; returns
        ``[D // part_dim, T, part_dim]`` (``out``, or a fresh tensor). vLLM's ``packed_causal_conv1d_fn``
        arguments, in its order. Rows of sequences on the null line are left unwritten, as in vLLM.

        :param x: ``[T, D]`` bf16, fp16 or fp32, channels contiguous, any row stride.
        :param weight: float32 ``[D, 4]``, any strides.
        :param bias: ``[D]`` contiguous, or None.
        :param conv_states: float32 ``[lines, D, >= 3]``, updated in place (columns ``0..2``); strides free.
        :param query_start_loc: int32 ``[N + 1]`` contiguous: the sequences' rows of ``x``.
        :param cache_indices: int32 or int64 ``[N]``, each sequence's line; stride free.
        :param has_initial_state: bool ``[N]``: whether the line holds the sequence's history.
        :param part_dim: channels per output plane (``P``); a multiple of 64 that divides ``D``.
        :param activation: ``"silu"`` (or ``"swish"``) or None.
        :param null_block_id: the null line (sequences on it are skipped), or None for none.
        :param out: a preallocated output, contiguous ``[D // part_dim, T, part_dim]`` of x's dtype.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take (vLLM's
            ``packed_causal_conv1d_supported``), or an ``out`` that is not the output's shape, dtype and layout.
        """
        self._check(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, part_dim)
        if activation not in (None, "silu", "swish"):
            raise warmreg.LaunchError(self.name, f"activation must be 'silu', 'swish' or None (got {activation!r})")
        key = self.dispatch(
            x=x, weight=weight, bias=bias, conv_states=conv_states, part_dim=part_dim, activation=activation,
            null_block_id=null_block_id,
        )  # fmt: skip
        tokens, dim = x.shape
        seqs = query_start_loc.shape[0] - 1
        out = warmreg.output(self.name, "out", out, (dim // part_dim, tokens, part_dim), x.dtype, x.device)
        levels = 0
        while 32**levels < seqs:
            levels += 1
        col_blocks = dim // key.block_n
        kwargs = dict(
            x_ptr=x, w_ptr=weight, bias_ptr=bias, state_ptr=conv_states, cache_indices_ptr=cache_indices,
            has_initial_state_ptr=has_initial_state, query_start_loc_ptr=query_start_loc, out_ptr=out,
            num_seqs=seqs, search_levels=levels, search_stride=32 ** max(levels - 1, 0),
            stride_cache_indices=cache_indices.stride(0), stride_out_part=tokens * part_dim,
            stride_x_token=x.stride(0), stride_state_seq=conv_states.stride(0), PART_DIM=part_dim,
            NUM_COL_BLOCKS=col_blocks, STRIDE_W_DIM=key.stride_w_dim, STRIDE_W_WIDTH=key.stride_w_width,
            STRIDE_STATE_DIM=key.stride_state_dim, STRIDE_STATE_TOKEN=key.stride_state_token,
            HAS_BIAS=key.bias_dtype is not None, HAS_NULL_BLOCK=key.null_block_id is not None,
            NULL_BLOCK_ID=0 if key.null_block_id is None else key.null_block_id, SILU_ACTIVATION=key.silu,
            BLOCK_M=key.block_m, NUM_BLOCKS=key.num_blocks, BLOCK_N=key.block_n,
        )  # fmt: skip
        chunk = key.block_m * key.num_blocks
        grid = (((tokens + chunk - 1) // chunk + seqs) * col_blocks,) if tokens and seqs else None
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
        part_dim: int,
    ) -> None:
        def fail(problem: str) -> None:
            raise warmreg.LaunchError(self.name, problem)

        floats = (torch.bfloat16, torch.float16, torch.float32)
        if x.ndim != 2 or x.stride(1) != 1 or x.dtype not in floats:
            fail(f"x must be bf16, fp16 or fp32 [T, D] with contiguous channels (got {x.dtype} {tuple(x.shape)}, "
                 f"strides {x.stride()})")  # fmt: skip
        d = x.shape[1]
        if part_dim <= 0 or part_dim % 64 or d % part_dim:
            fail(f"part_dim ({part_dim}) must be a positive multiple of 64 dividing D = {d}")
        if weight.shape != (d, WIDTH) or weight.dtype != torch.float32:
            fail(f"weight must be float32 [D, 4] = [{d}, 4] (got {weight.dtype} {tuple(weight.shape)})")
        if bias is not None and (bias.shape != (d,) or bias.stride(0) != 1):
            fail(f"bias must be [D] = [{d}] contiguous or None (got {tuple(bias.shape)})")
        if conv_states.ndim != 3 or conv_states.shape[1] != d or conv_states.shape[2] < WIDTH - 1:
            fail(f"conv_states must be [lines, D, >= 3] = [*, {d}, >= 3] (got {tuple(conv_states.shape)})")
        if conv_states.dtype != torch.float32:
            fail(f"conv_states must be float32 (got {conv_states.dtype}): vLLM runs the stock conv otherwise")
        n = query_start_loc.shape[0] - 1 if query_start_loc.ndim == 1 else -1
        if n < 0 or query_start_loc.dtype != torch.int32 or (n > 0 and query_start_loc.stride(0) != 1):
            fail(f"query_start_loc must be contiguous int32 [N + 1] (got {query_start_loc.dtype} "
                 f"{tuple(query_start_loc.shape)})")  # fmt: skip
        if cache_indices.shape != (n,) or cache_indices.dtype not in (torch.int32, torch.int64):
            fail(f"cache_indices must be int32 or int64 [N] = [{n}] (got {cache_indices.dtype} "
                 f"{tuple(cache_indices.shape)})")  # fmt: skip
        if (
            has_initial_state.shape != (n,)
            or has_initial_state.dtype != torch.bool
            or (n > 1 and has_initial_state.stride(0) != 1)
        ):
            fail(f"has_initial_state must be contiguous bool [N] = [{n}] (got {has_initial_state.dtype} "
                 f"{tuple(has_initial_state.shape)})")  # fmt: skip
        tensors = (x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state)
        devices = {t.device for t in tensors if t is not None}
        if len(devices) > 1:
            fail(f"all inputs must be on one device (got {sorted(map(str, devices))})")


def packed_causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    part_dim: int,
    activation: str | None = "silu",
    null_block_id: int | None = NULL_BLOCK_ID,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`PackedCausalConv1d`: the stock conv's reference over all channels, its output
    split into planes. Empty sequences are left out (no program runs them: their lines keep their state).

    :returns: ``(out, states)``: ``out`` ``[D // part_dim, T, part_dim]`` in x's dtype (zeros in the rows of skipped
        sequences) and a copy of ``conv_states`` with the new states; the inputs are not modified.
    """
    keep = query_start_loc[1:] > query_start_loc[:-1]
    y, states = causal_conv1d_reference(
        x, weight, bias, conv_states, torch.cat([query_start_loc[:1], query_start_loc[1:][keep]]),
        cache_indices[keep], has_initial_state[keep], activation=activation, null_block_id=null_block_id,
    )  # fmt: skip
    return y.view(x.shape[0], -1, part_dim).transpose(0, 1).contiguous(), states


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the packed prefill conv on CUDA where vLLM 0.34 takes it for the KDA layers
    (:func:`~warmreg_kimi_k3.causal_conv1d.packed_prefill_conv`).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None or not packed_prefill_conv(layout):
        return
    kernel = PackedCausalConv1d(layout=layout, max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN))
    registry.add(kernel, when=warmreg.is_cuda)
