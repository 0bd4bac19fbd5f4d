"""Kimi Delta Attention (KDA): the recurrent step of speculative decode, gate fused in, in vLLM's convention.

The op of ``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py: fused_recurrent_kda`` (its default
``fuse_gate=True``: ``fused_recurrent_kda_fwd`` launches ``fused_recurrent_kda_fwd_kernel`` with
``USE_GATE_IN_KERNEL`` and ``APPLY_BETA_SIGMOID``), which ``vllm/models/kimi_k3/nvidia/kda.py:
KimiK3DeltaAttention._forward`` calls for the speculative-decode rows of a step (spec-decode backend ``"native"``,
RecoverSSM off: with it the layer runs ``_recoverssm_verify`` instead) right after ``causal_conv1d_update`` wrote
their q/k/v. vLLM's NVIDIA layer launches it nowhere else: plain decode runs ``fused_recurrent_kda_packed_decode``
(:mod:`warmreg_kimi_k3.kda_packed_decode`) or a fused C++/FlashInfer decode, prefill the chunked kernels (vLLM's
own warmup says so: "fused_recurrent_kda_fwd_kernel is only used by speculative decode"). The call it replaces,
with the same arguments::

    core_attn_out_spec, _ = fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound,
        initial_state=recurrent_state, cu_seqlens=spec_cu_seqlens, ssm_state_indices=spec_state_indices_tensor,
        num_accepted_tokens=num_accepted_tokens, out=spec_out)
    o = kda_recurrent(...same arguments...)          # warmreg: returns o; the pool is updated in place alike

Math, per sequence ``n`` (tokens ``bos = cu_seqlens[n] .. eos = cu_seqlens[n + 1] - 1``) and head ``h``, the state
``S`` ``[V, K]`` in fp32, ``scale = K ** -0.5``, every input cast to fp32::

    c0 = num_accepted_tokens[n] - 1 if num_accepted_tokens is given else 0
    first = ssm_state_indices[n, c0]                  # 1-D indices: ssm_state_indices[n]
    if first <= 0: o[bos .. eos - 1] = 0, and nothing is read or written      # slot 0 is vLLM's null block
    S = initial_state[first, h]
    for i, t in enumerate(bos .. eos - 1):
        x = raw_g[t, h] + dt_bias[h * K : (h + 1) * K]            # dt_bias optional
        g = lower_bound * sigmoid(exp(A_log[h]) * x)              # with a lower bound, else
            -exp(A_log[h]) * softplus(x)                          # softplus(x) = x above 20
        q = q[t, h] / sqrt(sum(q[t, h] ** 2) + 1e-6) * scale;  k = k[t, h] / sqrt(sum(k[t, h] ** 2) + 1e-6)
        S = S * exp(g)[None, :]                                   # channel-wise decay along K
        u = (v[t, h] - S k) * sigmoid(raw_beta[t, h])             # the delta rule
        S = S + u k^T
        o[t, h] = cast(S q, dtype of out)
        if ssm_state_indices[n, i] > 0: initial_state[ssm_state_indices[n, i], h] = S    # every token's state

Layouts, as vLLM passes them: q, k ``[1, T, H, K]`` and v ``[1, T, H, V]`` are column slices of the conv update's
``empty_like`` output (``[T, 3P]`` rows, or for a one-token step the projection's own row: ``6288`` wide, or the
projection-overlap path's ``4P``), so they share one token stride (``q.stride(1) == k.stride(1) == v.stride(1)``,
required) with heads and head dims contiguous; ``raw_g`` ``[1, T, H, K]`` (the gate projection's rows, any token stride)
and ``raw_beta`` ``[1, T, H]`` (a column block of the packed projection: any token stride) in the model dtype;
``A_log`` ``H`` and ``dt_bias`` ``H * K`` contiguous float32 elements; ``initial_state`` the recurrent pool
``[slots, H, V, K]`` (K contiguous, the slot stride free: a KV page), updated in place; ``cu_seqlens`` int32
``[N + 1]``; ``ssm_state_indices`` int32, ``[N, 1 + spec]`` (columns contiguous, rows any stride: a view of the block
table or a staged copy) under speculative decoding with ``num_accepted_tokens`` int32 ``[N]`` (1 .. 1 + spec), or
``[N]`` with one token per sequence (``T == N``) and no accepted counts. A state index ``<= 0`` is the null or
padding slot: its sequence's outputs are zeros and no state is read or written.

Differences from vLLM's launch: the op returns ``o`` alone (vLLM returns ``(out, initial_state)``, the second being
the caller's own pool, which is updated in place here too: the engine discards it, ``core_attn_out_spec, _ = ...``);
every token of a null-slot sequence gets a zero row, where vLLM zeroes only its first token's row and leaves the
others unwritten (whatever ``out`` held: a superset, deterministic); ``out`` must be contiguous and 16-byte aligned
(vLLM's ``core_attn_out[:, :T]`` and ``[:, spec_slice]`` are whenever ``H * V * itemsize`` is a multiple of 16);
the token strides of q/k/v and raw_g and the pool's slot stride are specialized integers (vLLM: constexprs, one
binary per value), the index row stride is not specialized at all (vLLM: a constexpr), and ``scale`` is a runtime
float (vLLM: a constexpr, always ``K ** -0.5``); ``fuse_gate`` is not taken (the layer never passes it; False is
vLLM's two-kernel path). The tiling is vLLM's: BV and ``num_stages`` by head-sequences ``H * N``
(:func:`vllm_tile`), one warp, the whole K in one tile, grid ``(cdiv(V, BV) * N * H,)``, the same operation order;
outputs of live rows and every state byte equal vLLM's bit for bit under Triton's interpreter
(``tests/engines/test_vllm_kernels_kda.py``), and the PTX for ``cuda:90`` has the same shape (instruction mix within a
few percent). Key: dtypes, H/K/V and tiles, speculative or not, dt_bias and lower bound set or not, the int classes and
alignments above, one warp, ``num_stages``, PDL. ROCm's layer runs its own copy of the kernel: not modelled.
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

from .backends import KDALayout, kda_layout
from .causal_conv1d import projection_row_stride
from .causal_conv1d_update import overlap_rows
from .model import PLUGIN, KimiK3, local_pdl
from .recoverssm import use_recoverssm

__all__ = [
    "L2NORM_EPS",
    "MAX_BLOCK_V",
    "SOFTPLUS_THRESHOLD",
    "VLLM_TILES",
    "KDARecurrent",
    "KDARecurrentKey",
    "kda_gate",
    "kda_gate_reference",
    "kda_recurrent_reference",
    "register",
    "vllm_tile",
]

#: The V tile of the packed plain-decode step (:mod:`warmreg_kimi_k3.kda_packed_decode`, vLLM's ``min(V, 32)``).
MAX_BLOCK_V = 32
#: The epsilon of the in-kernel L2 normalisation of q and k.
L2NORM_EPS = 1e-6
#: softplus(x) = x above this (softplus beta 1), as vLLM's fused_recurrent_kda_fwd_kernel.
SOFTPLUS_THRESHOLD = 20.0
#: vLLM's gated launch (``fused_recurrent_kda_fwd``, "tuned on GB300 for Kimi-K3 shapes"): up to this many
#: head-sequences ``H * N``, this ``(BV, num_stages)``; past the last bound ``(8, 3)``. Always one warp.
VLLM_TILES = ((48, (4, 4)), (96, (8, 3)), (192, (16, 3)))
_TILE_BEYOND = (8, 3)


def vllm_tile(head_sequences: int) -> tuple[int, int]:
    """``(BV, num_stages)`` of vLLM's gated launch for ``H * N`` head-sequences (:data:`VLLM_TILES`)."""
    for bound, tile in VLLM_TILES:
        if head_sequences <= bound:
            return tile
    return _TILE_BEYOND


@triton.jit
def kda_gate(x, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):  # USE_LOWER_BOUND: picks the activation
    """The KDA gate in fp32 (log-space decay, ``<= 0``) of ``x = raw_g + dt_bias`` with ``a = exp(A_log[h])``:
    ``lower_bound * sigmoid(a * x)`` with a lower bound, else ``-a * softplus(x)`` (``x`` above
    :data:`SOFTPLUS_THRESHOLD`). Shared by the recurrent step and the chunked prefill's gate stage."""
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # softplus, SOFTPLUS_THRESHOLD 20
    return g


# Read one scalar at a time, or once a program (dt_bias: a parameter): alignment cannot change their code. Without
# dt_bias or accepted counts the launcher passes A_log / the indices in their place (never read).
_SCALARS = ["beta_ptr", "a_log_ptr", "dt_bias_ptr", "cu_seqlens_ptr", "indices_ptr", "accepted_ptr"]


# beta's token stride (a projection column, or a gathered copy) and the index row stride (a block-table view, a
# staged copy, a 1-D column) are not specialized: each is one scalar load a token. T and N are not arguments.
@triton.jit(do_not_specialize=["stride_beta_token", "stride_indices_seq"], do_not_specialize_on_alignment=_SCALARS)
def _kda_recurrent_kernel(
    q_ptr,  # [1, T, H, K]
    k_ptr,  # [1, T, H, K]
    v_ptr,  # [1, T, H, V]
    g_ptr,  # [1, T, H, K] the raw gate projection
    beta_ptr,  # [1, T, H] the raw beta projection
    a_log_ptr,  # [H] float32
    dt_bias_ptr,  # [H * K] float32 (A_log when HAS_DT_BIAS is False: unread)
    o_ptr,  # [1, T, H, V] contiguous
    state_ptr,  # [slots, H, V, K]
    cu_seqlens_ptr,  # [N + 1] int32
    indices_ptr,  # [N, C] or [N] int32: the state slot of each token's state
    accepted_ptr,  # [N] int32 (the indices when IS_SPEC is False: unread)
    stride_qkv_token,  # one token stride for q, k and v (rows of the conv update's output)
    stride_g_token,
    stride_beta_token,
    stride_state_slot,  # the KV page
    stride_indices_seq,
    scale,
    lower_bound,  # a runtime float: read only when USE_LOWER_BOUND
    H: tl.constexpr,  # heads on this rank: a model constant
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BLOCK_K: tl.constexpr,  # next_pow2(K): one tile covers K (S k, S q and the L2 norms)
    BLOCK_V: tl.constexpr,  # vLLM's BV by head-sequences: V is split over the grid
    IS_SPEC: tl.constexpr,  # read the initial state at column num_accepted_tokens[n] - 1 (else column 0)
    HAS_DT_BIAS: tl.constexpr,  # add dt_bias to the raw gate
    USE_LOWER_BOUND: tl.constexpr,  # gate = lb * sigmoid(...) instead of -exp(A_log) * softplus(...)
    LOOP_STAGES: tl.constexpr,  # software-pipelining depth of the token loop (the key's num_stages)
    USE_PDL: tl.constexpr,  # programmatic dependent launch; matches the launch option launch_pdl
):
    if USE_PDL:
        tl_cuda.gdc_wait()
    pid = tl.program_id(0)
    v_tiles = tl.cdiv(V, BLOCK_V)
    i_v, nh = pid % v_tiles, pid // v_tiles  # the V tiles of one (sequence, head) are neighbours
    n, h = nh // H, nh % H
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - bos
    if length == 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_v[:, None] & mask_k[None, :]
    row = indices_ptr + n.to(tl.int64) * stride_indices_seq
    if IS_SPEC:
        first = tl.load(row + tl.load(accepted_ptr + n).to(tl.int64) - 1).to(tl.int64)
    else:
        first = tl.load(row).to(tl.int64)
    o_ptrs = o_ptr + bos * (H * V) + h * V + offs_v
    if first <= 0:  # the null or a padding slot: zeros for every token, no state read or written
        for t in tl.range(0, length):
            tl.store(
                o_ptrs + t * (H * V), tl.zeros([BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v
            )
        return
    tile = h * V * K + offs_v[:, None] * K + offs_k[None, :]
    s = tl.load(state_ptr + first * stride_state_slot + tile, mask=mask_s, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    q_ptrs = q_ptr + bos * stride_qkv_token + h * K + offs_k
    k_ptrs = k_ptr + bos * stride_qkv_token + h * K + offs_k
    v_ptrs = v_ptr + bos * stride_qkv_token + h * V + offs_v
    g_ptrs = g_ptr + bos * stride_g_token + h * K + offs_k
    beta_ptrs = beta_ptr + bos * stride_beta_token + h
    for t in tl.range(0, length, num_stages=LOOP_STAGES):
        q = tl.load(q_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
        k = tl.load(k_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
        v = tl.load(v_ptrs, mask=mask_v, other=0.0, eviction_policy="evict_first").to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)  # L2NORM_EPS; vLLM's fused_recurrent_kda always normalises
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        x = tl.load(g_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if HAS_DT_BIAS:
            x = x + bias
        g = kda_gate(x, a, lower_bound, USE_LOWER_BOUND)
        s = s * tl.exp(g[None, :])
        u = v - tl.sum(s * k[None, :], axis=1)
        u = u * tl.sigmoid(tl.load(beta_ptrs, eviction_policy="evict_last").to(tl.float32))
        s = s + u[:, None] * k[None, :]
        o = tl.sum(s * q[None, :], axis=1)
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v, eviction_policy="evict_first")
        slot = tl.load(row + t).to(tl.int64)  # this token's state column
        if slot > 0:
            tl.store(state_ptr + slot * stride_state_slot + tile, s.to(state_ptr.dtype.element_ty), mask=mask_s)
        q_ptrs += stride_qkv_token
        k_ptrs += stride_qkv_token
        v_ptrs += stride_qkv_token
        g_ptrs += stride_g_token
        beta_ptrs += stride_beta_token
        o_ptrs += H * V
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()


@attrs.frozen(kw_only=True)
class KDARecurrentKey(warmreg.CompileKey):
    """What changes the binary of the KDA recurrent step."""

    dtype: str  # q, k, v and out
    gate_dtype: str  # the raw gate projection
    beta_dtype: str  # the raw beta projection
    state_dtype: str  # the recurrent pool (float32 in vLLM's default)
    num_heads: int  # H (constexpr)
    head_k_dim: int  # K
    head_v_dim: int  # V
    block_k: int
    block_v: int  # vLLM's BV for the step's head-sequences
    is_spec_decoding: bool  # IS_SPEC: num_accepted_tokens given
    has_dt_bias: bool  # HAS_DT_BIAS
    use_lower_bound: bool  # USE_LOWER_BOUND (the bound's value is a runtime float)
    qkv_stride: warmreg.IntClass  # the shared token stride of q, k, v
    g_stride: warmreg.IntClass
    state_stride: warmreg.IntClass  # the pool's slot stride
    q_aligned: bool
    k_aligned: bool
    v_aligned: bool
    g_aligned: bool
    state_aligned: bool
    num_warps: int  # 1, as vLLM
    num_stages: int  # vLLM's num_stages for the step's head-sequences (also the loop's pipelining depth)
    launch_pdl: bool  # USE_PDL and the launch option


class KDARecurrent(warmreg.TritonKernel[KDARecurrentKey]):
    """The KDA recurrent step of one deployment; the configuration shapes :meth:`domains` only (any instance can
    warm any key: :meth:`dispatch` reads the tensors alone).

    :param num_heads: KDA heads on one rank (``num_heads / tensor_parallel_size``).
    :param head_k_dim: key head dim ``K``.
    :param head_v_dim: value head dim ``V``.
    :param dtype: activation dtype name of q, k, v and o (also the raw gate's and beta's unless given).
    :param gate_dtype: dtype name of the raw gate projection (default ``dtype``).
    :param beta_dtype: dtype name of the raw beta projection (default ``dtype``).
    :param state_dtype: the recurrent pool's dtype name (vLLM's ``mamba_ssm_cache_dtype`` ``auto``: float32).
    :param has_dt_bias: whether the layers have a ``dt_bias`` (added to the raw gate).
    :param lower_bound: ``linear_attn_config.gate_lower_bound``, or None for the softplus gate; only whether it is
        set reaches the key.
    :param max_num_seqs: the most sequences in a step (N runs from 1 to it: every tile bucket it reaches).
    :param num_speculative_tokens: draft tokens per request (``ssm_state_indices`` is ``[N, 1 + this]``).
    :param projection_rows: the row strides a one-token step's q/k/v may have besides ``3P`` (the conv update's
        ``empty_like`` of one projection row keeps the row's stride): the packed projection's, the overlap path's.
    :param conv_width: the short convolution's width (the conv state shares the recurrent state's KV page).
    """

    name = "kimi_k3.kda_recurrent"
    key_type = KDARecurrentKey
    jit = _kda_recurrent_kernel

    def __init__(
        self,
        *,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: str = "bfloat16",
        gate_dtype: str | None = None,
        beta_dtype: str | None = None,
        state_dtype: str = "float32",
        has_dt_bias: bool = True,
        lower_bound: float | None = None,
        max_num_seqs: int = 1,
        num_speculative_tokens: int = 1,
        projection_rows: tuple[int, ...] = (),
        conv_width: int = 4,
    ) -> None:
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_k_dim, head_v_dim
        self.dtype = getattr(torch, dtype)
        self.gate_dtype = getattr(torch, gate_dtype or dtype)
        self.beta_dtype = getattr(torch, beta_dtype or dtype)
        self.state_dtype = getattr(torch, state_dtype)
        self.has_dt_bias, self.lower_bound = has_dt_bias, lower_bound
        self.max_num_seqs, self.num_speculative_tokens = max_num_seqs, num_speculative_tokens
        self.projection_rows, self.conv_width = tuple(projection_rows), conv_width

    @classmethod
    def from_layout(
        cls, layout: KDALayout, *, max_num_seqs: int, projection_rows: tuple[int, ...] = ()
    ) -> KDARecurrent:
        """The step of a KDA layout (K = V = ``head_dim``, activations and raw projections in the layout's dtype,
        a ``dt_bias``: Kimi-Linear's KDA layer always has one, an assumption)."""
        return cls(
            num_heads=layout.num_heads, head_k_dim=layout.head_dim, head_v_dim=layout.head_dim, dtype=layout.dtype,
            lower_bound=layout.lower_bound, max_num_seqs=max_num_seqs,
            num_speculative_tokens=layout.num_speculative_tokens, projection_rows=projection_rows,
            conv_width=layout.conv_width,
        )  # fmt: skip

    def dispatch(
        self,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        dt_bias: torch.Tensor | None,
        lower_bound: float | None,
        initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None,
        launch_pdl: bool,
    ) -> KDARecurrentKey:
        heads, k_dim, v_dim = q.shape[2], q.shape[3], v.shape[3]
        block_v, stages = vllm_tile(heads * (cu_seqlens.shape[0] - 1))
        return KDARecurrentKey(
            dtype=warmreg.dtype_name(q.dtype), gate_dtype=warmreg.dtype_name(raw_g.dtype),
            beta_dtype=warmreg.dtype_name(raw_beta.dtype), state_dtype=warmreg.dtype_name(initial_state.dtype),
            num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim, block_k=warmreg.next_pow2(k_dim), block_v=block_v,
            is_spec_decoding=num_accepted_tokens is not None, has_dt_bias=dt_bias is not None,
            use_lower_bound=lower_bound is not None, qkv_stride=warmreg.int_class(q.stride(1)),
            g_stride=warmreg.int_class(raw_g.stride(1)), state_stride=warmreg.int_class(initial_state.stride(0)),
            q_aligned=warmreg.is_aligned(q), k_aligned=warmreg.is_aligned(k), v_aligned=warmreg.is_aligned(v),
            g_aligned=warmreg.is_aligned(raw_g), state_aligned=warmreg.is_aligned(initial_state),
            num_warps=1, num_stages=stages, launch_pdl=bool(launch_pdl),
        )  # fmt: skip

    # -- the deployment's input space --------------------------------------------------------------
    def sequence_counts(self) -> list[int]:
        """N at each tile bucket's lower edge that ``1 .. max_num_seqs`` reaches (every bucket, so every key)."""
        h, top = self.num_heads, self.max_num_seqs
        return sorted({1, top, *(bound // h + 1 for bound, _ in VLLM_TILES if bound // h + 1 <= top)})

    def _qkv(self, tokens: int, row: int) -> tuple[torch.Tensor, ...]:
        """q, k, v as the layer's rearranged column slices of the conv update's output, rows ``row`` apart."""
        h, kd, vd = self.num_heads, self.head_k_dim, self.head_v_dim
        conv = warmreg.meta((tokens, h * (2 * kd + vd)), self.dtype, stride=(row, 1))
        cols = ((0, kd), (h * kd, kd), (2 * h * kd, vd))
        return tuple(conv[:, c : c + h * w].view(1, tokens, h, w) for c, w in cols)

    def _pools(self) -> list[torch.Tensor]:
        """The recurrent pool: contiguous, and as vLLM's KV page holds it (the conv state first, in the activation
        dtype, ``W - 1 + spec`` rows of ``3P``; the fp32 state after it; the page unpadded)."""
        h, kd, vd, slots = self.num_heads, self.head_k_dim, self.head_v_dim, self.max_num_seqs + 1
        pools = [warmreg.meta((slots, h, vd, kd), self.state_dtype)]
        elem, state_elem = self.dtype.itemsize, self.state_dtype.itemsize
        conv_bytes = (self.conv_width - 1 + self.num_speculative_tokens) * h * (2 * kd + vd) * elem
        page_bytes = conv_bytes + h * vd * kd * state_elem
        if not (conv_bytes % state_elem or page_bytes % state_elem):
            page, offset = page_bytes // state_elem, conv_bytes // state_elem
            pools.append(
                warmreg.meta((slots, h, vd, kd), self.state_dtype, stride=(page, vd * kd, kd, 1), offset=offset)
            )
        return pools

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """Speculative-decode steps of ``N`` sequences at each tile bucket (:meth:`sequence_counts`), ``1 + spec``
        tokens each: q/k/v from the conv update's ``[T, 3P]`` output (for one token also the projection rows it
        keeps), the gate projection's rows (from row 0, or later in a mixed batch), beta a column of the packed
        projection, the contiguous or KV-page pool, ``[N, 1 + spec]`` indices with accepted counts."""
        h, kd, spec = self.num_heads, self.head_k_dim, self.num_speculative_tokens
        width = h * (2 * kd + self.head_v_dim)
        beta_row = max([width + h, *self.projection_rows])
        points = []
        for n in self.sequence_counts():
            # one token (a request of one, or graph padding after it): the projection row the conv output keeps
            shapes = [(n * (1 + spec), width), *((1, row) for row in self.projection_rows)]
            for tokens, row in shapes:
                q, k, v = self._qkv(tokens, row)
                beta = warmreg.meta((tokens, beta_row), self.beta_dtype)[:, beta_row - h :].unsqueeze(0)
                for first in (0, 1):
                    g = warmreg.meta((1, first + tokens, h, kd), self.gate_dtype)[:, first:]
                    for pool in self._pools():
                        points.append({
                            "q": q, "k": k, "v": v, "raw_g": g, "raw_beta": beta,
                            "dt_bias": warmreg.meta((h * kd,), torch.float32) if self.has_dt_bias else None,
                            "lower_bound": self.lower_bound, "initial_state": pool,
                            "cu_seqlens": warmreg.meta((n + 1,), torch.int32),
                            "num_accepted_tokens": warmreg.meta((n,), torch.int32),
                            "launch_pdl": platform.supports_pdl,
                        })  # fmt: skip
        return points

    def when(self, *, q: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor, **_: Any) -> bool:
        # One step: every per-token input has the step's T.
        return q.shape[1] == raw_g.shape[1] == raw_beta.shape[1]

    def warmup_inputs(self, key: KDARecurrentKey) -> Mapping[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        row = warmreg.int_class_rep(key.qkv_stride)
        n = next(n for n in range(1, 1 << 20) if vllm_tile(h * n) == (key.block_v, key.num_stages))

        def act(dim: int, aligned: bool) -> torch.Tensor:
            return warmreg.meta((1, 1, h, dim), dt, stride=(row, row, dim, 1), offset=0 if aligned else 1)

        g_row = warmreg.int_class_rep(key.g_stride)
        return {
            "q": act(kd, key.q_aligned), "k": act(kd, key.k_aligned), "v": act(vd, key.v_aligned),
            "raw_g": warmreg.meta((1, 1, h, kd), getattr(torch, key.gate_dtype), stride=(g_row, g_row, kd, 1),
                                  offset=0 if key.g_aligned else 1),
            "raw_beta": warmreg.meta((1, 1, h), getattr(torch, key.beta_dtype)),
            "A_log": warmreg.meta((h,), torch.float32),
            "dt_bias": warmreg.meta((h * kd,), torch.float32) if key.has_dt_bias else None,
            "lower_bound": -1.0 if key.use_lower_bound else None,  # any value: a runtime argument
            "initial_state": warmreg.meta((1, h, vd, kd), getattr(torch, key.state_dtype),
                                          stride=(warmreg.int_class_rep(key.state_stride), vd * kd, kd, 1),
                                          offset=0 if key.state_aligned else 1),
            "cu_seqlens": warmreg.meta((n + 1,), torch.int32),
            "ssm_state_indices": warmreg.meta((n, 2), torch.int32),
            "num_accepted_tokens": warmreg.meta((n,), torch.int32) if key.is_spec_decoding else None,
            "launch_pdl": key.launch_pdl,
        }  # fmt: skip

    # -- the launch code ----------------------------------------------------------------------------
    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,  # the model's parameter name
        dt_bias: torch.Tensor | None,
        lower_bound: float | None,
        initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        ssm_state_indices: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        launch_pdl: bool | None = None,
    ) -> warmreg.LaunchSpec[KDARecurrentKey]:
        """One recurrent step of each sequence over its tokens, vLLM's ``fused_recurrent_kda`` (same arguments);
        returns ``o`` ``[1, T, H, V]`` in v's dtype (``out``, or a fresh tensor), zeros for every token of a
        sequence whose initial slot is ``<= 0``; writes each token's state into ``initial_state`` at its column of
        ``ssm_state_indices`` where that index is ``> 0``. The math and layouts are in the module docstring.

        :param q: ``[1, T, H, K]``, heads and K contiguous, any token stride.
        :param k: like ``q``, with q's token stride.
        :param v: ``[1, T, H, V]``, heads and V contiguous, with q's token stride.
        :param raw_g: ``[1, T, H, K]``, heads and K contiguous, any token stride: the raw gate projection.
        :param raw_beta: ``[1, T, H]``, heads contiguous, any token stride: the raw beta projection.
        :param A_log: float32, ``H`` contiguous elements (``[H]`` or the model's ``[1, 1, H, 1]``).
        :param dt_bias: float32, ``H * K`` contiguous elements, or None.
        :param lower_bound: the gate's lower bound (``< 0``), or None for the softplus gate.
        :param initial_state: ``[slots, H, V, K]`` (float32, or another float dtype), ``[H, V, K]`` contiguous
            within a slot, any slot stride; updated in place.
        :param cu_seqlens: int32 ``[N + 1]``, contiguous; rows of ``o`` past ``cu_seqlens[N]`` are not written.
        :param ssm_state_indices: int32 ``[N, C]`` with contiguous columns, or ``[N]`` (then ``T == N``, one token a
            sequence, and no ``num_accepted_tokens``); ``<= 0``: the null or a padding slot.
        :param num_accepted_tokens: int32 ``[N]`` (1 .. C): the initial state's column plus one; None: column 0.
        :param out: a preallocated ``o``, contiguous, 16-byte aligned, v's shape and dtype (then nothing is
            allocated); vLLM passes ``core_attn_out[:, :T]``.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it, as vLLM's
            ``is_arch_support_pdl``).
        :raises LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out`` that is
            not the output's shape, dtype and layout.
        """
        self._check(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                    ssm_state_indices, num_accepted_tokens)  # fmt: skip
        key = self.dispatch(
            q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, dt_bias=dt_bias, lower_bound=lower_bound,
            initial_state=initial_state, cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens,
            launch_pdl=local_pdl(launch_pdl),
        )  # fmt: skip
        o = warmreg.output(self.name, "out", out, tuple(v.shape), v.dtype, v.device)
        kwargs = dict(
            q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=raw_g, beta_ptr=raw_beta, a_log_ptr=A_log,
            dt_bias_ptr=A_log if dt_bias is None else dt_bias, o_ptr=o, state_ptr=initial_state,
            cu_seqlens_ptr=cu_seqlens, indices_ptr=ssm_state_indices,
            accepted_ptr=ssm_state_indices if num_accepted_tokens is None else num_accepted_tokens,
            stride_qkv_token=q.stride(1), stride_g_token=raw_g.stride(1), stride_beta_token=raw_beta.stride(1),
            stride_state_slot=initial_state.stride(0), stride_indices_seq=ssm_state_indices.stride(0),
            scale=key.head_k_dim**-0.5, lower_bound=0.0 if lower_bound is None else float(lower_bound),
            H=key.num_heads, K=key.head_k_dim, V=key.head_v_dim, BLOCK_K=key.block_k, BLOCK_V=key.block_v,
            IS_SPEC=key.is_spec_decoding, HAS_DT_BIAS=key.has_dt_bias, USE_LOWER_BOUND=key.use_lower_bound,
            LOOP_STAGES=key.num_stages, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        num_seqs = cu_seqlens.shape[0] - 1
        v_tiles = -(-key.head_v_dim // key.block_v)  # not triton.cdiv: microseconds of host time
        grid = (v_tiles * num_seqs * key.num_heads,) if num_seqs else None
        return warmreg.LaunchSpec(key, grid, kwargs, o)

    def _check(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor | None,
        lower_bound: float | None,
        state: torch.Tensor,
        cu_seqlens: torch.Tensor,
        indices: torch.Tensor,
        accepted: torch.Tensor | None,
    ) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if q.ndim != 4 or q.shape[0] != 1 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
            fail(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [1, T, H, K], [1, T, H, K], "
                 "[1, T, H, V]", fix="pass the layer's rearranged views ('n (h d) -> 1 n h d')")  # fmt: skip
        _, t, h, kd = q.shape
        vd = v.shape[3]
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if qs[2:] != (kd, 1) or ks[2:] != (kd, 1) or vs[2:] != (vd, 1):
            fail(f"q, k, v need contiguous heads and head dims (strides {qs}, {ks}, {vs})")
        if not qs[1] == ks[1] == vs[1]:
            fail(f"q, k, v must share one token stride (got {qs[1]}, {ks[1]}, {vs[1]})",
                 fix="pass column slices of one [T, 3P] conv output, as vLLM's layer does")  # fmt: skip
        if raw_g.shape != q.shape or raw_g.stride()[2:] != (kd, 1):
            fail(f"raw_g {tuple(raw_g.shape)} must be [1, T, H, K] = {(1, t, h, kd)}, contiguous within a token")
        if raw_beta.shape != (1, t, h) or raw_beta.stride(2) != 1:
            fail(f"raw_beta {tuple(raw_beta.shape)} must be [1, T, H] = {(1, t, h)} with contiguous heads")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            fail(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
        if not (q.dtype.is_floating_point and raw_g.dtype.is_floating_point and raw_beta.dtype.is_floating_point
                and state.dtype.is_floating_point):  # fmt: skip
            dtypes = f"{q.dtype}, {raw_g.dtype}, {raw_beta.dtype}, {state.dtype}"
            fail(f"q, raw_g, raw_beta and initial_state must be floating point (got {dtypes})")
        for name, p, numel in (("A_log", A_log, h), ("dt_bias", dt_bias, h * kd)):
            if p is not None and (p.dtype != torch.float32 or p.numel() != numel or not p.is_contiguous()):
                fail(f"{name} must be float32 with {numel} contiguous elements (got {p.dtype} {tuple(p.shape)})",
                     fix="pass the layer's parameter ([H] for A_log, [H * K] for dt_bias), as the model holds it")  # fmt: skip
        if lower_bound is not None and not lower_bound < 0:
            fail(f"lower_bound must be < 0 or None (got {lower_bound!r})")
        if state.ndim != 4 or tuple(state.shape[1:]) != (h, vd, kd) or state.stride()[1:] != (vd * kd, kd, 1):
            fail(f"initial_state {tuple(state.shape)} (strides {state.stride()}) must be [slots, H, V, K] = "
                 f"[slots, {h}, {vd}, {kd}], contiguous within a slot", fix="pass vLLM's recurrent-state pool")  # fmt: skip
        if (
            cu_seqlens.ndim != 1
            or cu_seqlens.shape[0] < 1
            or cu_seqlens.dtype != torch.int32
            or cu_seqlens.stride(0) != 1
        ):
            fail(f"cu_seqlens must be contiguous int32 [N + 1] (got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)})")
        n = cu_seqlens.shape[0] - 1
        if indices.dtype != torch.int32 or indices.ndim not in (1, 2) or indices.shape[0] != n:
            fail(
                f"ssm_state_indices must be int32 [N] or [N, C] with N = {n} (got {indices.dtype} {tuple(indices.shape)})"
            )
        if indices.ndim == 1 and (t != n or accepted is not None):
            fail(f"1-D ssm_state_indices take one token a sequence (T = {t}, N = {n}) and no num_accepted_tokens",
                 fix="pass [N, 1 + num_speculative_tokens] indices for speculative steps")  # fmt: skip
        if indices.ndim == 2 and indices.shape[1] > 1 and indices.stride(1) != 1:
            fail(f"ssm_state_indices needs contiguous columns (got strides {indices.stride()})")
        if accepted is not None and (accepted.dtype != torch.int32 or tuple(accepted.shape) != (n,)):
            fail(f"num_accepted_tokens must be int32 [N] with N = {n} (got {accepted.dtype} {tuple(accepted.shape)})")
        tensors = [q, k, v, raw_g, raw_beta, A_log, state, cu_seqlens, indices]
        tensors += [x for x in (dt_bias, accepted) if x is not None]
        device = q.get_device()  # -1 on the CPU, else the GPU's index: cheaper than torch.device objects
        if any(x.get_device() != device for x in tensors):
            fail(f"all inputs must be on one device (got {sorted({str(x.device) for x in tensors})})")


def kda_gate_reference(
    raw_g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """The gate the kernel applies, in fp32: ``g [..., H, K]`` (log-space decay, ``<= 0``).

    ``x = raw_g + dt_bias`` (``dt_bias`` ``[H * K]`` viewed as ``[H, K]``; 0 if None), ``a = exp(A_log[h])``;
    ``g = lower_bound * sigmoid(a * x)`` if a lower bound is set, else ``-a * softplus(x)`` (beta 1,
    threshold 20: ``x`` itself above 20).
    """
    heads, k_dim = raw_g.shape[-2], raw_g.shape[-1]
    x = raw_g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(heads, k_dim)
    a = torch.exp(A_log.float().reshape(heads, 1))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * torch.nn.functional.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)


def _token_step(
    s: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every head in fp32: state ``s`` ``[H, V, K]``, q/k/g ``[H, K]``, v ``[H, V]``, beta ``[H]``;
    returns the new state and ``o`` ``[H, V]``."""
    q, k = q.float(), k.float()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    s = s * torch.exp(g)[:, None, :]
    u = (v.float() - torch.einsum("hvk,hk->hv", s, k)) * beta[:, None]
    s = s + u[:, :, None] * k[:, None, :]
    return s, torch.einsum("hvk,hk->hv", s, q)


def kda_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference in vLLM's convention (the arguments of :class:`KDARecurrent`): the gate
    (:func:`kda_gate_reference`) and ``beta = sigmoid(raw_beta)`` in fp32, then the recurrence token by token in
    fp32, one cast of ``o`` per token; ``scale`` defaults to ``K ** -0.5`` (vLLM's only value).

    :returns: ``(o, pool)``: ``o`` ``[1, T, H, V]`` in v's dtype (zeros for null-slot sequences and outside the
        sequences) and a copy of ``initial_state`` with every token's state written at its column's slot (``> 0``);
        the input pool is not modified.
    :raises ValueError: for 1-D indices and a sequence of more than one token (not a decode step).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = kda_gate_reference(raw_g[0], A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(raw_beta[0].float())
    pool = initial_state.clone()
    o = torch.zeros(v.shape[1:], dtype=v.dtype, device=v.device)
    rows = (ssm_state_indices if ssm_state_indices.ndim == 2 else ssm_state_indices[:, None]).tolist()
    accepted = [1] * len(rows) if num_accepted_tokens is None else num_accepted_tokens.tolist()
    bounds = cu_seqlens.tolist()
    for n, row in enumerate(rows):
        bos, eos = bounds[n], bounds[n + 1]
        if eos - bos > len(row):
            raise ValueError(f"sequence {n} has {eos - bos} tokens but {len(row)} state column(s)")
        first = row[accepted[n] - 1] if eos > bos else 0
        if first <= 0:
            continue  # the null slot: zero rows, nothing read or written
        s = pool[first].float()
        for i, t in enumerate(range(bos, eos)):
            s, o_t = _token_step(s, q[0, t], k[0, t], v[0, t], g[t], beta[t], scale)
            o[t] = o_t.to(v.dtype)
            if row[i] > 0:
                pool[row[i]] = s.to(pool.dtype)
    return o.unsqueeze(0), pool


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the step on CUDA when the deployment speculates (``serving.num_speculative_tokens > 0``): vLLM's
    layer launches it for the speculative rows of every step that has them, except the steps of speculative rows
    alone that FlashInfer's packed kernel takes (:func:`warmreg_kimi_k3.backends.kda_spec_decode_backend`
    ``"flashinfer"``: mixed steps still come here), with RecoverSSM off: under RecoverSSM
    (:func:`warmreg_kimi_k3.recoverssm.use_recoverssm`) every speculative row goes to ``self._recoverssm_verify``
    (``if self.use_recoverssm: ... else: ... fused_recurrent_kda(...)`` in ``_forward``'s spec-decode path) and
    plain decodes to ``fused_recurrent_kda_packed_decode``, so vLLM 0.34 launches this kernel nowhere. ROCm's layer
    (``vllm/models/kimi_k3/amd/kda.py``) runs its own copy of the kernel, with other launch heuristics and ``rsqrt``
    normalisation, also for plain decodes: :mod:`warmreg_kimi_k3.rocm_kda_recurrent`.

    Reads the layout (:func:`warmreg_kimi_k3.backends.kda_layout`: heads, head dim K = V, the gate lower bound, the
    conv width), ``serving.max_num_seqs`` and whether the projection-overlap path feeds one-token steps
    (:func:`warmreg_kimi_k3.causal_conv1d_update.overlap_rows`).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, a tensor-parallel size that does not
        divide the KDA head count, or an invalid ``serving.use_replayssm``.
    """
    layout = kda_layout(m, config)
    if layout is None or not layout.num_speculative_tokens or use_recoverssm(config, layout):
        return  # a pure-MLA config, no KDA layers, no speculation, or RecoverSSM's verify: never launched
    rows = (
        projection_row_stride(layout),
        *([4 * layout.projection_size] if overlap_rows(layout, config, platform) else []),
    )
    kernel = KDARecurrent.from_layout(layout, max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
                                      projection_rows=rows)  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
