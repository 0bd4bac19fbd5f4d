"""vLLM's own registered kernels and keys for a deployment, on a machine without a GPU (issue 38, first half).

The GPU profile (:mod:`warmreg_vllm.profile`) runs anywhere warmreg-vllm is installed; the emulation
(:mod:`warmreg_vllm.emulation`) runs in the vLLM venvs (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES=
build/engine-venvs/vllm/bin/python -m pytest tests/engines/test_vllm_registry_keys.py``, and the same with
``vllm-0.34``), each check in a fresh process: the emulation makes vLLM import its model packages as on the GPU,
which one process does once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("warmreg_vllm", reason="warmreg-vllm is not installed here: bash scripts/engine-envs.sh build vllm")

from warmreg_vllm.profile import GpuProfile, ProfileError, TritonTarget

from warmreg import WarmregError

HERE = Path(__file__).resolve().parent
H200 = GpuProfile.named("h200")


# -- 1. the GPU profile ---------------------------------------------------------------------------------------------
def test_the_h200_profile_holds_the_hosts_values() -> None:
    assert H200.name == "NVIDIA H200"
    assert H200.capability == (9, 0) and H200.arch == 90
    assert H200.num_compute_units == 132
    assert H200.total_memory == 143771 * 2**20
    assert H200.supports_pdl and H200.fp8_dtype == "float8_e4m3fn"
    assert (H200.cuda_version, H200.torch_version) == ("13.0", "2.11")
    assert H200.triton_target == TritonTarget(backend="cuda", arch=90, warp_size=32)
    assert H200.triton_target.target == "cuda:90"
    assert "not yet read on the device" in H200.provenance


def test_a_profile_round_trips_through_json(tmp_path: Path) -> None:
    b200 = attrs.evolve(
        H200, name="NVIDIA B200", capability=(10, 0), num_compute_units=148,
        triton_target=TritonTarget(backend="cuda", arch=100, warp_size=32), provenance="test",
    )  # fmt: skip
    for profile in (H200, b200):
        assert GpuProfile.from_json(profile.to_json()) == profile
        path = tmp_path / "p.json"
        path.write_text(profile.to_json())
        assert GpuProfile.load(path) == profile
        assert json.loads(profile.to_json())["capability"] == list(profile.capability)
    assert hash(H200) == hash(GpuProfile.from_dict(H200.to_dict()))


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("capability", [9], "must be a [major, minor] pair"),
        ("capability", [9, "0"], "must be a [major, minor] pair"),
        ("num_compute_units", 0, "must be a positive int (got 0)"),
        ("num_compute_units", True, "must be a positive int (got True)"),
        ("total_memory", -1, "must be a positive int"),
        ("supports_pdl", "yes", "must be true or false (got 'yes')"),
        ("fp8_dtype", "float8_e5m2", "must be one of float8_e4m3fn, float8_e4m3fnuz (got 'float8_e5m2')"),
        ("cuda_version", "13", "must be a version such as '13.0' (got '13')"),
        ("name", " ", "must be a non-empty string"),
        ("provenance", None, "must be a non-empty string (got None)"),
        ("triton_target", {"backend": "cuda", "arch": 100, "warp_size": 32}, "must be 90, the capability's (got 100)"),
        ("triton_target", {"backend": "hip", "arch": 90, "warp_size": 32}, "must be 'cuda' (got 'hip')"),
        ("triton_target", {"backend": "cuda", "arch": 90}, "must be an object with exactly"),
    ],
)
def test_a_bad_field_is_named(field: str, value: Any, words: str) -> None:
    data = {**H200.to_dict(), field: value}
    with pytest.raises(ProfileError) as caught:
        GpuProfile.from_dict(data, source="h200.json")
    assert caught.value.field.split(".")[0] == field
    assert f"'{caught.value.field}' in h200.json {words}" in str(caught.value)
    assert isinstance(caught.value, WarmregError) and isinstance(caught.value, ValueError)


def test_unknown_missing_and_malformed_profiles_are_refused() -> None:
    with pytest.raises(ProfileError, match="'sm_count' is not a profile field"):
        GpuProfile.from_dict({**H200.to_dict(), "sm_count": 132})
    data = H200.to_dict()
    del data["supports_pdl"]
    with pytest.raises(ProfileError, match="'supports_pdl' is missing"):
        GpuProfile.from_dict(data)
    with pytest.raises(ProfileError, match="must be JSON"):
        GpuProfile.from_json("{")
    with pytest.raises(ProfileError, match="must be one of h100, h200 \\(got 'b300'\\)"):
        GpuProfile.named("b300")
    assert GpuProfile.named("h100").capability == GpuProfile.named("h200").capability == (9, 0)


# -- 2. vLLM behaving as on the profiled GPU ---------------------------------------------------------------------------
def run_vllm(body: str, *, timeout: int = 240) -> dict[str, Any]:
    """Run ``body`` in a fresh process of this venv's Python, with vLLM's CPU-machine environment, from ``/`` (a
    ``warmreg/`` folder in the working directory would shadow the installed package); it prints one JSON line last.
    ``scratch`` names a temporary folder there for model configs, removed when the process ends."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: run in build/engine-venvs/vllm or vllm-0.34")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory(prefix="warmreg-vllm-") as scratch:  # the body's model folders, removed after
        script = f"import json, sys\nsys.path.insert(0, {str(HERE)!r})\nscratch = {scratch!r}\n" + textwrap.dedent(body)
        done = subprocess.run(
            [sys.executable, "-c", script], cwd="/", env=env, capture_output=True, text=True, timeout=timeout
        )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_vllm_answers_as_the_profiled_gpu_and_builds_the_gpus_config() -> None:
    out = run_vllm(
        """
        import attrs, cases, tempfile, pathlib
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from warmreg_vllm.profile import GpuProfile, TritonTarget
        from warmreg_vllm.emulation import emulate_gpu
        h200 = GpuProfile.named("h200")
        before = type(current_platform).__name__
        with emulate_gpu(h200) as platform:
            assert platform is current_platform
            answers = {
                "is_cuda": current_platform.is_cuda(), "is_cuda_alike": current_platform.is_cuda_alike(),
                "capability": list(current_platform.get_device_capability()),
                "sm90": current_platform.is_device_capability(90),
                "sms": current_platform.num_compute_units(), "pdl": current_platform.is_arch_support_pdl(),
                "fp8": str(current_platform.fp8_dtype()), "name": current_platform.get_device_name(),
                "memory": current_platform.get_device_total_memory(), "triton": HAS_TRITON,
            }
            vc = cases.build_vllm("flash", pathlib.Path(tempfile.mkdtemp(dir=scratch)))
            config = {
                # vLLM 0.34 has only Model Runner V2 (its V1 GPU runner is gone, and the property with it)
                "v2": getattr(vc, "use_v2_model_runner", True), "worker": vc.parallel_config.worker_cls,
                "tokens": vc.scheduler_config.max_num_batched_tokens, "device": vc.device_config.device_type,
            }
        b200 = attrs.evolve(h200, capability=(10, 0), triton_target=TritonTarget(backend="cuda", arch=100, warp_size=32))
        with emulate_gpu(b200):
            sm100 = [current_platform.is_device_capability_family(100), current_platform.is_device_capability(90)]
        after = [type(current_platform).__name__, current_platform.is_cuda()]
        print(json.dumps({"before": before, "answers": answers, "config": config, "sm100": sm100, "after": after}))
        """
    )
    assert out["answers"] == {
        "is_cuda": True, "is_cuda_alike": True, "capability": [9, 0], "sm90": True, "sms": 132, "pdl": True,
        "fp8": "torch.float8_e4m3fn", "name": "NVIDIA H200", "memory": 143771 * 2**20, "triton": True,
    }  # fmt: skip
    # the GPU's config: Model Runner V2 on the GPU worker, chunked prefill at the 8192 tokens asked (the CPU
    # platform rewrites it to max_model_len, shared/notes/engine-configs.md)
    assert out["config"] == {"v2": True, "worker": "vllm.v1.worker.gpu_worker.Worker", "tokens": 8192, "device": "cuda"}
    assert out["sm100"] == [True, False]
    assert out["before"] == "CpuPlatform" and out["after"] == ["CpuPlatform", False]


def test_a_model_package_imported_under_the_cpu_platform_is_refused() -> None:
    out = run_vllm(
        """
        import vllm.models.deepseek_v4  # under the CPU platform: picks deepseek_v4/cpu/
        from warmreg_vllm.emulation import EmulationError, emulate_gpu
        from warmreg_vllm.profile import GpuProfile
        try:
            with emulate_gpu(GpuProfile.named("h200")):
                pass
        except EmulationError as e:
            print(json.dumps({"error": str(e)}))
        """
    )
    assert "vllm.models.deepseek_v4.cpu were imported under the CPU platform" in out["error"]
    assert "enter emulate_gpu before vLLM builds a config" in out["error"]


# -- 3. vLLM's own registrations and keys (warmreg_vllm.registry_keys) ------------------------------------------------
#: a small DeepSeek-V4-Flash TP 4 deployment: the Flash example's model at a short length and small batch
SMALL_FLASH = (
    'dict(max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=8192, block_size=256, kv_cache_dtype="fp8_ds_mla",'
    ' dtype="bfloat16", tensor_parallel_size=4, attention_backend="FLASHMLA_SPARSE_DSV4",'
    ' speculative_config={"method": "mtp", "num_speculative_tokens": 1})'
)
B200 = "attrs.evolve(h200, name='NVIDIA B200', capability=(10, 0), num_compute_units=148, triton_target=TritonTarget(backend='cuda', arch=100, warp_size=32))"


def registrations(profile: str) -> dict[str, Any]:
    """vLLM's registered kernels of :data:`SMALL_FLASH` on a profile (a Python expression over ``h200``), in a fresh
    process."""
    return run_vllm(
        f"""
        import attrs, cases, tempfile, pathlib
        from vllm.engine.arg_utils import EngineArgs
        from warmreg_vllm.profile import GpuProfile, TritonTarget
        from warmreg_vllm.registry_keys import registered_kernels
        h200 = GpuProfile.named("h200")
        model = cases.model_dir(pathlib.Path(tempfile.mkdtemp(dir=scratch)), "deepseek_v4_flash")
        found = registered_kernels(EngineArgs(model=model, skip_tokenizer_init=True, **{SMALL_FLASH}), {profile})
        print(json.dumps({{"kernels": [k.to_dict() for k in found.kernels], "per_kind": found.keys_per_kind()}}))
        """,
        timeout=600,
    )


@pytest.fixture(scope="module")
def h200_runs() -> list[dict[str, Any]]:
    return [registrations("h200"), registrations("h200")]


def by_name(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k["name"]: k for k in run["kernels"]}


def test_registrations_of_a_deployment_are_the_same_in_two_processes(h200_runs: list[dict[str, Any]]) -> None:
    first, second = h200_runs
    assert first == second
    assert sum(first["per_kind"].values()) == sum(len(k["keys"]) for k in first["kernels"]) > 100


def test_each_kernel_is_classified_by_how_vllm_compiles_it(h200_runs: list[dict[str, Any]]) -> None:
    kernels = by_name(h200_runs[0])
    expected = {
        "FusedQKVRMSNormKernel": ("triton", ["model"]),  # a layer's __init__
        "BuildPrefillChunkMetadataKernel": ("triton", ["model"]),
        "DequantGatherKCacheKernel": ("cutedsl", ["model"]),  # cutlass importable on CUDA: the CuTeDSL variant
        "IndexerQFp8Kernel": ("cutedsl", ["model"]),  # needs vllm.vllm_flash_attn.cute (emulate_gpu, point 4)
        "MhcPreBigFuseTileLangKernel": ("tilelang", ["model"]),  # its split count reads the SM count (point 5)
        "_topk_topp_kernel": ("triton", ["sampler"]),  # a Triton-derived key (the profile's target stands in)
    }
    assert {name: (kernels[name]["kind"], kernels[name]["points"]) for name in expected} == expected
    assert all(k["keys"] and k["reason"] is None for k in kernels.values())
    # the Triton-derived keys are written as Triton cache keys: no process-local id in them
    assert all(key.startswith("TritonCompileKey(") for key in kernels["_topk_topp_kernel"]["keys"])
    # the CPU platform's own choice (the Triton dequant-gather) is not registered on the GPU
    assert "DequantizeAndGatherKCacheKernel" not in kernels


def test_the_profile_changes_the_keys_of_a_named_kernel(h200_runs: list[dict[str, Any]]) -> None:
    sm90, sm100 = by_name(h200_runs[0]), by_name(registrations(B200))
    assert sm90["FusedInvRopeFP8QuantKernel"]["keys"] != sm100["FusedInvRopeFP8QuantKernel"]["keys"]
    assert sm90["MhcPreBigFuseTileLangKernel"]["keys"] != sm100["MhcPreBigFuseTileLangKernel"]["keys"]  # 132 vs 148
    assert sm90["FusedQKVRMSNormKernel"]["keys"] == sm100["FusedQKVRMSNormKernel"]["keys"]
