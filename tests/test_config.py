from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import warmreg
from warmreg import ConfigError, WarmConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_loads_each_example() -> None:
    for name in ("deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3"):
        cfg = WarmConfig.load(EXAMPLES / f"{name}.json")
        assert cfg.serving["max_num_batched_tokens"] > 0
    assert WarmConfig.load(EXAMPLES / "kimi_k3.json").text["model_type"] == "kimi_linear"


def test_plain_hf_config_dict_with_serving_overrides() -> None:
    model = json.loads((EXAMPLES / "deepseek_v4_flash.json").read_text())["model"]
    cfg = WarmConfig.load(model, serving={"max_num_seqs": 8})
    assert cfg.model_type == "deepseek_v4" and cfg.serving["max_num_seqs"] == 8


def test_hf_like_and_engine_like_objects() -> None:
    model = json.loads((EXAMPLES / "deepseek_v4_flash.json").read_text())["model"]
    hf = SimpleNamespace(model_type="deepseek_v4", to_dict=lambda: model)
    assert WarmConfig.load(hf).model_type == "deepseek_v4"
    vllm_like = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, max_model_len=4096, dtype="bfloat16"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=32),
        cache_config=SimpleNamespace(block_size=256, cache_dtype="fp8_ds_mla"),
        parallel_config=SimpleNamespace(tensor_parallel_size=8),
    )
    cfg = WarmConfig.load(vllm_like)
    assert cfg.serving["max_num_batched_tokens"] == 2048 and cfg.serving["block_size"] == 256
    sglang_like = SimpleNamespace(hf_config=hf, chunked_prefill_size=4096, max_running_requests=64, context_length=8192, page_size=64, tp_size=4)
    assert WarmConfig.load(sglang_like).serving["max_num_seqs"] == 64


def test_missing_field_names_field_plugin_and_fix() -> None:
    cfg = WarmConfig.load({"model": {"model_type": "x"}})
    with pytest.raises(ConfigError) as info:
        cfg.get("serving.max_num_seqs", int, plugin="warmreg-demo")
    assert info.value.field == "serving.max_num_seqs" and info.value.plugin == "warmreg-demo"
    assert "needed by warmreg-demo" in str(info.value) and "fix:" in str(info.value)


@pytest.mark.parametrize(
    ("serving", "field"),
    [({"max_num_seqs": 0}, "serving.max_num_seqs"), ({"max_model_len": -1}, "serving.max_model_len"), ({"block_size": "256"}, "serving.block_size"), ({"max_num_seqs": True}, "serving.max_num_seqs"), ({"maxnumseqs": 3}, "serving.maxnumseqs")],
)
def test_invalid_serving_values_are_refused_at_load(serving: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        WarmConfig.load({"model": {"model_type": "x"}, "serving": serving})
    assert info.value.field == field


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        WarmConfig.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json"):
        WarmConfig.load(bad)
    with pytest.raises(ConfigError, match="model_type"):
        WarmConfig.load({"model": {}})


def test_wrong_type_in_model_section() -> None:
    cfg = WarmConfig.load({"model": {"model_type": "x", "q_lora_rank": "1024"}})
    with pytest.raises(ConfigError, match="must be int"):
        cfg.get("model.q_lora_rank", int, plugin="p")
    assert cfg.get("model.absent", int, plugin="p", default=7) == 7
    assert warmreg.WarmConfig.load(cfg) is cfg


def test_a_config_error_carries_the_values_the_field_accepts() -> None:
    """What a reader names as accepted (``choices``) travels on the error, missing or unknown, for tools to use."""
    import pytest

    from warmreg import ConfigError, WarmConfig

    config = WarmConfig.load({"model": {"model_type": "x"}, "serving": {"kv_cache_dtype": "fp8_e5m2"}})
    with pytest.raises(ConfigError) as missing:
        config.get("serving.attention_backend", str, plugin="p", choices=("A", "B"))
    with pytest.raises(ConfigError) as unknown:
        config.get("serving.kv_cache_dtype", str, plugin="p", choices=("auto", "fp8"))
    assert missing.value.accepted == ("A", "B") and unknown.value.accepted == ("auto", "fp8")
