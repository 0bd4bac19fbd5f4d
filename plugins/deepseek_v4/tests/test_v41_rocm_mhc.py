"""DeepSeek-V4.1's ROCm mHC seam (post block + collapse + RMSNorm): the reference under Triton's interpreter,
hand-picked values, errors, out=, the plan per target and a real cross-compile for gfx950."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_rocm_mhc_post_collapse
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_rocm_mhc_post_collapse import (
    MhcPostCollapseRmsNorm,
    mhc_post_collapse_rms_norm_reference,
)

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, F32 = torch.bfloat16, torch.float32
NAME = MhcPostCollapseRmsNorm.name


def _inputs(tokens: int, hidden: int, seed: int, weight_dtype: torch.dtype = BF16) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, 4, hidden, generator=g).to(BF16), torch.randn(tokens, hidden, generator=g).to(BF16),
        torch.rand(tokens, 4, 1, generator=g), torch.rand(tokens, 4, 4, generator=g), torch.rand(tokens, 4, generator=g),
        (torch.randn(hidden, generator=g) * 0.1 + 1).to(weight_dtype), 1e-6,
    )  # fmt: skip


def test_hand_picked_values() -> None:
    """Identity comb, post 0: the streams pass through; pre selects stream 2, whose RMSNorm of a constant row is the
    weight (exact in bf16)."""
    h = 8
    residual = torch.arange(4 * h, dtype=F32).reshape(1, 4, h).to(BF16) + 1
    comb = torch.eye(4).reshape(1, 4, 4)
    pre = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    residual[0, 2] = 3.0
    weight = torch.arange(h, dtype=F32).to(BF16)
    res_out, layer_in = MhcPostCollapseRmsNorm()(
        residual, torch.ones(1, h, dtype=BF16), torch.zeros(1, 4, 1), comb, pre, weight, 0.0
    )
    assert torch.equal(res_out, residual)
    assert torch.equal(layer_in, weight.reshape(1, h))


@pytest.mark.parametrize(("tokens", "hidden", "weight_dtype"), [(3, 512, BF16), (2, 5120, BF16), (4, 300, F32)])
def test_matches_reference(tokens: int, hidden: int, weight_dtype: torch.dtype) -> None:
    """V4.1-Flash's hidden size, a non-power-of-two one (a masked tile) with an fp32 weight. Within two bf16 steps:
    Triton's interpreter truncates fp32 -> bf16 where the reference rounds to nearest."""
    args = _inputs(tokens, hidden, tokens + hidden, weight_dtype)
    got = MhcPostCollapseRmsNorm()(*args)
    want = mhc_post_collapse_rms_norm_reference(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2**-6, atol=2**-6)


def test_empty_batch() -> None:
    res_out, layer_in = MhcPostCollapseRmsNorm()(*_inputs(0, 64, 0))
    assert res_out.shape == (0, 4, 64) and layer_in.shape == (0, 64)


def test_launch_errors() -> None:
    args = list(_inputs(2, 64, 1))
    op = MhcPostCollapseRmsNorm()
    with pytest.raises(warmreg.LaunchError, match="residual must be"):
        op(args[0].float(), *args[1:])
    with pytest.raises(warmreg.LaunchError, match="sublayer_out must be"):
        op(args[0], args[1].t().contiguous().t()[:, :32], *args[2:])
    with pytest.raises(warmreg.LaunchError, match="comb_res_mix must be"):
        op(*args[:3], args[3].transpose(1, 2), *args[4:])
    with pytest.raises(warmreg.LaunchError, match="norm_weight must be"):
        op(*args[:5], args[5][:32], args[6])


def test_out() -> None:
    def build() -> OpCall:
        return OpCall(MhcPostCollapseRmsNorm(), _inputs(2, 64, 3), {})

    check_out(build)


def _plan(target: str, **model: Any) -> warmreg.Plan:
    config = example_config("deepseek_v41")
    config["serving"]["attention_backend"] = "ROCM_FLASHMLA_SPARSE_DSV41"
    config["model"]["text_config"].update(model)
    plugin = RegisterPlugin(v41_rocm_mhc_post_collapse.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


def test_one_key_on_gfx950_with_aiter() -> None:
    plan = _plan("rocm:gfx950+aiter")
    keys = plan.kernel(NAME).keys
    assert [k.fields() for k in keys] == [
        {"hidden": 5120, "block_h": 8192, "weight_dtype": "bfloat16", "num_warps": 16}
    ]
    assert_warmup_inputs_reproduce(MhcPostCollapseRmsNorm(), keys)


@pytest.mark.parametrize("target", ["rocm:gfx950", "rocm:gfx942", "cuda:100"])
def test_not_planned_without_gfx950_and_aiter(target: str) -> None:
    """``supports_mhc_overlap`` needs CDNA4 and aiter's fused seam kernel; CUDA's V4.1 model has no such seam."""
    assert not _plan(target).kernels


def test_not_planned_at_another_hc_mult() -> None:
    assert not _plan("rocm:gfx950+aiter", hc_mult=2).kernels


def test_warm_cross_compiles_for_gfx950() -> None:
    plugin = RegisterPlugin(v41_rocm_mhc_post_collapse.register, model=DSV4.from_config)
    config = example_config("deepseek_v41")
    report = warmreg.warm(config, target="rocm:gfx950+aiter", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
