"""WarmConfig from a real transformers config object (test extra: transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import warmreg

transformers = pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_deepseek_v4_config_object_plans_the_same_keys_as_its_json(example: str) -> None:
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepseekV4Config")
    data = json.loads((EXAMPLES / f"{example}.json").read_text())
    model = {k: v for k, v in data["model"].items() if k != "model_type"}
    hf = transformers.DeepseekV4Config(**model)  # normalizes compress_ratios into layer_types + compress_rates
    cfg = warmreg.WarmConfig.load(hf, serving=data["serving"])
    assert cfg.model_type == "deepseek_v4" and cfg.source == "DeepseekV4Config"
    from_object = warmreg.plan(cfg, target="cuda:90")
    from_json = warmreg.plan(EXAMPLES / f"{example}.json", target="cuda:90")
    assert {k.name: k.keys for k in from_object.kernels} == {k.name: k.keys for k in from_json.kernels}


def test_config_json_path_of_a_plain_hf_config(tmp_path: Path) -> None:
    data = json.loads((EXAMPLES / "deepseek_v4_flash.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data["model"]))
    plan = warmreg.plan(warmreg.WarmConfig.load(path, serving=data["serving"]), target="cuda:90")
    assert plan.num_keys == warmreg.plan(EXAMPLES / "deepseek_v4_flash.json", target="cuda:90").num_keys
