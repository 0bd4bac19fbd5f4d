"""ROCm's inverse GPT-J RoPE of the attention output: the reference under Triton's interpreter, hand-picked rotations,
the in-place head slice vLLM passes, errors, the plan (ROCm's in-tree prefill on the BF16 ``wo_a`` path), out=, and
real cross-compiles for gfx942 and gfx950."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_inverse_rope
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_inverse_rope import RocmInverseRope, rocm_inverse_rope_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16 = torch.bfloat16


def _cache(positions: int, rope: int) -> torch.Tensor:
    """fp32 ``[P, rope]``: cosines then sines of ``p * 10000**(-2i / rope)``."""
    inv = 10000.0 ** (-torch.arange(0, rope, 2, dtype=torch.float32) / rope)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Triton 3.8's interpreter truncates fp32 -> bf16 where torch rounds to nearest: one bf16 step apart at most.
    assert got.dtype == want.dtype == BF16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize(("tokens", "heads", "dim", "rope"), [(5, 4, 512, 64), (3, 3, 72, 14)])
def test_matches_reference(tokens: int, heads: int, dim: int, rope: int) -> None:
    """DeepSeek-V4's 448 + 64 lanes; an odd head count with 58 NoPE and 7 RoPE pairs (masked blocks)."""
    g = torch.Generator().manual_seed(dim)
    o = (torch.randn(tokens, heads, dim, generator=g) * 3).to(BF16)
    pos = torch.randint(0, 40, (tokens,), generator=g)
    cache = _cache(40, rope)
    _close(
        RocmInverseRope()(o, pos, cache, rope_head_dim=rope),
        rocm_inverse_rope_reference(o, pos, cache, rope_head_dim=rope),
    )


def test_undoes_a_known_rotation() -> None:
    """Position 0 is the identity; a pair rotated by the angle of its position comes back (within bf16)."""
    rope, pos = 4, torch.tensor([0, 3])
    cache = _cache(4, rope)
    o = torch.zeros(2, 1, 6, dtype=BF16)
    o[:, 0, :2] = torch.tensor([1.5, -2.0])  # NoPE lanes: copied
    theta = [3.0, 3.0 * 10000 ** (-0.5)]  # pair k of position 3
    o[0, 0, 2:] = torch.tensor([0.25, 0.5, -1.0, 2.0])
    o[1, 0, 2:] = torch.tensor([math.cos(theta[0]), math.sin(theta[0]), math.cos(theta[1]), math.sin(theta[1])])
    out = RocmInverseRope()(o, pos, cache, rope_head_dim=rope)
    assert out[:, 0, :2].tolist() == [[1.5, -2.0], [1.5, -2.0]]
    assert out[0, 0, 2:].tolist() == [0.25, 0.5, -1.0, 2.0]
    torch.testing.assert_close(out[1, 0, 2:].float(), torch.tensor([1.0, 0.0, 1.0, 0.0]), atol=2e-2, rtol=0)


def test_in_place_on_vllms_row_and_head_slice() -> None:
    """``rocm_inverse_rope_rows_(output[rotated:end, :n_local_heads], positions[rotated:end], ...)``: only that slice
    changes, and as the out-of-place launch writes it."""
    g = torch.Generator().manual_seed(7)
    output = torch.randn(7, 5, 512, generator=g).to(BF16)
    positions = torch.randint(0, 64, (7,), generator=g)
    cache = _cache(64, 64)
    view, pos = output[2:6, :3], positions[2:6]
    want_full = output.clone()
    want_full[2:6, :3] = RocmInverseRope()(view.clone(), pos, cache, rope_head_dim=64)
    got = RocmInverseRope()(view, pos, cache, rope_head_dim=64, inplace=True)
    assert got.data_ptr() == view.data_ptr() and torch.equal(output, want_full)


def test_empty_batch_launches_nothing() -> None:
    out = RocmInverseRope()(torch.empty(0, 4, 512, dtype=BF16), torch.empty(0, dtype=torch.int64), _cache(2, 64),
                            rope_head_dim=64)  # fmt: skip
    assert out.shape == (0, 4, 512)


def test_launch_errors() -> None:
    o, pos, cache = torch.zeros(2, 2, 512, dtype=BF16), torch.zeros(2, dtype=torch.int64), _cache(4, 64)
    kernel = RocmInverseRope()
    with pytest.raises(warmreg.LaunchError, match="o must be"):
        kernel(o.transpose(1, 2), pos, cache, rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="rope_head_dim must be even"):
        kernel(o, pos, _cache(4, 63)[:, :63], rope_head_dim=63)
    with pytest.raises(warmreg.LaunchError, match="positions must be"):
        kernel(o, pos[:1], cache, rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="cos_sin_cache must be"):
        kernel(o, pos, cache.double(), rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="inplace writes bf16"):
        kernel(o.float(), pos, cache, rope_head_dim=64, inplace=True)


def _plan(target: str, example: str = "deepseek_v4_flash", **serving: object) -> warmreg.Plan:
    config = example_config(example)
    config["serving"].update(serving)
    plugin = RegisterPlugin(rocm_inverse_rope.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(
    ("target", "example"),
    [
        ("rocm:gfx942", "deepseek_v4_flash"),
        ("rocm:gfx950+aiter", "deepseek_v4_flash"),
        ("rocm:gfx942+aiter_fp8bmm", "deepseek_v4_pro"),  # the FP8 wo_a needs gfx950
    ],
)
def test_planned_one_key_for_the_in_tree_prefill(target: str, example: str) -> None:
    keys = _plan(target, example).kernel(RocmInverseRope.name).keys
    assert [(k.dtype, k.pos_dtype, k.nope, k.half, k.block_nope, k.block_half) for k in keys] == [
        ("bfloat16", "int64", 448, 32, 512, 32)
    ]
    assert_warmup_inputs_reproduce(RocmInverseRope(), keys)


def test_fp8bmm_feature_needs_an_fp8_checkpoint() -> None:
    """``+aiter_fp8bmm`` on gfx950 with aiter: the FP8 example's ``wo_a`` takes aiter's FP8 path, which rotates
    (nothing planned); without ``quantization_config`` vLLM falls back to the BF16 ``wo_a`` (planned)."""
    target = "rocm:gfx950+aiter+aiter_fp8bmm"
    assert not _plan(target).kernels
    config = example_config("deepseek_v4_flash")
    del config["model"]["quantization_config"]
    plugin = RegisterPlugin(rocm_inverse_rope.register, model=DSV4.from_config)
    assert warmreg.plan(config, target=target, plugins=[plugin], entry_points=False).kernels


@pytest.mark.parametrize(
    ("target", "example"),
    [
        ("rocm:gfx950+aiter+aiter_sparse_mla", "deepseek_v4_flash"),  # 8 heads a rank: aiter rotates every row
        ("cuda:90", "deepseek_v4_flash"),
        ("cuda:100", "deepseek_v4_pro"),
    ],
)
def test_not_planned(target: str, example: str) -> None:
    assert not _plan(target, example).kernels


def test_aiter_sparse_mla_with_more_than_64_heads_keeps_it() -> None:
    """Pro at TP1 (128 heads a rank): prefill stays in-tree, its rows owe the pass."""
    assert _plan("rocm:gfx950+aiter+aiter_sparse_mla", "deepseek_v4_pro", tensor_parallel_size=1).kernels


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_inverse_rope.register, model=DSV4.from_config)
    for target in ("rocm:gfx942", "rocm:gfx950"):
        report = warmreg.warm(
            example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False, workers=1
        )
        assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        g = torch.Generator().manual_seed(3)
        o = torch.randn(3, 2, 512, generator=g).to(BF16)
        return OpCall(RocmInverseRope(), (o, torch.tensor([0, 5, 9]), _cache(10, 64)), {"rope_head_dim": 64})

    check_out(build)
