"""The DeepSeek-V4 sweep's DSpark draft step (``speculative_method`` ``dspark``), which
:class:`~warmreg_deepseek_v4.sweep.DSV4Sweep` runs after each target step: the draft inputs (vLLM 0.33
``prepare_dflash_inputs``; decode requests rejected some drafts, prefill chunks sampled a token or none), the
non-causal SWA indices over ``Nq`` query tokens a request, and the SWA-only draft layers on those tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from warmreg.testing.sweep import Batch

from .dspark import DSparkDraft
from .dspark_inputs_reference import prepare_dspark_inputs_reference
from .dspark_swa_indices import dspark_swa_indices_reference
from .sweep_inputs import DSV4_PREFIX, I32, I64, SWA, DSV4Step

if TYPE_CHECKING:
    from .sweep import DSV4Sweep

__all__ = ["draft_metadata", "draft_step"]


def draft_step(sweep: DSV4Sweep, st: DSV4Step, d: DSparkDraft) -> None:
    """The DSpark draft step after the target step: its inputs and non-causal SWA metadata
    (:func:`draft_metadata`), then the draft layers on ``Nq`` query tokens a request."""
    reqs, seq_host = sweep.dspark_metadata(st, d, SWA)
    nq = d.num_query_per_req
    draft = Batch("draft", tuple(seq_host), (nq,) * reqs, (0,) * reqs, reqs)
    dst = sweep.step_tensors(draft)
    m = sweep.m
    for ratio in sorted(set(d.ratios)):  # the SWA-only draft layers run as an SWA-only layer on the draft tokens
        if ratio == 1:
            sweep.layer(dst, "dspark draft", 1)
        else:
            sweep.qkv_norm(dst, "dspark draft", m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps)


def draft_metadata(sweep: DSV4Sweep, st: DSV4Step, d: DSparkDraft, swa: int) -> tuple[int, list[int]]:
    """A DSpark draft step's inputs (one launch for the SWA group of ``swa``-token pages: 64 for V4, 32 for V4.1)
    and its non-causal SWA rows; returns the request count and the draft batch's sequence lengths. Decode
    requests rejected some of their drafts; a prefill chunk sampled a token (its last chunk) or none (chunked
    prefill)."""
    b, rng = st.batch, sweep.rng
    reqs = len(b.qlens)
    nrej = [rng.randint(0, q - 1) if i < b.num_decodes else 0 for i, q in enumerate(b.qlens)]
    sampled = [q - r if i < b.num_decodes else rng.randint(0, 1) for i, (q, r) in enumerate(zip(b.qlens, nrej))]
    states = torch.randperm(sweep.draft_reqs, generator=sweep.gen, device=sweep.dev)[:reqs].to(I64)
    args = (
        st.positions, st.qsl, states, sweep.req_states[0], sweep.req_states[1],
        torch.tensor(sampled, dtype=I32, device=sweep.dev), torch.tensor(nrej, dtype=I32, device=sweep.dev),
        sweep.req_states[2], sweep.req_states[3], sweep.tables[swa],
    )  # fmt: skip
    kw: dict[str, Any] = dict(
        num_reqs=reqs, block_size=swa, parallel_drafting_token_id=d.noise_token_id,
        num_query_per_req=d.num_query_per_req, num_speculative_steps=d.num_tokens, max_num_reqs=sweep.draft_reqs,
        max_num_tokens=sweep.draft_tokens, max_model_len=sweep.lim.max_model_len,
        sample_from_anchor=d.sample_from_anchor,
    )  # fmt: skip
    out = sweep.launch(
        DSV4_PREFIX + "prepare_dspark_inputs",
        f"{reqs} requests, max_q {max(b.qlens)}",
        lambda: sweep.k("prepare_dspark_inputs")(*args, **kw, max_query_len=max(b.qlens), out=sweep.draft_buf),
        fallback=lambda: prepare_dspark_inputs_reference(sweep.draft_buf, *args, **kw),
        ref=lambda: prepare_dspark_inputs_reference(sweep.draft_buf, *args, **kw),
    )
    nq = d.num_query_per_req
    T = reqs * nq
    qsl, seqs = out.query_start_loc[: reqs + 1], out.seq_lens[:reqs]
    tok2req = torch.arange(reqs, dtype=I32, device=sweep.dev).repeat_interleave(nq)
    valid = out.query_slot_mapping[:T] >= 0
    sw_args = (qsl, seqs, tok2req, valid, sweep.tables[swa])
    sw_kw: dict[str, Any] = dict(num_tokens=T, window_size=sweep.window, index_width=d.index_width, block_size=swa)
    sweep.draft_swa[1][T:] = 0  # the builder zeroes the lens past the decode tokens first
    rows = sweep.launch(
        DSV4_PREFIX + "dspark_noncausal_swa_indices",
        f"draft: {reqs} requests x {nq} tokens, W={d.index_width}",
        lambda: sweep.k("dspark_noncausal_swa_indices")(*sw_args, **sw_kw, out=sweep.draft_swa),
        ref=lambda: dspark_swa_indices_reference(*sw_args, **sw_kw),
    )
    sweep.rocm_swa_rows("draft non-causal", rows, T)
    return reqs, seqs.tolist()
