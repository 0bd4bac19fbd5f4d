"""DeepSeek-V4.1's ROCm sparse MLA decode (``warmreg_deepseek_v4.v41_rocm_attention``): which keys each ROCm arch
plans for V4.1's layer kinds, that their warmup inputs reproduce them and compile, and that the V4.1 sweep launches
them against their references.

The kernels themselves (math, strides, errors, out=) are DeepSeek-V4's ops, tested in ``test_rocm_sparse_attn_*.py``
and against vLLM 0.34's own kernels in ``tests/engines/test_vllm034_kernels_dsv4_rocm_attn.py``; V4.1 calls the same
``rocm_sparse_attn_decode`` with the same head geometry (512 = 448 NoPE + 64 RoPE lanes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41, v41_rocm_attention
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_inverse_rope import RocmInverseRope
from warmreg_deepseek_v4.sweep import DSV4Sweep
from warmreg_deepseek_v4.v41_rocm_attention import V41RocmDecodePartial, V41RocmDecodeRagged, V41RocmDecodeReduce

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader
from warmreg.testing.sweep import driver_for, run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
PARTIAL, REDUCE, RAGGED, INV_ROPE = (
    "deepseek_v4." + n
    for n in ("rocm_sparse_attn_decode_partial", "rocm_sparse_attn_reduce", "rocm_sparse_attn_decode_ragged",
              "rocm_inverse_rope")
)  # fmt: skip
DECODE = {PARTIAL, REDUCE, RAGGED, INV_ROPE}


def _config(ratios: list[int] | None = None, **serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    if ratios is not None:
        text = config["model"]["text_config"]
        text["compress_ratios"] = [ratios[i % len(ratios)] for i in range(text["num_hidden_layers"])]
    return config


def _keys(plan: warmreg.Plan, name: str) -> list[dict[str, Any]]:
    return [k.fields() for k in plan.kernel(name).keys]


def _names(plan: warmreg.Plan) -> set[str]:
    return {k.name for k in plan.kernels}


def test_gfx942_plans_the_partial_pass_per_layer_kind_and_one_reduce() -> None:
    """SWA-only and compressed layers (the SWA cache FNUZ on gfx942), and the reduce with the sink, the inverse RoPE at
    int64 positions, no adaptive splits."""
    plan = warmreg.plan(_config(), target="rocm:gfx942")
    assert _names(plan) & DECODE == {PARTIAL, REDUCE, INV_ROPE}
    common = {"q_dtype": "bfloat16", "nope": 448, "nope_block": 512, "rope": 64, "fnuz_main": True,
              "fnuz_extra": False, "block_h": 16, "block_k": 32, "num_stages": 1, "num_warps": 4}  # fmt: skip
    assert _keys(plan, PARTIAL) == [{**common, "has_extra": False}, {**common, "has_extra": True}]
    assert _keys(plan, REDUCE) == [
        {"has_sink": True, "adaptive": False, "comb_dim": 512, "fuse_inv_rope": True, "nope": 448, "half": 32,
         "out_dtype": "bfloat16", "pos_dtype": "int64", "num_warps": 4}
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(V41RocmDecodePartial(), plan.kernel(PARTIAL).keys)
    assert_warmup_inputs_reproduce(V41RocmDecodeReduce(), plan.kernel(REDUCE).keys)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx90a"])
def test_the_unrotated_rows_take_deepseek_v4s_inverse_rope_key(target: str) -> None:
    """``forward_mqa``'s ``rocm_inverse_rope_rows_`` off gfx950: bf16 rows of 448 NoPE and 64 RoPE lanes, int64
    positions."""
    plan = warmreg.plan(_config(), target=target)
    assert _keys(plan, INV_ROPE) == [
        {"dtype": "bfloat16", "pos_dtype": "int64", "nope": 448, "half": 32, "block_nope": 512, "block_half": 32,
         "num_warps": 4}
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(RocmInverseRope(), plan.kernel(INV_ROPE).keys)


@pytest.mark.parametrize(
    ("ratios", "extras"), [([1], [True]), ([0], [False]), ([0, 1], [False, True]), ([2, 1], [True])]
)
def test_a_ratio_1_layer_reads_the_compressed_cache(ratios: list[int], extras: list[bool]) -> None:
    """V4.1's compressed ratios are 1 and 2 (DeepSeek-V4's ops read a compressed layer as a ratio above 1): a model
    of ratio-1 layers alone plans the extra segment; SWA-only layers (the MTP layer past ``compress_ratios`` is
    SWA-only) do not."""
    plan = warmreg.plan(_config(ratios), target="rocm:gfx942")
    mtp = [False] if DSV4.from_config(plan.config).ratios[-1] == 0 else []
    assert sorted({k["has_extra"] for k in _keys(plan, PARTIAL)}) == sorted(set(extras + mtp))


@pytest.mark.parametrize("target", ["rocm:gfx90a", "rocm:gfx1250"])
def test_other_archs_plan_the_single_pass_decode(target: str) -> None:
    plan = warmreg.plan(_config(), target=target)
    assert _names(plan) & DECODE == {RAGGED, INV_ROPE}
    keys = _keys(plan, RAGGED)
    assert [(k["has_sink"], k["has_extra"], k["block_k"], k["num_warps"]) for k in keys] == [
        (True, False, 16, 8), (True, True, 16, 8)
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(V41RocmDecodeRagged(), plan.kernel(RAGGED).keys)


@pytest.mark.parametrize("target", ["rocm:gfx950", "rocm:gfx950+aiter", "rocm:gfx950+aiter+aiter_sparse_mla"])
def test_nothing_on_gfx950(target: str) -> None:
    """gfx950's decode writes MXFP8 through the reduce's ``QUANT_OUT`` (not reproduced yet) and its prefill rows take
    the MXFP8 inverse RoPE; with aiter's sparse MLA the decode is aiter's kernel."""
    assert not _names(warmreg.plan(_config(), target=target)) & DECODE


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_nothing_on_cuda(target: str) -> None:
    assert not _names(warmreg.plan(example_config("deepseek_v41"), target=target)) & DECODE


def test_warm_cross_compiles_for_gfx942_and_gfx90a() -> None:
    """The decode's keys (gfx942: partial pass for both layer kinds, reduce, inverse RoPE; gfx90a: the single-pass
    decode and the inverse RoPE), and on both the in-tree prefill's three combines and its sparse attention."""
    plugin = RegisterPlugin(v41_rocm_attention.register, model=DSV4.from_config)
    for target, n in (("rocm:gfx942", 8), ("rocm:gfx90a", 7)):
        report = warmreg.warm(_config(), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == n, [(r.kernel, r.error) for r in report.failed]


def test_listed_in_rocm_op_modules() -> None:
    assert v41_rocm_attention in v41.ROCM_OP_MODULES and v41_rocm_attention not in v41.OP_MODULES


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx90a"])
def test_sweep_launches_the_decode_against_its_references(target: str) -> None:
    """Three steps (decode, prefill, mixed) of at most three tokens under the monitor in ``error`` mode: every planned kernel
    launched, the decode kernels at least once for each layer kind, matching their references."""
    plan = warmreg.plan(_config(max_num_seqs=4), target=target)
    assert issubclass(driver_for(plan), DSV4Sweep)
    run = run_steps(plan, 7)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    for name in _names(plan) & DECODE:
        k = run["kernels"][name]
        assert k["launches"] >= 2 and k["failures"] == 0 and k["misses"] == 0, (name, k)
        assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]


@pytest.mark.parametrize(("target", "name"), [("rocm:gfx942", PARTIAL), ("rocm:gfx942", REDUCE), ("rocm:gfx1250", RAGGED)])
def test_out_of_the_v41_decode_ops(target: str, name: str) -> None:
    """V4.1's decode ops are DeepSeek-V4's over V4.1's layer kinds: the same ``out=`` contract, on the first key
    V4.1's plan warms (its warm-up inputs, zero-filled, under Triton's interpreter)."""
    from warmreg.testing import OpCall, check_out, materialize

    plan = warmreg.plan(_config(), target=target)
    key = plan.kernel(name).keys[0]
    op = {PARTIAL: V41RocmDecodePartial, REDUCE: V41RocmDecodeReduce, RAGGED: V41RocmDecodeRagged}[name]()
    inputs = {k: materialize(v) for k, v in op.warmup_inputs(key).items() if k != "out"}

    def build() -> OpCall:
        if name == PARTIAL:
            return OpCall(V41RocmDecodePartial(), (), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        if name == REDUCE:
            return OpCall(V41RocmDecodeReduce(), (), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        return OpCall(V41RocmDecodeRagged(), (), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})

    with bf16_dot_by_value():
        check_out(build)
