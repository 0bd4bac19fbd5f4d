"""DeepSeek-V4.1's plan of the DeepSeek-V4 ops it launches unchanged (issue 37): the short-context top-k fill, the
indexer Q quant, the inverse RoPE quant, the compressed slot mapping at ratio 2, the indexer's prefill-chunk metadata
and uniform decode. Which keys examples/deepseek_v41.json plans for each on cuda:90 and cuda:100, where nothing is
planned, and that the V4 plans keep their keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_deepseek_v4 import indexer_q, inv_rope_quant, short_context_topk
from warmreg_deepseek_v4._v41 import index_ratios, indexer_block_size
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.ops import CompressedSlotMapping, IndexerPrefillChunkMetadata, PrepareUniformDecode
from warmreg.testing import config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
FILL, IQ, INV, CSLOTS, CHUNK, UNIFORM = (
    k.name
    for k in (
        short_context_topk.ShortContextTopk, indexer_q.IndexerQRopeQuant, inv_rope_quant.InvRopeFP8Quant,
        CompressedSlotMapping, IndexerPrefillChunkMetadata, PrepareUniformDecode,
    )
)  # fmt: skip
SHARED = {FILL, IQ, INV, CSLOTS, CHUNK, UNIFORM}


def _v41(text: dict[str, Any] | None = None, **serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    config["model"]["text_config"].update(text or {})
    return config


def _keys(config: Any, target: str) -> dict[str, list[Any]]:
    return {kp.name: list(kp.keys) for kp in warmreg.plan(config, target=target).kernels}


def test_index_ratios_are_the_index_sources_compressed_ratios() -> None:
    m = DSV4.from_config(warmreg.WarmConfig.load(_v41()))
    assert index_ratios(m) == (1, 2)  # 2, 8 and 14 at ratio 2; 20, 24, 28, 32 and 36 at ratio 1
    ratios = [0, 0, 1] + [2] * 40
    m1 = DSV4.from_config(warmreg.WarmConfig.load(_v41({"compress_ratios": ratios, "index_source_layer_ids": [2]})))
    assert index_ratios(m1) == (1,)
    # an index source on a sliding-window layer builds no indexer; an MTP layer (past the backbone) is no source
    m0 = DSV4.from_config(warmreg.WarmConfig.load(_v41({"index_source_layer_ids": [0, 43]})))
    assert index_ratios(m0) == ()
    v4 = DSV4.from_config(warmreg.WarmConfig.load(example_config("deepseek_v4_flash")))
    assert index_ratios(v4) == ()
    assert [indexer_block_size(warmreg.Platform.parse(t)) for t in ("cuda:90", "cuda:100", "cuda:120")] == [64, 128, 64]


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_the_example_plans_v41s_keys(target: str) -> None:
    keys = _keys(_v41(), target)
    assert SHARED - {INV} <= set(keys)
    fill = keys[FILL]
    assert [(k.topk, k.compress_ratio, k.block_topk, k.num_warps) for k in fill] == [(512, 1, 512, 8), (512, 2, 512, 8)]
    (q,) = keys[IQ]
    assert (q.dtype, q.weights_dtype, q.head_dim, q.rope_dim, q.fp8_dtype, q.explicit_fma) == (
        "bfloat16", "bfloat16", 128, 64, "float8_e4m3fn", False,
    )  # fmt: skip
    (slots,) = keys[CSLOTS]  # both sites (sparse-MLA and indexer, no DCP) give one key at ratio 2 (none at ratio 1)
    assert (slots.compress_ratio, str(slots.block_size), str(slots.dcp_world_size)) == (2, "div16", "one")
    assert {k.compress_ratio for k in keys[CHUNK]} == {1, 2} and len(keys[CHUNK]) == 2 * 28  # 28 a ratio
    assert {str(k.max_decode_len) for k in keys[UNIFORM]} == {"one", "other"}  # MTP 1: decode lengths 1 and 2


def test_inverse_rope_follows_the_wo_a_weight() -> None:
    """MXFP8 linears: Marlin's int32 wo_a on Hopper (bf16 output, no quant); DeepGEMM's [1, 32] blocks on SM100,
    a quant group the op does not build (nothing planned). A plain FP8 checkpoint quantizes in blocks of 128."""
    (h100,) = _keys(_v41(), "cuda:90")[INV]
    assert (h100.quantize, h100.tma_aligned_scales, h100.heads_per_group, h100.head_dim) == (False, False, 8, 512)
    assert INV not in _keys(_v41(), "cuda:100")
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}
    (b200,) = _keys(_v41(fp8), "cuda:100")[INV]
    assert (b200.quantize, b200.tma_aligned_scales) == (True, True)
    mega = _keys(_v41(fp8, attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=8), "cuda:100")
    assert INV not in mega  # mega attention rotates and quantizes inside its kernel


def test_nothing_is_planned_without_an_indexer_or_off_cuda() -> None:
    no_index = _keys(_v41({"index_source_layer_ids": [0, 1]}), "cuda:90")
    assert not {FILL, IQ, CHUNK, UNIFORM} & set(no_index)
    assert CSLOTS in no_index  # the ratio-2 kv sources still map their compressed slots
    swa_only = _keys(_v41({"compress_ratios": [0] * 43}), "cuda:90")
    assert not SHARED - {INV} & set(swa_only)
    rocm = _v41(attention_backend="ROCM_FLASHMLA_SPARSE_DSV41")
    assert not SHARED & set(_keys(rocm, "rocm:gfx942"))  # V4.1's ROCm model is a separate code path
    assert IQ not in _keys(_v41(indexer_kv_dtype="mxfp4"), "cuda:100")
    assert IQ not in _keys(_v41(), "cuda:90+cutedsl")  # CuTeDSL's Q kernel replaces it
    assert UNIFORM not in _keys(_v41(), "cuda:100+deepgemm")  # the native varlen decode


def test_ratio_1_index_sources_plan_ratio_1_keys() -> None:
    ratios = [0, 0] + [1] * 41
    keys = _keys(_v41({"compress_ratios": ratios}), "cuda:90")
    assert {k.compress_ratio for k in keys[FILL]} == {1} and {k.compress_ratio for k in keys[CHUNK]} == {1}
    assert CSLOTS not in keys  # ratio 1 keeps the step's slots at both builders


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_v4_keys_are_unchanged(example: str) -> None:
    """The V4 plan of these ops still comes from their V4 branch: C4 only for the indexer ops."""
    keys = _keys(example_config(example), "cuda:90")
    assert {k.compress_ratio for k in keys[FILL]} == {4} and {k.compress_ratio for k in keys[CHUNK]} == {4}
    assert all(k.quantize for k in keys[INV])
