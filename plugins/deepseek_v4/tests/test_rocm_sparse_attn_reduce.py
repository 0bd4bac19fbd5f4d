"""ROCm's sparse MLA decode reduce: the reference under Triton's interpreter (with and without the sink, the fused
inverse RoPE, adaptive splits), hand-picked combines, the output slice vLLM passes, errors, the plan (gfx942 and
gfx950 without aiter's sparse MLA decode; the rotation off with aiter's FP8 wo_a), out=, and real cross-compiles."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_sparse_attn_reduce
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_sparse_attn_reduce import RocmSparseAttnReduce, decode_reduce_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
LOWEST = -3.4028234663852886e38


def _parts(seed: int, tokens: int, splits: int, heads: int, dim: int = 512) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    part_m = torch.randn(tokens, splits, heads, generator=g) * 3
    part_l = torch.rand(tokens, splits, heads, generator=g) * 5 + 0.5
    part_acc = torch.randn(tokens, splits, heads, dim, generator=g) * part_l[..., None]
    return part_m, part_l, part_acc


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32 sums in another order (the reference sums the splits at once), then bf16: one bf16 step (the interpreter
    # truncates to bf16 where torch rounds)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize(("splits", "sink", "rotate"), [(1, True, True), (5, True, False), (3, False, True)])
def test_matches_reference(splits: int, sink: bool, rotate: bool) -> None:
    part_m, part_l, part_acc = _parts(splits, 3, splits, 4)
    g = torch.Generator().manual_seed(9)
    s = torch.randn(4, generator=g) if sink else None
    pos, cs = (torch.tensor([2, 0, 5]), torch.randn(6, 64, generator=g)) if rotate else (None, None)
    got = RocmSparseAttnReduce()(part_m, part_l, part_acc, s, positions=pos, cos_sin_cache=cs)
    _close(got, decode_reduce_reference(part_m, part_l, part_acc, s, positions=pos, cos_sin_cache=cs))


def test_combines_two_splits_and_the_sink() -> None:
    """m = (0, 1), l = (1, 2), acc = (1, 2) a lane, sink 1: M = 1, L = e**-1 + 2 + 1, o = (e**-1 + 2) / L."""
    part_m = torch.tensor([[[0.0], [1.0]]])
    part_l = torch.tensor([[[1.0], [2.0]]])
    part_acc = torch.stack((torch.ones(1, 1, 1, 4), 2 * torch.ones(1, 1, 1, 4)), dim=1)[:, :, 0]
    got = RocmSparseAttnReduce(rope_head_dim=2)(part_m, part_l, part_acc, torch.tensor([1.0]))
    want = (math.exp(-1) + 2) / (math.exp(-1) + 3)
    torch.testing.assert_close(got.float(), torch.full((1, 1, 4), want), atol=4e-3, rtol=0)


def test_no_key_and_no_sink_writes_zero() -> None:
    part_m, part_l, part_acc = torch.full((1, 2, 1), LOWEST), torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 8)
    assert RocmSparseAttnReduce(rope_head_dim=2)(part_m, part_l, part_acc).tolist() == [[[0.0] * 8]]


def test_adaptive_skips_splits_without_keys() -> None:
    """A split without keys (m = fp32's lowest) may hold any bytes: adaptive splits read none of them."""
    part_m, part_l, part_acc = _parts(4, 2, 3, 2)
    part_m[0, 1], part_acc[0, 1] = LOWEST, float("nan")
    sink = torch.zeros(2)
    got = RocmSparseAttnReduce()(part_m, part_l, part_acc, sink, adaptive=True)
    assert not got.isnan().any()
    _close(got, decode_reduce_reference(part_m, part_l, part_acc, sink, adaptive=True))


def test_writes_vllms_output_slice() -> None:
    """``output[:num_decode_tokens]`` of the layer's output: the prefill rows after it are untouched."""
    part_m, part_l, part_acc = _parts(5, 2, 2, 3)
    output = torch.full((4, 3, 512), 7.0, dtype=torch.bfloat16)
    RocmSparseAttnReduce()(part_m, part_l, part_acc, torch.zeros(3), out=output[:2])
    _close(output[:2], decode_reduce_reference(part_m, part_l, part_acc, torch.zeros(3)))
    assert (output[2:] == 7).all()


def test_launch_errors() -> None:
    part_m, part_l, part_acc = _parts(1, 1, 2, 2)
    kernel = RocmSparseAttnReduce()
    with pytest.raises(warmreg.LaunchError, match="part_acc must be"):
        kernel(part_m, part_l, part_acc[..., :500])
    with pytest.raises(warmreg.LaunchError, match="part_l must be"):
        kernel(part_m, part_l[:, :1], part_acc)
    with pytest.raises(warmreg.LaunchError, match="attn_sink must be"):
        kernel(part_m, part_l, part_acc, torch.zeros(1))
    with pytest.raises(warmreg.LaunchError, match="together, or neither"):
        kernel(part_m, part_l, part_acc, positions=torch.zeros(1, dtype=torch.int64))


def _plan(target: str, example: str = "deepseek_v4_flash", config: dict[str, object] | None = None) -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_sparse_attn_reduce.register, model=DSV4.from_config)
    return warmreg.plan(config or example_config(example), target=target, plugins=[plugin], entry_points=False)


def _keys(plan: warmreg.Plan) -> set[tuple[bool, bool, bool, str]]:
    keys = plan.kernel(RocmSparseAttnReduce.name).keys
    assert_warmup_inputs_reproduce(RocmSparseAttnReduce(), keys)
    return {(k.has_sink, k.adaptive, k.fuse_inv_rope, k.pos_dtype) for k in keys}


def test_planned_on_gfx942_and_gfx950() -> None:
    """gfx942: one key (the rotation fused); gfx950 with C128 layers: adaptive splits too."""
    assert _keys(_plan("rocm:gfx942")) == {(True, False, True, "int64")}
    assert _keys(_plan("rocm:gfx950+aiter")) == {(True, False, True, "int64"), (True, True, True, "int64")}


def test_fp8_wo_a_leaves_the_rotation_to_aiter() -> None:
    assert _keys(_plan("rocm:gfx950+aiter+aiter_fp8bmm")) == {(True, False, False, ""), (True, True, False, "")}


@pytest.mark.parametrize("target", ["rocm:gfx950+aiter+aiter_sparse_mla", "cuda:90"])
def test_not_planned_with_aiter_decode_or_off_rocm(target: str) -> None:
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_sparse_attn_reduce.register, model=DSV4.from_config)
    for target, n in (("rocm:gfx942", 1), ("rocm:gfx950", 2)):
        report = warmreg.warm(
            example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False, workers=1
        )
        assert report.ok and report.compiled == n, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        parts = _parts(2, 2, 3, 2)
        return OpCall(RocmSparseAttnReduce(), (*parts, torch.zeros(2)), {})

    check_out(build)
