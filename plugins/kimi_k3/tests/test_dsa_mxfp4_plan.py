"""What a Kimi-K3.1 deployment with an MXFP4 DSA indexer cache plans: the MXFP4 prologue or the MXFP4 key insert
(fused forward or not) and the MXFP4 query quant, on the SM10x family only; engine-shaped runtime inputs give
planned keys; and a real cross-compile for cuda:100.

The configs are ``examples/kimi_k3_dsa.json`` (Kimi-K3.1: DSA on every full-attention layer, the bias-full LayerNorm
key, no indexer RoPE, 32 index heads of 128) with ``serving.indexer_kv_dtype`` switched to ``"mxfp4"`` here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import dsa_mxfp4_k_insert, dsa_mxfp4_prologue, dsa_mxfp4_q_quant
from warmreg_kimi_k3.dsa_mxfp4_k_insert import MXFP4KeyInsert
from warmreg_kimi_k3.dsa_mxfp4_prologue import MXFP4Prologue
from warmreg_kimi_k3.dsa_mxfp4_q_quant import MXFP4QQuant
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
INSERT, PROLOGUE, QUANT = MXFP4KeyInsert.name, MXFP4Prologue.name, MXFP4QQuant.name
PLUGIN = RegisterPlugin(
    dsa_mxfp4_k_insert.register, dsa_mxfp4_prologue.register, dsa_mxfp4_q_quant.register, model=KimiK3.from_config
)


def dsa_config(
    *, heads: int | None = None, head_dim: int | None = None, norm: str | None = None, **serving: Any
) -> dict[str, Any]:
    """``examples/kimi_k3_dsa.json`` with the MXFP4 indexer cache (its fp8 MLA cache: the fused forward), the
    ``dsa_config`` fields given changed and ``serving`` overriding."""
    config = example_config("kimi_k3_dsa", **{"indexer_kv_dtype": "mxfp4", **serving})
    dsa = config["model"]["text_config"]["dsa_config"]
    for field, value in (("index_num_heads", heads), ("index_head_dim", head_dim), ("index_k_norm_type", norm)):
        if value is not None:
            dsa[field] = value
    return config


def plan(config: dict[str, Any], target: str = "cuda:100") -> warmreg.Plan:
    return warmreg.plan(config, target=target, plugins=[PLUGIN], entry_points=False)


def test_fused_forward_plans_the_prologue_and_the_query_quant() -> None:
    p = plan(dsa_config())
    assert {k.name for k in p.kernels} == {PROLOGUE, QUANT}
    (key,) = p.kernel(PROLOGUE).keys
    bf16 = "bfloat16"
    assert key.fields() == {
        "q_dtype": bf16, "kv_dtype": bf16, "rope_dtype": bf16, "index_k_dtype": bf16, "q_norm_dtype": bf16,
        "kv_norm_dtype": bf16, "k_norm_dtype": "float32", "mla_slot_dtype": "int64", "index_slot_dtype": "int64",
        "topk_dtype": "int32", "q_dim": 1536, "q_block": 2048, "kv_dim": 512, "rope_dim": 64, "index_dim": 128,
        "topk": 2048, "topk_block": 1024, "launch_pdl": True, "num_warps": 4,
    }  # fmt: skip
    quant = sorted((k.fields()["heads_per_program"], k.fields()["full"]) for k in p.kernel(QUANT).keys)
    assert quant == [(2, True), (8, True), (16, True)]  # 32 heads: no padding, every bucket up to 8192 tokens


@pytest.mark.parametrize("serving", [{"kv_cache_dtype": "auto"}, {"decode_context_parallel_size": 2}])
def test_unfused_forward_plans_the_key_insert(serving: dict[str, Any]) -> None:
    """Without an fp8_ds_mla MLA cache, or with DCP, vLLM keeps the wrapper forward: the standalone key insert."""
    p = plan(dsa_config(**serving))
    assert {k.name for k in p.kernels} == {INSERT, QUANT}
    (key,) = p.kernel(INSERT).keys
    assert key.fields() == {
        "k_dtype": "bfloat16", "norm_dtype": "float32", "slot_dtype": "int64", "topk_dtype": "int32",
        "head_dim": 128, "topk": 2048, "topk_block": 1024, "num_warps": 1,
    }  # fmt: skip


def test_padded_heads_and_small_steps() -> None:
    """16 heads are padded to DeepGEMM's 32 (the masked variant); a 100-token step limit reaches one bucket."""
    keys = plan(dsa_config(heads=16)).kernel(QUANT).keys
    assert sorted((k.fields()["heads_per_program"], k.fields()["full"]) for k in keys) == [
        (2, False), (8, False), (16, False)
    ]  # fmt: skip
    (key,) = plan(dsa_config(max_num_batched_tokens=100)).kernel(QUANT).keys
    assert key.fields()["heads_per_program"] == 2
    keys = plan(dsa_config(heads=48, max_num_batched_tokens=1000)).kernel(QUANT).keys  # P = 64
    assert sorted((k.fields()["heads_per_program"], k.fields()["full"]) for k in keys) == [(2, False), (8, False)]


@pytest.mark.parametrize("target", ["cuda:90", "cuda:120"])
def test_mxfp4_refused_off_sm10x(target: str) -> None:
    with pytest.raises(warmreg.ConfigError, match="sm_10x") as info:
        plan(dsa_config(), target)
    assert info.value.field == "serving.indexer_kv_dtype"


def test_mxfp4_refusals_that_name_the_model_field() -> None:
    with pytest.raises(warmreg.ConfigError, match="fused Kimi-K3 DSA key insert"):
        plan(dsa_config(norm="rmsnorm"))  # vLLM: MXFP4 needs the fused key insert
    with pytest.raises(warmreg.ConfigError, match="takes 128") as info:
        plan(dsa_config(head_dim=64))  # vLLM's mxfp4_q_quant asserts D = 4 * 32
    assert info.value.field == "text.dsa_config.index_head_dim"


@pytest.mark.parametrize("value", ["fp8", "auto"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_fp8_cache_plans_none_of_these(value: str, target: str) -> None:
    assert not plan(dsa_config(indexer_kv_dtype=value), target).kernels


@pytest.mark.parametrize("target", ["rocm:gfx950", "xpu:pvc"])
def test_no_dsa_off_cuda(target: str) -> None:
    """vLLM's Kimi-K3.1 DSA layers are CUDA-only: nothing is planned (and the setting is not read) elsewhere."""
    assert not plan(dsa_config(), target).kernels


def test_no_dsa_config_plans_nothing() -> None:
    assert not plan(example_config("kimi_k3", indexer_kv_dtype="mxfp4")).kernels


# -- runtime shapes: what vLLM's call sites pass gives planned keys --------------------------------------------------


def _projection(tokens: int, widths: list[int]) -> list[torch.Tensor]:
    """Column views of one packed projection output, as ``low_latency_linear(...).split(widths)`` gives them."""
    return list(warmreg.meta((tokens, sum(widths)), torch.bfloat16).split(widths, dim=-1))


@pytest.mark.parametrize("tokens", [1, 127, 128, 1023, 1024, 8192])
def test_runtime_keys_are_planned(tokens: int) -> None:
    fused, unfused = plan(dsa_config()), plan(dsa_config(kv_cache_dtype="auto"))
    q_c, kv_c, k_pe, index_k, weights = _projection(tokens, [1536, 512, 64, 128, 32])
    topk = warmreg.meta((8192, 2048), torch.int32)[:tokens]
    slots = warmreg.meta((8192,), torch.int64)[:tokens]
    kp = fused.kernel(PROLOGUE)
    key = kp.kernel.dispatch(
        q_c=q_c, kv_c=kv_c, k_pe=k_pe, index_k=index_k, q_norm_weight=warmreg.meta((1536,), torch.bfloat16),
        kv_norm_weight=warmreg.meta((512,), torch.bfloat16), k_norm_weight=warmreg.meta((128,), torch.float32),
        topk_indices_buffer=topk, mla_slot_mapping=slots, index_slot_mapping=slots, launch_pdl=True,
    )  # fmt: skip
    assert key in kp.keys
    assert kp.kernel.dispatch(**{**_prologue_args(q_c, kv_c, k_pe, index_k, topk), "launch_pdl": True}) in kp.keys
    ki = unfused.kernel(INSERT)
    k, _ = _projection(tokens, [128, 32])  # wkv_index's [index_k | weights]
    key = ki.kernel.dispatch(
        k=k, norm_weight=warmreg.meta((128,), torch.float32), slot_mapping=slots, topk_indices_buffer=topk
    )
    assert key in ki.keys
    _, index_q = _projection(tokens, [24 * 192, 32 * 128])  # [q | index_q] of the packed query GEMM
    index_q = index_q.view(tokens, 32, 128)
    for p in (fused, unfused):
        kq = p.kernel(QUANT)
        assert kq.kernel.dispatch(index_q=index_q, index_weights=weights, padded_num_heads=32) in kq.keys


def _prologue_args(
    q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor, topk: torch.Tensor
) -> dict[str, Any]:
    """A profile run's arguments: no caches (vLLM's int64 placeholder slots), the same key."""
    return {
        "q_c": q_c, "kv_c": kv_c, "k_pe": k_pe, "index_k": index_k,
        "q_norm_weight": warmreg.meta((1536,), torch.bfloat16), "kv_norm_weight": warmreg.meta((512,), torch.bfloat16),
        "k_norm_weight": warmreg.meta((128,), torch.float32), "topk_indices_buffer": topk,
        "mla_slot_mapping": None, "index_slot_mapping": None,
    }  # fmt: skip


def test_warmup_inputs_reproduce_every_planned_key() -> None:
    for config in (dsa_config(), dsa_config(kv_cache_dtype="auto", heads=16)):
        for kp in plan(config).kernels:
            assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_warm_cross_compiles_for_sm100() -> None:
    """Every planned key compiles for cuda:100 through Triton's own JIT path (no GPU here): the PDL intrinsics,
    the fp32 log2 / exp2 / rsqrt and the byte stores of all three kernels lower for SM100."""
    fused, unfused = dsa_config(max_num_batched_tokens=100), dsa_config(kv_cache_dtype="auto", heads=16)
    for config, kernels, keys in ((fused, {PROLOGUE, QUANT}, 2), (unfused, {INSERT, QUANT}, 4)):  # 3 quant buckets
        report = warmreg.warm(config, target="cuda:100", plugins=[PLUGIN], entry_points=False, workers=2)
        assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
        assert {r.kernel for r in report.results} == kernels and len(report.results) == keys
