"""The RecoverSSM commit plan: per speculative request, how many verified tokens to fold into its state and which
slots to write (vLLM 0.34 ``models/kimi_k3/nvidia/ops/recoverssm.py``: ``KDARecoverSSMCommitContext.commit``,
``_prepare_commit_plan_kernel``).

Math, per speculative request ``b < B`` (its batch row ``r = request_indices[b]`` when the step mixed speculative
rows with others, else ``r = b``), with ``n = query_start_loc[b + 1] - query_start_loc[b]`` and ``S = 1 + spec``::

    c = min(clamp(num_accepted[r], 0, n), S)                            # tokens to commit
    final = state_indices[b];  boundary = null;  recovery = 0
    align mode (block table, num_computed, block size Bm; width W):
        m = num_computed[r];  final = block_table[r, min(max(m + c - 1, 0) // Bm, W - 1)]
        edge = (m // Bm + 1) * Bm;   recovery = edge - m
        boundary = block_table[r, edge // Bm - 1]  if m + c >= edge  else null
    valid = state_indices[b] > null  and  c > 0
    commit_lens[b] = c, final_state_indices[b] = final, boundary_state_indices[b] = boundary,
    boundary_recovery_lens[b] = recovery                  where valid;  else 0, null, null, 0

(integer division of non-negative values). Grid ``(B,)``, one warp, as vLLM launches it.

Where it runs: first of the three launches of the commit, once per KV-cache group of KDA layers after sampling
(``KimiK3KDAMetadata.commit_recoverssm_state``, called by the V2 runner's ``RecoverSSMState.commit_step`` with the
sampler's int32 ``num_sampled`` as ``num_accepted``); the state indices are the speculative rows' checkpoint slots
(int32), ``request_indices`` the int32 batch rows of the speculative requests in a mixed step (``None`` when every
row of the step is speculative), and the align inputs are given only under ``mamba_cache_mode`` ``"align"``.

Key: the input dtypes (``None`` for an absent input), ``S``, whether there are request indices, align mode and
one warp. Strides, the block size and the table width are runtime integers that are not specialized.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kda_layout
from .model import PLUGIN, KimiK3
from .recoverssm import NULL_BLOCK_ID, use_recoverssm

__all__ = ["RecoverSSMCommitPlan", "RecoverSSMCommitPlanKey", "recoverssm_commit_plan_reference", "register"]

_POINTERS = ["accepted_ptr", "req_ptr", "idx_ptr", "qsl_ptr", "bt_ptr", "computed_ptr", "lens_ptr", "final_ptr",
             "boundary_ptr", "recovery_ptr"]  # fmt: skip
_INTS = ["null_block_id", "block_size", "width", "s_accepted", "s_req", "s_idx", "s_qsl", "s_bt_row", "s_bt_col",
         "s_computed"]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _recoverssm_commit_plan_kernel(
    accepted_ptr, req_ptr, idx_ptr, qsl_ptr, bt_ptr, computed_ptr,  # inputs (req, bt, computed: may be stand-ins)
    lens_ptr, final_ptr, boundary_ptr, recovery_ptr,  # outputs [B], contiguous
    null_block_id, block_size, width,
    s_accepted, s_req, s_idx, s_qsl, s_bt_row, s_bt_col, s_computed,
    S: tl.constexpr,  # 1 + num_speculative_tokens: the most tokens a request commits
    HAS_REQ: tl.constexpr,  # speculative request b is batch row req[b], else row b
    ALIGN: tl.constexpr,  # prefix-caching align mode: final and boundary slots from the block table
):  # fmt: skip
    b = tl.program_id(0)
    src = tl.load(idx_ptr + b * s_idx).to(tl.int64)
    r = b
    if HAS_REQ:
        r = tl.load(req_ptr + b * s_req).to(tl.int64)
    accepted = tl.load(accepted_ptr + r * s_accepted).to(tl.int32)
    n = (tl.load(qsl_ptr + (b + 1) * s_qsl).to(tl.int64) - tl.load(qsl_ptr + b * s_qsl).to(tl.int64)).to(tl.int32)
    c = tl.minimum(tl.minimum(tl.maximum(accepted, 0), n), S)
    final = src
    boundary = null_block_id
    recovery = 0
    if ALIGN:
        m = tl.load(computed_ptr + r * s_computed).to(tl.int32)
        row = bt_ptr + r * s_bt_row
        final = tl.load(row + tl.minimum(tl.maximum(m + c - 1, 0) // block_size, width - 1) * s_bt_col).to(tl.int64)
        edge = (m // block_size + 1) * block_size
        recovery = edge - m
        boundary = tl.load(row + (edge // block_size - 1) * s_bt_col, mask=m + c >= edge, other=null_block_id)
        boundary = boundary.to(tl.int64)
    valid = (src > null_block_id) & (c > 0)
    tl.store(lens_ptr + b, tl.where(valid, c, 0))
    tl.store(final_ptr + b, tl.where(valid, final, null_block_id))
    tl.store(boundary_ptr + b, tl.where(valid, boundary, null_block_id))
    tl.store(recovery_ptr + b, tl.where(valid, recovery, 0))


@attrs.frozen(kw_only=True)
class RecoverSSMCommitPlanKey(warmreg.CompileKey):
    """What changes the binary of the commit plan: dtypes, the window and the two modes."""

    accepted_dtype: str
    request_dtype: str | None  # None: every row of the step is speculative
    index_dtype: str  # state_indices and query_start_loc
    block_table_dtype: str | None  # None outside align mode
    computed_dtype: str | None  # None outside align mode
    window: int  # S
    num_warps: int

    @property
    def align(self) -> bool:
        """Align mode (prefix caching): the block table is given."""
        return self.block_table_dtype is not None


def _name(t: torch.Tensor | None) -> str | None:
    return None if t is None else warmreg.dtype_name(t.dtype)


class RecoverSSMCommitPlan(warmreg.TritonKernel[RecoverSSMCommitPlanKey]):
    """The commit plan of the RecoverSSM commit (the module docstring has the math and vLLM's call site).

    :param max_num_seqs: requests in a step (domains only).
    :param spec_query_len: ``1 + num_speculative_tokens`` (domains only).
    """

    name = "kimi_k3.recoverssm_commit_plan"
    key_type = RecoverSSMCommitPlanKey
    jit = _recoverssm_commit_plan_kernel

    def __init__(self, *, max_num_seqs: int, spec_query_len: int) -> None:
        self.max_num_seqs, self.spec_query_len = max_num_seqs, spec_query_len

    def dispatch(
        self, *, num_accepted_tokens: torch.Tensor, state_indices: torch.Tensor, request_indices: torch.Tensor | None,
        block_table: torch.Tensor | None, num_computed_tokens: torch.Tensor | None, spec_query_len: int,
    ) -> RecoverSSMCommitPlanKey:  # fmt: skip
        return RecoverSSMCommitPlanKey(
            accepted_dtype=warmreg.dtype_name(num_accepted_tokens.dtype), request_dtype=_name(request_indices),
            index_dtype=warmreg.dtype_name(state_indices.dtype), block_table_dtype=_name(block_table),
            computed_dtype=_name(num_computed_tokens), window=spec_query_len, num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """A step of speculative rows alone (no request indices) or mixed with prefills (int32 request indices);
        never align mode (``mamba_cache_mode`` is not a warmreg setting)."""
        n = self.max_num_seqs
        return {
            "num_accepted_tokens": [warmreg.meta((n,), torch.int32)],
            "state_indices": [warmreg.meta((n, 1), torch.int32)[:, 0]],
            "request_indices": [None, warmreg.meta((n,), torch.int32)],
            "block_table": [None],
            "num_computed_tokens": [None],
            "spec_query_len": [self.spec_query_len],
        }

    def warmup_inputs(self, key: RecoverSSMCommitPlanKey) -> Mapping[str, Any]:
        def t(dtype: str | None, shape: tuple[int, ...] = (1,)) -> torch.Tensor | None:
            return None if dtype is None else warmreg.meta(shape, getattr(torch, dtype))

        return {
            "num_accepted_tokens": t(key.accepted_dtype), "state_indices": t(key.index_dtype),
            "request_indices": t(key.request_dtype), "block_table": t(key.block_table_dtype, (1, 1)),
            "num_computed_tokens": t(key.computed_dtype), "spec_query_len": key.window,
            "query_start_loc": t(key.index_dtype, (2,)), "mamba_block_size": key.window if key.align else None,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, num_accepted_tokens: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, *,
        spec_query_len: int, request_indices: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None, mamba_block_size: int | None = None,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RecoverSSMCommitPlanKey]:  # fmt: skip
        """The plan of the ``B`` speculative requests: int32 ``(commit_lens, final_state_indices,
        boundary_state_indices, boundary_recovery_lens)``, each ``[B]`` (``out``, or fresh tensors).

        :param num_accepted_tokens: int ``[rows]``: each batch row's accepted (sampled) tokens.
        :param state_indices: int ``[B]``: each speculative request's checkpoint slot, any stride.
        :param query_start_loc: int ``[B + 1]``: the speculative requests' token offsets.
        :param spec_query_len: ``S = 1 + num_speculative_tokens``.
        :param request_indices: int ``[>= B]``: the batch row of each speculative request, or None (row ``b``).
        :param block_table: int ``[rows, W]`` (align mode, with ``num_computed_tokens`` int ``[rows]`` and
            ``mamba_block_size >= S``), or None with both of them.
        :param out: four preallocated contiguous int32 ``[B]`` tensors.
        :raises warmreg.LaunchError: for inputs vLLM's ``commit`` refuses (it raises ``ValueError``), or an ``out``
            that is not four int32 ``[B]`` tensors.
        """
        self._check(num_accepted_tokens, state_indices, query_start_loc, spec_query_len, request_indices,
                    block_table, num_computed_tokens, mamba_block_size)  # fmt: skip
        batch, device = state_indices.shape[0], state_indices.device
        if out is not None and (not isinstance(out, tuple) or len(out) != 4):
            raise warmreg.LaunchError(
                self.name, "out must be a tuple of 4 tensors (commit_lens, final, boundary, recovery)"
            )
        outs = tuple(warmreg.output(self.name, f"out[{i}]", None if out is None else out[i], (batch,),
                                    torch.int32, device) for i in range(4))  # fmt: skip
        key = self.dispatch(num_accepted_tokens=num_accepted_tokens, state_indices=state_indices,
                            request_indices=request_indices, block_table=block_table,
                            num_computed_tokens=num_computed_tokens, spec_query_len=spec_query_len)  # fmt: skip
        bt_strides = (0, 0) if block_table is None else block_table.stride()
        kwargs = dict(
            accepted_ptr=num_accepted_tokens, req_ptr=state_indices if request_indices is None else request_indices,
            idx_ptr=state_indices, qsl_ptr=query_start_loc, bt_ptr=state_indices if block_table is None else block_table,
            computed_ptr=state_indices if num_computed_tokens is None else num_computed_tokens,
            lens_ptr=outs[0], final_ptr=outs[1], boundary_ptr=outs[2], recovery_ptr=outs[3],
            null_block_id=NULL_BLOCK_ID, block_size=mamba_block_size or 1,
            width=1 if block_table is None else block_table.shape[1],
            s_accepted=num_accepted_tokens.stride(0), s_req=0 if request_indices is None else request_indices.stride(0),
            s_idx=state_indices.stride(0), s_qsl=query_start_loc.stride(0), s_bt_row=bt_strides[0],
            s_bt_col=bt_strides[1], s_computed=0 if num_computed_tokens is None else num_computed_tokens.stride(0),
            S=key.window, HAS_REQ=key.request_dtype is not None, ALIGN=key.align,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (batch,) if batch else None, kwargs, outs)

    def _check(
        self, accepted: torch.Tensor, indices: torch.Tensor, qsl: torch.Tensor, window: int,
        requests: torch.Tensor | None, table: torch.Tensor | None, computed: torch.Tensor | None,
        block_size: int | None,
    ) -> None:  # fmt: skip
        given = [t for t in (accepted, indices, qsl, requests, table, computed) if t is not None]
        if any(t.dtype.is_floating_point or t.dtype == torch.bool for t in given):
            raise warmreg.LaunchError(self.name, "every index input must be an integer tensor")
        batch = indices.shape[0]
        if indices.ndim != 1 or accepted.ndim != 1 or qsl.shape != (batch + 1,):
            raise warmreg.LaunchError(self.name, f"state_indices [B], num_accepted_tokens [rows] and query_start_loc "
                                      f"[B + 1] (got {tuple(indices.shape)}, {tuple(accepted.shape)}, {tuple(qsl.shape)})")  # fmt: skip
        if requests is not None and (requests.ndim != 1 or requests.shape[0] < batch):
            raise warmreg.LaunchError(self.name, f"request_indices must be [>= {batch}] (got {tuple(requests.shape)})")
        if len({table is None, computed is None, block_size is None}) != 1:
            raise warmreg.LaunchError(self.name, "block_table, num_computed_tokens and mamba_block_size: all or none")
        if block_size is not None and (block_size < window or table is None or table.ndim != 2):
            raise warmreg.LaunchError(self.name, f"mamba_block_size ({block_size}) must cover spec_query_len "
                                      f"({window}) and block_table be 2-D")  # fmt: skip
        if window < 1:
            raise warmreg.LaunchError(self.name, f"spec_query_len must be >= 1 (got {window})")
        if any(t.device != indices.device for t in given):
            raise warmreg.LaunchError(self.name, f"inputs must all be on {indices.device}")


def recoverssm_commit_plan_reference(
    num_accepted_tokens: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor, *,
    spec_query_len: int, request_indices: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None, mamba_block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`RecoverSSMCommitPlan`: the four int32 ``[B]`` plan tensors."""
    rows = []
    bounds = query_start_loc.tolist()
    for b, src in enumerate(state_indices.tolist()):
        r = b if request_indices is None else int(request_indices[b])
        c = min(max(int(num_accepted_tokens[r]), 0), bounds[b + 1] - bounds[b], spec_query_len)
        final, boundary, recovery = src, NULL_BLOCK_ID, 0
        if block_table is not None and num_computed_tokens is not None and mamba_block_size is not None:
            m, bs, width = int(num_computed_tokens[r]), mamba_block_size, block_table.shape[1]
            final = int(block_table[r, min(max(m + c - 1, 0) // bs, width - 1)])
            edge = (m // bs + 1) * bs
            recovery = edge - m
            boundary = int(block_table[r, edge // bs - 1]) if m + c >= edge else NULL_BLOCK_ID
        valid = src > NULL_BLOCK_ID and c > 0
        rows.append((c, final, boundary, recovery) if valid else (0, NULL_BLOCK_ID, NULL_BLOCK_ID, 0))
    cols = list(zip(*rows)) if rows else [(), (), (), ()]
    lens, finals, bounds_, recs = (torch.tensor(col, dtype=torch.int32) for col in cols)
    return lens, finals, bounds_, recs


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the commit plan on CUDA under RecoverSSM (:func:`warmreg_kimi_k3.recoverssm.use_recoverssm`): vLLM
    launches it before either commit backend (Triton or CuTe).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, an invalid ``serving.use_replayssm`` or a
        missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None or not use_recoverssm(config, layout):
        return
    kernel = RecoverSSMCommitPlan(max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
                                  spec_query_len=1 + layout.num_speculative_tokens)  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
