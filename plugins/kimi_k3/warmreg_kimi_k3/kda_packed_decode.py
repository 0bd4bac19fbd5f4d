"""Kimi Delta Attention's plain decode step straight from the packed conv output: one token per sequence.

The op of ``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py: fused_recurrent_kda_packed_decode``
(``fused_recurrent_kda_packed_decode_kernel``), which ``vllm/models/kimi_k3/nvidia/kda.py:
KimiK3DeltaAttention._forward`` launches for a batch of plain decodes (no prefill among the non-speculative rows)
when the decode backend resolved to ``"triton"``, right after ``causal_conv1d_update`` wrote the packed q/k/v rows.

The math is the KDA recurrent step's (:mod:`warmreg_kimi_k3.kda`, gate :func:`warmreg_kimi_k3.kda.kda_gate`, q and k
always L2-normalised, ``dt_bias`` always present) with one token per sequence ``n``::

    q, k, v = mixed_qkv[n, 0:HK], mixed_qkv[n, HK:2HK], mixed_qkv[n, 2HK:2HK+HV]   (per head: [K], [K], [V])
    slot = state_indices[n];  slot <= 0 (the null block 0 or a padded -1): o[n] = 0, the state untouched
    S = state[slot, h]                                          # [V, K]: vLLM's pool layout of this kernel
    S = S * exp(g)[None, :];  u = sigmoid(raw_beta[n, h]) * (v - S k);  S = S + u k^T;  o = S (q * scale)
    state[slot, h] = S

Differences from vLLM's launch, so that one binary serves every engine layout: the token strides of ``mixed_qkv``
and ``raw_g`` and the pool's slot stride are specialized integers (vLLM: constexprs; ``mixed_qkv`` is the conv's
``empty_like`` output, whose row stride is ``3P`` for a batch of several rows and the projection's own row for a
batch of one), and ``scale`` is a runtime float (vLLM: a constexpr, always ``K ** -0.5``). The output is a fresh
``[1, B, H, V]`` tensor (vLLM writes into ``core_attn_out`` or an equal fresh one). As in vLLM, ``stride_beta_token``
(beta is a column of the projection, or a gathered copy) and ``stride_state_indices`` (a block-table column or a
staged copy) are not specialized at all.
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

from .backends import KDALayout, kda_decode_backend, kda_layout
from .causal_conv1d import projection_row_stride
from .causal_conv1d_update import overlap_rows
from .kda import MAX_BLOCK_V, kda_gate, kda_recurrent_reference
from .model import PLUGIN, KimiK3

__all__ = ["KDAPackedDecode", "KDAPackedDecodeKey", "kda_packed_decode_reference", "register"]

_SCALARS = ["beta_ptr", "a_log_ptr", "dt_bias_ptr", "state_indices_ptr"]


# beta, A_log and the state index are read one scalar at a time, dt_bias (a parameter) once a program: their
# alignment cannot change the code. The two strides vLLM leaves unspecialized are left so here too.
@triton.jit(do_not_specialize=["stride_beta_token", "stride_state_indices"], do_not_specialize_on_alignment=_SCALARS)
def _kda_packed_decode_kernel(
    mixed_ptr,  # [B, >= 2HK + HV]: q | k | v of each token, channels contiguous
    g_ptr,  # [1, B, H, K] the raw gate projection
    beta_ptr,  # [1, B, H] the raw beta projection
    a_log_ptr,  # [H] float32
    dt_bias_ptr,  # [H * K] float32
    o_ptr,  # [1, B, H, V], fresh and contiguous
    state_ptr,  # [slots, H, V, K] float32
    state_indices_ptr,  # [B] int32
    stride_mixed_token,  # 3P, or the projection's row for a batch of one
    stride_g_token,
    stride_beta_token,
    stride_state_token,  # the engine's page stride
    stride_state_indices,
    scale,
    lower_bound,  # a runtime float: read only when USE_LOWER_BOUND
    H: tl.constexpr,  # heads on this rank: a model constant
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BLOCK_K: tl.constexpr,  # next_pow2(K): one tile covers K (S k and the L2 norm)
    BLOCK_V: tl.constexpr,  # min(next_pow2(V), 32): V is split over grid axis 0
    USE_LOWER_BOUND: tl.constexpr,  # gate = lb * sigmoid(...) instead of -exp(A_log) * softplus(...)
    USE_PDL: tl.constexpr,  # programmatic dependent launch
):
    nh = tl.program_id(1)
    n, h = nh // H, nh % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    slot = tl.load(state_indices_ptr + n * stride_state_indices).to(tl.int64)
    o_ptrs = o_ptr + (n * H + h) * V + offs_v
    if slot <= 0:
        tl.store(o_ptrs, tl.zeros([BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v)
        return
    s_ptrs = state_ptr + slot * stride_state_token + h * V * K + offs_v[:, None] * K + offs_k[None, :]
    mask_s = mask_v[:, None] & mask_k[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    row = mixed_ptr + n.to(tl.int64) * stride_mixed_token
    q = tl.load(row + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(row + (H + h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * H * K + h * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)  # L2NORM_EPS of the recurrent step
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    x = tl.load(g_ptr + n.to(tl.int64) * stride_g_token + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    x = x + tl.load(dt_bias_ptr + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    g = kda_gate(x, a, lower_bound, USE_LOWER_BOUND)
    beta = tl.sigmoid(tl.load(beta_ptr + n.to(tl.int64) * stride_beta_token + h).to(tl.float32))
    s = s * tl.exp(g)[None, :]
    u = beta * (v - tl.sum(s * k[None, :], axis=1))
    s = s + u[:, None] * k[None, :]
    o = tl.sum(s * (q * scale)[None, :], axis=1)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptrs, s, mask=mask_s)


@attrs.frozen(kw_only=True)
class KDAPackedDecodeKey(warmreg.CompileKey):
    """What changes the binary of the packed KDA decode step."""

    dtype: str  # mixed_qkv and o
    gate_dtype: str  # the raw gate projection
    beta_dtype: str  # the raw beta projection
    num_heads: int  # H (constexpr)
    head_k_dim: int  # K
    head_v_dim: int  # V
    block_k: int
    block_v: int
    use_lower_bound: bool  # USE_LOWER_BOUND (the bound's value is a runtime float)
    mixed_stride: warmreg.IntClass
    g_stride: warmreg.IntClass
    state_stride: warmreg.IntClass
    mixed_aligned: bool
    g_aligned: bool
    state_aligned: bool
    num_warps: int
    num_stages: int
    launch_pdl: bool


class KDAPackedDecode(warmreg.TritonKernel[KDAPackedDecodeKey]):
    """The packed KDA decode step of one deployment; the configuration shapes :meth:`domains` only.

    :param layout: the KDA layout (:func:`warmreg_kimi_k3.backends.kda_layout`).
    :param overlap_rows: whether decode steps may see the projection-overlap path's ``[T, 4P]`` rows.
    :param max_num_seqs: the most sequences in a step.
    """

    name = "kimi_k3.kda_packed_decode"
    key_type = KDAPackedDecodeKey
    jit = _kda_packed_decode_kernel

    def __init__(self, *, layout: KDALayout, overlap_rows: bool = False, max_num_seqs: int = 1) -> None:
        self.layout, self.overlap_rows, self.max_num_seqs = layout, overlap_rows, max_num_seqs

    def dispatch(
        self,
        *,
        mixed_qkv: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        lower_bound: float | None,
        initial_state: torch.Tensor,
        launch_pdl: bool,
    ) -> KDAPackedDecodeKey:
        heads, v_dim, k_dim = initial_state.shape[1:]
        return KDAPackedDecodeKey(
            dtype=warmreg.dtype_name(mixed_qkv.dtype), gate_dtype=warmreg.dtype_name(raw_g.dtype),
            beta_dtype=warmreg.dtype_name(raw_beta.dtype), num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim,
            block_k=warmreg.next_pow2(k_dim), block_v=min(warmreg.next_pow2(v_dim), MAX_BLOCK_V),
            use_lower_bound=lower_bound is not None, mixed_stride=warmreg.int_class(mixed_qkv.stride(0)),
            g_stride=warmreg.int_class(raw_g.stride(1)), state_stride=warmreg.int_class(initial_state.stride(0)),
            mixed_aligned=warmreg.is_aligned(mixed_qkv), g_aligned=warmreg.is_aligned(raw_g),
            state_aligned=warmreg.is_aligned(initial_state), num_warps=4, num_stages=2, launch_pdl=bool(launch_pdl),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """``mixed_qkv`` as the conv's output: ``[B, 3P]`` rows of a batch of several, or one row of the projection
        (``row`` or the overlap path's ``4P``) for a batch of one; the gate ``[1, B, H, K]`` (a slice of the gate
        projection's rows, or a gathered copy); beta a column of the projection; a contiguous fp32 pool."""
        lay, n = self.layout, self.max_num_seqs
        dt, h, d, p = getattr(torch, lay.dtype), lay.num_heads, lay.head_dim, lay.projection_size
        widths = [projection_row_stride(lay), *([4 * p] if self.overlap_rows else [])]
        mixed = [warmreg.meta((n, 3 * p), dt)]
        if not platform.is_rocm:  # ROCm's layer gives the conv update a fresh [B, 3P] output, even for one row
            mixed += [warmreg.meta((1, w), dt)[:, : 3 * p] for w in widths]
        row = projection_row_stride(lay)
        return {
            "mixed_qkv": mixed,
            "raw_g": [warmreg.meta((1, n, h, d), dt)],
            "raw_beta": [warmreg.meta((n, row), dt)[:, 4 * p + d : 4 * p + d + h].unsqueeze(0)],
            "lower_bound": [lay.lower_bound],
            "initial_state": [warmreg.meta((n + 1, h, d, d), torch.float32)],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: KDAPackedDecodeKey) -> Mapping[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        width = 2 * h * kd + h * vd
        g_row = warmreg.int_class_rep(key.g_stride)
        return {
            "mixed_qkv": warmreg.meta((1, width), dt, stride=(warmreg.int_class_rep(key.mixed_stride), 1),
                                      offset=0 if key.mixed_aligned else 1),
            "raw_g": warmreg.meta((1, 1, h, kd), getattr(torch, key.gate_dtype), stride=(g_row, g_row, kd, 1),
                                  offset=0 if key.g_aligned else 1),
            "raw_beta": warmreg.meta((1, 1, h), getattr(torch, key.beta_dtype)),
            "A_log": warmreg.meta((h,), torch.float32),
            "dt_bias": warmreg.meta((h * kd,), torch.float32),
            "lower_bound": -1.0 if key.use_lower_bound else None,  # any value: a runtime argument
            "initial_state": warmreg.meta((1, h, vd, kd), torch.float32,
                                          stride=(warmreg.int_class_rep(key.state_stride), vd * kd, kd, 1),
                                          offset=0 if key.state_aligned else 1),
            "state_indices": warmreg.meta((1,), torch.int32),
            "launch_pdl": key.launch_pdl,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        mixed_qkv: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,  # the model's parameter name
        dt_bias: torch.Tensor,
        lower_bound: float | None,
        initial_state: torch.Tensor,
        state_indices: torch.Tensor,
        *,
        scale: float | None = None,
        launch_pdl: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[KDAPackedDecodeKey]:
        """One decode step of each sequence from its packed q/k/v row, updating its state; returns ``o``
        ``[1, B, H, V]`` (dtype of ``mixed_qkv``; ``out``, or a fresh tensor), zeros for sequences on slot ``<= 0``. The arguments follow
        vLLM's ``fused_recurrent_kda_packed_decode``; the math is in the module docstring.

        :param mixed_qkv: ``[B, 2HK + HV]``, channels contiguous; the row stride is free.
        :param raw_g: ``[1, B, H, K]``, heads and K contiguous; the token stride is free.
        :param raw_beta: ``[1, B, H]``, heads contiguous; the token stride is free.
        :param A_log: float32, ``H`` contiguous elements.
        :param dt_bias: float32, ``H * K`` contiguous elements.
        :param lower_bound: the gate's lower bound (``< 0``), or None for the softplus gate.
        :param initial_state: fp32 ``[slots, H, V, K]``, updated in place; the slot stride is free.
        :param state_indices: int32 ``[B]``, each sequence's slot (``<= 0``: none); stride free.
        :param scale: applied to q (default ``K ** -0.5``).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated ``o``, contiguous ``[1, B, H, V]`` of mixed_qkv's dtype (then nothing is
            allocated; every element is written).
        :raises LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out`` that is
            not the output's shape, dtype and layout.
        """
        self._check(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, state_indices)
        if launch_pdl is None:
            local = warmreg.runtime_platform()
            launch_pdl = bool(local and local.supports_pdl)
        key = self.dispatch(mixed_qkv=mixed_qkv, raw_g=raw_g, raw_beta=raw_beta, lower_bound=lower_bound,
                            initial_state=initial_state, launch_pdl=launch_pdl)  # fmt: skip
        b, h, vd = mixed_qkv.shape[0], key.num_heads, key.head_v_dim
        o = warmreg.output(self.name, "out", out, (1, b, h, vd), mixed_qkv.dtype, mixed_qkv.device)
        kwargs = dict(
            mixed_ptr=mixed_qkv, g_ptr=raw_g, beta_ptr=raw_beta, a_log_ptr=A_log, dt_bias_ptr=dt_bias, o_ptr=o,
            state_ptr=initial_state, state_indices_ptr=state_indices, stride_mixed_token=mixed_qkv.stride(0),
            stride_g_token=raw_g.stride(1), stride_beta_token=raw_beta.stride(1),
            stride_state_token=initial_state.stride(0), stride_state_indices=state_indices.stride(0),
            scale=float(key.head_k_dim**-0.5 if scale is None else scale),
            lower_bound=0.0 if lower_bound is None else float(lower_bound),
            H=h, K=key.head_k_dim, V=vd, BLOCK_K=key.block_k, BLOCK_V=key.block_v,
            USE_LOWER_BOUND=key.use_lower_bound, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = ((vd + key.block_v - 1) // key.block_v, b * h) if b else None
        return warmreg.LaunchSpec(key, grid, kwargs, o)

    def _check(
        self,
        mixed: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        lower_bound: float | None,
        state: torch.Tensor,
        indices: torch.Tensor,
    ) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if state.ndim != 4 or state.dtype != torch.float32:
            fail(f"initial_state must be float32 [slots, H, V, K] (got {state.dtype} {tuple(state.shape)})")
        h, vd, kd = state.shape[1:]
        if state.stride()[1:] != (vd * kd, kd, 1):
            fail(f"initial_state needs contiguous [H, V, K] slots (got strides {state.stride()})")
        if mixed.ndim != 2 or mixed.shape[1] != h * (2 * kd + vd) or mixed.stride(1) != 1:
            fail(f"mixed_qkv {tuple(mixed.shape)} must be [B, {h * (2 * kd + vd)}] with contiguous channels",
                 fix="pass the conv update's packed q/k/v output")  # fmt: skip
        b = mixed.shape[0]
        if raw_g.shape != (1, b, h, kd) or raw_g.stride()[2:] != (kd, 1):
            fail(f"raw_g {tuple(raw_g.shape)} must be [1, B, H, K] = {(1, b, h, kd)}, contiguous within a token")
        if raw_beta.shape != (1, b, h) or raw_beta.stride(2) != 1:
            fail(f"raw_beta {tuple(raw_beta.shape)} must be [1, B, H] = {(1, b, h)} with contiguous heads")
        if not all(x.dtype.is_floating_point for x in (mixed, raw_g, raw_beta)):
            dtypes = f"{mixed.dtype}, {raw_g.dtype}, {raw_beta.dtype}"
            fail(f"mixed_qkv, raw_g, raw_beta must be floating point (got {dtypes})")
        for name, p, numel in (("A_log", A_log, h), ("dt_bias", dt_bias, h * kd)):
            if p.dtype != torch.float32 or p.numel() != numel or not p.is_contiguous():
                fail(f"{name} must be float32 with {numel} contiguous elements (got {p.dtype} {tuple(p.shape)})",
                     fix="pass the layer's parameter ([H] for A_log, [H * K] for dt_bias), as the model holds it")  # fmt: skip
        if lower_bound is not None and not lower_bound < 0:
            fail(f"lower_bound must be < 0 or None (got {lower_bound!r})")
        if indices.shape != (b,) or indices.dtype != torch.int32:
            fail(f"state_indices must be int32 [B] with B = {b} (got {indices.dtype} {tuple(indices.shape)})")
        devices = {x.device for x in (mixed, raw_g, raw_beta, A_log, dt_bias, state, indices)}
        if len(devices) > 1:
            fail(f"all inputs must be on one device (got {sorted(map(str, devices))})")


def kda_packed_decode_reference(
    mixed_qkv: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: :func:`warmreg_kimi_k3.kda.kda_recurrent_reference` (vLLM's convention: the ``[V, K]``
    pool, slots ``<= 0`` give zeros and no state) on the column slices of ``mixed_qkv``, one token a sequence.

    :returns: ``(o, state)``: ``o`` ``[1, B, H, V]`` in ``mixed_qkv``'s dtype and a copy of ``initial_state`` with
        the new states; the input is not modified.
    """
    b = mixed_qkv.shape[0]
    h, vd, kd = initial_state.shape[1:]
    q, k, v = (mixed_qkv[:, s : s + h * w].reshape(1, b, h, w) for s, w in ((0, kd), (h * kd, kd), (2 * h * kd, vd)))
    cu_seqlens = torch.arange(b + 1, dtype=torch.int32)
    return kda_recurrent_reference(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, state_indices, scale=scale
    )


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the packed decode step on CUDA and ROCm when :func:`warmreg_kimi_k3.backends.kda_decode_backend` is
    ``"triton"`` (native and FlashInfer fuse the whole decode; with speculation vLLM resolves every decode backend
    to Triton, and its plain-decode steps, e.g. one-token rows with no speculative row, run this kernel). On ROCm
    the backend is ``"triton"`` unless aiter's Gluon decode or the HIP fused decode takes the plain decodes; then
    ``vllm/models/kimi_k3/amd/kda.py: KimiK3DeltaAttention._forward`` launches ROCm's copy of the kernel
    (``amd/ops/third_party/kda/fused_recurrent.py``: the same math and layouts, without PDL, its
    ``stride_beta_token`` a constexpr) on the same arguments for a pure non-speculative decode batch, after the
    conv update wrote a fresh ``[B, 3P]`` output.

    :raises warmreg.ConfigError: for an unknown or refused ``serving.kda_decode_backend``.
    """
    layout = kda_layout(m, config)
    if layout is None or kda_decode_backend(m, config, platform) != "triton":
        return
    kernel = KDAPackedDecode(
        layout=layout, overlap_rows=overlap_rows(layout, config, platform),
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda | warmreg.is_rocm)
