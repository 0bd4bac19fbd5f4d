"""XPU's BF16 sparse MLA attention: the float32 reference under Triton's interpreter, hand-picked cases (one valid
key, no valid key), strided query and output views, errors, ``out=``, and the plan (XPU only, the widths of every
layer type, DSpark's draft rows)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import xpu_sparse_mla
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.xpu_sparse_mla import XPUSparseMla, xpu_sparse_mla_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32 = torch.bfloat16, torch.int32
SCALE = 512**-0.5


@pytest.fixture(autouse=True)
def _by_value() -> Iterator[None]:
    """Triton 3.8's interpreter multiplies bf16 bit patterns in ``tl.dot``: compute on the values (see
    :mod:`warmreg_deepseek_v4._interpreter_dot`); compiled kernels are untouched."""
    with bf16_dot_by_value():
        yield


def _inputs(tokens: int, heads: int, rows: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((tokens, heads, 512), generator=g).to(BF16)
    kv = torch.randn((rows, 1, 512), generator=g).to(BF16)
    idx = torch.randint(-1, rows + 3, (tokens, 1, width), generator=g, dtype=I32)  # -1 and past-the-end: masked
    return q, kv, idx


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    # The kernel rounds each block's probabilities to bf16 for the value dot and its output to bf16: the output is
    # within a few bf16 steps of the float32 reference; the statistics are float32 throughout.
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-5)


def test_one_valid_key_is_its_row_and_none_gives_zero() -> None:
    q, kv, _ = _inputs(2, 16, 4, 16, 0)
    idx = torch.full((2, 1, 16), -1, dtype=I32)
    idx[0, 0, 5] = 2
    out, mx, lse = XPUSparseMla()(q, kv, idx, SCALE)
    assert torch.equal(out[0], kv[2, 0].expand(16, 512))
    s = (q[0].float() @ kv[2, 0].float()) * SCALE
    torch.testing.assert_close(mx[0], s, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse[0], mx[0])
    assert torch.equal(out[1], torch.zeros(16, 512, dtype=BF16))
    # no valid key: 16 columns scored -1e30 each, vLLM's finite sentinel
    torch.testing.assert_close(lse[1], torch.full((16,), -1e30 * math.log(2) + math.log(16)))


@pytest.mark.parametrize(("tokens", "heads", "rows", "width"), [(3, 16, 40, 128), (2, 64, 70, 144), (1, 8, 9, 32)])
def test_matches_reference(tokens: int, heads: int, rows: int, width: int) -> None:
    """Flash's 16 heads a rank at a decode width, Pro-like 64 heads (4 programs), fewer heads than a tile."""
    args = _inputs(tokens, heads, rows, width, tokens + heads + width)
    _close(XPUSparseMla()(*args, SCALE), xpu_sparse_mla_reference(*args, SCALE))


def test_strided_views() -> None:
    """Query and output rows sliced from a wider batch (vLLM's ``q[query_start:query_end]``)."""
    q, kv, idx = _inputs(5, 16, 30, 128, 9)
    big = torch.zeros((8, 16, 512), dtype=BF16)
    big[2:7] = q
    outs = (torch.zeros((8, 16, 512), dtype=BF16), torch.zeros((8, 16)), torch.zeros((8, 16)))
    got = XPUSparseMla()(big[2:7], kv, idx, SCALE, out=tuple(o[1:6] for o in outs))
    _close(got, xpu_sparse_mla_reference(q, kv, idx, SCALE))
    assert not outs[0][0].any() and not outs[0][6:].any()


def test_empty_batch_and_errors() -> None:
    q, kv, idx = _inputs(2, 16, 8, 16, 1)
    out = XPUSparseMla()(q[:0], kv, idx[:0], SCALE)
    assert out[0].shape == (0, 16, 512) and out[2].shape == (0, 16)
    with pytest.raises(warmreg.LaunchError, match="q must be"):
        XPUSparseMla()(q.float(), kv, idx, SCALE)
    with pytest.raises(warmreg.LaunchError, match="kv must be"):
        XPUSparseMla()(q, kv[:, :, :448], idx, SCALE)
    with pytest.raises(warmreg.LaunchError, match="indices must be"):
        XPUSparseMla()(q, kv, idx[..., :12], SCALE)


def test_out() -> None:
    def build() -> OpCall:
        return OpCall(XPUSparseMla(), (*_inputs(2, 16, 20, 32, 4), SCALE))

    check_out(build)


def _plan(target: str, example: str = "deepseek_v4_flash", **serving: object) -> warmreg.Plan:
    config = example_config(example)
    config["serving"].update(serving)
    plugin = RegisterPlugin(xpu_sparse_mla.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


def test_planned_on_xpu_for_every_layer_width() -> None:
    """Flash at TP 8 (8 heads a rank, window 128, top-k 512, 1M context): SWA-only rows 128 (decode and prefill), C4
    decode 640 and prefill 640, and a C128 width of each kind; every width a multiple of 16."""
    keys = _plan("xpu:pvc").kernel(XPUSparseMla.name).keys
    widths = sorted(k.width for k in keys)
    assert {k.heads for k in keys} == {8}
    assert {128, 640, 256, 1152} <= set(widths)  # C128 width 128: decode 256; width 1024: prefill round_up(1152, 128)
    assert all(w % 16 == 0 for w in widths) and len(widths) == len(set(widths))
    assert_warmup_inputs_reproduce(XPUSparseMla(), keys)


def test_dspark_adds_the_draft_rows() -> None:
    plain = {k.width for k in _plan("xpu:pvc", "deepseek_v4_flash_0731_dspark").kernel(XPUSparseMla.name).keys}
    assert 192 in plain  # round_up(128 + N, 64) for the example's draft tokens, already a multiple of 16


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx950"])
def test_not_planned_off_xpu(target: str) -> None:
    assert not _plan(target).kernels
