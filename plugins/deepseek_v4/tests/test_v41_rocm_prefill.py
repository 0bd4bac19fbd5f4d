"""DeepSeek-V4.1's in-tree ROCm prefill (``DeepseekV41ROCMAiterMLAAttention._forward_prefill``, vLLM 0.34
``models/deepseek_v41/amd/rocm.py``): which keys each ROCm arch plans for its kernels (the K gathers, V4.1's
``combine_topk_swa_indices``, ``rocm_sparse_attn_prefill`` and its compaction of the combined rows), that vLLM's call
site arguments launch exactly those keys, that nothing is planned where aiter's sparse MLA takes prefill, and that the
V4.1 sweep's prefill steps launch them against their references.

The kernels themselves are tested in ``test_v41_rocm_gather_k.py``, ``test_v41_combine_indices.py``,
``test_rocm_sparse_attn_prefill.py`` and ``test_rocm_ragged.py``, and against vLLM's own kernels in
``tests/engines/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sweep import DSV4Sweep
from warmreg_deepseek_v4.v41_rocm_attention import register

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader
from warmreg.testing.sweep import driver_for, run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
P = "deepseek_v4."
GATHER, COMBINE, PREFILL, COUNT, COMPACT = (
    P + n
    for n in ("v41_rocm_gather_k_cache", "v41_combine_topk_swa_indices", "rocm_sparse_attn_prefill",
              "rocm_ragged_count", "rocm_ragged_compact")
)  # fmt: skip
IN_TREE = {GATHER, COMBINE, PREFILL}
I32, BF16, F32 = torch.int32, torch.bfloat16, torch.float32


def _config(ratios: list[int] | None = None, **serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    if ratios is not None:
        text = config["model"]["text_config"]
        text["compress_ratios"] = [ratios[i % len(ratios)] for i in range(text["num_hidden_layers"])]
    return config


def _names(plan: warmreg.Plan) -> set[str]:
    return {k.name for k in plan.kernels}


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter", "rocm:gfx950", "rocm:gfx1250"])
def test_in_tree_prefill_plans_each_layer_kind(target: str) -> None:
    """V4.1's combine for SWA-only layers (top-k 0) and ratios 1 and 2 (the indexer's top-k), the sparse prefill with
    the layer's sink, and the compaction of the combined rows (128 and 640 wide: blocks 128 and 1024) beside the decode
    SWA rows."""
    plan = warmreg.plan(_config(), target=target)
    assert _names(plan) >= IN_TREE
    model = DSV4.from_config(plan.config)
    combine = {
        (k.fields()["compress_ratio"], k.fields()["top_k"], k.fields()["width"]) for k in plan.kernel(COMBINE).keys
    }
    assert combine == {(0, 0, 128), (1, model.index_topk, 640), (2, model.index_topk, 640)}
    (key,) = plan.kernel(PREFILL).keys
    assert key.fields() | {"has_sink": True, "out_dv": 512, "q_dtype": "bfloat16"} == key.fields()
    assert {k.fields()["block_w"] for k in plan.kernel(COMPACT).keys} == {128, 1024}
    assert {k.fields()["block_w"] for k in plan.kernel(COUNT).keys} == {128, 1024}


def test_swa_only_models_combine_without_top_k() -> None:
    plan = warmreg.plan(_config(ratios=[0]), target="rocm:gfx942")
    assert {k.fields()["compress_ratio"] for k in plan.kernel(COMBINE).keys} == {0}
    assert {k.fields()["block_w"] for k in plan.kernel(COMPACT).keys} == {128}


def test_not_planned_where_aiter_sparse_mla_takes_prefill() -> None:
    plan = warmreg.plan(_config(), target="rocm:gfx950+aiter+aiter_sparse_mla")
    assert not _names(plan) & IN_TREE
    assert {k.fields()["block_w"] for k in plan.kernel(COMPACT).keys} == {128}


def test_the_call_sites_launch_the_planned_keys() -> None:
    """``_forward_prefill``'s arguments for a chunk of 3 prefills (M = N + window + batched tokens) launch the
    planned combine and sparse-prefill keys: ``q[query_start:query_end]`` of the layer's heads, the workspace
    ``kv.view(-1, 1, D)`` rows, the layer's sink; the combine's topk rows a slice of the persistent buffer."""
    plan = warmreg.plan(_config(tensor_parallel_size=8), target="rocm:gfx942")
    model = DSV4.from_config(plan.config)
    heads = model.num_attention_heads // 8
    combine, prefill = plan.kernel(COMBINE), plan.kernel(PREFILL)
    buf = warmreg.meta((64, model.index_topk), I32)
    for ratio in (0, 1, 2):
        top_k = model.index_topk if ratio else 0
        args = (buf[5:20], warmreg.meta((4,), I32), warmreg.meta((3,), I32), warmreg.meta((3,), I32))
        kw = {"top_k": top_k, "compress_ratio": ratio, "M": 9000, "N": 4096 if ratio else 0}
        assert OpCall(combine.kernel, args, kw).launch_code().key in combine.keys
    q = warmreg.meta((40, heads, model.head_dim), BF16)[3:20]
    kv = warmreg.meta((3 * 9000, model.head_dim), BF16)
    args_p = (q, kv, warmreg.meta((900,), I32), warmreg.meta((18,), I32), warmreg.meta((heads,), F32))
    assert OpCall(prefill.kernel, args_p, {"scale": model.head_dim**-0.5}).launch_code().key in prefill.keys
    assert_warmup_inputs_reproduce(combine.kernel, list(combine.keys))
    assert_warmup_inputs_reproduce(prefill.kernel, list(prefill.keys))


def test_warm_cross_compiles_for_gfx1250() -> None:
    """V4.1's ROCm attention on an arch off gfx942 / gfx950: the single-pass decode and the inverse RoPE of the
    unrotated rows (one key each), the three combines and the sparse prefill."""
    plugin = RegisterPlugin(register, model=DSV4.from_config)
    report = warmreg.warm(_config(), target="rocm:gfx1250", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled >= 4, [(r.kernel, r.error) for r in report.failed]
    assert {r.kernel for r in report.results} >= {COMBINE, PREFILL}


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter"])
def test_sweep_prefill_steps_launch_the_in_tree_prefill(target: str) -> None:
    """Three steps (decode, prefill, mixed) under the monitor in ``error`` mode: every planned kernel launched, the
    in-tree prefill's kernels once for each layer kind at least, the first launch of each matching its reference."""
    plan = warmreg.plan(_config(max_num_seqs=4), target=target)
    assert issubclass(driver_for(plan), DSV4Sweep)
    run = run_steps(plan, 11)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    for name in IN_TREE | {COUNT, COMPACT}:
        k = run["kernels"][name]
        assert k["launches"] >= 2 and k["failures"] == 0 and k["misses"] == 0, (name, k)
        assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), (name, k)
