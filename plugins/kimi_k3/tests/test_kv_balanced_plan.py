"""The KV-balanced MLA plan: the split counts and work list on hand-picked batches, a brute-force reference of the
search, errors, the cores and keys planned per target, and cross-compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import kv_balanced_plan
from warmreg_kimi_k3.kv_balanced_plan import BalancedCore, KvBalancedPlan, kv_balanced_cores
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = KvBalancedPlan.name



def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("kimi_k3")
    config["serving"].update({"decode_backend": "latency_specialized", **serving})
    return config


def _plan(lens: list[int], core: BalancedCore) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.full((core.max_requests,), 77, dtype=torch.int32)
    work = torch.full((core.list_len,), 55, dtype=torch.int32)
    return KvBalancedPlan(heads=12, q=1, dcp=False)(torch.tensor(lens, dtype=torch.int32), counts, work, core=core)


def test_work_list_of_a_hand_picked_batch() -> None:
    """Two query tiles a request (192 heads): each request's entries split-major, both tiles of a split adjacent,
    requests in order, then -1; counts past the batch untouched."""
    core = BalancedCore.create(heads=192, q=1, max_requests=4, clusters=74, capacity=8)
    counts, work = _plan([128, 300 * 128], core)
    n0, n1 = counts[:2].tolist()
    assert n0 == 1 and 1 < n1 <= 8 and counts[2:].eq(77).all()
    want = [(t * 2 + 0) << 8 for t in range(2)]
    want += [((t * 2 + 1) << 8) | s for s in range(n1) for t in range(2)]
    assert work[: len(want)].tolist() == want and work[len(want) :].eq(-1).all()


def _reference_counts(lens: list[int], core: BalancedCore) -> list[int]:
    """The search in PyTorch fp32, operation for operation: per wave count a 20-step bisection of the chunk, the
    kernel's counts and chunk, the estimate, the first fastest wave count."""
    f32 = torch.float32
    tiles_i = torch.tensor([max(-(-n // 128), 1) for n in lens], dtype=torch.int32)
    tiles = tiles_i.to(f32)[None, :]
    waves = torch.arange(1, 9, dtype=torch.int32)
    budget = (waves * core.clusters).to(f32)
    low = torch.full((8,), float(max(core.min_tiles, 1)), dtype=f32)
    high = torch.maximum(torch.full((8,), float(tiles.max())), low)
    for _ in range(20):
        mid = 0.5 * (low + high)
        n = torch.clamp(torch.ceil(tiles / mid[:, None]), max=core.capacity)
        fits = n.sum(1) * core.q_tiles <= budget
        high, low = torch.where(fits, mid, high), torch.where(fits, low, mid)
    n = torch.clamp(torch.ceil(tiles / high[:, None]), min=1, max=core.capacity).to(torch.int32)
    per = torch.clamp(torch.div(tiles_i[None, :] + n - 1, n, rounding_mode="floor"), min=1)
    n = torch.div(tiles_i[None, :] + per - 1, per, rounding_mode="floor")
    used = n.sum(1) * core.q_tiles
    estimate = torch.div(used + core.clusters - 1, core.clusters, rounding_mode="floor") * (per.max(1).values + 6)
    estimate = torch.where(waves <= core.max_waves, estimate, 1 << 30)
    return n[int(torch.argmin(estimate))].tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_match_the_exact_search(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lens = (torch.randint(1, 2000, (20,), generator=g) * torch.randint(1, 60, (20,), generator=g)).tolist()
    core = BalancedCore.create(heads=12, q=5, max_requests=20, clusters=74, capacity=8)
    counts, work = _plan(lens, core)
    assert counts[:20].tolist() == _reference_counts(lens, core)
    assert int((work >= 0).sum()) == int(counts[:20].sum()) * core.q_tiles


def test_errors() -> None:
    core = BalancedCore.create(heads=12, q=1, max_requests=2, clusters=74, capacity=8)
    with pytest.raises(warmreg.LaunchError, match="at most 2"):
        _plan([1, 2, 3], core)
    with pytest.raises(warmreg.LaunchError, match="work"):
        KvBalancedPlan(heads=12, q=1, dcp=False)(torch.ones(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                                                 torch.zeros(3, dtype=torch.int32), core=core)  # fmt: skip


def test_cores() -> None:
    """TP8 (12 heads), k = 3: sm_100 runs tokenspeed at q = 1 (12 heads <= 64) and q = 4 (48 <= 64); sm_103 the
    balanced core at q = 1 from 8 rows (32 splits up to 12 requests, 8 past) and at q = 4 (64 / 32 / 8 splits)."""
    assert kv_balanced_cores(heads=12, q=4, dcp=False, sm=100) == []
    cores = kv_balanced_cores(heads=12, q=4, dcp=False, sm=103)
    assert [(c.q_tiles, c.capacity, c.max_requests, c.max_waves) for c in cores] == [
        (1, 8, 64, 8), (1, 32, 8, 8), (1, 8, 16, 8), (1, 32, 12, 8), (1, 64, 1, 8),
    ]  # fmt: skip
    dcp = kv_balanced_cores(heads=96, q=4, dcp=True, sm=100)  # DCP8: 3 tiles of 96 x 4 rows; 16 splits for one
    assert {(c.q_tiles, c.capacity) for c in dcp} == {(1, 8), (3, 16), (3, 8)}


def test_plan_per_target() -> None:
    assert NAME not in {kp.name for kp in warmreg.plan(_config(), target="cuda:100").kernels}  # M64 shapes
    assert NAME not in {kp.name for kp in warmreg.plan(_config(), target="cuda:90").kernels}
    assert NAME not in {kp.name for kp in warmreg.plan(_config(tensor_parallel_size=1), target="cuda:103").kernels}
    kp = warmreg.plan(_config(), target="cuda:103").kernel(NAME)
    assert sorted((k.block_b, k.block_r) for k in kp.keys) == [(16, 8), (16, 32), (16, 64), (64, 8)]
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    dcp = warmreg.plan(_config(decode_context_parallel_size=8), target="cuda:100").kernel(NAME)
    assert sorted((k.block_b, k.block_r) for k in dcp.keys) == [(16, 32), (16, 64), (64, 8)]  # q = 4: 3 tiles


def test_cross_compile() -> None:
    plugin = RegisterPlugin(kv_balanced_plan.register, model=KimiK3.from_config)
    report = warmreg.warm(_config(), target="cuda:103", plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == {NAME}, [r.error for r in report.failed]
