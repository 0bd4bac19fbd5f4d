"""Chunked KDA prefill, stage 3: the intra-chunk matrices ``A_qk`` and ``(I + L)^-1``.

vLLM: ``chunk_kda_fwd_intra`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk_intra.py``): the diagonal
16-token sub-chunk blocks (``chunk_kda_fwd_kernel_intra_sub_chunk`` with a lower bound, else
``chunk_intra_token_parallel.py: chunk_kda_fwd_kernel_intra_token_parallel``), then
``chunk_kda_fwd_kernel_inter_solve_fused`` (autotuned on ``H, HV, K, BC`` over ``BK`` and ``num_warps``): the
blocks between sub-chunks and the inverse. Here one kernel does both, one program per (chunk, head).

Math, for one chunk of ``n <= 64`` tokens (rows ``i, j`` of the chunk, ``g`` the chunk-local cumulative gate in
log2 units from the gate stage, so ``exp2(g_i - g_j)`` is the decay from token ``j`` to token ``i``)::

    A_qk[i, j] = scale * sum_c q_i[c] k_j[c] exp2(g_i[c] - g_j[c])          for j <= i, else 0
    L[i, j]    = beta_i * sum_c k_i[c] k_j[c] exp2(g_i[c] - g_j[c])         for j <  i, else 0
    A_kk       = (I + L)^-1

Numerically safe decay products, as FLA takes them: ``g`` never increases along a chunk (each gate is ``<= 0``),
so every exponent used is ``<= 0``. Between sub-chunks the product goes through the later sub-chunk's first row
``r``: ``(q_i exp2(g_i - g_r)) . (k_j exp2(g_r - g_j))``, a ``tl.dot``; inside a 16-token sub-chunk the pairs are
taken one by one (token-parallel, FLA's path for the unbounded gate; this kernel takes it for both gates, where
vLLM takes a midpoint-referenced product when a lower bound is set). The inverse: the four diagonal blocks by
forward substitution in fp32 (all four at once, one row of each per step), then the blocks below them by block
forward substitution (``X_ij = -D_i sum_{j <= m < i} L_im X_mj``) with fp32 ``tl.dot`` (``ieee``: vLLM takes
tf32 there).

Outputs in the activation dtype (as vLLM's ``Aqk`` and ``Akk``): ``[T, H, 64]``, row ``t`` holding the row of
``t``'s chunk; ``A_kk`` rows are written in full (zeros above the diagonal), ``A_qk`` rows only on and below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda_chunk_base import CHUNK_SIZE, SUB_CHUNK, ChunkStage, chunk_rows, meta_chunks

__all__ = ["INTRA_TUNE_CONFIGS", "KDAChunkIntra", "KDAChunkIntraKey", "chunk_intra_reference"]

#: vLLM's inter/solve kernel tunes BK in {32, 64} x {1, 2, 4} warps; one warp is left out (the token-parallel
#: [16, 16, BK] products run in the same program here).
INTRA_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BK": 32}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BK": 32}, num_warps=4),
    warmreg.TuneConfig(constexprs={"BK": 64}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BK": 64}, num_warps=4),
)


@triton.jit
def _pick(b_y, offs_c, c: tl.constexpr):  # c: which of the batched diagonal blocks
    return tl.sum(tl.where((offs_c == c)[:, None, None], b_y, 0.0), axis=0)


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _lblock(
    l_ptr, base, nv, h, ri: tl.constexpr, cj: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):  # ri, cj: which block (constants of the unrolled solve); H, BT, BC: the layout
    offs = tl.arange(0, BC)
    rows = ri * BC + offs
    p = ((base + rows) * H + h)[:, None] * BT + (cj * BC + offs)[None, :]
    return tl.load(l_ptr + p, mask=(rows < nv)[:, None] & (offs < BC)[None, :], other=0.0)


@triton.jit
def _store_row(
    a_ptr, base, nv, h, ri: tl.constexpr, x0, x1, x2, x3, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):  # ri: the block row (a constant of the unrolled solve); H, BT, BC: the layout
    offs = tl.arange(0, BC)
    rows = ri * BC + offs
    m = (rows < nv)[:, None] & (offs < BC)[None, :]
    p = a_ptr + ((base + rows) * H + h)[:, None] * BT + offs[None, :]
    tl.store(p, x0.to(a_ptr.dtype.element_ty), mask=m)
    tl.store(p + BC, x1.to(a_ptr.dtype.element_ty), mask=m)
    tl.store(p + 2 * BC, x2.to(a_ptr.dtype.element_ty), mask=m)
    tl.store(p + 3 * BC, x3.to(a_ptr.dtype.element_ty), mask=m)


# The metadata and beta are read a scalar (or a row) at a time: their alignment must not specialize.
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_ptr", "chunks_ptr", "beta_ptr"])
def _kda_chunk_intra_kernel(
    q_ptr,  # L2-normalised q [T, H, K]
    k_ptr,  # L2-normalised k [T, H, K]
    g_ptr,  # fp32 [T, H, K], the chunk-local cumulative gate in log2 units
    beta_ptr,  # fp32 [T, H]
    aqk_ptr,  # out [T, H, BT]: row t holds A_qk[t, :] of t's chunk (lower triangle, diagonal included)
    akk_ptr,  # out [T, H, BT]: (I + L)^-1, rows likewise
    l_ptr,  # fp32 scratch [T, H, BT]: L (strictly lower)
    cu_seqlens_ptr,
    chunks_ptr,  # [NT, 2] (sequence, chunk within it)
    scale,
    H: tl.constexpr,  # heads on this rank: a model constant
    K: tl.constexpr,  # head dim
    BT: tl.constexpr,  # chunk size (64)
    BC: tl.constexpr,  # sub-chunk size (16): BT == 4 * BC
    BK: tl.constexpr,  # K per step (tuned)
):
    tl.static_assert(BT == 4 * BC)
    i_c, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunks_ptr + 2 * i_c)
    c = tl.load(chunks_ptr + 2 * i_c + 1)
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    base = bos + c.to(tl.int64) * BT  # first token row of the chunk
    nv = tl.minimum(tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - base, BT)  # its valid rows
    offs_j = tl.arange(0, BT)
    offs_r = tl.arange(0, BC)
    for ci in tl.static_range(BT // BC):
        offs_i = ci * BC + offs_r
        m_i = offs_i < nv
        if ci * BC < nv:
            acc_qk = tl.zeros([BC, BT], dtype=tl.float32)
            acc_kk = tl.zeros([BC, BT], dtype=tl.float32)
            d_qk = tl.zeros([BC, BC], dtype=tl.float32)
            d_kk = tl.zeros([BC, BC], dtype=tl.float32)
            for k0 in range(0, K, BK):
                offs_k = k0 + tl.arange(0, BK)
                m_k = offs_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                p_i = ((base + offs_i)[:, None] * H + h) * K + offs_k[None, :]
                b_q = tl.load(q_ptr + p_i, mask=m_ik, other=0.0).to(tl.float32)
                b_k = tl.load(k_ptr + p_i, mask=m_ik, other=0.0).to(tl.float32)
                b_g = tl.load(g_ptr + p_i, mask=m_ik, other=0.0)
                if ci > 0:
                    # Rows of this sub-chunk against every earlier row, through the decay at the sub-chunk's
                    # first row gn: both exponents are <= 0 (g is a cumulative sum of gates <= 0).
                    b_gn = tl.load(g_ptr + ((base + ci * BC) * H + h) * K + offs_k, mask=m_k, other=0.0)
                    m_j = offs_j < ci * BC
                    m_jk = m_j[:, None] & m_k[None, :]
                    p_j = ((base + offs_j)[:, None] * H + h) * K + offs_k[None, :]
                    b_kj = tl.load(k_ptr + p_j, mask=m_jk, other=0.0).to(tl.float32)
                    b_gj = tl.load(g_ptr + p_j, mask=m_jk, other=0.0)
                    b_kd = b_kj * tl.exp2(tl.where(m_jk, b_gn[None, :] - b_gj, 0.0))
                    b_up = tl.exp2(tl.where(m_ik, b_g - b_gn[None, :], 0.0))
                    acc_qk += tl.dot(b_q * b_up, tl.trans(b_kd))
                    acc_kk += tl.dot(b_k * b_up, tl.trans(b_kd))
                # Inside the sub-chunk, pair by pair: exp2(g_r - g_j) for j <= r, never above 1.
                m_rj = (offs_r[:, None] >= offs_r[None, :])[:, :, None] & m_ik[None, :, :]
                b_w = tl.exp2(tl.where(m_rj, b_g[:, None, :] - b_g[None, :, :], float("-inf"))) * b_k[None, :, :]
                d_qk += tl.sum(b_q[:, None, :] * b_w, axis=2)
                d_kk += tl.sum(b_k[:, None, :] * b_w, axis=2)
            b_beta = tl.load(beta_ptr + (base + offs_i) * H + h, mask=m_i, other=0.0)
            p_row = ((base + offs_i) * H + h) * BT
            m_off = m_i[:, None] & (offs_j < ci * BC)[None, :]
            p_off = p_row[:, None] + offs_j[None, :]
            tl.store(aqk_ptr + p_off, (acc_qk * scale).to(aqk_ptr.dtype.element_ty), mask=m_off)
            tl.store(l_ptr + p_off, acc_kk * b_beta[:, None], mask=m_off)
            p_diag = p_row[:, None] + (ci * BC + offs_r)[None, :]
            m_diag = m_i[:, None] & (offs_r[None, :] < BC)
            d_qk = tl.where(offs_r[:, None] >= offs_r[None, :], d_qk, 0.0)
            d_kk = tl.where(offs_r[:, None] > offs_r[None, :], d_kk, 0.0)
            tl.store(aqk_ptr + p_diag, (d_qk * scale).to(aqk_ptr.dtype.element_ty), mask=m_diag)
            tl.store(l_ptr + p_diag, d_kk * b_beta[:, None], mask=m_diag)
    tl.debug_barrier()
    # (I + L)^-1, L strictly lower: the four diagonal BC x BC blocks by forward substitution, all four at
    # once (rows r of every block per step), in fp32; then the blocks below them from those (block
    # forward substitution: X_ij = -D_i sum_{j <= m < i} L_im X_mj).
    offs_c = tl.arange(0, BT // BC)
    b_y = tl.zeros([BT // BC, BC, BC], dtype=tl.float32)
    for r in range(1, BC):
        rows = offs_c * BC + r
        m_a = (rows < nv)[:, None] & (offs_r < r)[None, :]
        p_a = ((base + rows) * H + h)[:, None] * BT + (offs_c * BC)[:, None] + offs_r[None, :]
        b_a = -tl.load(l_ptr + p_a, mask=m_a, other=0.0)
        b_a += tl.sum(b_a[:, :, None] * b_y, axis=1)
        b_y = tl.where((offs_r == r)[None, :, None], b_a[:, None, :], b_y)
    b_y += tl.where(offs_r[:, None] == offs_r[None, :], 1.0, 0.0)[None, :, :]
    d0 = _pick(b_y, offs_c, 0)
    d1 = _pick(b_y, offs_c, 1)
    d2 = _pick(b_y, offs_c, 2)
    d3 = _pick(b_y, offs_c, 3)
    x10 = -_mm(d1, _mm(_lblock(l_ptr, base, nv, h, 1, 0, H, BT, BC), d0))
    x21 = -_mm(d2, _mm(_lblock(l_ptr, base, nv, h, 2, 1, H, BT, BC), d1))
    x32 = -_mm(d3, _mm(_lblock(l_ptr, base, nv, h, 3, 2, H, BT, BC), d2))
    x20 = -_mm(
        d2,
        _mm(_lblock(l_ptr, base, nv, h, 2, 0, H, BT, BC), d0) + _mm(_lblock(l_ptr, base, nv, h, 2, 1, H, BT, BC), x10),
    )
    x31 = -_mm(
        d3,
        _mm(_lblock(l_ptr, base, nv, h, 3, 1, H, BT, BC), d1) + _mm(_lblock(l_ptr, base, nv, h, 3, 2, H, BT, BC), x21),
    )
    x30 = -_mm(
        d3,
        _mm(_lblock(l_ptr, base, nv, h, 3, 0, H, BT, BC), d0)
        + _mm(_lblock(l_ptr, base, nv, h, 3, 1, H, BT, BC), x10)
        + _mm(_lblock(l_ptr, base, nv, h, 3, 2, H, BT, BC), x20),
    )
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_row(akk_ptr, base, nv, h, 0, d0, zero, zero, zero, H, BT, BC)
    _store_row(akk_ptr, base, nv, h, 1, x10, d1, zero, zero, H, BT, BC)
    _store_row(akk_ptr, base, nv, h, 2, x20, x21, d2, zero, H, BT, BC)
    _store_row(akk_ptr, base, nv, h, 3, x30, x31, x32, d3, H, BT, BC)


@attrs.frozen(kw_only=True)
class KDAChunkIntraKey(warmreg.CompileKey):
    """What changes the binary of the intra-chunk stage."""

    dtype: str  # q, k, A_qk, A_kk
    num_heads: int  # H
    head_dim: int  # K
    chunk_size: int  # BT
    sub_chunk: int  # BC
    config: int | None = None


class KDAChunkIntra(ChunkStage[KDAChunkIntraKey]):
    """The intra-chunk stage of the chunked KDA prefill."""

    name = "kimi_k3.kda_chunk_intra"
    key_type = KDAChunkIntraKey
    jit = _kda_chunk_intra_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = INTRA_TUNE_CONFIGS

    def dispatch(self, *, q: torch.Tensor) -> KDAChunkIntraKey:
        return KDAChunkIntraKey(
            dtype=warmreg.dtype_name(q.dtype), num_heads=q.shape[1], head_dim=q.shape[2], chunk_size=CHUNK_SIZE,
            sub_chunk=SUB_CHUNK,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"q": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in self.token_counts()]}

    def warmup_inputs(self, key: KDAChunkIntraKey) -> Mapping[str, Any]:
        dt, shape = getattr(torch, key.dtype), (1, key.num_heads, key.head_dim)
        return {
            "q": warmreg.meta(shape, dt), "k": warmreg.meta(shape, dt), "g": warmreg.meta(shape, torch.float32),
            "beta": warmreg.meta(shape[:2], torch.float32), **meta_chunks(1),
        }  # fmt: skip

    def tuning_inputs(self, key: KDAChunkIntraKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        shape, dt = (batch["tokens"], key.num_heads, key.head_dim), getattr(torch, key.dtype)
        unit = torch.nn.functional.normalize(torch.randn(2, *shape, device=device), dim=-1).to(dt)
        return {
            "q": unit[0], "k": unit[1], "g": -0.1 * torch.rand(shape, device=device).cumsum(0),  # decays, <= 0
            "beta": torch.rand(shape[:2], device=device), "cu_seqlens": batch["cu_seqlens"],
            "chunk_indices": batch["chunk_indices"],
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        *,
        scale: float | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        workspace: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkIntraKey]:
        """``(A_qk, A_kk)`` of every chunk (module docstring), each ``[T, H, 64]`` in q's dtype (``out``'s
        tensors, or fresh ones).

        :param q: ``[T, H, K]`` contiguous, L2-normalised.
        :param k: like ``q``.
        :param g: fp32 ``[T, H, K]`` contiguous (the gate stage's ``g``).
        :param beta: fp32 ``[T, H]`` contiguous.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]``.
        :param scale: of ``A_qk`` (default ``K ** -0.5``).
        :param out: preallocated ``(A_qk, A_kk)``, contiguous ``[T, H, 64]`` of q's dtype.
        :param workspace: a preallocated scratch for ``L``, contiguous fp32 ``[T, H, 64]`` (its contents are
            overwritten before they are read); with ``out``, the launch allocates nothing.
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` or ``workspace``
            that is not the buffers' shapes, dtypes and layouts.
        """
        if q.ndim != 3 or k.shape != q.shape or g.shape != q.shape or beta.shape != q.shape[:2]:
            self.fail(
                f"q, k, g, beta must be [T, H, K] x 3 and [T, H] (got {[tuple(x.shape) for x in (q, k, g, beta)]})"
            )
        if not all(x.is_contiguous() for x in (q, k, g, beta)) or k.dtype != q.dtype:
            self.fail("q, k, g and beta must be contiguous, q and k of one dtype")
        if g.dtype != torch.float32 or beta.dtype != torch.float32 or q.shape[2] < 16:
            self.fail(f"g and beta must be float32 and K >= 16 (tl.dot), got {g.dtype}, {beta.dtype}, K = {q.shape[2]}")
        key = self.dispatch(q=q)
        t, h, kd = q.shape
        bt = key.chunk_size
        aqk_out, akk_out = (None, None) if out is None else self.out_tuple(out, ("A_qk", "A_kk"))
        aqk = warmreg.output(self.name, "out[0]", aqk_out, (t, h, bt), q.dtype, q.device)
        akk = warmreg.output(self.name, "out[1]", akk_out, (t, h, bt), q.dtype, q.device)
        scratch = warmreg.output(self.name, "workspace", workspace, (t, h, bt), torch.float32, q.device)
        kwargs = dict(
            q_ptr=q, k_ptr=k, g_ptr=g, beta_ptr=beta, aqk_ptr=aqk, akk_ptr=akk, l_ptr=scratch,
            cu_seqlens_ptr=cu_seqlens, chunks_ptr=chunk_indices, scale=float(kd**-0.5 if scale is None else scale),
            H=h, K=kd, BT=bt, BC=key.sub_chunk,
        )  # fmt: skip
        num_chunks = chunk_indices.shape[0]
        return warmreg.LaunchSpec(key, (num_chunks, h) if num_chunks else None, kwargs, (aqk, akk))


def chunk_intra_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: per chunk and head, the matrices of the module docstring from pairwise decays in fp32
    (``exp2(g_i - g_j)`` directly) and ``torch.linalg.inv``.

    :returns: ``(A_qk, A_kk)``, fp32 ``[T, H, 64]``: A_qk zero above the diagonal, zeros outside the sequences.
    """
    t, h, kd = q.shape
    scale = kd**-0.5 if scale is None else scale
    aqk = torch.zeros((t, h, CHUNK_SIZE))
    akk = torch.zeros((t, h, CHUNK_SIZE))
    for rows in chunk_rows(cu_seqlens):
        n = rows.stop - rows.start
        qc, kc, gc = (x[rows].float().transpose(0, 1) for x in (q, k, g))  # [H, n, K]
        lower = torch.ones(n, n).tril()
        causal = lower.bool()[None, :, :, None]  # j <= i: the exponents above the diagonal would overflow
        decay = torch.exp2(torch.where(causal, gc[:, :, None, :] - gc[:, None, :, :], -torch.inf))  # [H, i, j, K]
        a = scale * torch.einsum("hik,hjk,hijk->hij", qc, kc, decay) * lower
        ell = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay) * (lower - torch.eye(n))
        ell = ell * beta[rows].float().transpose(0, 1)[:, :, None]
        inv = torch.linalg.inv(torch.eye(n) + ell)
        aqk[rows, :, :n] = a.transpose(0, 1)
        akk[rows, :, :n] = inv.transpose(0, 1)
    return aqk, akk
