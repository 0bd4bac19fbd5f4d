"""The RecoverSSM commit: the accepted tokens folded into every KDA layer's conv state and SSM checkpoint at once
(vLLM 0.34 ``models/kimi_k3/nvidia/ops/recoverssm.py``: ``KDARecoverSSMCommitContext.commit``,
``_compact_conv_state_kernel`` and ``_commit_kda_state_kernel``).

Both read the plan (``warmreg_kimi_k3.recoverssm_plan``: ``c`` tokens to commit, the final and boundary slots, the
boundary's recovery length ``rb``) of speculative request ``b`` with checkpoint slot ``src``, and do nothing for a
request with ``src <= null``, ``c == 0`` or ``final <= null``. Each layer ``l`` is addressed through
:class:`~warmreg_kimi_k3.recoverssm.LayerTable` (base address and page stride per layer).

**Conv state** (``[pages, D, L_state]`` views, ``hist = L_state - S + 1`` with ``S = 1 + spec``): the verify's conv
update left ``[history, drafts]`` in slot ``src``; the accepted history is its window ending at token ``c``::

    conv[final][:, 0:hist] = conv[src][:, c - 1 : c - 1 + hist]
    align mode, boundary > null:  conv[boundary][:, 0:hist] = conv[src][:, rb - 1 : rb - 1 + hist]

Grid ``(cdiv(D, 256), B, L)``, tiles of 256 channels by ``next_pow2(hist)`` positions, four warps.

**SSM state**, per layer and head, in fp32 from the records of row ``b`` (the verify's corrections ``u_t`` and
``[k_t | raw_g_t]``) and the checkpoint ``S0 = state[src]`` (``[V, K]``), with ``k~_t`` the L2-normalised key and
``d_t = exp(g_t)`` the gate of the verify (``kda_gate_reference``): tokens ``t = c-1 .. 0`` in that order::

    F += (u_t k~_t^T) * D[None, :];   D *= d_t                   (F = 0, D = 1 to start)
    state[final] = S0 * D[None, :] + F                            # = the recurrence over tokens 0..c-1
    align mode: the same sums over t < rb only  ->  state[boundary] (if boundary > null)

Grid ``(cdiv(V, BV), B, L * H)``, ``BV = min(next_pow2(V), 32)``, four warps, two stages.

Where they run: the second and third launches of the commit (after the plan), once per KV-cache group of KDA layers
per step with speculative rows, under RecoverSSM; the conv compaction with either backend, the SSM fold in Triton
where the CuTe commit cannot serve (every CUDA target with vLLM's default float32 SSM state,
``warmreg_kimi_k3.recoverssm``). The tables are those of ``KDARecoverSSMCommitContext.create``: conv states as the
layer's ``[pages, D, L_state]`` transposes, fp32 checkpoints ``[pages, H, V, K]``, records of ``max_num_seqs`` rows,
``A_log`` ``[L, H]`` and ``dt_bias`` ``[L, H, K]`` stacked float32.

Keys: the dtypes, the tile constexprs, the head count (SSM), align mode, warps and stages. No stride, size or
alignment is specialized: addresses come from the tables, and one binary serves every page layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton

import warmreg

from ._recoverssm_kernels import commit_kda_state_kernel, compact_conv_state_kernel
from .backends import RECURRENT_STATE_DTYPE, KDALayout, kda_layout
from .causal_conv1d import conv_state_pool
from .model import PLUGIN, KimiK3
from .recoverssm import NULL_BLOCK_ID, LayerTable, use_recoverssm
from .recoverssm_deferred import deferred_recoverssm
from .recoverssm_verify import kda_gate_reference
from .specialized import SM100_FAMILY

__all__ = [
    "BLOCK_D",
    "CommitKeyBase",
    "CommitStateKey",
    "CompactConvKey",
    "RecoverSSMCommitState",
    "RecoverSSMCompactConv",
    "commit_state_reference",
    "compact_conv_state_reference",
    "register",
]

#: Conv-state channels per program (vLLM's ``BLOCK_D``).
BLOCK_D = 256
_Plan = Sequence[torch.Tensor]


@attrs.frozen(kw_only=True)
class CommitKeyBase(warmreg.CompileKey):
    """The fields both commit kernels share."""

    index_dtype: str  # state_indices
    align: bool  # ALIGN_MODE
    num_warps: int


@attrs.frozen(kw_only=True)
class CompactConvKey(CommitKeyBase):
    """What changes the binary of the conv-state compaction."""

    conv_dtype: str
    block_d: int
    block_history: int  # next_pow2(hist)


@attrs.frozen(kw_only=True)
class CommitStateKey(CommitKeyBase):
    """What changes the binary of the SSM fold."""

    state_dtype: str
    correction_dtype: str
    key_gate_dtype: str
    param_dtype: str  # A_log and dt_bias
    head_k: int
    head_v: int
    block_k: int
    block_v: int
    num_heads: int  # NUM_HEADS: the grid's last axis is layers x heads
    bounded: bool
    num_stages: int


def _check_plan(kernel: str, state_indices: torch.Tensor, plan: _Plan, device: torch.device) -> None:
    batch = state_indices.shape[0]
    if state_indices.ndim != 1 or state_indices.dtype.is_floating_point:
        raise warmreg.LaunchError(kernel, f"state_indices must be an int [B] tensor (got {tuple(state_indices.shape)})")
    if len(plan) != 4 or any(
        p.dtype != torch.int32 or p.ndim != 1 or p.shape[0] < batch or p.stride(0) != 1 for p in plan
    ):
        raise warmreg.LaunchError(kernel, f"plan must be the commit plan's four contiguous int32 [>= {batch}] tensors")
    if any(t.device != device for t in (state_indices, *plan)):
        raise warmreg.LaunchError(kernel, f"state_indices and plan must be on {device}")


def _table(kernel: str, name: str, table: LayerTable, layers: int | None = None) -> None:
    if not isinstance(table, LayerTable) or (layers is not None and table.num_layers != layers):
        raise warmreg.LaunchError(kernel, f"{name} must be a LayerTable of {layers or 'the'} layers")


class RecoverSSMCompactConv(warmreg.TritonKernel[CompactConvKey]):
    """The conv-state compaction of the RecoverSSM commit (the module docstring has the math).

    :param layout: the KDA layout (domains only).
    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.recoverssm_compact_conv_state"
    key_type = CompactConvKey
    jit = compact_conv_state_kernel

    def __init__(self, *, layout: KDALayout, max_num_seqs: int) -> None:
        self.layout, self.max_num_seqs = layout, max_num_seqs

    def dispatch(
        self, *, conv: LayerTable, state_indices: torch.Tensor, conv_history_len: int, align: bool
    ) -> CompactConvKey:
        return CompactConvKey(
            index_dtype=warmreg.dtype_name(state_indices.dtype), align=bool(align), num_warps=4,
            conv_dtype=warmreg.dtype_name(conv.ref.dtype), block_d=BLOCK_D,
            block_history=warmreg.next_pow2(conv_history_len),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lay = self.layout
        pool = conv_state_pool(lay, self.max_num_seqs + 1, getattr(torch, lay.dtype))
        return {"conv": [_meta_table(pool)], "state_indices": [warmreg.meta((self.max_num_seqs,), torch.int32)],
                "conv_history_len": [lay.conv_width - 1], "align": [False]}  # fmt: skip

    def warmup_inputs(self, key: CompactConvKey) -> Mapping[str, Any]:
        pool = warmreg.meta((1, 1, key.block_history), getattr(torch, key.conv_dtype))
        return {"conv": _meta_table(pool), "state_indices": warmreg.meta((1,), getattr(torch, key.index_dtype)),
                "conv_history_len": key.block_history, "align": key.align, "plan": _meta_plan()}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, conv: LayerTable, state_indices: torch.Tensor, plan: _Plan, *, conv_history_len: int, align: bool
    ) -> warmreg.LaunchSpec[CompactConvKey]:
        """Compact every layer's conv state in place; returns None.

        :param conv: the layers' conv states ``[pages, D, L_state]`` (:class:`LayerTable`).
        :param state_indices: int ``[B]``: the speculative requests' checkpoint slots (the plan's input).
        :param plan: the commit plan's ``(commit_lens, final, boundary, recovery)`` int32 ``[>= B]`` tensors.
        :param conv_history_len: ``L_state - S + 1`` (> 0).
        :param align: align mode (the plan was made with a block table).
        :raises warmreg.LaunchError: for a plan, table or history length the kernel cannot take.
        """
        _table(self.name, "conv", conv)
        _check_plan(self.name, state_indices, plan, conv.ref.device)
        if not 0 < conv_history_len <= conv.ref.shape[2]:
            raise warmreg.LaunchError(self.name, f"conv_history_len ({conv_history_len}) must be in 1..L_state "
                                      f"({conv.ref.shape[2]})")  # fmt: skip
        key = self.dispatch(conv=conv, state_indices=state_indices, conv_history_len=conv_history_len, align=align)
        dim, batch = conv.ref.shape[1], state_indices.shape[0]
        kwargs = dict(
            ref_ptr=conv.ref, base_ptr=conv.base_addrs, block_stride_ptr=conv.block_strides,
            dim_stride_ptr=conv.dim_strides, token_stride_ptr=conv.token_strides, idx_ptr=state_indices,
            lens_ptr=plan[0], final_ptr=plan[1], boundary_ptr=plan[2], recovery_ptr=plan[3],
            null_block_id=NULL_BLOCK_ID, dim=dim, history=conv_history_len, s_idx=state_indices.stride(0),
            BLOCK_D=key.block_d, BLOCK_H=key.block_history, ALIGN=key.align,
        )  # fmt: skip
        grid = (triton.cdiv(dim, key.block_d), batch, conv.num_layers) if batch and dim else None
        return warmreg.LaunchSpec(key, grid, kwargs, None)


class RecoverSSMCommitState(warmreg.TritonKernel[CommitStateKey]):
    """The SSM fold of the RecoverSSM commit (the module docstring has the math).

    :param layout: the KDA layout (domains only).
    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.recoverssm_commit_state"
    key_type = CommitStateKey
    jit = commit_kda_state_kernel

    def __init__(self, *, layout: KDALayout, max_num_seqs: int) -> None:
        self.layout, self.max_num_seqs = layout, max_num_seqs

    def dispatch(
        self, *, state: LayerTable, correction: LayerTable, key_gate: LayerTable, A_log: torch.Tensor,
        state_indices: torch.Tensor, lower_bound: float | None, align: bool,
    ) -> CommitStateKey:  # fmt: skip
        _, heads, v, k = state.ref.shape
        return CommitStateKey(
            index_dtype=warmreg.dtype_name(state_indices.dtype), align=bool(align), num_warps=4,
            state_dtype=warmreg.dtype_name(state.ref.dtype), correction_dtype=warmreg.dtype_name(correction.ref.dtype),
            key_gate_dtype=warmreg.dtype_name(key_gate.ref.dtype), param_dtype=warmreg.dtype_name(A_log.dtype),
            head_k=k, head_v=v, block_k=warmreg.next_pow2(k), block_v=min(warmreg.next_pow2(v), 32),
            num_heads=heads, bounded=lower_bound is not None, num_stages=2,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lay, n = self.layout, self.max_num_seqs
        h, d, s = lay.num_heads, lay.head_dim, 1 + lay.num_speculative_tokens
        return {
            "state": [_meta_table(warmreg.meta((n + 1, h, d, d), getattr(torch, RECURRENT_STATE_DTYPE)))],
            "correction": [_meta_table(warmreg.meta((n, h, s, d), torch.float32))],
            "key_gate": [_meta_table(warmreg.meta((n, h, s, 2 * d), getattr(torch, lay.dtype)))],
            "A_log": [warmreg.meta((1, h), torch.float32)],
            "state_indices": [warmreg.meta((n,), torch.int32)],
            "lower_bound": [lay.lower_bound],
            "align": [False],
        }

    def warmup_inputs(self, key: CommitStateKey) -> Mapping[str, Any]:
        h, k, v = key.num_heads, key.head_k, key.head_v
        return {
            "state": _meta_table(warmreg.meta((1, h, v, k), getattr(torch, key.state_dtype))),
            "correction": _meta_table(warmreg.meta((1, h, 1, v), getattr(torch, key.correction_dtype))),
            "key_gate": _meta_table(warmreg.meta((1, h, 1, 2 * k), getattr(torch, key.key_gate_dtype))),
            "A_log": warmreg.meta((1, h), getattr(torch, key.param_dtype)),
            "state_indices": warmreg.meta((1,), getattr(torch, key.index_dtype)),
            "dt_bias": warmreg.meta((1, h, k), getattr(torch, key.param_dtype)),
            "lower_bound": -5.0 if key.bounded else None,
            "align": key.align,
            "plan": _meta_plan(),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, state: LayerTable, correction: LayerTable, key_gate: LayerTable, A_log: torch.Tensor,
        dt_bias: torch.Tensor, state_indices: torch.Tensor, plan: _Plan, *, lower_bound: float | None, align: bool,
    ) -> warmreg.LaunchSpec[CommitStateKey]:  # fmt: skip
        """Fold the accepted tokens into every layer's checkpoint, in place; returns None.

        :param state: the layers' SSM checkpoints ``[pages, H, V, K]`` (:class:`LayerTable`).
        :param correction: the layers' correction records ``[rows, H, S, V]``; ``key_gate`` their
            ``[rows, H, S, 2K]`` key/gate records (row ``b``: speculative request ``b``).
        :param A_log: ``[L, H]`` and ``dt_bias`` ``[L, H, K]``: every layer's gate parameters, any strides.
        :param state_indices: int ``[B]``; ``plan`` the commit plan's four int32 tensors.
        :param lower_bound: the gate's lower bound, or None (softplus gate).
        :param align: align mode (the plan was made with a block table).
        :raises warmreg.LaunchError: for tables, parameters or a plan the kernel cannot take.
        """
        if not isinstance(state, LayerTable) or state.ref.ndim != 4:
            raise warmreg.LaunchError(self.name, "state must be a LayerTable of [pages, H, V, K] checkpoints")
        layers, (_, heads, v, k) = state.num_layers, state.ref.shape
        _table(self.name, "correction", correction, layers)
        _table(self.name, "key_gate", key_gate, layers)
        if (
            tuple(correction.ref.shape[1:2]) + tuple(correction.ref.shape[3:]) != (heads, v)
            or key_gate.ref.shape[-1] != 2 * k
        ):
            raise warmreg.LaunchError(
                self.name, f"correction must be [rows, {heads}, S, {v}] and key_gate [rows, {heads}, S, {2 * k}]"
            )
        if A_log.shape != (layers, heads) or dt_bias.shape != (layers, heads, k):
            raise warmreg.LaunchError(self.name, f"A_log must be [{layers}, {heads}] and dt_bias [{layers}, {heads}, {k}] "
                                      f"(got {tuple(A_log.shape)}, {tuple(dt_bias.shape)})")  # fmt: skip
        _check_plan(self.name, state_indices, plan, state.ref.device)
        key = self.dispatch(state=state, correction=correction, key_gate=key_gate, A_log=A_log,
                            state_indices=state_indices, lower_bound=lower_bound, align=align)  # fmt: skip
        st, co, kg = state.ref, correction.ref, key_gate.ref
        kwargs = dict(
            state_ref_ptr=st, state_base_ptr=state.base_addrs, state_block_ptr=state.block_strides,
            corr_ref_ptr=co, corr_base_ptr=correction.base_addrs, corr_block_ptr=correction.block_strides,
            kg_ref_ptr=kg, kg_base_ptr=key_gate.base_addrs, kg_block_ptr=key_gate.block_strides,
            a_log_ptr=A_log, dt_bias_ptr=dt_bias, idx_ptr=state_indices,
            lens_ptr=plan[0], final_ptr=plan[1], boundary_ptr=plan[2], recovery_ptr=plan[3],
            lower_bound=lower_bound or 0.0, null_block_id=NULL_BLOCK_ID,
            s_state_h=st.stride(1), s_state_v=st.stride(2), s_state_k=st.stride(3),
            s_corr_h=co.stride(1), s_corr_t=co.stride(2), s_corr_d=co.stride(3),
            s_kg_h=kg.stride(1), s_kg_t=kg.stride(2), s_kg_d=kg.stride(3),
            s_a_l=A_log.stride(0), s_a_h=A_log.stride(1),
            s_dt_l=dt_bias.stride(0), s_dt_h=dt_bias.stride(1), s_dt_k=dt_bias.stride(2), s_idx=state_indices.stride(0),
            K=key.head_k, V=key.head_v, BK=key.block_k, BV=key.block_v, H=key.num_heads, BOUNDED=key.bounded,
            ALIGN=key.align,
        )  # fmt: skip
        batch = state_indices.shape[0]
        grid = (triton.cdiv(v, key.block_v), batch, layers * heads) if batch else None
        return warmreg.LaunchSpec(key, grid, kwargs, None)


def compact_conv_state_reference(
    convs: Sequence[torch.Tensor], state_indices: torch.Tensor, plan: _Plan, *, conv_history_len: int, align: bool
) -> None:
    """PyTorch reference of :class:`RecoverSSMCompactConv`: compacts each ``[pages, D, L_state]`` of ``convs`` in
    place, request by request in order."""
    hist = conv_history_len
    for b, src in enumerate(state_indices.tolist()):
        c, final, boundary, rb = (int(p[b]) for p in plan)
        if src <= NULL_BLOCK_ID or c == 0 or final <= NULL_BLOCK_ID:
            continue
        for conv in convs:
            kept = conv[src, :, c - 1 : c - 1 + hist].clone()
            if align and boundary > NULL_BLOCK_ID:
                conv[boundary, :, :hist] = conv[src, :, rb - 1 : rb - 1 + hist]
            conv[final, :, :hist] = kept


def commit_state_reference(
    states: Sequence[torch.Tensor], corrections: Sequence[torch.Tensor], key_gates: Sequence[torch.Tensor],
    A_log: torch.Tensor, dt_bias: torch.Tensor, state_indices: torch.Tensor, plan: _Plan, *,
    lower_bound: float | None, align: bool,
) -> None:  # fmt: skip
    """PyTorch reference of :class:`RecoverSSMCommitState`: the recurrence of the committed tokens, oldest first,
    applied to each layer's checkpoint ``[pages, H, V, K]`` of ``states`` in place (``state[final]``, and under
    align mode ``state[boundary]`` from the tokens before the block boundary)."""
    for b, src in enumerate(state_indices.tolist()):
        c, final, boundary, rb = (int(p[b]) for p in plan)
        if src <= NULL_BLOCK_ID or c == 0 or final <= NULL_BLOCK_ID:
            continue
        for layer, (state, corr, kg) in enumerate(zip(states, corrections, key_gates)):
            k = state.shape[-1]
            for h in range(state.shape[1]):
                a = torch.exp(A_log[layer, h].float())
                run, edge = state[src, h].float().clone(), None
                for t in range(c):
                    if t == rb:
                        edge = run.clone()
                    kt = kg[b, h, t, :k].float()
                    kn = kt * torch.rsqrt((kt * kt).sum() + 1e-6)
                    gate = kda_gate_reference(kg[b, h, t, k:], dt_bias[layer, h], a, lower_bound)
                    run = run * torch.exp(gate)[None, :] + corr[b, h, t].float()[:, None] * kn[None, :]
                if align and boundary > NULL_BLOCK_ID:
                    state[boundary, h] = (run if edge is None else edge).to(state.dtype)
                state[final, h] = run.to(state.dtype)


def _meta_plan() -> tuple[torch.Tensor, ...]:
    """The commit plan's four int32 buffers, as meta tensors."""
    return tuple(warmreg.meta((1,), torch.int32) for _ in range(4))


def _meta_table(tensor: torch.Tensor) -> LayerTable:
    """A one-layer table of a meta tensor for planning: the tables themselves are int64 device tensors."""
    column = warmreg.meta((1,), torch.int64)
    return LayerTable(ref=tensor, base_addrs=column, block_strides=column, dim_strides=column, token_strides=column)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register both commit kernels on CUDA under RecoverSSM (:func:`warmreg_kimi_k3.recoverssm.use_recoverssm`):
    the conv compaction runs with either commit backend, the SSM fold is the Triton backend's, which serves every
    CUDA target with vLLM's default float32 SSM state, but for the SM100 family under the deferred RecoverSSM
    (:func:`warmreg_kimi_k3.recoverssm_deferred.deferred_recoverssm`), whose every commit and flush folds with the CuTe
    FP32 commit (``KDADeferredCommitContext._fold``: the records are always indexed there).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, an invalid ``serving.use_replayssm`` or a
        missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None or not use_recoverssm(config, layout):
        return
    n = config.get("serving.max_num_seqs", int, plugin=PLUGIN)
    registry.add(RecoverSSMCompactConv(layout=layout, max_num_seqs=n), when=warmreg.is_cuda)
    fold = warmreg.is_cuda & ~SM100_FAMILY if deferred_recoverssm(config, layout) else warmreg.is_cuda
    registry.add(RecoverSSMCommitState(layout=layout, max_num_seqs=n), when=fold)
