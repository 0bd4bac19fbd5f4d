"""Chunked KDA prefill, stage 3: the intra-chunk matrices ``A_qk`` and ``(I + L)^-1``.

vLLM: ``chunk_kda_fwd_intra`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk_intra.py``), two launches:
the diagonal 16-token sub-chunk blocks (with a gate lower bound, ``safe_gate``:
``chunk_kda_fwd_kernel_intra_sub_chunk``, which also inverts them; else ``chunk_intra_token_parallel.py:
chunk_kda_fwd_kernel_intra_token_parallel``, token by token), then ``chunk_kda_fwd_kernel_inter_solve_fused``
(autotuned on ``H, HV, K, BC`` over ``BK`` and ``num_warps``): the blocks between sub-chunks and the inverse.
Here one program per (chunk, head) runs both phases in turn, with vLLM's arithmetic in vLLM's order (the same
operands, tile shapes, masks and dot precisions), the diagonal blocks passing through the fp32 scratch
``workspace`` as vLLM's ``Akkd``.

Math, for one chunk of ``n <= 64`` tokens (rows ``i, j`` of the chunk, ``g`` the chunk-local cumulative gate in
log2 units from the gate stage, so ``exp2(g_i - g_j)`` is the decay from token ``j`` to token ``i``)::

    A_qk[i, j] = scale * sum_c q_i[c] k_j[c] exp2(g_i[c] - g_j[c])          for j <= i
    L[i, j]    = beta_i * sum_c k_i[c] k_j[c] exp2(g_i[c] - g_j[c])         for j <  i, else 0
    A_kk       = (I + L)^-1

The decay products as vLLM takes them (every exponent ``<= 0`` where it matters, ``g`` never increasing along a
chunk): between sub-chunks through the later sub-chunk's first row ``r``,
``(q_i exp2(g_i - g_r)) . (k_j exp2(g_r - g_j))`` in ``tl.dot``; inside a sub-chunk pair by pair (token-parallel)
for the softplus gate, through the sub-chunk's middle row in ``tl.dot`` with a lower bound. The inverse: each
diagonal block by forward substitution in fp32, then the blocks below with vLLM's products
(``X10 = -(D1 L10) D0``, ``X20 = -D2 (L20 D0 + L21 X10)``, ...) at ``solve_precision`` (vLLM's
``SOLVE_TRIL_DOT_PRECISION``: ``"tf32"`` on CUDA sm >= 80, else ``"ieee"``: a key field).

Outputs in q's dtype (as vLLM's ``Aqk`` and ``Akk``), ``[T, H, 64]``, row ``t`` holding the row of ``t``'s chunk:
``A_kk`` rows in full (zeros above the diagonal blocks, which vLLM gets from ``torch.zeros``), ``A_qk`` on and
below the diagonal only (vLLM leaves the rest uninitialised; the output stage never reads it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda_chunk_base import CHUNK_SIZE, SUB_CHUNK, ChunkStage, chunk_rows, meta_chunks, tuning_tensor

__all__ = [
    "INTRA_TUNE_CONFIGS",
    "KDAChunkIntra",
    "KDAChunkIntraKey",
    "chunk_intra_reference",
    "platform_solve_precision",
]

#: vLLM's inter/solve kernel tunes BK in {32, 64} x {1, 2, 4} warps; one warp is left out (the diagonal blocks
#: run in the same program here).
INTRA_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BK": 32}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BK": 32}, num_warps=4),
    warmreg.TuneConfig(constexprs={"BK": 64}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BK": 64}, num_warps=4),
)


def platform_solve_precision(platform: warmreg.Platform | None) -> str:
    """vLLM's ``SOLVE_TRIL_DOT_PRECISION`` on ``platform``: ``"tf32"`` on CUDA with compute capability 8.0 or
    more, else ``"ieee"`` (ROCm, XPU, no GPU)."""
    return "tf32" if platform is not None and platform.is_cuda and platform.sm >= 80 else "ieee"


@triton.jit
def _tile(ptr, rows, m_rows, offs_k, m_k, STRIDE: tl.constexpr):  # STRIDE: elements between rows (H * K)
    """``[len(rows), len(offs_k)]`` fp32 of a ``[T, H, K]`` tensor already offset to its head."""
    p = ptr + rows[:, None] * STRIDE + offs_k[None, :]
    return tl.load(p, mask=m_rows[:, None] & m_k[None, :], other=0.0).to(tl.float32)


@triton.jit
def _substitute(akkd_ptr, b_ai, first, start, stop, offs, H: tl.constexpr, BC: tl.constexpr):  # H, BC: layout
    """Forward substitution of one diagonal block (vLLM's loop): rows ``start .. stop - 1`` of the chunk from
    the scratch rows of ``L`` (``first``: the block's first chunk row, at ``akkd_ptr``'s chunk origin)."""
    for i in range(start, stop):
        b_a = -tl.load(akkd_ptr + i * H * BC + offs)
        b_a = tl.where(offs < i - first, b_a, 0.0)
        b_a += tl.sum(b_a[:, None] * b_ai, 0)
        b_ai = tl.where((offs == i - first)[:, None], b_a, b_ai)
    return b_ai


@triton.jit
def _diag_token_parallel(
    q_ptr, k_ptr, g_ptr, beta_ptr, aqk_ptr, akkd_ptr, i_ts, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
):  # fmt: skip  # H, K, BT, BC: the layout; BKD: next_pow2(K), one tile over K
    """vLLM's ``chunk_kda_fwd_kernel_intra_token_parallel`` for the rows of one sub-chunk: per row ``i``, the
    pairs ``j <= i`` of its sub-chunk, each a sum over K of fp32 products (beta folded into ``k_i`` first)."""
    offs_j = i_ts + tl.arange(0, BC)
    m_j = offs_j < T
    offs_k = tl.arange(0, BKD)
    m_k = offs_k < K
    b_kj = _tile(k_ptr, offs_j, m_j, offs_k, m_k, H * K)
    b_gj = _tile(g_ptr, offs_j, m_j, offs_k, m_k, H * K)
    for r in range(BC):
        i = i_ts + r
        if i < T:
            b_q = tl.load(q_ptr + i * H * K + offs_k, mask=m_k, other=0).to(tl.float32)
            b_k = tl.load(k_ptr + i * H * K + offs_k, mask=m_k, other=0).to(tl.float32)
            b_g = tl.load(g_ptr + i * H * K + offs_k, mask=m_k, other=0.0).to(tl.float32)
            b_k *= tl.load(beta_ptr + i * H).to(tl.float32)
            b_kgj = tl.where(m_k[None, :], b_kj * tl.exp2(b_g[None, :] - b_gj), 0.0)
            b_aqk = tl.sum(b_q[None, :] * b_kgj, axis=1) * scale
            b_akk = tl.sum(b_k[None, :] * b_kgj, axis=1) * tl.where(offs_j < i, 1.0, 0.0)
            m_st = m_j & (offs_j <= i)
            tl.store(aqk_ptr + i * H * BT + offs_j % BT, b_aqk.to(aqk_ptr.dtype.element_ty), mask=m_st)
            tl.store(akkd_ptr + i * H * BC + offs_j - i_ts, b_akk, mask=m_st)


@triton.jit
def _diag_safe(
    q_ptr, k_ptr, g_ptr, beta_ptr, aqk_ptr, akkd_ptr, i_ts, T, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
):  # fmt: skip  # H, K, BT, BC: the layout; BKD: next_pow2(K), one tile over K
    """vLLM's ``chunk_kda_fwd_kernel_intra_sub_chunk`` for one sub-chunk (a gate lower bound): the block's
    decays through its middle row in ``tl.dot``, then its inverse by forward substitution, into the scratch."""
    offs_c = i_ts + tl.arange(0, BC)
    m_c = offs_c < T
    offs_k = tl.arange(0, BKD)
    m_k = offs_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    p_ck = offs_c[:, None] * (H * K) + offs_k[None, :]
    b_q = tl.load(q_ptr + p_ck, mask=m_ck, other=0.0)
    b_k = tl.load(k_ptr + p_ck, mask=m_ck, other=0.0)
    b_g = tl.load(g_ptr + p_ck, mask=m_ck, other=0.0)
    b_beta = tl.load(beta_ptr + offs_c * H, mask=m_c, other=0.0).to(tl.float32)
    b_gn = tl.load(g_ptr + (i_ts + tl.minimum(BC // 2, T - i_ts - 1)) * H * K + offs_k, mask=m_k, other=0.0)
    b_gm = (b_g - b_gn[None, :]).to(tl.float32)
    b_gq = tl.where(m_c[:, None], tl.exp2(b_gm), 0.0)
    b_gk = tl.where(m_c[:, None], tl.exp2(-b_gm), 0.0)
    b_kgt = tl.trans(b_k * b_gk)
    b_aqk = tl.dot(b_q * b_gq, b_kgt) * scale
    b_akk = tl.dot(b_k * b_gq, b_kgt) * b_beta[:, None]
    offs = tl.arange(0, BC)
    b_aqk = tl.where(offs[:, None] >= offs[None, :], b_aqk, 0.0)
    b_akk = tl.where(offs[:, None] > offs[None, :], b_akk, 0.0)
    p_akkd = akkd_ptr + offs_c[:, None] * (H * BC) + offs[None, :]
    m_st = m_c[:, None] & (offs[None, :] < BC)
    p_aqk = aqk_ptr + offs_c[:, None] * (H * BT) + (i_ts % BT + offs)[None, :]
    tl.store(p_aqk, b_aqk.to(aqk_ptr.dtype.element_ty), mask=m_st)
    tl.store(p_akkd, b_akk, mask=m_st)
    tl.debug_barrier()
    b_ai = _substitute(akkd_ptr, -b_akk, i_ts, i_ts + 2, i_ts + tl.minimum(BC, T - i_ts), offs, H, BC)
    b_ai += tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    tl.store(p_akkd, b_ai, mask=m_st)


@triton.jit
def _sub(a, b, PRECISION: tl.constexpr):  # PRECISION: the solve's input_precision
    return tl.dot(a, b, input_precision=PRECISION)


# The metadata and beta are read a scalar (or a row) at a time: their alignment must not specialize.
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_ptr", "chunks_ptr", "beta_ptr"])
def _kda_chunk_intra_kernel(
    q_ptr,  # L2-normalised q [T, H, K]
    k_ptr,  # L2-normalised k [T, H, K]
    g_ptr,  # fp32 [T, H, K], the chunk-local cumulative gate in log2 units
    beta_ptr,  # fp32 [T, H]
    aqk_ptr,  # out [T, H, BT]: row t holds A_qk[t, :] of t's chunk (lower triangle, diagonal included)
    akk_ptr,  # out [T, H, BT]: (I + L)^-1, rows likewise
    akkd_ptr,  # fp32 scratch [T, H, BC]: the diagonal blocks of L, then their inverses (vLLM's Akkd)
    cu_seqlens_ptr,
    chunks_ptr,  # [NT, 2] (sequence, chunk within it)
    scale,
    H: tl.constexpr,  # heads on this rank: a model constant
    K: tl.constexpr,  # head dim
    BT: tl.constexpr,  # chunk size (64)
    BC: tl.constexpr,  # sub-chunk size (16): BT == 4 * BC
    BKD: tl.constexpr,  # next_pow2(K): the diagonal blocks' one K tile (vLLM's)
    BK: tl.constexpr,  # K per step between sub-chunks (tuned)
    SAFE_GATE: tl.constexpr,  # a gate lower bound: vLLM's sub-chunk kernel for the diagonal blocks
    PRECISION: tl.constexpr,  # input_precision of the inverse's block products ("tf32" or "ieee")
):
    tl.static_assert(BT == 4 * BC)
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunks_ptr + 2 * i_c)
    i_t = tl.load(chunks_ptr + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
    T = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64) - bos
    # everything below is relative to the sequence's first token and this head, as in vLLM's kernels
    q = q_ptr + (bos * H + i_h) * K
    k = k_ptr + (bos * H + i_h) * K
    g = g_ptr + (bos * H + i_h) * K
    beta = beta_ptr + bos * H + i_h
    aqk = aqk_ptr + (bos * H + i_h) * BT
    akk = akk_ptr + (bos * H + i_h) * BT
    akkd = akkd_ptr + (bos * H + i_h) * BC
    i_tc0 = i_t * BT
    i_tc1 = i_tc0 + BC
    i_tc2 = i_tc0 + 2 * BC
    i_tc3 = i_tc0 + 3 * BC

    # Phase 1: the diagonal blocks (vLLM's first launch).
    for ci in tl.static_range(BT // BC):
        if i_tc0 + ci * BC < T:
            if SAFE_GATE:
                _diag_safe(q, k, g, beta, aqk, akkd, i_tc0 + ci * BC, T, scale, H, K, BT, BC, BKD)
            else:
                _diag_token_parallel(q, k, g, beta, aqk, akkd, i_tc0 + ci * BC, T, scale, H, K, BT, BC, BKD)
    tl.debug_barrier()

    # Phase 2: vLLM's chunk_kda_fwd_kernel_inter_solve_fused for this chunk.
    o_i = tl.arange(0, BC)
    o_c0, o_c1, o_c2, o_c3 = i_tc0 + o_i, i_tc1 + o_i, i_tc2 + o_i, i_tc3 + o_i
    m_tc0, m_tc1, m_tc2, m_tc3 = o_c0 < T, o_c1 < T, o_c2 < T, o_c3 < T
    b_aqk10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_aqk20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_aqk21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_aqk30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_aqk31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_aqk32 = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk32 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k0 = _tile(k, o_c0, m_tc0, o_k, m_k, H * K)
        b_g0 = _tile(g, o_c0, m_tc0, o_k, m_k, H * K)
        if i_tc1 < T:
            b_q1 = _tile(q, o_c1, m_tc1, o_k, m_k, H * K)
            b_k1 = _tile(k, o_c1, m_tc1, o_k, m_k, H * K)
            b_g1 = _tile(g, o_c1, m_tc1, o_k, m_k, H * K)
            b_gn1 = tl.load(g + i_tc1 * H * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_gqn = tl.where(m_tc1[:, None], tl.exp2(b_g1 - b_gn1[None, :]), 0)
            b_kgt = tl.trans(b_k0 * tl.exp2(b_gn1[None, :] - b_g0))
            b_aqk10 += tl.dot(b_q1 * b_gqn, b_kgt)
            b_akk10 += tl.dot(b_k1 * b_gqn, b_kgt)
            if i_tc2 < T:
                b_q2 = _tile(q, o_c2, m_tc2, o_k, m_k, H * K)
                b_k2 = _tile(k, o_c2, m_tc2, o_k, m_k, H * K)
                b_g2 = _tile(g, o_c2, m_tc2, o_k, m_k, H * K)
                b_gn2 = tl.load(g + i_tc2 * H * K + o_k, mask=m_k, other=0).to(tl.float32)
                b_gqn2 = tl.where(m_tc2[:, None], tl.exp2(b_g2 - b_gn2[None, :]), 0)
                b_qg2 = b_q2 * b_gqn2
                b_kg2 = b_k2 * b_gqn2
                b_kgt = tl.trans(b_k0 * tl.exp2(b_gn2[None, :] - b_g0))
                b_aqk20 += tl.dot(b_qg2, b_kgt)
                b_akk20 += tl.dot(b_kg2, b_kgt)
                b_kgt = tl.trans(b_k1 * tl.exp2(b_gn2[None, :] - b_g1))
                b_aqk21 += tl.dot(b_qg2, b_kgt)
                b_akk21 += tl.dot(b_kg2, b_kgt)
                if i_tc3 < T:
                    b_q3 = _tile(q, o_c3, m_tc3, o_k, m_k, H * K)
                    b_k3 = _tile(k, o_c3, m_tc3, o_k, m_k, H * K)
                    b_g3 = _tile(g, o_c3, m_tc3, o_k, m_k, H * K)
                    b_gn3 = tl.load(g + i_tc3 * H * K + o_k, mask=m_k, other=0).to(tl.float32)
                    b_gqn3 = tl.where(m_tc3[:, None], tl.exp2(b_g3 - b_gn3[None, :]), 0)
                    b_qg3 = b_q3 * b_gqn3
                    b_kg3 = b_k3 * b_gqn3
                    b_kgt = tl.trans(b_k0 * tl.exp2(b_gn3[None, :] - b_g0))
                    b_aqk30 += tl.dot(b_qg3, b_kgt)
                    b_akk30 += tl.dot(b_kg3, b_kgt)
                    b_kgt = tl.trans(b_k1 * tl.exp2(b_gn3[None, :] - b_g1))
                    b_aqk31 += tl.dot(b_qg3, b_kgt)
                    b_akk31 += tl.dot(b_kg3, b_kgt)
                    b_kgt = tl.trans(b_k2 * tl.exp2(b_gn3[None, :] - b_g2))
                    b_aqk32 += tl.dot(b_qg3, b_kgt)
                    b_akk32 += tl.dot(b_kg3, b_kgt)

    # the off-diagonal blocks of A_qk; those of L stay in registers, scaled by beta
    m_row1 = m_tc1[:, None] & (o_i[None, :] < BT)
    m_row2 = m_tc2[:, None] & (o_i[None, :] < BT)
    m_row3 = m_tc3[:, None] & (o_i[None, :] < BT)
    dt = aqk_ptr.dtype.element_ty
    if i_tc1 < T:
        tl.store(aqk + o_c1[:, None] * (H * BT) + o_i[None, :], (b_aqk10 * scale).to(dt), mask=m_row1)
        b_akk10 = b_akk10 * tl.load(beta + o_c1 * H, mask=m_tc1, other=0.0).to(tl.float32)[:, None]
    if i_tc2 < T:
        p2 = aqk + o_c2[:, None] * (H * BT) + o_i[None, :]
        tl.store(p2, (b_aqk20 * scale).to(dt), mask=m_row2)
        tl.store(p2 + BC, (b_aqk21 * scale).to(dt), mask=m_row2)
        b_b2 = tl.load(beta + o_c2 * H, mask=m_tc2, other=0.0).to(tl.float32)
        b_akk20 = b_akk20 * b_b2[:, None]
        b_akk21 = b_akk21 * b_b2[:, None]
    if i_tc3 < T:
        p3 = aqk + o_c3[:, None] * (H * BT) + o_i[None, :]
        tl.store(p3, (b_aqk30 * scale).to(dt), mask=m_row3)
        tl.store(p3 + BC, (b_aqk31 * scale).to(dt), mask=m_row3)
        tl.store(p3 + 2 * BC, (b_aqk32 * scale).to(dt), mask=m_row3)
        b_b3 = tl.load(beta + o_c3 * H, mask=m_tc3, other=0.0).to(tl.float32)
        b_akk30 = b_akk30 * b_b3[:, None]
        b_akk31 = b_akk31 * b_b3[:, None]
        b_akk32 = b_akk32 * b_b3[:, None]

    # the diagonal blocks: L's (token-parallel), to invert here; or already inverted (sub-chunk kernel)
    m_row0 = m_tc0[:, None] & (o_i[None, :] < BT)
    b_ai00 = tl.load(akkd + o_c0[:, None] * (H * BC) + o_i[None, :], mask=m_row0, other=0.0).to(tl.float32)
    b_ai11 = tl.load(akkd + o_c1[:, None] * (H * BC) + o_i[None, :], mask=m_row1, other=0.0).to(tl.float32)
    b_ai22 = tl.load(akkd + o_c2[:, None] * (H * BC) + o_i[None, :], mask=m_row2, other=0.0).to(tl.float32)
    b_ai33 = tl.load(akkd + o_c3[:, None] * (H * BC) + o_i[None, :], mask=m_row3, other=0.0).to(tl.float32)
    if not SAFE_GATE:
        m_lower = o_i[:, None] > o_i[None, :]
        m_eye = o_i[:, None] == o_i[None, :]
        b_ai00 = -tl.where(m_lower, b_ai00, 0)
        b_ai11 = -tl.where(m_lower, b_ai11, 0)
        b_ai22 = -tl.where(m_lower, b_ai22, 0)
        b_ai33 = -tl.where(m_lower, b_ai33, 0)
        left = T - i_tc0  # rows of this chunk
        b_ai00 = _substitute(akkd + i_tc0 * H * BC, b_ai00, 0, 2, tl.minimum(BC, left), o_i, H, BC)
        b_ai11 = _substitute(akkd + i_tc0 * H * BC, b_ai11, BC, BC + 2, tl.minimum(2 * BC, left), o_i, H, BC)
        b_ai22 = _substitute(akkd + i_tc0 * H * BC, b_ai22, 2 * BC, 2 * BC + 2, tl.minimum(3 * BC, left), o_i, H, BC)
        b_ai33 = _substitute(akkd + i_tc0 * H * BC, b_ai33, 3 * BC, 3 * BC + 2, tl.minimum(4 * BC, left), o_i, H, BC)
        b_ai00 += m_eye
        b_ai11 += m_eye
        b_ai22 += m_eye
        b_ai33 += m_eye

    # the blocks below the diagonal, with vLLM's association of the products
    b_ai10 = -_sub(_sub(b_ai11, b_akk10, PRECISION), b_ai00, PRECISION)
    b_ai21 = -_sub(_sub(b_ai22, b_akk21, PRECISION), b_ai11, PRECISION)
    b_ai32 = -_sub(_sub(b_ai33, b_akk32, PRECISION), b_ai22, PRECISION)
    b_ai20 = -_sub(b_ai22, _sub(b_akk20, b_ai00, PRECISION) + _sub(b_akk21, b_ai10, PRECISION), PRECISION)
    b_ai31 = -_sub(b_ai33, _sub(b_akk31, b_ai11, PRECISION) + _sub(b_akk32, b_ai21, PRECISION), PRECISION)
    b_ai30 = -_sub(
        b_ai33,
        _sub(b_akk30, b_ai00, PRECISION) + _sub(b_akk31, b_ai10, PRECISION) + _sub(b_akk32, b_ai20, PRECISION),
        PRECISION,
    )

    # every block of every valid row: zeros above the diagonal blocks (vLLM: its torch.zeros buffer)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    dk = akk_ptr.dtype.element_ty
    p0 = akk + o_c0[:, None] * (H * BT) + o_i[None, :]
    p1 = akk + o_c1[:, None] * (H * BT) + o_i[None, :]
    p2 = akk + o_c2[:, None] * (H * BT) + o_i[None, :]
    p3 = akk + o_c3[:, None] * (H * BT) + o_i[None, :]
    tl.store(p0, b_ai00.to(dk), mask=m_row0)
    tl.store(p0 + BC, zero.to(dk), mask=m_row0)
    tl.store(p0 + 2 * BC, zero.to(dk), mask=m_row0)
    tl.store(p0 + 3 * BC, zero.to(dk), mask=m_row0)
    tl.store(p1, b_ai10.to(dk), mask=m_row1)
    tl.store(p1 + BC, b_ai11.to(dk), mask=m_row1)
    tl.store(p1 + 2 * BC, zero.to(dk), mask=m_row1)
    tl.store(p1 + 3 * BC, zero.to(dk), mask=m_row1)
    tl.store(p2, b_ai20.to(dk), mask=m_row2)
    tl.store(p2 + BC, b_ai21.to(dk), mask=m_row2)
    tl.store(p2 + 2 * BC, b_ai22.to(dk), mask=m_row2)
    tl.store(p2 + 3 * BC, zero.to(dk), mask=m_row2)
    tl.store(p3, b_ai30.to(dk), mask=m_row3)
    tl.store(p3 + BC, b_ai31.to(dk), mask=m_row3)
    tl.store(p3 + 2 * BC, b_ai32.to(dk), mask=m_row3)
    tl.store(p3 + 3 * BC, b_ai33.to(dk), mask=m_row3)


@attrs.frozen(kw_only=True)
class KDAChunkIntraKey(warmreg.CompileKey):
    """What changes the binary of the intra-chunk stage."""

    dtype: str  # q, k, A_qk, A_kk
    num_heads: int  # H
    head_dim: int  # K
    chunk_size: int  # BT
    sub_chunk: int  # BC
    block_k_diag: int  # BKD
    safe_gate: bool  # SAFE_GATE: a gate lower bound
    solve_precision: str  # PRECISION
    config: int | None = None


class KDAChunkIntra(ChunkStage[KDAChunkIntraKey]):
    """The intra-chunk stage of the chunked KDA prefill: replaces ``chunk_kda_fwd_intra(q, k, gk=g, beta,
    scale, cu_seqlens, chunk_size=64, chunk_indices, safe_gate=lower_bound is not None)`` inside vLLM's
    ``chunk_kda_with_fused_gate`` (module docstring); tensors without vLLM's leading batch dim of 1."""

    name = "kimi_k3.kda_chunk_intra"
    key_type = KDAChunkIntraKey
    jit = _kda_chunk_intra_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = INTRA_TUNE_CONFIGS

    def dispatch(self, *, q: torch.Tensor, safe_gate: bool, solve_precision: str) -> KDAChunkIntraKey:
        return KDAChunkIntraKey(
            dtype=warmreg.dtype_name(q.dtype), num_heads=q.shape[1], head_dim=q.shape[2], chunk_size=CHUNK_SIZE,
            sub_chunk=SUB_CHUNK, block_k_diag=warmreg.next_pow2(q.shape[2]), safe_gate=bool(safe_gate),
            solve_precision=solve_precision,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "q": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in self.token_counts()],
            "safe_gate": [self.lower_bound is not None],
            "solve_precision": [platform_solve_precision(platform)],
        }

    def warmup_inputs(self, key: KDAChunkIntraKey) -> Mapping[str, Any]:
        dt, shape = getattr(torch, key.dtype), (1, key.num_heads, key.head_dim)
        return {
            "q": warmreg.meta(shape, dt), "k": warmreg.meta(shape, dt), "g": warmreg.meta(shape, torch.float32),
            "beta": warmreg.meta(shape[:2], torch.float32), **meta_chunks(1), "safe_gate": key.safe_gate,
            "solve_precision": key.solve_precision,
        }  # fmt: skip

    def tuning_inputs(self, key: KDAChunkIntraKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        shape, dt = (batch["tokens"], key.num_heads, key.head_dim), getattr(torch, key.dtype)
        return {
            "q": tuning_tensor(device, shape, dt), "k": tuning_tensor(device, shape, dt),
            "g": tuning_tensor(device, shape, torch.float32), "beta": tuning_tensor(device, shape[:2], torch.float32),
            "cu_seqlens": batch["cu_seqlens"],
            "chunk_indices": batch["chunk_indices"], "safe_gate": key.safe_gate, "solve_precision": key.solve_precision,
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
        safe_gate: bool = False,
        solve_precision: str | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        workspace: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkIntraKey]:
        """``(A_qk, A_kk)`` of every chunk (module docstring), each ``[T, H, 64]`` in q's dtype (``out``'s
        tensors, or fresh ones), as vLLM's ``chunk_kda_fwd_intra`` returns ``(Aqk, Akk)``.

        :param q: ``[T, H, K]`` contiguous, L2-normalised.
        :param k: like ``q``.
        :param g: fp32 ``[T, H, K]`` contiguous (the gate stage's ``g``).
        :param beta: fp32 ``[T, H]`` contiguous.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]``.
        :param scale: of ``A_qk`` (default ``K ** -0.5``).
        :param safe_gate: vLLM's ``safe_gate`` (``lower_bound is not None``): how the diagonal blocks are taken.
        :param solve_precision: ``"tf32"`` or ``"ieee"`` (default: :func:`platform_solve_precision` of the local GPU).
        :param out: preallocated ``(A_qk, A_kk)``, contiguous ``[T, H, 64]`` of q's dtype.
        :param workspace: a preallocated scratch for the diagonal blocks, contiguous fp32 ``[T, H, 16]`` (its
            contents are overwritten before they are read); with ``out``, the launch allocates nothing.
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
        precision = solve_precision or platform_solve_precision(warmreg.runtime_platform())
        if precision not in ("tf32", "ieee"):
            self.fail(f"solve_precision must be 'tf32' or 'ieee' (got {precision!r})")
        key = self.dispatch(q=q, safe_gate=safe_gate, solve_precision=precision)
        t, h, kd = q.shape
        bt = key.chunk_size
        aqk_out, akk_out = (None, None) if out is None else self.out_tuple(out, ("A_qk", "A_kk"))
        aqk = warmreg.output(self.name, "out[0]", aqk_out, (t, h, bt), q.dtype, q.device)
        akk = warmreg.output(self.name, "out[1]", akk_out, (t, h, bt), q.dtype, q.device)
        scratch = warmreg.output(self.name, "workspace", workspace, (t, h, key.sub_chunk), torch.float32, q.device)
        kwargs = dict(
            q_ptr=q, k_ptr=k, g_ptr=g, beta_ptr=beta, aqk_ptr=aqk, akk_ptr=akk, akkd_ptr=scratch,
            cu_seqlens_ptr=cu_seqlens, chunks_ptr=chunk_indices, scale=float(kd**-0.5 if scale is None else scale),
            H=h, K=kd, BT=bt, BC=key.sub_chunk, BKD=key.block_k_diag, SAFE_GATE=key.safe_gate, PRECISION=key.solve_precision,
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
