"""The shared sparse-MLA index remap (``warmreg.ops.sparse_mla_index_remap``): exact against its reference and
hand-worked rows under Triton's interpreter (integer rows: ``torch.equal``), strided views, its argument errors, the
keys of its declared launches and their warmup inputs. vLLM 0.34's own kernel is compared in
``tests/engines/test_vllm034_kernels_mla_shared.py``; the Kimi-K3 plan in the plugin's tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import warmreg
from warmreg.ops import RemapLaunch, SparseMLAIndexRemap, remap_tiling, sparse_mla_index_remap_reference
from warmreg.testing import OpCall, assert_allocates_nothing, assert_warmup_inputs_reproduce

I32 = torch.int32
OP = SparseMLAIndexRemap()


def _inputs(tokens: int, topk: int, requests: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    req = torch.randint(0, requests, (tokens,), generator=gen, dtype=I32)
    table = torch.randint(0, 900, (requests, width), generator=gen, dtype=I32)
    ids = torch.randint(-1, 64 * width + 50, (tokens, topk), generator=gen, dtype=I32)
    return req, table, ids


def _same(got: Any, want: Any) -> None:
    if isinstance(want, tuple):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)


def test_hand_worked_rows() -> None:
    """Request 1's ids 0, 63, 64 and 130 in 64-token blocks [7, 2, 5]; -1 and an id past the table give -1."""
    table = torch.tensor([[9, 9, 9], [7, 2, 5]], dtype=I32)
    ids = torch.tensor([[0, 63, 64, 130, -1, 192, 1, 2]], dtype=I32)
    out, counts = OP(torch.tensor([1], dtype=I32), table, ids, block_size=64, block_n=8, return_valid_counts=True,
                     compact_to_front=False)  # fmt: skip
    assert out.tolist() == [[7 * 64, 7 * 64 + 63, 2 * 64, 5 * 64 + 2, -1, -1, 7 * 64 + 1, 7 * 64 + 2]]
    assert counts.tolist() == [6]
    # rows 200 apart between blocks (other layers' pages in between); compacted: the valid rows first
    out, counts = OP(torch.tensor([1], dtype=I32), table, ids, block_size=64, block_stride_rows=200, block_n=8,
                     return_valid_counts=True)  # fmt: skip
    assert out.tolist() == [[1400, 1463, 400, 1002, 1401, 1402, -1, -1]] and counts.tolist() == [6]


def test_dcp_and_prefill_workspace_by_hand() -> None:
    """DCP world 2, interleave 2: id 5 is rank 0's local 3 (ids 0 1 | 4 5 | ...); id 2 is rank 1's, so -1 on a decode
    row and, on a prefill row, rank 1's workspace part: rank_stride + start + local 0."""
    table = torch.tensor([[4]], dtype=I32)
    ids = torch.tensor([[5, 2, -1, 0], [5, 2, -1, 0]], dtype=I32)
    prefill = torch.tensor([-1, 0], dtype=I32)
    out = OP(torch.zeros(2, dtype=I32), table, ids, block_size=64, block_n=4, dcp_size=2, dcp_rank=0, dcp_interleave=2,
             prefill_workspace_request_ids=prefill, prefill_workspace_starts=torch.tensor([10], dtype=I32),
             prefill_workspace_rank_stride=100)  # fmt: skip
    assert out.tolist() == [[4 * 64 + 3, -1, -1, 4 * 64], [10 + 3, 100 + 10 + 0, -1, 10]]


CASES: list[dict[str, Any]] = [
    {},
    {"return_valid_counts": True},
    {"return_valid_counts": True, "compact_to_front": False, "block_n": 64},
    {"block_stride_rows": 3 * 64 + 8, "return_valid_counts": True},
    {"dcp_size": 3, "dcp_rank": 2, "dcp_interleave": 16, "return_valid_counts": True},
    {"dcp_size": 2, "dcp_rank": 1, "return_valid_counts": True, "compact_to_front": False},
    {"idx_mapping": torch.tensor([2, -1, 0], dtype=I32)},
    {"prefill_workspace_request_ids": torch.tensor([-1, 0, 1, -1, 1, 0, -1], dtype=I32),
     "prefill_workspace_starts": torch.tensor([0, 333], dtype=I32), "return_valid_counts": True},
]  # fmt: skip


@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
def test_matches_reference(kw: dict[str, Any]) -> None:
    req, table, ids = _inputs(7, 384, 3, 6, seed=len(kw))  # 384: not a power of two, padded to one counting tile
    _same(
        OP(req, table, ids, block_size=64, **kw), sparse_mla_index_remap_reference(req, table, ids, block_size=64, **kw)
    )


def test_multi_tile_counts_and_compaction() -> None:
    """4224 columns (not a power of two, past one 4096-wide tile): 33 tiles count with atomics into a zeroed buffer; compaction keeps the
    column order under the interpreter (tiles in order)."""
    req, table, ids = _inputs(2, 4224, 2, 140, seed=4)
    assert remap_tiling(4224, 128, True) == (False, 128, 33, 4)
    counts = torch.full((2,), 77, dtype=I32)  # stale: the launcher zeroes it
    got = OP(req, table, ids, block_size=64, return_valid_counts=True, valid_counts_out=counts)
    _same(got, sparse_mla_index_remap_reference(req, table, ids, block_size=64, return_valid_counts=True))
    assert got[1] is counts


def test_strided_views_and_empty_step() -> None:
    req, table, ids = _inputs(4, 256, 3, 5, seed=6)
    wide_table = torch.cat([table[:, :1], table, table], 1)[:, 1 : 1 + 5]  # the table at a row stride of 11, an offset
    view = torch.cat([ids[:, :3], ids], 1)[:, 3:]  # the ids as a column slice of a wider top-k buffer
    out = torch.empty(4, 256, dtype=I32)
    got = OP(req, wide_table, view, block_size=64, out=out)
    _same(got, sparse_mla_index_remap_reference(req, table, ids, block_size=64))
    assert got is out
    empty = OP(req[:0], table, ids[:0], block_size=64, return_valid_counts=True)
    assert empty[0].shape == (0, 256) and empty[1].shape == (0,)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_n": 100}, "multiple of block_n"),
        ({"dcp_size": 2, "dcp_rank": 2}, "bad DCP rank"),
        ({"dcp_size": 2, "dcp_interleave": 48}, "not dividing the block size"),
        ({"prefill_workspace_starts": torch.zeros(1, dtype=I32)}, "go together"),
        ({"idx_mapping": torch.zeros(3, dtype=torch.int64)}, "idx_mapping must be"),
        ({"out": torch.empty(4, 256, dtype=torch.int64)}, "out must be int32"),
        ({"return_valid_counts": True, "valid_counts_out": torch.empty(3, dtype=I32)}, "valid_counts_out"),
    ],
)
def test_errors_name_the_argument(kw: dict[str, Any], match: str) -> None:
    req, table, ids = _inputs(4, 256, 3, 5, seed=8)
    with pytest.raises(warmreg.LaunchError, match=match):
        OP(req, table, ids, block_size=64, **kw)
    with pytest.raises(warmreg.LaunchError, match="same tokens"):
        OP(req[:3], table, ids, block_size=64)
    with pytest.raises(warmreg.LaunchError, match="token_indices must be"):
        OP(req, table, ids.long(), block_size=64)


class _Plugin:
    def __init__(self, launches: list[RemapLaunch]) -> None:
        self.launches = launches

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        registry.add(SparseMLAIndexRemap(launches=self.launches))


def test_declared_launches_give_their_keys_and_warmup_inputs() -> None:
    base: dict[str, Any] = dict(block_size=64, block_stride_rows=64)
    launches = [
        RemapLaunch(**base, num_topk=2048),
        RemapLaunch(**base, num_topk=2048, count_valid=True, compact_to_front=True),
        RemapLaunch(**base, num_topk=2048, has_prefill=True, count_valid=True, compact_to_front=True),
        RemapLaunch(**base, num_topk=4224, count_valid=True, compact_to_front=True, dcp_size=2, dcp_rank=1),
        RemapLaunch(block_size=64, block_stride_rows=200, num_topk=384, has_idx_mapping=True, count_valid=True),
        RemapLaunch(**base, num_topk=2048),  # a second call site of the same kind: one key
    ]
    config = {"model": {"model_type": "tests"}, "serving": {}}
    kp = warmreg.plan(config, target="cuda:90", plugins=[_Plugin(launches)], entry_points=False).kernel(OP.name)
    keys = list(kp.keys)
    assert len(keys) == 5
    tiling = {(k.num_topk, k.count_valid, k.has_prefill): (k.block_n, k.num_warps, k.single_tile) for k in keys}  # type: ignore[attr-defined]
    assert tiling[2048, False, False] == (128, 4, False)
    assert tiling[2048, True, False] == tiling[2048, True, True] == (2048, 8, True)
    assert tiling[4224, True, False] == (128, 4, False)
    assert tiling[384, True, False] == (512, 8, True)
    assert_warmup_inputs_reproduce(kp.kernel, keys)


def test_launch_with_out_allocates_nothing() -> None:
    """Given ``out`` (rows) the launch code allocates nothing; without it, the rows."""
    req, table, ids = _inputs(4, 256, 3, 5, seed=10)
    assert_allocates_nothing(OpCall(OP, (req, table, ids), {"block_size": 64}))
