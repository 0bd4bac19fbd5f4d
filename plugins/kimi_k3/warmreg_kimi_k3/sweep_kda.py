"""The KDA layers' steps of the Kimi-K3 sweep driver: the short convolutions, the plain-decode packed step, the
speculative recurrent step and the chunked prefill, launched as vLLM's ``kda.py: _forward`` launches them.

Part of the sweep driver (:mod:`warmreg_kimi_k3.sweep`, whose :class:`~warmreg_kimi_k3.sweep.KimiSweep` calls each
step with itself as ``sweep``), never imported by registration.
"""

from __future__ import annotations

from typing import Any

import torch

from warmreg.testing.sweep import Step

from .causal_conv1d import causal_conv1d_reference, conv1d_chunks
from .causal_conv1d_update import causal_conv1d_update_reference
from .gather_initial_states import gather_initial_states_reference
from .kda import kda_recurrent_reference
from .kda_chunk import STAGES as KDA_CHUNK_STAGES
from .kda_chunk_base import chunk_metadata
from .kda_chunk_intra import platform_solve_precision
from .kda_chunk_l2norm import l2norm_reference
from .kda_packed_decode import kda_packed_decode_reference

__all__ = ["CONV", "CONV_UPDATE", "KDA", "KDA_CHUNK", "KDA_PACKED", "chunk_step", "conv_step", "packed_decode_step", "recurrent_step"]

I32, F32 = torch.int32, torch.float32
KDA, KDA_PACKED = "kimi_k3.kda_recurrent", "kimi_k3.kda_packed_decode"
CONV, CONV_UPDATE = "kimi_k3.causal_conv1d", "kimi_k3.causal_conv1d_update"
#: The chunked KDA prefill's stages, in launch order (l2norm, gate, intra, wu, h, o).
KDA_CHUNK = tuple(stage.name for stage in KDA_CHUNK_STAGES)


def conv_step(sweep: Any, st: Step) -> None:
    """The KDA layer's short convolutions on the step's packed projection ``[T, row]`` (vLLM's ``_forward``):
    the speculative rows (the decode requests, first) through the varlen update, the prefills through three
    prefill conv1d launches (q, k, v); a decode step of one-token rows through the plain-decode update when
    the plan holds it (vLLM's builder then classifies them as decodes)."""
    b, lay = st.batch, sweep.conv_layout
    p, spec, t = lay.projection_size, lay.num_speculative_tokens, b.tokens
    proj = sweep.randn(t, sweep.conv_row)
    perm = torch.randperm(sweep.conv_state.shape[0] - 1, generator=sweep.gen, device=sweep.dev)
    lines = perm[: len(b.qlens)].add_(1).to(I32)
    one_token = b.num_prefills == 0 and all(q == 1 for q in b.qlens)
    upd = sweep.kernel(CONV_UPDATE) if CONV_UPDATE in sweep.names else None
    if upd is not None and upd.plain_decode and one_token and (not spec or sweep.rng.random() >= 0.5):
        width = sweep.rng.choice([sweep.conv_row, 4 * p] if upd.overlap_rows else [sweep.conv_row])
        x = sweep.randn(t, width)[:, : 3 * p]
        stride = sweep.rng.choice(sorted({1, 1 + spec}))
        indices = _conv_lines(sweep, lines, stride)
        conv_out = _conv_update(sweep, f"{t} plain decode rows", x, indices)
        if KDA_PACKED in sweep.names:
            packed_decode_step(sweep, proj, width, None if conv_out is None else conv_out[0], indices)
    elif upd is not None and spec and b.num_decodes:
        n, d = b.num_decodes, b.decode_tokens
        x = proj[:d, : 3 * p] if sweep.rng.random() < 0.5 else proj[:d, : 3 * p].contiguous()  # slice or gathered
        qsl = st.qsl[: n + 1].to(I32)
        accepted = torch.tensor([sweep.rng.randint(1, 1 + spec) for _ in range(n)], dtype=I32, device=sweep.dev)
        spec_args = {"num_accepted_tokens": accepted, "query_start_loc": qsl}
        _conv_update(sweep, f"{n} speculative rows", x, _conv_lines(sweep, lines[:n], 1 + spec), 1 + spec, spec_args)
    if b.num_prefills and CONV in sweep.names:
        start = b.decode_tokens if spec else 0  # without speculation the decodes are prefill rows of one token
        first = b.num_decodes if spec else 0
        rows = proj[start:]
        if spec and sweep.rng.random() < 0.5:
            rows = rows[:, : 3 * p].contiguous()  # a mixed batch's gathered non-speculative rows (index_select)
        qsl = (st.qsl[first:] - st.qsl[first]).to(I32)
        stride = 1 if spec and b.num_decodes else 1 + spec  # gathered rows, or block_table[:, 0]
        indices = _conv_lines(sweep, lines[first:], stride)
        init = torch.rand(len(b.qlens) - first, generator=sweep.gen, device=sweep.dev) < 0.7
        chunks = conv1d_chunks(qsl.cpu(), device=sweep.dev)
        for c, name in enumerate("qkv"):
            cols = slice(c * p, (c + 1) * p)
            args = (rows[:, cols], sweep.conv_weight[cols], None, sweep.conv_state[:, cols], qsl, indices, init)
            _conv_prefill(sweep, f"{b.num_prefills} prefills, {name}", args, chunks)


def _conv_prefill(sweep: Any, what: str, args: tuple[Any, ...], chunks: Any) -> None:
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return sweep.kernel(CONV)(*args, chunks=chunks), args[3]  # the output and the updated state slice

    # The plugin's tests: fp32 sums in one order, one bf16 step apart (the interpreter truncates).
    sweep.launch(CONV, what, run, ref=lambda: causal_conv1d_reference(*args), tol=(1e-6, 2**-7))


def _conv_lines(sweep: Any, lines: torch.Tensor, stride: int) -> torch.Tensor:
    """Cache lines as ``block_table[:, 0]`` of a table ``stride`` wide (a gathered copy when 1)."""
    table = torch.zeros((lines.shape[0], stride), dtype=I32, device=sweep.dev)
    table[:, 0] = lines
    return table[:, 0]


def _conv_update(
    sweep: Any, what: str, x: torch.Tensor, indices: torch.Tensor, max_len: int = -1, spec: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One conv update launch; returns ``(output, conv_state)``, or None on a miss or a failure."""
    kw = spec or {}
    args = (x, sweep.conv_state, sweep.conv_weight, None)
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = sweep.kernel(CONV_UPDATE)(*args, conv_state_indices=indices, max_query_len=max_len, **kw)
        return out, sweep.conv_state

    return sweep.launch(  # type: ignore[no-any-return]
        CONV_UPDATE,
        what,
        run,
        ref=lambda: causal_conv1d_update_reference(*args, indices, **kw),
        tol=(1e-6, 2**-7),
    )


def packed_decode_step(
    sweep: Any, proj: torch.Tensor, width: int, conv_out: torch.Tensor | None, indices: torch.Tensor
) -> None:
    """vLLM's plain-decode step after the conv update (``kda.py: _forward``, pure non-speculative decode): the
    packed decode on the conv's output (its ``empty_like``: ``[B, 3P]`` rows, or for a batch of one the
    projection's row stride, plain or the overlap path's ``4P``), the gate projection's rows, beta a column of
    the projection, the state indices of the conv update (now and then a padded slot 0: zeros out)."""
    lay, (h, dk, _) = sweep.conv_layout, sweep.hkv
    p, t = lay.projection_size, indices.shape[0]
    mixed = sweep.randn(t, 3 * p) if conv_out is None else conv_out
    if t == 1:
        row = sweep.randn(1, width)
        row[:, : 3 * p] = mixed
        mixed = row[:, : 3 * p]
    raw_g = sweep.randn(1, t, h, dk, dtype=sweep.raw_dtypes[0])
    raw_beta = proj[:t, 4 * p + dk : 4 * p + dk + h].unsqueeze(0)
    slots = indices.clone()
    if sweep.rng.random() < 0.1:
        slots[-1] = 0  # CUDA-graph padding: the null slot
    a_log, dt_bias, bound = sweep.gate
    bias = dt_bias if dt_bias is not None else torch.zeros(h * dk, dtype=F32, device=sweep.dev)
    args = (mixed, raw_g, raw_beta, a_log, bias, bound, sweep.pool, slots)
    sweep.launch(
        KDA_PACKED,
        f"{t} plain decode rows",
        lambda: sweep.kernel(KDA_PACKED)(*args),
        ref=lambda: kda_packed_decode_reference(*args)[0],
        tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
    )


def recurrent_step(sweep: Any, st: Step) -> None:
    """vLLM's speculative-decode step over the decode requests (``kda.py: _forward``; the kernel is planned only
    under speculation): q, k, v rearranged column slices of the conv update's ``[T, 3P]`` output (for one token
    the projection row it keeps), the gate projection's rows, beta a column of the packed projection, the
    ``[N, 1 + spec]`` state indices a view of a wider table (now and then a padded request on the null slot 0,
    or a column 0: no write), accepted counts ``1 .. 1 + spec``, ``out`` a view of core_attn_out or none."""
    b, kda = st.batch, sweep.kernel(KDA)
    if not b.num_decodes:
        return
    (h, dk, dv), t, n, cols = sweep.hkv, b.decode_tokens, b.num_decodes, 1 + sweep.lim.spec
    width = h * (2 * dk + dv)
    conv = sweep.randn(t, sweep.rng.choice(kda.projection_rows) if t == 1 and kda.projection_rows else width)
    q, k, v = (conv[:, c : c + h * w].view(1, t, h, w) for c, w in ((0, dk), (h * dk, dk), (2 * h * dk, dv)))
    raw_g = sweep.randn(1, t, h, dk, dtype=sweep.raw_dtypes[0])  # the raw projections: gate and beta in the kernel
    row = max(width + h, *kda.projection_rows)
    raw_beta = sweep.randn(t, row, dtype=sweep.raw_dtypes[1], scale=2.0)[:, row - h :].unsqueeze(0)
    table = torch.zeros(n, cols + 2, dtype=I32, device=sweep.dev)
    slots = torch.randperm(sweep.pool.shape[0] - 1, generator=sweep.gen, device=sweep.dev)[: n * cols].add(1)
    table[:, :cols] = slots.view(n, cols)  # distinct slots: no two tokens write one
    if sweep.rng.random() < 0.2:
        table[sweep.rng.randrange(n), sweep.rng.randrange(cols)] = 0  # the null slot in some column: no state there
    accepted = torch.randint(1, cols + 1, (n,), generator=sweep.gen, device=sweep.dev, dtype=I32)
    out = torch.empty(1, t + 1, h, dv, dtype=q.dtype, device=sweep.dev)[:, :t] if sweep.rng.random() < 0.5 else None
    args = (q, k, v, raw_g, raw_beta, *sweep.gate, sweep.pool, st.qsl[: n + 1], table[:, :cols], accepted)
    sweep.launch(
        KDA,
        f"{n} speculative sequences, {t} tokens",
        lambda: kda(*args, out=out),
        ref=lambda: kda_recurrent_reference(*args)[0],
        tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
    )


def chunk_step(sweep: Any, st: Step) -> None:
    """The chunked KDA prefill over the step's prefill requests, stage by stage as
    ``warmreg_kimi_k3.kda_chunk.chunk_kda_prefill`` chains them, between the layer's gather of the initial
    states from the pool (mixed: zeros without one) and its scatter of the final states back. On the CPU
    only the L2 norm is checked against its reference: Triton 3.8.0's interpreter multiplies bf16 ``tl.dot``
    operands as raw bits, so the bf16 chain is checked by the plugin's GPU test instead."""
    b = st.batch
    if not b.num_prefills:
        return
    (h, dk, dv), nd = sweep.chunk_hkv, b.num_decodes
    t = b.tokens - b.decode_tokens
    q, k, v = sweep.randn(t, h, dk), sweep.randn(t, h, dk), sweep.randn(t, h, dv)
    raw_g, raw_beta = sweep.randn(t, h, dk), sweep.randn(t, h, scale=2.0)
    cu = (st.qsl[nd:] - st.qsl[nd]).contiguous()
    n = b.num_prefills
    slots = torch.randperm(sweep.pool.shape[0] - 1, generator=sweep.gen, device=sweep.dev)[:n].add_(1).to(I32)
    has_state = torch.rand(n, generator=sweep.gen, device=sweep.dev) < 0.5  # continuing chunked prefills
    initial_state = gather_initial_states_reference(sweep.pool, slots, has_state)  # [N, H, V, K], as vLLM's
    l2, gate, intra, wu, hs, out = (sweep.kernel(name) for name in KDA_CHUNK)
    what = f"{n} prefill sequences, {t} tokens"
    chunks, offsets = chunk_metadata(cu)
    qn = sweep.launch(KDA_CHUNK[0], what, lambda: l2(q), ref=lambda: l2norm_reference(q), tol=(1e-2, 1.6e-2))
    kn = sweep.launch(KDA_CHUNK[0], what, lambda: l2(k))
    gb = sweep.launch(
        KDA_CHUNK[1], what, lambda: gate(raw_g, raw_beta, sweep.gate[0], sweep.gate[1], sweep.gate[2], cu, chunks)
    )
    if qn is None or kn is None or gb is None:
        return
    g, beta = gb
    solve = platform_solve_precision(sweep.plan.platform)  # the planned target's (vLLM: tf32 on sm >= 80)
    aa = sweep.launch(
        KDA_CHUNK[2],
        what,
        lambda: intra(qn, kn, g, beta, cu, chunks, safe_gate=sweep.gate[2] is not None, solve_precision=solve),
    )
    wuk = sweep.launch(KDA_CHUNK[3], what, lambda: wu(kn, v, beta, aa[1], g, cu, chunks)) if aa is not None else None
    if wuk is None:
        return
    hv = sweep.launch(
        KDA_CHUNK[4], what, lambda: hs(wuk[2], wuk[0], wuk[1], g, cu, offsets, initial_state, chunks.shape[0])
    )
    if hv is None:
        return
    sweep.pool[slots] = hv[2]  # the layer's scatter: recurrent_state[indices] = final_state
    sweep.launch(KDA_CHUNK[5], what, lambda: out(qn, hv[1], g, hv[0], aa[0], cu, chunks, out=v))
