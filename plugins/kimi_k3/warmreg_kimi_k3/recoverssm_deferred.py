"""The specialized decode's deferred RecoverSSM: the commit step that defers each request's accepted tokens to its
next verify, and the flush plan that folds them in before a verify that does not replay them (vLLM 0.34
``models/kimi_k3/nvidia/specialized_decode/recoverssm/``: ``context.py: KDADeferredCommitContext.commit`` and
``.flush``, ``kernels.py: _defer_commit_kernel`` and ``_prepare_flush_plan_kernel``).

When vLLM runs it: the specialized decode (``serving.decode_backend`` ``latency_specialized``, SM100 family, DSpark
drafts: ``warmreg_kimi_k3.specialized``) installs it on every Triton RecoverSSM KDA layer (``recoverssm/state.py:
install_layers``, ``install_builder``). The layers' commit context becomes ``KDADeferredCommitContext``, whose backend
is ``fp32_deferred`` where the CuTe FP32 commit folds the checkpoints (``cutedsl/kda/commit.py: supported``: a gate
lower bound, an fp32 ``[slot, H, 128, 128]`` state contiguous per slot, SM10x), else the stock ``triton`` one, and
nothing is deferred. Under ``fp32_deferred`` every step with speculative rows gets a deferred commit (the builder's
``recoverssm_deferred``), so:

- after sampling, ``commit`` runs the stock plan (``warmreg_kimi_k3.recoverssm_plan``) then :class:`DeferCommit`,
  which moves each request's commit length into the pending replay of its record slot; with no eager rows (only
  prefix caching's align mode marks rows eager) nothing is folded;
- the verify of a step the stock layer loop runs (``deferred_recoverssm_verify``) first flushes: :class:`FlushPlan`,
  the conv-state compaction (``warmreg_kimi_k3.recoverssm_commit``, not align) and the CuTe FP32 fold (not Triton;
  the Triton SSM fold never runs there), then runs the verify with record indices
  (``warmreg_kimi_k3.recoverssm_verify``).

Math, per speculative row ``b`` (grid ``(B,)``, one warp, as vLLM launches both), ``row = record_rows[b]``,
``src = state_indices[b]``, ``S = 1 + spec``::

    defer:  if row >= 0 and src > null:
                if eager[b]:  pending[row] = 0                          (the row is committed now)
                else:         pending[row] = commit_lens[b];  commit_lens[b] = 0
    flush:  c = clamp(pending[row] if row >= 0 else 0, 0, S)
            commit_lens[b] = c if src > null and c > 0 else 0;  final[b] = src;  boundary[b] = null;  recovery[b] = 0

Every index tensor is int32 (the staged ``[max_num_seqs, 1]`` state-index buffer's column, the builder's
``recoverssm_record_rows``, the runner state's ``pending``, the context's plan buffers). Keys: the dtypes, ``S`` (flush),
whether there is an eager mask (defer) and one warp; the state-index stride and the null block are runtime integers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import KDALayout, kda_layout
from .model import PLUGIN, KimiK3
from .recoverssm import NULL_BLOCK_ID, use_recoverssm
from .specialized import SM100_FAMILY, dspark_draft

__all__ = [
    "FP32_COMMIT_HEAD_DIM",
    "DeferCommit",
    "DeferCommitKey",
    "FlushPlan",
    "FlushPlanKey",
    "defer_commit_reference",
    "deferred_recoverssm",
    "flush_plan_reference",
    "register",
]

#: The head dim of the CuTe FP32 commit (``cutedsl/kda/commit.py: K``).
FP32_COMMIT_HEAD_DIM = 128
_PLAN = ["lens_ptr", "final_ptr", "boundary_ptr", "recovery_ptr"]


def deferred_recoverssm(config: warmreg.WarmConfig, layout: KDALayout | None) -> bool:
    """Whether vLLM defers the RecoverSSM commit on the SM100 family (the caller adds that platform predicate): the
    specialized decode with DSpark drafts, RecoverSSM, and a layout the CuTe FP32 commit folds (a gate lower bound,
    head dim 128; warmreg's SSM state is vLLM's default float32).

    :raises warmreg.ConfigError: as :func:`warmreg_kimi_k3.recoverssm.use_recoverssm` and
        :func:`warmreg_kimi_k3.specialized.dspark_draft`.
    """
    if layout is None or not use_recoverssm(config, layout) or dspark_draft(config) is None:
        return False
    return layout.lower_bound is not None and layout.head_dim == FP32_COMMIT_HEAD_DIM


@triton.jit(do_not_specialize=["null_block_id", "s_idx"],
            do_not_specialize_on_alignment=["idx_ptr", "lens_ptr", "rows_ptr", "pending_ptr", "eager_ptr"])  # fmt: skip
def _defer_commit_kernel(
    idx_ptr, lens_ptr, rows_ptr, pending_ptr, eager_ptr,  # [B] (idx: stride s_idx), [B], [>= B], [slots], [B]
    null_block_id, s_idx,
    EAGER: tl.constexpr,  # an eager mask is given (align mode's rows near a block boundary)
):  # fmt: skip
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    src = tl.load(idx_ptr + b * s_idx)
    if (row < 0) | (src <= null_block_id):
        return
    c = tl.load(lens_ptr + b)
    if EAGER:
        now = tl.load(eager_ptr + b) != 0
        tl.store(pending_ptr + row, tl.where(now, 0, c))
        tl.store(lens_ptr + b, tl.zeros_like(c), mask=~now)
    else:
        tl.store(pending_ptr + row, c)
        tl.store(lens_ptr + b, tl.zeros_like(c))


@triton.jit(do_not_specialize=["null_block_id", "s_idx"],
            do_not_specialize_on_alignment=["idx_ptr", "rows_ptr", "pending_ptr", *_PLAN])  # fmt: skip
def _flush_plan_kernel(
    idx_ptr, rows_ptr, pending_ptr,  # [B] (stride s_idx), [>= B], [slots]
    lens_ptr, final_ptr, boundary_ptr, recovery_ptr,  # the plan [B], contiguous
    null_block_id, s_idx,
    S: tl.constexpr,  # 1 + num_speculative_tokens: the most tokens a request replays
):  # fmt: skip
    b = tl.program_id(0)
    src = tl.load(idx_ptr + b * s_idx)
    row = tl.load(rows_ptr + b)
    c = tl.load(pending_ptr + row, mask=row >= 0, other=0)
    c = tl.minimum(tl.maximum(c, 0), S)
    tl.store(lens_ptr + b, tl.where((src > null_block_id) & (c > 0), c, 0))
    tl.store(final_ptr + b, src)
    tl.store(boundary_ptr + b, null_block_id)
    tl.store(recovery_ptr + b, 0)


def _name(t: torch.Tensor | None) -> str | None:
    return None if t is None else warmreg.dtype_name(t.dtype)


def _check_ints(kernel: str, tensors: Mapping[str, torch.Tensor | None], batch: int) -> None:
    """Every tensor an integer vector on the state indices' device; each but ``state_indices`` and ``pending``
    holds ``>= batch`` elements and is contiguous."""
    device = tensors["state_indices"].device  # type: ignore[union-attr]
    for name, t in tensors.items():
        if t is None:
            continue
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise warmreg.LaunchError(kernel, f"{name} must be a 1-D integer tensor (got {t.dtype} {tuple(t.shape)})")
        if name not in ("state_indices", "pending") and (t.shape[0] < batch or (t.stride(0) != 1 and batch > 1)):
            raise warmreg.LaunchError(kernel, f"{name} must be contiguous with >= {batch} elements "
                                      f"(got {tuple(t.shape)}, stride {t.stride(0)})")  # fmt: skip
        if t.device != device:
            raise warmreg.LaunchError(kernel, f"{name} must be on {device} (got {t.device})")


@attrs.frozen(kw_only=True)
class DeferCommitKey(warmreg.CompileKey):
    """What changes the binary of the defer step: the dtypes (the eager mask's or None) and one warp."""

    index_dtype: str  # state_indices
    lens_dtype: str  # commit_lens (the plan's)
    rows_dtype: str  # record_rows
    pending_dtype: str
    eager_dtype: str | None  # None: no eager rows (outside align mode, always)
    num_warps: int


class DeferCommit(warmreg.TritonKernel[DeferCommitKey]):
    """The deferred commit's defer step (the module docstring has the math and vLLM's call site).

    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.recoverssm_defer_commit"
    key_type = DeferCommitKey
    jit = _defer_commit_kernel

    def __init__(self, *, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def dispatch(
        self, *, state_indices: torch.Tensor, commit_lens: torch.Tensor, record_rows: torch.Tensor,
        pending: torch.Tensor, eager: torch.Tensor | None,
    ) -> DeferCommitKey:  # fmt: skip
        return DeferCommitKey(
            index_dtype=warmreg.dtype_name(state_indices.dtype), lens_dtype=warmreg.dtype_name(commit_lens.dtype),
            rows_dtype=warmreg.dtype_name(record_rows.dtype), pending_dtype=warmreg.dtype_name(pending.dtype),
            eager_dtype=_name(eager), num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """The staged int32 state-index column, the context's int32 ``commit_lens``, the builder's int32 record
        rows and the runner state's int32 ``pending``; no eager mask (vLLM makes one in align mode only, which
        warmreg does not express)."""
        n = self.max_num_seqs
        return {
            "state_indices": [warmreg.meta((n, 1), torch.int32)[:, 0]],
            "commit_lens": [warmreg.meta((n,), torch.int32)],
            "record_rows": [warmreg.meta((n,), torch.int32)],
            "pending": [warmreg.meta((n,), torch.int32)],
            "eager": [None],
        }

    def warmup_inputs(self, key: DeferCommitKey) -> Mapping[str, Any]:
        def t(dtype: str | None) -> torch.Tensor | None:
            return None if dtype is None else warmreg.meta((1,), getattr(torch, dtype))

        return {"state_indices": t(key.index_dtype), "commit_lens": t(key.lens_dtype), "record_rows": t(key.rows_dtype),
                "pending": t(key.pending_dtype), "eager": t(key.eager_dtype)}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, state_indices: torch.Tensor, commit_lens: torch.Tensor, record_rows: torch.Tensor,
        pending: torch.Tensor, *, eager: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[DeferCommitKey]:  # fmt: skip
        """Move the ``B`` speculative rows' commit lengths into ``pending`` (in place; returns None).

        :param state_indices: int ``[B]``, any stride: each row's checkpoint slot.
        :param commit_lens: int ``[>= B]``, contiguous: the plan's commit lengths (zeroed where deferred).
        :param record_rows: int ``[>= B]``, contiguous: each row's record slot, -1 for none.
        :param pending: int ``[slots]``: the pending replay of each record slot.
        :param eager: int ``[>= B]``, contiguous: rows committed now (non-zero), or None.
        :raises warmreg.LaunchError: for tensors that are not integer vectors of these sizes on one device.
        """
        batch = state_indices.shape[0]
        _check_ints(self.name, {"state_indices": state_indices, "commit_lens": commit_lens, "record_rows": record_rows,
                                "pending": pending, "eager": eager}, batch)  # fmt: skip
        key = self.dispatch(state_indices=state_indices, commit_lens=commit_lens, record_rows=record_rows,
                            pending=pending, eager=eager)  # fmt: skip
        kwargs = dict(idx_ptr=state_indices, lens_ptr=commit_lens, rows_ptr=record_rows, pending_ptr=pending,
                      eager_ptr=commit_lens if eager is None else eager, null_block_id=NULL_BLOCK_ID,
                      s_idx=state_indices.stride(0), EAGER=key.eager_dtype is not None)  # fmt: skip
        return warmreg.LaunchSpec(key, (batch,) if batch else None, kwargs, None)


@attrs.frozen(kw_only=True)
class FlushPlanKey(warmreg.CompileKey):
    """What changes the binary of the flush plan: the dtypes, ``S`` and one warp."""

    index_dtype: str  # state_indices
    rows_dtype: str  # record_rows
    pending_dtype: str
    window: int  # S
    num_warps: int


class FlushPlan(warmreg.TritonKernel[FlushPlanKey]):
    """The deferred commit's flush plan (the module docstring has the math and vLLM's call site).

    :param max_num_seqs: requests in a step (domains only).
    :param spec_query_len: ``1 + num_speculative_tokens`` (domains only).
    """

    name = "kimi_k3.recoverssm_flush_plan"
    key_type = FlushPlanKey
    jit = _flush_plan_kernel

    def __init__(self, *, max_num_seqs: int, spec_query_len: int) -> None:
        self.max_num_seqs, self.spec_query_len = max_num_seqs, spec_query_len

    def dispatch(
        self, *, state_indices: torch.Tensor, record_rows: torch.Tensor, pending: torch.Tensor, spec_query_len: int
    ) -> FlushPlanKey:
        return FlushPlanKey(
            index_dtype=warmreg.dtype_name(state_indices.dtype), rows_dtype=warmreg.dtype_name(record_rows.dtype),
            pending_dtype=warmreg.dtype_name(pending.dtype), window=spec_query_len, num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """One point: ``KDARecoverSSMDeferred.flush``'s int32 staged state-index column, record rows and pending."""
        n = self.max_num_seqs
        return {
            "state_indices": [warmreg.meta((n, 1), torch.int32)[:, 0]],
            "record_rows": [warmreg.meta((n,), torch.int32)],
            "pending": [warmreg.meta((n,), torch.int32)],
            "spec_query_len": [self.spec_query_len],
        }

    def warmup_inputs(self, key: FlushPlanKey) -> Mapping[str, Any]:
        return {"state_indices": warmreg.meta((1,), getattr(torch, key.index_dtype)),
                "record_rows": warmreg.meta((1,), getattr(torch, key.rows_dtype)),
                "pending": warmreg.meta((1,), getattr(torch, key.pending_dtype)), "spec_query_len": key.window}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, state_indices: torch.Tensor, record_rows: torch.Tensor, pending: torch.Tensor, *, spec_query_len: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[FlushPlanKey]:  # fmt: skip
        """The flush's commit plan of the ``B`` rows: int32 ``(commit_lens, final_state_indices,
        boundary_state_indices, boundary_recovery_lens)``, each ``[B]`` (``out``, or fresh tensors), as the commit
        plan's (``warmreg_kimi_k3.recoverssm_plan``) for the conv compaction and the fold.

        :param state_indices: int ``[B]``, any stride: each row's checkpoint slot.
        :param record_rows: int ``[>= B]``, contiguous: each row's record slot, -1 for none.
        :param pending: int ``[slots]``: the pending replay of each record slot.
        :param spec_query_len: ``S = 1 + num_speculative_tokens``.
        :param out: four preallocated contiguous int32 ``[B]`` tensors.
        :raises warmreg.LaunchError: for tensors that are not integer vectors of these sizes on one device, ``S < 1``,
            or an ``out`` that is not four int32 ``[B]`` tensors.
        """
        batch, device = state_indices.shape[0], state_indices.device
        _check_ints(self.name, {"state_indices": state_indices, "record_rows": record_rows, "pending": pending}, batch)
        if spec_query_len < 1:
            raise warmreg.LaunchError(self.name, f"spec_query_len must be >= 1 (got {spec_query_len})")
        if out is not None and (not isinstance(out, tuple) or len(out) != 4):
            raise warmreg.LaunchError(self.name, "out must be a tuple of 4 tensors (commit_lens, final, boundary, "
                                      "recovery)")  # fmt: skip
        outs = tuple(warmreg.output(self.name, f"out[{i}]", None if out is None else out[i], (batch,),
                                    torch.int32, device) for i in range(4))  # fmt: skip
        key = self.dispatch(state_indices=state_indices, record_rows=record_rows, pending=pending,
                            spec_query_len=spec_query_len)  # fmt: skip
        kwargs = dict(idx_ptr=state_indices, rows_ptr=record_rows, pending_ptr=pending, lens_ptr=outs[0],
                      final_ptr=outs[1], boundary_ptr=outs[2], recovery_ptr=outs[3], null_block_id=NULL_BLOCK_ID,
                      s_idx=state_indices.stride(0), S=key.window)  # fmt: skip
        return warmreg.LaunchSpec(key, (batch,) if batch else None, kwargs, outs)


def defer_commit_reference(
    state_indices: torch.Tensor, commit_lens: torch.Tensor, record_rows: torch.Tensor, pending: torch.Tensor, *,
    eager: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """PyTorch reference of :class:`DeferCommit`: updates ``commit_lens`` and ``pending`` in place."""
    for b, src in enumerate(state_indices.tolist()):
        row = int(record_rows[b])
        if row < 0 or src <= NULL_BLOCK_ID:
            continue
        if eager is not None and int(eager[b]) != 0:
            pending[row] = 0
        else:
            pending[row] = commit_lens[b]
            commit_lens[b] = 0


def flush_plan_reference(
    state_indices: torch.Tensor, record_rows: torch.Tensor, pending: torch.Tensor, *, spec_query_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`FlushPlan`: the four int32 ``[B]`` plan tensors."""
    srcs = [int(s) for s in state_indices.tolist()]
    lens = []
    for b, src in enumerate(srcs):
        row = int(record_rows[b])
        c = min(max(int(pending[row]) if row >= 0 else 0, 0), spec_query_len)
        lens.append(c if src > NULL_BLOCK_ID and c > 0 else 0)
    batch = len(srcs)
    return (torch.tensor(lens, dtype=torch.int32), torch.tensor(srcs, dtype=torch.int32),
            torch.full((batch,), NULL_BLOCK_ID, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32))  # fmt: skip


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the defer step and the flush plan on the SM100 family under the deferred RecoverSSM
    (:func:`deferred_recoverssm`).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, invalid RecoverSSM or specialized-decode
        settings, or a missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None or not deferred_recoverssm(config, layout):
        return
    n = config.get("serving.max_num_seqs", int, plugin=PLUGIN)
    registry.add(DeferCommit(max_num_seqs=n), when=SM100_FAMILY)
    registry.add(FlushPlan(max_num_seqs=n, spec_query_len=1 + layout.num_speculative_tokens), when=SM100_FAMILY)
