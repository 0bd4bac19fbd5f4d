"""vLLM's KDA backend resolution, as warmreg_kimi_k3.backends reproduces it for the examples and variants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from warmreg_kimi_k3.backends import kda_decode_backend, kda_layout, kda_prefill_backend, kda_spec_decode_backend
from warmreg_kimi_k3.model import KimiK3

import warmreg

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kimi_k3.json"


def _config(linear: dict[str, Any] | None = None, **serving: Any) -> warmreg.WarmConfig:
    data = json.loads(EXAMPLE.read_text())
    data.pop("description")
    data["model"]["text_config"]["linear_attn_config"].update(linear or {})
    data["serving"].update(serving)
    return warmreg.WarmConfig.load(data)


def _resolve(fn: Any, config: warmreg.WarmConfig, target: str) -> str:
    return str(fn(KimiK3.from_config(config), config, warmreg.Platform.parse(target)))


def test_layout_of_the_example() -> None:
    config = _config()
    layout = kda_layout(KimiK3.from_config(config), config)
    assert layout is not None
    assert (layout.num_heads, layout.head_dim, layout.conv_width, layout.lower_bound) == (12, 128, 4, -5.0)
    assert (layout.num_speculative_tokens, layout.projection_size) == (3, 1536)


@pytest.mark.parametrize(
    ("target", "linear", "serving", "expected"),
    [
        ("cuda:90", {}, {}, "flashkda"),  # bounded gate, head_dim 128, bf16: FlashKDA on every SM9/10/12
        ("cuda:100", {}, {}, "flashkda"),
        ("cuda:120", {}, {}, "flashkda"),
        ("cuda:80", {}, {}, "triton"),
        ("cuda:90", {"gate_lower_bound": None}, {}, "triton"),  # the softplus gate: FlashKDA needs a bound
        ("cuda:90", {}, {"kda_prefill_backend": "triton"}, "triton"),
        ("cuda:100+flashinfer", {}, {}, "flashkda"),  # auto never picks FlashInfer
        ("rocm:gfx942", {}, {}, "triton"),
        ("rocm:gfx950", {}, {}, "fused"),
        ("rocm:gfx950+aiter", {}, {}, "gluon"),
    ],
)
def test_prefill_backend(target: str, linear: dict[str, Any], serving: dict[str, Any], expected: str) -> None:
    assert _resolve(kda_prefill_backend, _config(linear, **serving), target) == expected


@pytest.mark.parametrize(
    ("target", "serving", "expected"),
    [
        ("cuda:90", {}, "triton"),  # the example speculates 3 tokens: no fused decode
        ("cuda:90", {"num_speculative_tokens": 0}, "native"),
        ("cuda:100", {"num_speculative_tokens": 0}, "native"),
        ("cuda:103", {"num_speculative_tokens": 0}, "native"),
        ("cuda:89", {"num_speculative_tokens": 0}, "triton"),  # not SM 9.0 / 10.x / 12.x
        ("cuda:100+flashinfer", {"num_speculative_tokens": 0, "kda_decode_backend": "flashinfer"}, "flashinfer"),
        ("cuda:90", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, "triton"),
        ("cuda:90", {"num_speculative_tokens": 0, "tensor_parallel_size": 16}, "triton"),  # 6 heads a rank
        ("rocm:gfx942", {}, "triton"),  # ROCm ignores the setting; speculation: no HIP fused decode
        ("rocm:gfx942", {"num_speculative_tokens": 0}, "native"),  # the HIP fused decode (12 heads a rank)
        ("rocm:gfx942", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, "native"),
        ("rocm:gfx942", {"num_speculative_tokens": 0, "tensor_parallel_size": 16}, "triton"),  # 6 heads a rank
        ("rocm:gfx950", {}, "triton"),
        ("rocm:gfx950+aiter", {}, "aiter"),  # aiter's Gluon decode on CDNA4, speculative or not
        ("rocm:gfx942+aiter", {}, "triton"),  # CDNA3: no Gluon decode
    ],
)
def test_decode_backend(target: str, serving: dict[str, Any], expected: str) -> None:
    assert _resolve(kda_decode_backend, _config(**serving), target) == expected


@pytest.mark.parametrize(
    ("target", "serving", "expected"),
    [("cuda:100+flashinfer", {}, "flashinfer"), ("cuda:100", {}, "native"), ("cuda:90+flashinfer", {}, "native"),
     ("cuda:100+flashinfer", {"num_speculative_tokens": 0}, "native")],
)  # fmt: skip
def test_spec_decode_backend(target: str, serving: dict[str, Any], expected: str) -> None:
    assert _resolve(kda_spec_decode_backend, _config(**serving), target) == expected


@pytest.mark.parametrize(
    ("fn", "target", "serving", "message"),
    [
        (kda_prefill_backend, "cuda:90", {"kda_prefill_backend": "gluon"}, "auto, triton, flashkda, flashinfer"),
        (kda_prefill_backend, "cuda:90", {"kda_prefill_backend": "fused"}, "ROCm-only"),
        (kda_prefill_backend, "cuda:80", {"kda_prefill_backend": "flashkda"}, "FlashKDA needs"),
        (kda_prefill_backend, "cuda:100+flashinfer", {"kda_prefill_backend": "flashinfer"}, "float32 state"),
        (kda_prefill_backend, "rocm:gfx942", {"kda_prefill_backend": "fused"}, "needs gfx950"),
        (kda_decode_backend, "cuda:90", {"kda_decode_backend": "cute"}, "auto, native, flashinfer, triton"),
        (kda_decode_backend, "cuda:90", {"kda_decode_backend": "native"}, "no speculative tokens"),
        (kda_decode_backend, "cuda:90", {"kda_decode_backend": "flashinfer", "num_speculative_tokens": 0}, "SM10x"),
    ],
)
def test_refused_settings(fn: Any, target: str, serving: dict[str, Any], message: str) -> None:
    with pytest.raises(warmreg.ConfigError, match=message):
        _resolve(fn, _config(**serving), target)


def test_conv_width_is_required() -> None:
    data = json.loads(EXAMPLE.read_text())
    del data["model"]["text_config"]["linear_attn_config"]["short_conv_kernel_size"]
    config = warmreg.WarmConfig.load(data)
    with pytest.raises(warmreg.ConfigError, match="short_conv_kernel_size"):
        kda_layout(KimiK3.from_config(config), config)
