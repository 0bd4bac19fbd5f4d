"""Chunked KDA prefill, stage 6: the output.

vLLM: ``chunk_gla_fwd_o_gk(q, v=v_new, g, A=Aqk, h, o=v if out is None else out, scale, cu_seqlens,
chunk_indices)`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk.py: chunk_gla_fwd_kernel_o``, autotuned on
``BT`` over ``BK``, ``BV``, ``num_warps`` and ``num_stages``). Math, per chunk and head, with the state ``h``
(``[V, K]``) at the chunk's start and the corrected values ``v_new`` from the h stage, ``A_qk`` from the intra
stage, in vLLM's order (q scaled and rounded to its dtype first, then decayed and rounded again; the second
product an ieee dot)::

    o = ((q * scale) * exp2(g)) h^T + tril(A_qk) v_new          # [n, V], stored in o's dtype

Grid ``(cdiv(V, BV), NT, H)``. It writes into the caller's ``o`` (vLLM's chain passes ``v`` itself when the layer
gives no ``out``), so that buffer's alignment is a key field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda_chunk_base import CHUNK_SIZE, ChunkStage, chunk_rows, meta_chunks, tuning_tensor

__all__ = ["O_TUNE_CONFIGS", "KDAChunkO", "KDAChunkOKey", "chunk_o_reference"]

#: vLLM tunes BK {32, 64} x BV {64, 128} x {2, 4, 8} warps x {2, 3, 4} stages (36); four of them here.
O_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BK": 64, "BV": 64}, num_warps=4, num_stages=2),
    warmreg.TuneConfig(constexprs={"BK": 32, "BV": 64}, num_warps=2, num_stages=3),
    warmreg.TuneConfig(constexprs={"BK": 64, "BV": 128}, num_warps=8, num_stages=2),
    warmreg.TuneConfig(constexprs={"BK": 64, "BV": 128}, num_warps=4, num_stages=3),
)


@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_ptr", "chunks_ptr"])
def _kda_chunk_o_kernel(
    q_ptr,  # L2-normalised q [T, H, K]
    v_ptr,  # v_new [T, H, V]
    g_ptr,  # fp32 [T, H, K]
    h_ptr,  # [NT, H, V, K]
    a_ptr,  # A_qk [T, H, BT]
    o_ptr,  # out [T, H, V]
    cu_seqlens_ptr,
    chunks_ptr,  # [NT, 2]
    scale,
    H: tl.constexpr,  # heads on this rank
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BT: tl.constexpr,  # chunk size (64)
    BK: tl.constexpr,  # K per step (tuned)
    BV: tl.constexpr,  # V per program (tuned)
):
    i_v, i_tg, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_n = tl.load(chunks_ptr + 2 * i_tg)
    i_t = tl.load(chunks_ptr + 2 * i_tg + 1).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
    T = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64) - bos
    m_s = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    m_t = o_t < T
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_qk = m_t[:, None] & m_k[None, :]
        offs = (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
        p_h = h_ptr + (i_tg * H + i_h) * K * V + o_v[:, None] * K + o_k[None, :]
        b_q = tl.load(q_ptr + offs, mask=m_qk, other=0.0)
        # vLLM's (b_q * scale): on a GPU q is promoted to the fp32 argument's type first, as here; the explicit
        # cast lets Triton's interpreter run bf16 too (it passes a float argument as a Python float, which
        # would make a bf16 constant)
        b_q = (b_q.to(tl.float32) * scale).to(b_q.dtype)
        b_g = tl.load(g_ptr + offs, mask=m_qk, other=0.0)
        b_qg = (b_q * tl.exp2(b_g)).to(b_q.dtype)
        b_h = tl.load(p_h, mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_o += tl.dot(b_qg, tl.trans(b_h).to(b_qg.dtype))
    offs_tv = (bos * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
    b_v = tl.load(v_ptr + offs_tv, mask=m_tv, other=0.0)
    p_a = a_ptr + (bos * H + i_h) * BT + o_t[:, None] * (H * BT) + o_i[None, :]
    b_a = tl.load(p_a, mask=m_t[:, None] & (o_i[None, :] < BT), other=0.0)
    b_a = tl.where(m_s, b_a, 0.0).to(b_v.dtype)  # above the diagonal: never written by the intra stage
    b_o += tl.dot(b_a, b_v, input_precision="ieee")
    tl.store(o_ptr + offs_tv, b_o.to(o_ptr.dtype.element_ty), mask=m_tv)


@attrs.frozen(kw_only=True)
class KDAChunkOKey(warmreg.CompileKey):
    """What changes the binary of the output stage."""

    dtype: str  # q, v_new, h, A_qk, o
    num_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    chunk_size: int  # BT
    o_dtype: str  # the output buffer's (vLLM stores into out's dtype)
    o_aligned: bool  # the output buffer's 16-byte alignment (vLLM's v, or the layer's out)
    config: int | None = None


class KDAChunkO(ChunkStage[KDAChunkOKey]):
    """The output stage of the chunked KDA prefill: replaces ``chunk_gla_fwd_o_gk`` inside vLLM's
    ``chunk_kda_with_fused_gate`` (module docstring); tensors without vLLM's leading batch dim of 1."""

    name = "kimi_k3.kda_chunk_o"
    key_type = KDAChunkOKey
    jit = _kda_chunk_o_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = O_TUNE_CONFIGS

    def dispatch(self, *, q: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor | None) -> KDAChunkOKey:
        return KDAChunkOKey(
            dtype=warmreg.dtype_name(q.dtype), num_heads=q.shape[1], head_k_dim=q.shape[2], head_v_dim=v_new.shape[2],
            chunk_size=CHUNK_SIZE, o_dtype=warmreg.dtype_name(v_new.dtype if out is None else out.dtype),
            o_aligned=out is None or warmreg.is_aligned(out),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        h, d = self.num_heads, self.head_dim
        # out: the layer's v or core_attn_out slice, aligned views in the activation dtype (keyed as a fresh one)
        return [
            {"q": warmreg.meta((t, h, d), self.dtype), "v_new": warmreg.meta((t, h, d), self.dtype), "out": None}
            for t in self.token_counts()
        ]

    def _inputs(self, key: KDAChunkOKey, tokens: int, chunks: int, make: Any) -> dict[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        return {
            "q": make((tokens, h, kd), dt), "v_new": make((tokens, h, vd), dt), "g": make((tokens, h, kd), torch.float32),
            "h": make((chunks, h, vd, kd), dt), "aqk": make((tokens, h, key.chunk_size), dt),
        }  # fmt: skip

    def _out(self, key: KDAChunkOKey, tokens: int, make_offset: Any) -> torch.Tensor | None:
        if key.o_dtype == key.dtype and key.o_aligned:
            return None  # a fresh output
        return make_offset(
            (tokens, key.num_heads, key.head_v_dim), getattr(torch, key.o_dtype), 0 if key.o_aligned else 1
        )

    def warmup_inputs(self, key: KDAChunkOKey) -> Mapping[str, Any]:
        o = self._out(key, 1, lambda s, d, off: warmreg.meta(s, d, offset=off))
        return {**self._inputs(key, 1, 1, warmreg.meta), **meta_chunks(1), "out": o}

    def tuning_inputs(self, key: KDAChunkOKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        inputs = self._inputs(key, batch["tokens"], batch["chunk_indices"].shape[0], partial(tuning_tensor, device))

        def make_offset(shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
            flat = torch.empty(offset + math.prod(shape), dtype=dtype, device=device)
            return flat[offset:].view(shape)

        o = self._out(key, batch["tokens"], make_offset)
        return {**inputs, "cu_seqlens": batch["cu_seqlens"], "chunk_indices": batch["chunk_indices"], "out": o}

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        v_new: torch.Tensor,
        g: torch.Tensor,
        h: torch.Tensor,
        aqk: torch.Tensor,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        *,
        scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkOKey]:
        """The output ``o`` ``[T, H, V]``: ``out`` (as vLLM, any float dtype and alignment: vLLM's chain hands
        it the layer's ``out`` or ``v`` itself), or a fresh tensor of v_new's dtype; rows outside the sequences
        unwritten.

        :param q: ``[T, H, K]`` contiguous, L2-normalised.
        :param v_new: ``[T, H, V]`` contiguous, q's dtype (the h stage's).
        :param g: fp32 ``[T, H, K]`` contiguous.
        :param h: ``[NT, H, V, K]`` contiguous, q's dtype (the h stage's).
        :param aqk: ``[T, H, 64]`` contiguous, q's dtype (the intra stage's).
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]``.
        :param scale: applied to q (default ``K ** -0.5``).
        :param out: where to write ``o``: contiguous, v_new's shape, a float dtype (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` that is not
            contiguous of v_new's shape.
        """
        if q.ndim != 3 or v_new.ndim != 3 or v_new.shape[:2] != q.shape[:2] or g.shape != q.shape:
            self.fail(f"q, g must be [T, H, K] and v_new [T, H, V] (got {[tuple(x.shape) for x in (q, g, v_new)]})")
        t, hd, kd = q.shape
        vd = v_new.shape[2]
        num_chunks = chunk_indices.shape[0]
        if h.shape != (num_chunks, hd, vd, kd) or aqk.shape != (t, hd, CHUNK_SIZE):
            self.fail(
                f"h must be [NT, H, V, K] = {(num_chunks, hd, vd, kd)} and aqk [T, H, {CHUNK_SIZE}] (got {tuple(h.shape)}, {tuple(aqk.shape)})"
            )
        if (
            not all(x.is_contiguous() for x in (q, v_new, g, h, aqk))
            or not v_new.dtype == h.dtype == aqk.dtype == q.dtype
        ):
            self.fail("q, v_new, g, h and aqk must be contiguous, all but g of one dtype")
        if out is not None and (
            not isinstance(out, torch.Tensor) or out.shape != v_new.shape or not out.is_contiguous()
            or not out.dtype.is_floating_point or out.device != v_new.device
        ):  # fmt: skip
            got = f"{out.dtype} {tuple(out.shape)}, strides {out.stride()}" if isinstance(out, torch.Tensor) else out
            self.fail(f"out is not a contiguous float tensor of shape {tuple(v_new.shape)} (got {got})")
        key = self.dispatch(q=q, v_new=v_new, out=out)
        o = warmreg.output(self.name, "out", None, v_new.shape, v_new.dtype, v_new.device) if out is None else out
        kwargs = dict(
            q_ptr=q, v_ptr=v_new, g_ptr=g, h_ptr=h, a_ptr=aqk, o_ptr=o, cu_seqlens_ptr=cu_seqlens,
            chunks_ptr=chunk_indices, scale=float(kd**-0.5 if scale is None else scale), H=hd, K=kd, V=vd,
            BT=key.chunk_size,
        )  # fmt: skip

        def grid(meta: Mapping[str, Any]) -> tuple[int, ...]:
            return ((vd + meta["BV"] - 1) // meta["BV"], num_chunks, hd)

        return warmreg.LaunchSpec(key, grid if num_chunks else None, kwargs, o)


def chunk_o_reference(
    q: torch.Tensor,
    v_new: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    aqk: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch reference of the module docstring's formula, per chunk, in fp32 (zeros outside the sequences)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v_new.shape)
    for chunk, rows in enumerate(chunk_rows(cu_seqlens)):
        n = rows.stop - rows.start
        qg = scale * q[rows].float() * torch.exp2(g[rows].float())
        lower = torch.ones(n, n, dtype=torch.bool).tril()[:, None, :]
        a = torch.where(lower, aqk[rows, :, :n].float(), 0.0)  # [i, H, j]; above the diagonal unwritten (any bits)
        o[rows] = torch.einsum("thk,hvk->thv", qg, h[chunk].float()) + torch.einsum(
            "ihj,jhv->ihv", a, v_new[rows].float()
        )
    return o
