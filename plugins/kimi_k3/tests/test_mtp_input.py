"""The MTP draft layer's fused input norms: the PyTorch reference under Triton's interpreter, the math on
hand-picked rows, strided views, errors, out=, the plan and cross-compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import mtp_input
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.mtp_input import FusedMTPInput, fused_mtp_input_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = FusedMTPInput.name
EPS = 1e-5
#: bf16 outputs of fp32 math: the sum of squares and rsqrt are computed in a different order / library than the
#: reference's, so an output may land one bf16 rounding step away.
TOL = {"atol": 1e-2, "rtol": 2**-7}


def _inputs(tokens: int, hidden: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 3, (tokens,), generator=g)  # position 0 now and then: a masked embedding
    embeds = torch.randn(tokens, hidden, generator=g).mul_(3).to(dtype)
    hidden_states = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights = [torch.randn(hidden, generator=g).mul_(0.2).add_(1).to(dtype) for _ in range(2)]
    return positions, embeds, hidden_states, *weights, EPS


def _mtp_config(layers: int = 1, **serving: Any) -> dict[str, Any]:
    config = example_config("kimi_k3", **serving)
    config["model"]["text_config"]["num_nextn_predict_layers"] = layers
    return config


def test_hand_picked_rows() -> None:
    """Position 0 zeroes the embedding half; a constant row normalizes to its weight; the halves sit side by side."""
    hidden = 16
    embeds = torch.full((2, hidden), 3.0)
    prev = torch.full((2, hidden), -2.0)
    w_e, w_h = torch.arange(hidden, dtype=torch.float32), torch.full((hidden,), 0.5)
    got = FusedMTPInput(hidden_size=hidden, dtype="float32")(torch.tensor([0, 5]), embeds, prev, w_e, w_h, 1e-9)
    assert got.shape == (2, 2 * hidden)
    assert torch.equal(got[0, :hidden], torch.zeros(hidden))  # 0 * rsqrt(eps)
    torch.testing.assert_close(got[1, :hidden], w_e)  # x * rsqrt(x^2) = 1 for a constant positive row
    torch.testing.assert_close(got[:, hidden:], torch.full((2, hidden), -0.5))


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 7168), (5, 100)])  # 100: a non-power-of-two row
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    args = _inputs(tokens, hidden, seed=tokens + hidden, dtype=dtype)
    got = FusedMTPInput(hidden_size=hidden)(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, fused_mtp_input_reference(*args), **TOL)


def test_strided_views() -> None:
    """Rows of wider persistent buffers (one starting 2 bytes past a 16-byte boundary), and int32 positions."""
    positions, embeds, prev, w_e, w_h, eps = _inputs(4, 64, seed=9)
    wide_e = torch.zeros(6, 80, dtype=embeds.dtype)
    wide_e[1:5, :64] = embeds
    wide_h = torch.zeros(5, 90, dtype=prev.dtype)
    wide_h[:4, 1:65] = prev
    args = (positions.int(), wide_e[1:5, :64], wide_h[:4, 1:65], w_e, w_h, eps)
    kernel = FusedMTPInput(hidden_size=64)
    torch.testing.assert_close(kernel(*args), fused_mtp_input_reference(positions, embeds, prev, w_e, w_h, eps), **TOL)
    key = kernel.dispatch(positions=args[0], inputs_embeds=args[1], previous_hidden_states=args[2], enorm_weight=w_e)
    assert (key.embeds_stride, key.hidden_stride, key.embeds_aligned, key.hidden_aligned) == (
        "div16",
        "other",
        True,
        False,
    )


def test_empty_batch_and_launch_errors() -> None:
    kernel = FusedMTPInput(hidden_size=64)
    positions, embeds, prev, w_e, w_h, eps = _inputs(3, 64, seed=1)
    assert kernel(positions[:0], embeds[:0], prev[:0], w_e, w_h, eps).shape == (0, 128)
    with pytest.raises(warmreg.LaunchError, match="previous_hidden_states"):
        kernel(positions, embeds, prev[:2], w_e, w_h, eps)
    with pytest.raises(warmreg.LaunchError, match="inputs_embeds"):
        kernel(positions, embeds.t(), prev, w_e, w_h, eps)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(positions.float(), embeds, prev, w_e, w_h, eps)
    with pytest.raises(warmreg.LaunchError, match="hnorm_weight"):
        kernel(positions, embeds, prev, w_e, w_h.float(), eps)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_key_when_mtp_layers_draft(target: str) -> None:
    (key,) = warmreg.plan(_mtp_config(), target=target).kernel(NAME).keys
    assert key.fields() == {
        "dtype": "bfloat16", "hidden_dtype": "bfloat16", "weight_dtype": "bfloat16", "positions_dtype": "int64",
        "hidden": 7168, "block": 8192, "embeds_stride": "div16", "hidden_stride": "div16", "out_stride": "div16",
        "embeds_aligned": True, "hidden_aligned": True, "num_warps": 4,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("layers", "serving", "planned"),
    [
        (0, {}, False),  # the examples: no MTP layers in the checkpoint
        (1, {"speculative_method": "mtp"}, True),
        (1, {"num_speculative_tokens": 0}, False),  # no draft model at all
        (1, {"speculative_method": "eagle3"}, False),  # another drafter: the MTP layers are not built
    ],
)
def test_planned_only_when_the_mtp_layers_draft(layers: int, serving: dict[str, Any], planned: bool) -> None:
    names = {kp.name for kp in warmreg.plan(_mtp_config(layers, **serving), target="cuda:90").kernels}
    assert (NAME in names) is planned


@pytest.mark.parametrize("tokens", [1, 4, 1024])
def test_runtime_shapes_are_planned(tokens: int) -> None:
    """The drafter's embeddings and the target's hidden states as fresh tensors or leading rows of buffers."""
    kp = warmreg.plan(_mtp_config(), target="cuda:90").kernel(NAME)
    for rows in (tokens, 8192):
        key = kp.kernel.dispatch(
            positions=warmreg.meta((8192,), torch.int64)[:tokens],
            inputs_embeds=warmreg.meta((rows, 7168), torch.bfloat16)[:tokens],
            previous_hidden_states=warmreg.meta((rows, 7168), torch.bfloat16)[:tokens],
            enorm_weight=warmreg.meta((7168,), torch.bfloat16),
        )
        assert key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_cross_compiles(target: str) -> None:
    plugin = RegisterPlugin(mtp_input.register, model=KimiK3.from_config)
    report = warmreg.warm(_mtp_config(), target=target, plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == {NAME}, [r.error for r in report.failed]


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        return OpCall(FusedMTPInput(hidden_size=48), _inputs(3, 48, seed=2))

    check_out(build)
