"""Chunked KDA prefill, stage 5: the state at the start of every chunk, the corrected values, the final state.

vLLM: ``chunk_gated_delta_rule_fwd_h`` (``vllm/third_party/flash_linear_attention/ops/chunk_delta_h.py:
chunk_gated_delta_rule_fwd_kernel_h_blockdim64``, autotuned on ``H, K, V, BT`` over ``BV``, ``num_warps`` and
``num_stages``, with ``USE_GK``, ``USE_EXP2``, ``USE_INITIAL_STATE``, ``STORE_FINAL_STATE``, ``SAVE_NEW_VALUE``),
after ``gather_initial_states``; the layer then writes ``recurrent_state[idx] = final_state``. Here the initial
states are read from the pool and the final states written back to it by the kernel. Math, per sequence ``n``
and head, with the fp32 state ``S`` ``[K, V]`` (the decode step's pool layout)::

    S = pool[slot[n]] if has_initial_state[n] and slot[n] >= 0 else 0
    for each chunk c of n:
        h[c] = S                                    # in k's dtype
        v_new = u_c - w_c S                         # [n_c, V], stored in u's dtype
        S = S * exp2(g_last)[:, None] + kg_c^T v_new
    if slot[n] >= 0: pool[slot[n]] = S

Grid ``(cdiv(V, BV), N, H)``: each program carries a ``[K, BV]`` tile of one state through its sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda_chunk_base import CHUNK_SIZE, ChunkStage, meta_chunks

__all__ = ["H_TUNE_CONFIGS", "KDAChunkH", "KDAChunkHKey", "chunk_h_reference"]

#: vLLM tunes BV in {32, 64} x {2, 4} warps x {2, 3, 4} stages (12); four of them here.
H_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BV": 32}, num_warps=4, num_stages=2),
    warmreg.TuneConfig(constexprs={"BV": 64}, num_warps=4, num_stages=2),
    warmreg.TuneConfig(constexprs={"BV": 32}, num_warps=2, num_stages=3),
    warmreg.TuneConfig(constexprs={"BV": 64}, num_warps=4, num_stages=3),
)


# The slot stride of the pool is the engine's (padded slots): a runtime int. The metadata is read a scalar
# at a time.
@triton.jit(
    do_not_specialize=["state_stride"],
    do_not_specialize_on_alignment=["cu_seqlens_ptr", "offsets_ptr", "slots_ptr", "init_ptr"],
)
def _kda_chunk_h_kernel(
    kg_ptr,  # [T, H, K]
    w_ptr,  # [T, H, K]
    u_ptr,  # [T, H, V]
    g_ptr,  # fp32 [T, H, K]
    h_ptr,  # out [NT, H, K, V]
    v_new_ptr,  # out [T, H, V]
    state_ptr,  # fp32 pool [num_slots, H, K, V], read and written in place
    cu_seqlens_ptr,
    offsets_ptr,  # [N + 1] first chunk of each sequence
    slots_ptr,  # int32 [N]
    init_ptr,  # bool [N] has_initial_state
    state_stride,
    H: tl.constexpr,  # heads on this rank
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BT: tl.constexpr,  # chunk size (64)
    BK: tl.constexpr,  # next_pow2(K): the state tile covers K
    BV: tl.constexpr,  # V per program (tuned)
):
    i_v, n, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64)
    chunk = tl.load(offsets_ptr + n).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_k = offs_k < K
    m_v = offs_v < V
    m_s = m_k[:, None] & m_v[None, :]
    offs_s = offs_k[:, None] * V + offs_v[None, :]
    # A negative slot still needs a valid address expression; the mask keeps it unread.
    p_s = state_ptr + tl.maximum(slot, 0) * state_stride + h * K * V + offs_s
    live = tl.where(slot >= 0, True, False)  # an int1 scalar (see kda.py on Triton 3.9's interpreter)
    init = tl.where(tl.load(init_ptr + n) != 0, True, False)
    b_s = tl.load(p_s, mask=m_s & live & init, other=0.0).to(tl.float32)
    offs_t = tl.arange(0, BT)
    base = bos
    # A while loop over loaded bounds (kda.py: Triton 3.6.0's interpreter cannot range over them).
    while base < eos:
        tl.store(h_ptr + (chunk * H + h) * K * V + offs_s, b_s.to(h_ptr.dtype.element_ty), mask=m_s)
        nv = tl.minimum(eos - base, BT)
        m_t = offs_t < nv
        rows = base + offs_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        offs_tk = (rows[:, None] * H + h) * K + offs_k[None, :]
        offs_tv = (rows[:, None] * H + h) * V + offs_v[None, :]
        b_w = tl.load(w_ptr + offs_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u_ptr + offs_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_s.to(b_w.dtype))
        tl.store(v_new_ptr + offs_tv, b_vn.to(v_new_ptr.dtype.element_ty), mask=m_tv)
        b_glast = tl.load(g_ptr + ((base + nv - 1) * H + h) * K + offs_k, mask=m_k, other=0.0)
        b_kg = tl.load(kg_ptr + offs_tk, mask=m_tk, other=0.0)
        b_s = b_s * tl.exp2(b_glast)[:, None] + tl.dot(tl.trans(b_kg), b_vn.to(b_kg.dtype))
        chunk += 1
        base += BT
    if slot >= 0:
        tl.store(p_s, b_s, mask=m_s)


@attrs.frozen(kw_only=True)
class KDAChunkHKey(warmreg.CompileKey):
    """What changes the binary of the state stage."""

    dtype: str  # kg, w, u, h, v_new
    num_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    chunk_size: int  # BT
    block_k: int  # BK
    state_aligned: bool  # the pool may be a view into a larger cache buffer
    config: int | None = None


class KDAChunkH(ChunkStage[KDAChunkHKey]):
    """The chunk-state stage of the chunked KDA prefill."""

    name = "kimi_k3.kda_chunk_h"
    key_type = KDAChunkHKey
    jit = _kda_chunk_h_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = H_TUNE_CONFIGS

    def dispatch(self, *, u: torch.Tensor, kg: torch.Tensor, state_pool: torch.Tensor) -> KDAChunkHKey:
        return KDAChunkHKey(
            dtype=warmreg.dtype_name(kg.dtype), num_heads=kg.shape[1], head_k_dim=kg.shape[2], head_v_dim=u.shape[2],
            chunk_size=CHUNK_SIZE, block_k=warmreg.next_pow2(kg.shape[2]), state_aligned=warmreg.is_aligned(state_pool),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        h, d = self.num_heads, self.head_dim
        pool = warmreg.meta((self.max_num_seqs + 1, h, d, d), torch.float32)  # the decode step's pool
        return [
            {"u": warmreg.meta((t, h, d), self.dtype), "kg": warmreg.meta((t, h, d), self.dtype), "state_pool": pool}
            for t in self.token_counts()
        ]

    def _inputs(self, key: KDAChunkHKey, tokens: int, seqs: int, make: Any) -> dict[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        return {
            "kg": make((tokens, h, kd), dt, 0), "w": make((tokens, h, kd), dt, 0), "u": make((tokens, h, vd), dt, 0),
            "g": make((tokens, h, kd), torch.float32, 0),
            "state_pool": make((seqs + 1, h, kd, vd), torch.float32, 0 if key.state_aligned else 1),
        }  # fmt: skip

    def warmup_inputs(self, key: KDAChunkHKey) -> Mapping[str, Any]:
        inputs = self._inputs(key, 1, 1, lambda s, d, off: warmreg.meta(s, d, offset=off))
        return {
            **inputs, "cu_seqlens": meta_chunks(1)["cu_seqlens"], "chunk_offsets": warmreg.meta((2,), torch.int32),
            "state_slots": warmreg.meta((1,), torch.int32), "has_initial_state": warmreg.meta((1,), torch.bool),
            "num_chunks": 1,
        }  # fmt: skip

    def tuning_inputs(self, key: KDAChunkHKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        seqs = batch["cu_seqlens"].shape[0] - 1

        def make(shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
            flat = -0.1 * torch.rand(offset + int(torch.tensor(shape).prod()), device=device)  # g <= 0, small values
            return flat[offset:].view(shape).to(dtype)

        return {
            **self._inputs(key, batch["tokens"], seqs, make), "cu_seqlens": batch["cu_seqlens"],
            "chunk_offsets": batch["chunk_offsets"], "state_slots": torch.arange(1, seqs + 1, dtype=torch.int32, device=device),
            "has_initial_state": torch.arange(seqs, device=device) % 2 == 0, "num_chunks": batch["chunk_indices"].shape[0],
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
        state_pool: torch.Tensor,
        state_slots: torch.Tensor,
        has_initial_state: torch.Tensor,
        num_chunks: int,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkHKey]:
        """``(h, v_new)``: the state at the start of each chunk (``[NT, H, K, V]``, k's dtype) and the corrected
        values (``[T, H, V]``, u's dtype), ``out``'s tensors or fresh ones; the final states are written into
        ``state_pool``.

        :param kg: ``[T, H, K]`` contiguous (the WY stage's ``kg``).
        :param w: like ``kg``.
        :param u: ``[T, H, V]`` contiguous, kg's dtype.
        :param g: fp32 ``[T, H, K]`` contiguous.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_offsets: int32 ``[N + 1]`` (:func:`~warmreg_kimi_k3.kda_chunk_base.chunk_metadata`).
        :param state_pool: fp32 ``[num_slots, H, K, V]``; the slot stride is free, the rest contiguous.
        :param state_slots: int32 ``[N]``; a negative slot: no initial state, no write-back.
        :param has_initial_state: bool ``[N]``: start from the pool's state (else from zeros).
        :param num_chunks: ``NT``, the number of chunks (``chunk_indices.shape[0]``).
        :param out: preallocated ``(h, v_new)``, contiguous, of those shapes and dtypes (then nothing is allocated).
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
        if state_pool.ndim != 4 or tuple(state_pool.shape[1:]) != (h, kd, vd) or state_pool.dtype != torch.float32:
            self.fail(
                f"state_pool must be float32 [num_slots, H, K, V] with (H, K, V) = {(h, kd, vd)} (got {state_pool.dtype} {tuple(state_pool.shape)})"
            )
        if state_pool.stride()[1:] != (kd * vd, vd, 1):
            self.fail(f"state_pool needs contiguous [H, K, V] slots (got strides {state_pool.stride()})")
        seqs = cu_seqlens.shape[0] - 1
        if state_slots.shape != (seqs,) or state_slots.dtype != torch.int32 or has_initial_state.shape != (seqs,):
            self.fail(f"state_slots (int32) and has_initial_state must be [N] with N = {seqs}")
        if has_initial_state.dtype != torch.bool:
            self.fail(f"has_initial_state must be bool (got {has_initial_state.dtype})")
        key = self.dispatch(u=u, kg=kg, state_pool=state_pool)
        hs_out, v_new_out = (None, None) if out is None else self.out_tuple(out, ("h", "v_new"))
        hs = warmreg.output(self.name, "out[0]", hs_out, (num_chunks, h, kd, vd), kg.dtype, kg.device)
        v_new = warmreg.output(self.name, "out[1]", v_new_out, u.shape, u.dtype, u.device)
        kwargs = dict(
            kg_ptr=kg, w_ptr=w, u_ptr=u, g_ptr=g, h_ptr=hs, v_new_ptr=v_new, state_ptr=state_pool,
            cu_seqlens_ptr=cu_seqlens, offsets_ptr=chunk_offsets, slots_ptr=state_slots, init_ptr=has_initial_state,
            state_stride=state_pool.stride(0), H=h, K=kd, V=vd, BT=key.chunk_size, BK=key.block_k,
        )  # fmt: skip

        def grid(meta: Mapping[str, Any]) -> tuple[int, ...]:
            return ((vd + meta["BV"] - 1) // meta["BV"], seqs, h)

        return warmreg.LaunchSpec(key, grid if seqs else None, kwargs, (hs, v_new))


def chunk_h_reference(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's loop, in fp32.

    :returns: ``(h, v_new, pool)``: fp32 ``[NT, H, K, V]`` and ``[T, H, V]``, and a copy of the pool with the
        final states written (the input pool is not modified).
    """
    pool = state_pool.clone()
    hs, v_new = [], torch.zeros(u.shape)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_slots.tolist()):
        s = pool[slot].clone() if slot >= 0 and bool(has_initial_state[n]) else torch.zeros(state_pool.shape[1:])
        for start in range(bounds[n], bounds[n + 1], CHUNK_SIZE):
            rows = slice(start, min(start + CHUNK_SIZE, bounds[n + 1]))
            hs.append(s.clone())
            vn = u[rows].float() - torch.einsum("thk,hkv->thv", w[rows].float(), s)
            v_new[rows] = vn
            s = s * torch.exp2(g[rows.stop - 1].float())[:, :, None] + torch.einsum(
                "thk,thv->hkv", kg[rows].float(), vn
            )
        if slot >= 0:
            pool[slot] = s
    return torch.stack(hs) if hs else torch.zeros((0, *state_pool.shape[1:])), v_new, pool
