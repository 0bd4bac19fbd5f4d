"""A Kimi-K3 deployment's pack of vLLM's own Triton kernels, and the integration installing it (issue 38).

Runs in both vLLM venvs (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm/bin/python -m pytest
tests/engines/test_vllm_kimi_k3_pack.py``, and the same with ``vllm-0.34``), each step a process of its own, for a
small Kimi-K3 TP 8 deployment (the ``kimi_k3`` case's arguments at a short length and small batch) under the H200
profile:

1. vLLM's registrations reach the KV-cache points: after the model is built, vLLM's
   ``update_block_size_for_backend`` raises the requested block size 64 to 768 (an MLA page that holds a KDA state
   page), so the engine core's page-size unification accepts it; kernels and keys are the same in two processes.
2. ``warmreg-vllm build`` packs every Triton key, ``warmreg pack install`` installs it, and vLLM's own ``compile(key)``
   of every key in a fresh process compiles nothing.
3. With ``WARMREG_WARM=1 WARMREG_PACK=<the pack>``, vLLM's own loader's entry point (``warmreg_vllm.plugin.register``)
   wraps the GPU worker; its ``compile_or_warm_up_model`` installs the pack before vLLM's warmup, and vLLM's own
   ``JitWarmupRegistry.warmup()`` of every registry then compiles nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("warmreg_vllm", reason="warmreg-vllm is not installed here: bash scripts/engine-envs.sh build vllm")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM: run in build/engine-venvs/vllm or vllm-0.34", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_pack_check import CHECK  # noqa: E402

#: vLLM's engine arguments of a small Kimi-K3 TP 8 deployment (the model folder is added): the ``kimi_k3`` case's
#: FlashMLA, block size 64, no prefix caching and three ngram draft tokens, at a short context and small batch
SMALL = [
    "--skip-tokenizer-init", "--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--max-model-len", "4096",
    "--block-size", "64", "--kv-cache-dtype", "auto", "--dtype", "bfloat16", "--tensor-parallel-size", "8",
    "--attention-backend", "FLASHMLA", "--no-enable-prefix-caching",
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
]  # fmt: skip


def run(args: list[str], cache: Path, *, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    """Run ``python args`` in a fresh process from ``/`` (a ``warmreg/`` folder in the working directory would shadow
    the installed package), with vLLM's CPU-machine environment and ``cache`` as Triton's cache; returns stdout."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": str(cache),
           **(env or {})}  # fmt: skip
    done = subprocess.run([sys.executable, *args], cwd="/", env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``warmreg-vllm build`` of :data:`SMALL` for the H200 profile: the pack and its JSON report."""
    sys.path.insert(0, str(HERE))
    import cases

    root = tmp_path_factory.mktemp("warmreg-vllm-kimi")
    engine = ["--model", cases.model_dir(root, "kimi_k3"), *SMALL]
    pack, report = root / "kimi-small-h200.tar.gz", root / "report.json"
    run(
        ["-m", "warmreg_vllm", "build", "--profile", "h200", "-o", str(pack), "--json", str(report), "--", *engine],
        root / "build-cache",
    )
    return {"root": root, "engine": engine, "pack": pack, "report": json.loads(report.read_text())}


REGISTRATIONS = """
    import json, sys
    from warmreg_vllm.cli import _engine_args
    from warmreg_vllm.profile import GpuProfile
    from warmreg_vllm.vllm_pack import deployment

    with deployment(_engine_args(sys.argv[1:]), GpuProfile.named("h200")) as (vllm_config, found):
        cache = vllm_config.cache_config
        print(json.dumps({
            "kernels": [k.to_dict() for k in found.kernels], "block_size": cache.block_size,
            "mamba_padded": cache.mamba_page_size_padded, "seconds": found.seconds,
        }))
"""


def test_kimi_k3_registers_through_the_kv_cache_points_the_same_in_two_processes(built: dict[str, Any]) -> None:
    first, second = (
        last_json(run(["-c", textwrap.dedent(REGISTRATIONS), *built["engine"]], built["root"] / f"cache-{i}"))
        for i in (1, 2)
    )
    # vLLM's hybrid alignment ran after the model was built: 64 raised to 768, the KDA state page padded to one MLA page
    assert first["block_size"] == 768 and first["mamba_padded"]
    assert set(first["seconds"]) >= {"attention-backends", "kv-cache", "keys"}
    assert first["kernels"] == second["kernels"]
    kernels = {k["name"]: k for k in first["kernels"]}
    # the sampler's top-k/top-p kernels (ngram speculation on CUDA); vLLM 0.34's KDA layers add scatter_states
    sampler = {"_topk_topp_kernel", "_topp_sb_mask_kernel", "_topp_sb_stats_kernel", "_topp_sb_step_kernel"}
    assert sampler <= set(kernels) and all(kernels[n]["points"] == ["sampler"] for n in sampler)
    assert set(kernels) - sampler <= {"_scatter_states_kernel"}
    assert all(k["kind"] == "triton" and k["keys"] and k["reason"] is None for k in kernels.values())
    # the pack's report holds the same kernels with the same key counts
    assert {k["name"]: k["keys"] for k in built["report"]["kernels"]} == {n: len(k["keys"]) for n, k in kernels.items()}
    assert built["report"]["not_held"] == []




def test_after_pack_install_vllms_own_compile_of_every_kimi_k3_key_compiles_nothing(built: dict[str, Any]) -> None:
    cache = built["root"] / "serving-cache"
    binaries = built["report"]["binaries"]
    installed = run(["-m", "warmreg", "pack", "install", str(built["pack"])], cache)
    assert f"{binaries} installed, 0 already present, 0 refused" in installed
    out = last_json(run(["-c", textwrap.dedent(CHECK), *built["engine"]], cache))
    assert out["keys"] == {k["name"]: k["keys"] for k in built["report"]["kernels"]}
    assert out["failed"] == {} and out["compiled"] == [] and out["hits"] == binaries


INTEGRATION = """
    import json, sys, triton
    from warmreg import Platform, cross_target, warm as real_warm
    from warmreg.api import startup
    from warmreg_vllm.cli import _engine_args
    from warmreg_vllm.emulation import emulate_gpu
    from warmreg_vllm.profile import GpuProfile
    from warmreg_vllm.vllm_pack import deployment

    h200 = GpuProfile.named("h200")
    seen = {"events": [], "compiled": [], "hits": 0, "warm_pack": "not called"}

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            seen["hits"] += 1
        else:
            seen["compiled"].append(metadata_group and sorted(metadata_group)[0])

    def load_model(self):  # vLLM's builds the model (deployment() did, on the meta device) and loads weights
        seen["events"].append("load_model")

    def compile_or_warm_up_model(self):  # vLLM's: kernel_warmup (its runner's JitWarmupRegistry.warmup()), capture
        seen["events"].append("kernel_warmup")
        with cross_target(Platform.parse(h200.triton_target.target)):
            for registry in found.registries.values():
                registry.warmup()
        return 0.0

    def warm(config, **kwargs):  # warmreg's warm of its own plan: an empty one here (not this test's subject)
        seen["events"].append("warmreg.warm")
        seen["warm_pack"] = kwargs.pop("pack")
        return real_warm({"model": {"model_type": "none"}, "serving": {}}, target="cuda:90", entry_points=False, **kwargs)

    startup.warm = warm
    with emulate_gpu(h200):  # the worker module imports the model packages: the GPU's, as on the GPU
        from vllm.v1.worker import gpu_worker

        gpu_worker.Worker.load_model = load_model
        gpu_worker.Worker.compile_or_warm_up_model = compile_or_warm_up_model
        args = _engine_args(sys.argv[1:])  # vLLM's loader calls the vllm.general_plugins entry point here
        wrapped = getattr(gpu_worker.Worker.compile_or_warm_up_model, "__warmreg_wrapped__", False)
        with deployment(args, h200) as (vllm_config, found):
            worker = object.__new__(gpu_worker.Worker)
            worker.vllm_config = vllm_config
            worker.load_model()
            triton.knobs.compilation.listener = listener
            worker.compile_or_warm_up_model()
            keys = sum(len(k.keys) for k in found.kernels if k.kind == "triton")
    print(json.dumps({**seen, "keys": keys, "wrapped": wrapped}))
"""


def test_the_integration_installs_the_pack_before_vllms_own_warmup_which_compiles_nothing(
    built: dict[str, Any],
) -> None:
    cache = built["root"] / "integration-cache"
    env = {"WARMREG_WARM": "1", "WARMREG_PACK": str(built["pack"]), "VLLM_TRITON_JIT_WARMUP_NUM_THREADS": "2"}
    out = last_json(run(["-c", textwrap.dedent(INTEGRATION), *built["engine"]], cache, env=env))
    assert out["wrapped"]  # by vLLM's own plugin loader, through the entry point
    assert out["events"] == ["load_model", "warmreg.warm", "kernel_warmup"]
    assert out["warm_pack"] is None  # the vLLM pack is the integration's to install, not warm's plan's
    # vLLM's own warmup of every registered key finds each binary the integration installed: Triton compiles nothing
    assert out["keys"] == sum(k["keys"] for k in built["report"]["kernels"])
    assert out["compiled"] == [] and out["hits"] == built["report"]["binaries"]
