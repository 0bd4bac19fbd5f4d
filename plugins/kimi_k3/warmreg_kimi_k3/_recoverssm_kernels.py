"""Triton code shared by the RecoverSSM ops: the KDA gate, and the two commit kernels of
``warmreg_kimi_k3.recoverssm_commit`` (whose docstring has their math and vLLM's call site).

Every size and stride is a runtime integer that is not specialized and no pointer is specialized on alignment: a
layer's tensors are addressed through its base address and page stride (``LayerTable``), loaded per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["commit_kda_state_kernel", "compact_conv_state_kernel", "kda_gate"]

_PLAN = ["idx_ptr", "lens_ptr", "final_ptr", "boundary_ptr", "recovery_ptr"]


@triton.jit
def kda_gate(raw_g, dt_bias, a, lower_bound, BOUNDED: tl.constexpr):
    """The KDA log decay of one token: ``lower_bound * sigmoid(a * x)`` (bounded) or ``-a * softplus(x)``
    (``x`` past 20 taken as is), ``x = raw_g + dt_bias``, fp32."""
    x = raw_g + dt_bias
    if BOUNDED:
        return lower_bound * tl.sigmoid(a * x)
    return -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit(
    do_not_specialize=["null_block_id", "dim", "history", "s_idx"],
    do_not_specialize_on_alignment=["ref_ptr", "base_ptr", "block_stride_ptr", "dim_stride_ptr", "token_stride_ptr",
                                    *_PLAN],
)  # fmt: skip
def compact_conv_state_kernel(
    ref_ptr,  # layer 0's conv state: types the per-layer pointers
    base_ptr, block_stride_ptr, dim_stride_ptr, token_stride_ptr,  # int64 [L] each
    idx_ptr, lens_ptr, final_ptr, boundary_ptr, recovery_ptr,  # state_indices [B] and the plan
    null_block_id, dim, history, s_idx,
    BLOCK_D: tl.constexpr,  # channels per program
    BLOCK_H: tl.constexpr,  # next_pow2(history)
    ALIGN: tl.constexpr,  # also write the boundary slot (prefix-caching align mode)
):  # fmt: skip
    i_d, b, layer = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(idx_ptr + b * s_idx).to(tl.int64)
    if src <= null_block_id:
        return
    c = tl.load(lens_ptr + b)
    if c == 0:
        return
    final = tl.load(final_ptr + b).to(tl.int64)
    boundary = tl.load(boundary_ptr + b).to(tl.int64)
    recovery = tl.load(recovery_ptr + b)
    if final <= null_block_id:
        return
    pages = tl.load(base_ptr + layer).to(tl.pointer_type(ref_ptr.dtype.element_ty))
    page = tl.load(block_stride_ptr + layer)
    s_dim = tl.load(dim_stride_ptr + layer)
    s_tok = tl.load(token_stride_ptr + layer)
    ds = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    hs = tl.arange(0, BLOCK_H)
    tile = (ds[:, None] < dim) & (hs[None, :] < history)
    source = pages + src * page + ds[:, None] * s_dim
    kept = tl.load(source + (c - 1 + hs[None, :]) * s_tok, mask=tile)
    if ALIGN:
        at_edge = tl.where(boundary > null_block_id, tile, False)
        edge = tl.load(source + (recovery - 1 + hs[None, :]) * s_tok, mask=at_edge)
        tl.store(pages + boundary * page + ds[:, None] * s_dim + hs[None, :] * s_tok, edge, mask=at_edge)
    tl.store(pages + final * page + ds[:, None] * s_dim + hs[None, :] * s_tok, kept, mask=tile)


@triton.jit(
    do_not_specialize=["lower_bound", "null_block_id", "s_state_h", "s_state_v", "s_state_k", "s_corr_h", "s_corr_t",
                       "s_corr_d", "s_kg_h", "s_kg_t", "s_kg_d", "s_a_l", "s_a_h", "s_dt_l", "s_dt_h", "s_dt_k",
                       "s_idx"],
    do_not_specialize_on_alignment=["state_ref_ptr", "state_base_ptr", "state_block_ptr", "corr_ref_ptr",
                                    "corr_base_ptr", "corr_block_ptr", "kg_ref_ptr", "kg_base_ptr", "kg_block_ptr",
                                    "a_log_ptr", "dt_bias_ptr", *_PLAN],
)  # fmt: skip
def commit_kda_state_kernel(
    state_ref_ptr, state_base_ptr, state_block_ptr,  # checkpoints [pages, H, V, K]: reference, int64 [L] tables
    corr_ref_ptr, corr_base_ptr, corr_block_ptr,  # correction records [rows, H, S, V]
    kg_ref_ptr, kg_base_ptr, kg_block_ptr,  # key/gate records [rows, H, S, 2K]
    a_log_ptr, dt_bias_ptr,  # [L, H], [L, H, K]
    idx_ptr, lens_ptr, final_ptr, boundary_ptr, recovery_ptr,  # state_indices [B] and the plan
    lower_bound, null_block_id,
    s_state_h, s_state_v, s_state_k, s_corr_h, s_corr_t, s_corr_d, s_kg_h, s_kg_t, s_kg_d,
    s_a_l, s_a_h, s_dt_l, s_dt_h, s_dt_k, s_idx,
    K: tl.constexpr,  # key head dim
    V: tl.constexpr,  # value head dim
    BK: tl.constexpr,  # next_pow2(K)
    BV: tl.constexpr,  # value rows per program
    H: tl.constexpr,  # heads per layer: the last grid axis is layer * H + head
    BOUNDED: tl.constexpr,  # the gate has a lower bound
    ALIGN: tl.constexpr,  # also fold the tokens before the block boundary into the boundary slot
):  # fmt: skip
    i_v, b, lh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    layer, h = lh // H, lh % H
    src = tl.load(idx_ptr + b * s_idx).to(tl.int64)
    if src <= null_block_id:
        return
    c = tl.load(lens_ptr + b)
    if c == 0:
        return
    final = tl.load(final_ptr + b).to(tl.int64)
    boundary = tl.load(boundary_ptr + b).to(tl.int64)
    recovery = tl.load(recovery_ptr + b)
    if final <= null_block_id:
        return
    pages = tl.load(state_base_ptr + layer).to(tl.pointer_type(state_ref_ptr.dtype.element_ty))
    page = tl.load(state_block_ptr + layer)
    corr = tl.load(corr_base_ptr + layer).to(tl.pointer_type(corr_ref_ptr.dtype.element_ty))
    corr += b * tl.load(corr_block_ptr + layer) + h * s_corr_h
    kg = tl.load(kg_base_ptr + layer).to(tl.pointer_type(kg_ref_ptr.dtype.element_ty))
    kg += b * tl.load(kg_block_ptr + layer) + h * s_kg_h
    ks = tl.arange(0, BK)
    vs = i_v * BV + tl.arange(0, BV)
    k_in, v_in = ks < K, vs < V
    tile = v_in[:, None] & k_in[None, :]
    cells = vs[:, None] * s_state_v + ks[None, :] * s_state_k
    s0 = tl.load(pages + src * page + h * s_state_h + cells, mask=tile, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + layer * s_a_l + h * s_a_h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + layer * s_dt_l + h * s_dt_h + ks * s_dt_k, mask=k_in, other=0.0).to(tl.float32)
    decay_all = tl.full([BK], 1.0, tl.float32)
    fold_all = tl.zeros([BV, BK], tl.float32)
    decay_edge = tl.full([BK], 1.0, tl.float32)
    fold_edge = tl.zeros([BV, BK], tl.float32)
    for i in range(c):
        t = c - 1 - i  # newest first: each older token's update is decayed by the tokens after it
        kt = tl.load(kg + t * s_kg_t + ks * s_kg_d, mask=k_in, other=0.0).to(tl.float32)
        ut = tl.load(corr + t * s_corr_t + vs * s_corr_d, mask=v_in, other=0.0).to(tl.float32)
        gt = tl.load(kg + t * s_kg_t + (K + ks) * s_kg_d, mask=k_in, other=0.0).to(tl.float32)
        kn = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        update = ut[:, None] * kn[None, :]
        dt = tl.exp(kda_gate(gt, bias, a, lower_bound, BOUNDED))
        fold_all += update * decay_all[None, :]
        decay_all *= dt
        if ALIGN:
            before = t < recovery
            fold_edge += tl.where(before, update * decay_edge[None, :], 0.0)
            decay_edge *= tl.where(before, dt, 1.0)
    if ALIGN:
        edge_ok = tl.where(boundary > null_block_id, tile, False)
        tl.store(pages + boundary * page + h * s_state_h + cells, s0 * decay_edge[None, :] + fold_edge, mask=edge_ok)
    tl.store(pages + final * page + h * s_state_h + cells, s0 * decay_all[None, :] + fold_all, mask=tile)
