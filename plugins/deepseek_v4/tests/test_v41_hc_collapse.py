"""DeepSeek-V4.1's mHC head collapse: hand-picked math, the PyTorch reference under Triton's interpreter, strided
views (another key each), errors, out=, warmup inputs, and which keys examples/deepseek_v41.json plans on cuda:90 and
cuda:100 (one, cross-compiled), and where nothing is planned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import v41_hc_collapse
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_hc_collapse import HcCollapse, hc_collapse_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, F32 = torch.bfloat16, torch.float32
NAME = HcCollapse.name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # The interpreter truncates fp32 -> bf16 where torch rounds to nearest: at most one bf16 step (2**-7 relative)
    # apart; the fp32 sums themselves are the same operations in the same order on both sides.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0.0)


def test_collapse_by_hand() -> None:
    """Weights 0.5 / 2 / -1 on three streams of exact small values: exact in bf16 either way."""
    x = torch.tensor([[[1.0, 2.0, -4.0], [3.0, 0.5, 1.0], [8.0, -2.0, 0.25]]], dtype=BF16)
    pre = torch.tensor([[0.5, 2.0, -1.0]], dtype=F32)
    got = HcCollapse(hidden_size=3, hc_mult=3)(x, pre)
    assert got.dtype is BF16 and got.shape == (1, 3)
    assert got.float().tolist() == [[0.5 + 6.0 - 8.0, 1.0 + 1.0 + 2.0, -2.0 + 2.0 - 0.25]]


@pytest.mark.parametrize(("t", "n", "h"), [(5, 4, 2048), (3, 2, 1100), (1, 4, 80), (0, 4, 64)])
def test_collapse_matches_reference(t: int, n: int, h: int) -> None:
    """V4.1's hc_mult 4 over two tiles, a second tile 76 columns wide, one narrow row, and an empty step."""
    x = torch.randn(t, n, h, generator=_gen(t + h)).to(BF16)
    pre = torch.rand(t, n, generator=_gen(n))
    got = HcCollapse(hidden_size=h, hc_mult=n)(x, pre)
    assert got.shape == (t, h)
    _close(got, hc_collapse_reference(x, pre))


def test_strided_views_read_right_under_their_own_keys() -> None:
    """Every stride is a constexpr of vLLM's kernel: a row-sliced stream buffer and a pre-mix that is a column slice
    of a wider mix tensor each read right and each make another key."""
    kernel = HcCollapse(hidden_size=64, hc_mult=4)
    base_x = torch.randn(4, 4, 96, generator=_gen(1)).to(BF16)
    base_pre = torch.rand(4, 12, generator=_gen(2))
    cases = [
        (base_x[:, :, :64].contiguous(), base_pre[:, :4].contiguous()),
        (base_x[:, :, :64], base_pre[:, :4].contiguous()),
        (base_x[:, :, :64].contiguous(), base_pre[:, 4:8]),
        (base_x[:, :, :64].transpose(0, 1).contiguous().transpose(0, 1), base_pre[:, :4].contiguous()),
    ]
    for x, pre in cases:
        _close(kernel(x, pre), hc_collapse_reference(x, pre))
    assert len({kernel.dispatch(x=x, pre_mix=pre) for x, pre in cases}) == len(cases)


def test_errors_name_the_argument() -> None:
    kernel = HcCollapse(hidden_size=64, hc_mult=4)
    x, pre = torch.zeros(2, 4, 64, dtype=BF16), torch.zeros(2, 4, dtype=F32)
    with pytest.raises(warmreg.LaunchError, match="x must be"):
        kernel(x.float(), pre)
    with pytest.raises(warmreg.LaunchError, match="x must be"):
        kernel(x.reshape(2, 256), pre)
    with pytest.raises(warmreg.LaunchError, match="x must be"):
        kernel(torch.zeros(2 * 4 * 64 + 1, dtype=BF16)[1:].view(2, 4, 64), pre)
    with pytest.raises(warmreg.LaunchError, match="pre_mix must be"):
        kernel(x, pre.to(BF16))
    with pytest.raises(warmreg.LaunchError, match="pre_mix must be"):
        kernel(x, torch.zeros(2, 3, dtype=F32))
    with pytest.raises(warmreg.LaunchError, match="pre_mix must be"):
        kernel(x, torch.zeros(9, dtype=F32)[1:].view(2, 4))
    with pytest.raises(warmreg.LaunchError, match="out"):
        kernel(x, pre, out=torch.zeros(2, 64, dtype=F32))


def test_out() -> None:
    args = (torch.ones(3, 4, 64, dtype=BF16), torch.full((3, 4), 0.25, dtype=F32))
    check_out(lambda: OpCall(HcCollapse(hidden_size=64, hc_mult=4), args, {}))


# -- the plan --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_v41_plans_one_contiguous_key(target: str) -> None:
    """Every step launches the collapse on fresh contiguous streams and mixes: one key whatever the token count,
    which an engine-shaped call through the launch code reproduces."""
    plan = warmreg.plan(example_config("deepseek_v41"), target=target).kernel(NAME)
    (key,) = plan.keys
    assert (key.hidden, key.hc_mult, key.x_stride_t, key.x_stride_n, key.x_stride_h) == (5120, 4, 4 * 5120, 5120, 1)
    assert (key.pre_stride_t, key.pre_stride_n, key.num_warps, key.enable_fp_fusion) == (4, 1, 4, False)
    for t in (1, 7, 8192):
        x, pre = warmreg.meta((t, 4, 5120), BF16), warmreg.meta((t, 4), F32)
        assert OpCall(plan.kernel, (x, pre), {}).launch_code().key == key
    assert_warmup_inputs_reproduce(plan.kernel, plan.keys)


def test_nothing_is_planned_for_v4_and_rocm_plans_it_too() -> None:
    """V4 has no head collapse; V4.1's ROCm model calls ``hc_collapse_triton`` every step as the CUDA one does
    (``v41_rocm_shared`` registers it there, on the ROCm attention backend)."""
    assert NAME not in {k.name for k in warmreg.plan(example_config("deepseek_v4_flash"), target="cuda:90").kernels}
    rocm = warmreg.plan(example_config("deepseek_v41"), target="rocm:gfx942", serving={"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41"})
    cuda = warmreg.plan(example_config("deepseek_v41"), target="cuda:90")
    assert rocm.kernel(NAME).keys == cuda.kernel(NAME).keys


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    plugins = [RegisterPlugin(v41_hc_collapse.register, model=DSV4.from_config)]
    report = warmreg.warm(example_config("deepseek_v41"), target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
