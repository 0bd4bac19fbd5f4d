"""The DSpark draft attention's balanced tables (tier plan, row copies): equality with the PyTorch references under
Triton's interpreter, hand-picked cases, errors, the plan and cross-compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import draft_fold
from warmreg_kimi_k3.draft_fold import RowCopy, TierPlan, draft_fold_rows, row_copy_reference, tier_plan_reference
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)



def _specialized(**serving: Any) -> dict[str, Any]:
    config = example_config("kimi_k3")
    config["model"]["text_config"]["vocab_size"] = 163840
    settings = {"decode_backend": "latency_specialized", "speculative_method": "dspark",
                "decode_context_parallel_size": 8}  # fmt: skip
    settings.update(serving)
    config["serving"].update(settings)
    return config


def test_plan_of_hand_picked_rows() -> None:
    """Rows 1 and 3 tie at the longest: the lower row ranks first; of the 3 tier rows only those longer than a
    pair's share (sum 1000 over 4 pairs: 250) move; the third tier row stays (length 0, dst = N)."""
    lens = torch.tensor([100, 300, 200, 300, 100], dtype=torch.int32)
    tot = lens * 2
    dst, rest, tier_sl, tier_tot = TierPlan(rows=[5])(lens, tot, split_rows=3, pairs=4)
    assert dst.tolist() == [1, 3, 5] and rest.tolist() == [100, 0, 200, 0, 100]
    assert tier_sl.tolist() == [300, 300, 0] and tier_tot.tolist() == [600, 600, 400]


@pytest.mark.parametrize(("rows", "split_rows", "pairs"), [(40, 12, 74), (70, 28, 76), (1, 1, 1)])
def test_plan_matches_reference(rows: int, split_rows: int, pairs: int) -> None:
    g = torch.Generator().manual_seed(rows)
    lens = torch.randint(1, 4000, (rows,), generator=g, dtype=torch.int32)
    lens[: rows // 5] *= 100
    tot = lens + 7
    got = TierPlan(rows=[rows])(lens, tot, split_rows=split_rows, pairs=pairs)
    for a, b in zip(got, tier_plan_reference(lens, tot, split_rows, pairs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gather", [True, False])
def test_row_copy_matches_reference(gather: bool) -> None:
    """bf16 rows of 8192 words (two blocks), rows skipped by the bound; an offset view of the destination."""
    g = torch.Generator().manual_seed(3)
    target = torch.tensor([3, 9, 0, 8], dtype=torch.int32)
    src = torch.randn(9 if gather else 4, 1, 32, 512, generator=g).to(torch.bfloat16)
    dst = torch.randn(1 + (4 if gather else 9), 1, 32, 512, generator=g).to(torch.bfloat16)[1:]
    want = row_copy_reference(src, dst, target, 9, gather)
    assert RowCopy()(src, dst, target, 9, gather) is dst and torch.equal(dst, want)


def test_errors() -> None:
    lens = torch.ones(4, dtype=torch.int32)
    with pytest.raises(warmreg.LaunchError, match="split_rows"):
        TierPlan(rows=[4])(lens, lens, split_rows=5, pairs=2)
    with pytest.raises(warmreg.LaunchError, match="totals"):
        TierPlan(rows=[4])(lens, lens.long(), split_rows=1, pairs=2)
    with pytest.raises(warmreg.LaunchError, match="dst"):
        RowCopy()(torch.zeros(2, 8), torch.zeros(2, 4), lens[:2], 2, True)
    with pytest.raises(warmreg.LaunchError, match="target"):
        RowCopy()(torch.zeros(2, 8), torch.zeros(2, 8), lens[:2].long(), 2, True)


def test_rows_and_plan() -> None:
    """k = 3 at 96 draft heads: no fold past 128 heads, 3 rows a request; tiers from 38 rows (148 SMs)."""
    assert draft_fold_rows(3, 96, 256) == range(38, 769) and draft_fold_rows(4, 64, 8) == range(38, 17)
    kps = {kp.name: kp for kp in warmreg.plan(_specialized(), target="cuda:100").kernels}
    plan, copy = kps[TierPlan.name], kps[RowCopy.name]
    assert sorted(key.block for key in plan.keys) == [64, 128, 256, 512, 1024]
    assert sorted(key.gather for key in copy.keys) == [False, True]
    assert_warmup_inputs_reproduce(plan.kernel, plan.keys)
    assert_warmup_inputs_reproduce(copy.kernel, copy.keys)
    for config, target in ((_specialized(), "cuda:90"), (_specialized(decode_context_parallel_size=1), "cuda:100"),
                           (_specialized(max_num_seqs=4), "cuda:100")):  # fmt: skip
        assert TierPlan.name not in {kp.name for kp in warmreg.plan(config, target=target).kernels}


def test_cross_compile() -> None:
    plugin = RegisterPlugin(draft_fold.register, model=KimiK3.from_config)
    report = warmreg.warm(_specialized(max_num_seqs=16), target="cuda:100", plugins=[plugin], entry_points=False,
                          workers=1)  # fmt: skip
    assert report.ok and {r.kernel for r in report.results} == {TierPlan.name, RowCopy.name}, report.failed
