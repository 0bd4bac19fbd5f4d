"""The PyTorch reference of the DSpark draft step's inputs (:class:`~warmreg_deepseek_v4.dspark_inputs.DSparkInputs`;
what each row gets is in that module's docstring): the sweep and the tests compare the kernel with it."""

from __future__ import annotations

import torch

from .dspark_buffers import DraftInputs
from .dspark_inputs import PAD_SLOT_ID

__all__ = ["prepare_dspark_inputs_reference"]


def prepare_dspark_inputs_reference(
    out: DraftInputs,
    target_positions: torch.Tensor,
    target_query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_reqs: int,
    block_size: int,
    parallel_drafting_token_id: int,
    num_query_per_req: int,
    num_speculative_steps: int,
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
    cp_rank: int = 0,
    cp_size: int = 1,
    cp_interleave: int = 1,
    sample_from_anchor: bool = True,
) -> DraftInputs:
    """PyTorch reference of :class:`~warmreg_deepseek_v4.dspark_inputs.DSparkInputs`: updates copies of ``out``'s
    buffers and returns them."""
    o = DraftInputs(*(t.clone() for t in out))
    nq, n, bs, cp, inter = num_query_per_req, num_speculative_steps, block_size, cp_size, cp_interleave
    qsl, pos_t, bt = target_query_start_loc.tolist(), target_positions.tolist(), block_table.tolist()
    width = block_table.shape[1]

    def slot(r: int, p: int) -> tuple[int, int]:
        blk = bt[r][min(p // (bs * cp), width - 1)]
        off = p % (bs * cp)
        if cp == 1:
            return blk, blk * bs + off
        mine = (off // inter) % cp == cp_rank
        return blk, blk * bs + (off // (inter * cp)) * inter + off % inter if mine else PAD_SLOT_ID

    for r in range(num_reqs):
        st, cs, ce = int(idx_mapping[r]), qsl[r], qsl[r + 1]
        nv = ce - cs - int(num_rejected[r])
        bonus = int(last_sampled.flatten()[st]) if int(num_sampled[r]) > 0 else int(next_prefill_tokens.flatten()[st])
        lastp = pos_t[cs + nv - 1]
        for j in range(ce - cs):
            p = pos_t[cs + j] if j < nv else 0
            o.context_positions[cs + j] = p
            blk, s = slot(r, p) if j < nv else (0, 0)
            o.context_slot_mapping[cs + j] = s if j < nv and blk != 0 else PAD_SLOT_ID
        for k in range(nq):
            q, i = lastp + 1 + k, r * nq + k
            o.input_ids[i], o.is_padding[i], o.positions[i] = (
                bonus if k == 0 else parallel_drafting_token_id,
                False,
                min(q, max_model_len - 1),
            )
            blk, s = slot(r, q)
            o.query_slot_mapping[i] = s if blk != 0 else PAD_SLOT_ID
            off = 0 if sample_from_anchor else 1
            if k >= off:
                si = r * n + k - off
                o.sample_indices[si], o.sample_pos[si], o.sample_idx_mapping[si] = (
                    i,
                    q + 1 if sample_from_anchor else q,
                    st,
                )
        o.query_start_loc[r], o.seq_lens[r] = r * nq, min(lastp + 1 + nq, max_model_len)
        o.temperature[st], o.seeds[st] = temperature[st], seeds[st]
    o.query_start_loc[num_reqs : max_num_reqs + 1] = num_reqs * nq
    o.seq_lens[num_reqs:max_num_reqs] = 0
    s0, s1 = num_reqs * n, max_num_reqs * n
    o.sample_indices[s0:s1], o.sample_pos[s0:s1], o.sample_idx_mapping[s0:s1] = 0, 0, -1
    q0 = num_reqs * nq
    o.input_ids[q0:max_num_tokens], o.positions[q0:max_num_tokens] = 0, 0
    o.is_padding[q0:max_num_tokens], o.query_slot_mapping[q0:max_num_tokens] = True, PAD_SLOT_ID
    return o
