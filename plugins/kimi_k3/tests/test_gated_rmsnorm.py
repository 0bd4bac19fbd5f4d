"""The KDA output's gated RMSNorm against its PyTorch reference under Triton's interpreter, and its plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.gated_rmsnorm import GatedRMSNorm, gated_rmsnorm_reference, projection_width

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = GatedRMSNorm.name
# Both sides compute in fp32 (sums of D squares in different orders, sigmoid) and cast to bf16 once: one bf16
# rounding apart at most (8 mantissa bits: rtol 1.6e-2 is one ulp with margin; atol for outputs near 0).
TOL = {torch.bfloat16: (1e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}  # (atol, rtol)


def _inputs(
    tokens: int, heads: int, dim: int, dtype: torch.dtype, *, seed: int = 0, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[1, T, H, D]``; g the gate columns of a fused ``[T, 4HD + D + H (+pad)]`` projection; the weight."""
    gen = torch.Generator().manual_seed(seed)
    hd = heads * dim
    proj = (torch.randn(tokens, 4 * hd + dim + heads + pad, generator=gen) * 2).to(dtype)
    g = proj[:, 3 * hd : 4 * hd].view(tokens, heads, dim)
    x = (torch.randn(1, tokens, heads, dim, generator=gen) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)
    return x, g, w


def _check(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> GatedRMSNorm:
    kernel = GatedRMSNorm(num_heads=g.shape[1], head_dim=g.shape[2])
    got = kernel(x, g, w, eps)
    assert got.shape == x.shape and got.dtype == x.dtype
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(got, gated_rmsnorm_reference(x, g, w, eps), atol=atol, rtol=rtol)
    return kernel


@pytest.mark.parametrize(("tokens", "heads"), [(1, 12), (3, 12), (5, 3)])  # 36 rows: 3 programs, the last partial
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(tokens: int, heads: int, dtype: torch.dtype) -> None:
    _check(*_inputs(tokens, heads, 128, dtype, seed=tokens + heads))


def test_awkward_head_dim_and_stride() -> None:
    """D = 96 (a masked 128 tile), an odd gate stride (one pad column), an offset x view, eps 1e-6."""
    x, g, w = _inputs(4, 5, 96, torch.bfloat16, seed=7, pad=1)
    base = torch.randn(1 + x.numel(), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x_view = base[1:].view(x.shape)
    kernel = _check(x_view, g, w, eps=1e-6)
    key = kernel.dispatch(x=x_view, g=g, weight=w)
    assert (key.g_stride, key.x_aligned, key.g_aligned) == ("other", False, True)  # g: 3 * 5 * 96 elements in


def test_wide_head_takes_the_one_row_tile() -> None:
    """D > 512: one row a program and 4 warps (layer_norm_gated_fwd's second kernel)."""
    x, g, w = _inputs(2, 2, 640, torch.bfloat16, seed=3)
    key = _check(x, g, w).dispatch(x=x, g=g, weight=w)
    assert (key.block_t, key.block_d, key.num_warps) == (1, 1024, 4)


def test_gate_scales_the_normalised_row() -> None:
    """g = 0 halves the normalised row; a large g leaves it; a row of zeros stays zero (eps keeps rstd finite)."""
    x, _, w = _inputs(2, 2, 128, torch.float32, seed=5)
    x[0, 1, 0] = 0
    g = torch.zeros(2, 2, 128)
    g[1] = 30.0
    out = GatedRMSNorm(num_heads=2, head_dim=128)(x, g, w)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(out[0, 0], normed[0, 0] / 2)
    torch.testing.assert_close(out[0, 1, 1], normed[0, 1, 1])
    assert torch.equal(out[0, 1, 0], torch.zeros(128))


def test_empty_batch_and_launch_errors() -> None:
    kernel = GatedRMSNorm(num_heads=2, head_dim=128)
    x, g, w = _inputs(0, 2, 128, torch.bfloat16)
    assert kernel(x, g, w).shape == (1, 0, 2, 128)
    x, g, w = _inputs(2, 2, 128, torch.bfloat16)
    with pytest.raises(warmreg.LaunchError, match="T \\* H \\* D"):
        kernel(x[:, :1], g, w)
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        kernel(x.transpose(2, 3), g, w)
    with pytest.raises(warmreg.LaunchError, match="g must be"):
        kernel(x, g.transpose(1, 2), w)
    with pytest.raises(warmreg.LaunchError, match="weight"):
        kernel(x, g, w[:64])


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["kimi_k3", "kimi_k3_attn_res"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "xpu:pvc"])
def test_one_key_for_every_batch(example: str, target: str) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {
        "dtype": "bfloat16", "gate_dtype": "bfloat16", "weight_dtype": "bfloat16", "num_heads": 12,
        "head_dim": 128, "block_t": 16, "block_d": 128, "g_stride": "div16", "x_aligned": True, "g_aligned": True,
        "num_warps": 8,
    }  # fmt: skip


def test_not_planned_on_rocm_nor_without_kda_layers() -> None:
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942").kernels}
    data = example_config("kimi_k3")
    data["model"]["text_config"]["linear_attn_config"]["kda_layers"] = []
    assert NAME not in {k.name for k in warmreg.plan(data, target="cuda:90").kernels}


@pytest.mark.parametrize("tokens", [1, 7, 300, 8192])
@pytest.mark.parametrize("width", [projection_width(12, 128), 4 * 12 * 128, 6400])  # 6400: the FP8 weight pad
def test_runtime_shapes_are_planned(tokens: int, width: int) -> None:
    """The layer's tensors at sizes the domains did not sample hit the plan (x sliced from a padded buffer too)."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    proj = warmreg.meta((tokens, width), torch.bfloat16)
    g = proj[:, 3 * 1536 : 4 * 1536].view(tokens, 12, 128)
    x = warmreg.meta((1, 8192, 12, 128), torch.bfloat16)[:, :tokens]
    assert kp.kernel.dispatch(x=x, g=g, weight=warmreg.meta((128,), torch.bfloat16)) in kp.keys


def test_warmup_inputs_reproduce_the_key() -> None:
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    assert projection_width(12, 128) == 6288  # vLLM's _KDA_PACKED_SIZE for TP 8


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    check_out(lambda: OpCall(GatedRMSNorm(num_heads=3, head_dim=128), _inputs(5, 3, 128, torch.bfloat16, seed=8)))
