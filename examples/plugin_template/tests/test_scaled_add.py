"""The template kernel against its reference (Triton's interpreter on CPU tensors) and its warm coverage."""

from __future__ import annotations

import pytest
import torch
import warmreg

from warmreg_template import ScaledAdd, scaled_add_reference
from warmreg_template import plugin as template_plugin

# One cast from an fp32 sum on both sides: equal up to one rounding step of the output dtype.
TOLERANCES = {torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}, torch.float32: {"atol": 1e-6, "rtol": 1e-6}}
CONFIG = {
    "model": {"model_type": "template_llm", "hidden_size": 96},
    "serving": {"max_num_batched_tokens": 64, "dtype": "bfloat16"},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7])  # a single row, and a count that leaves a partial block
def test_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    hidden = 96
    x = torch.randn(tokens, hidden).to(dtype)
    proj = torch.randn(tokens, 2 * hidden).to(dtype)
    y = proj[:, hidden:]  # a view: row stride 2 * hidden, offset hidden
    out = ScaledAdd(hidden=hidden)(x, y, 0.5)
    torch.testing.assert_close(out, scaled_add_reference(x, y, 0.5), **TOLERANCES[dtype])


def test_empty_batch() -> None:
    x = torch.empty(0, 96)
    assert ScaledAdd(hidden=96)(x, x, 2.0).shape == (0, 96)


def test_launch_error() -> None:
    with pytest.raises(warmreg.LaunchError, match="must both be"):
        ScaledAdd(hidden=96)(torch.zeros(2, 96), torch.zeros(3, 96), 1.0)


def test_runtime_keys_are_planned() -> None:
    """The key of runtime-shaped inputs (meta tensors, real sizes) is among the planned keys."""
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[template_plugin], entry_points=False)
    kp = plan.kernel(ScaledAdd.name)
    for tokens in (0, 1, 5, 64):
        proj = warmreg.meta((tokens, 192), torch.bfloat16)
        x = warmreg.meta((tokens, 96), torch.bfloat16)
        assert kp.kernel.dispatch(x=x, y=proj[:, 96:]) in kp.keys


def test_warm_compiles_every_key() -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[template_plugin], entry_points=False, workers=1)
    assert report.ok and report.declared >= 1
