"""The chunked KDA prefill: vLLM 0.33's ``chunk_kda_with_fused_gate`` as a chain of six warmreg ops.

vLLM's Kimi-K3 KDA layer (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward``) runs it for the
prefill requests of a step when its prefill backend resolves to ``"triton"``
(:func:`warmreg_kimi_k3.backends.kda_prefill_backend`)::

    initial_state = gather_initial_states(recurrent_state, non_spec_state_indices_tensor, has_initial_state)
    o, final_state = chunk_kda_with_fused_gate(q=q, k=k, v=v, raw_g=g1, raw_beta=beta, A_log=A_log,
        g_bias=dt_bias, lower_bound=gate_lower_bound, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=non_spec_query_start_loc, out=non_spec_out)
    recurrent_state[non_spec_state_indices_tensor] = final_state.to(recurrent_state.dtype)

:func:`chunk_kda_prefill` replaces the middle call, with its arguments and results (the gather is the op
:mod:`~warmreg_kimi_k3.gather_initial_states`; the scatter stays the layer's torch indexing). No variant reads
or writes the pool by slot: no engine call does (ROCm's ``models/kimi_k3/amd/ops/kda_prefill.py:
chunk_kda_prefill(state_cache=...)`` gathers and scatters around the same chain on its Triton path too). The stages, in
order, each an op with its own key (and autotune candidates but for the L2 norm), each vLLM's own kernel's
arithmetic:

1. :mod:`~warmreg_kimi_k3.kda_chunk_l2norm`: L2 norm of q and of k (``l2norm_fwd``);
2. :mod:`~warmreg_kimi_k3.kda_chunk_gate`: the gate, its chunk-local cumulative sum (log2 units), beta
   (``fused_kda_gate_chunk_cumsum``);
3. :mod:`~warmreg_kimi_k3.kda_chunk_intra`: ``A_qk`` and ``(I + L)^-1`` of every 64-token chunk
   (``chunk_kda_fwd_intra``);
4. :mod:`~warmreg_kimi_k3.kda_chunk_wu`: the WY factors ``w``, ``u`` and the decayed keys ``kg``
   (``recompute_w_u_fwd``);
5. :mod:`~warmreg_kimi_k3.kda_chunk_h`: the state at each chunk's start, the corrected values, the final states
   (``chunk_gated_delta_rule_fwd_h``);
6. :mod:`~warmreg_kimi_k3.kda_chunk_o`: the output (``chunk_gla_fwd_o_gk``).

Together they equal the recurrence (per sequence and head, state ``S`` ``[V, K]`` as vLLM's pool holds it,
scale ``K^-0.5``)::

    q, k = l2norm(q), l2norm(k);  beta = sigmoid(raw_beta);  g = kda_gate(raw_g + dt_bias)   # per K channel
    S = initial_state[n] if given else 0
    for t: S = S * exp(g_t)[None, :];  S = S + (beta_t (v_t - S k_t)) k_t^T;  o_t = scale * S q_t
    final_state[n] = S

which :func:`chunk_kda_reference` computes token by token.
"""

from __future__ import annotations

import torch

import warmreg

from .backends import kda_layout, kda_prefill_backend
from .kda import kda_gate_reference
from .kda_chunk_base import ChunkStage, chunk_metadata
from .kda_chunk_gate import KDAChunkGate
from .kda_chunk_h import KDAChunkH
from .kda_chunk_intra import KDAChunkIntra
from .kda_chunk_l2norm import KDAChunkL2Norm, l2norm_reference
from .kda_chunk_o import KDAChunkO
from .kda_chunk_wu import KDAChunkWU
from .model import PLUGIN, KimiK3

__all__ = ["NAME", "STAGES", "chunk_kda_prefill", "chunk_kda_reference", "register"]

#: The name :func:`chunk_kda_prefill`'s own errors carry (a chain, not a kernel).
NAME = "kimi_k3.kda_chunk"
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
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's ``chunk_kda_with_fused_gate`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk.py``), same
    arguments, same results: ``(o, final_state)``.

    As vLLM: q, k, v and raw_g are made contiguous (``.contiguous()``, a copy only when they are not); the
    output is written into ``out``, or without one into that contiguous ``v`` (the caller's ``v`` itself when
    it is contiguous: its values are overwritten), and that tensor is returned, ``[1, T, H, V]``. The final
    states are a fresh fp32 ``[N, H, V, K]`` (None without ``output_final_state``); the pool is not touched.

    :param q: ``[1, T, H, K]``.
    :param k: ``[1, T, H, K]``, q's dtype.
    :param v: ``[1, T, H, V]``, q's dtype.
    :param raw_g: ``[1, T, H, K]``, the raw gate projection.
    :param raw_beta: ``[1, T, H]`` with contiguous heads (the token stride is free), the raw beta projection.
    :param A_log: float32, ``H`` elements (any shape that ``reshape(-1)`` views).
    :param g_bias: float32, ``H * K`` elements (the layer's ``dt_bias``), or None.
    :param scale: applied to q (default ``K ** -0.5``).
    :param initial_state: ``[N, H, V, K]`` (``gather_initial_states``' output; any float dtype, read as fp32),
        or None: zeros.
    :param output_final_state: return the final states.
    :param lower_bound: the gate's lower bound (``< 0``), or None (the softplus gate).
    :param use_qk_l2norm_in_kernel: L2-normalise q and k first (the layer: True).
    :param cu_seqlens: int32 ``[N + 1]``: token offsets of the N sequences (starting at 0); required, as the
        layer always passes it.
    :param out: ``[1, T, H, V]`` contiguous (the layer's ``core_attn_out`` slice), or None.
    :raises warmreg.LaunchError: from the stage that cannot take an input, naming it, or naming this chain for
        a missing ``cu_seqlens`` or a batch other than 1.
    """
    if cu_seqlens is None or q.ndim != 4 or q.shape[0] != 1:
        raise warmreg.LaunchError(
            NAME,
            f"needs cu_seqlens and q of shape [1, T, H, K] (got cu_seqlens={cu_seqlens is not None}, "
            f"q {tuple(q.shape)})",
            fix="pass the varlen batch as the Kimi-K3 layer does: one batch row, cu_seqlens",
        )
    if out is not None and (out.ndim != 4 or out.shape[0] != 1):
        raise warmreg.LaunchError(NAME, f"out must be [1, T, H, V] (got {tuple(out.shape)})")
    qk = (q.contiguous(), k.contiguous())
    if use_qk_l2norm_in_kernel:
        qk = (_L2NORM(qk[0]), _L2NORM(qk[1]))
    qn, kn = qk[0][0], qk[1][0]
    v = v.contiguous()
    chunk_indices, chunk_offsets = chunk_metadata(cu_seqlens)
    g, beta = _GATE(
        raw_g.contiguous()[0], raw_beta[0], A_log.reshape(-1), None if g_bias is None else g_bias.reshape(-1),
        lower_bound, cu_seqlens, chunk_indices,
    )  # fmt: skip
    aqk, akk = _INTRA(qn, kn, g, beta, cu_seqlens, chunk_indices, scale=scale, safe_gate=lower_bound is not None)
    w, u, kg = _WU(kn, v[0], beta, akk, g, cu_seqlens, chunk_indices)
    h, v_new, final_state = _H(
        kg, w, u, g, cu_seqlens, chunk_offsets, None if initial_state is None else initial_state.contiguous(),
        chunk_indices.shape[0], output_final_state=output_final_state,
    )  # fmt: skip
    o = v if out is None else out
    _O(qn, v_new, g, h, aqk, cu_seqlens, chunk_indices, scale=scale, out=o[0])
    return o, final_state


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`chunk_kda_prefill`: the fp32 recurrence of the module docstring, token by
    token (the decays with ``exp``, not the chain's ``exp2`` of chunk-local sums), in the same layouts.

    :returns: ``(o, final_state)``: fp32 ``[1, T, H, V]`` (zeros outside the sequences) and ``[N, H, V, K]``.
    :raises ValueError: without ``cu_seqlens``.
    """
    if cu_seqlens is None:
        raise ValueError("chunk_kda_reference needs cu_seqlens")
    heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = q[0].float(), k[0].float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm_reference(qf), l2norm_reference(kf)
    g = kda_gate_reference(raw_g[0], A_log.reshape(-1), g_bias, lower_bound)  # [T, H, K]
    beta = torch.sigmoid(raw_beta[0].float())
    o = torch.zeros(v.shape[1:])
    bounds = cu_seqlens.tolist()
    finals = []
    for n in range(len(bounds) - 1):
        s = torch.zeros(heads, dv, dk) if initial_state is None else initial_state[n].float().clone()
        for t in range(bounds[n], bounds[n + 1]):
            s = s * torch.exp(g[t])[:, None, :]
            u = beta[t][:, None] * (v[0, t].float() - torch.einsum("hvk,hk->hv", s, kf[t]))
            s = s + u[:, :, None] * kf[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", s, qf[t] * scale)
        finals.append(s)
    return o[None], torch.stack(finals) if finals else torch.zeros(0, heads, dv, dk)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the six stages where vLLM runs this chain: KDA layers present and the prefill backend resolved to
    ``"triton"`` (:func:`~warmreg_kimi_k3.backends.kda_prefill_backend`: on CUDA without a gate lower bound, with a
    head dim other than 128 or non-bf16 activations, or when ``serving.kda_prefill_backend`` is ``"triton"``; on
    ROCm where neither aiter's Gluon kernel nor the fused C++ op is taken, vLLM's ROCm copy of the same chain,
    ``models/kimi_k3/amd/ops/kda_prefill.py``, which gathers and scatters the states around it likewise).

    Reads the layout (:func:`~warmreg_kimi_k3.backends.kda_layout`) and ``serving.max_num_batched_tokens`` (the
    tuning batch).
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
                plugin=PLUGIN,
            )
        )
