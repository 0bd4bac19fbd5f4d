"""MTP input and shared-head RMSNorms against their references (Triton interpreter), and warm coverage."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import DSV4, mtp_input_norm, mtp_shared_head_norm
from warmreg_deepseek_v4.mtp_input_norm import MTPInputRMSNorm, mtp_input_rmsnorm_reference
from warmreg_deepseek_v4.mtp_shared_head_norm import MTPSharedHeadRMSNorm, mtp_shared_head_rmsnorm_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FLASH, PRO = EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"
INPUT, HEAD = MTPInputRMSNorm.name, MTPSharedHeadRMSNorm.name
# Kernel and reference both compute in fp32 and round once to bf16; only the fp32 summation order differs,
# which can flip the final rounding by one bf16 ulp (2**-7 relative). Masked rows must be exactly 0.
BF16_TOL = {"atol": 0.0, "rtol": 2.0**-7}


def _Plugin() -> RegisterPlugin:
    return RegisterPlugin(mtp_input_norm.register, mtp_shared_head_norm.register, model=DSV4.from_config)


def _rows(tokens: int, width: int, gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    return (3 * torch.randn(tokens * width + offset, generator=gen)).to(torch.bfloat16)[offset:].view(tokens, width)


def _weights(hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple((1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16) for _ in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("tokens", "hidden", "hc", "offset", "positions"),
    [
        (4, 64, 4, 0, [0, 1, 2, 0]),  # regular; two rows at position 0 (request starts)
        (3, 40, 3, 1, [5, 0, 7]),  # non-pow2 hidden and hc, misaligned activations (offset views)
        (1, 48, 1, 0, [0]),  # T = 1, hc 1, a masked row
    ],
)
def test_input_norm_matches_reference(tokens: int, hidden: int, hc: int, offset: int, positions: list[int]) -> None:
    gen = torch.Generator().manual_seed(tokens)
    embeds, prev = _rows(tokens, hidden, gen, offset), _rows(tokens, hc * hidden, gen, offset)
    embeds[0, 0] = float("nan") if positions[0] == 0 else embeds[0, 0]  # a masked row is zeroed, NaN included
    enorm_w, hnorm_w = _weights(hidden, gen)
    pos = torch.tensor(positions, dtype=torch.int64)
    kernel = MTPInputRMSNorm(hidden=hidden, hc_mult=hc)
    e_out, h_out = kernel(embeds, pos, prev, enorm_w, hnorm_w, 1e-6)
    e_ref, h_ref = mtp_input_rmsnorm_reference(embeds, pos, prev, enorm_w, hnorm_w, 1e-6)
    torch.testing.assert_close(e_out, e_ref, **BF16_TOL)
    torch.testing.assert_close(h_out, h_ref, **BF16_TOL)
    assert e_out[pos == 0].eq(0).all() and h_out.shape == prev.shape and e_out.is_contiguous()


def test_input_norm_takes_prev_hidden_as_three_dims() -> None:
    gen = torch.Generator().manual_seed(0)
    embeds, prev = _rows(2, 32, gen), _rows(2, 4 * 32, gen).view(2, 4, 32)
    w1, w2 = _weights(32, gen)
    pos = torch.tensor([3, 0])
    _, h_out = MTPInputRMSNorm(hidden=32, hc_mult=4)(embeds, pos, prev, w1, w2, 1e-6)
    torch.testing.assert_close(h_out, mtp_input_rmsnorm_reference(embeds, pos, prev, w1, w2, 1e-6)[1], **BF16_TOL)


@pytest.mark.parametrize(("tokens", "hidden", "offset"), [(3, 64, 0), (2, 72, 5), (1, 16, 0)])
def test_shared_head_norm_matches_reference(tokens: int, hidden: int, offset: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x, (w, _) = _rows(tokens, hidden, gen, offset), _weights(hidden, gen)
    out = MTPSharedHeadRMSNorm(hidden=hidden)(x, w, 1e-6)
    torch.testing.assert_close(out, mtp_shared_head_rmsnorm_reference(x, w, 1e-6), **BF16_TOL)


def test_empty_batches_launch_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    w1, w2 = _weights(32, gen)
    e, h = MTPInputRMSNorm(hidden=32, hc_mult=4)(
        _rows(0, 32, gen), torch.empty(0, dtype=torch.int64), _rows(0, 128, gen), w1, w2, 1e-6
    )
    assert e.shape == (0, 32) and h.shape == (0, 128)
    assert MTPSharedHeadRMSNorm(hidden=32)(_rows(0, 32, gen), w1, 1e-6).shape == (0, 32)


def test_bad_inputs_are_named() -> None:
    gen = torch.Generator().manual_seed(0)
    embeds, prev, (w1, w2) = _rows(2, 32, gen), _rows(2, 128, gen), _weights(32, gen)
    kernel = MTPInputRMSNorm(hidden=32, hc_mult=4)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(embeds, torch.zeros(2, dtype=torch.int32), prev, w1, w2, 1e-6)
    with pytest.raises(warmreg.LaunchError, match="prev_hidden"):
        kernel(embeds, torch.zeros(2, dtype=torch.int64), prev[:, :100], w1, w2, 1e-6)
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        MTPSharedHeadRMSNorm(hidden=32)(_rows(2, 64, gen)[:, :32], w1, 1e-6)
    with pytest.raises(warmreg.LaunchError, match="aligned"):
        MTPSharedHeadRMSNorm(hidden=32)(embeds, torch.zeros(33, dtype=torch.bfloat16)[1:], 1e-6)


@pytest.mark.parametrize("example", [FLASH, PRO])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_runtime_batches_hit_warmed_keys(example: Path, target: str) -> None:
    """Draft steps of any token count (fresh contiguous activations) dispatch to the one key of each norm."""
    plan = warmreg.plan(example, target=target, plugins=[_Plugin()], entry_points=False)
    model = DSV4.from_config(plan.config)
    h, hc = model.hidden_size, model.hc_mult
    inputs, head = plan.kernel(INPUT), plan.kernel(HEAD)
    assert len(inputs.keys) == 1 and len(head.keys) == 1
    w = warmreg.meta((h,), torch.bfloat16)
    for tokens in (1, 2, 17, 256, 8192):
        residual = warmreg.meta((2 * tokens, hc * h), torch.bfloat16)[:tokens]  # a leading slice of a padded buffer
        key = inputs.kernel.dispatch(
            inputs_embeds=warmreg.meta((tokens, h), torch.bfloat16), prev_hidden=residual, enorm_weight=w
        )
        assert key in inputs.keys, key
        assert head.kernel.dispatch(x=warmreg.meta((tokens, h), torch.bfloat16), weight=w) in head.keys
    assert inputs.keys[0].block_size == {4096: 4096, 7168: 8192}[h]


def test_no_mtp_layers_registers_nothing() -> None:
    data = json.loads(FLASH.read_text())
    data["model"]["num_nextn_predict_layers"] = 0
    data["model"]["compress_ratios"] = data["model"]["compress_ratios"][:-1]
    plan = warmreg.plan(data, target="cuda:90", plugins=[_Plugin()], entry_points=False)
    assert plan.kernels == ()


def test_warmup_inputs_reproduce_keys_of_offset_views() -> None:
    gen = torch.Generator().manual_seed(0)
    kernel, shared = MTPInputRMSNorm(hidden=40, hc_mult=3), MTPSharedHeadRMSNorm(hidden=40)
    w = _weights(40, gen)[0]
    for offset in (0, 1):
        key = kernel.dispatch(
            inputs_embeds=_rows(2, 40, gen, offset), prev_hidden=_rows(2, 120, gen, 1 - offset), enorm_weight=w
        )
        assert_warmup_inputs_reproduce(kernel, [key])
        assert_warmup_inputs_reproduce(shared, [shared.dispatch(x=_rows(2, 40, gen, offset), weight=w)])


def test_warm_cross_compiles_for_cuda_and_gfx942() -> None:
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(
            PRO, target=target, plugins=[_Plugin()], entry_points=False, workers=2, on_error="continue"
        )
        assert report.ok, [(r.key, r.error) for r in report.failed]
        assert report.compiled == 2


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def _input_norm_call() -> OpCall:
    gen = torch.Generator().manual_seed(3)
    embeds, prev = _rows(3, 40, gen, 1), _rows(3, 3 * 40, gen, 1)
    args = (embeds, torch.tensor([5, 0, 7]), prev, *_weights(40, gen), 1e-6)
    return OpCall(MTPInputRMSNorm(hidden=40, hc_mult=3), args, tol=BF16_TOL)


def _shared_head_norm_call() -> OpCall:
    gen = torch.Generator().manual_seed(2)
    return OpCall(MTPSharedHeadRMSNorm(hidden=72), (_rows(2, 72, gen, 5), _weights(72, gen)[0], 1e-6), tol=BF16_TOL)


@pytest.mark.parametrize("build", [_input_norm_call, _shared_head_norm_call], ids=["input_norm", "shared_head_norm"])
def test_out(build: Callable[[], OpCall]) -> None:
    check_out(build, tuple_error=r"out must be a tuple of \d buffers")
