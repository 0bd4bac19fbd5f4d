"""Kimi Delta Attention (KDA): the recurrent step for decode and speculative decode, gate fused in.

This is the kernel vLLM's Kimi-K3 CUDA path launches for speculative decode:
``vllm/model_executor/layers/fla/ops/kda.py: fused_recurrent_kda`` (``fuse_gate=True`` by default),
which launches ``fused_recurrent_kda_fwd_kernel`` with ``USE_GATE_IN_KERNEL=True`` and
``APPLY_BETA_SIGMOID=True``, called from the KDA layer of ``vllm/models/kimi_k3/nvidia/kda.py``. It
takes the RAW gate projection and the RAW beta projection (model dtype) and applies the gate
activation and the beta sigmoid in the kernel; ``fused_kda_gate`` is not on that path.

Math, per sequence ``n`` and head ``h``, with the state ``S`` in fp32 of shape ``[K, V]`` and every
input cast to fp32::

    a = exp(A_log[h])
    S = pool[slot[n], h] if slot[n] >= 0 else 0
    for t in tokens of n (cu_seqlens[n] .. cu_seqlens[n + 1] - 1):
        x = raw_g[t, h] + (dt_bias[h, :] if dt_bias is given else 0)      # [K], per channel
        g = lb * sigmoid(a * x)      if a lower bound lb is set            # in (lb, 0)
            -a * softplus(x)         otherwise (softplus(x) = x if x > 20 else log(1 + exp(x)))
        beta = sigmoid(raw_beta[t, h])
        q, k = q[t, h], k[t, h]
        if USE_L2NORM:  q = q / sqrt(sum(q * q) + 1e-6);  k = k / sqrt(sum(k * k) + 1e-6)
        S = S * exp(g)[:, None]                            # channel-wise decay, g in log space
        u = beta * (v[t, h] - S^T k)                       # the delta rule
        S = S + k u^T
        o[t, h] = cast(S^T (q * scale), dtype of v)
    if slot[n] >= 0:  pool[slot[n], h] = S                  # the final state, written back in place

``A_log`` is ``[H]`` (any shape of ``H`` contiguous elements, e.g. the model's ``[1, 1, H, 1]``),
``dt_bias`` ``[H * K]`` (one bias per channel, ``dt_bias[h * K + c]``), both float32 parameters.
The lower bound is a runtime float argument (as in vLLM: only whether it is set, ``USE_LOWER_BOUND``,
is a constexpr), so its value never changes the binary.

Inputs are varlen (a few tokens per sequence, ``cu_seqlens`` int32 ``[N + 1]``); the state pool
``[num_slots, H, K, V]`` (fp32) is indexed by a per-sequence slot (int32 ``[N]``), a negative slot
meaning "no state": start from zeros and write nothing back. Grid ``(N, H, cdiv(V, BLOCK_V))``: each
program keeps a ``[BLOCK_K, BLOCK_V]`` tile of one head's state in registers for all of its tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kda_layout
from .model import PLUGIN, KimiK3

__all__ = [
    "L2NORM_EPS",
    "MAX_BLOCK_V",
    "SOFTPLUS_THRESHOLD",
    "KDARecurrent",
    "KDARecurrentKey",
    "kda_gate",
    "kda_gate_reference",
    "kda_recurrent_reference",
    "register",
]

#: Largest V tile: a [128, 32] fp32 tile is 32 registers per thread at 4 warps, and V = 128 gives
#: 4 programs per (sequence, head), enough parallelism for small decode batches.
MAX_BLOCK_V = 32
#: The epsilon of the in-kernel L2 normalisation of q and k.
L2NORM_EPS = 1e-6
#: softplus(x) = x above this (softplus beta 1), as vLLM's fused_recurrent_kda_fwd_kernel.
SOFTPLUS_THRESHOLD = 20.0


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


# The token count T and the number of sequences N are not arguments at all (cu_seqlens and the grid
# carry them), so one binary serves every batch. beta, cu_seqlens and the slots are read one scalar
# at a time: their 16-byte alignment cannot change the code, so Triton must not specialize on it.
# A_log (one scalar a head) and dt_bias (K floats a head, loaded once a program) are parameters; without
# dt_bias the launcher passes A_log in its place (never read), so neither may specialize on alignment.
@triton.jit(do_not_specialize_on_alignment=["beta_ptr", "a_log_ptr", "dt_bias_ptr", "cu_seqlens_ptr", "slots_ptr"])
def _kda_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,  # the raw gate projection [T, H, K]
    beta_ptr,  # the raw beta projection [T, H]
    a_log_ptr,  # [H] float32
    dt_bias_ptr,  # [H * K] float32 (A_log again when HAS_DT_BIAS is False: unread)
    o_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    q_stride,
    k_stride,
    v_stride,
    state_stride,
    scale,
    lower_bound,  # a runtime float: read only when USE_LOWER_BOUND
    H: tl.constexpr,  # heads on this rank: a model constant; the g/beta/o token strides derive from it
    K: tl.constexpr,  # key head dim: a model constant
    V: tl.constexpr,  # value head dim: a model constant
    BLOCK_K: tl.constexpr,  # next_pow2(K): one tile covers K (needed by S^T k and the L2 norm)
    BLOCK_V: tl.constexpr,  # min(next_pow2(V), 32): V is split over grid axis 2
    USE_L2NORM: tl.constexpr,  # L2-normalise q and k in the kernel (Kimi-Linear does)
    HAS_DT_BIAS: tl.constexpr,  # add dt_bias to the raw gate
    USE_LOWER_BOUND: tl.constexpr,  # gate = lb * sigmoid(...) instead of -exp(A_log) * softplus(...)
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    # A negative slot still needs a valid address expression; the mask keeps it unread.
    s_ptrs = state_ptr + tl.maximum(slot, 0) * state_stride + h * K * V + offs_k[:, None] * V + offs_v[None, :]
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    live = tl.where(slot >= 0, True, False)
    s = tl.load(s_ptrs, mask=mask_s & live, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    # A while loop, not range(bos, eos): Triton 3.6.0's interpreter cannot take loaded values as range
    # bounds under numpy >= 2 (it calls int() on a 1-element array); compiled, both are an scf loop.
    t = bos
    while t < eos:
        q = tl.load(q_ptr + t * q_stride + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * k_stride + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * v_stride + h * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        x = tl.load(g_ptr + (t * H + h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            x = x + bias
        g = kda_gate(x, a, lower_bound, USE_LOWER_BOUND)
        beta = tl.sigmoid(tl.load(beta_ptr + t * H + h).to(tl.float32))
        if USE_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        s = s * tl.exp(g)[:, None]
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * (q * scale)[:, None], axis=0)
        tl.store(o_ptr + (t * H + h) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        t += 1
    if slot >= 0:
        tl.store(s_ptrs, s, mask=mask_s)


@attrs.frozen(kw_only=True)
class KDARecurrentKey(warmreg.CompileKey):
    """What changes the binary of the KDA recurrent step."""

    dtype: str  # q, k, v and o
    gate_dtype: str  # the raw gate projection
    beta_dtype: str  # the raw beta projection
    num_heads: int  # H (constexpr)
    head_k_dim: int  # K
    head_v_dim: int  # V
    block_k: int
    block_v: int
    use_qk_l2norm: bool
    has_dt_bias: bool  # HAS_DT_BIAS
    use_lower_bound: bool  # USE_LOWER_BOUND (the bound's value is a runtime float, not part of the key)
    # q, k, v may be views of one fused qkv projection: token strides and alignment vary with that.
    q_stride: warmreg.IntClass
    k_stride: warmreg.IntClass
    v_stride: warmreg.IntClass
    q_aligned: bool
    k_aligned: bool
    v_aligned: bool
    g_aligned: bool
    # The pool may be a view into an engine's shared cache buffer, with padded slots.
    state_stride: warmreg.IntClass
    state_aligned: bool
    num_warps: int


def _block_v(v_dim: int) -> int:
    return min(warmreg.next_pow2(v_dim), MAX_BLOCK_V)


class KDARecurrent(warmreg.TritonKernel[KDARecurrentKey]):
    """The KDA recurrent step, configured with one deployment's linear-attention layout.

    The configuration only shapes :meth:`domains`; :meth:`dispatch` reads the tensors alone, so any
    instance can warm any key of this kernel (registrations with one name are merged).

    :param num_heads: KDA heads on one rank (``num_heads / tensor_parallel_size``).
    :param head_k_dim: key head dim ``K``.
    :param head_v_dim: value head dim ``V``.
    :param dtype: activation dtype name of q, k, v and o.
    :param gate_dtype: dtype name of the raw gate projection (the model dtype in vLLM's Kimi-K3 layer).
    :param beta_dtype: dtype name of the raw beta projection (likewise).
    :param use_qk_l2norm: whether the deployment normalises q and k in the kernel.
    :param has_dt_bias: whether the layers have a ``dt_bias`` (added to the raw gate).
    :param lower_bound: ``linear_attn_config.gate_lower_bound``, or None for the softplus gate; only
        whether it is set reaches the key.
    :param max_num_seqs: most sequences in a decode step.
    :param num_speculative_tokens: draft tokens per sequence (each step has 1 + this many tokens).
    :param plugin: the registering plugin, named in config errors.
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
        gate_dtype: str = "bfloat16",
        beta_dtype: str = "bfloat16",
        use_qk_l2norm: bool = True,
        has_dt_bias: bool = True,
        lower_bound: float | None = None,
        max_num_seqs: int = 1,
        num_speculative_tokens: int = 0,
        plugin: str = PLUGIN,
    ) -> None:
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_k_dim, head_v_dim
        self.dtype = getattr(torch, dtype)
        self.gate_dtype = getattr(torch, gate_dtype)
        self.beta_dtype = getattr(torch, beta_dtype)
        self.use_qk_l2norm = use_qk_l2norm
        self.has_dt_bias = has_dt_bias
        self.lower_bound = lower_bound
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        self.plugin = plugin

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
        state_pool: torch.Tensor,
        use_qk_l2norm: bool,
    ) -> KDARecurrentKey:
        heads, k_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
        block_k, block_v = warmreg.next_pow2(k_dim), _block_v(v_dim)
        return KDARecurrentKey(
            dtype=warmreg.dtype_name(q.dtype),
            gate_dtype=warmreg.dtype_name(raw_g.dtype),
            beta_dtype=warmreg.dtype_name(raw_beta.dtype),
            num_heads=heads,
            head_k_dim=k_dim,
            head_v_dim=v_dim,
            block_k=block_k,
            block_v=block_v,
            use_qk_l2norm=bool(use_qk_l2norm),
            has_dt_bias=dt_bias is not None,
            use_lower_bound=lower_bound is not None,
            q_stride=warmreg.int_class(q.stride(0)),
            k_stride=warmreg.int_class(k.stride(0)),
            v_stride=warmreg.int_class(v.stride(0)),
            q_aligned=warmreg.is_aligned(q),
            k_aligned=warmreg.is_aligned(k),
            v_aligned=warmreg.is_aligned(v),
            g_aligned=warmreg.is_aligned(raw_g),
            state_stride=warmreg.int_class(state_pool.stride(0)),
            state_aligned=warmreg.is_aligned(state_pool),
            num_warps=max(1, min(8, block_k * block_v // 1024)),
        )

    # -- the deployment's input space --------------------------------------------------------------
    def _token_counts(self) -> list[int]:
        """Decode steps: ``N * s`` tokens for N in {1, max_num_seqs}, s in {1, 1 + spec}.

        No key field depends on the count (T is not a kernel argument); the samples keep the
        warm plan honest about the shapes a step really has.
        """
        per_seq = {1, 1 + self.num_speculative_tokens}
        return sorted({n * s for n in {1, self.max_num_seqs} for s in per_seq})

    def _qkv(self, tokens: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as separate projections, or as views of one fused ``[T, H*(2K+V)]`` projection."""
        h, kd, vd = self.num_heads, self.head_k_dim, self.head_v_dim
        if not fused:
            return (
                warmreg.meta((tokens, h, kd), self.dtype),
                warmreg.meta((tokens, h, kd), self.dtype),
                warmreg.meta((tokens, h, vd), self.dtype),
            )
        width = h * (2 * kd + vd)
        q = warmreg.meta((tokens, h, kd), self.dtype, stride=(width, kd, 1))
        k = warmreg.meta((tokens, h, kd), self.dtype, stride=(width, kd, 1), offset=h * kd)
        v = warmreg.meta((tokens, h, vd), self.dtype, stride=(width, vd, 1), offset=2 * h * kd)
        return q, k, v

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h, kd, vd = self.num_heads, self.head_k_dim, self.head_v_dim
        views = [self._qkv(t, fused) for t in self._token_counts() for fused in (False, True)]
        return {
            "q": [q for q, _, _ in views],
            "k": [k for _, k, _ in views],
            "v": [v for _, _, v in views],
            "raw_g": [warmreg.meta((t, h, kd), self.gate_dtype) for t in self._token_counts()],
            "raw_beta": [warmreg.meta((t, h), self.beta_dtype) for t in self._token_counts()],
            "dt_bias": [warmreg.meta((h * kd,), torch.float32) if self.has_dt_bias else None],
            "lower_bound": [self.lower_bound],
            # One slot per running request plus the engine's padding slot; contiguous pool.
            "state_pool": [warmreg.meta((self.max_num_seqs + 1, h, kd, vd), torch.float32)],
            "use_qk_l2norm": [self.use_qk_l2norm],
        }

    def when(
        self,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        **_: Any,
    ) -> bool:
        # One step: every input has the same T, and q, k, v come from the same projection layout.
        same_t = q.shape[0] == k.shape[0] == v.shape[0] == raw_g.shape[0] == raw_beta.shape[0]
        return same_t and _is_view(q) == _is_view(k) == _is_view(v)

    def warmup_inputs(self, key: KDARecurrentKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        h, kd, vd = key.num_heads, key.head_k_dim, key.head_v_dim

        def act(dim: int, stride: warmreg.IntClass, aligned: bool) -> torch.Tensor:
            return warmreg.meta(
                (1, h, dim), dtype, stride=(warmreg.int_class_rep(stride), dim, 1), offset=0 if aligned else 1
            )

        return {
            "q": act(kd, key.q_stride, key.q_aligned),
            "k": act(kd, key.k_stride, key.k_aligned),
            "v": act(vd, key.v_stride, key.v_aligned),
            "raw_g": warmreg.meta((1, h, kd), getattr(torch, key.gate_dtype), offset=0 if key.g_aligned else 1),
            "raw_beta": warmreg.meta((1, h), getattr(torch, key.beta_dtype)),
            "A_log": warmreg.meta((h,), torch.float32),
            "dt_bias": warmreg.meta((h * kd,), torch.float32) if key.has_dt_bias else None,
            "lower_bound": -1.0 if key.use_lower_bound else None,  # any value: a runtime argument
            "cu_seqlens": warmreg.meta((2,), torch.int32),
            "state_pool": warmreg.meta(
                (1, h, kd, vd),
                torch.float32,
                stride=(warmreg.int_class_rep(key.state_stride), kd * vd, vd, 1),
                offset=0 if key.state_aligned else 1,
            ),
            "state_slots": warmreg.meta((1,), torch.int32),
            "use_qk_l2norm": key.use_qk_l2norm,
        }

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
        cu_seqlens: torch.Tensor,
        state_pool: torch.Tensor,
        state_slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[KDARecurrentKey]:
        """Run the gate, beta and the recurrence over each sequence's tokens; returns ``o`` ``[T, H, V]``
        (dtype of v; ``out``, or a fresh tensor). The arguments follow vLLM's ``fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log,
        dt_bias, lower_bound, ...)``; the math is in the module docstring.

        The final state of each sequence with a non-negative slot is written into ``state_pool``.

        :param q: ``[T, H, K]``, heads and K contiguous; the token stride is free (fused-projection view).
        :param k: ``[T, H, K]``, like ``q``.
        :param v: ``[T, H, V]``, like ``q``.
        :param raw_g: ``[T, H, K]`` contiguous, the raw gate projection (before bias and activation).
        :param raw_beta: ``[T, H]`` contiguous, the raw beta projection (before the sigmoid).
        :param A_log: float32, ``H`` contiguous elements (``[H]`` or the model's ``[1, 1, H, 1]``).
        :param dt_bias: float32, ``H * K`` contiguous elements (``[H * K]``), or None.
        :param lower_bound: the gate's lower bound (``< 0``), or None for the softplus gate.
        :param cu_seqlens: int32 ``[N + 1]``, token offsets of the N sequences; rows of ``o`` outside
            ``cu_seqlens[0] .. cu_seqlens[N]`` are left unwritten.
        :param state_pool: fp32 ``[num_slots, H, K, V]``; the slot stride is free, the rest contiguous.
        :param state_slots: int32 ``[N]``, each sequence's slot; negative: no state.
        :param scale: applied to q (default ``K ** -0.5``).
        :param use_qk_l2norm: L2-normalise q and k in the kernel (default: this instance's setting).
        :param out: a preallocated ``o``, contiguous, v's shape and dtype (then nothing is allocated; rows outside
            the sequences keep what they held).
        :raises LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out`` that is
            not the output's shape, dtype and layout.
        """
        self._check(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, cu_seqlens, state_pool, state_slots)
        l2norm = self.use_qk_l2norm if use_qk_l2norm is None else use_qk_l2norm
        key = self.dispatch(
            q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, dt_bias=dt_bias, lower_bound=lower_bound,
            state_pool=state_pool, use_qk_l2norm=l2norm,
        )  # fmt: skip
        o = warmreg.output(self.name, "out", out, v.shape, v.dtype, v.device)
        kwargs = dict(
            q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=raw_g, beta_ptr=raw_beta, a_log_ptr=A_log,
            dt_bias_ptr=A_log if dt_bias is None else dt_bias, o_ptr=o, state_ptr=state_pool,
            cu_seqlens_ptr=cu_seqlens, slots_ptr=state_slots,
            q_stride=q.stride(0), k_stride=k.stride(0), v_stride=v.stride(0), state_stride=state_pool.stride(0),
            scale=float(key.head_k_dim**-0.5 if scale is None else scale),
            lower_bound=0.0 if lower_bound is None else float(lower_bound),
            H=key.num_heads, K=key.head_k_dim, V=key.head_v_dim, BLOCK_K=key.block_k, BLOCK_V=key.block_v,
            USE_L2NORM=key.use_qk_l2norm, HAS_DT_BIAS=key.has_dt_bias, USE_LOWER_BOUND=key.use_lower_bound,
        )  # fmt: skip
        num_seqs = cu_seqlens.shape[0] - 1
        v_tiles = (key.head_v_dim + key.block_v - 1) // key.block_v  # not triton.cdiv: microseconds of host time
        grid = (num_seqs, key.num_heads, v_tiles) if num_seqs else None
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
        cu_seqlens: torch.Tensor,
        state_pool: torch.Tensor,
        state_slots: torch.Tensor,
    ) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
            fail(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, H, K], [T, H, K], [T, H, V]")
        t, h, kd = q.shape
        vd = v.shape[2]
        if raw_g.shape != q.shape or raw_beta.shape != (t, h):
            fail(
                f"raw_g {tuple(raw_g.shape)} and raw_beta {tuple(raw_beta.shape)} must be [T, H, K] = {(t, h, kd)}"
                " and [T, H]"
            )
        for name, x, dim in (("q", q, kd), ("k", k, kd), ("v", v, vd)):
            if x.stride(2) != 1 or x.stride(1) != dim:
                fail(f"{name} needs contiguous heads and head dim (strides (*, {dim}, 1), got {x.stride()})")
        if not (raw_g.is_contiguous() and raw_beta.is_contiguous()):
            fail("raw_g and raw_beta must be contiguous", fix="pass the gate and beta projections, not views of them")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            fail(f"q, k, v must share one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
        if not all(x.dtype.is_floating_point for x in (q, raw_g, raw_beta)):
            fail(f"q, raw_g and raw_beta must be floating point (got {q.dtype}, {raw_g.dtype}, {raw_beta.dtype})")
        params = (("A_log", A_log, h), ("dt_bias", dt_bias, h * kd))
        for name, p, numel in params:
            if p is not None and (p.dtype != torch.float32 or p.numel() != numel or not p.is_contiguous()):
                fail(
                    f"{name} must be float32 with {numel} contiguous elements (got {p.dtype} {tuple(p.shape)})",
                    fix="pass the layer's parameter ([H] for A_log, [H * K] for dt_bias), as the model holds it",
                )
        if lower_bound is not None and not lower_bound < 0:
            fail(f"lower_bound must be < 0 or None (got {lower_bound!r})")
        if state_pool.ndim != 4 or tuple(state_pool.shape[1:]) != (h, kd, vd):
            fail(f"state_pool {tuple(state_pool.shape)} must be [num_slots, H, K, V] with (H, K, V) = {(h, kd, vd)}")
        if state_pool.dtype != torch.float32:
            fail(f"state_pool must be float32 (got {state_pool.dtype})")
        if state_pool.stride()[1:] != (kd * vd, vd, 1):
            fail(f"state_pool needs contiguous [H, K, V] slots (got strides {state_pool.stride()})")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
            fail(f"cu_seqlens must be int32 [N + 1] (got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)})")
        if state_slots.shape != (cu_seqlens.shape[0] - 1,) or state_slots.dtype != torch.int32:
            fail(
                f"state_slots must be int32 [N] (got {state_slots.dtype} {tuple(state_slots.shape)}, N = {cu_seqlens.shape[0] - 1})"
            )
        tensors = [q, k, v, raw_g, raw_beta, A_log, cu_seqlens, state_pool, state_slots]
        devices = {x.device for x in (*tensors, *([] if dt_bias is None else [dt_bias]))}
        if len(devices) > 1:
            fail(f"all inputs must be on one device (got {sorted(map(str, devices))})")


def _is_view(x: torch.Tensor) -> bool:
    """Whether a ``[T, H, D]`` input is a view into a wider projection rather than its own tensor."""
    return x.storage_offset() != 0 or x.stride(0) != x.shape[1] * x.shape[2]


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


def kda_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: the gate (:func:`kda_gate_reference`) and ``beta = sigmoid(raw_beta)`` in fp32,
    then the recurrence token by token in fp32, one cast of ``o`` at the end.

    :returns: ``(o, pool)``: ``o`` ``[T, H, V]`` in v's dtype (zeros outside the sequences) and a
        copy of ``state_pool`` with the final states written; the input pool is not modified.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = kda_gate_reference(raw_g, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(raw_beta.float())
    pool = state_pool.clone()
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_slots.tolist()):
        s = pool[slot].clone() if slot >= 0 else q.new_zeros((q.shape[1], q.shape[2], v.shape[2]), dtype=torch.float32)
        for t in range(bounds[n], bounds[n + 1]):
            qt, kt = q[t].float(), k[t].float()  # [H, K]
            if use_qk_l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + L2NORM_EPS)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + L2NORM_EPS)
            s = s * torch.exp(g[t])[..., None]
            u = beta[t][:, None] * (v[t].float() - torch.einsum("hkv,hk->hv", s, kt))
            s = s + kt[..., None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, qt * scale)
        if slot >= 0:
            pool[slot] = s
    return o.to(v.dtype), pool


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the KDA step when ``text.linear_attn_config.kda_layers`` is non-empty (every platform).

    Reads the layout with :func:`warmreg_kimi_k3.backends.kda_layout`; the raw gate and beta are in the
    model dtype and the layers have a ``dt_bias``, as vLLM's Kimi-K3 KDA layer (``vllm/models/kimi_k3/
    nvidia/kda.py``) passes them to ``fused_recurrent_kda``.

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a tensor-parallel size that
        does not divide the KDA head count.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return  # a pure-MLA config, or no KDA layers
    registry.add(
        KDARecurrent(
            num_heads=layout.num_heads,
            head_k_dim=layout.head_dim,
            head_v_dim=layout.head_dim,
            dtype=m.dtype,
            gate_dtype=m.dtype,  # raw projections, in the model dtype
            beta_dtype=m.dtype,
            use_qk_l2norm=True,  # Kimi-Linear normalises q and k inside the kernel
            has_dt_bias=True,  # an assumption: Kimi-Linear's KDA layer always has one (examples/kimi_k3.json)
            lower_bound=layout.lower_bound,
            max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
            num_speculative_tokens=layout.num_speculative_tokens,
            plugin=PLUGIN,
        )
    )
