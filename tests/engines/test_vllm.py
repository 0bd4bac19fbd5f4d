"""``WarmConfig.load`` of a real vLLM 0.33 ``VllmConfig`` plans the keys of the example-format JSON.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from warmreg_deepseek_v4.model import DSV4, fp8_checkpoint

from warmreg import WarmConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
from plans import differences, engine_or_skip, planned_keys

# vLLM detects no platform on a machine without a GPU unless told ("Device string must not be empty").
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
engine_or_skip("vLLM", "vllm", "vllm.engine.arg_utils")

CASES = list(cases.VLLM_CASES)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    return {case: cases.build_vllm(case, root) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_plan_keys_equal_the_example_format_json(built: dict[str, Any], case: str) -> None:
    expected = cases.expected_vllm(case)
    # vLLM's CPU platform rewrites max_num_batched_tokens (cases.VLLM_CPU_REWRITTEN): the GPU value
    # comes from the deployment's JSON, everything else from the real object.
    serving = {k: expected["serving"][k] for k in cases.VLLM_CPU_REWRITTEN}
    got, want = planned_keys(built[case], serving=serving), planned_keys(expected)
    assert got == want, differences(got, want)


def test_the_real_object_reads_as_the_example(built: dict[str, Any]) -> None:
    vc = built["flash"]
    cfg = WarmConfig.load(vc)
    example = WarmConfig.load(cases.EXAMPLES / "deepseek_v4_flash.json")
    # vLLM rewrote quant_method to deepseek_v4_fp8: still an FP8 checkpoint, the same model
    assert cfg.model["quantization_config"]["quant_method"] == "deepseek_v4_fp8"
    assert fp8_checkpoint(cfg) and fp8_checkpoint(example) and fp8_checkpoint(vc.model_config.hf_config)
    assert DSV4.from_config(cfg) == DSV4.from_config(example)
    assert type(vc.attention_config.backend).__name__ == "AttentionBackendEnum"
    want = {k: v for k, v in example.serving.items() if k not in cases.VLLM_CPU_REWRITTEN}
    assert {k: cfg.serving[k] for k in want} == want
    assert "AttentionBackendEnum.FLASHMLA_SPARSE_DSV4" in cfg.origins["attention_backend"]


def test_the_examples_model_sections_are_vllm_inputs(built: dict[str, Any]) -> None:
    # built from examples/deepseek_v4_{flash,pro}.json's model sections as they are
    assert built["flash"].model_config.hf_config.model_type == "deepseek_v4"
    assert built["pro"].model_config.hf_config.model_type == "deepseek_v4"
