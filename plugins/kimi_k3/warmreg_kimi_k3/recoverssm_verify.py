"""The KDA RecoverSSM verify: a speculative window run from each request's checkpoint, which is left unchanged,
with the records the commit needs (vLLM 0.34 ``models/kimi_k3/nvidia/ops/recoverssm.py``:
``kda_recoverssm_verify``, ``_kda_recoverssm_verify_kernel``, ``_kda_recurrent_step``, ``_kda_gate``).

Math, per speculative request ``b`` (tokens ``bos .. eos-1`` of ``query_start_loc``, at most ``S = 1 + spec``),
head ``h``, in fp32, from ``state = checkpoint[state_indices[b], h]`` (``[V, K]``) and ``A = exp(A_log[h])``::

    for t < eos - bos:
        q~ = q_t * (rsqrt(sum(q_t^2) + 1e-6) * K^-1/2);   k~ = k_t * rsqrt(sum(k_t^2) + 1e-6)
        x  = raw_g_t + dt_bias[h]
        g  = lower_bound * sigmoid(A * x)            with a gate bound, else  -A * softplus(x)  (x if x > 20)
        state = state * exp(g)[None, :]
        u_t   = (v_t - state @ k~) * sigmoid(raw_beta_t)          # the correction, [V]
        state = state + u_t[:, None] * k~[None, :]
        out_t = state @ q~
        correction[b, h, t] = u_t;   key_gate[b, h, t] = [k_t | raw_g_t]    # the records, row b of the step

A request on the null block (``state_indices[b] <= 0``) writes zeros to its outputs and no records. Tokens past
``eos`` are neither written nor folded in. Grid ``(cdiv(V, BV), B, H)`` with ``BK = next_pow2(K)``,
``BV = min(next_pow2(V), 32)``, four warps and two stages, as vLLM launches it; the key and raw gate are written by
the ``BV`` tile 0 only.

Where it runs: ``KimiK3DeltaAttention._recoverssm_verify`` on every step with speculative rows under RecoverSSM
(``warmreg_kimi_k3.recoverssm``), after ``causal_conv1d_update`` (num_accepted 1: the conv history is the
checkpoint's) on the ``spec_query_start_loc`` rows: q, k, v are ``[1, T, H, D]`` views of the conv output,
``raw_g`` the gate projection ``[1, T, H, K]``, ``raw_beta`` ``[1, T, H]`` a column slice of the packed projection,
the checkpoint the layer's fp32 SSM state pool, the records ``[max_num_seqs, H, S, V]`` fp32 and
``[max_num_seqs, H, S, 2K]`` in the activation dtype (``KDARecoverSSMRecords.allocate``).

Under the specialized decode's deferred RecoverSSM (``warmreg_kimi_k3.recoverssm_deferred``) vLLM runs its second
copy of this kernel (``models/kimi_k3/nvidia/specialized_decode/recoverssm/kernels.py``: ``kda_recoverssm_verify``,
``_kda_recoverssm_verify_kernel`` with ``HAS_RECORD_INDICES``), called by ``recoverssm/state.py:
deferred_recoverssm_verify`` with ``record_indices = record_rows[:B]``: the same math, with request ``b``'s records
in row ``record_indices[b]`` of record tensors that are views one row into their allocation (``allocate_records``:
row -1, a scratch row, takes the records of a request that owns no record slot).

Key: the dtypes (the record indices' or None), ``K``, ``V``, their tiles, ``S``, whether there is a gate bound,
warps and stages. Unlike vLLM's
launch, no stride or size is specialized and no pointer on its alignment: one binary serves every step's views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._recoverssm_kernels import kda_gate
from .backends import KDALayout, kda_layout
from .model import PLUGIN, KimiK3
from .recoverssm import NULL_BLOCK_ID, use_recoverssm
from .recoverssm_deferred import deferred_recoverssm
from .specialized import SM100_FAMILY

__all__ = ["RecoverSSMVerify", "RecoverSSMVerifyKey", "kda_gate_reference", "recoverssm_verify_reference", "register"]

_POINTERS = ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "a_log_ptr", "dt_bias_ptr", "state_ptr", "corr_ptr",
             "kg_ptr", "out_ptr", "qsl_ptr", "idx_ptr", "rec_ptr"]  # fmt: skip
_INTS = ["lower_bound", "null_block_id", "s_q", "s_k", "s_v", "s_g", "s_beta", "s_state_b", "s_state_h", "s_state_v",
         "s_state_k", "s_corr_b", "s_corr_h", "s_corr_t", "s_corr_d", "s_kg_b", "s_kg_h", "s_kg_t", "s_kg_d", "s_out",
         "s_qsl", "s_idx"]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _recoverssm_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # [1, T, H, K|V] / [1, T, H]: token strides s_*, heads contiguous
    a_log_ptr, dt_bias_ptr,  # [H], [H * K]: contiguous
    state_ptr,  # the checkpoint pool [blocks, H, V, K], read only
    corr_ptr, kg_ptr,  # the records [rows, H, S, V] fp32 and [rows, H, S, 2K]
    out_ptr,  # [1, T, H, V]: token stride s_out, heads contiguous
    qsl_ptr, idx_ptr,  # [B + 1] token offsets, [B] checkpoint slots
    rec_ptr,  # [>= B] record rows (contiguous), read with RECORDS only
    lower_bound, null_block_id,
    s_q, s_k, s_v, s_g, s_beta,
    s_state_b, s_state_h, s_state_v, s_state_k,
    s_corr_b, s_corr_h, s_corr_t, s_corr_d,
    s_kg_b, s_kg_h, s_kg_t, s_kg_d,
    s_out, s_qsl, s_idx,
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BK: tl.constexpr,  # next_pow2(K)
    BV: tl.constexpr,  # value rows per program
    S: tl.constexpr,  # 1 + num_speculative_tokens: the window, unrolled
    BOUNDED: tl.constexpr,  # the gate has a lower bound (sigmoid gate) rather than softplus
    RECORDS: tl.constexpr,  # request b's records are in row rec[b] (deferred RecoverSSM), else in row b
):  # fmt: skip
    i_v, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = b.to(tl.int64)
    if RECORDS:
        row = tl.load(rec_ptr + b).to(tl.int64)
    bos = tl.load(qsl_ptr + b * s_qsl).to(tl.int64)
    n = tl.load(qsl_ptr + (b + 1) * s_qsl).to(tl.int64) - bos
    slot = tl.load(idx_ptr + b * s_idx).to(tl.int64)
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    k_in, v_in = ks < K, vs < V
    if slot <= null_block_id:
        for t in tl.static_range(S):
            tl.store(out_ptr + (bos + t) * s_out + h * V + vs, tl.zeros([BV], dtype=tl.float32), mask=tl.where(t < n, v_in, False))
        return
    tile = v_in[:, None] & k_in[None, :]
    cell = state_ptr + slot * s_state_b + h * s_state_h + vs[:, None] * s_state_v + ks[None, :] * s_state_k
    state = tl.load(cell, mask=tile, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    for t in tl.static_range(S):
        live = t < n
        tok = bos + t
        qt = tl.load(q_ptr + tok * s_q + h * K + ks, mask=tl.where(live, k_in, False), other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + tok * s_k + h * K + ks, mask=tl.where(live, k_in, False), other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + tok * s_v + h * V + vs, mask=tl.where(live, v_in, False), other=0.0).to(tl.float32)
        gt = tl.load(g_ptr + tok * s_g + h * K + ks, mask=tl.where(live, k_in, False), other=0.0).to(tl.float32)
        bt = tl.load(beta_ptr + tok * s_beta + h, mask=live, other=0.0).to(tl.float32)
        qt *= tl.rsqrt(tl.sum(qt * qt) + 1e-6) * (K**-0.5)
        bias = tl.load(dt_bias_ptr + h * K + ks, mask=k_in, other=0.0).to(tl.float32)
        kn = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        decayed = state * tl.exp(kda_gate(gt, bias, a, lower_bound, BOUNDED))[None, :]
        u = (vt - tl.sum(decayed * kn[None, :], axis=1)) * tl.sigmoid(bt)
        state = tl.where(live, decayed + u[:, None] * kn[None, :], state)
        tl.store(out_ptr + tok * s_out + h * V + vs, tl.sum(state * qt[None, :], axis=1), mask=tl.where(live, v_in, False))
        tl.store(corr_ptr + row * s_corr_b + h * s_corr_h + t * s_corr_t + vs * s_corr_d, u, mask=tl.where(live, v_in, False))
        if i_v == 0:
            rec = kg_ptr + row * s_kg_b + h * s_kg_h + t * s_kg_t
            tl.store(rec + ks * s_kg_d, kt, mask=tl.where(live, k_in, False))
            tl.store(rec + (K + ks) * s_kg_d, gt, mask=tl.where(live, k_in, False))


@attrs.frozen(kw_only=True)
class RecoverSSMVerifyKey(warmreg.CompileKey):
    """What changes the binary of the RecoverSSM verify: dtypes and the tile constexprs, no stride or alignment."""

    dtype: str  # q, k, v (and the output), raw_g and raw_beta: the activation dtype
    param_dtype: str  # A_log and dt_bias
    state_dtype: str  # the checkpoint pool
    key_gate_dtype: str  # the key/gate record (the activation dtype in vLLM)
    index_dtype: str  # query_start_loc and state_indices
    record_index_dtype: str | None  # record_indices (deferred RecoverSSM), None: records in row b
    head_k: int
    head_v: int
    block_k: int
    block_v: int
    window: int  # S = 1 + num_speculative_tokens
    bounded: bool  # USE_LOWER_BOUND
    num_warps: int
    num_stages: int


class RecoverSSMVerify(warmreg.TritonKernel[RecoverSSMVerifyKey]):
    """The RecoverSSM verify of one KDA layer (the module docstring has the math and vLLM's call site).

    :param layout: the KDA layout (heads, head dim, gate bound, speculative tokens, dtype; domains only).
    :param max_num_seqs: requests in a step (domains only).
    :param deferred: the deployment runs the deferred RecoverSSM on the SM100 family (domains only: there every
        verify writes indexed records).
    """

    name = "kimi_k3.recoverssm_verify"
    key_type = RecoverSSMVerifyKey
    jit = _recoverssm_verify_kernel

    def __init__(self, *, layout: KDALayout, max_num_seqs: int, deferred: bool = False) -> None:
        self.layout, self.max_num_seqs, self.deferred = layout, max_num_seqs, deferred

    def dispatch(
        self, *, q: torch.Tensor, v: torch.Tensor, A_log: torch.Tensor, checkpoint_state: torch.Tensor,
        key_gate: torch.Tensor, state_indices: torch.Tensor, spec_query_len: int,
        lower_bound: float | None, record_indices: torch.Tensor | None = None,
    ) -> RecoverSSMVerifyKey:  # fmt: skip
        k, v_dim = q.shape[-1], v.shape[-1]
        return RecoverSSMVerifyKey(
            dtype=warmreg.dtype_name(q.dtype), param_dtype=warmreg.dtype_name(A_log.dtype),
            state_dtype=warmreg.dtype_name(checkpoint_state.dtype), key_gate_dtype=warmreg.dtype_name(key_gate.dtype),
            index_dtype=warmreg.dtype_name(state_indices.dtype),
            record_index_dtype=None if record_indices is None else warmreg.dtype_name(record_indices.dtype),
            head_k=k, head_v=v_dim, block_k=warmreg.next_pow2(k), block_v=min(warmreg.next_pow2(v_dim), 32),
            window=spec_query_len, bounded=lower_bound is not None, num_warps=4, num_stages=2,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """One point: the layer's tensors as ``_recoverssm_verify`` passes them (q a head view of the conv output,
        the fp32 checkpoint pool, the records of ``max_num_seqs`` rows); nothing in the key varies with the step.
        Under the deferred RecoverSSM on the SM100 family the record indices are the builder's int32
        ``recoverssm_record_rows[:B]`` (``recoverssm/state.py: install_builder``) on every step (a speculative step
        always has a deferred commit there), else absent."""
        lay, n = self.layout, self.max_num_seqs
        deferred = self.deferred and SM100_FAMILY(platform)
        h, d, s, dt = lay.num_heads, lay.head_dim, 1 + lay.num_speculative_tokens, getattr(torch, lay.dtype)
        return {
            "q": [warmreg.meta((n * s, 3 * h * d), dt)[:, : h * d].view(1, n * s, h, d)],
            "v": [warmreg.meta((n * s, 3 * h * d), dt)[:, 2 * h * d :].view(1, n * s, h, d)],
            "A_log": [warmreg.meta((h,), torch.float32)],
            "checkpoint_state": [warmreg.meta((n + 1, h, d, d), torch.float32)],
            "key_gate": [warmreg.meta((n, h, s, 2 * d), dt)],
            "state_indices": [warmreg.meta((n, 1), torch.int32)[:, 0]],
            "spec_query_len": [s],
            "lower_bound": [lay.lower_bound],
            "record_indices": [warmreg.meta((n,), torch.int32) if deferred else None],
        }

    def warmup_inputs(self, key: RecoverSSMVerifyKey) -> Mapping[str, Any]:
        dt, k, v, s = getattr(torch, key.dtype), key.head_k, key.head_v, key.window
        param, index = getattr(torch, key.param_dtype), getattr(torch, key.index_dtype)
        return {
            "q": warmreg.meta((1, 1, 1, k), dt), "k": warmreg.meta((1, 1, 1, k), dt), "v": warmreg.meta((1, 1, 1, v), dt),
            "raw_g": warmreg.meta((1, 1, 1, k), dt), "raw_beta": warmreg.meta((1, 1, 1), dt),
            "A_log": warmreg.meta((1,), param), "dt_bias": warmreg.meta((k,), param),
            "checkpoint_state": warmreg.meta((1, 1, v, k), getattr(torch, key.state_dtype)),
            "correction": warmreg.meta((1, 1, s, v), torch.float32),
            "key_gate": warmreg.meta((1, 1, s, 2 * k), getattr(torch, key.key_gate_dtype)),
            "query_start_loc": warmreg.meta((2,), index), "state_indices": warmreg.meta((1,), index),
            "spec_query_len": s, "lower_bound": -5.0 if key.bounded else None,
            "record_indices": None if key.record_index_dtype is None else warmreg.meta((1,), getattr(torch, key.record_index_dtype)),
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, checkpoint_state: torch.Tensor, correction: torch.Tensor,
        key_gate: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor, *,
        lower_bound: float | None, spec_query_len: int, out: torch.Tensor | None = None,
        record_indices: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RecoverSSMVerifyKey]:  # fmt: skip
        """The verify's output ``[1, T, H, V]`` (``out``, or a fresh tensor of v's dtype); writes the records of
        each non-null request ``b`` into row ``b`` of ``correction`` and ``key_gate``. The checkpoint is not written.

        :param q: ``[1, T, H, K]``, heads contiguous (``stride()[2:] == (K, 1)``); also ``k`` and ``raw_g``.
        :param v: ``[1, T, H, V]``, heads contiguous; ``raw_beta`` ``[1, T, H]`` with ``stride(2) == 1``.
        :param A_log: ``[H]`` and ``dt_bias`` ``[H * K]`` elements, both contiguous.
        :param checkpoint_state: ``[blocks, H, V, K]``, any strides: the layer's SSM state pool.
        :param correction: fp32 ``[rows, H, S, V]`` and ``key_gate`` ``[rows, H, S, 2K]``: the records,
            ``rows >= B``.
        :param query_start_loc: int ``[B + 1]`` and ``state_indices`` int ``[B]``, any strides.
        :param lower_bound: the gate's lower bound (< 0), or None for the softplus gate.
        :param spec_query_len: ``S = 1 + num_speculative_tokens``; ``T <= B * S``.
        :param out: a preallocated output: contiguous ``[1, T, H, V]`` of v's dtype.
        :param record_indices: int ``[>= B]``, contiguous: request ``b``'s record row (-1 and other negative rows
            address the rows before the record views, as vLLM's scratch row), or None (row ``b``).
        :raises warmreg.LaunchError: for shapes, layouts or devices vLLM's entry point refuses (it raises
            ``ValueError`` for the same), or an ``out`` that is not the output's shape, dtype and layout.
        """
        self._check(q, k, v, raw_g, raw_beta, A_log, dt_bias, checkpoint_state, correction, key_gate,
                    query_start_loc, state_indices, spec_query_len)  # fmt: skip
        self._check_records(record_indices, state_indices)
        out = warmreg.output(self.name, "out", out, tuple(v.shape), v.dtype, v.device)
        key = self.dispatch(q=q, v=v, A_log=A_log, checkpoint_state=checkpoint_state, key_gate=key_gate,
                            state_indices=state_indices, spec_query_len=spec_query_len,
                            lower_bound=lower_bound, record_indices=record_indices)  # fmt: skip
        c, kg, st = correction, key_gate, checkpoint_state
        kwargs = dict(
            q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=raw_g, beta_ptr=raw_beta, a_log_ptr=A_log, dt_bias_ptr=dt_bias,
            state_ptr=st, corr_ptr=c, kg_ptr=kg, out_ptr=out, qsl_ptr=query_start_loc, idx_ptr=state_indices,
            rec_ptr=state_indices if record_indices is None else record_indices,
            lower_bound=lower_bound or 0.0, null_block_id=NULL_BLOCK_ID,
            s_q=q.stride(1), s_k=k.stride(1), s_v=v.stride(1), s_g=raw_g.stride(1), s_beta=raw_beta.stride(1),
            s_state_b=st.stride(0), s_state_h=st.stride(1), s_state_v=st.stride(2), s_state_k=st.stride(3),
            s_corr_b=c.stride(0), s_corr_h=c.stride(1), s_corr_t=c.stride(2), s_corr_d=c.stride(3),
            s_kg_b=kg.stride(0), s_kg_h=kg.stride(1), s_kg_t=kg.stride(2), s_kg_d=kg.stride(3),
            s_out=out.stride(1), s_qsl=query_start_loc.stride(0), s_idx=state_indices.stride(0),
            K=key.head_k, V=key.head_v, BK=key.block_k, BV=key.block_v, S=key.window, BOUNDED=key.bounded,
            RECORDS=key.record_index_dtype is not None,
        )  # fmt: skip
        tokens, batch, heads = q.shape[1], state_indices.shape[0], q.shape[2]
        grid = (triton.cdiv(key.head_v, key.block_v), batch, heads) if tokens and batch else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check_records(self, rows: torch.Tensor | None, indices: torch.Tensor) -> None:
        if rows is None:
            return
        if (
            rows.ndim != 1
            or rows.shape[0] < indices.shape[0]
            or rows.dtype.is_floating_point
            or rows.dtype == torch.bool
        ):
            raise warmreg.LaunchError(self.name, f"record_indices must be int [>= {indices.shape[0]}] "
                                      f"(got {rows.dtype} {tuple(rows.shape)})")  # fmt: skip
        if rows.stride(0) != 1 and rows.shape[0] > 1:
            raise warmreg.LaunchError(self.name, f"record_indices must be contiguous (got stride {rows.stride(0)})")
        if rows.device != indices.device:
            raise warmreg.LaunchError(self.name, f"record_indices must be on {indices.device}")

    def _check(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, correction: torch.Tensor,
        key_gate: torch.Tensor, qsl: torch.Tensor, indices: torch.Tensor, window: int,
    ) -> None:  # fmt: skip
        def fail(name: str, problem: str) -> warmreg.LaunchError:
            return warmreg.LaunchError(self.name, f"{name} {problem}")

        if q.ndim != 4 or q.shape[0] != 1:
            raise fail("q", f"must be [1, T, H, K] (got {tuple(q.shape)})")
        _, tokens, heads, kd = q.shape
        vd = v.shape[-1]
        if k.shape != q.shape or raw_g.shape != q.shape or v.shape != (1, tokens, heads, vd):
            raise fail("k, v, raw_g", f"must be [1, {tokens}, {heads}, K|V] like q (got {tuple(k.shape)}, "
                       f"{tuple(v.shape)}, {tuple(raw_g.shape)})")  # fmt: skip
        if any(t.dtype != q.dtype for t in (k, v, raw_g, raw_beta)) or dt_bias.dtype != A_log.dtype:
            raise fail("k, v, raw_g, raw_beta, dt_bias", "must have q's dtype (dt_bias A_log's)")
        if raw_beta.shape != (1, tokens, heads):
            raise fail("raw_beta", f"must be [1, {tokens}, {heads}] (got {tuple(raw_beta.shape)})")
        if any(t.stride()[2:] != (kd, 1) for t in (q, k, raw_g)) or v.stride()[2:] != (vd, 1):
            raise fail("q, k, v, raw_g", "must have contiguous heads (stride()[2:] == (D, 1))")
        if raw_beta.stride(2) != 1 and heads > 1:
            raise fail("raw_beta", f"must have contiguous heads (got stride {raw_beta.stride(2)})")
        if state.ndim != 4 or tuple(state.shape[1:]) != (heads, vd, kd):
            raise fail("checkpoint_state", f"must be [blocks, {heads}, {vd}, {kd}] (got {tuple(state.shape)})")
        if (
            A_log.shape != (heads,)
            or dt_bias.numel() != heads * kd
            or not (A_log.is_contiguous() and dt_bias.is_contiguous())
        ):
            raise fail("A_log, dt_bias", f"must be contiguous with {heads} and {heads * kd} elements")
        batch = indices.shape[0]
        if (
            indices.ndim != 1
            or qsl.shape != (batch + 1,)
            or indices.dtype.is_floating_point
            or qsl.dtype.is_floating_point
        ):
            raise fail("query_start_loc, state_indices", f"must be int [B + 1] and [B] (got {tuple(qsl.shape)}, "
                       f"{tuple(indices.shape)})")  # fmt: skip
        if window < 1 or tokens > batch * window:
            raise fail("spec_query_len", f"({window}) must be >= 1 and cover T = {tokens} tokens of {batch} requests")
        for name, rec, width in (("correction", correction, vd), ("key_gate", key_gate, 2 * kd)):
            if rec.ndim != 4 or rec.shape[0] < batch or tuple(rec.shape[1:]) != (heads, window, width):
                raise fail(name, f"must be [rows >= {batch}, {heads}, {window}, {width}] (got {tuple(rec.shape)})")
        if correction.dtype != torch.float32:
            raise fail("correction", f"must be float32 (got {correction.dtype})")
        tensors = (k, v, raw_g, raw_beta, A_log, dt_bias, state, correction, key_gate, qsl, indices)
        if any(t.device != q.device for t in tensors):
            raise fail("inputs", f"must all be on {q.device}")


def kda_gate_reference(
    raw_g: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """The per-channel log decay ``g`` of the module docstring, fp32 (``a = exp(A_log)`` broadcast over channels)."""
    x = raw_g.float() + dt_bias.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def recoverssm_verify_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, checkpoint_state: torch.Tensor, correction: torch.Tensor,
    key_gate: torch.Tensor, query_start_loc: torch.Tensor, state_indices: torch.Tensor, *,
    lower_bound: float | None, spec_query_len: int, record_indices: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`RecoverSSMVerify`: returns the output (v's dtype) and writes the records into
    ``correction`` and ``key_gate`` (row ``b``, or ``record_indices[b]``, negative rows before the views) as the
    kernel does. Tokens of a null-block request read 0."""
    heads, kd = q.shape[2], q.shape[3]
    out = torch.zeros_like(v)
    bounds = query_start_loc.tolist()
    bias = dt_bias.float().reshape(heads, kd)
    for b, slot in enumerate(state_indices.tolist()):
        n = min(bounds[b + 1] - bounds[b], spec_query_len)
        if slot <= NULL_BLOCK_ID or n <= 0:
            continue
        row = b if record_indices is None else int(record_indices[b])
        corr, kg = _record_row(correction, row), _record_row(key_gate, row)
        for h in range(heads):
            state = checkpoint_state[slot, h].float().clone()
            a = torch.exp(A_log[h].float())
            for t in range(n):
                tok = bounds[b] + t
                qt, kt, vt = q[0, tok, h].float(), k[0, tok, h].float(), v[0, tok, h].float()
                qt = qt * (torch.rsqrt((qt * qt).sum() + 1e-6) * kd**-0.5)
                kn = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                state = state * torch.exp(kda_gate_reference(raw_g[0, tok, h], bias[h], a, lower_bound))[None, :]
                u = (vt - state @ kn) * torch.sigmoid(raw_beta[0, tok, h].float())
                state = state + u[:, None] * kn[None, :]
                out[0, tok, h] = (state @ qt).to(out.dtype)
                corr[h, t] = u
                kg[h, t] = torch.cat([k[0, tok, h], raw_g[0, tok, h]]).to(key_gate.dtype)
    return out


def _record_row(records: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of ``records`` as the kernel addresses it (a negative row lies before the view's first)."""
    return records.as_strided(
        records.shape[1:], records.stride()[1:], records.storage_offset() + row * records.stride(0)
    )


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the verify on CUDA under RecoverSSM (:func:`warmreg_kimi_k3.recoverssm.use_recoverssm`): the Triton
    verify serves every CUDA target with vLLM's default float32 SSM state (the CuTe one needs a bfloat16 state);
    under the deferred RecoverSSM (:func:`warmreg_kimi_k3.recoverssm_deferred.deferred_recoverssm`) its SM100 keys
    are the indexed-records ones.

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, an invalid ``serving.use_replayssm`` or a
        missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if not use_recoverssm(config, layout) or layout is None:
        return
    n = config.get("serving.max_num_seqs", int, plugin=PLUGIN)
    kernel = RecoverSSMVerify(layout=layout, max_num_seqs=n, deferred=deferred_recoverssm(config, layout))
    registry.add(kernel, when=warmreg.is_cuda)
