"""The V2 runner's block-table gather: exact equality with the PyTorch reference under Triton's interpreter (groups of
different widths behind address tables), the sliding-window nulling on hand-picked rows, padding rows, errors, the
plan and a real cross-compile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import gather_block_tables
from warmreg_deepseek_v4.gather_block_tables import (
    GatherBlockTables,
    block_table_pointers,
    gather_block_tables_reference,
)
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = GatherBlockTables.name
I32 = torch.int32


class Tables:
    """A runner's persistent tables: per group a source and a forward-pass table ``[max_reqs, W_g]`` (the latter
    full of 7777: what a previous step left), their address tables and the per-group values."""

    def __init__(self, widths: list[int], block_sizes: list[int], reach: list[int], max_reqs: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.src = [torch.randint(1, 10_000, (max_reqs, w), generator=gen, dtype=I32) for w in widths]
        self.dst = [torch.full((max_reqs, w), 7777, dtype=I32) for w in widths]
        self.num_blocks = torch.stack([torch.randint(0, w + 1, (max_reqs,), generator=gen, dtype=I32) for w in widths])
        self.num_computed = torch.randint(0, 3000, (max_reqs,), generator=gen, dtype=I32)
        self.reach, self.block_sizes = torch.tensor(reach, dtype=I32), torch.tensor(block_sizes, dtype=I32)
        self.strides = torch.tensor(widths, dtype=torch.int64)

    def args(self, idx_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The op's positional arguments (the address tables built afresh: the tables do not move)."""
        return (
            idx_mapping, block_table_pointers(self.src), block_table_pointers(self.dst), self.strides,
            self.num_blocks, self.num_computed, self.reach, self.block_sizes,
        )  # fmt: skip

    def reference(self, idx_mapping: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:
        dst = [t.clone() for t in self.dst]
        return gather_block_tables_reference(
            idx_mapping, self.src, dst, self.num_blocks, self.num_computed, self.reach, self.block_sizes, **kw
        )


def test_rows_nulled_below_the_window_and_padding_rows() -> None:
    """SWA group (block 64, reach 127) and a full-attention group (reach 0); request 1 has computed 300 tokens:
    (300 - 127) // 64 = 2 SWA blocks nulled, none in the full group; the padding row 2 is zeroed whole."""
    t = Tables([6, 5], [64, 256], [127, 0], max_reqs=3, seed=0)
    t.num_blocks = torch.tensor([[1, 5, 2], [2, 3, 4]], dtype=I32)
    t.num_computed = torch.tensor([0, 300, 10], dtype=I32)
    idx = torch.tensor([1, 0], dtype=I32)
    GatherBlockTables(mask_sliding_window=True)(*t.args(idx), num_rows=3, mask_sliding_window=True)
    swa, full = t.dst
    assert swa[0].tolist() == [0, 0, *t.src[0][1, 2:5].tolist(), 7777]  # columns past n = 5 untouched
    assert swa[1].tolist() == [t.src[0][0, 0].item(), 7777, 7777, 7777, 7777, 7777]
    assert full[0].tolist() == [*t.src[1][1, :3].tolist(), 7777, 7777]
    assert swa[2].tolist() == [0] * 6 and full[2].tolist() == [0] * 5


@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize(("widths", "rows", "padded"), [([7, 9, 13, 6], 3, 5), ([2100, 40], 4, 4), ([5], 0, 3)])
def test_matches_reference(widths: list[int], rows: int, padded: int, mask: bool) -> None:
    """DeepSeek-V4's four groups (SWA, compressed, two compressor states), a width past one 1024 tile, an empty
    batch whose padded rows are all zeroed; the mask on and off."""
    groups = len(widths)
    t = Tables(widths, [64, 256, 4, 8][:groups], [127, 0, 7, 127][:groups], max_reqs=6, seed=sum(widths) + rows)
    t.num_computed[:] = torch.tensor([0, 130, 5000, 64 * 7, 127, 2000], dtype=I32)
    idx = torch.randperm(6, generator=torch.Generator().manual_seed(rows))[:rows].to(I32)
    GatherBlockTables(mask_sliding_window=mask)(*t.args(idx), num_rows=padded, mask_sliding_window=mask)
    for got, want in zip(t.dst, t.reference(idx, num_rows=padded, mask_sliding_window=mask), strict=True):
        assert torch.equal(got, want)


def test_the_mask_reads_num_computed_tokens_only_when_on() -> None:
    """Off, the runner passes any int32 tensor (vLLM: the reach table itself) in place of num_computed_tokens."""
    t = Tables([8, 8], [4, 4], [3, 0], max_reqs=2, seed=3)
    idx = torch.tensor([0, 1], dtype=I32)
    args = list(t.args(idx))
    args[5] = t.reach  # [G], not [max_reqs]: never read with the mask off
    GatherBlockTables(mask_sliding_window=False)(*args, num_rows=2, mask_sliding_window=False)
    for got, want in zip(t.dst, t.reference(idx, num_rows=2, mask_sliding_window=False)):
        assert torch.equal(got, want)


def test_launch_errors() -> None:
    kernel, t = GatherBlockTables(mask_sliding_window=True), Tables([4, 4], [64, 256], [127, 0], max_reqs=2, seed=1)
    idx = torch.tensor([0, 1], dtype=I32)
    good = list(t.args(idx))
    cases = {
        "src_ptrs must be a contiguous torch.uint64": (1, good[1].long()),
        "block_table_strides must be a contiguous torch.int64": (3, good[3][:1]),
        "num_blocks must be int32": (4, good[4].t()),
        "idx_mapping must be a contiguous 1-D int32": (0, idx.long()),
        "num_computed_tokens must be a contiguous 1-D int32": (5, torch.zeros(4, dtype=I32)[::2]),
        "num_computed_tokens .1 requests. must cover": (5, t.num_computed[:1]),
        "block_sizes must be": (7, good[7].long()),
    }
    for match, (i, bad) in cases.items():
        args = [*good[:i], bad, *good[i + 1 :]]
        with pytest.raises(warmreg.LaunchError, match=match):
            kernel(*args, num_rows=2, mask_sliding_window=True)
    with pytest.raises(warmreg.LaunchError, match="num_rows"):
        kernel(*good, num_rows=1, mask_sliding_window=True)
    with pytest.raises(warmreg.LaunchError, match="non-empty sequence"):
        block_table_pointers([])


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro", "deepseek_v4_flash_0731_dspark"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_masked_key_on_every_platform(example: str, target: str) -> None:
    """Every DeepSeek-V4 deployment has sliding-window groups (the SWA cache, the compressor states), so the
    runner's one gather a step masks them."""
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {"mask_sliding_window": True, "block": 1024, "num_warps": 4}


def test_dcp_turns_the_mask_off() -> None:
    """DCP > 1 (only without C4 layers: the C4 indexer refuses DCP) zeroes every reach: the unmasked binary."""
    config = example_config("deepseek_v4_flash", decode_context_parallel_size=2)
    config["model"]["compress_ratios"] = [0 if r == 4 else r for r in config["model"]["compress_ratios"]]
    kp = warmreg.plan(config, target="cuda:90").kernel(NAME)
    assert [k.fields()["mask_sliding_window"] for k in kp.keys] == [False]
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_runtime_calls_are_planned() -> None:
    """The runner's call through the launch code on meta tensors: any batch, padding and group widths."""
    kp = warmreg.plan(EXAMPLES / "deepseek_v4_flash.json", target="cuda:90").kernel(NAME)
    m = warmreg.meta
    for groups, reqs, rows in ((4, 1, 1), (4, 37, 48), (5, 256, 256)):
        ptrs = m((groups,), torch.uint64)
        args = (
            m((reqs,), I32), ptrs, ptrs, m((groups,), torch.int64), m((groups, 256), I32), m((256,), I32),
            m((groups,), I32), m((groups,), I32),
        )  # fmt: skip
        call = OpCall(kp.kernel, args, {"num_rows": rows, "mask_sliding_window": True})
        assert call.launch_code().key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_warm_cross_compiles_for_cuda_and_gfx942() -> None:
    plugin = RegisterPlugin(gather_block_tables.register, model=DSV4.from_config)
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
