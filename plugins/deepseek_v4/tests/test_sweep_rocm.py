"""The DeepSeek-V4 sweep driver on ROCm plans (:mod:`warmreg_deepseek_v4.sweep_rocm`): every planned ROCm op is
launched through Triton's interpreter with engine-shaped inputs, misses nothing and matches its PyTorch reference.

``tests/test_sweep_cpu.py`` runs Flash on ``rocm:gfx950+aiter`` (the in-tree prefill: ROCm's combine, the
compactions, the C4 decode top-k stream); these cover the other two paths: aiter's sparse MLA prefill (the prefill
top-k slots) and the FP8 indexer's localization of aiter's prefill top-k. Three steps (decode, prefill, mixed) of at
most three tokens, as the CPU sweep test runs them; a few CPU seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from warmreg_deepseek_v4.sweep import DSV4Sweep
from warmreg_deepseek_v4.sweep_rocm import ROCM_DRIVES

import warmreg
from warmreg.testing.sweep import driver_for, run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _sweep(config: dict[str, Any], target: str, seed: int = 36) -> tuple[warmreg.Plan, dict[str, Any]]:
    """Three steps of the driver on ``target``'s plan, under the monitor in ``error`` mode (as the CPU sweep)."""
    plan = warmreg.plan(config, target=target)
    assert driver_for(plan) is DSV4Sweep
    return plan, run_steps(plan, seed)


def _flash(**serving: Any) -> dict[str, Any]:
    config = json.loads((EXAMPLES / "deepseek_v4_flash.json").read_text())
    config["serving"].update(serving)
    return config


def _assert_rocm_ops_driven(plan: warmreg.Plan, run: dict[str, Any]) -> set[str]:
    """Every planned ROCm op launched, without a miss or a failure, its first launch matching its reference."""
    assert run["step_failures"] == [] and run["not_launched"] == []
    rocm = {kp.name for kp in plan.kernels} & ROCM_DRIVES
    for name in rocm:
        k = run["kernels"][name]
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 and k["monitor_agrees"], (name, k)
        assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
    return rocm


def test_aiter_sparse_mla_prefill_drives_the_prefill_top_k_slots() -> None:
    """Flash on ``rocm:gfx950+aiter+aiter_sparse_mla``: prefill reads the caches in place, so the top-k slots of the
    C4 and C128 layers and their compaction run, and ROCm's combine is neither planned nor launched."""
    plan, run = _sweep(_flash(), "rocm:gfx950+aiter+aiter_sparse_mla")
    rocm = _assert_rocm_ops_driven(plan, run)
    assert "deepseek_v4.rocm_prefill_topk_slots" in rocm and "deepseek_v4.rocm_combine_topk_swa_indices" not in rocm
    slots = run["kernels"]["deepseek_v4.rocm_prefill_topk_slots"]
    assert slots["launches"] >= 2  # a C4 and a C128 layer type on each step with prefill tokens
    # the compactions: the SWA builder's decode and prefill rows, the C128 builder's, each layer's prefill slots
    assert (
        run["kernels"]["deepseek_v4.rocm_ragged_compact"]["launches"]
        > run["kernels"]["deepseek_v4.rocm_topk_lens"]["launches"]
    )


@pytest.mark.parametrize("target", ["rocm:gfx950+aiter", "rocm:gfx942"])
def test_fp8_indexer_drives_the_localization_on_gfx950_with_aiter(target: str) -> None:
    """The FP8 indexer (``serving.indexer_kv_dtype`` ``fp8``): on gfx950 with aiter each indexer prefill chunk's top-k
    is localized (and must come back request-local); gfx942 has no aiter top-k, so nothing is localized. Seed 30 draws
    prefills of 4+ tokens (seed 36's are shorter): each indexer chunk gathers compressed K rows (``seq_len // 4``)."""
    plan, run = _sweep(_flash(indexer_kv_dtype="fp8"), target, seed=30)
    rocm = _assert_rocm_ops_driven(plan, run)
    assert ("deepseek_v4.rocm_localize_topk" in rocm) == target.startswith("rocm:gfx950")
    assert "deepseek_v4.rocm_combine_topk_swa_indices" in rocm and "deepseek_v4.compress_pool" not in run["kernels"]


def test_the_driver_drives_every_rocm_op_the_plugin_registers() -> None:
    """Each ``rocm_*`` kernel any ROCm target plans for the examples is one the driver declares (and launches):
    gfx942's and gfx950's, and gfx1250's single-pass decode (every other arch plans a subset of these)."""
    planned = set()
    for example in ("deepseek_v4_flash", "deepseek_v4_pro"):
        config = _flash(indexer_kv_dtype="fp8") if example == "deepseek_v4_flash" else str(EXAMPLES / f"{example}.json")
        for target in ("rocm:gfx942", "rocm:gfx950+aiter", "rocm:gfx950+aiter+aiter_sparse_mla", "rocm:gfx1250"):
            planned |= {kp.name for kp in warmreg.plan(config, target=target).kernels if ".rocm_" in kp.name}
    assert planned == ROCM_DRIVES and ROCM_DRIVES <= DSV4Sweep.drives


@pytest.mark.parametrize("target", ["rocm:gfx1250", "rocm:gfx1201"])
def test_single_pass_decode_off_gfx942_and_gfx950(target: str) -> None:
    """gfx1250 and RDNA: each layer type's decode is the single-pass kernel (no split-KV partial, no reduce), checked
    against its reference; the standalone inverse RoPE then rotates every row, decode rows included (vLLM does not
    fold it into decode there)."""
    plan, run = _sweep(_flash(), target)
    rocm = _assert_rocm_ops_driven(plan, run)
    assert "deepseek_v4.rocm_sparse_attn_decode_ragged" in rocm
    assert not {"deepseek_v4.rocm_sparse_attn_decode_partial", "deepseek_v4.rocm_sparse_attn_reduce"} & rocm
    # decode steps reach SWA-only, C4 and C128 layers: one launch a layer type with decode tokens
    assert run["kernels"]["deepseek_v4.rocm_sparse_attn_decode_ragged"]["launches"] >= 3
