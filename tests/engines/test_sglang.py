"""``WarmConfig.load`` of a real SGLang 0.5.23 ``ServerArgs`` plans the keys of the example-format JSON.

Runs in the SGLang venv (``bash scripts/engine-envs.sh test sglang``); skips, naming why, elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from warmreg_deepseek_v4.model import DSV4, fp8_checkpoint

from warmreg import ConfigError, WarmConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
from plans import differences, engine_or_skip, planned_keys

engine_or_skip("SGLang", "sglang.srt.server_args", "sglang.srt.arg_groups.model_override_base")

CASES = list(cases.SGLANG_CASES)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("case", CASES)
def test_plan_keys_equal_the_example_format_json(root: Path, case: str) -> None:
    sa = cases.build_sglang(case, root)  # not resolved: WarmConfig.load resolves it
    got, want = planned_keys(sa), planned_keys(cases.expected_sglang(case))
    assert got == want, differences(got, want)


def test_resolved_values_not_raw_attributes(root: Path) -> None:
    sa = cases.build_sglang("flash_eagle", root)
    cfg = WarmConfig.load(sa)
    assert sa.kv_cache_dtype == "auto" and sa.attention_backend is None  # the raw input stays
    assert cfg.serving["kv_cache_dtype"] == "fp8_ds_mla" and cfg.serving["attention_backend"] == "FLASHMLA_SPARSE_DSV4"
    assert cfg.serving["num_speculative_tokens"] == 1 and sa.speculative_num_draft_tokens == 2
    assert WarmConfig.load(sa).serving == cfg.serving  # a resolved ServerArgs reads the same again
    from sglang.srt.arg_groups.model_override_base import model_config_of

    hf = model_config_of(sa).hf_config
    assert type(hf).__name__ == "_DeepseekV4ConfigAlias" and fp8_checkpoint(hf)
    assert DSV4.from_config(cfg) == DSV4.from_config(WarmConfig.load(cases.EXAMPLES / "deepseek_v4_flash.json"))


def test_defaults_resolve_context_and_dtype_from_the_model_config(root: Path) -> None:
    cfg = WarmConfig.load(cases.build_sglang("flash_defaults", root))
    assert cfg.serving["max_model_len"] == 1048576 and cfg.serving["dtype"] == "bfloat16"


def test_a_value_without_a_canonical_counterpart_names_the_field(root: Path) -> None:
    sa = cases.build_sglang("flash_eagle", root)
    sa.kv_cache_dtype = "bfloat16"  # SGLang takes it for DeepSeek-V4 (its NPU pool)
    cfg = WarmConfig.load(sa)
    assert cfg.serving["kv_cache_dtype"] == "bfloat16"
    # chunked prefill off: SGLang resolves it, and no step then has a token bound warmreg can use
    off = cases.build_sglang("flash_eagle", root)
    off.chunked_prefill_size = -1
    with pytest.raises(ConfigError) as info:
        planned_keys(off)
    assert info.value.field == "serving.max_num_batched_tokens"
    assert "ServerArgs.chunked_prefill_size = -1" in str(info.value)
