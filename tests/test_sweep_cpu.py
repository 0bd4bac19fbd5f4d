"""The zero-JIT sweep (``benchmarks/sweep.py``) on the CPU: each example config's plan kernels all launch
through Triton's interpreter, with engine-shaped inputs, one step of each kind, and nothing fails. The drivers
come from the plugins through the ``warmreg.sweep`` entry points (``warmreg.testing.sweep``)."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import warmreg
from warmreg.testing import sweep as kit

ROOT = Path(__file__).resolve().parents[1]


def _sweep_module() -> ModuleType:
    """``benchmarks/sweep.py``, imported from its path (benchmarks is not a package)."""
    name = "warmreg_benchmarks_sweep"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "sweep.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3", "kimi_k3_dsa", "deepseek_v41"])
def test_sweep_launches_every_plan_kernel(example: str) -> None:
    sweep = _sweep_module()
    config = str(ROOT / "examples" / f"{example}.json")
    # Tiny sizes: the interpreter runs the programs one by one in Python (the indexer Q kernel has 64 per token,
    # the inverse RoPE 4 x heads per launch). Three tokens a step are the fewest that give the first (decode-only)
    # step unequal decode lengths (2 + 1 under MTP 1: the indexer's pack / unpack), then a prefill-only and a
    # mixed step.
    run = sweep.run_config(config, steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2)
    assert run["step_kinds"] == {"decode": 1, "prefill": 1, "mixed": 1}
    assert run["step_failures"] == []
    planned = {kp.name for kp in warmreg.plan(config, target=sweep.CPU_TARGET).kernels}
    assert set(run["kernels"]) == planned
    for name, k in run["kernels"].items():
        assert k["launches"] >= 1, f"{name} was never launched"
        assert k["failures"] == 0, f"{name}: {k['failure_messages']}"
        assert k["misses"] == 0, f"{name}: {k['miss_explanations']}"
        assert k["monitor_agrees"], f"{name}: the monitor counted {k['monitor']}, the sweep {k['launches']} launches"
        assert all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
    assert any(k["checks"] for k in run["kernels"].values())  # the first launches were checked
    # The CPU has no PDL: launch_pdl is the only field in which a launched key may differ from the cuda:90 plan.
    assert all(o["platform_only"] for o in run["keys_outside_plan"]), run["keys_outside_plan"]


@pytest.mark.slow
def test_sweep_drives_the_dspark_draft_step() -> None:
    """DeepSeek-V4-Flash-0731 with DSpark: each target step is followed by a draft step (its inputs, its non-causal
    SWA indices, the SWA-only draft layers on 5 tokens a request). Seven tokens a step are the fewest that give the
    first step unequal decode lengths under 1 + 5 (6 + 1: the indexer's pack / unpack). About 2 CPU minutes."""
    sweep = _sweep_module()
    config = str(ROOT / "examples" / "deepseek_v4_flash_0731_dspark.json")
    run = sweep.run_config(config, steps=3, seed=36, device="cpu", max_tokens=7, max_seq_len=16, max_seqs=2)
    assert run["step_failures"] == [] and run["not_launched"] == []
    assert set(run["kernels"]) == {kp.name for kp in warmreg.plan(config, target=sweep.CPU_TARGET).kernels}
    for name, k in run["kernels"].items():
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 and k["monitor_agrees"], (name, k)
        assert all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
    assert all(o["platform_only"] for o in run["keys_outside_plan"]), run["keys_outside_plan"]


def test_sweep_drives_deepseek_v41_on_sm100() -> None:
    """DeepSeek-V4.1's plan for cuda:100: the fused Q/KV norm + MXFP8 query quant replaces the shared RMSNorm and the
    inverse RoPE is not planned (DeepGEMM's MXFP8 wo_a); every planned kernel launches, through the same driver as
    the V4 examples (DSV4Sweep builds its V4.1 subclass). About 7 CPU seconds."""
    sweep = _sweep_module()
    config = str(ROOT / "examples" / "deepseek_v41.json")
    run = sweep.run_config(
        config, steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2, target="cuda:100"
    )
    assert run["step_failures"] == [] and run["not_launched"] == []
    planned = {kp.name for kp in warmreg.plan(config, target="cuda:100").kernels}
    assert set(run["kernels"]) == planned and "deepseek_v4.v41_q_kv_norm_quant" in planned
    for name, k in run["kernels"].items():
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 and k["monitor_agrees"], (name, k)
        assert all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
    assert all(o["platform_only"] for o in run["keys_outside_plan"]), run["keys_outside_plan"]


def test_sweep_drives_deepseek_v41_dspark_fused_markov(tmp_path: Path) -> None:
    """DeepSeek-V4.1 as a DSpark deployment with vLLM's fused Markov sampler (``dspark_fused_markov``, probabilistic
    drafts; the vocabulary and Markov rank of DeepSeek-V4's DSpark example): after each target step every request
    drafts through the sample and select kernels, each checked against its reference, and every planned kernel
    launches; before them the draft's inputs and non-causal SWA rows (DeepSeek-V4's DSpark kernels, V4.1's 32-token
    pages), checked against their references. One draft token keeps the target steps the example's (three tokens).
    About 30 CPU seconds."""
    sweep = _sweep_module()
    data = json.loads((ROOT / "examples" / "deepseek_v41.json").read_text())
    data["model"]["text_config"].update(vocab_size=129280, dspark_markov_rank=256)
    data["serving"].update(speculative_method="dspark", num_speculative_tokens=1, draft_sample_method="probabilistic",
                           dspark_fused_markov=True)  # fmt: skip
    config = tmp_path / "deepseek_v41_dspark.json"
    config.write_text(json.dumps(data))
    run = sweep.run_config(str(config), steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2)
    assert run["step_failures"] == [] and run["not_launched"] == []
    planned = {kp.name for kp in warmreg.plan(str(config), target=sweep.CPU_TARGET).kernels}
    assert set(run["kernels"]) == planned >= {"deepseek_v4.v41_markov_sample", "deepseek_v4.v41_markov_select"}
    for name, k in run["kernels"].items():
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 and k["monitor_agrees"], (name, k)
        assert all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
    assert run["kernels"]["deepseek_v4.v41_markov_select"]["checks"]
    for name in ("deepseek_v4.prepare_dspark_inputs", "deepseek_v4.dspark_noncausal_swa_indices"):
        assert run["kernels"][name]["checks"], name
    assert all(o["platform_only"] for o in run["keys_outside_plan"]), run["keys_outside_plan"]


def test_sweep_drives_the_deepseek_v4_upcast_on_sm100() -> None:
    """DeepSeek-V4-Flash on cuda:100: the C4 indexer's BF16 logits upcast is planned there and driven, checked against
    its reference, with every planned kernel launched and none failing. About 25 CPU seconds."""
    sweep = _sweep_module()
    config = str(ROOT / "examples" / "deepseek_v4_flash.json")
    run = sweep.run_config(
        config, steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2, target="cuda:100"
    )
    assert run["step_failures"] == [] and run["not_launched"] == []
    assert set(run["kernels"]) == {kp.name for kp in warmreg.plan(config, target="cuda:100").kernels}
    upcast = run["kernels"]["deepseek_v4.indexer_upcast_logits"]
    assert upcast["launches"] >= 1 and upcast["failures"] == upcast["misses"] == 0 and upcast["monitor_agrees"]
    assert upcast["checks"] and all(c.endswith("matches the PyTorch reference") for c in upcast["checks"])
    assert all(k["failures"] == 0 and k["misses"] == 0 for k in run["kernels"].values())


def _without_kda(drivers: dict[str, type[kit.Sweep[Any]]]) -> dict[str, type[kit.Sweep[Any]]]:
    """The installed drivers, Kimi-K3's made to drive everything but the KDA decode step."""
    kimi = drivers["kimi_k3"]
    partial = type("PartialKimiSweep", (kimi,), {"drives": kimi.drives - {"kimi_k3.kda_recurrent"}})
    return {**drivers, "kimi_k3": partial}


def test_sweep_refuses_a_plan_kernel_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = _sweep_module()
    drivers = _without_kda(kit.sweep_drivers())
    monkeypatch.setattr(kit, "sweep_drivers", lambda: drivers)
    with pytest.raises(sweep.SweepError, match=r"kimi_k3\.kda_recurrent") as caught:
        sweep.run_config(str(ROOT / "examples" / "kimi_k3.json"), steps=1, seed=0, device="cpu", max_tokens=2)
    assert caught.value.kernels == ("kimi_k3.kda_recurrent",)


def test_the_plugins_declare_their_drivers_and_the_sweep_names_no_plugin() -> None:
    """Each plugin's driver comes through the entry points and drives every kernel its examples plan; the sweep
    itself imports no plugin module and names no plugin kernel."""
    drivers, sweep = kit.sweep_drivers(), _sweep_module()
    assert drivers["deepseek_v4"].__module__ == "warmreg_deepseek_v4.sweep"
    assert drivers["kimi_k3"].__module__ == "warmreg_kimi_k3.sweep"
    source, named = (ROOT / "benchmarks" / "sweep.py").read_text(), set()
    for example in ("deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3", "kimi_k3_full", "deepseek_v41"):
        plan = warmreg.plan(str(ROOT / "examples" / f"{example}.json"), target=sweep.CPU_TARGET)
        assert kit.driver_for(plan, drivers) is drivers[plan.config.model_type]
        named |= {kp.name for kp in plan.kernels if not kp.name.startswith("warmreg.")}
    for name in sorted(named):
        assert name.rpartition(".")[2] not in source, f"benchmarks/sweep.py names {name}"
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not {m for m in imported if m.startswith(("warmreg_deepseek_v4", "warmreg_kimi_k3"))}, imported


def test_a_model_type_without_a_driver_is_refused() -> None:
    plan = warmreg.plan(str(ROOT / "examples" / "kimi_k3.json"), target="cuda:90")
    with pytest.raises(kit.SweepError, match=r"no sweep driver for model type 'kimi_k3'.*warmreg\.sweep"):
        kit.driver_for(plan, {"deepseek_v4": kit.sweep_drivers()["deepseek_v4"]})


def test_importing_a_plugin_pulls_no_sweep_in() -> None:
    """A plugin's registration never imports its driver: the sweep kit (and with it the test machinery) stays out."""
    code = (
        "import sys, warmreg_deepseek_v4.plugin, warmreg_kimi_k3.plugin; "
        "print(sorted(m for m in sys.modules if m.endswith(('.sweep', '.sweep_inputs', '.sweep_batch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout


def test_sweep_drives_the_rocm_mxfp4_indexer() -> None:
    """Flash on gfx950 with aiter ("auto" indexer_kv_dtype: MXFP4): compress_pool is planned and driven, checked
    against its reference; the FP8 indexer Q, K insert and pack are not planned, so not driven."""
    sweep = _sweep_module()
    run = sweep.run_config(
        str(ROOT / "examples" / "deepseek_v4_flash.json"), steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2, target="rocm:gfx950+aiter"
    )
    assert run["step_failures"] == []
    pool = run["kernels"]["deepseek_v4.compress_pool"]
    assert pool["launches"] >= 1 and pool["failures"] == pool["misses"] == 0 and pool["monitor_agrees"]
    assert pool["checks"] and all(c.endswith("matches the PyTorch reference") for c in pool["checks"])
    assert not {"deepseek_v4.indexer_q_rope_quant", "deepseek_v4.indexer_kv_compress_insert"} & set(run["kernels"])
    assert all(k["failures"] == 0 and k["misses"] == 0 for k in run["kernels"].values())


def test_sweep_drives_kimi_k3_on_rocm() -> None:
    """Kimi-K3 on gfx942 (Triton KDA prefill and decode): every plan kernel launches, the ROCm KDA builder's device
    chunk metadata and the plain decodes' packed decode step among them, checked against their references."""
    sweep = _sweep_module()
    config = str(ROOT / "examples" / "kimi_k3.json")
    run = sweep.run_config(
        config, steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2, target="rocm:gfx942"
    )
    assert run["step_failures"] == []
    assert set(run["kernels"]) == {kp.name for kp in warmreg.plan(config, target="rocm:gfx942").kernels}
    assert all(k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 for k in run["kernels"].values())
    for name in ("kimi_k3.rocm_chunk_metadata", "kimi_k3.kda_packed_decode"):
        checks = run["kernels"][name]["checks"]
        assert checks and all(c.endswith("matches the PyTorch reference") for c in checks), name


def test_sweep_drives_kimi_k3_with_dcp(tmp_path: Path) -> None:
    """Kimi-K3 with decode context parallelism 2: every plan kernel launches, the MLA decode's DCP correction among
    them, checked against its reference."""
    sweep = _sweep_module()
    data = json.loads((ROOT / "examples" / "kimi_k3.json").read_text())
    data["serving"]["decode_context_parallel_size"] = 2
    config = tmp_path / "kimi_k3_dcp2.json"
    config.write_text(json.dumps(data))
    run = sweep.run_config(str(config), steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2)
    assert run["step_failures"] == []
    assert set(run["kernels"]) == {kp.name for kp in warmreg.plan(str(config), target=sweep.CPU_TARGET).kernels}
    assert all(k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 for k in run["kernels"].values())
    checks = run["kernels"]["kimi_k3.dcp_correct_attn_out"]["checks"]
    assert checks and all(c.endswith("matches the PyTorch reference") for c in checks)


def test_sweep_drives_kimi_k3_with_dcp_all_to_all(tmp_path: Path) -> None:
    """Kimi-K3 with decode context parallelism 2 over the all-to-all backend without the direct workspace: every plan
    kernel launches, the MLA decode's pack and combine among them (not the all-gather correction), checked against
    their references."""
    sweep = _sweep_module()
    data = json.loads((ROOT / "examples" / "kimi_k3.json").read_text())
    data["serving"].update(decode_context_parallel_size=2, dcp_comm_backend="a2a", direct_dcp_a2a=False)
    config = tmp_path / "kimi_k3_dcp2_a2a.json"
    config.write_text(json.dumps(data))
    run = sweep.run_config(str(config), steps=3, seed=36, device="cpu", max_tokens=3, max_seq_len=16, max_seqs=2)
    assert run["step_failures"] == []
    assert set(run["kernels"]) == {kp.name for kp in warmreg.plan(str(config), target=sweep.CPU_TARGET).kernels}
    assert all(k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0 for k in run["kernels"].values())
    assert "kimi_k3.dcp_correct_attn_out" not in run["kernels"]
    for name in ("kimi_k3.dcp_a2a_pack_send", "kimi_k3.dcp_a2a_unpack_combine"):
        checks = run["kernels"][name]["checks"]
        assert checks and all(c.endswith("matches the PyTorch reference") for c in checks), (name, checks)
