"""The MLA layers' KV block size vLLM runs (warmreg_kimi_k3.backends.kv_block_size): the requested one raised until an
attention page holds a KDA state page, as vLLM's ``Platform._align_hybrid_block_size`` raises it once the model is
loaded. Checked against vLLM's own function in ``tests/engines/test_vllm.py``; here the arithmetic and the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_kimi_k3.backends import kda_layout, kda_state_page_bytes, kv_block_size, mla_token_bytes
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
SLOTS = "warmreg.ops.block_table_slot_mapping"


def _config(linear: dict[str, Any] | None = None, **serving: Any) -> warmreg.WarmConfig:
    data = example_config("kimi_k3", **serving)
    data["serving"] = {k: v for k, v in data["serving"].items() if v is not None}
    data["model"]["text_config"]["linear_attn_config"].update(linear or {})
    return warmreg.WarmConfig.load(data)


def _block(config: warmreg.WarmConfig) -> int:
    return kv_block_size(KimiK3.from_config(config), config)


def test_the_examples_sizes() -> None:
    config = _config()
    m = KimiK3.from_config(config)
    layout = kda_layout(m, config)
    assert layout is not None
    # conv: (4 - 1 + 3) x 3 x 12 heads x 128 bf16 values; recurrent: 12 x 128 x 128 float32
    assert kda_state_page_bytes(layout) == 6 * 4608 * 2 + 12 * 128 * 128 * 4 == 841728
    assert mla_token_bytes(m, config) == (512 + 64) * 2 == 1152
    assert config.serving["block_size"] == 768 == _block(config)


@pytest.mark.parametrize(
    ("serving", "block"),
    [
        ({"block_size": 64}, 768),  # the requested --block-size of the example: 128 * cdiv(841728, 128 * 1152)
        ({"block_size": 16}, 768),  # vLLM's CPU platform's MLA block size: the MLA floor of 128 decides
        ({"block_size": None}, 768),  # unset: FlashMLA's preferred 64, then the same
        ({"block_size": 1024}, 1024),  # already holds a state page: kept
        ({"block_size": 200}, 832),  # 200 * cdiv(841728, 200 * 1152) = 800, a multiple of FlashMLA's 64: 832
        ({"block_size": 200, "attention_backend": "TRITON_MLA"}, 800),  # multiples of 16
        ({"block_size": 64, "kv_cache_dtype": "fp8"}, 1536),  # 576-byte tokens: 128 * cdiv(841728, 128 * 576)
        ({"block_size": 768, "kv_cache_dtype": "fp8"}, 1536),  # 768 * cdiv(841728, 768 * 576)
        ({"block_size": 64, "num_speculative_tokens": 0}, 768),  # conv state of 3 rows: 814,080 bytes, 6 x 128
        ({"block_size": 64, "tensor_parallel_size": 4}, 1536),  # 24 heads a rank: 1,683,456 bytes, 12 x 128
        ({"block_size": 64, "dtype": "float32"}, 512),  # 4-byte cache and conv state: 897,024 / (128 * 2304), 4 x 128
    ],
)
def test_vllms_alignment(serving: dict[str, Any], block: int) -> None:
    assert _block(_config(**serving)) == block


def test_idempotent_and_without_kda_layers_the_requested_size() -> None:
    for requested in (16, 64, 200, 768, 1000, 4096):
        aligned = _block(_config(block_size=requested))
        assert _block(_config(block_size=aligned)) == aligned >= requested
    assert _block(_config({"kda_layers": []}, block_size=64)) == 64
    assert _block(_config({"kda_layers": []}, block_size=None)) == 64  # FlashMLA's preferred size


def test_the_slot_mapping_is_planned_at_the_block_size_vllm_runs() -> None:
    """The key vLLM launches (768), never the requested 64's."""
    for requested in (64, 768):
        plan = warmreg.plan(_config(block_size=requested), target="cuda:90")
        assert {key.block_size for key in plan.kernel(SLOTS).keys} == {768}


@pytest.mark.parametrize(
    ("serving", "field"),
    [
        ({"attention_backend": "CUTLASS_MLA_X"}, "serving.attention_backend"),
        ({"attention_backend": None}, "serving.attention_backend"),
        ({"kv_cache_dtype": "int4"}, "serving.kv_cache_dtype"),
    ],
)
def test_what_decides_the_alignment_must_be_known(serving: dict[str, Any], field: str) -> None:
    with pytest.raises(warmreg.ConfigError) as info:
        warmreg.plan(_config(**serving), target="cuda:90")
    assert info.value.field == field
