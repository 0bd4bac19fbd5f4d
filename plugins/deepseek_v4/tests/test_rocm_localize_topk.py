"""ROCm's localization of aiter's prefill top-k: the reference under Triton's interpreter, a hand-picked case, the
buffer's row slices, errors, the plan (FP8 indexer on gfx950 with aiter only), and real cross-compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_localize_topk
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_localize_topk import RocmLocalizeTopk, localize_topk_reference

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32


def test_subtracts_row_start_but_keeps_minus_one() -> None:
    indices = torch.tensor([[10, 12, -1], [7, -1, 9]], dtype=I32)
    out = RocmLocalizeTopk()(indices, torch.tensor([10, 5], dtype=I32))
    assert out.data_ptr() == indices.data_ptr() and indices.tolist() == [[0, 2, -1], [2, -1, 4]]


@pytest.mark.parametrize(("rows", "topk"), [(5, 512), (3, 1024), (4, 300)])
def test_matches_reference_on_buffer_slices(rows: int, topk: int) -> None:
    """Rows ``[a:b, :index_topk]`` of the persistent buffer; rows outside the slice untouched; a masked last tile."""
    g = torch.Generator().manual_seed(rows + topk)
    buffer = torch.randint(-1, 5000, (rows + 4, topk + 8), generator=g, dtype=I32)
    starts = torch.randint(0, 1000, (rows,), generator=g, dtype=I32)
    before = buffer.clone()
    want = localize_topk_reference(buffer[2 : 2 + rows, :topk], starts)
    RocmLocalizeTopk()(buffer[2 : 2 + rows, :topk], starts)
    assert torch.equal(buffer[2 : 2 + rows, :topk], want)
    before[2 : 2 + rows, :topk] = want
    assert torch.equal(buffer, before)


def test_launch_errors() -> None:
    with pytest.raises(warmreg.LaunchError, match="indices must be"):
        RocmLocalizeTopk()(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=I32))
    with pytest.raises(warmreg.LaunchError, match="row_starts must be"):
        RocmLocalizeTopk()(torch.zeros(2, 4, dtype=I32), torch.zeros(1, dtype=I32))


def _plan(target: str, value: str = "fp8") -> warmreg.Plan:
    config = example_config("deepseek_v4_flash")
    config["serving"]["indexer_kv_dtype"] = value
    plugin = RegisterPlugin(rocm_localize_topk.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


def test_planned_for_the_fp8_indexer_on_gfx950_with_aiter() -> None:
    keys = _plan("rocm:gfx950+aiter").kernel(RocmLocalizeTopk.name).keys
    assert [k.fields() for k in keys] == [{"tile": 256, "num_warps": 4}]
    assert_warmup_inputs_reproduce(RocmLocalizeTopk(), keys)


@pytest.mark.parametrize(
    ("target", "value"),
    [
        ("rocm:gfx950+aiter", "auto"),
        ("rocm:gfx950+aiter", "mxfp4"),
        ("rocm:gfx950", "fp8"),
        ("rocm:gfx942+aiter", "fp8"),
        ("cuda:90", "fp8"),
    ],
)
def test_not_planned_elsewhere(target: str, value: str) -> None:
    """MXFP4 (auto on gfx950 with aiter) scores on aiter's paged kernels; aiter's top-k is gfx950's only."""
    assert not _plan(target, value).kernels


def test_warm_cross_compiles_for_gfx950() -> None:
    config = example_config("deepseek_v4_flash")
    config["serving"]["indexer_kv_dtype"] = "fp8"
    plugin = RegisterPlugin(rocm_localize_topk.register, model=DSV4.from_config)
    report = warmreg.warm(config, target="rocm:gfx950+aiter", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
