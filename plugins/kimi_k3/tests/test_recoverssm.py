"""Kimi-K3's RecoverSSM ops (verify; commit plan, conv-state compaction, SSM fold): the PyTorch references under
Triton's interpreter, the math of a verify followed by a commit, errors, ``out=``, and the plan: what
``serving.use_replayssm`` plans on cuda:90 and cuda:100, and where nothing is planned."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import recoverssm_commit, recoverssm_plan, recoverssm_verify
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.recoverssm import LayerTable
from warmreg_kimi_k3.recoverssm_commit import (
    RecoverSSMCommitState,
    RecoverSSMCompactConv,
    commit_state_reference,
    compact_conv_state_reference,
)
from warmreg_kimi_k3.recoverssm_plan import RecoverSSMCommitPlan, recoverssm_commit_plan_reference
from warmreg_kimi_k3.recoverssm_verify import RecoverSSMVerify, recoverssm_verify_reference

import warmreg
from warmreg.contract.config import SERVING_FIELDS
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAMES = {RecoverSSMVerify.name, RecoverSSMCommitPlan.name, RecoverSSMCompactConv.name, RecoverSSMCommitState.name}


def _config(**serving: Any) -> warmreg.WarmConfig:
    """The Kimi-K3 example with ``serving``. ``use_replayssm`` is not yet one of the core's SERVING_FIELDS (the
    plugin reads it with a default), so until it is, it is set on the loaded config directly."""
    extra = {k: v for k, v in serving.items() if k not in SERVING_FIELDS}
    config = warmreg.WarmConfig.load(example_config("kimi_k3", **{k: v for k, v in serving.items() if k not in extra}))
    object.__setattr__(config, "serving", MappingProxyType({**config.serving, **extra}))
    return config


def _layout(heads: int = 2, d: int = 16, spec: int = 3, bound: float | None = -5.0) -> KDALayout:
    return KDALayout(num_heads=heads, head_dim=d, conv_width=4, lower_bound=bound, tensor_parallel_size=1,
                     num_speculative_tokens=spec, dtype="float32")  # fmt: skip


def _verify_inputs(lens: list[int], heads: int, d: int, s: int, seed: int) -> dict[str, Any]:
    g, n = torch.Generator().manual_seed(seed), len(lens)
    tokens = sum(lens)
    mixed = torch.randn(tokens, 3 * heads * d, generator=g)
    q, k, v = (x.reshape(tokens, heads, d).unsqueeze(0) for x in mixed.split(heads * d, dim=-1))
    beta = torch.randn(tokens, heads + 3, generator=g)[:, 1 : 1 + heads].unsqueeze(0)
    slots = torch.randperm(n + 2, generator=g)[:n].int() + 1
    return {
        "q": q, "k": k, "v": v, "raw_g": torch.randn(1, tokens, heads, d, generator=g), "raw_beta": beta,
        "A_log": torch.randn(heads, generator=g) * 0.5, "dt_bias": torch.randn(heads * d, generator=g),
        "checkpoint_state": torch.randn(n + 3, heads, d, d, generator=g),
        "correction": torch.zeros(n + 1, heads, s, d), "key_gate": torch.zeros(n + 1, heads, s, 2 * d),
        "query_start_loc": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "state_indices": slots,
    }  # fmt: skip


@pytest.mark.parametrize(("lens", "d", "bound"), [([4, 2, 4], 16, -5.0), ([3, 0, 1], 24, None)])
def test_verify_matches_reference(lens: list[int], d: int, bound: float | None) -> None:
    """fp32 activations: the kernel's one-tile sums and the reference's matmuls differ in summation order only."""
    t = _verify_inputs(lens, 2, d, 4, seed=d)
    t["state_indices"][1] = 0  # the null block: zeros out, no records
    ref = {k: v.clone() for k, v in t.items()}
    got = RecoverSSMVerify(layout=_layout(d=d, bound=bound), max_num_seqs=4)(**t, lower_bound=bound, spec_query_len=4)
    want = recoverssm_verify_reference(**ref, lower_bound=bound, spec_query_len=4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for name in ("correction", "key_gate"):
        torch.testing.assert_close(t[name], ref[name], atol=2e-5, rtol=2e-5)
    assert torch.equal(t["checkpoint_state"], ref["checkpoint_state"])  # the checkpoint is only read


def test_verify_then_commit_is_the_recurrence_of_the_accepted_tokens() -> None:
    """Committing ``c`` accepted tokens leaves in the final slot the state the verify reached after ``c`` tokens:
    the output of token ``c - 1`` read from the committed state equals the verify's output there."""
    heads, d, s = 2, 16, 4
    t = _verify_inputs([4, 4], heads, d, s, seed=5)
    lay = _layout(heads, d, s - 1)
    out = RecoverSSMVerify(layout=lay, max_num_seqs=2)(**t, lower_bound=-5.0, spec_query_len=s)
    plan = RecoverSSMCommitPlan(max_num_seqs=2, spec_query_len=s)(
        torch.tensor([3, 1], dtype=torch.int32), t["state_indices"], t["query_start_loc"], spec_query_len=s
    )
    assert plan[0].tolist() == [3, 1] and plan[1].tolist() == t["state_indices"].tolist()
    state = t["checkpoint_state"]
    RecoverSSMCommitState(layout=lay, max_num_seqs=2)(
        LayerTable.of([state]), LayerTable.of([t["correction"]]), LayerTable.of([t["key_gate"]]),
        t["A_log"].view(1, heads), t["dt_bias"].view(1, heads, d), t["state_indices"], plan, lower_bound=-5.0,
        align=False,
    )  # fmt: skip
    for b, (c, token) in enumerate(((3, 2), (1, 4))):
        slot = int(t["state_indices"][b])
        q = t["q"][0, token].float()
        q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d**-0.5)
        read = torch.einsum("hvk,hk->hv", state[slot], q)
        torch.testing.assert_close(read, out[0, token], atol=1e-4, rtol=1e-4, msg=f"request {b}, {c} tokens")


def _commit_case(align: bool) -> dict[str, Any]:
    g, heads, d, s, layers = torch.Generator().manual_seed(11), 2, 8, 4, 2
    return {
        "conv": [torch.randn(16, 12, 3 + s - 1, generator=g) for _ in range(layers)],
        "state": [torch.randn(16, heads, d, d, generator=g) for _ in range(layers)],
        "corr": [torch.randn(3, heads, s, d, generator=g) for _ in range(layers)],
        "kg": [torch.randn(3, heads, s, 2 * d, generator=g) for _ in range(layers)],
        "A_log": torch.randn(layers, heads, generator=g), "dt_bias": torch.randn(layers, heads, d, generator=g),
        "slots": torch.tensor([2, 0, 5], dtype=torch.int32), "qsl": torch.tensor([0, 4, 8, 11], dtype=torch.int32),
        "accepted": torch.tensor([4, 2, 3], dtype=torch.int32),
        "align": {"block_table": torch.tensor([[7, 8, 9], [1, 1, 1], [10, 11, 12]], dtype=torch.int32),
                  "num_computed_tokens": torch.tensor([6, 0, 9], dtype=torch.int32), "mamba_block_size": 8}
        if align else {},
    }  # fmt: skip


@pytest.mark.parametrize("align", [False, True])
def test_plan_and_commit_match_references(align: bool) -> None:
    """The plan exactly; the conv compaction exactly (copies); the SSM fold to fp32 rounding (the kernel folds the
    tokens newest first, the reference runs the recurrence oldest first)."""
    c = _commit_case(align)
    kernel_plan = RecoverSSMCommitPlan(max_num_seqs=3, spec_query_len=4)
    plan = kernel_plan(c["accepted"], c["slots"], c["qsl"], spec_query_len=4, **c["align"])
    want = recoverssm_commit_plan_reference(c["accepted"], c["slots"], c["qsl"], spec_query_len=4, **c["align"])
    for got, ref in zip(plan, want):
        assert torch.equal(got, ref)
    if align:  # request 0: 6 computed + 4 accepted crosses 8: final column 1, boundary column 0 after 2 tokens
        assert [int(p[0]) for p in plan] == [4, 8, 7, 2] and plan[2][2] == 0
    convs, ref_convs = c["conv"], [x.clone() for x in c["conv"]]
    RecoverSSMCompactConv(layout=_layout(d=2), max_num_seqs=3)(
        LayerTable.of(convs),
        c["slots"], plan, conv_history_len=3, align=align,
    )  # fmt: skip
    compact_conv_state_reference(ref_convs, c["slots"], plan, conv_history_len=3, align=align)
    for got, ref in zip(convs, ref_convs):
        assert torch.equal(got, ref)
    states, ref_states = c["state"], [x.clone() for x in c["state"]]
    RecoverSSMCommitState(layout=_layout(d=8), max_num_seqs=3)(
        LayerTable.of(states), LayerTable.of(c["corr"]), LayerTable.of(c["kg"]), c["A_log"], c["dt_bias"],
        c["slots"], plan, lower_bound=None, align=align,
    )  # fmt: skip
    commit_state_reference(ref_states, c["corr"], c["kg"], c["A_log"], c["dt_bias"], c["slots"], plan,
                           lower_bound=None, align=align)  # fmt: skip
    for got, ref in zip(states, ref_states):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_launch_errors() -> None:
    t = _verify_inputs([2, 2], 2, 16, 4, seed=1)
    verify = RecoverSSMVerify(layout=_layout(), max_num_seqs=2)
    with pytest.raises(warmreg.LaunchError, match="spec_query_len"):
        verify(**t, lower_bound=-5.0, spec_query_len=1)
    with pytest.raises(warmreg.LaunchError, match="correction"):
        verify(**{**t, "correction": t["correction"][:, :, :2]}, lower_bound=-5.0, spec_query_len=4)
    with pytest.raises(warmreg.LaunchError, match="q, k, v, raw_g"):
        verify(**{**t, "q": t["q"].transpose(2, 3).contiguous().transpose(2, 3)}, lower_bound=-5.0, spec_query_len=4)
    plan = RecoverSSMCommitPlan(max_num_seqs=2, spec_query_len=4)
    with pytest.raises(warmreg.LaunchError, match="all or none"):
        plan(t["state_indices"], t["state_indices"], t["query_start_loc"], spec_query_len=4, mamba_block_size=8)
    with pytest.raises(warmreg.LaunchError, match="plan"):
        RecoverSSMCompactConv(layout=_layout(), max_num_seqs=2)(
            LayerTable.of([torch.zeros(3, 4, 6)]), t["state_indices"], (t["state_indices"],) * 3,
            conv_history_len=3, align=False,
        )  # fmt: skip


def test_out_conformance() -> None:
    t = _verify_inputs([3, 4], 2, 16, 4, seed=2)
    check_out(lambda: OpCall(RecoverSSMVerify(layout=_layout(), max_num_seqs=2), (),
                             {**{k: v.clone() for k, v in t.items()}, "lower_bound": -5.0, "spec_query_len": 4}))  # fmt: skip
    accepted = torch.tensor([2, 9], dtype=torch.int32)
    check_out(lambda: OpCall(RecoverSSMCommitPlan(max_num_seqs=2, spec_query_len=4),
                             (accepted, t["state_indices"], t["query_start_loc"]), {"spec_query_len": 4}))  # fmt: skip


# -- the plan -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_use_replayssm_plans_five_keys(target: str) -> None:
    """Kimi-K3 (96 heads over TP 8: 12 a rank, head dim 128, 3 drafts, gate bound, bf16): one verify, two plans
    (request indices or not), one compaction, one fold; the same on SM100 (the CuTe commit needs a bf16 SSM state)."""
    kps = {kp.name: kp for kp in warmreg.plan(_config(use_replayssm=True), target=target).kernels}
    assert NAMES <= set(kps)
    (verify,) = kps[RecoverSSMVerify.name].keys
    assert (verify.dtype, verify.head_k, verify.block_v, verify.window, verify.bounded) == (
        "bfloat16",
        128,
        32,
        4,
        True,
    )
    plans = kps[RecoverSSMCommitPlan.name].keys
    assert sorted(str(k.request_dtype) for k in plans) == ["None", "int32"] and not any(k.align for k in plans)
    (conv,) = kps[RecoverSSMCompactConv.name].keys
    assert (conv.conv_dtype, conv.block_history, conv.align) == ("bfloat16", 4, False)
    (fold,) = kps[RecoverSSMCommitState.name].keys
    assert (fold.state_dtype, fold.key_gate_dtype, fold.num_heads, fold.block_v) == ("float32", "bfloat16", 12, 32)
    for name in NAMES:
        assert_warmup_inputs_reproduce(kps[name].kernel, kps[name].keys)


@pytest.mark.parametrize(("target", "serving"), [("cuda:90", {}), ("cuda:90", {"use_replayssm": False}),
                                                 ("rocm:gfx942", {"use_replayssm": True})])  # fmt: skip
def test_nothing_planned_without_recoverssm(target: str, serving: dict[str, Any]) -> None:
    kps = {kp.name for kp in warmreg.plan(_config(**serving), target=target).kernels}
    assert not kps & NAMES


def test_use_replayssm_without_drafts_is_refused() -> None:
    with pytest.raises(warmreg.ConfigError, match="use_replayssm"):
        warmreg.plan(_config(use_replayssm=True, num_speculative_tokens=0), target="cuda:90")


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_cross_compile(target: str) -> None:
    plugin = RegisterPlugin(recoverssm_verify.register, recoverssm_plan.register, recoverssm_commit.register,
                            model=KimiK3.from_config)  # fmt: skip
    report = warmreg.warm(_config(use_replayssm=True), target=target, plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == NAMES, [r.error for r in report.failed]
