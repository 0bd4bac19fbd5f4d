"""ROCm's C4 decode top-k as ragged cache slots (lens + cumsum + pack): the reference under Triton's interpreter,
hand-picked rows, strided views, errors, the plan per target, out=, and real cross-compiles for gfx942 and gfx950."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_decode_topk
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_decode_topk import (
    RocmPackTopkRagged,
    RocmTopkLens,
    global_topk_ragged_reference,
    rocm_global_topk_ragged,
)

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32


def test_slots_of_hand_picked_rows() -> None:
    """Page size 4: local 5 is page 1 offset 1; an invalid token has no entries; -1 tails are dropped."""
    topk = torch.tensor([[5, 0, -1, -1], [2, 3, 9, -1], [1, 1, 1, 1]], dtype=I32)
    table = torch.tensor([[10, 20, 30], [40, 50, 60]], dtype=I32)
    ragged, indptr, lens = rocm_global_topk_ragged(
        topk, torch.tensor([1, 0, 0], dtype=I32), table, 4, torch.tensor([True, True, False])
    )
    assert lens.tolist() == [2, 3, 0] and indptr.tolist() == [0, 2, 5, 5]
    assert ragged[:5].tolist() == [201, 160, 42, 43, 121]


@pytest.mark.parametrize(("tokens", "topk"), [(6, 512), (3, 1100), (5, 37)])
def test_matches_reference(tokens: int, topk: int) -> None:
    """Flash's top-k, a row wider than the 1024 count tile (9 pack tiles), a non-power-of-two width; a -1 inside a row
    (the pack takes the first ``lens`` columns, as vLLM's)."""
    g = torch.Generator().manual_seed(tokens + topk)
    indices = torch.randint(0, 64 * 7, (tokens, topk), generator=g, dtype=I32)
    indices[0, topk // 2 :] = -1
    indices[1, 3] = -1
    table = torch.randint(0, 1000, (4, 7), generator=g, dtype=I32)
    t2r = torch.randint(0, 4, (tokens,), generator=g, dtype=I32)
    valid = torch.rand(tokens, generator=g) > 0.2
    ragged, indptr, lens = rocm_global_topk_ragged(indices, t2r, table, 64, valid)
    want_ragged, want_indptr, want_lens = global_topk_ragged_reference(indices, t2r, table, 64, valid)
    assert torch.equal(lens, want_lens) and torch.equal(indptr, want_indptr)
    assert torch.equal(ragged[: int(indptr[-1])], want_ragged)


def test_buffer_prefix_and_table_rows() -> None:
    """vLLM's ``topk_indices_buffer[:T]`` and ``block_table[:num_decodes]`` views."""
    g = torch.Generator().manual_seed(1)
    buffer, table = (
        torch.randint(-1, 200, (9, 64), generator=g, dtype=I32),
        torch.randint(0, 99, (6, 16), generator=g, dtype=I32),
    )
    args = (buffer[:4], torch.tensor([0, 1, 2, 2], dtype=I32), table[:3], 64, torch.ones(4, dtype=torch.bool))
    ragged, indptr, _ = rocm_global_topk_ragged(*args)
    assert torch.equal(ragged[: int(indptr[-1])], global_topk_ragged_reference(*args)[0])


def test_launch_errors() -> None:
    topk = torch.zeros(3, 8, dtype=I32)
    with pytest.raises(warmreg.LaunchError, match="is_valid_token must be"):
        RocmTopkLens()(topk, torch.ones(3, dtype=I32))
    with pytest.raises(warmreg.LaunchError, match="topk_indices must be"):
        RocmTopkLens()(topk.t(), torch.ones(8, dtype=torch.bool))
    pack, indptr = RocmPackTopkRagged(), torch.zeros(4, dtype=I32)
    with pytest.raises(warmreg.LaunchError, match="block_size"):
        pack(topk, indptr, indptr[:3], torch.zeros(1, 4, dtype=I32), block_size=0, out=torch.empty(24, dtype=I32))
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        pack(topk, indptr, indptr[:3], torch.zeros(1, 4, dtype=I32), block_size=64, out=torch.empty(23, dtype=I32))


def _plan(target: str, **model: object) -> warmreg.Plan:
    config = example_config("deepseek_v4_flash")
    config["model"].update(model)
    plugin = RegisterPlugin(rocm_decode_topk.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950"])
def test_one_key_each_on_rocm(target: str) -> None:
    plan = _plan(target)
    assert [k.fields() for k in plan.kernel(RocmTopkLens.name).keys] == [{"tile": 1024, "num_warps": 4}]
    assert [k.fields() for k in plan.kernel(RocmPackTopkRagged.name).keys] == [{"tile": 128, "num_warps": 4}]
    for kernel in (RocmTopkLens(), RocmPackTopkRagged()):
        assert_warmup_inputs_reproduce(kernel, plan.kernel(kernel.name).keys)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_not_planned_off_rocm(target: str) -> None:
    assert not _plan(target).kernels


def test_not_planned_without_c4_layers() -> None:
    ratios = [0 if r == 4 else r for r in example_config("deepseek_v4_flash")["model"]["compress_ratios"]]
    assert not _plan("rocm:gfx942", compress_ratios=ratios).kernels


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_decode_topk.register, model=DSV4.from_config)
    for target in ("rocm:gfx942", "rocm:gfx950"):
        report = warmreg.warm(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        topk = torch.tensor([[3, -1, 4], [1, 5, 9]], dtype=I32)
        return OpCall(RocmTopkLens(), (topk, torch.tensor([True, False])), {})

    check_out(build)
