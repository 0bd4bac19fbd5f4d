"""ROCm's dense-to-ragged compaction (count + cumsum + compact): the reference under Triton's interpreter, hand-picked
rows, strided views, errors, the plan per ROCm target, out=, and real cross-compiles for gfx942 and gfx950."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_ragged
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_ragged import (
    RocmRaggedCompact,
    RocmRaggedCount,
    ragged_from_dense_reference,
    rocm_ragged_from_dense,
)

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32


def _written(flat: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    return flat[: int(indptr[-1])]


def test_keeps_live_non_negative_entries_in_order() -> None:
    """Row 0 keeps its first 3 live entries but the -1; row 1 has length 0; row 2 drops entries at or past the bound."""
    indices = torch.tensor([[5, -1, 7, 9, 11], [1, 2, 3, 4, 5], [0, 40, 39, -1, 2]], dtype=I32)
    lengths = torch.tensor([4, 0, 5], dtype=I32)
    flat, indptr = rocm_ragged_from_dense(indices, lengths, num_rows=40)
    assert indptr.tolist() == [0, 3, 3, 6]
    assert _written(flat, indptr).tolist() == [5, 7, 9, 0, 39, 2]
    flat, indptr = rocm_ragged_from_dense(indices, lengths)  # no bound: 40 is kept
    assert _written(flat, indptr).tolist() == [5, 7, 9, 0, 40, 39, 2]


@pytest.mark.parametrize(("rows", "width", "bound"), [(9, 128, -1), (5, 37, 30), (3, 1500, 1000), (70, 8, 5)])
def test_matches_reference(rows: int, width: int, bound: int) -> None:
    """The decode SWA width, a non-power-of-two, a row wider than the 1024 tile (the loop), many narrow rows (a count
    program covers 128 of them)."""
    g = torch.Generator().manual_seed(rows * width)
    indices = torch.randint(-3, 2 * width, (rows, width), generator=g, dtype=I32)
    lengths = torch.randint(0, width + 5, (rows,), generator=g, dtype=I32)
    flat, indptr = rocm_ragged_from_dense(indices, lengths, bound)
    want_flat, want_indptr = ragged_from_dense_reference(indices, lengths, bound)
    assert flat.shape == (rows * width,)
    assert torch.equal(indptr, want_indptr) and torch.equal(_written(flat, indptr), want_flat)


def test_strided_rows_and_empty_batches() -> None:
    """C128's decode rows are a column slice of a wider buffer (row stride > width): one binary, same result."""
    buffer = torch.randint(-2, 300, (6, 512), generator=torch.Generator().manual_seed(3), dtype=I32)
    view, lengths = buffer[:4, :256], torch.tensor([256, 10, 0, 200], dtype=I32)
    flat, indptr = rocm_ragged_from_dense(view, lengths)
    want_flat, want_indptr = ragged_from_dense_reference(view.contiguous(), lengths)
    assert torch.equal(indptr, want_indptr) and torch.equal(_written(flat, indptr), want_flat)
    flat, indptr = rocm_ragged_from_dense(torch.empty(0, 128, dtype=I32), torch.empty(0, dtype=I32))
    assert flat.numel() == 0 and indptr.tolist() == [0]


def test_launch_errors() -> None:
    count, indices, lengths, indptr = (
        RocmRaggedCount(),
        torch.zeros(3, 8, dtype=I32),
        torch.zeros(3, dtype=I32),
        torch.zeros(4, dtype=I32),
    )
    with pytest.raises(warmreg.LaunchError, match="indices must be int32"):
        count(indices.long(), lengths, indptr)
    with pytest.raises(warmreg.LaunchError, match="lengths must be"):
        count(indices, lengths[:2], indptr)
    with pytest.raises(warmreg.LaunchError, match="indptr must be"):
        count(indices, lengths, indptr[:3])
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        RocmRaggedCompact()(indices, lengths, indptr, out=torch.zeros(23, dtype=I32))


# -- the plan ---------------------------------------------------------------------------------------------------
def _plan(target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_ragged.register, model=DSV4.from_config)
    return warmreg.plan(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "rocm:gfx950+aiter+aiter_sparse_mla"])
def test_planned_on_every_rocm_target(target: str) -> None:
    """Flash (window 128, top-k 512, C128 widths 128..8192): tiles 128, 256, 512 and 1024 either way."""
    plan = _plan(target)
    assert {k.block_w for k in plan.kernel(RocmRaggedCompact.name).keys} == {128, 256, 512, 1024}
    assert {(k.block_r, k.block_w) for k in plan.kernel(RocmRaggedCount.name).keys} == {
        (8, 128),
        (4, 256),
        (2, 512),
        (1, 1024),
    }


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "xpu:pvc"])
def test_not_planned_off_rocm(target: str) -> None:
    assert not _plan(target).kernels


def test_widths_of_each_prefill_path() -> None:
    """The in-tree prefill compacts combined rows (round_up(k + 128, 128)); aiter's the SWA and top-k rows."""
    config = warmreg.WarmConfig.load(example_config("deepseek_v4_flash"))
    model = DSV4.from_config(config)
    triton_path = rocm_ragged.ragged_row_widths(model, config, warmreg.Platform.parse("rocm:gfx942"))
    aiter_path = rocm_ragged.ragged_row_widths(
        model, config, warmreg.Platform.parse("rocm:gfx950+aiter+aiter_sparse_mla")
    )
    assert {128, 640, 8320} <= set(triton_path) and 8320 not in aiter_path and {128, 512, 8192} <= set(aiter_path)


def test_runtime_calls_are_planned() -> None:
    plan = _plan("rocm:gfx942")
    for kernel in (RocmRaggedCount(), RocmRaggedCompact()):
        keys = plan.kernel(kernel.name).keys
        for width in (128, 640, 8320, 256):
            assert kernel.dispatch(indices=warmreg.meta((8192, 8320), torch.int32)[:5, :width]) in keys
        assert_warmup_inputs_reproduce(kernel, keys)


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_ragged.register, model=DSV4.from_config)
    for target in ("rocm:gfx942", "rocm:gfx950"):
        report = warmreg.warm(
            example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False, workers=2
        )
        assert report.ok and report.compiled == 8, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        indices = torch.tensor([[3, -1, 4], [1, 5, 9]], dtype=I32)
        return OpCall(RocmRaggedCount(), (indices, torch.tensor([3, 2], dtype=I32), torch.zeros(3, dtype=I32)), {})

    check_out(build)
