"""The chunked KDA prefill: vLLM 0.33's ``chunk_kda_with_fused_gate`` as a chain of six warmreg ops.

vLLM's Kimi-K3 KDA layer (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward``) runs it for the
prefill requests of a step when its prefill backend resolves to ``"triton"``
(:func:`warmreg_kimi_k3.backends.kda_prefill_backend`), with ``cu_seqlens = non_spec_query_start_loc``,
``use_qk_l2norm_in_kernel=True`` and the initial states gathered from the recurrent-state pool. The stages,
in order, each an op with its own key and autotune candidates:

1. :mod:`~warmreg_kimi_k3.kda_chunk_l2norm`: L2 norm of q and of k;
2. :mod:`~warmreg_kimi_k3.kda_chunk_gate`: the gate, its chunk-local cumulative sum (log2 units), beta;
3. :mod:`~warmreg_kimi_k3.kda_chunk_intra`: ``A_qk`` and ``(I + L)^-1`` of every 64-token chunk;
4. :mod:`~warmreg_kimi_k3.kda_chunk_wu`: the WY factors ``w``, ``u`` and the decayed keys ``kg``;
5. :mod:`~warmreg_kimi_k3.kda_chunk_h`: the state at each chunk's start, the corrected values, the final
   state (read from and written back to the pool);
6. :mod:`~warmreg_kimi_k3.kda_chunk_o`: the output.

Together they equal the recurrence (per sequence and head, state ``S`` ``[K, V]``, scale ``K^-0.5``)::

    q, k = l2norm(q), l2norm(k);  beta = sigmoid(raw_beta);  g = kda_gate(raw_g + dt_bias)   # per K channel
    S = pool[slot] if has_initial_state else 0
    for t: S = S * exp(g_t)[:, None];  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale * S^T q_t
    pool[slot] = S

which :func:`chunk_kda_reference` computes token by token (the decode step's reference,
:func:`warmreg_kimi_k3.kda.kda_recurrent_reference`).
"""

from __future__ import annotations

import torch

import warmreg

from .backends import kda_layout, kda_prefill_backend
from .kda import kda_recurrent_reference
from .kda_chunk_base import ChunkStage, chunk_metadata
from .kda_chunk_gate import KDAChunkGate
from .kda_chunk_h import KDAChunkH
from .kda_chunk_intra import KDAChunkIntra
from .kda_chunk_l2norm import KDAChunkL2Norm
from .kda_chunk_o import KDAChunkO
from .kda_chunk_wu import KDAChunkWU
from .model import PLUGIN, KimiK3

__all__ = ["STAGES", "chunk_kda_prefill", "chunk_kda_reference", "register"]

#: The stage kernels, in launch order.
STAGES: tuple[type[ChunkStage], ...] = (KDAChunkL2Norm, KDAChunkGate, KDAChunkIntra, KDAChunkWU, KDAChunkH, KDAChunkO)
# Any instance launches any key (dispatch reads the tensors alone): the chain uses default ones.
_L2NORM, _GATE, _INTRA, _WU, _H, _O = (
    KDAChunkL2Norm(),
    KDAChunkGate(),
    KDAChunkIntra(),
    KDAChunkWU(),
    KDAChunkH(),
    KDAChunkO(),
)


def chunk_kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,  # the model's parameter name
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The chunked KDA prefill of a varlen batch; returns ``o`` ``[T, H, V]`` in v's dtype and writes each
    sequence's final state into ``state_pool[state_slots[n]]``.

    The arguments follow vLLM's ``chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias,
    lower_bound=..., initial_state=..., cu_seqlens=...)`` with the states in the pool instead of gathered:
    q, k and raw_g are made contiguous as vLLM does (``q.contiguous()`` etc.); raw_beta may keep a token stride.

    :param q: ``[T, H, K]``.
    :param k: ``[T, H, K]``, q's dtype.
    :param v: ``[T, H, V]``, q's dtype.
    :param raw_g: ``[T, H, K]``, the raw gate projection.
    :param raw_beta: ``[T, H]`` (heads contiguous), the raw beta projection.
    :param A_log: float32, ``H`` contiguous elements.
    :param dt_bias: float32 ``[H * K]``, or None.
    :param lower_bound: the gate's lower bound (``< 0``), or None (the softplus gate).
    :param cu_seqlens: int32 ``[N + 1]``: token offsets of the N sequences (starting at 0).
    :param state_pool: fp32 ``[num_slots, H, K, V]``, the decode step's pool.
    :param state_slots: int32 ``[N]``; negative: no state read or written.
    :param has_initial_state: bool ``[N]``: start from the pool (else from zeros).
    :param scale: applied to q (default ``K ** -0.5``).
    :raises warmreg.LaunchError: from the stage that cannot take an input, naming it.
    """
    chunk_indices, chunk_offsets = chunk_metadata(cu_seqlens)
    qn, kn = _L2NORM(q.contiguous()), _L2NORM(k.contiguous())
    g, beta = _GATE(raw_g.contiguous(), raw_beta, A_log.reshape(-1), dt_bias, lower_bound, cu_seqlens, chunk_indices)
    aqk, akk = _INTRA(qn, kn, g, beta, cu_seqlens, chunk_indices, scale=scale)
    w, u, kg = _WU(kn, v.contiguous(), beta, akk, g, cu_seqlens, chunk_indices)
    h, v_new = _H(
        kg, w, u, g, cu_seqlens, chunk_offsets, state_pool, state_slots, has_initial_state, chunk_indices.shape[0]
    )
    return _O(qn, v_new, g, h, aqk, cu_seqlens, chunk_indices, scale=scale)


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: the fp32 recurrence, token by token (:func:`~warmreg_kimi_k3.kda.kda_recurrent_reference`),
    from zeros for sequences without an initial state.

    :returns: ``(o, pool)``: ``o`` in v's dtype (zeros outside the sequences) and a copy of the pool with the
        final states written; the input pool is not modified.
    """
    pool = state_pool.clone()
    for slot, has in zip(state_slots.tolist(), has_initial_state.tolist(), strict=True):
        if slot >= 0 and not has:
            pool[slot] = 0.0
    return kda_recurrent_reference(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, cu_seqlens, pool, state_slots, scale=scale
    )


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the six stages where vLLM runs this chain: KDA layers present and the prefill backend resolved to
    ``"triton"`` (:func:`~warmreg_kimi_k3.backends.kda_prefill_backend`: on CUDA without a gate lower bound, with a
    head dim other than 128 or non-bf16 activations, or when ``serving.kda_prefill_backend`` is ``"triton"``; on
    ROCm where neither aiter's Gluon kernel nor the fused C++ op is taken, vLLM's ROCm copy of the same chain).

    Reads the layout (:func:`~warmreg_kimi_k3.backends.kda_layout`), ``serving.max_num_batched_tokens`` and
    ``serving.max_num_seqs`` (the tuning batch and the state pool's size).
    """
    layout = kda_layout(m, config)
    if layout is None or kda_prefill_backend(m, config, platform) != "triton":
        return
    for stage in STAGES:
        registry.add(
            stage(
                num_heads=layout.num_heads,
                head_dim=layout.head_dim,
                dtype=m.dtype,
                has_dt_bias=True,  # as the decode step: Kimi-Linear's KDA layer has a dt_bias (an assumption)
                lower_bound=layout.lower_bound,
                max_num_batched_tokens=config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN),
                max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
                plugin=PLUGIN,
            )
        )
