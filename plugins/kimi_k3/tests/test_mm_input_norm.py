"""The vision tower's input normalisation: the PyTorch reference under Triton's interpreter, hand-picked values,
views and errors, and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.mm_input_norm import MMInputNorm, mm_input_norm_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = MMInputNorm.name
BF16 = torch.bfloat16


def _params(rescale: float = 1 / 255, mean: float = 0.5, std: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's folded buffers: weight = rescale / std, bias = -mean / std (per channel, fp32)."""
    std_t = torch.tensor([std, std * 0.9, std * 1.1])
    mean_t = torch.tensor([mean, mean * 0.8, mean * 1.2])
    return rescale / std_t, -mean_t / std_t


def _pixels(patches: int, patch_len: int = 196, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (patches, 3 * patch_len), generator=gen, dtype=torch.uint8)


def test_hand_picked_values() -> None:
    """Bytes 0 and 255 map to (0 - mean) / std and (1 - mean) / std; each channel takes its own weight and bias."""
    x = torch.tensor([[0, 255, 0, 255, 0, 255]], dtype=torch.uint8)  # C = 3, L = 2
    weight, bias = torch.tensor([1 / 255, 2 / 255, 4 / 255]), torch.tensor([-1.0, 0.0, 1.0])
    got = MMInputNorm(dtype="float32")(x, weight, bias, out_dtype=torch.float32)
    assert got.tolist() == [[-1.0, 0.0, 0.0, 2.0, 1.0, 5.0]]


@pytest.mark.parametrize(("patches", "patch_len"), [(1, 196), (37, 196), (6, 5)])  # 37 * 588: 22 programs, a tail
def test_matches_reference(patches: int, patch_len: int) -> None:
    x, (weight, bias) = _pixels(patches, patch_len, seed=patches), _params()
    kernel = MMInputNorm(dtype="bfloat16")
    # fp32 output: the same products and sums as the reference, exact
    got32 = kernel(x, weight, bias, out_dtype=torch.float32)
    assert torch.equal(got32, mm_input_norm_reference(x, weight, bias, out_dtype=torch.float32))
    # bf16 output: Triton's interpreter truncates fp32 -> bf16 where torch rounds to nearest, so one bf16 step
    got = kernel(x, weight, bias, out_dtype=BF16)
    want = mm_input_norm_reference(x, weight, bias, out_dtype=BF16)
    assert got.dtype == BF16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)


def test_views_and_input_dtypes_share_the_binary_rules() -> None:
    """A row-strided view (made contiguous, as vLLM does), an offset view and a bf16 input."""
    weight, bias = _params()
    kernel, wide = MMInputNorm(dtype="bfloat16"), _pixels(9, 200, seed=3)
    for x in (wide[:, :588], wide.view(-1)[7 : 7 + 4 * 588].view(4, 588)):
        got = kernel(x, weight, bias, out_dtype=torch.float32)
        assert torch.equal(got, mm_input_norm_reference(x, weight, bias, out_dtype=torch.float32))
    bf = (_pixels(3).float() / 7).to(BF16)
    got = kernel(bf, weight, bias, out_dtype=torch.float32)
    assert torch.equal(got, mm_input_norm_reference(bf, weight, bias, out_dtype=torch.float32))
    keys = {kernel.dispatch(pixel_values=x, weight=weight, out_dtype=BF16) for x in (wide[:, :588], _pixels(2))}
    assert len(keys) == 1


def test_empty_batch_and_launch_errors() -> None:
    kernel, (weight, bias) = MMInputNorm(dtype="bfloat16"), _params()
    assert kernel(_pixels(0), weight, bias, out_dtype=BF16).shape == (0, 588)
    with pytest.raises(warmreg.LaunchError, match="pixel_values"):
        kernel(_pixels(2)[:, :587], weight, bias, out_dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="pixel_values"):
        kernel(_pixels(2).view(2, 3, 196), weight, bias, out_dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="weight and bias"):
        kernel(_pixels(2), weight.double(), bias, out_dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="weight and bias"):
        kernel(_pixels(2), weight, bias[:2], out_dtype=BF16)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["kimi_k3", "kimi_k3_attn_res", "kimi_k3_dsa"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_one_key_for_the_vision_tower(example: str, target: str) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {
        "input_dtype": "uint8", "output_dtype": "bfloat16", "channels": 3, "block": 1024, "num_warps": 4,
    }  # fmt: skip


def test_not_planned_without_a_vision_tower_or_on_xpu() -> None:
    text_only = example_config("kimi_k3")
    text_only["model"]["architectures"] = ["KimiLinearForCausalLM"]
    assert NAME not in {k.name for k in warmreg.plan(text_only, target="cuda:90").kernels}
    assert NAME not in {k.name for k in warmreg.plan(example_config("kimi_k3"), target="xpu:pvc").kernels}
    fp16 = warmreg.plan(example_config("kimi_k3", dtype="float16"), target="cuda:90")
    (key,) = fp16.kernel(NAME).keys
    assert key.fields()["output_dtype"] == "float16"


@pytest.mark.parametrize("patches", [1, 64, 4096 + 4])
def test_runtime_shapes_are_planned(patches: int) -> None:
    """MoonViT's [P, 3 * 14 * 14] patches at any count, fresh or an offset slice of a larger batch."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    weight = warmreg.meta((3,), torch.float32)
    for x in (warmreg.meta((patches, 588), torch.uint8), warmreg.meta((patches + 3, 588), torch.uint8)[3:]):
        assert kp.kernel.dispatch(pixel_values=x, weight=weight, out_dtype=BF16) in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, [next(iter(kp.keys))])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        weight, bias = _params()
        return OpCall(MMInputNorm(dtype="bfloat16"), (_pixels(3, 20), weight, bias), {"out_dtype": BF16})

    check_out(build)
