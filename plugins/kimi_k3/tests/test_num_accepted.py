"""The model runner's accepted-count stores: exact equality with the PyTorch references under Triton's interpreter,
the math on hand-picked rows, the plan and cross-compiling."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from warmreg_kimi_k3 import num_accepted
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.num_accepted import (
    FillNumAccepted,
    ScatterNumAccepted,
    fill_num_accepted_reference,
    scatter_num_accepted_reference,
)

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME, FILL = ScatterNumAccepted.name, FillNumAccepted.name


def _rows(rows: int, slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's distinct request slots (a few -1 sentinels), its sampled counts (0 included) and the runner's
    counts, garbage to start with."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(slots, generator=g)[:rows].to(torch.int64)
    idx[torch.rand(rows, generator=g) < 0.2] = -1
    sampled = torch.randint(0, 5, (rows,), generator=g, dtype=torch.int32)
    return idx, sampled, torch.randint(100, 200, (slots,), generator=g, dtype=torch.int32)


def test_the_counts_of_hand_picked_rows() -> None:
    """A chunked prefill (0 sampled) stores 1, a skipped row (-1) and the slots no row names are untouched."""
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int64)
    accepted = torch.full((6,), 9, dtype=torch.int32)
    got = ScatterNumAccepted(max_num_seqs=4)(idx, torch.tensor([0, 3, 2, 4], dtype=torch.int32), accepted)
    assert got is accepted and accepted.tolist() == [2, 9, 4, 9, 1, 9]
    FillNumAccepted(max_num_seqs=4)(idx, accepted, 1)
    assert accepted.tolist() == [1, 9, 1, 9, 1, 9]


@pytest.mark.parametrize(("rows", "slots"), [(1, 1), (37, 64), (129, 300)])  # 129: two programs
def test_scatter_matches_reference(rows: int, slots: int) -> None:
    idx, sampled, accepted = _rows(rows, slots, seed=rows)
    want = scatter_num_accepted_reference(idx, sampled, accepted)
    assert torch.equal(ScatterNumAccepted(max_num_seqs=rows)(idx, sampled, accepted), want)


@pytest.mark.parametrize(("rows", "value"), [(5, 1), (130, 7)])
def test_fill_matches_reference(rows: int, value: int) -> None:
    idx, _, accepted = _rows(rows, 200, seed=value)
    want = fill_num_accepted_reference(idx, accepted, value)
    assert torch.equal(FillNumAccepted(max_num_seqs=rows)(idx, accepted, value), want)


def test_strided_and_int32_inputs_one_binary() -> None:
    """num_sampled a column of a wider tensor: the same key as a contiguous one; int32 indices another key."""
    kernel = ScatterNumAccepted(max_num_seqs=8)
    idx, sampled, accepted = _rows(6, 10, seed=3)
    strided = torch.stack([sampled, sampled + 1], dim=1)[:, 0]
    want = scatter_num_accepted_reference(idx, sampled, accepted)
    assert torch.equal(kernel(idx, strided, accepted.clone()), want)
    assert kernel.dispatch(idx_mapping=idx, num_sampled=strided, num_accepted_tokens=accepted) == kernel.dispatch(
        idx_mapping=idx, num_sampled=sampled, num_accepted_tokens=accepted
    )
    assert torch.equal(kernel(idx.int(), sampled, accepted.clone()), want)


def test_empty_batch_and_launch_errors() -> None:
    kernel, accepted = ScatterNumAccepted(max_num_seqs=4), torch.full((4,), 3, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int64)
    assert kernel(none, none.int(), accepted).tolist() == [3] * 4
    idx, sampled = torch.tensor([0, 1]), torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(warmreg.LaunchError, match="num_sampled"):
        kernel(idx, sampled[:1], accepted)
    with pytest.raises(warmreg.LaunchError, match="idx_mapping"):
        kernel(idx.float(), sampled, accepted)
    with pytest.raises(warmreg.LaunchError, match="num_accepted_tokens"):
        kernel(idx, sampled, torch.zeros(4, 2, dtype=torch.int32)[:, 0])
    with pytest.raises(warmreg.LaunchError, match="value"):
        FillNumAccepted(max_num_seqs=4)(idx, accepted, 0)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_key_on_every_platform(target: str) -> None:
    kps = {kp.name: kp for kp in warmreg.plan(EXAMPLES / "kimi_k3.json", target=target).kernels}
    (key,) = kps[NAME].keys
    assert key.fields() == {
        "index_dtype": "int64", "sampled_dtype": "int32", "accepted_dtype": "int32", "block_rows": 128, "num_warps": 1,
    }  # fmt: skip
    assert FILL not in kps  # pipeline parallelism only: not a warmreg setting
    assert_warmup_inputs_reproduce(kps[NAME].kernel, [key])
    assert_warmup_inputs_reproduce(FillNumAccepted(max_num_seqs=1), [attrs.evolve(key, sampled_dtype=None)])


def test_planned_without_kda_layers_too() -> None:
    """KimiK3ModelState is the runner state of every Kimi-K3 model, hybrid or not."""
    config = example_config("kimi_k3")
    config["model"]["text_config"]["linear_attn_config"]["kda_layers"] = []
    assert NAME in {kp.name for kp in warmreg.plan(config, target="cuda:90").kernels}


@pytest.mark.parametrize("requests", [1, 200, 256])
def test_runtime_shapes_are_planned(requests: int) -> None:
    """The runner's batch: int64 idx_mapping and int32 num_sampled of the step's requests, the persistent counts."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    key = kp.kernel.dispatch(
        idx_mapping=warmreg.meta((requests,), torch.int64),
        num_sampled=warmreg.meta((requests,), torch.int32),
        num_accepted_tokens=warmreg.meta((256,), torch.int32),
    )
    assert key in kp.keys


def _fill_too(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    registry.add(FillNumAccepted(max_num_seqs=4))  # what a pipeline-parallel deployment would add


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_both_cross_compile(target: str) -> None:
    plugin = RegisterPlugin(num_accepted.register, _fill_too, model=KimiK3.from_config)
    report = warmreg.warm(example_config("kimi_k3"), target=target, plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == {NAME, FILL}, [r.error for r in report.failed]
