"""Chunked KDA prefill, stage 6: the output.

vLLM: ``chunk_gla_fwd_o_gk`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk.py: chunk_gla_fwd_kernel_o``,
autotuned on ``BT`` over ``BK``, ``BV``, ``num_warps`` and ``num_stages``). Math, per chunk and head, with the state
``h`` at the chunk's start and the corrected values ``v_new`` from the h stage, ``A_qk`` from the intra stage::

    o = (scale * q * exp2(g)) h + tril(A_qk) v_new          # [n, V], in v_new's dtype

Grid ``(cdiv(V, BV), NT, H)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda_chunk_base import CHUNK_SIZE, ChunkStage, chunk_rows, meta_chunks

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
    v_new_ptr,  # [T, H, V]
    g_ptr,  # fp32 [T, H, K]
    h_ptr,  # [NT, H, K, V]
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
    i_v, i_c, h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    n = tl.load(chunks_ptr + 2 * i_c)
    c = tl.load(chunks_ptr + 2 * i_c + 1)
    base = tl.load(cu_seqlens_ptr + n).to(tl.int64) + c.to(tl.int64) * BT
    nv = tl.minimum(tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - base, BT)
    offs_t = tl.arange(0, BT)
    offs_v = i_v * BV + tl.arange(0, BV)
    m_t = offs_t < nv
    m_v = offs_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    rows = base + offs_t
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        m_k = offs_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        offs = (rows[:, None] * H + h) * K + offs_k[None, :]
        b_q = tl.load(q_ptr + offs, mask=m_tk, other=0.0)
        b_g = tl.load(g_ptr + offs, mask=m_tk, other=0.0)
        b_qg = (b_q.to(tl.float32) * scale * tl.exp2(b_g)).to(b_q.dtype)
        p_h = h_ptr + (i_c * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]
        b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_qg, b_h.to(b_qg.dtype))
    offs_tv = (rows[:, None] * H + h) * V + offs_v[None, :]
    b_vn = tl.load(v_new_ptr + offs_tv, mask=m_tv, other=0.0)
    b_a = tl.load(a_ptr + (rows[:, None] * H + h) * BT + offs_t[None, :], mask=m_t[:, None], other=0.0)
    b_a = tl.where(offs_t[:, None] >= offs_t[None, :], b_a, 0.0).to(b_vn.dtype)  # above the diagonal: unwritten
    b_o += tl.dot(b_a, b_vn)
    tl.store(o_ptr + offs_tv, b_o.to(o_ptr.dtype.element_ty), mask=m_tv)


@attrs.frozen(kw_only=True)
class KDAChunkOKey(warmreg.CompileKey):
    """What changes the binary of the output stage."""

    dtype: str  # q, v_new, h, A_qk, o
    num_heads: int  # H
    head_k_dim: int  # K
    head_v_dim: int  # V
    chunk_size: int  # BT
    config: int | None = None


class KDAChunkO(ChunkStage[KDAChunkOKey]):
    """The output stage of the chunked KDA prefill."""

    name = "kimi_k3.kda_chunk_o"
    key_type = KDAChunkOKey
    jit = _kda_chunk_o_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = O_TUNE_CONFIGS

    def dispatch(self, *, q: torch.Tensor, v_new: torch.Tensor) -> KDAChunkOKey:
        return KDAChunkOKey(
            dtype=warmreg.dtype_name(q.dtype), num_heads=q.shape[1], head_k_dim=q.shape[2], head_v_dim=v_new.shape[2],
            chunk_size=CHUNK_SIZE,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        h, d = self.num_heads, self.head_dim
        return [
            {"q": warmreg.meta((t, h, d), self.dtype), "v_new": warmreg.meta((t, h, d), self.dtype)}
            for t in self.token_counts()
        ]

    def _inputs(self, key: KDAChunkOKey, tokens: int, chunks: int, make: Any) -> dict[str, Any]:
        dt, h, kd, vd = getattr(torch, key.dtype), key.num_heads, key.head_k_dim, key.head_v_dim
        return {
            "q": make((tokens, h, kd), dt), "v_new": make((tokens, h, vd), dt), "g": make((tokens, h, kd), torch.float32),
            "h": make((chunks, h, kd, vd), dt), "aqk": make((tokens, h, key.chunk_size), dt),
        }  # fmt: skip

    def warmup_inputs(self, key: KDAChunkOKey) -> Mapping[str, Any]:
        return {**self._inputs(key, 1, 1, warmreg.meta), **meta_chunks(1)}

    def tuning_inputs(self, key: KDAChunkOKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)

        def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return -0.1 * torch.rand(shape, device=device).to(dtype)

        inputs = self._inputs(key, batch["tokens"], batch["chunk_indices"].shape[0], make)
        return {**inputs, "cu_seqlens": batch["cu_seqlens"], "chunk_indices": batch["chunk_indices"]}

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
        """The output ``o`` ``[T, H, V]`` (v_new's dtype; ``out``, or a fresh tensor; rows outside the sequences
        unwritten).

        :param q: ``[T, H, K]`` contiguous, L2-normalised.
        :param v_new: ``[T, H, V]`` contiguous, q's dtype (the h stage's).
        :param g: fp32 ``[T, H, K]`` contiguous.
        :param h: ``[NT, H, K, V]`` contiguous, q's dtype (the h stage's).
        :param aqk: ``[T, H, 64]`` contiguous, q's dtype (the intra stage's).
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]``.
        :param scale: applied to q (default ``K ** -0.5``).
        :param out: a preallocated ``o``, contiguous, v_new's shape and dtype (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` that is not the
            output's shape, dtype and layout.
        """
        if q.ndim != 3 or v_new.ndim != 3 or v_new.shape[:2] != q.shape[:2] or g.shape != q.shape:
            self.fail(f"q, g must be [T, H, K] and v_new [T, H, V] (got {[tuple(x.shape) for x in (q, g, v_new)]})")
        t, hd, kd = q.shape
        vd = v_new.shape[2]
        num_chunks = chunk_indices.shape[0]
        if h.shape != (num_chunks, hd, kd, vd) or aqk.shape != (t, hd, CHUNK_SIZE):
            self.fail(
                f"h must be [NT, H, K, V] = {(num_chunks, hd, kd, vd)} and aqk [T, H, {CHUNK_SIZE}] (got {tuple(h.shape)}, {tuple(aqk.shape)})"
            )
        if (
            not all(x.is_contiguous() for x in (q, v_new, g, h, aqk))
            or not v_new.dtype == h.dtype == aqk.dtype == q.dtype
        ):
            self.fail("q, v_new, g, h and aqk must be contiguous, all but g of one dtype")
        key = self.dispatch(q=q, v_new=v_new)
        o = warmreg.output(self.name, "out", out, v_new.shape, v_new.dtype, v_new.device)
        kwargs = dict(
            q_ptr=q, v_new_ptr=v_new, g_ptr=g, h_ptr=h, a_ptr=aqk, o_ptr=o, cu_seqlens_ptr=cu_seqlens,
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
        a = aqk[rows, :, :n].float() * torch.ones(n, n).tril()[:, None, :]  # [i, H, j]
        o[rows] = torch.einsum("thk,hkv->thv", qg, h[chunk].float()) + torch.einsum(
            "ihj,jhv->ihv", a, v_new[rows].float()
        )
    return o
