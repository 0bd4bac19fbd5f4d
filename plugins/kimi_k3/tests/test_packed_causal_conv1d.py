"""The packed prefill conv: the PyTorch reference under Triton's interpreter (states exactly, outputs within a bf16
step), the taps on hand-picked values, the program search over many sequences, strided layouts, errors, out=, and
which prefill conv the plan picks where."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import packed_causal_conv1d
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.causal_conv1d import CausalConv1d, conv_state_pool, projection_row_stride
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.packed_causal_conv1d import PackedCausalConv1d, packed_causal_conv1d_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME, STOCK = PackedCausalConv1d.name, CausalConv1d.name
#: fp32 sums in one order on both sides; exp from numpy (interpreter) against torch: an output may land one bf16
#: step away (the plugin's stock conv test takes the same).
TOL = {"atol": 1e-6, "rtol": 2**-7}


def _kernel(p: int = 64) -> PackedCausalConv1d:
    lay = KDALayout(num_heads=1, head_dim=p, conv_width=4, lower_bound=None, tensor_parallel_size=1,
                    num_speculative_tokens=0, dtype="float32")  # fmt: skip
    return PackedCausalConv1d(layout=lay, max_num_seqs=4)


def _batch(
    lens: list[int], p: int, *, seed: int, dtype: torch.dtype = torch.bfloat16, lines: list[int] | None = None
) -> tuple[Any, ...]:
    """x as the first 3P columns of a wider projection, fp32 weights [3P, 4], an fp32 state pool in vLLM's default
    (state_len, dim) layout with 2 spare columns, a line per sequence (0 the null line), mixed initial states."""
    g = torch.Generator().manual_seed(seed)
    d, n = 3 * p, len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(int(qsl[-1]), d + 40, generator=g).mul_(2).to(dtype)[:, :d]
    weight = torch.randn(d, 4, generator=g).mul_(0.5)
    states = torch.randn(n + 3, 5, d, generator=g).transpose(1, 2)
    indices = torch.tensor(lines if lines is not None else torch.randperm(n + 2, generator=g)[:n].add(1).tolist(),
                           dtype=torch.int32)  # fmt: skip
    init = torch.rand(n, generator=g) < 0.6
    return x, weight, None, states, qsl, indices, init, p


def _compare(args: tuple[Any, ...], **kw: Any) -> None:
    """The op against the reference: every live output row, the whole state pool exactly."""
    want, want_states = packed_causal_conv1d_reference(*args, **kw)
    states = args[3].clone()
    got = _kernel(args[7])(*args[:3], states, *args[4:], **kw)
    qsl, lines = args[4].tolist(), args[5].tolist()
    live = torch.ones(got.shape[1], dtype=torch.bool)
    for s, line in enumerate(lines):
        if line == kw.get("null_block_id", 0):
            live[qsl[s] : qsl[s + 1]] = False
    torch.testing.assert_close(got[:, live], want[:, live], **TOL)
    assert torch.equal(states, want_states)


def test_the_taps_on_hand_picked_values() -> None:
    """One channel's taps: weights 1, 10, 100, 1000 (oldest first), history 1, 2, 3 and inputs 4, 5 give
    y0 = 1 + 20 + 300 + 4000, y1 = 2 + 30 + 400 + 5000; the new state is 3, 4, 5; spare columns untouched."""
    p = 64
    x = torch.zeros(2, 3 * p)
    x[:, 0] = torch.tensor([4.0, 5.0])
    weight = torch.zeros(3 * p, 4)
    weight[0] = torch.tensor([1.0, 10.0, 100.0, 1000.0])
    states = torch.zeros(2, 3 * p, 5)
    states[1, 0] = torch.tensor([1.0, 2.0, 3.0, 7.0, 7.0])
    qsl, lines, init = (
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([True]),
    )
    out = _kernel()(x, weight, None, states, qsl, lines, init, p, activation=None)
    assert out.shape == (3, 2, p) and out[0, :, 0].tolist() == [4321.0, 5432.0]
    assert states[1, 0].tolist() == [3.0, 4.0, 5.0, 7.0, 7.0]


@pytest.mark.parametrize(
    "lens",
    [
        [1],
        [2, 70, 1, 0, 130],  # a chunk boundary mid-sequence, an empty sequence, programs left spare
        [3] * 20 + [65] * 15,  # 35 sequences: two levels of the program search
    ],
)
@pytest.mark.parametrize(("p", "dtype"), [(64, torch.bfloat16), (128, torch.float32)])  # BLOCK_N 64 and 128
def test_matches_reference(lens: list[int], p: int, dtype: torch.dtype) -> None:
    _compare(_batch(lens, p, seed=len(lens) + p, dtype=dtype))


def test_null_line_bias_and_no_silu() -> None:
    """A sequence on line 0 is skipped (its state line too); with a bias and without silu; no null line at all."""
    x, weight, _, states, qsl, _, init, p = _batch([5, 9, 2], 64, seed=3)
    bias = torch.randn(3 * p, generator=torch.Generator().manual_seed(0))
    _compare((x, weight, bias, states, qsl, torch.tensor([2, 0, 4], dtype=torch.int32), init, p), activation=None)
    _compare((x, weight, None, states, qsl, torch.tensor([2, 0, 4], dtype=torch.int32), init, p), null_block_id=None)


def test_strided_layouts_one_binary() -> None:
    """Rows of the projection from row 1 (a mixed batch's slice), cache indices ``block_table[:, 0]`` of a 4-wide
    table, and the dim-first conv-state layout (strides (page, rows, 1)): exact states, the same key for the first
    two; the dim-first layout is a key of its own (a constexpr stride)."""
    x, weight, _, states, qsl, lines, init, p = _batch([6, 66, 3], 64, seed=4)
    buf = torch.zeros(x.shape[0] + 1, x.stride(0), dtype=x.dtype)
    buf[1:, : x.shape[1]] = x
    wide = buf[1:, : x.shape[1]]  # x's row stride, one row further on
    table = torch.zeros(3, 4, dtype=torch.int32)
    table[:, 0] = lines
    dim_first = states.contiguous()
    kernel, keys = _kernel(), set()
    for args in ((wide, weight, None, states, qsl, table[:, 0], init, p),
                 (x, weight, None, dim_first, qsl, lines, init, p), (x, weight, None, states, qsl, lines, init, p)):  # fmt: skip
        _compare(args)
        keys.add(kernel.dispatch(x=args[0], weight=weight, bias=None, conv_states=args[3], part_dim=p,
                                 activation="silu", null_block_id=0))  # fmt: skip
    assert len(keys) == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"states": torch.bfloat16}, "conv_states must be float32"),
        ({"weight": torch.bfloat16}, "weight"),
        ({"part_dim": 48}, "part_dim"),
        ({"init": torch.int32}, "has_initial_state"),
    ],
)
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    x, weight, _, states, qsl, lines, init, p = _batch([3, 4], 64, seed=5)
    if "states" in change:
        states = states.to(change["states"])
    if "weight" in change:
        weight = weight.to(change["weight"])
    if "init" in change:
        init = init.to(change["init"])
    with pytest.raises(warmreg.LaunchError, match=message):
        _kernel()(x, weight, None, states, qsl, lines, init, change.get("part_dim", p))


def test_empty_batch_launches_nothing() -> None:
    x, weight, _, states, qsl, lines, init, p = _batch([3], 64, seed=6)
    before = states.clone()
    assert _kernel()(x[:0], weight, None, states, qsl[:1], lines[:0], init[:0], p).shape == (3, 0, p)
    assert torch.equal(states, before)


# -- the plan: which prefill conv vLLM 0.34 runs ----------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_float32_plans_the_packed_conv_instead_of_the_stock_one(target: str) -> None:
    plan = warmreg.plan(example_config("kimi_k3", dtype="float32"), target=target)
    names = {kp.name for kp in plan.kernels}
    assert STOCK not in names
    (key,) = plan.kernel(NAME).keys  # the projection's rows and the gathered [T, 3P] copy, from row 0 or 1: one key
    assert key.fields() == {
        "dtype": "float32", "weight_dtype": "float32", "state_dtype": "float32", "bias_dtype": None,
        "part_dim": 1536, "num_parts": 3, "stride_x_token": "div16", "stride_w_dim": 4, "stride_w_width": 1,
        "stride_state_seq": "div16", "stride_state_dim": 1, "stride_state_token": 4608, "null_block_id": 0,
        "silu": True, "block_m": 8, "num_blocks": 8, "block_n": 128, "x_aligned": True, "w_aligned": True,
        "state_aligned": True, "num_warps": 1,
    }  # fmt: skip
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, [key])


@pytest.mark.parametrize(
    ("example", "serving", "width", "target"),
    [
        ("kimi_k3", {}, 4, "cuda:90"),  # bf16: a bf16 conv state, the stock conv
        ("kimi_k3_attn_res", {}, 4, "cuda:100"),
        ("kimi_k3", {"dtype": "float16"}, 4, "cuda:90"),
        ("kimi_k3", {"dtype": "float32"}, 3, "cuda:90"),  # width 3: the stock conv
    ],
)
def test_elsewhere_the_stock_conv(example: str, serving: dict[str, Any], width: int, target: str) -> None:
    config = example_config(example, **serving)
    config["model"]["text_config"]["linear_attn_config"]["short_conv_kernel_size"] = width
    names = {kp.name for kp in warmreg.plan(config, target=target).kernels}
    assert STOCK in names and NAME not in names


@pytest.mark.parametrize("target", ["rocm:gfx942", "xpu:pvc"])
def test_never_off_cuda(target: str) -> None:
    names = {kp.name for kp in warmreg.plan(example_config("kimi_k3", dtype="float32"), target=target).kernels}
    assert NAME not in names and STOCK not in names


def test_runtime_shapes_are_planned() -> None:
    """The layer's mixed_qkv_ns at TP 8: the projection's first 3P columns from row 0 or later (a slice after the
    speculative rows), or the gathered copy; the packed weight view and the whole conv state."""
    plan = warmreg.plan(example_config("kimi_k3", dtype="float32"), target="cuda:90")
    kp = plan.kernel(NAME)
    lay = kp.kernel.layout
    p = lay.projection_size
    state = conv_state_pool(lay, 257, torch.float32)
    weight = warmreg.meta((3 * p, 1, 4), torch.float32).view(3 * p, 4)
    for width in (projection_row_stride(lay), 3 * p):
        for start, tokens in ((0, 1), (12, 8192)):
            x = warmreg.meta((8192 + 12, width), torch.float32)[start : start + tokens, : 3 * p]
            key = kp.kernel.dispatch(x=x, weight=weight, bias=None, conv_states=state, part_dim=p, activation="silu",
                                     null_block_id=0)  # fmt: skip
            assert key in kp.keys, (width, start)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_cross_compiles(target: str) -> None:
    plugin = RegisterPlugin(packed_causal_conv1d.register, model=KimiK3.from_config)
    config = example_config("kimi_k3", dtype="float32")
    report = warmreg.warm(config, target=target, plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == {NAME}, [r.error for r in report.failed]


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        x, weight, bias, states, qsl, lines, init, p = _batch([3, 9], 64, seed=7)
        return OpCall(_kernel(), (x, weight, bias, states, qsl, lines, init, p))

    check_out(build)
