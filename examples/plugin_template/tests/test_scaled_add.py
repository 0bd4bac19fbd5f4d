"""The template kernel against its reference (Triton's interpreter on CPU tensors), its ``out=`` contract, and
its warm coverage, with warmreg's test kit (:mod:`warmreg.testing`)."""

from __future__ import annotations

import pytest
import torch
import warmreg
from warmreg.testing import OpCall, assert_matches, assert_warmup_inputs_reproduce, check_out

import warmreg_template
from warmreg_template import ScaledAdd, scaled_add_reference

CONFIG = {
    "model": {"model_type": "template_llm", "hidden_size": 96},
    "serving": {"max_num_batched_tokens": 64, "dtype": "bfloat16"},
}


def _inputs(tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """x, and y as the second half of a fused [T, 2 * 96] projection (row stride 192, offset 96)."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 96, generator=gen).to(dtype)
    return x, torch.randn(tokens, 192, generator=gen).to(dtype)[:, 96:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7])  # a single row, and a count that leaves a partial block
def test_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    x, y = _inputs(tokens, dtype)
    # The kit's default tolerance: one cast from an fp32 sum on both sides, one rounding step of the dtype apart.
    assert_matches(ScaledAdd()(x, y, 0.5), scaled_add_reference(x, y, 0.5))


def test_out_is_returned_written_checked_and_allocates_nothing() -> None:
    check_out(lambda: OpCall(ScaledAdd(), _inputs(7), {"alpha": 0.5}))


def test_empty_batch() -> None:
    x = torch.empty(0, 96)
    assert ScaledAdd()(x, x, 2.0).shape == (0, 96)


def test_launch_error() -> None:
    with pytest.raises(warmreg.LaunchError, match="must both be"):
        ScaledAdd()(torch.zeros(2, 96), torch.zeros(3, 96), 1.0)


def test_runtime_keys_are_planned() -> None:
    """The key of runtime-shaped inputs (meta tensors, real sizes) is among the planned keys."""
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[warmreg_template], entry_points=False)
    kp = plan.kernel(ScaledAdd.name)
    for tokens in (0, 1, 5, 64):
        proj = warmreg.meta((tokens, 192), torch.bfloat16)
        x = warmreg.meta((tokens, 96), torch.bfloat16)
        assert kp.kernel.dispatch(x=x, y=proj[:, 96:]) in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)  # the default warmup_inputs: the domain points


def test_other_model_types_register_nothing() -> None:
    """warmreg calls the hook only for the model types ``warmreg_model_types`` lists (the plugin has no guard):
    for another, nothing is registered and no plugin serves it."""
    other = {**CONFIG, "model": {**CONFIG["model"], "model_type": "other_llm"}}
    with pytest.raises(warmreg.ConfigError, match="'other_llm', which no installed plugin serves"):
        warmreg.plan(other, target="cuda:90", plugins=[warmreg_template], entry_points=False)


def test_warm_compiles_every_key() -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[warmreg_template], entry_points=False, workers=1)
    assert report.ok and report.declared >= 1
