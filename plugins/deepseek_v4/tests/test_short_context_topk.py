"""The C4 indexer's short-context top-k fill: exact equality with the PyTorch reference under Triton's interpreter,
the math on hand-picked positions, views, errors, the plan, out=, and a real cross-compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import short_context_topk
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.short_context_topk import ShortContextTopk, short_context_topk_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = ShortContextTopk.name
I64 = torch.int64


def _kernel(topk: int = 12) -> ShortContextTopk:
    return ShortContextTopk(topk=topk)


def test_every_visible_candidate_then_minus_one() -> None:
    """Position p sees floor((p + 1) / 4) compressed entries: 0 for p < 3, 1 at p = 3, all K once (p + 1) / 4 >= K."""
    positions = torch.tensor([0, 2, 3, 7, 8, 46, 47, 1000], dtype=I64)
    got = _kernel()(positions, num_tokens=8, topk=12)
    want_counts = [0, 0, 1, 2, 2, 11, 12, 12]
    for row, n in zip(got.tolist(), want_counts):
        assert row == list(range(n)) + [-1] * (12 - n)
    assert got.dtype == torch.int32


@pytest.mark.parametrize(("topk", "tokens", "ratio"), [(16, 5, 4), (13, 9, 4), (512, 3, 4), (7, 4, 128)])
def test_matches_reference(topk: int, tokens: int, ratio: int) -> None:
    """A power-of-two row, rows of 13 (a masked tile), the Flash width, and another ratio (the kernel's constexpr)."""
    gen = torch.Generator().manual_seed(topk + tokens)
    positions = torch.randint(-2, 5 * topk * ratio, (tokens + 2,), generator=gen, dtype=I64)  # padding past T
    got = _kernel(topk)(positions, num_tokens=tokens, topk=topk, compress_ratio=ratio)
    want = short_context_topk_reference(positions, num_tokens=tokens, topk=topk, compress_ratio=ratio)
    assert torch.equal(got, want)


def test_offset_positions_and_a_buffer_prefix() -> None:
    """Offset views of the positions, written into the prefix of a persistent buffer: one binary."""
    kernel, base = _kernel(), torch.arange(0, 200, 3, dtype=I64)
    buffer = torch.full((10, 12), 7777, dtype=torch.int32)
    keys = set()
    for positions in (base[1:7], base[2:]):
        got = kernel(positions, num_tokens=6, topk=12, out=buffer[:6])
        assert got.data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:6], short_context_topk_reference(positions, num_tokens=6, topk=12))
        assert (buffer[6:] == 7777).all()  # rows past the step untouched
        keys.add(kernel.dispatch(topk=12, compress_ratio=4))
    assert len(keys) == 1


def test_empty_step_and_launch_errors() -> None:
    kernel, positions = _kernel(), torch.arange(4, dtype=I64)
    assert kernel(positions, num_tokens=0, topk=12).shape == (0, 12)
    for bad, tokens in ((positions.int(), 4), (positions, 5), (torch.arange(8, dtype=I64)[::2], 4)):
        with pytest.raises(warmreg.LaunchError, match="positions must be a contiguous 1-D int64"):
            kernel(bad, num_tokens=tokens, topk=12)
    with pytest.raises(warmreg.LaunchError, match="topk"):
        kernel(positions, num_tokens=4, topk=0)
    with pytest.raises(warmreg.LaunchError, match="out is "):
        kernel(positions, num_tokens=4, topk=12, out=torch.empty(5, 12, dtype=torch.int32))


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("example", "topk"), [("deepseek_v4_flash", 512), ("deepseek_v4_pro", 1024)])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_key_a_model_on_every_platform(example: str, topk: int, target: str) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {"topk": topk, "compress_ratio": 4, "block_topk": topk, "num_warps": 8}


def test_not_planned_without_c4_layers() -> None:
    config = example_config("deepseek_v4_flash")
    config["model"]["compress_ratios"] = [0 if r == 4 else r for r in config["model"]["compress_ratios"]]
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}


def test_runtime_calls_are_planned() -> None:
    """vLLM's call, through the launch code on meta tensors: the step's positions (padded past T) and the prefix
    of the ``[max_num_batched_tokens, index_topk]`` buffer, for any T."""
    kp = warmreg.plan(EXAMPLES / "deepseek_v4_flash.json", target="cuda:90").kernel(NAME)
    positions, buffer = warmreg.meta((8192,), I64), warmreg.meta((8192, 512), torch.int32)
    for tokens in (1, 17, 8191, 8192):
        call = OpCall(kp.kernel, (positions,), {"num_tokens": tokens, "topk": 512, "out": buffer[:tokens]})
        assert call.launch_code().key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_warm_cross_compiles_for_cuda_and_gfx942() -> None:
    plugin = RegisterPlugin(short_context_topk.register, model=DSV4.from_config)
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(example_config("deepseek_v4_pro"), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        return OpCall(_kernel(), (torch.tensor([0, 5, 40, 3, 90], dtype=I64),), {"num_tokens": 4, "topk": 12})

    check_out(build)
