"""Kimi-K3.1's plan of the shared sparse-MLA metadata kernels (``warmreg.ops``; the kernels themselves are tested in
``tests/test_mla_index_metadata.py`` and ``tests/test_sparse_mla_index_remap.py``): which keys
examples/kimi_k3_dsa.json plans for each on cuda:90 and cuda:100, how the attention's heads, DCP and the cache dtype
change the top-k remap's, where nothing is planned, and that the planned keys warm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_kimi_k3.dsa_index_metadata import KERNEL_PAGE, dsa_kernel_table_width
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.ops import (
    CompressedSlotMapping,
    IndexerPrefillChunkMetadata,
    PrepareUniformDecode,
    SparseMLAIndexRemap,
    block_table_width,
)
from warmreg.testing import assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
CSLOTS, CHUNK, UNIFORM, REMAP = (k.name for k in (CompressedSlotMapping, IndexerPrefillChunkMetadata,
                                                   PrepareUniformDecode, SparseMLAIndexRemap))  # fmt: skip
FOUR = {CSLOTS, CHUNK, UNIFORM, REMAP}


def _keys(target: str = "cuda:90", **serving: Any) -> dict[str, list[Any]]:
    plan = warmreg.plan(example_config("kimi_k3_dsa", **serving), target=target)
    return {kp.name: list(kp.keys) for kp in plan.kernels if kp.name in FOUR}


def _remap(keys: dict[str, list[Any]]) -> set[tuple[Any, ...]]:
    return {(k.has_prefill, k.count_valid, k.compact_to_front, k.dcp_size, k.dcp_rank) for k in keys[REMAP]}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_keys(target: str) -> None:
    keys = _keys(target)
    assert set(keys) == FOUR
    (slots,) = keys[CSLOTS]  # ratio 1 on 64-token pages (a div16 block size), no DCP
    assert slots.fields() == {"compress_ratio": 1, "tile": 1024, "block_size": "div16", "dcp_world_size": "one",
                              "cp_interleave": "one", "num_warps": 4}  # fmt: skip
    assert len(keys[CHUNK]) == 28 and {k.compress_ratio for k in keys[CHUNK]} == {1}
    # D = 1 .. 1 + 3 drafts: classes one and other; the kernel-page table: 171 blocks of 1536 tokens, 24 pages each
    assert {k.max_decode_len for k in keys[UNIFORM]} == {"one", "other"}
    assert {(k.block_table_stride, k.expanded_bt_stride) for k in keys[UNIFORM]} == {("other", "other")}
    # 96 heads over TP 8: 12 a rank, the FP8 mixed batch: one conversion without counts, 16 tiles of 128
    (remap,) = keys[REMAP]
    assert (remap.block_size, remap.block_stride_rows, remap.num_topk, remap.block_n, remap.single_tile) == (
        64, 64, 2048, 128, False)  # fmt: skip
    assert _remap(keys) == {(False, False, False, 1, 0)}
    for name, ks in keys.items():
        assert_warmup_inputs_reproduce(warmreg.plan(example_config("kimi_k3_dsa"), target=target).kernel(name).kernel, ks)


def test_kernel_table_width() -> None:
    config = warmreg.WarmConfig.load(example_config("kimi_k3_dsa"))
    m = KimiK3.from_config(config)
    assert dsa_kernel_table_width(m, config) == block_table_width(262144, 1536) * 1536 // KERNEL_PAGE == 171 * 24
    dcp = warmreg.WarmConfig.load(example_config("kimi_k3_dsa", decode_context_parallel_size=2))
    assert dsa_kernel_table_width(m, dcp) == 86 * 24
    with pytest.raises(warmreg.ConfigError, match="multiple of 64"):
        _keys(block_size=1552, attention_backend="TRITON_MLA")  # 16-token kernel blocks: not raised to 64s


def test_remap_follows_heads_dcp_and_cache() -> None:
    # 96 heads over TP 2: 48 a rank, the separate FP8 decode (counted) and prefill (workspace) conversions
    assert _remap(_keys(tensor_parallel_size=2)) == {(False, True, True, 1, 0), (True, True, True, 1, 0)}
    # DCP 2 under the mixed batch: the DCP filter with and without counts, on each rank; the chunk metadata per rank
    dcp = _keys(decode_context_parallel_size=2, cp_kv_cache_interleave_size=16)
    assert _remap(dcp) == {(False, c, c, 2, r) for c in (False, True) for r in (0, 1)}
    assert {k.dcp_interleave for k in dcp[REMAP]} == {16}
    assert {k.dcp_rank for k in dcp[CHUNK]} == {"div16", "one"} and len(dcp[CHUNK]) == 2 * 28
    (slots,) = dcp[CSLOTS]
    assert (slots.dcp_world_size, slots.cp_interleave) == ("other", "div16")
    # a BF16 (flat) MLA cache: the remap's block row stride is the packed row's, not modelled: not planned
    assert REMAP not in _keys(kv_cache_dtype="auto") and CSLOTS in _keys(kv_cache_dtype="auto")


def test_not_planned() -> None:
    """sm_10x with DeepGEMM serves decode varlen (no uniform flattening); no DSA layers or a non-CUDA target:
    nothing."""
    assert set(_keys("cuda:100+deepgemm")) == FOUR - {UNIFORM}
    assert not _keys("rocm:gfx942")
    plain = warmreg.plan(example_config("kimi_k3"), target="cuda:90")
    assert not FOUR & {kp.name for kp in plain.kernels}


def test_the_planned_keys_compile() -> None:
    """One compile for cuda:90 of each key of the slot mapping, the uniform decode and the remap (the 28 chunk keys:
    the shared op's own tests)."""
    config = example_config("kimi_k3_dsa")
    plan = warmreg.plan(config, target="cuda:90")
    only = {CSLOTS, UNIFORM, REMAP}

    class Only:
        @warmreg.hookimpl
        def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
            for kp in plan.kernels:
                if kp.name in only:
                    registry.add(kp.kernel)

    report = warmreg.warm(config, target="cuda:90", plugins=[Only()], entry_points=False, workers=2, on_error="continue")
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    assert report.compiled + report.from_cache == 4
