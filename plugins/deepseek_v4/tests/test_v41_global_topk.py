"""DeepSeek-V4.1's global top-k indices: DeepSeek-V4's op with V4.1's plan (which attention classes launch it, the
compressed tokens a kernel page for ratios 1 and 2, the kernel block table's width), V4.1-shaped launches against the
reference under Triton's interpreter, and cross-compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_global_topk
from warmreg_deepseek_v4.global_topk import GlobalTopkIndices, global_topk_indices_reference
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_global_topk import V41GlobalTopkIndices, block_table_width

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
NAME = GlobalTopkIndices.name
MEGA = {"attention_backend": "FLASHMLA_MEGA_ATTN_DSV41", "tensor_parallel_size": 2, "kv_cache_dtype": "auto"}


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _fields(config: Any, target: str) -> set[tuple[int, int, bool]]:
    plan = warmreg.plan(config, target=target)
    return {(k.fields()["block_size"], k.fields()["block_table_stride"], k.fields()["topk_aligned"])
            for k in plan.kernel(NAME).keys}  # fmt: skip


def test_v41_names_the_v4_op() -> None:
    assert V41GlobalTopkIndices.name == NAME and V41GlobalTopkIndices.jit is GlobalTopkIndices.jit


@pytest.mark.parametrize(
    ("serving", "target", "want"),
    [
        # FlashMLA on SM90: 64-token kernel pages over ratio 2 (layers 2-19) and ratio 1 (20-42)
        ({}, "cuda:90", {(32, 16384, True), (64, 16384, True)}),
        ({}, "cuda:100", {(64, 8192, True), (128, 8192, True)}),  # 128-token kernel pages elsewhere
        (MEGA, "cuda:100", {(64, 8192, True), (128, 8192, True)}),
        (
            {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8"},
            "cuda:120",
            {(32, 16384, True), (64, 16384, True)},
        ),
    ],
)
def test_plan_per_attention_class(serving: dict[str, Any], target: str, want: set[tuple[int, int, bool]]) -> None:
    """max_model_len 2^20 over 256-token blocks: 4096 blocks, times the 256 / kernel-page split."""
    assert _fields(_v41(**serving), target) == want


def test_not_planned_for_flashinfer_on_sm100_or_without_compressed_layers() -> None:
    flashinfer = _v41(attention_backend="FLASHINFER_MLA_SPARSE_DSV41", kv_cache_dtype="fp8")
    assert NAME not in {k.name for k in warmreg.plan(flashinfer, target="cuda:100").kernels}
    config = _v41()
    config["model"]["text_config"]["compress_ratios"] = [0] * 43
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}


def test_ratio_1_and_2_layers_plan_both_page_sizes() -> None:
    config = _v41()
    config["model"]["text_config"]["compress_ratios"] = [0, 0] + [1, 2] * 20 + [2]
    assert {f[0] for f in _fields(config, "cuda:100")} == {128, 64}


def test_block_size_must_split_into_kernel_pages() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"serving\.block_size"):
        warmreg.plan(_v41(block_size=96), target="cuda:100")
    assert block_table_width(warmreg.WarmConfig.load(_v41(max_model_len=1000)), 128) == 8  # 4 blocks, x 2


def test_runtime_calls_are_planned() -> None:
    """FlashMLA's decode: prefixes of the shared buffer, the kernel block table's first rows."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target="cuda:100")
    kernel = plan.kernel(NAME).kernel
    buffer, table = warmreg.meta((8192, 512), I32), warmreg.meta((256, 8192), I32)
    t2r, valid = warmreg.meta((8192,), I32), warmreg.meta((8192,), torch.bool)
    for t in (1, 3, 256):
        call = OpCall(kernel, (buffer[:t], t2r, table[:t], valid[:t]), {"block_size": 64})
        assert call.launch_code().key in plan.kernel(NAME).keys
    assert_warmup_inputs_reproduce(kernel, plan.kernel(NAME).keys)
    sm120 = warmreg.plan(_v41(attention_backend="FLASHINFER_MLA_SPARSE_DSV41", kv_cache_dtype="fp8"), target="cuda:120")
    call = OpCall(sm120.kernel(NAME).kernel, (buffer[3:10], t2r[3:10], warmreg.meta((256, 16384), I32), valid[3:10]),
                  {"block_size": 32})  # fmt: skip
    assert call.launch_code().key in sm120.kernel(NAME).keys


def test_v41_shaped_launch_matches_reference() -> None:
    """Ratio 2 on 128-token kernel pages (64 compressed tokens a page), a prefill slice of the buffer."""
    g = torch.Generator().manual_seed(41)
    buffer = torch.randint(-1, 300, (9, 16), generator=g, dtype=I32)
    table = torch.randint(0, 50, (3, 8), generator=g, dtype=I32)
    t2r = torch.tensor([0, 0, 1, 2, 2, 1, 0, 1, 2], dtype=I32)
    valid = torch.tensor([1, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    got = V41GlobalTopkIndices()(buffer[2:9], t2r[2:9], table, valid[2:9], block_size=64)
    want = global_topk_indices_reference(buffer[2:9], t2r[2:9], table, valid[2:9], block_size=64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_out_conformance() -> None:
    g = torch.Generator().manual_seed(4)
    topk, table = (
        torch.randint(-1, 300, (5, 16), generator=g, dtype=I32),
        torch.randint(0, 50, (3, 8), generator=g, dtype=I32),
    )
    t2r, valid = torch.tensor([0, 1, 2, 2, 1], dtype=I32), torch.tensor([True, True, False, True, True])
    check_out(lambda: OpCall(V41GlobalTopkIndices(), (topk, t2r, table, valid), {"block_size": 64}))


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    plugin = RegisterPlugin(v41_global_topk.register, model=DSV4.from_config)
    report = warmreg.warm(_v41(), target=target, plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
