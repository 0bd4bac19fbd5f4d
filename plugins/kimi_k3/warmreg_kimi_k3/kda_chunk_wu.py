"""Chunked KDA prefill, stage 4: the WY factors ``w``, ``u`` and the decayed keys ``kg``.

vLLM: ``recompute_w_u_fwd(k, v, beta, A, gk=g, cu_seqlens, chunk_indices)`` (``vllm/models/kimi_k3/nvidia/ops/
third_party/kda/chunk.py: recompute_w_u_fwd_kernel``, autotuned on ``H, K, V, BT, BK, BV, IS_VARLEN`` over
``num_warps`` and ``num_stages``, ``BK = BV = 64`` whatever the head dim). Math, per chunk and head, with
``A = A_kk`` from the intra stage and ``g`` the chunk-local cumulative gate (log2), in vLLM's order and dot
precisions::

    u  = A ((beta * v) in v's dtype)                        # [n, V], ieee dot
    w  = A ((beta * k * exp2(g)) in k's dtype)              # [n, K]
    kg = k * exp2(g_last - g)                               # [n, K], g_last: g at the chunk's last token

so that the chunk's corrected values are ``u - w S0`` for the state ``S0`` at its start (the h stage). ``w``,
``kg`` in k's dtype, ``u`` in v's, each ``[T, H, *]`` (vLLM's ``[1, T, H, *]`` without the batch dim).
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

from .kda_chunk_base import CHUNK_SIZE, ChunkStage, chunk_rows, meta_chunks, tuning_tensor

__all__ = ["BLOCK", "WU_TUNE_CONFIGS", "KDAChunkWU", "KDAChunkWUKey", "chunk_wu_reference"]

#: vLLM tunes {2, 4, 8} warps x {2, 3, 4} stages (9); these four keep the corners and the middle.
WU_TUNE_CONFIGS = (
    warmreg.TuneConfig(num_warps=4, num_stages=2),
    warmreg.TuneConfig(num_warps=2, num_stages=2),
    warmreg.TuneConfig(num_warps=4, num_stages=3),
    warmreg.TuneConfig(num_warps=8, num_stages=3),
)
#: K and V per step: vLLM's ``BK = BV = 64`` (masked for smaller heads).
BLOCK = 64


@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_ptr", "chunks_ptr", "beta_ptr"])
def _kda_chunk_wu_kernel(
    k_ptr,  # L2-normalised k [T, H, K]
    v_ptr,  # [T, H, V]
    beta_ptr,  # fp32 [T, H]
    a_ptr,  # A_kk [T, H, BT]
    g_ptr,  # fp32 [T, H, K]
    w_ptr,  # out [T, H, K]
    u_ptr,  # out [T, H, V]
    kg_ptr,  # out [T, H, K]
    cu_seqlens_ptr,
    chunks_ptr,  # [NT, 2]
    H: tl.constexpr,  # heads on this rank
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BT: tl.constexpr,  # chunk size (64)
    BK: tl.constexpr,  # K per step (64)
    BV: tl.constexpr,  # V per step (64)
):
    i_c, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunks_ptr + 2 * i_c)
    c = tl.load(chunks_ptr + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    T = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - bos
    o_t = c * BT + tl.arange(0, BT)  # rows of the sequence
    m_t = o_t < T
    b_b = tl.load(beta_ptr + bos * H + h + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    o_a = tl.arange(0, BT)
    p_a = a_ptr + (bos * H + h) * BT + o_t[:, None] * (H * BT) + o_a[None, :]
    b_a = tl.load(p_a, mask=m_t[:, None] & (o_a[None, :] < BT), other=0.0)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v[None, :] < V)
        offs = (bos * H + h) * V + o_t[:, None] * (H * V) + o_v[None, :]
        b_v = tl.load(v_ptr + offs, mask=m_v, other=0.0)
        b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
        b_u = tl.dot(b_a, b_vb, input_precision="ieee")
        tl.store(u_ptr + offs, b_u.to(u_ptr.dtype.element_ty), mask=m_v)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        offs = (bos * H + h) * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k_ptr + offs, mask=m_tk, other=0.0)
        b_kb = b_k * b_b[:, None]
        b_gk = tl.load(g_ptr + offs, mask=m_tk, other=0.0)
        b_kb *= tl.exp2(b_gk)
        last = tl.minimum(c * BT + BT, T) - 1
        b_gn = tl.load(g_ptr + ((bos + last) * H + h) * K + o_k, mask=m_k, other=0.0)
        b_kg = b_k * tl.exp2(b_gn - b_gk)
        tl.store(kg_ptr + offs, b_kg.to(kg_ptr.dtype.element_ty), mask=m_tk)
        b_w = tl.dot(b_a, b_kb.to(b_k.dtype))
        tl.store(w_ptr + offs, b_w.to(w_ptr.dtype.element_ty), mask=m_tk)


@attrs.frozen(kw_only=True)
class KDAChunkWUKey(warmreg.CompileKey):
    """What changes the binary of the WY stage."""

    dtype: str  # k, v, A_kk, w, u, kg
    num_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    chunk_size: int  # BT
    v_aligned: bool  # v comes from the caller; everything else is a fresh tensor
    config: int | None = None


class KDAChunkWU(ChunkStage[KDAChunkWUKey]):
    """The WY-factor stage of the chunked KDA prefill: replaces ``recompute_w_u_fwd(k, v, beta, A, gk=g,
    cu_seqlens, chunk_indices)`` inside vLLM's ``chunk_kda_with_fused_gate`` (module docstring); tensors without
    vLLM's leading batch dim of 1."""

    name = "kimi_k3.kda_chunk_wu"
    key_type = KDAChunkWUKey
    jit = _kda_chunk_wu_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = WU_TUNE_CONFIGS

    def dispatch(self, *, k: torch.Tensor, v: torch.Tensor) -> KDAChunkWUKey:
        return KDAChunkWUKey(
            dtype=warmreg.dtype_name(k.dtype), num_heads=k.shape[1], head_k_dim=k.shape[2], head_v_dim=v.shape[2],
            chunk_size=CHUNK_SIZE, v_aligned=warmreg.is_aligned(v),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        h, d = self.num_heads, self.head_dim
        return [
            {"k": warmreg.meta((t, h, d), self.dtype), "v": warmreg.meta((t, h, d), self.dtype)}
            for t in self.token_counts()
        ]

    def _inputs(self, key: KDAChunkWUKey, tokens: int, make: Any) -> dict[str, Any]:
        dt, h = getattr(torch, key.dtype), key.num_heads
        return {
            "k": make((tokens, h, key.head_k_dim), dt, 0), "v": make((tokens, h, key.head_v_dim), dt, 0 if key.v_aligned else 1),
            "beta": make((tokens, h), torch.float32, 0), "akk": make((tokens, h, key.chunk_size), dt, 0),
            "g": make((tokens, h, key.head_k_dim), torch.float32, 0),
        }  # fmt: skip

    def warmup_inputs(self, key: KDAChunkWUKey) -> Mapping[str, Any]:
        return {**self._inputs(key, 1, lambda s, d, off: warmreg.meta(s, d, offset=off)), **meta_chunks(1)}

    def tuning_inputs(self, key: KDAChunkWUKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        inputs = self._inputs(key, batch["tokens"], partial(tuning_tensor, device))
        return {**inputs, "cu_seqlens": batch["cu_seqlens"], "chunk_indices": batch["chunk_indices"]}

    @warmreg.kernel_launcher
    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        akk: torch.Tensor,
        g: torch.Tensor,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        *,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkWUKey]:
        """``(w, u, kg)`` of the module docstring: k's, v's and k's shape, all of k's dtype (``out``'s tensors, or
        fresh ones), as vLLM's ``recompute_w_u_fwd`` returns ``(w, u, None, kg)``.

        :param k: ``[T, H, K]`` contiguous, L2-normalised.
        :param v: ``[T, H, V]`` contiguous, k's dtype.
        :param beta: fp32 ``[T, H]`` contiguous.
        :param akk: ``[T, H, 64]`` contiguous, the intra stage's ``A_kk`` (k's dtype).
        :param g: fp32 ``[T, H, K]`` contiguous.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]``.
        :param out: preallocated ``(w, u, kg)``, contiguous, of those shapes and dtype (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` that is not
            the outputs' shapes, dtypes and layouts.
        """
        if k.ndim != 3 or v.ndim != 3 or v.shape[:2] != k.shape[:2] or g.shape != k.shape:
            self.fail(
                f"k, v, g must be [T, H, K], [T, H, V], [T, H, K] (got {tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)})"
            )
        t, h, kd = k.shape
        if beta.shape != (t, h) or akk.shape != (t, h, CHUNK_SIZE):
            self.fail(
                f"beta and akk must be [T, H] and [T, H, {CHUNK_SIZE}] (got {tuple(beta.shape)}, {tuple(akk.shape)})"
            )
        if not all(x.is_contiguous() for x in (k, v, beta, akk, g)) or not v.dtype == akk.dtype == k.dtype:
            self.fail("k, v, beta, akk and g must be contiguous; k, v and akk of one dtype")
        if min(kd, v.shape[2]) < 16:
            self.fail(f"K and V must be >= 16 (tl.dot), got {kd} and {v.shape[2]}")
        key = self.dispatch(k=k, v=v)
        w_out, u_out, kg_out = (None, None, None) if out is None else self.out_tuple(out, ("w", "u", "kg"))
        w = warmreg.output(self.name, "out[0]", w_out, k.shape, k.dtype, k.device)
        u = warmreg.output(self.name, "out[1]", u_out, v.shape, v.dtype, v.device)
        kg = warmreg.output(self.name, "out[2]", kg_out, k.shape, k.dtype, k.device)
        kwargs = dict(
            k_ptr=k, v_ptr=v, beta_ptr=beta, a_ptr=akk, g_ptr=g, w_ptr=w, u_ptr=u, kg_ptr=kg, cu_seqlens_ptr=cu_seqlens,
            chunks_ptr=chunk_indices, H=h, K=kd, V=key.head_v_dim, BT=key.chunk_size, BK=BLOCK, BV=BLOCK,
        )  # fmt: skip
        num_chunks = chunk_indices.shape[0]
        return warmreg.LaunchSpec(key, (num_chunks, h) if num_chunks else None, kwargs, (w, u, kg))


def chunk_wu_reference(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, akk: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's formulas, per chunk, in fp32.

    :returns: ``(w, u, kg)`` in fp32, zeros outside the sequences.
    """
    w, u, kg = torch.zeros(k.shape), torch.zeros(v.shape), torch.zeros(k.shape)
    for rows in chunk_rows(cu_seqlens):
        n = rows.stop - rows.start
        a = akk[rows, :, :n].float().transpose(0, 1)  # [H, n, n]
        b = beta[rows].float().transpose(0, 1)[:, :, None]
        kc, vc, gc = (x[rows].float().transpose(0, 1) for x in (k, v, g))
        u[rows] = (a @ (b * vc)).transpose(0, 1)
        w[rows] = (a @ (b * kc * torch.exp2(gc))).transpose(0, 1)
        kg[rows] = (kc * torch.exp2(gc[:, -1:, :] - gc)).transpose(0, 1)
    return w, u, kg
