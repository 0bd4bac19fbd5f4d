"""ROCm aiter MegaMoE's fused shared-expert routes: the reference under Triton's interpreter, hand-picked cases
(``-1`` routes, the last rank's slot), strided rows, an empty batch, errors, ``out=``, and the plan (only
``rocm:gfx950+aiter`` with every MegaMoE condition vLLM checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import rocm_mega_moe
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_mega_moe import RocmMegaMoeAppendShared, append_shared_expert_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, F32 = torch.int32, torch.float32
MEGA = {
    "moe_backend": "aiter_mega_moe",
    "enable_expert_parallel": True,
    "data_parallel_size": 8,
    "all2all_backend": "mori",
    "aiter_fusion_shared_experts": True,
    "tensor_parallel_size": 1,  # MegaMoE is data-parallel attention with expert-parallel MoE
}


def _routes(rows: int, topk: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts, (rows, topk), generator=g, dtype=I32)
    return torch.rand((rows, topk), generator=g, dtype=F32), ids


def test_moves_routes_past_earlier_shared_slots_and_appends_the_rank_slot() -> None:
    """R = 4 routed experts a rank: expert 9 (rank 2) moves past two shared slots; -1 stays; rank 1's slot is 9."""
    weights = torch.tensor([[0.5, 0.25], [0.125, 2.0]], dtype=F32)
    ids = torch.tensor([[0, 9], [-1, 3]], dtype=I32)
    out_w, out_ids = RocmMegaMoeAppendShared()(weights, ids, routed_per_rank=4, shared_expert_id=9)
    assert out_ids.tolist() == [[0, 11, 9], [-1, 3, 9]]
    assert out_w.tolist() == [[0.5, 0.25, 1.0], [0.125, 2.0, 1.0]]


@pytest.mark.parametrize(("rows", "topk", "experts", "ranks"), [(130, 6, 256, 8), (7, 8, 384, 3), (64, 6, 256, 1)])
def test_matches_reference(rows: int, topk: int, experts: int, ranks: int) -> None:
    """Several 64-token tiles with a masked tail, a non-power-of-two rank count, one rank (R = all experts)."""
    weights, ids = _routes(rows, topk, experts, rows + topk)
    per_rank = experts // ranks
    slot = (ranks - 1) * (per_rank + 1) + per_rank
    got = RocmMegaMoeAppendShared()(weights, ids, routed_per_rank=per_rank, shared_expert_id=slot)
    want = append_shared_expert_reference(weights, ids, routed_per_rank=per_rank, shared_expert_id=slot)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # copies and index math: exact


def test_strided_rows_and_empty_batch() -> None:
    weights, ids = _routes(9, 10, 256, 3)
    got = RocmMegaMoeAppendShared()(weights[1:, 2:8], ids[1:, 2:8], routed_per_rank=32, shared_expert_id=32)
    want = append_shared_expert_reference(weights[1:, 2:8], ids[1:, 2:8], routed_per_rank=32, shared_expert_id=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = RocmMegaMoeAppendShared()(weights[:0, :6], ids[:0, :6], routed_per_rank=32, shared_expert_id=32)
    assert empty[0].shape == (0, 7) and empty[1].shape == (0, 7)


def test_launch_errors() -> None:
    weights, ids = _routes(2, 6, 256, 1)
    op = RocmMegaMoeAppendShared()
    with pytest.raises(warmreg.LaunchError, match="topk_ids must be"):
        op(weights, ids.long(), routed_per_rank=32, shared_expert_id=32)
    with pytest.raises(warmreg.LaunchError, match="topk_weights must be"):
        op(weights.bfloat16(), ids, routed_per_rank=32, shared_expert_id=32)
    with pytest.raises(warmreg.LaunchError, match="topk_weights must be"):
        op(weights[:, :5], ids, routed_per_rank=32, shared_expert_id=32)
    with pytest.raises(warmreg.LaunchError, match="routed_per_rank must be"):
        op(weights, ids, routed_per_rank=0, shared_expert_id=32)


def test_out() -> None:
    def build() -> OpCall:
        weights, ids = _routes(5, 6, 256, 7)
        return OpCall(RocmMegaMoeAppendShared(), (weights, ids), {"routed_per_rank": 32, "shared_expert_id": 98})

    check_out(build)


def _plan(target: str, example: str = "deepseek_v4_flash", **serving: Any) -> warmreg.Plan:
    config = example_config(example)
    config["serving"].update(MEGA)
    config["serving"].update(serving)
    plugin = RegisterPlugin(rocm_mega_moe.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(("example", "ranks", "topk", "per_rank"), [("deepseek_v4_flash", 8, 6, 32),
                                                                   ("deepseek_v4_pro", 4, 6, 96)])  # fmt: skip
def test_planned_on_gfx950_with_aiter(example: str, ranks: int, topk: int, per_rank: int) -> None:
    config = example_config(example)["model"]
    assert (config["num_experts_per_tok"], config["n_routed_experts"] // ranks) == (topk, per_rank)
    keys = _plan("rocm:gfx950+aiter", example, data_parallel_size=ranks).kernel(RocmMegaMoeAppendShared.name).keys
    assert [k.fields() for k in keys] == [{"topk": topk, "routed_per_rank": per_rank, "block_m": 64, "num_warps": 4}]
    assert_warmup_inputs_reproduce(RocmMegaMoeAppendShared(), keys)


@pytest.mark.parametrize(
    ("target", "serving"),
    [
        ("rocm:gfx950", {}),
        ("rocm:gfx942+aiter", {}),
        ("cuda:100", {}),
        ("rocm:gfx950+aiter", {"moe_backend": "auto"}),
        ("rocm:gfx950+aiter", {"enable_expert_parallel": False}),
        ("rocm:gfx950+aiter", {"tensor_parallel_size": 2}),
        ("rocm:gfx950+aiter", {"all2all_backend": "allgather_reducescatter"}),
        ("rocm:gfx950+aiter", {"aiter_fusion_shared_experts": False}),
    ],
)
def test_not_planned_without_every_condition(target: str, serving: dict[str, Any]) -> None:
    """aiter MegaMoE is gfx950's with aiter, expert-parallel at TP 1 on MoRI; without the fusion no route is added."""
    assert not _plan(target, **serving).kernels


def test_not_planned_for_v41() -> None:
    """DeepSeek-V4.1's ROCm MoE never takes MegaMoE (``use_mega_moe = False``)."""
    assert not _plan("rocm:gfx950+aiter", "deepseek_v41").kernels


def test_ranks_must_divide_the_experts() -> None:
    with pytest.raises(warmreg.ConfigError, match="data_parallel_size"):
        _plan("rocm:gfx950+aiter", data_parallel_size=3)


def test_warm_cross_compiles_for_gfx950() -> None:
    config = example_config("deepseek_v4_flash")
    config["serving"].update(MEGA)
    plugin = RegisterPlugin(rocm_mega_moe.register, model=DSV4.from_config)
    report = warmreg.warm(config, target="rocm:gfx950+aiter", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
