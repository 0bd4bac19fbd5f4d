"""The attention caches' layout per backend and target (warmreg_deepseek_v4.backends.kv_cache_layout), and the
kernels each layout plans. ``tests/engines/test_vllm.py`` checks the table against vLLM's own backend classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_deepseek_v4.backends import flashinfer_rope_quant, kv_cache_layout
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

FLASHINFER, FLASHMLA = "FLASHINFER_MLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV4"
GATHER, INDEXER_K, INV_ROPE = (
    "deepseek_v4.dequant_gather_k_cache", "deepseek_v4.indexer_kv_compress_insert", "deepseek_v4.inv_rope_fp8_quant",
)  # fmt: skip


def _config(example: str = "deepseek_v4_pro", **serving: Any) -> warmreg.WarmConfig:
    return warmreg.WarmConfig.load(example_config(example, **serving))


def _layout(target: str, backend: str, name: str) -> str:
    return kv_cache_layout(_config(attention_backend=backend, kv_cache_dtype=name), warmreg.Platform.parse(target))


@pytest.mark.parametrize(
    ("target", "backend", "name", "layout"),
    [
        # FlashInfer on SM10x: the plain per-tensor FP8 layout (or bf16 rows), never fp8_ds_mla
        ("cuda:100", FLASHINFER, "fp8", "fp8"),
        ("cuda:103", FLASHINFER, "fp8_e4m3", "fp8"),
        ("cuda:100", FLASHINFER, "auto", "bfloat16"),
        ("cuda:100", FLASHINFER, "bfloat16", "bfloat16"),
        # FlashInfer on SM12x: FP8 names only, stored as fp8_ds_mla (its SM120 attention class)
        ("cuda:120", FLASHINFER, "fp8", "fp8_ds_mla"),
        ("cuda:121", FLASHINFER, "fp8_ds_mla", "fp8_ds_mla"),
        # FlashMLA (and ROCm's attention): every FP8 name and auto become fp8_ds_mla, which vLLM writes back
        ("cuda:90", FLASHMLA, "auto", "fp8_ds_mla"),
        ("cuda:90", FLASHMLA, "fp8", "fp8_ds_mla"),
        ("cuda:100", FLASHMLA, "fp8_e4m3", "fp8_ds_mla"),
        ("rocm:gfx942", FLASHMLA, "auto", "fp8_ds_mla"),
    ],
)
def test_layout_vllm_stores(target: str, backend: str, name: str, layout: str) -> None:
    assert _layout(target, backend, name) == layout


@pytest.mark.parametrize(
    ("target", "backend", "name", "field", "words"),
    [
        ("cuda:100", FLASHINFER, "fp8_ds_mla", "kv_cache_dtype", ["plain per-tensor FP8", "auto, bfloat16, fp8, fp8_e4m3"]),
        ("cuda:120", FLASHINFER, "auto", "kv_cache_dtype", ["only FP8 caches", "fp8, fp8_e4m3, fp8_ds_mla"]),
        ("cuda:120", FLASHINFER, "bfloat16", "kv_cache_dtype", ["only FP8 caches"]),
        ("cuda:90", FLASHINFER, "fp8_ds_mla", "attention_backend", ["SM10x and SM12x", f"use {FLASHMLA} on cuda:90"]),
        ("cuda:90", FLASHINFER, "fp8", "attention_backend", ["SM10x and SM12x"]),
        ("cuda:110", FLASHINFER, "fp8", "attention_backend", ["SM10x and SM12x"]),
        ("cuda:90", FLASHMLA, "bfloat16", "kv_cache_dtype", ["only as fp8_ds_mla pages"]),
        ("rocm:gfx950", FLASHMLA, "bfloat16", "kv_cache_dtype", ["only as fp8_ds_mla pages"]),
    ],
)  # fmt: skip
def test_pairs_vllm_refuses_are_refused_naming_field_target_and_fix(
    target: str, backend: str, name: str, field: str, words: list[str]
) -> None:
    """At plan time too (the plugin's hook), before any kernel is registered."""
    for call in (
        lambda: _layout(target, backend, name),
        lambda: warmreg.plan(example_config("deepseek_v4_pro", attention_backend=backend, kv_cache_dtype=name), target=target),
    ):  # fmt: skip
        with pytest.raises(warmreg.ConfigError) as info:
            call()
        message = str(info.value)
        assert info.value.field == f"serving.{field}" and target in message and "fix:" in message, message
        assert all(w in message for w in words), message


def test_the_layout_of_flashinfer_needs_the_target() -> None:
    config = _config(attention_backend=FLASHINFER, kv_cache_dtype="fp8")
    with pytest.raises(warmreg.ConfigError, match="depends on the target"):
        kv_cache_layout(config, None)
    assert kv_cache_layout(_config(), None) == "fp8_ds_mla"  # FlashMLA: the same on every target


def _plan(target: str, **serving: Any) -> warmreg.Plan:
    return warmreg.plan(example_config("deepseek_v4_pro", **serving), target=target)


def test_flashinfer_fp8_on_sm10x_plans_the_plain_layouts_kernels() -> None:
    """No fp8_ds_mla gather (FlashInfer's kernel reads the cache itself; vLLM registers the Triton gather for FlashMLA
    only), and the C4 indexer's pages 512-aligned: vLLM aligns them to 576 only when the cache ends up fp8_ds_mla."""
    plain = _plan("cuda:100", attention_backend=FLASHINFER, kv_cache_dtype="fp8")
    assert GATHER not in {k.name for k in plain.kernels}
    assert {k.kv_block_stride for k in plain.kernel(INDEXER_K).keys} == {8704}  # 64 x 132 bytes, rounded to 512
    flashmla = _plan("cuda:100")
    assert GATHER in {k.name for k in flashmla.kernels}
    assert {k.kv_block_stride for k in flashmla.kernel(INDEXER_K).keys} == {8640}  # rounded to 576
    sm120 = _plan("cuda:120", attention_backend=FLASHINFER, kv_cache_dtype="fp8")  # stored as fp8_ds_mla there
    assert GATHER not in {k.name for k in sm120.kernels}
    assert {k.kv_block_stride for k in sm120.kernel(INDEXER_K).keys} == {8640}


def test_auto_under_flashmla_plans_fp8_ds_mla() -> None:
    """vLLM writes fp8_ds_mla back for auto / fp8 / fp8_e4m3 under FlashMLA: the same keys as the explicit name."""
    want = {(k.name, key) for k, key in _plan("cuda:90").items()}
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert {(k.name, key) for k, key in _plan("cuda:90", kv_cache_dtype=name).items()} == want


@pytest.mark.parametrize(
    ("target", "tp", "name", "fused"),
    [
        ("cuda:100", 1, "fp8", True),  # 128 heads a rank, FP8 rows, FP8 wo_a: FlashInfer's RopeQuant epilogue
        ("cuda:100", 1, "auto", False),  # bf16 rows: "RopeQuant needs the per-tensor FP8 KV cache"
        ("cuda:100", 8, "fp8", False),  # 16 heads a rank
        ("cuda:120", 1, "fp8", False),  # the SM120 attention class has no RopeQuant
    ],
)
def test_flashinfer_rope_quant_replaces_the_triton_inverse_rope(target: str, tp: int, name: str, fused: bool) -> None:
    config = _config(attention_backend=FLASHINFER, kv_cache_dtype=name, tensor_parallel_size=tp)
    platform = warmreg.Platform.parse(target)
    assert flashinfer_rope_quant(DSV4.from_config(config), config, platform) is fused
    assert (INV_ROPE in {k.name for k in warmreg.plan(config, target=target).kernels}) is not fused
