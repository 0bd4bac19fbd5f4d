"""The Kimi-K3 sweep's decode context parallelism: the MLA decode's combine of one DCP rank's partial output.

Part of the sweep driver (:mod:`warmreg_kimi_k3.sweep`), never imported by registration. With
``decode_context_parallel_size > 1`` every MLA layer's decode (``nvidia/mla.py``) ends in ``MLADCPManager.combine``:
the lses all-gathered over the group, this rank's latent output ``[T, H, kv_lora_rank]`` rescaled in place
(:mod:`warmreg_kimi_k3.dcp_correct_attn_out`), then a reduce-scatter (not a kernel of this plugin). With the
all-to-all backend and no direct workspace it is ``dcp_a2a_v_up_proj_lse_reduce`` instead: the pack
(:mod:`warmreg_kimi_k3.dcp_a2a_pack`), the all-to-all (stood in for by this rank's own buffer, a permutation of the
ranks' equal-shaped ones) and the combine (:mod:`warmreg_kimi_k3.dcp_a2a_combine`), over ``kv_lora_rank`` below 8
decode tokens and ``v_head_dim`` from 8.
"""

from __future__ import annotations

from typing import Any

import torch

from warmreg.testing.sweep import Step

from .dcp_a2a_combine import dcp_a2a_unpack_combine_reference
from .dcp_a2a_pack import V_UP_PROJ_FIRST_MIN_TOKENS, dcp_a2a_pack_send_reference
from .dcp_correct_attn_out import dcp_correct_attn_out_reference

__all__ = ["DCP_A2A_COMBINE", "DCP_A2A_PACK", "DCP_CORRECT", "dcp_a2a_step", "dcp_correct_step"]

DCP_CORRECT = "kimi_k3.dcp_correct_attn_out"
DCP_A2A_PACK = "kimi_k3.dcp_a2a_pack_send"
DCP_A2A_COMBINE = "kimi_k3.dcp_a2a_unpack_combine"


def dcp_correct_step(sweep: Any, st: Step) -> None:
    """One MLA layer's combine over the step's decode tokens: a random rank of the group, lses with the padded
    rows of empty shards at -inf, checked against the reference (the output within one bf16 step).

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its plan kernels and ``launch``).
    :param st: the step.
    """
    t = st.batch.decode_tokens
    if not t:
        return
    kernel = sweep.kernel(DCP_CORRECT)
    n, heads, d = kernel.world_size, kernel.heads, kernel.head_dim
    out = sweep.randn(t, heads, d, dtype=getattr(torch, kernel.dtype))
    lses = torch.randn(n, t, heads, generator=sweep.gen, device=sweep.dev).mul_(4)
    if sweep.rng.random() < 0.3:
        lses[sweep.rng.randrange(n), -1] = -float("inf")  # an empty shard
    rank, base_e = sweep.rng.randrange(n), kernel.is_base_e

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        lse = kernel(out, lses, rank, is_lse_base_on_e=base_e)
        return out, lse

    sweep.launch(
        DCP_CORRECT,
        f"{t} decode tokens, rank {rank} of {n}",
        run,
        ref=lambda: dcp_correct_attn_out_reference(out, lses, rank, is_lse_base_on_e=base_e),
    )


def dcp_a2a_step(sweep: Any, st: Step) -> None:
    """One MLA layer's all-to-all combine over the step's decode tokens: the pack with the decode's int32
    ``seq_lens`` / ``query_start_loc`` (a random shard empty now and then, a CUDA-graph padding row), checked bitwise
    against the reference, then the combine of the packed buffer into the attention output's rows (within one bf16
    step).

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its plan kernels and ``launch``).
    :param st: the step.
    """
    t, decodes = st.batch.decode_tokens, st.batch.num_decodes
    if not t:
        return
    pack, combine = sweep.kernel(DCP_A2A_PACK), sweep.kernel(DCP_A2A_COMBINE)
    n, heads = pack.world_size, pack.heads
    d = int(sweep.cfg.text["kv_lora_rank" if t < V_UP_PROJ_FIRST_MIN_TOKENS else "v_head_dim"])
    rows = t + (sweep.rng.random() < 0.3)  # a padded row past the decode
    dtype = getattr(torch, pack.dtype)
    out = sweep.randn(rows, n * heads, d, dtype=dtype)
    lse = torch.randn(rows, n * heads, generator=sweep.gen, device=sweep.dev).mul_(4)
    lens = [0 if sweep.rng.random() < 0.2 else s for s in st.batch.seqs[:decodes]]  # a shard with no local KV
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=sweep.dev)
    starts = [0]
    for q in st.batch.qlens[:decodes]:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32, device=sweep.dev)
    words = torch.int32 if dtype == torch.float32 else torch.int16  # the packed lse's bits compare exactly
    send = sweep.launch(
        DCP_A2A_PACK,
        f"{rows} rows of {decodes} decode requests, D {d}, group {n}",
        lambda: pack(out, lse, n, seq_lens, qsl).view(words),
        ref=lambda: dcp_a2a_pack_send_reference(out, lse, n, seq_lens, qsl).view(words),
    )
    if send is None:
        return
    recv, base_e = send.view(dtype), combine.is_base_e
    attn_out = torch.empty(rows, heads * d, dtype=dtype, device=sweep.dev)
    sweep.launch(
        DCP_A2A_COMBINE,
        f"{rows} rows, D {d}, group {n}",
        lambda: combine(recv, is_lse_base_on_e=base_e, out=attn_out.view(rows, heads, d)),
        ref=lambda: dcp_a2a_unpack_combine_reference(recv, is_lse_base_on_e=base_e),
    )
