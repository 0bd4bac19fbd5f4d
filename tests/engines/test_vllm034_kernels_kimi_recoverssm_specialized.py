"""Kimi-K3's deferred RecoverSSM (the specialized decode) and RecoverSSM's align postprocess against vLLM 0.34's own
kernels (issue 37), on identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_recoverssm_specialized.py``); skips, naming why, elsewhere.

- The verify as ``recoverssm/state.py: deferred_recoverssm_verify`` calls ``kernels.py: kda_recoverssm_verify``: head
  views of the conv output, the layer's SSM pool, records laid out as ``context.py: allocate_records`` makes them
  (views one row into their allocation) and ``record_indices = record_rows[:B]`` with -1 rows.
- The commit and the flush through ``KDADeferredCommitContext`` itself: built by its parent's ``create`` (backend
  ``triton``) from stand-in layers, then given the ``fp32_deferred`` backend that its own ``create`` sets where
  ``cutedsl/kda/commit.py: supported`` holds (a ``torch.cuda`` check: CUDA only). ``commit(..., record_rows, pending,
  eager=None)`` runs the stock plan and the defer step; ``flush`` runs the flush plan, the conv compaction and the
  CuTe FP32 fold, which is CUDA only and is replaced by a recorder (the only patch: no Triton kernel is touched).
- The align postprocess as ``RecoverSSMState.commit_step`` launches it.

warmreg's ops run on clones of the same seeded tensors; every output, record, plan buffer, pending count and conv
state is compared bitwise (integer plans and copies; the verify runs the same fp32 operations in the same order).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

from unittest import mock

import pytest
import torch

vllm_rssm = engine("vllm.models.kimi_k3.nvidia.ops.recoverssm")
vllm_spec = engine("vllm.models.kimi_k3.nvidia.specialized_decode.recoverssm.kernels")
vllm_ctx = engine("vllm.models.kimi_k3.nvidia.specialized_decode.recoverssm.context")
vllm_state = engine("vllm.v1.worker.gpu.model_states.recoverssm")
from warmreg_kimi_k3.backends import KDALayout  # noqa: E402
from warmreg_kimi_k3.recoverssm import LayerTable  # noqa: E402
from warmreg_kimi_k3.recoverssm_align import AlignPostprocess  # noqa: E402
from warmreg_kimi_k3.recoverssm_commit import RecoverSSMCompactConv  # noqa: E402
from warmreg_kimi_k3.recoverssm_deferred import DeferCommit, FlushPlan  # noqa: E402
from warmreg_kimi_k3.recoverssm_plan import RecoverSSMCommitPlan  # noqa: E402
from warmreg_kimi_k3.recoverssm_verify import RecoverSSMVerify  # noqa: E402

FP32_COMMIT = "vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.kda.commit"


def _layout(heads: int, d: int, spec: int, bound: float | None) -> KDALayout:
    return KDALayout(num_heads=heads, head_dim=d, conv_width=4, lower_bound=bound, tensor_parallel_size=1,
                     num_speculative_tokens=spec, dtype="bfloat16")  # fmt: skip


def _records(rows: int, heads: int, s: int, d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``allocate_records``' layout (``[1 + rows, ...]`` allocations viewed from row 1), filled with garbage."""
    corr = torch.randn(1 + rows, heads, s, d, generator=g)[1:]
    kg = torch.randn(1 + rows, heads, s, 2 * d, generator=g).to(dtype)[1:]
    return corr, kg


@pytest.mark.parametrize(("lens", "heads", "d", "spec", "bound"), [([4, 4, 2, 3], 2, 128, 3, -5.0),
                                                                   ([3, 1, 3], 3, 32, 2, None)])  # fmt: skip
def test_deferred_verify_equals_vllm(lens: list[int], heads: int, d: int, spec: int, bound: float | None) -> None:
    """``kda_recoverssm_verify(..., out=out, record_indices=deferred.record_rows[:B])``: the output, both records
    (the scratch row -1 included, through the allocation) and the unchanged pool, bitwise."""
    g, p, n, s = seeded(sum(lens) + d), heads * d, len(lens), 1 + spec
    tokens = sum(lens)
    corr, kg = _records(6, heads, s, d, torch.bfloat16, g)
    t = {
        "mixed": torch.randn(tokens, 3 * p, generator=g).to(torch.bfloat16),
        "g1": torch.randn(tokens, p, generator=g).to(torch.bfloat16),
        "packed": torch.randn(tokens, p + 16, generator=g).to(torch.bfloat16),
        "A_log": torch.randn(heads, generator=g).mul_(0.5), "dt_bias": torch.randn(p, generator=g),
        "state": torch.randn(n + 3, heads, d, d, generator=g), "corr_base": corr._base, "kg_base": kg._base,
        "qsl": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "slots": torch.tensor([[2], [0], [4], [1]][:n], dtype=torch.int32).repeat(1, 1),
        "rows": torch.tensor([5, 2, -1, 0, -1, -1], dtype=torch.int32),  # the builder's buffer
        "out": torch.full((1, tokens, heads, d), 5.0).to(torch.bfloat16),
    }  # fmt: skip
    theirs, ours = clones(**t), clones(**t)
    for side in (theirs, ours):
        m = side["mixed"]
        side["q"], side["k"], side["v"] = (x.view(tokens, heads, d).unsqueeze(0) for x in m.split(p, dim=-1))
        side["g"], side["beta"] = side["g1"].view(1, tokens, heads, d), side["packed"][:, 8 : 8 + heads].unsqueeze(0)
        side["corr"], side["kg"] = side["corr_base"][1:], side["kg_base"][1:]
    vllm_spec.kda_recoverssm_verify(
        q=theirs["q"], k=theirs["k"], v=theirs["v"], raw_g=theirs["g"], raw_beta=theirs["beta"], A_log=theirs["A_log"],
        dt_bias=theirs["dt_bias"], lower_bound=bound, checkpoint_state=theirs["state"],
        records=vllm_rssm.KDARecoverSSMRecords(theirs["corr"], theirs["kg"]), query_start_loc=theirs["qsl"],
        state_indices=theirs["slots"][:n, 0], spec_query_len=s, out=theirs["out"], record_indices=theirs["rows"][:n],
    )  # fmt: skip
    RecoverSSMVerify(layout=_layout(heads, d, spec, bound), max_num_seqs=6)(
        ours["q"], ours["k"], ours["v"], ours["g"], ours["beta"], ours["A_log"], ours["dt_bias"], ours["state"],
        ours["corr"], ours["kg"], ours["qsl"], ours["slots"][:n, 0], lower_bound=bound, spec_query_len=s,
        out=ours["out"], record_indices=ours["rows"][:n],
    )  # fmt: skip
    for name in ("out", "corr_base", "kg_base", "state"):
        assert_same(ours[name], theirs[name], name)


def _context_inputs(layers: int, heads: int, d: int, spec: int, seed: int) -> dict[str, Any]:
    g, p, s, pages = seeded(seed), heads * d, 1 + spec, 16
    out: dict[str, Any] = {}
    for i in range(layers):
        out[f"conv{i}"] = torch.randn(pages, 3 + spec + 1, 3 * p, generator=g).to(torch.bfloat16)[:, : 3 + spec]
        out[f"ssm{i}"] = torch.randn(pages, heads, d, d, generator=g)
        corr, kg = _records(6, heads, s, d, torch.bfloat16, g)
        out[f"corr{i}"], out[f"kg{i}"] = corr._base, kg._base
        out[f"A{i}"], out[f"dt{i}"] = torch.randn(heads, generator=g), torch.randn(p, generator=g)
    out["slots"] = torch.tensor([[3], [0], [5], [7], [2]], dtype=torch.int32)
    out["qsl"] = torch.tensor([0, s, 2 * s, 2 * s + 2, 3 * s + 2], dtype=torch.int32)
    out["accepted"] = torch.tensor([2, 3, 0, s + 4, 1, s], dtype=torch.int32)
    out["rows"] = torch.tensor([4, 1, -1, 0, -1, -1], dtype=torch.int32)
    out["pending"] = torch.arange(6, dtype=torch.int32) + 1
    return out


def _context(t: dict[str, Any], layers: int, heads: int, d: int, s: int) -> Any:
    """``KDADeferredCommitContext`` as its ``create`` leaves it where the CuTe FP32 commit is supported."""
    stand_ins = [
        SimpleNamespace(kv_cache=(t[f"conv{i}"], t[f"ssm{i}"]), A_log=t[f"A{i}"], dt_bias=t[f"dt{i}"],
                        recoverssm_records=vllm_rssm.KDARecoverSSMRecords(t[f"corr{i}"][1:], t[f"kg{i}"][1:]),
                        local_num_heads=heads, head_dim=d, gate_lower_bound=-5.0)
        for i in range(layers)
    ]  # fmt: skip
    create = vllm_rssm.KDARecoverSSMCommitContext.create.__func__
    context = create(vllm_ctx.KDADeferredCommitContext, stand_ins, spec_query_len=s, max_num_reqs=6, backend="triton")
    context.backend = vllm_ctx.FP32_DEFERRED
    return context


@pytest.mark.parametrize("mixed", [False, True])
def test_deferred_commit_and_flush_equal_vllm(mixed: bool) -> None:
    """``commit(num_accepted, state_indices, query_start_loc, request_indices, record_rows=, pending=, eager=None)``
    then ``flush(state_indices, record_rows[:B], pending)``: the plan buffers after each, the pending counts and
    every layer's conv state bitwise; the FP32 fold is asked for every layer with the flush plan (recorded)."""
    layers, heads, d, spec = 2, 2, 32, 3
    s, batch = 1 + spec, 4
    t = _context_inputs(layers, heads, d, spec, seed=7 + mixed)
    theirs, ours = clones(**t), clones(**t)
    rows = slice(None) if mixed else slice(0, batch)
    requests = torch.tensor([5, 0, 2, 4], dtype=torch.int32) if mixed else None
    context = _context(theirs, layers, heads, d, s)
    context.commit(theirs["accepted"][rows], theirs["slots"][:batch, 0], theirs["qsl"], request_indices=requests,
                   record_rows=theirs["rows"], pending=theirs["pending"], eager=None)  # fmt: skip
    plan = RecoverSSMCommitPlan(max_num_seqs=6, spec_query_len=s)(
        ours["accepted"][rows], ours["slots"][:batch, 0], ours["qsl"], spec_query_len=s, request_indices=requests
    )
    DeferCommit(max_num_seqs=6)(ours["slots"][:batch, 0], plan[0], ours["rows"], ours["pending"])
    assert_same(plan[0], context.commit_lens[:batch], "commit_lens after the defer")
    assert_same(ours["pending"], theirs["pending"], "pending after the defer")
    assert bool(ours["pending"].ne(t["pending"]).any()), "the defer must move some commit length"

    folds: list[Any] = []
    fp32 = SimpleNamespace(commit_f32=lambda ctx, idx, b, align, record_rows=None: folds.append((b, align)),
                           use_commit_f32=lambda *a: True)  # fmt: skip
    with mock.patch.dict(sys.modules, {FP32_COMMIT: fp32}):
        context.flush(theirs["slots"][:batch, 0], theirs["rows"][:batch], theirs["pending"])
    flushed = FlushPlan(max_num_seqs=6, spec_query_len=s)(ours["slots"][:batch, 0], ours["rows"][:batch],
                                                          ours["pending"], spec_query_len=s)  # fmt: skip
    conv = LayerTable.of([ours[f"conv{i}"].transpose(-1, -2) for i in range(layers)])
    RecoverSSMCompactConv(layout=_layout(heads, d, spec, -5.0), max_num_seqs=6)(
        conv, ours["slots"][:batch, 0], flushed, conv_history_len=3, align=False
    )
    want = (context.commit_lens, context.final_state_indices, context.boundary_state_indices,
            context.boundary_recovery_lens)  # fmt: skip
    for name, mine, engine_buf in zip(("commit_lens", "final", "boundary", "recovery"), flushed, want):
        assert_same(mine, engine_buf[:batch], f"flush {name}")
    assert folds == [(batch, False)]
    assert int(flushed[0].gt(0).sum()) >= 1, "the flush must replay tokens somewhere"
    for i in range(layers):
        assert_same(ours[f"conv{i}"], theirs[f"conv{i}"], f"conv state of layer {i}")


def test_defer_with_eager_rows_equals_vllm() -> None:
    """Align mode's eager rows (``_build_deferred``: ``eager`` int32 ``[B]``) through vLLM's kernel launched as
    ``commit`` launches it (its ``_fold`` afterwards needs the CuTe commit, CUDA only)."""
    slots = torch.tensor([[3], [0], [5], [7], [2]], dtype=torch.int32)[:, 0]
    t = {"lens": torch.tensor([3, 2, 4, 1, 2], dtype=torch.int32), "rows": torch.tensor([4, 1, -1, 0, 2], dtype=torch.int32),
         "pending": torch.arange(6, dtype=torch.int32) + 10, "eager": torch.tensor([1, 0, 0, 1, 0], dtype=torch.int32)}  # fmt: skip
    theirs, ours = clones(**t), clones(**t)
    vllm_spec._defer_commit_kernel[(5,)](slots, theirs["lens"], theirs["rows"], theirs["pending"], theirs["eager"],
                                         0, slots.stride(0), num_warps=1)  # fmt: skip
    DeferCommit(max_num_seqs=5)(slots, ours["lens"], ours["rows"], ours["pending"], eager=ours["eager"])
    for name in ("lens", "pending"):
        assert_same(ours[name], theirs[name], name)


@pytest.mark.parametrize("with_requests", [False, True])
def test_align_postprocess_equals_vllm(with_requests: bool) -> None:
    """``_postprocess_recoverssm_align_kernel[(B,)](idx_mapping, num_sampled, request_indices, num_computed_tokens,
    state_indices, num_accepted_tokens, MAMBA_BLOCK_SIZE=, BLOCK_TABLE_WIDTH=)`` as ``commit_step`` launches it."""
    t = {"idx": torch.tensor([4, -1, 0, 2, 6, 1], dtype=torch.int64),
         "sampled": torch.tensor([3, 2, 0, 4, 1, 2], dtype=torch.int32),
         "computed": torch.tensor([14, 5, 0, 60, 31, 7], dtype=torch.int32),
         "state": torch.full((8,), 9, dtype=torch.int32), "accepted": torch.full((8,), 5, dtype=torch.int32)}  # fmt: skip
    requests = torch.tensor([0, 2, 3, 5], dtype=torch.int32) if with_requests else None
    theirs, ours = clones(**t), clones(**t)
    vllm_state._postprocess_recoverssm_align_kernel[(4,)](
        theirs["idx"], theirs["sampled"], requests, theirs["computed"], theirs["state"], theirs["accepted"],
        MAMBA_BLOCK_SIZE=8, BLOCK_TABLE_WIDTH=5,
    )  # fmt: skip
    AlignPostprocess(max_num_seqs=6)(ours["idx"], ours["sampled"], ours["computed"], ours["state"], ours["accepted"],
                                     num_spec_decodes=4, mamba_block_size=8, block_table_width=5,
                                     request_indices=requests)  # fmt: skip
    for name in ("state", "accepted"):
        assert_same(ours[name], theirs[name], name)
    assert bool(ours["state"].ne(9).any())
