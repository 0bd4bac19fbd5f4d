"""The shared block-table slot mapping: exact against its reference, its domains, and its warm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import warmreg
from warmreg.ops import BlockTableSlotMapping, block_table_slot_mapping_reference, block_table_width

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAME = BlockTableSlotMapping.name
#: DeepSeek-V4's KV-cache groups: SWA, compressed/indexer caches, C4 and C128 compressor states.
DSV4_GROUPS = (64, 256, 4, 8)


class _Plugin:
    def __init__(self, block_sizes: tuple[int, ...]) -> None:
        self.block_sizes = block_sizes

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry, config: warmreg.WarmConfig) -> None:
        registry.add(BlockTableSlotMapping.from_config(config, block_sizes=self.block_sizes, plugin="tests"))


def _batch(
    gen: torch.Generator, *, max_model_len: int, decodes: int, prefills: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode-first batch: ``query_start_loc`` and ``positions`` (some sequences end at max_model_len)."""
    qlens = [int(torch.randint(1, 3, (), generator=gen)) for _ in range(decodes)]
    qlens += [int(torch.randint(1, 12, (), generator=gen)) for _ in range(prefills)]
    qsl, positions = [0], []
    for i, qlen in enumerate(qlens):
        seq_len = max_model_len if i % 3 == 0 else int(torch.randint(qlen, max_model_len + 1, (), generator=gen))
        positions += range(seq_len - qlen, seq_len)
        qsl.append(qsl[-1] + qlen)
    return torch.tensor(qsl, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64)


@pytest.mark.parametrize(
    ("block_size", "dcp_world", "interleave"),
    [(64, 1, 1), (4, 1, 1), (3, 1, 1), (16, 2, 4), (8, 4, 2), (8, 3, 8)],
)
def test_matches_reference_on_decode_first_batches(block_size: int, dcp_world: int, interleave: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + dcp_world)
    max_model_len = 150
    width = block_table_width(max_model_len, block_size, dcp_world)
    kernel = BlockTableSlotMapping(block_sizes=(block_size,), max_model_len=max_model_len, dcp_world=dcp_world)
    for decodes, prefills in [(5, 0), (0, 3), (4, 2)]:
        qsl, positions = _batch(gen, max_model_len=max_model_len, decodes=decodes, prefills=prefills)
        block_table = torch.randint(0, 1000, (decodes + prefills + 2, width), dtype=torch.int32, generator=gen)
        max_tokens = positions.shape[0] + 5  # a graph-padding tail
        for rank in range(dcp_world):
            out = torch.full((max_tokens,), 123, dtype=torch.int64)
            got = kernel(
                qsl,
                positions,
                block_table,
                out,
                block_size=block_size,
                dcp_world=dcp_world,
                dcp_rank=rank,
                interleave=interleave,
            )
            want = block_table_slot_mapping_reference(
                qsl, positions, block_table, block_size=block_size, dcp_world=dcp_world, dcp_rank=rank,
                interleave=interleave, max_num_tokens=max_tokens,
            )  # fmt: skip
            assert got is out and torch.equal(got, want)


def test_dcp_ranks_partition_the_tokens() -> None:
    """Every token is owned by exactly one DCP rank."""
    gen = torch.Generator().manual_seed(7)
    qsl, positions = _batch(gen, max_model_len=100, decodes=3, prefills=2)
    block_table = torch.randint(0, 50, (5, block_table_width(100, 8, 4)), dtype=torch.int32, generator=gen)
    kernel = BlockTableSlotMapping(block_sizes=(8,), max_model_len=100, dcp_world=4)
    owned = torch.stack(
        [kernel(qsl, positions, block_table, block_size=8, dcp_world=4, dcp_rank=r, interleave=2) for r in range(4)]
    )
    assert torch.equal((owned >= 0).sum(0), torch.ones(positions.shape[0], dtype=torch.int64))


def test_small_batches_and_views() -> None:
    kernel = BlockTableSlotMapping(block_sizes=(4,), max_model_len=64)
    wide = torch.arange(40, dtype=torch.int32).reshape(2, 20)
    block_table = wide[:, :16]  # a column slice: row stride 20, not 16
    # T = 0 with a padding tail: the tail program still fills -1.
    out = torch.zeros(6, dtype=torch.int64)
    empty_qsl = torch.zeros(1, dtype=torch.int32)
    no_positions = torch.empty(0, dtype=torch.int64)
    assert torch.equal(kernel(empty_qsl, no_positions, block_table, out, block_size=4), torch.full((6,), -1))
    # T = 0 and nothing to pad: no launch, an empty result.
    assert kernel(empty_qsl, no_positions, block_table, block_size=4).shape == (0,)
    # T = 1, inputs that are offset views (16-byte misaligned): same key, same result.
    pos_buf = torch.tensor([0, 63], dtype=torch.int64)
    qsl_buf = torch.tensor([5, 0, 1], dtype=torch.int32)
    got = kernel(qsl_buf[1:], pos_buf[1:], block_table[1:], block_size=4)
    assert got.tolist() == [block_table[1, 63 // 4].item() * 4 + 63 % 4]
    assert kernel.dispatch(
        block_size=4, block_table=block_table[1:], dcp_world=1, dcp_rank=0, interleave=1
    ) == kernel.dispatch(block_size=4, block_table=wide, dcp_world=1, dcp_rank=0, interleave=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 4, "dcp_world": 2, "dcp_rank": 2}, "rank"),
        ({"block_size": 4, "dcp_world": 2, "interleave": 8}, "interleave 8 must divide"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_arguments_raise_launch_error(kwargs: dict[str, Any], match: str) -> None:
    kernel = BlockTableSlotMapping(block_sizes=(4,), max_model_len=64)
    qsl, positions = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3])
    with pytest.raises(warmreg.LaunchError, match=match):
        kernel(qsl, positions, torch.zeros((1, 16), dtype=torch.int32), **kwargs)
    with pytest.raises(warmreg.LaunchError, match="int32"):
        kernel(qsl, positions, torch.zeros((1, 16), dtype=torch.int64), block_size=4)
    with pytest.raises(warmreg.LaunchError, match="holds 0 slots"):
        kernel(qsl, positions, torch.zeros((1, 16), dtype=torch.int32), torch.empty(0, dtype=torch.int64), block_size=4)


@pytest.mark.parametrize(
    ("max_model_len", "block_size", "dcp_world", "width"),
    [
        (1048576, 256, 1, 4096),
        (1048576, 64, 1, 16384),
        (1048576, 4, 1, 262144),
        (100, 256, 1, 1),  # one entry: the stride is Triton's "one" class
        (100, 64, 1, 2),  # rounded to even
        (100, 8, 1, 16),  # 13 -> multiple of 16
        (100, 4, 1, 32),  # 25 -> multiple of 32
        (1000, 16, 2, 32),  # sharded: cdiv(1000, 32) = 32 -> multiple of 8
    ],
)
def test_block_table_width(max_model_len: int, block_size: int, dcp_world: int, width: int) -> None:
    assert block_table_width(max_model_len, block_size, dcp_world) == width


@pytest.mark.parametrize("example", ["deepseek_v4_flash.json", "deepseek_v4_pro.json"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_plan_covers_runtime_block_tables(example: str, dcp: int) -> None:
    serving = {"decode_context_parallel_size": dcp, "cp_kv_cache_interleave_size": 4} if dcp > 1 else {}
    config = warmreg.WarmConfig.load(EXAMPLES / example, serving=serving)
    plan = warmreg.plan(config, target="cuda:90", plugins=[_Plugin(DSV4_GROUPS)], entry_points=False)
    keys = set(plan.kernel(NAME).keys)
    assert len(keys) == len(DSV4_GROUPS) * dcp  # one key per group (and per rank under DCP)
    max_len, max_seqs = config.serving["max_model_len"], config.serving["max_num_seqs"]
    kernel = plan.kernel(NAME).kernel
    for block_size in DSV4_GROUPS:
        # The runtime table: [max_num_seqs, W] persistent, or a slice of its first num_reqs rows.
        table = warmreg.meta((max_seqs, block_table_width(max_len, block_size, dcp)), torch.int32)
        for rows in (1, 17, max_seqs):
            for rank in range(dcp):
                key = kernel.dispatch(
                    block_size=block_size,
                    block_table=table[:rows],
                    dcp_world=dcp,
                    dcp_rank=rank,
                    interleave=4 if dcp > 1 else 1,
                )
                assert key in keys, key


def test_warm_cross_compiles_every_group() -> None:
    flash = EXAMPLES / "deepseek_v4_flash.json"
    report = warmreg.warm(
        flash, target="cuda:90", plugins=[_Plugin(DSV4_GROUPS)], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [r.error for r in report.failed]
    assert report.compiled == 4
    # A tiny max_model_len makes the compressed table one entry wide: the stride becomes a constexpr 1.
    tiny = warmreg.WarmConfig.load(flash, serving={"max_model_len": 100})
    report = warmreg.warm(
        tiny, target="cuda:90", plugins=[_Plugin((256, 64))], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [r.error for r in report.failed]
    assert sorted(r.key.block_table_stride for r in report.results) == ["one", "other"]  # type: ignore[attr-defined]
