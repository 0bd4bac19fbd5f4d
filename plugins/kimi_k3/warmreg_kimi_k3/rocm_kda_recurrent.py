"""ROCm's KDA recurrent step: vLLM's AMD copy of ``fused_recurrent_kda``, with its own launch table.

The op of ``vllm/models/kimi_k3/amd/ops/third_party/kda/fused_recurrent.py: fused_recurrent_kda``
(``fused_recurrent_kda_fwd_kernel``, the gate always fused on ROCm), which ``vllm/models/kimi_k3/amd/kda.py:
KimiK3DeltaAttention._forward`` launches for the speculative rows of a step (unless aiter's Gluon spec decode takes a
step of speculative rows alone: ``rocm:gfx950+aiter``), with ``[N, 1 + spec]`` state indices, accepted counts and the
builder's ``uniform_spec_sequence_length``, and for the plain decodes a mixed batch peels off before its prefills
(1-D indices, one token a sequence).

The math is the KDA recurrent step of :mod:`warmreg_kimi_k3.kda` (the same gate, :func:`warmreg_kimi_k3.kda.kda_gate`,
beta's sigmoid, the state in ``[slots, H, V, K]``, every token's state written at its column's slot ``> 0``), with
ROCm's L2 normalisation ``q * rsqrt(sum(q * q) + 1e-6)`` (NVIDIA's divides by ``sqrt``). A sequence whose initial slot
is ``<= 0`` gets zero rows (vLLM zeroes its first row only). Launch, as vLLM's ``_get_static_sequence_length`` and
``_select_kda_launch_config`` pick it from ``N``, ``T``, ``H`` and the uniform length:

* ``IS_SINGLE_SEQUENCE`` (a speculative step of one sequence: ``T`` a static loop length) or ``SEQUENCE_LENGTH`` (a
  uniform speculative length ``L > 1`` with ``H * N <= 192``: ``bos = n * L`` without reading ``cu_seqlens``);
* static lengths: ``BV`` 4 (``H * N <= 24``) or 8, one warp, ``num_stages`` 2 / 8 or 4 / 6 / 10 / 12 by length;
* else speculative: ``(4, 1, 4 or 2)`` up to 24 head-sequences, ``(8, 1, 4)`` up to 48 with multi-token rows,
  ``(8, 1, 2)`` with them beyond, ``(32, 4, 2)`` without; plain decodes ``(32, 4, 2)``.

Key: the dtypes, H/K/V and tiles, the constexpr flags, the static length, ``num_warps`` and ``num_stages``. Unlike
vLLM's kernel, whose six strides and ``scale`` are constexprs, the strides are runtime ints that are not specialized
(nor is any pointer on alignment): one binary serves every layout of a launch class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kda_layout
from .kda import KDARecurrent, kda_gate
from .model import PLUGIN, KimiK3

__all__ = ["ROCmKDARecurrent", "ROCmKDARecurrentKey", "rocm_launch", "register"]

_INTS = ["stride_qkv_token", "stride_g_token", "stride_beta_token", "stride_state_slot", "stride_indices_seq"]
_PTRS = ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "a_log_ptr", "dt_bias_ptr", "o_ptr", "state_ptr",
         "cu_seqlens_ptr", "indices_ptr", "accepted_ptr"]  # fmt: skip


def rocm_launch(
    *, heads: int, num_seqs: int, tokens: int, spec: bool, uniform: int | None
) -> tuple[int, int, int, int]:
    """``(static length, BV, num_warps, num_stages)`` of vLLM's ROCm launch (the module docstring's table); the
    static length is the single sequence's ``T``, the uniform length, or 0 (read from ``cu_seqlens``)."""
    hs = heads * num_seqs
    if spec and num_seqs == 1:
        static = tokens
    elif uniform is not None and uniform > 1 and hs <= 192:
        static = uniform
    else:
        static = 0
    if static:
        bv = 4 if hs <= 24 else 8
        if static == 1:
            stages = 2
        elif static <= 3:
            stages = 8 if hs <= 24 else 4
        else:
            stages = 6 if static <= 6 else 10 if static <= 10 else 12
        return static, bv, 1, stages
    if spec:
        multi = tokens > num_seqs
        if hs <= 24:
            return 0, 4, 1, 4 if multi else 2
        return (0, 8, 1, 4 if hs <= 48 else 2) if multi else (0, 32, 4, 2)
    return 0, 32, 4, 2


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _rocm_kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr,  # [1, T, H, K], [1, T, H, K], [1, T, H, V]: one token stride
    g_ptr,  # [1, T, H, K] the raw gate projection
    beta_ptr,  # [1, T, H] the raw beta projection
    a_log_ptr,  # [H] float32
    dt_bias_ptr,  # [H * K] float32 (A_log when HAS_DT_BIAS is False: unread)
    o_ptr,  # [1, T, H, V] contiguous
    state_ptr,  # [slots, H, V, K]
    cu_seqlens_ptr,  # [N + 1] int32 (unread with a static length)
    indices_ptr,  # [N, C] or [N] int32
    accepted_ptr,  # [N] int32 (the indices when IS_SPEC is False: unread)
    stride_qkv_token, stride_g_token, stride_beta_token, stride_state_slot, stride_indices_seq,
    scale,
    lower_bound,  # read only when USE_LOWER_BOUND
    H: tl.constexpr,  # heads on this rank
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next_pow2(K)
    BLOCK_V: tl.constexpr,  # vLLM's BV
    IS_SPEC: tl.constexpr,  # the initial state at column num_accepted_tokens[n] - 1 (else column 0)
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    SINGLE_SEQUENCE: tl.constexpr,  # one sequence: the program's (sequence, head) index is the head
    SEQUENCE_LENGTH: tl.constexpr,  # a static token count of every sequence (0: read cu_seqlens)
    LOOP_STAGES: tl.constexpr,  # the token loop's pipelining depth (the key's num_stages)
):  # fmt: skip
    pid = tl.program_id(0)
    v_tiles = tl.cdiv(V, BLOCK_V)
    i_v, nh = pid % v_tiles, pid // v_tiles
    if SINGLE_SEQUENCE:
        n, h = nh * 0, nh
    else:
        n, h = nh // H, nh % H
    if SEQUENCE_LENGTH:
        bos = n.to(tl.int64) * SEQUENCE_LENGTH
        length = SEQUENCE_LENGTH
    else:
        bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
        length = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - bos
    if length == 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_s = mask_v[:, None] & mask_k[None, :]
    row = indices_ptr + n.to(tl.int64) * stride_indices_seq
    if IS_SPEC:
        first = tl.load(row + tl.load(accepted_ptr + n).to(tl.int64) - 1).to(tl.int64)
    else:
        first = tl.load(row).to(tl.int64)
    o_ptrs = o_ptr + bos * (H * V) + h * V + offs_v
    if first <= 0:  # the null or a padding slot: zero rows, no state read or written
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
        q *= tl.rsqrt(tl.sum(q * q) + 1e-6)  # ROCm's normalisation (L2NORM_EPS)
        k *= tl.rsqrt(tl.sum(k * k) + 1e-6)
        q *= scale
        x = tl.load(g_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if HAS_DT_BIAS:
            x += bias
        g = kda_gate(x, a, lower_bound, USE_LOWER_BOUND)
        s *= tl.exp(g[None, :])
        u = v - tl.sum(s * k[None, :], axis=1)
        u *= tl.sigmoid(tl.load(beta_ptrs, eviction_policy="evict_last").to(tl.float32))
        s += u[:, None] * k[None, :]
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


@attrs.frozen(kw_only=True)
class ROCmKDARecurrentKey(warmreg.CompileKey):
    """What changes the binary of ROCm's KDA recurrent step: no stride, size or alignment does."""

    dtype: str  # q, k, v and out
    gate_dtype: str
    beta_dtype: str
    state_dtype: str
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    block_k: int
    block_v: int
    is_spec_decoding: bool
    has_dt_bias: bool
    use_lower_bound: bool
    single_sequence: bool
    sequence_length: int  # the static loop length (0: cu_seqlens)
    num_warps: int
    num_stages: int


class ROCmKDARecurrent(KDARecurrent):
    """ROCm's KDA recurrent step of one deployment (the module docstring has the math and the launch table); the
    constructor, the checks and the reference are :class:`~warmreg_kimi_k3.kda.KDARecurrent`'s."""

    name = "kimi_k3.rocm_kda_recurrent"
    key_type = ROCmKDARecurrentKey  # type: ignore[assignment]
    jit = _rocm_kda_recurrent_kernel

    def dispatch(  # type: ignore[override]
        self, *, q: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor, dt_bias: torch.Tensor | None,
        lower_bound: float | None, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None, uniform_sequence_length: int | None,
    ) -> ROCmKDARecurrentKey:  # fmt: skip
        heads, k_dim, n, spec = q.shape[2], q.shape[3], cu_seqlens.shape[0] - 1, num_accepted_tokens is not None
        static, bv, warps, stages = rocm_launch(heads=heads, num_seqs=n, tokens=q.shape[1], spec=spec,
                                                uniform=uniform_sequence_length)  # fmt: skip
        return ROCmKDARecurrentKey(
            dtype=warmreg.dtype_name(q.dtype), gate_dtype=warmreg.dtype_name(raw_g.dtype),
            beta_dtype=warmreg.dtype_name(raw_beta.dtype), state_dtype=warmreg.dtype_name(initial_state.dtype),
            num_heads=heads, head_k_dim=k_dim, head_v_dim=initial_state.shape[2], block_k=warmreg.next_pow2(k_dim),
            block_v=bv, is_spec_decoding=spec, has_dt_bias=dt_bias is not None, use_lower_bound=lower_bound is not None,
            single_sequence=spec and n == 1, sequence_length=static, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """The plain decodes of a mixed batch (``N`` one-token rows, 1-D indices) and, with speculation, the
        speculative rows: one sequence of ``1 .. 1 + spec`` tokens, and ``N`` sequences at each launch bucket,
        uniform (``2 .. 1 + spec`` tokens each), or not, with and without multi-token rows."""
        h, kd, vd, spec = self.num_heads, self.head_k_dim, self.head_v_dim, self.num_speculative_tokens
        top = self.max_num_seqs
        counts = sorted({n for b in (24, 48, 192) for n in (b // h, b // h + 1) if 1 <= n <= top} | {1, 2, top})
        steps: list[tuple[int, int, int | None, bool]] = [(n, n, None, False) for n in counts]  # (N, T, L, spec)
        if spec:
            steps += [(1, t, t, True) for t in range(1, 2 + spec)]
            for n in (c for c in counts if c > 1):
                steps += [(n, n * (1 + spec), None, True), (n, n, None, True)]
                steps += [(n, n * u, u, True) for u in range(2, 2 + spec)]
        points = []
        for n, t, uniform, is_spec in steps:
            points.append({
                "q": warmreg.meta((1, t, h, kd), self.dtype), "raw_g": warmreg.meta((1, t, h, kd), self.gate_dtype),
                "raw_beta": warmreg.meta((1, t, h), self.beta_dtype),
                "dt_bias": warmreg.meta((h * kd,), torch.float32) if self.has_dt_bias else None,
                "lower_bound": self.lower_bound,
                "initial_state": warmreg.meta((top + 1, h, vd, kd), self.state_dtype),
                "cu_seqlens": warmreg.meta((n + 1,), torch.int32),
                "num_accepted_tokens": warmreg.meta((n,), torch.int32) if is_spec else None,
                "uniform_sequence_length": uniform,
            })  # fmt: skip
        return points

    def warmup_inputs(self, key: ROCmKDARecurrentKey) -> Mapping[str, Any]:  # type: ignore[override]
        h, kd, vd = key.num_heads, key.head_k_dim, key.head_v_dim
        n, t, uniform = _example_step(key)
        dt = getattr(torch, key.dtype)
        return {
            "q": warmreg.meta((1, t, h, kd), dt), "k": warmreg.meta((1, t, h, kd), dt),
            "v": warmreg.meta((1, t, h, vd), dt), "raw_g": warmreg.meta((1, t, h, kd), getattr(torch, key.gate_dtype)),
            "raw_beta": warmreg.meta((1, t, h), getattr(torch, key.beta_dtype)), "A_log": warmreg.meta((h,), torch.float32),
            "dt_bias": warmreg.meta((h * kd,), torch.float32) if key.has_dt_bias else None,
            "lower_bound": -1.0 if key.use_lower_bound else None,
            "initial_state": warmreg.meta((2, h, vd, kd), getattr(torch, key.state_dtype)),
            "cu_seqlens": warmreg.meta((n + 1,), torch.int32),
            "ssm_state_indices": warmreg.meta((n, max(t, 2)), torch.int32) if key.is_spec_decoding
            else warmreg.meta((n,), torch.int32),
            "num_accepted_tokens": warmreg.meta((n,), torch.int32) if key.is_spec_decoding else None,
            "uniform_sequence_length": uniform,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None, initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor, ssm_state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None = None,
        uniform_sequence_length: int | None = None, out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[ROCmKDARecurrentKey]:  # fmt: skip
        """One recurrent step of each sequence over its tokens, vLLM ROCm's ``fused_recurrent_kda`` (same arguments;
        the parameters, returns and errors of :meth:`warmreg_kimi_k3.kda.KDARecurrent.__call__`, without
        ``launch_pdl``), ``uniform_sequence_length`` the builder's uniform speculative length or None.

        :raises warmreg.LaunchError: as :meth:`~warmreg_kimi_k3.kda.KDARecurrent.__call__`, and for a uniform
            length that is not ``T / N`` of a speculative step.
        """
        self._check(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                    ssm_state_indices, num_accepted_tokens)  # fmt: skip
        n = cu_seqlens.shape[0] - 1
        if uniform_sequence_length is not None and (
            num_accepted_tokens is None or uniform_sequence_length <= 0 or n * uniform_sequence_length != q.shape[1]
        ):
            raise warmreg.LaunchError(
                self.name, f"uniform_sequence_length {uniform_sequence_length} must be T / N = {q.shape[1]} / {n} "
                "of a speculative step (with num_accepted_tokens)",
            )  # fmt: skip
        key = self.dispatch(
            q=q, raw_g=raw_g, raw_beta=raw_beta, dt_bias=dt_bias, lower_bound=lower_bound, initial_state=initial_state,
            cu_seqlens=cu_seqlens, num_accepted_tokens=num_accepted_tokens, uniform_sequence_length=uniform_sequence_length,
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
            SINGLE_SEQUENCE=key.single_sequence, SEQUENCE_LENGTH=key.sequence_length, LOOP_STAGES=key.num_stages,
        )  # fmt: skip
        grid = (triton.cdiv(key.head_v_dim, key.block_v) * n * key.num_heads,) if n else None
        return warmreg.LaunchSpec(key, grid, kwargs, o)


def _example_step(key: ROCmKDARecurrentKey) -> tuple[int, int, int | None]:
    """A step ``(N, T, uniform)`` that launches ``key`` (for :meth:`ROCmKDARecurrent.warmup_inputs`)."""
    want = (key.sequence_length, key.block_v, key.num_warps, key.num_stages, key.single_sequence)
    spec = key.is_spec_decoding
    for n in range(1, 1 << 12):
        steps: list[tuple[int, int | None]] = [(n, None)]
        if spec:
            steps = [(t, None) for t in range(n, 17 * n)] + [(n * u, u) for u in range(2, 17)]
        for t, uniform in steps:
            launch = rocm_launch(heads=key.num_heads, num_seqs=n, tokens=t, spec=spec, uniform=uniform)
            if (*launch, spec and n == 1) == want:
                return n, t, uniform
    raise warmreg.LaunchError("kimi_k3.rocm_kda_recurrent", f"no step launches {key}")


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the step on ROCm when there are KDA layers: every mixed batch's plain decodes, and with speculation
    the speculative rows (aiter's Gluon decode takes only steps of speculative rows alone, so mixed steps still come
    here); the projection layouts are not in the key.

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return
    kernel = ROCmKDARecurrent.from_layout(layout, max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN))
    registry.add(kernel, when=warmreg.is_rocm)
