"""Fused inverse RoPE + FP8 block quant against its PyTorch reference (Triton interpreter on CPU),
plus warm coverage of the example deployments and real cross-compiles (sm90 and sm100 scale formats)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import inv_rope_quant
from warmreg_deepseek_v4.inv_rope_quant import InvRopeFP8Quant, inv_rope_fp8_quant_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import EXACT, OpCall, RegisterPlugin, assert_allocates_nothing, assert_matches, garbage_like

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CONFIGS = [EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"]
NAME = InvRopeFP8Quant.name


def InvRopePlugin() -> RegisterPlugin:
    """Registers only this module's kernels."""
    return RegisterPlugin(inv_rope_quant.register, model=DSV4.from_config)


def make_inputs(
    tokens: int, heads: int = 4, *, head_stride: int = 512, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``o [T, H, 512]`` (a view with row stride ``head_stride`` at element ``offset``), positions, cache."""
    buffer = (torch.randn(offset + tokens * heads * head_stride) * 3).to(torch.bfloat16)
    o = buffer[offset:].as_strided((tokens, heads, 512), (heads * head_stride, head_stride, 1))
    if tokens:
        o[0, 0, :128] = 0.0  # an all-zero block: the 1e-10 floor
        o[0, 1, 128:256] = 448.0  # amax exactly 448: scale 1 (ceil(log2) exact at a power of two)
    angles = torch.rand(40, 32) * 6.3
    return o, torch.randint(0, 40, (tokens,)), torch.cat([angles.cos(), angles.sin()], dim=1)


def scale_storage(scale: torch.Tensor) -> torch.Tensor:
    """The whole scale buffer, padding rows (t >= T) included."""
    return torch.empty(0, dtype=scale.dtype).set_(scale.untyped_storage())


@pytest.mark.parametrize(
    ("tokens", "tma_aligned_scales", "head_stride", "offset"),
    [(5, False, 512, 0), (5, True, 512, 0), (1, False, 516, 4), (1, True, 516, 4)],
    ids=["sm90-fp32-scales", "sm100-ue8m0-words", "sm90-one-token-offset-view", "sm100-one-token-offset-view"],
)
def test_matches_reference(tokens: int, tma_aligned_scales: bool, head_stride: int, offset: int) -> None:
    torch.manual_seed(tokens + offset)
    o, positions, cos_sin = make_inputs(tokens, head_stride=head_stride, offset=offset)
    kernel = InvRopeFP8Quant()
    key = kernel.dispatch(
        o=o, cos_sin_cache=cos_sin, n_groups=2, quantize=True, tma_aligned_scales=tma_aligned_scales, launch_pdl=False
    )
    assert key.o_aligned == (offset == 0) and key.heads_per_group == 2
    out, scale = kernel(o, positions, cos_sin, 2, tma_aligned_scales=tma_aligned_scales, launch_pdl=False)
    ref_out, ref_scale = inv_rope_fp8_quant_reference(o, positions, cos_sin, 2, tma_aligned_scales=tma_aligned_scales)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (tokens, 2, 2 * 512)
    # Same fp32 operations in the same order, exact power-of-two scales: FP8 bytes and scales bit-exact.
    assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))
    assert scale is not None and ref_scale is not None
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0)
    padded = (tokens + 3) // 4 * 4
    k = 2 if tma_aligned_scales else 8
    assert scale.shape == (tokens, 2, k) and scale.stride() == (1, k * padded, padded)  # MN-major
    storage = scale_storage(scale).view(2, k, padded)
    assert int(storage[:, :, tokens:].abs().sum()) == 0  # TMA padding rows: zero scales
    if tma_aligned_scales:
        assert int(storage[0, 0, 0]) & 0xFF == 127 - 42  # zero block: 2**ceil(log2(1e-10 / 448)) = 2**-42
    else:
        assert float(storage[0, 4 * 1 + 1, 0]) == 1.0  # head 1, block 1 (all 448): scale exactly 1


def test_a_block_an_ulp_above_a_power_of_two_takes_vllms_fp32_log2_scale() -> None:
    """vLLM's scale is ``exp2(ceil(log2(amax * float32(1/448))))`` in fp32: for an amax one ulp above
    ``448 * 2**-9`` the fp32 log2 rounds to -9, so the block gets ``2**-9`` and that value saturates at 448
    (the exact ceiling would be -8 and code it 224). The rotation makes the fp32 amax: ``x = 1``, ``cos`` = it."""
    o, _, cos_sin = make_inputs(1)
    o.zero_()
    o[0, 0, 448] = 1.0
    above = torch.tensor(0.875).nextafter(torch.tensor(1.0))  # 448 * 2**-9 * (1 + 2**-23)
    cos_sin[0, 0], cos_sin[0, 32] = above, 0.0
    out, scale = InvRopeFP8Quant()(o, torch.zeros(1, dtype=torch.int64), cos_sin, 2, launch_pdl=False)
    assert scale is not None and float(scale[0, 0, 3]) == 2.0**-9
    assert float(out[0, 0, 448].float()) == 448.0


def test_unquantized_path_and_empty_batch() -> None:
    torch.manual_seed(3)
    o, positions, cos_sin = make_inputs(3)
    out, scale = InvRopeFP8Quant()(o, positions, cos_sin, 2, quantize=False, launch_pdl=False)
    ref_out, _ = inv_rope_fp8_quant_reference(o, positions, cos_sin, 2, quantize=False)
    assert scale is None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)  # one fp32 rotation, RNE to bf16: exact
    o, positions, cos_sin = make_inputs(0)
    out, scale = InvRopeFP8Quant()(o, positions, cos_sin, 2, tma_aligned_scales=True)
    assert out.shape == (0, 2, 1024) and scale is not None and scale.shape == (0, 2, 2)


def test_launch_errors() -> None:
    o, positions, cos_sin = make_inputs(2)
    kernel = InvRopeFP8Quant()
    with pytest.raises(warmreg.LaunchError, match="groups"):
        kernel(o, positions, cos_sin, 3)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(o, positions.int(), cos_sin, 2)
    with pytest.raises(warmreg.LaunchError, match="bfloat16"):
        kernel(o.float(), positions, cos_sin, 2)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_runtime_keys_are_planned(config: Path, target: str) -> None:
    """Runtime-shaped attention outputs of the example deployments give keys that the plan warms."""
    plan = warmreg.plan(config, target=target, plugins=[InvRopePlugin()], entry_points=False)
    platform = warmreg.Platform.parse(target)
    if platform.is_rocm:  # aiter's inverse_rope_group_quant serves ROCm
        assert NAME in {s.kernel for s in plan.skipped}
        return
    cfg = warmreg.WarmConfig.load(config)
    m = DSV4.from_config(cfg)
    tp = cfg.serving["tensor_parallel_size"]
    heads, groups = m.num_attention_heads // tp, m.o_groups // tp
    keys = plan.kernel(NAME).keys
    cos_sin = warmreg.meta((65536 * 16, m.qk_rope_head_dim), torch.float32)
    for tokens in (1, 3, 4, 17, 4096, cfg.serving["max_num_batched_tokens"]):
        # the sparse-MLA output buffer, sliced to this step's tokens
        o = warmreg.meta((cfg.serving["max_num_batched_tokens"], heads, m.head_dim), torch.bfloat16)[:tokens]
        key = InvRopeFP8Quant().dispatch(
            o=o, cos_sin_cache=cos_sin, n_groups=groups, quantize=True,
            tma_aligned_scales=platform.sm >= 100, launch_pdl=platform.supports_pdl,
        )  # fmt: skip
        assert key in keys, key
    assert len(keys) == 1


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    """fp32 MN-major scales (sm90) and packed UE8M0 words (sm100), PDL on: both compile for real."""
    report = warmreg.warm(
        CONFIGS[1], target=target, plugins=[InvRopePlugin()], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    assert len(report.results) == 1
    # compiled now (fresh TRITON_CACHE_DIR), unless an earlier test of this process warmed the same target
    assert report.compiled > 0 or all(r.status == "memory" for r in report.results)


# -- out= (the kit's checks): group-major buffers whose transposed views come back ------------------------------
def _out_call(packed_scales: bool) -> OpCall:
    torch.manual_seed(5)
    o, positions, cos_sin = make_inputs(5)  # T = 5: three TMA padding rows of scales
    return OpCall(InvRopeFP8Quant(), (o, positions, cos_sin, 2), dict(tma_aligned_scales=packed_scales, launch_pdl=False))


def _out_buffers(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Garbage buffers for the outputs: ``[G, T, hpg * D]`` and ``[G, K, round_up(T, 4)]``."""
    return garbage_like(values.transpose(0, 1)), garbage_like(scale_storage(scale).view(scale.shape[1], scale.shape[2], -1))


@pytest.mark.parametrize("packed_scales", [False, True], ids=["fp32-scales", "ue8m0-words"])
def test_out_returns_views_of_the_buffers(packed_scales: bool) -> None:
    call = _out_call(packed_scales)
    want_values, want_scale = call()
    values, storage = _out_buffers(want_values, want_scale)
    got_values, got_scale = call(out=(values, storage))
    assert got_values.data_ptr() == values.data_ptr() and got_values.untyped_storage().data_ptr() == values.data_ptr()
    assert got_scale is not None and got_scale.untyped_storage().data_ptr() == storage.data_ptr()
    assert got_scale.stride() == want_scale.stride()  # MN-major, as fresh
    assert_matches((got_values, got_scale), (want_values, want_scale), EXACT)
    assert_matches(storage.flatten(), scale_storage(want_scale), EXACT)  # the padding rows' zero scales too


@pytest.mark.parametrize("packed_scales", [False, True], ids=["fp32-scales", "ue8m0-words"])
def test_launch_with_out_allocates_nothing(packed_scales: bool) -> None:
    call = _out_call(packed_scales)
    assert_allocates_nothing(call, _out_buffers(*call.launch_code().outputs))


def test_without_quantize_out_takes_no_scales() -> None:
    o, positions, cos_sin = make_inputs(3)
    kernel = InvRopeFP8Quant()
    want, _ = kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False)
    values = garbage_like(want.transpose(0, 1))
    got, scale = kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False, out=(values, None))
    assert scale is None and got.untyped_storage().data_ptr() == values.data_ptr()
    assert_matches(got, want, EXACT)
    with pytest.raises(warmreg.LaunchError, match=re.escape("out[1] must be None")):
        kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False, out=(values, torch.zeros(4)))
