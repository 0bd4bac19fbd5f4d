"""DeepSeek-V4.1's gfx950 inverse RoPE + MXFP8 quant of the prefill attention rows against its PyTorch reference under
Triton's interpreter (hand-picked rows, views, an empty step, errors, out=, warmup inputs), the plan (gfx950 without
aiter's sparse MLA only) and the V4.1 sweep driving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.sweep_inputs import rope_cache
from warmreg_deepseek_v4.v41_rocm_inverse_rope_mxfp8 import RocmInverseRopeMxfp8, inverse_rope_mxfp8_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader
from warmreg.testing.sweep import run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16 = torch.bfloat16
NAME = RocmInverseRopeMxfp8.name


def test_by_hand() -> None:
    """D = 64, R = 32. Position 0 (cos 1, sin 0): the row unchanged; block 0's amax 448 gives scale 127 and the values
    as they are, block 1's amax 7 gives ``ceil(log2(7 / 448)) + 127 = 121`` and the values times 64. Position 1 has
    ``c = 0, s = 1`` on every RoPE pair: ``(a, b) -> (b, -a)`` there, NoPE lanes untouched."""
    cache = torch.zeros(2, 32)
    cache[0, :16] = 1.0
    cache[1, 16:] = 1.0
    row = torch.cat((torch.arange(32.0) - 16, torch.arange(32.0) % 8))
    row[5] = 448.0
    o = torch.stack((row, row))[:, None].to(BF16)
    data, scale = RocmInverseRopeMxfp8()(o, torch.tensor([0, 1]), cache, rope_head_dim=32)
    assert scale.tolist() == [[127, 121], [127, 121]]
    assert torch.equal(data[0].float(), torch.cat((row[:32], row[32:] * 64)))
    swapped = torch.stack((row[33::2], -row[32::2]), -1).flatten()
    assert torch.equal(data[1].float(), torch.cat((row[:32], swapped * 64)))


def _interpreter_e4m3_ok(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the e4m3 values agree within one e4m3 step (Triton 3.8's interpreter does not round fp32 -> e4m3 to
    nearest even) or differ only by the interpreter losing the exponent carry of a rounding that crosses a binade (it
    stores 31.4 as 16 where the GPU and torch round to 32). The comparison with vLLM's own kernel (the same
    conversions) is exact: tests/engines/test_vllm034_kernels_dsv41_rocm2.py."""
    g, w = got.float(), want.float()
    return ((g - w).abs() <= torch.maximum(w.abs() / 8, torch.tensor(2.0**-9))) | (g * 2 == w)  # 2^-9: a subnormal step


@pytest.mark.parametrize(("t", "heads", "pos_dtype"), [(5, 3, torch.int64), (2, 8, torch.int32), (0, 2, torch.int64)])
def test_matches_reference(t: int, heads: int, pos_dtype: torch.dtype) -> None:
    """V4.1's 512-wide heads (448 NoPE + 64 RoPE) as a head slice of a wider buffer, a longer position vector, an
    empty step. Scales bitwise; values within one e4m3 step or halved by a lost carry (:func:`_interpreter_e4m3_ok`)."""
    g = torch.Generator().manual_seed(t + heads)
    buf = (torch.randn(t, heads + 2, 512, generator=g) * 3).to(BF16)
    o = buf[:, 1 : heads + 1]
    positions = torch.randint(0, 40, (t + 3,), generator=g).to(pos_dtype)
    cache = rope_cache(40, 64, 10000.0, torch.device("cpu"))
    data, scale = RocmInverseRopeMxfp8()(o, positions, cache, rope_head_dim=64)
    want_data, want_scale = inverse_rope_mxfp8_reference(o, positions, cache, rope_head_dim=64)
    assert torch.equal(scale, want_scale) and data.shape == (t, heads * 512)
    assert data.dtype == torch.float8_e4m3fn and _interpreter_e4m3_ok(data, want_data).all()
    assert t == 0 or (data.float() == want_data.float()).float().mean() > 0.8  # most values need no rounding excuse


def test_errors_and_out() -> None:
    op, cache = RocmInverseRopeMxfp8(), torch.zeros(4, 64)
    o, pos = torch.zeros(3, 2, 512, dtype=BF16), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(warmreg.LaunchError, match="o must be"):
        op(o.transpose(1, 2), pos, cache, rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="head dim"):
        op(o[..., :96], pos, cache, rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="rope_head_dim"):
        op(o, pos, cache, rope_head_dim=63)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        op(o, pos[:2], cache, rope_head_dim=64)
    with pytest.raises(warmreg.LaunchError, match="cos_sin_cache"):
        op(o, pos, cache.to(BF16), rope_head_dim=64)
    check_out(lambda: OpCall(RocmInverseRopeMxfp8(), (o, pos, cache), dict(rope_head_dim=64)))


# -- the plan --------------------------------------------------------------------------------------------------------
def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    return config


@pytest.mark.parametrize("target", ["rocm:gfx950", "rocm:gfx950+aiter"])
def test_planned_on_gfx950_with_the_in_tree_prefill(target: str) -> None:
    """Flash at TP 8: 8 heads of 448 + 64 lanes, one key."""
    plan = warmreg.plan(_config(), target=target)
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == dict(
        head_dim=512, nope=448, half=32, dtype="bfloat16", data_dtype="float8_e4m3fn", pos_dtype="int64",
        cos_sin_dtype="float32", num_warps=4,
    )  # fmt: skip
    assert_warmup_inputs_reproduce(RocmInverseRopeMxfp8(), [key])


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter+aiter_sparse_mla"])
def test_not_planned_without_mxfp8_rows_or_under_aiter_sparse_mla(target: str) -> None:
    """gfx942's attention output is bf16 (``_alloc_attn_out``); aiter's sparse MLA prefill quantizes its own rows."""
    assert NAME not in {k.name for k in warmreg.plan(_config(), target=target).kernels}
    cuda = warmreg.plan(example_config("deepseek_v41"), target="cuda:100")
    assert NAME not in {k.name for k in cuda.kernels}


def test_sweep_drives_it() -> None:
    """Three CPU sweep steps on gfx950: the prefill steps' rows launch it under the monitor in ``error`` mode,
    matching the reference."""
    plan = warmreg.plan(_config(max_num_seqs=2), target="rocm:gfx950")
    run = run_steps(plan, 38)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    k = run["kernels"][NAME]
    assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0, k
    assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
