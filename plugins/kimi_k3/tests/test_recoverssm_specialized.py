"""Kimi-K3's deferred RecoverSSM (the specialized decode) and RecoverSSM's align postprocess: the verify with record
indices, the defer step, the flush plan and the postprocess against their PyTorch references under Triton's
interpreter, a deferred step's arithmetic, errors, ``out=``, and the plan: what the specialized decode with RecoverSSM
plans on cuda:100 / cuda:103 and what it leaves as before elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import recoverssm_align, recoverssm_commit, recoverssm_deferred, recoverssm_plan, recoverssm_verify
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.recoverssm_align import AlignPostprocess, align_postprocess_reference
from warmreg_kimi_k3.recoverssm_commit import RecoverSSMCommitState, RecoverSSMCompactConv
from warmreg_kimi_k3.recoverssm_deferred import DeferCommit, FlushPlan, defer_commit_reference, flush_plan_reference
from warmreg_kimi_k3.recoverssm_plan import RecoverSSMCommitPlan
from warmreg_kimi_k3.recoverssm_verify import RecoverSSMVerify, recoverssm_verify_reference

import warmreg
from warmreg.contract.space import enumerate_keys
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
DEFERRED = {DeferCommit.name, FlushPlan.name}


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _layout(heads: int = 2, d: int = 16, spec: int = 3) -> KDALayout:
    return KDALayout(num_heads=heads, head_dim=d, conv_width=4, lower_bound=-5.0, tensor_parallel_size=1,
                     num_speculative_tokens=spec, dtype="float32")  # fmt: skip


# -- the verify with record indices -------------------------------------------------------------------------------
def _verify_inputs(lens: list[int], heads: int, d: int, s: int, rows: int, seed: int) -> dict[str, Any]:
    """A step's inputs with records as ``allocate_records`` makes them: views one row into their allocation."""
    g, n, tokens = torch.Generator().manual_seed(seed), len(lens), sum(lens)
    mixed = torch.randn(tokens, 3 * heads * d, generator=g)
    q, k, v = (x.reshape(tokens, heads, d).unsqueeze(0) for x in mixed.split(heads * d, dim=-1))
    return {
        "q": q, "k": k, "v": v, "raw_g": torch.randn(1, tokens, heads, d, generator=g),
        "raw_beta": torch.randn(tokens, heads + 3, generator=g)[:, 1 : 1 + heads].unsqueeze(0),
        "A_log": torch.randn(heads, generator=g) * 0.5, "dt_bias": torch.randn(heads * d, generator=g),
        "checkpoint_state": torch.randn(n + 3, heads, d, d, generator=g),
        "correction": torch.full((1 + rows, heads, s, d), 3.0)[1:],
        "key_gate": torch.full((1 + rows, heads, s, 2 * d), 4.0)[1:],
        "query_start_loc": _i32(0, *torch.tensor(lens).cumsum(0).tolist()),
        "state_indices": torch.randperm(n + 2, generator=g)[:n].int() + 1,
    }  # fmt: skip


def _scratch(records: torch.Tensor) -> torch.Tensor:
    """The row before a record view (vLLM's scratch row -1)."""
    return records.as_strided(records.shape[1:], records.stride()[1:], records.storage_offset() - records.stride(0))


def test_verify_with_record_indices_matches_reference() -> None:
    """Records land in row ``record_indices[b]``, -1 in the scratch row before the views; the output is the stock
    verify's (records are all the indices change). fp32: the kernel's tile sums and the reference's matmuls differ in
    summation order only."""
    t = _verify_inputs([4, 2, 4, 3], 2, 16, 4, rows=6, seed=3)
    record_rows = _i32(5, -1, 0, 2, -1, -1)  # the builder's buffer: -1 past the step's rows
    ref, stock = ({k: v.clone() for k, v in t.items()} for _ in range(2))
    for name in ("correction", "key_gate"):  # clone() drops the scratch row: copy the whole allocation
        ref[name] = torch.cat([_scratch(t[name]).unsqueeze(0), t[name]])[1:]
    op = RecoverSSMVerify(layout=_layout(), max_num_seqs=6)
    got = op(**t, lower_bound=-5.0, spec_query_len=4, record_indices=record_rows[:4])
    want = recoverssm_verify_reference(**ref, lower_bound=-5.0, spec_query_len=4, record_indices=record_rows[:4])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for name in ("correction", "key_gate"):
        torch.testing.assert_close(t[name], ref[name], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(_scratch(t[name]), _scratch(ref[name]), atol=2e-5, rtol=2e-5)
    assert torch.equal(t["correction"][1], torch.full_like(t["correction"][1], 3.0))  # row 1 owned by no request
    assert torch.equal(got, op(**stock, lower_bound=-5.0, spec_query_len=4))  # same output without indices
    assert torch.equal(t["correction"][5, :, :4], stock["correction"][0, :, :4])  # request 0's records, row 5


def test_verify_key_and_errors() -> None:
    t = _verify_inputs([2, 2], 2, 16, 4, rows=2, seed=1)
    op = RecoverSSMVerify(layout=_layout(), max_num_seqs=2)
    keyed = {
        "q": t["q"],
        "v": t["v"],
        "A_log": t["A_log"],
        "checkpoint_state": t["checkpoint_state"],
        "key_gate": t["key_gate"],
        "state_indices": t["state_indices"],
        "spec_query_len": 4,
        "lower_bound": -5.0,
    }
    assert op.dispatch(**keyed, record_indices=_i32(1, 0)).record_index_dtype == "int32"
    assert op.dispatch(**keyed).record_index_dtype is None
    with pytest.raises(warmreg.LaunchError, match="record_indices must be int"):
        op(**t, lower_bound=-5.0, spec_query_len=4, record_indices=_i32(1))
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        op(**t, lower_bound=-5.0, spec_query_len=4, record_indices=_i32(1, 9, 0, 9)[::2])


# -- the defer step and the flush plan ----------------------------------------------------------------------------
@pytest.mark.parametrize("eager", [None, _i32(1, 0, 0, 1, 0)])
def test_defer_commit_matches_reference(eager: torch.Tensor | None) -> None:
    """Row 0 defers (or, eager, commits now), row 1 is on the null block, row 2 owns no record slot, row 3 and 4
    defer into slots 0 and 6; slots no row names keep their counts."""
    slots = torch.tensor([[3, 0], [0, 0], [5, 0], [7, 0], [2, 0]], dtype=torch.int32)[:, 0]  # a strided column
    lens, rows, pending = _i32(3, 2, 4, 1, 0, 9), _i32(4, 1, -1, 0, 6, -1), torch.arange(8, dtype=torch.int32) + 10
    want_lens, want_pending = lens.clone(), pending.clone()
    defer_commit_reference(slots, want_lens, rows, want_pending, eager=eager)
    DeferCommit(max_num_seqs=5)(slots, lens, rows, pending, eager=eager)
    assert torch.equal(lens, want_lens) and torch.equal(pending, want_pending)
    if eager is None:
        assert lens.tolist() == [0, 2, 4, 0, 0, 9] and pending.tolist() == [1, 11, 12, 13, 3, 15, 0, 17]
    else:
        assert lens.tolist() == [3, 2, 4, 1, 0, 9] and pending.tolist() == [0, 11, 12, 13, 0, 15, 0, 17]  # eager: 0


def test_flush_plan_matches_reference() -> None:
    """Pending counts clamped into ``[0, S]``; a row without a record slot or on the null block commits nothing;
    final is the row's own slot either way, boundary null, recovery 0."""
    slots, rows = _i32(3, 0, 5, 7, 2), _i32(4, 1, -1, 0, 2, -1)
    pending = _i32(9, 2, -3, 0, 2)
    got = FlushPlan(max_num_seqs=5, spec_query_len=4)(slots, rows, pending, spec_query_len=4)
    want = flush_plan_reference(slots, rows, pending, spec_query_len=4)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert got[0].tolist() == [2, 0, 0, 4, 0] and got[1].tolist() == slots.tolist()
    assert got[2].tolist() == [0] * 5 and got[3].tolist() == [0] * 5


def test_deferred_step_folds_what_the_commit_would() -> None:
    """A deferred commit then a flush: the flush's plan equals the commit plan the stock path folds (same lengths,
    final slots), so the compaction and fold that follow see what the stock commit's would."""
    slots, qsl, accepted = _i32(3, 0, 5), _i32(0, 4, 8, 11), _i32(4, 2, 3)
    plan = RecoverSSMCommitPlan(max_num_seqs=3, spec_query_len=4)(accepted, slots, qsl, spec_query_len=4)
    lens, rows, pending = plan[0].clone(), _i32(2, 0, 1), torch.zeros(3, dtype=torch.int32)
    DeferCommit(max_num_seqs=3)(slots, lens, rows, pending)
    assert lens.tolist() == [0, 0, 0]
    flushed = FlushPlan(max_num_seqs=3, spec_query_len=4)(slots, rows, pending, spec_query_len=4)
    assert flushed[0].tolist() == plan[0].tolist() and flushed[1][[0, 2]].tolist() == plan[1][[0, 2]].tolist()


def test_deferred_errors_and_out() -> None:
    slots, rows, pending = _i32(3, 1), _i32(0, 1), _i32(2, 1)
    with pytest.raises(warmreg.LaunchError, match="record_rows must be contiguous"):
        DeferCommit(max_num_seqs=2)(slots, _i32(1, 1), rows[:1], pending)
    with pytest.raises(warmreg.LaunchError, match="pending must be a 1-D integer"):
        FlushPlan(max_num_seqs=2, spec_query_len=4)(slots, rows, pending.float(), spec_query_len=4)
    with pytest.raises(warmreg.LaunchError, match="spec_query_len"):
        FlushPlan(max_num_seqs=2, spec_query_len=4)(slots, rows, pending, spec_query_len=0)
    check_out(lambda: OpCall(FlushPlan(max_num_seqs=2, spec_query_len=4), (slots, rows, pending),
                             {"spec_query_len": 4}))  # fmt: skip
    empty = torch.empty(0, dtype=torch.int32)
    assert all(t.numel() == 0 for t in FlushPlan(max_num_seqs=2, spec_query_len=4)(empty, empty, pending,
                                                                                   spec_query_len=4))  # fmt: skip


# -- the align postprocess ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_requests", [False, True])
def test_align_postprocess_matches_reference(with_requests: bool) -> None:
    """Columns ``min(max(m + n - 1, 0) // Bm, W - 1)``: the last sampled token's block, clamped to the table; a
    skipped row (-1) writes nothing."""
    idx = torch.tensor([4, -1, 0, 2, 6], dtype=torch.int64)
    sampled, computed = _i32(3, 2, 0, 4, 1), _i32(14, 5, 0, 60, 31)
    requests = _i32(0, 2, 3, 1) if with_requests else None
    b = 4
    state, accepted = torch.full((8,), 9, dtype=torch.int32), torch.full((8,), 5, dtype=torch.int32)
    ref_state, ref_accepted = state.clone(), accepted.clone()
    kw = {"num_spec_decodes": b, "mamba_block_size": 8, "block_table_width": 5, "request_indices": requests}
    AlignPostprocess(max_num_seqs=5)(idx, sampled, computed, state, accepted, **kw)
    align_postprocess_reference(idx, sampled, computed, ref_state, ref_accepted, **kw)
    assert torch.equal(state, ref_state) and torch.equal(accepted, ref_accepted)
    assert state[4] == 2 and state[0] == 0 and state[2] == 4 and accepted[[4, 0, 2]].tolist() == [1, 1, 1]
    assert state[6] == 9 and accepted[6] == 5  # row 4 is past the speculative requests
    with pytest.raises(warmreg.LaunchError, match="mamba_block_size"):
        AlignPostprocess(max_num_seqs=5)(idx, sampled, computed, state, accepted, **{**kw, "mamba_block_size": 0})
    with pytest.raises(warmreg.LaunchError, match="exceeds"):
        AlignPostprocess(max_num_seqs=5)(idx, sampled, computed, state, accepted, **{**kw, "num_spec_decodes": 6})


def test_align_postprocess_keys_reproduce() -> None:
    """Its domains give two keys (request indices or not) whose warmup inputs reproduce them."""
    op = AlignPostprocess(max_num_seqs=4)
    config = warmreg.WarmConfig.load(example_config("kimi_k3"))
    keys = enumerate_keys(op, op.domains(config, warmreg.Platform.parse("cuda:90")))
    assert sorted(str(k.request_dtype) for k in keys) == ["None", "int32"]
    assert_warmup_inputs_reproduce(op, keys)


# -- the plan -----------------------------------------------------------------------------------------------------
def _specialized(**serving: Any) -> warmreg.WarmConfig:
    config = example_config("kimi_k3")
    config["model"]["text_config"]["vocab_size"] = 163840
    config["serving"].update({"decode_backend": "latency_specialized", "speculative_method": "dspark",
                              "use_replayssm": True, **serving})  # fmt: skip
    return warmreg.WarmConfig.load(config)


def _plan(config: warmreg.WarmConfig, target: str) -> dict[str, warmreg.KernelPlan]:
    return {kp.name: kp for kp in warmreg.plan(config, target=target).kernels}


@pytest.mark.parametrize("target", ["cuda:100", "cuda:103"])
def test_deferred_plan_on_sm100(target: str) -> None:
    """vLLM 0.34 on SM10x (Kimi-K3: gate bound, head dim 128, fp32 state: ``fp32_deferred``): the verify with
    record indices only, the stock plan (commit), the defer step without an eager mask, the flush plan, the conv
    compaction (flush, not align); no Triton SSM fold (the CuTe FP32 commit folds every deferred step)."""
    kps = _plan(_specialized(), target)
    assert DEFERRED <= set(kps) and RecoverSSMCommitState.name not in kps
    assert {RecoverSSMCommitPlan.name, RecoverSSMCompactConv.name} <= set(kps)
    (verify,) = kps[RecoverSSMVerify.name].keys
    assert (verify.record_index_dtype, verify.window, verify.head_k) == ("int32", 4, 128)
    (defer,) = kps[DeferCommit.name].keys
    assert defer.eager_dtype is None and defer.pending_dtype == "int32"
    (flush,) = kps[FlushPlan.name].keys
    assert (flush.window, flush.num_warps) == (4, 1)
    assert AlignPostprocess.name not in kps
    for name in (*DEFERRED, RecoverSSMVerify.name):
        assert_warmup_inputs_reproduce(kps[name].kernel, kps[name].keys)


@pytest.mark.parametrize(
    ("target", "serving"),
    [
        ("cuda:90", {}),  # vLLM refuses the specialized decode off SM100: the stock plan stands
        ("cuda:120", {}),
        ("cuda:100", {"decode_backend": "auto"}),
        ("cuda:100", {"speculative_method": "mtp"}),  # the specialized decode refuses it; warmreg plans stock
    ],
)
def test_stock_recoverssm_elsewhere(target: str, serving: dict[str, Any]) -> None:
    kps = _plan(_specialized(**serving), target)
    assert not DEFERRED & set(kps) and RecoverSSMCommitState.name in kps
    (verify,) = kps[RecoverSSMVerify.name].keys
    assert verify.record_index_dtype is None


def test_softplus_gate_is_not_deferred() -> None:
    """``cutedsl/kda/commit.py: supported`` needs a gate bound: without one the context keeps the Triton backend."""
    config = example_config("kimi_k3")
    config["model"]["text_config"]["vocab_size"] = 163840
    config["model"]["text_config"]["linear_attn_config"].pop("gate_lower_bound", None)
    config["serving"].update({"decode_backend": "latency_specialized", "speculative_method": "dspark",
                              "use_replayssm": True})  # fmt: skip
    kps = _plan(warmreg.WarmConfig.load(config), "cuda:100")
    assert not DEFERRED & set(kps) and RecoverSSMCommitState.name in kps


def test_cross_compile_sm100() -> None:
    plugin = RegisterPlugin(recoverssm_verify.register, recoverssm_plan.register, recoverssm_commit.register,
                            recoverssm_deferred.register, recoverssm_align.register, model=KimiK3.from_config)  # fmt: skip
    report = warmreg.warm(_specialized(), target="cuda:100", plugins=[plugin], entry_points=False, workers=1)
    names = {RecoverSSMVerify.name, RecoverSSMCommitPlan.name, RecoverSSMCompactConv.name, *DEFERRED}
    assert report.ok and {r.kernel for r in report.results} == names, [r.error for r in report.failed]
