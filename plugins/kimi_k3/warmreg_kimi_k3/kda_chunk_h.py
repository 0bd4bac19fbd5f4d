"""Chunked KDA prefill, stage 5: the state at the start of every chunk, the corrected values, the final state.

vLLM: ``chunk_gated_delta_rule_fwd_h(k=kg, w, u, gk=g, initial_state, output_final_state, cu_seqlens,
chunk_indices, use_exp2=True)`` (``vllm/third_party/flash_linear_attention/ops/chunk_delta_h.py:
chunk_gated_delta_rule_fwd_kernel_h_blockdim64``, autotuned on ``H, K, V, BT`` over ``BV``, ``num_warps`` and
``num_stages``). Its states are ``[.., H, V, K]`` (K contiguous): ``initial_state`` ``[N, H, V, K]`` as
``gather_initial_states`` returns it from the layer's recurrent-state pool, the chunk states ``h``
``[NT, H, V, K]``, the final states fp32 ``[N, H, V, K]``, which the layer scatters back itself
(``recurrent_state[idx] = final_state.to(recurrent_state.dtype)``). Math, per sequence ``n`` and head, with the
fp32 state ``S`` ``[V, K]``, in vLLM's order (K in tiles of 64, up to four)::

    S = initial_state[n] (fp32) if there is one else 0
    for each chunk c of n:
        h[c] = S                                    # in kg's dtype
        v_new = u_c - w_c S^T                       # [n_c, V], stored in u's dtype
        S = S * exp2(g_last)[None, :] + (kg_c^T v_new)^T      # v_new in kg's dtype for the product
    final_state[n] = S

Grid ``(cdiv(V, BV), N, H)``: each program carries a ``[BV, K]`` tile of one state through its sequence (vLLM:
``(cdiv(V, BV), N * H)``, the same programs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import RECURRENT_STATE_DTYPE
from .kda_chunk_base import CHUNK_SIZE, ChunkStage, meta_chunks, tuning_tensor

__all__ = ["H_TUNE_CONFIGS", "MAX_HEAD_K_DIM", "KDAChunkH", "KDAChunkHKey", "chunk_h_reference"]

#: vLLM tunes BV in {32, 64} x {2, 4} warps x {2, 3, 4} stages (12); four of them here.
H_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BV": 32}, num_warps=4, num_stages=2),
    warmreg.TuneConfig(constexprs={"BV": 64}, num_warps=4, num_stages=2),
    warmreg.TuneConfig(constexprs={"BV": 32}, num_warps=2, num_stages=3),
    warmreg.TuneConfig(constexprs={"BV": 64}, num_warps=4, num_stages=3),
)
#: The kernel holds the state in four K tiles of 64 at most (vLLM's limit).
MAX_HEAD_K_DIM = 256


@triton.jit
def _load_state(h0, o_v, m_v, o_k, K: tl.constexpr):  # K: the head dim, for the mask
    """A ``[BV, 64]`` tile of an initial state, in fp32."""
    return tl.load(h0 + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & (o_k < K)[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def _store_state(ptr, b, o_v, m_v, o_k, K: tl.constexpr):  # K: the head dim, for the mask
    tl.store(ptr + o_v[:, None] * K + o_k[None, :], b.to(ptr.dtype.element_ty), mask=m_v[:, None] & (o_k < K)[None, :])


@triton.jit
def _w_times_state(w, o_t, m_t, o_k, b_h, K: tl.constexpr, STRIDE: tl.constexpr):  # K: mask; STRIDE: H * K
    b_w = tl.load(w + o_t[:, None] * STRIDE + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
    return tl.dot(b_w, tl.trans(b_h).to(b_w.dtype))


@triton.jit
def _decay_update(b_h, gk_last, k, o_t, m_t, o_k, b_v, K: tl.constexpr, STRIDE: tl.constexpr):  # K, STRIDE: layout
    """``b_h * exp2(g_last) + (kg^T v_new)^T`` for one K tile, in vLLM's order."""
    b_h *= tl.exp2(tl.load(gk_last + o_k, mask=(o_k < K), other=0.0))[None, :]
    b_k = tl.load(k + o_k[:, None] + o_t[None, :] * STRIDE, mask=(o_k < K)[:, None] & m_t[None, :], other=0.0)
    b_h += tl.trans(tl.dot(b_k, b_v))
    return b_h


# The metadata is read a scalar at a time.
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_ptr", "offsets_ptr"])
def _kda_chunk_h_kernel(
    kg_ptr,  # [T, H, K]
    w_ptr,  # [T, H, K]
    u_ptr,  # [T, H, V]
    g_ptr,  # fp32 [T, H, K]
    h_ptr,  # out [NT, H, V, K]
    v_new_ptr,  # out [T, H, V]
    h0_ptr,  # [N, H, V, K] initial states (unread without USE_INITIAL_STATE)
    ht_ptr,  # out fp32 [N, H, V, K] final states (unwritten without STORE_FINAL_STATE)
    cu_seqlens_ptr,
    offsets_ptr,  # [N + 1] first chunk of each sequence
    H: tl.constexpr,  # heads on this rank
    K: tl.constexpr,  # key head dim (<= 256: four tiles of 64)
    V: tl.constexpr,  # value head dim
    BT: tl.constexpr,  # chunk size (64)
    BV: tl.constexpr,  # V per program (tuned)
    USE_INITIAL_STATE: tl.constexpr,  # vLLM's: an initial_state was given
    STORE_FINAL_STATE: tl.constexpr,  # vLLM's: output_final_state
):
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
    T = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64) - bos
    boh = tl.load(offsets_ptr + i_n).to(tl.int64)
    i_nh = i_n.to(tl.int64) * H + i_h
    h = h_ptr + (boh * H + i_h) * V * K
    v = u_ptr + (bos * H + i_h) * V
    k = kg_ptr + (bos * H + i_h) * K
    w = w_ptr + (bos * H + i_h) * K
    v_new = v_new_ptr + (bos * H + i_h) * V
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_k1 = tl.arange(0, 64)
    o_k2 = 64 + o_k1
    o_k3 = 128 + o_k1
    o_k4 = 192 + o_k1
    # the state as vLLM holds it: zeros, plus the initial state (so -0.0 reads as 0.0)
    b_h1 = tl.zeros([BV, 64], dtype=tl.float32)
    if K > 64:
        b_h2 = tl.zeros([BV, 64], dtype=tl.float32)
    if K > 128:
        b_h3 = tl.zeros([BV, 64], dtype=tl.float32)
    if K > 192:
        b_h4 = tl.zeros([BV, 64], dtype=tl.float32)
    if USE_INITIAL_STATE:
        h0 = h0_ptr + i_nh * V * K
        b_h1 += _load_state(h0, o_v, m_v, o_k1, K)
        if K > 64:
            b_h2 += _load_state(h0, o_v, m_v, o_k2, K)
        if K > 128:
            b_h3 += _load_state(h0, o_v, m_v, o_k3, K)
        if K > 192:
            b_h4 += _load_state(h0, o_v, m_v, o_k4, K)
    i_t = tl.zeros([], dtype=tl.int64)
    # A while loop over a loaded bound (kda.py: Triton 3.6.0's interpreter cannot range over one).
    while i_t * BT < T:
        p_h = h + i_t * H * V * K
        _store_state(p_h, b_h1, o_v, m_v, o_k1, K)
        if K > 64:
            _store_state(p_h, b_h2, o_v, m_v, o_k2, K)
        if K > 128:
            _store_state(p_h, b_h3, o_v, m_v, o_k3, K)
        if K > 192:
            _store_state(p_h, b_h4, o_v, m_v, o_k4, K)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        b_v = _w_times_state(w, o_t, m_t, o_k1, b_h1, K, H * K)
        if K > 64:
            b_v += _w_times_state(w, o_t, m_t, o_k2, b_h2, K, H * K)
        if K > 128:
            b_v += _w_times_state(w, o_t, m_t, o_k3, b_h3, K, H * K)
        if K > 192:
            b_v += _w_times_state(w, o_t, m_t, o_k4, b_h4, K, H * K)
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0) - b_v
        tl.store(v_new + o_t[:, None] * (H * V) + o_v[None, :], b_v.to(v_new_ptr.dtype.element_ty), mask=m_tv)
        gk_last = g_ptr + (bos + tl.minimum((i_t + 1) * BT, T) - 1) * H * K + i_h * K
        b_v = b_v.to(kg_ptr.dtype.element_ty)
        b_h1 = _decay_update(b_h1, gk_last, k, o_t, m_t, o_k1, b_v, K, H * K)
        if K > 64:
            b_h2 = _decay_update(b_h2, gk_last, k, o_t, m_t, o_k2, b_v, K, H * K)
        if K > 128:
            b_h3 = _decay_update(b_h3, gk_last, k, o_t, m_t, o_k3, b_v, K, H * K)
        if K > 192:
            b_h4 = _decay_update(b_h4, gk_last, k, o_t, m_t, o_k4, b_v, K, H * K)
        i_t += 1
    if STORE_FINAL_STATE:
        ht = ht_ptr + i_nh * V * K
        _store_state(ht, b_h1, o_v, m_v, o_k1, K)
        if K > 64:
            _store_state(ht, b_h2, o_v, m_v, o_k2, K)
        if K > 128:
            _store_state(ht, b_h3, o_v, m_v, o_k3, K)
        if K > 192:
            _store_state(ht, b_h4, o_v, m_v, o_k4, K)


@attrs.frozen(kw_only=True)
class KDAChunkHKey(warmreg.CompileKey):
    """What changes the binary of the state stage."""

    dtype: str  # kg, w, u, h, v_new
    num_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    chunk_size: int  # BT
    initial_state_dtype: str | None  # USE_INITIAL_STATE and h0's element type; None: no initial state
    initial_state_aligned: bool  # h0 comes from the caller (gather_initial_states' fresh tensor in vLLM)
    store_final_state: bool  # STORE_FINAL_STATE
    config: int | None = None


class KDAChunkH(ChunkStage[KDAChunkHKey]):
    """The chunk-state stage of the chunked KDA prefill: replaces ``chunk_gated_delta_rule_fwd_h(k=kg, w, u,
    gk=g, initial_state, output_final_state, cu_seqlens, chunk_indices, use_exp2=True)`` inside vLLM's
    ``chunk_kda_with_fused_gate`` (module docstring): states ``[.., H, V, K]``; it reads the gathered initial
    states and returns the final ones, and leaves the pool to the caller, as vLLM (whose layer gathers with
    ``gather_initial_states`` and scatters with ``recurrent_state[idx] = final_state``)."""

    name = "kimi_k3.kda_chunk_h"
    key_type = KDAChunkHKey
    jit = _kda_chunk_h_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = H_TUNE_CONFIGS

    def dispatch(
        self, *, u: torch.Tensor, kg: torch.Tensor, initial_state: torch.Tensor | None, output_final_state: bool
    ) -> KDAChunkHKey:
        return KDAChunkHKey(
            dtype=warmreg.dtype_name(kg.dtype), num_heads=kg.shape[1], head_k_dim=kg.shape[2], head_v_dim=u.shape[2],
            chunk_size=CHUNK_SIZE,
            initial_state_dtype=None if initial_state is None else warmreg.dtype_name(initial_state.dtype),
            initial_state_aligned=initial_state is None or warmreg.is_aligned(initial_state),
            store_final_state=bool(output_final_state),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        h, d = self.num_heads, self.head_dim
        # gather_initial_states' output from the layer's pool ([N, H, V, K], a fresh tensor of the pool's
        # dtype); the final states always requested (the layer scatters them back)
        state = warmreg.meta((1, h, d, d), getattr(torch, RECURRENT_STATE_DTYPE))
        return [
            {"u": warmreg.meta((t, h, d), self.dtype), "kg": warmreg.meta((t, h, d), self.dtype),
             "initial_state": state, "output_final_state": True}
            for t in self.token_counts()
        ]  # fmt: skip

    def _inputs(self, key: KDAChunkHKey, tokens: int, seqs: int, make: Any) -> dict[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        state = key.initial_state_dtype
        return {
            "kg": make((tokens, h, kd), dt, 0), "w": make((tokens, h, kd), dt, 0), "u": make((tokens, h, vd), dt, 0),
            "g": make((tokens, h, kd), torch.float32, 0),
            "initial_state": None if state is None else make(
                (seqs, h, vd, kd), getattr(torch, state), 0 if key.initial_state_aligned else 1
            ),
            "output_final_state": key.store_final_state,
        }  # fmt: skip

    def warmup_inputs(self, key: KDAChunkHKey) -> Mapping[str, Any]:
        inputs = self._inputs(key, 1, 1, lambda s, d, off: warmreg.meta(s, d, offset=off))
        return {**inputs, "cu_seqlens": meta_chunks(1)["cu_seqlens"], "chunk_offsets": warmreg.meta((2,), torch.int32),
                "num_chunks": 1}  # fmt: skip

    def tuning_inputs(self, key: KDAChunkHKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        seqs = batch["cu_seqlens"].shape[0] - 1
        return {
            **self._inputs(key, batch["tokens"], seqs, partial(tuning_tensor, device)), "cu_seqlens": batch["cu_seqlens"],
            "chunk_offsets": batch["chunk_offsets"], "num_chunks": batch["chunk_indices"].shape[0],
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        kg: torch.Tensor,
        w: torch.Tensor,
        u: torch.Tensor,
        g: torch.Tensor,
        cu_seqlens: torch.Tensor,
        chunk_offsets: torch.Tensor,
        initial_state: torch.Tensor | None,
        num_chunks: int,
        *,
        output_final_state: bool = True,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkHKey]:
        """``(h, v_new, final_state)``, as vLLM's ``chunk_gated_delta_rule_fwd_h`` returns them: the state at the
        start of each chunk (``[NT, H, V, K]``, kg's dtype), the corrected values (``[T, H, V]``, u's dtype) and
        the final states (fp32 ``[N, H, V, K]``, or None without ``output_final_state``); ``out``'s tensors or
        fresh ones. Nothing else is written.

        :param kg: ``[T, H, K]`` contiguous (the WY stage's ``kg``), K <= 256.
        :param w: like ``kg``.
        :param u: ``[T, H, V]`` contiguous, kg's dtype.
        :param g: fp32 ``[T, H, K]`` contiguous.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_offsets: int32 ``[N + 1]`` (:func:`~warmreg_kimi_k3.kda_chunk_base.chunk_metadata`).
        :param initial_state: ``[N, H, V, K]`` contiguous (any float dtype, read as fp32), or None (zeros): vLLM's
            ``gather_initial_states(recurrent_state, indices, has_initial_state)``, zeros where a sequence has
            no state.
        :param num_chunks: ``NT``, the number of chunks (``chunk_indices.shape[0]``).
        :param output_final_state: return (and write) the final states.
        :param out: preallocated ``(h, v_new, final_state)`` (``(h, v_new)`` without ``output_final_state``),
            contiguous, of those shapes and dtypes (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` that is not
            the outputs' shapes, dtypes and layouts.
        """
        if kg.ndim != 3 or w.shape != kg.shape or g.shape != kg.shape or u.ndim != 3 or u.shape[:2] != kg.shape[:2]:
            self.fail(f"kg, w, g must be [T, H, K] and u [T, H, V] (got {[tuple(x.shape) for x in (kg, w, g, u)]})")
        h, kd, vd = kg.shape[1], kg.shape[2], u.shape[2]
        if (
            not all(x.is_contiguous() for x in (kg, w, u, g))
            or not w.dtype == u.dtype == kg.dtype
            or g.dtype != torch.float32
        ):
            self.fail("kg, w, u and g must be contiguous, kg, w and u of one dtype, g float32")
        if kd > MAX_HEAD_K_DIM or min(kd, vd) < 16:
            self.fail(f"K must be in [16, {MAX_HEAD_K_DIM}] and V >= 16 (got K = {kd}, V = {vd})")
        seqs = cu_seqlens.shape[0] - 1
        if initial_state is not None and (
            tuple(initial_state.shape) != (seqs, h, vd, kd)
            or not initial_state.dtype.is_floating_point
            or not initial_state.is_contiguous()
        ):
            self.fail(
                f"initial_state must be a contiguous float [N, H, V, K] = {(seqs, h, vd, kd)} tensor "
                f"(got {initial_state.dtype} {tuple(initial_state.shape)}, strides {initial_state.stride()})",
                fix="gather the states with gather_initial_states (vLLM's layout: K contiguous)",
            )
        key = self.dispatch(u=u, kg=kg, initial_state=initial_state, output_final_state=output_final_state)
        names = ("h", "v_new", "final_state") if key.store_final_state else ("h", "v_new")
        outs = (None,) * len(names) if out is None else self.out_tuple(out, names)
        hs = warmreg.output(self.name, "out[0]", outs[0], (num_chunks, h, vd, kd), kg.dtype, kg.device)
        v_new = warmreg.output(self.name, "out[1]", outs[1], u.shape, u.dtype, u.device)
        final = (
            warmreg.output(self.name, "out[2]", outs[2], (seqs, h, vd, kd), torch.float32, kg.device)
            if key.store_final_state
            else None
        )
        kwargs = dict(
            kg_ptr=kg, w_ptr=w, u_ptr=u, g_ptr=g, h_ptr=hs, v_new_ptr=v_new,
            h0_ptr=g if initial_state is None else initial_state, ht_ptr=hs if final is None else final,
            cu_seqlens_ptr=cu_seqlens, offsets_ptr=chunk_offsets, H=h, K=kd, V=vd, BT=key.chunk_size,
            USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=key.store_final_state,
        )  # fmt: skip

        def grid(meta: Mapping[str, Any]) -> tuple[int, ...]:
            return ((vd + meta["BV"] - 1) // meta["BV"], seqs, h)

        outputs = (hs, v_new, final) if final is not None else (hs, v_new, None)
        return warmreg.LaunchSpec(key, grid if seqs else None, kwargs, outputs)


def chunk_h_reference(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's loop, in fp32.

    :returns: ``(h, v_new, final_state)``: fp32 ``[NT, H, V, K]``, ``[T, H, V]`` and ``[N, H, V, K]``.
    """
    h, kd, vd = kg.shape[1], kg.shape[2], u.shape[2]
    hs, v_new, finals = [], torch.zeros(u.shape), []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        s = torch.zeros(h, vd, kd) if initial_state is None else initial_state[n].float().clone()
        for start in range(bounds[n], bounds[n + 1], CHUNK_SIZE):
            rows = slice(start, min(start + CHUNK_SIZE, bounds[n + 1]))
            hs.append(s.clone())
            vn = u[rows].float() - torch.einsum("thk,hvk->thv", w[rows].float(), s)
            v_new[rows] = vn
            s = s * torch.exp2(g[rows.stop - 1].float())[:, None, :] + torch.einsum(
                "thk,thv->hvk", kg[rows].float(), vn
            )
        finals.append(s)
    empty = torch.zeros((0, h, vd, kd))
    return torch.stack(hs) if hs else empty, v_new, torch.stack(finals) if finals else empty
