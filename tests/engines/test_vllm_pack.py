"""A pack of vLLM's own Triton kernels, built on this CPU machine (``warmreg-vllm build``, issue 38, part 4).

Runs in both vLLM venvs (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm/bin/python -m pytest
tests/engines/test_vllm_pack.py``, and the same with ``vllm-0.34``). For a small DeepSeek-V4-Flash TP 4 deployment
under the H200 profile: ``warmreg-vllm build`` writes the pack and its report; ``warmreg pack install`` installs every
entry (vLLM's functions found through warmreg-vllm's ``warmreg_pack_functions``); a fresh process, with vLLM
registering and keying its kernels as on the H200, runs vLLM's own ``compile(key)`` for every Triton key and Triton
compiles nothing (its compilation listener sees only cache hits). Each step is a process of its own.
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

import pytest

pytest.importorskip("warmreg_vllm", reason="warmreg-vllm is not installed here: bash scripts/engine-envs.sh build vllm")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM: run in build/engine-venvs/vllm or vllm-0.34", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_pack_check import CHECK  # noqa: E402

#: vLLM's engine arguments of a small DeepSeek-V4-Flash TP 4 deployment (the model folder is added): FlashMLA sparse,
#: fp8_ds_mla, no speculation, short context and small batch, so the build stays near a minute on 2 cores
SMALL = [
    "--skip-tokenizer-init", "--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--max-model-len", "2048",
    "--block-size", "256", "--kv-cache-dtype", "fp8_ds_mla", "--dtype", "bfloat16", "--tensor-parallel-size", "4",
    "--attention-backend", "FLASHMLA_SPARSE_DSV4",
]  # fmt: skip


def run(args: list[str], cache: Path, *, timeout: int = 300) -> str:
    """Run ``python args`` in a fresh process from ``/`` (a ``warmreg/`` folder in the working directory would shadow
    the installed package), with vLLM's CPU-machine environment and ``cache`` as Triton's cache; returns stdout."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, *args], cwd="/", env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``warmreg-vllm build`` of :data:`SMALL` for the H200 profile: the pack, its JSON report and the printed one."""
    sys.path.insert(0, str(HERE))
    import cases

    root = tmp_path_factory.mktemp("warmreg-vllm-pack")
    engine = ["--model", cases.model_dir(root, "deepseek_v4_flash"), *SMALL]
    pack, report = root / "flash-small-h200.tar.gz", root / "report.json"
    printed = run(
        ["-m", "warmreg_vllm", "build", "--profile", "h200", "-o", str(pack), "--json", str(report), "--", *engine],
        root / "build-cache",
    )
    return {"root": root, "engine": engine, "pack": pack, "report": json.loads(report.read_text()), "printed": printed}


def test_the_pack_holds_every_triton_kernel_and_names_the_rest(built: dict[str, Any]) -> None:
    from warmreg.stages.pack import inspect_pack

    report, manifest = built["report"], inspect_pack(built["pack"])
    held = {k["name"]: k["keys"] for k in report["kernels"]}
    assert manifest.engine is not None and manifest.engine["kernels"] == report["kernels"]
    assert manifest.engine["name"] == "vllm" and manifest.engine["version"] == report["version"]
    assert manifest.engine["profile"]["name"] == "NVIDIA H200" and manifest.target == "cuda:90"
    assert manifest.model_type == "deepseek_v4" and manifest.engine["deployment"]["model_type"] == "deepseek_v4"
    # every held kernel has binaries in the pack, under its own name; keys sharing a binary share its entry
    assert {e.kernel for e in manifest.entries} == set(held)
    assert len(manifest.entries) == report["binaries"] <= sum(held.values())
    assert {"FusedQKVRMSNormKernel", "BuildPrefillChunkMetadataKernel", "PrepareUniformDecodeKernel"} <= set(held)
    # the kernels a Triton pack cannot hold are listed by name, kind, key count and why
    not_held = {k["name"]: k for k in report["not_held"]}
    assert (
        not_held["DequantGatherKCacheKernel"]["kind"] == "cutedsl"
        and "CuTeDSL" in not_held["DequantGatherKCacheKernel"]["why"]
    )
    assert (
        not_held["MhcPreBigFuseTileLangKernel"]["kind"] == "tilelang"
        and not_held["MhcPreBigFuseTileLangKernel"]["keys"] > 0
    )
    assert not set(held) & set(not_held)
    # the printed report: one line per kernel, held or not and why
    printed = built["printed"]
    assert f"holds {sum(held.values())} keys of {len(held)} Triton kernels in {report['binaries']} binaries" in printed
    assert "DequantGatherKCacheKernel" in printed and "no: a CuTeDSL kernel" in printed




def test_after_pack_install_vllms_own_compile_of_every_key_compiles_nothing(built: dict[str, Any]) -> None:
    cache = built["root"] / "serving-cache"
    installed = run(["-m", "warmreg", "pack", "install", str(built["pack"])], cache)
    binaries = built["report"]["binaries"]
    assert f"{binaries} installed, 0 already present, 0 refused" in installed
    out = json.loads(run(["-c", textwrap.dedent(CHECK), *built["engine"]], cache).strip().splitlines()[-1])
    # the fresh process registers the same kernels and keys the pack was built from ...
    assert out["keys"] == {k["name"]: k["keys"] for k in built["report"]["kernels"]}
    # ... and vLLM's compile(key) of each finds its binary in the cache: Triton compiles nothing
    assert out["failed"] == {} and out["compiled"] == []
    assert out["hits"] == binaries


def test_a_compile_that_raises_on_the_pool_is_reported_with_its_cause() -> None:
    """Triton's async compile pool (``AsyncCompileMode(ignore_errors=True)``, as vLLM's warmup runs it) drops the error
    of a compile that raises there and leaves no binary; ``compile_keys`` reports it under the key that submitted it,
    so a failed build names the cause instead of only the missing binary."""
    import types

    import torch
    import triton
    import triton.language as tl
    from warmreg_vllm.vllm_pack import compile_keys

    from warmreg import Platform, cross_target

    @triton.jit
    def _refuses_small_blocks(x_ptr, BLOCK: tl.constexpr):
        tl.static_assert(BLOCK >= 64, "BLOCK below 64")
        tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)

    x = torch.empty(128)

    def compile(block: int) -> None:
        _refuses_small_blocks.warmup(x, BLOCK=block, grid=(1,))

    kernel = types.SimpleNamespace(name="test.refuses", keys=["BLOCK=32", "BLOCK=64"], vllm_keys=[32, 64],
                                   kernel=types.SimpleNamespace(compile=compile))  # fmt: skip
    with tempfile.TemporaryDirectory() as cache, pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", cache)
        with cross_target(Platform.parse("cuda:90")):
            failed = compile_keys([kernel], workers=2)  # type: ignore[list-item]
    assert list(failed) == ["test.refuses BLOCK=32"], failed
    assert "BLOCK below 64" in failed["test.refuses BLOCK=32"], failed
