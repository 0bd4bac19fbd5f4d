"""The KDA aligned state indices: exact equality with the PyTorch reference under Triton's interpreter, the math
on hand-picked lengths, and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.kda_state_indices import AlignedStateIndices, aligned_state_indices_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = AlignedStateIndices.name


def _kernel() -> AlignedStateIndices:
    return AlignedStateIndices(max_num_seqs=4, num_speculative_tokens=3)


def _table(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 1000, (rows, width), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_the_block_of_the_last_token() -> None:
    """L = 0 and 1 take column 0; L = B the last column of block 0; L = B + 1 block 1; then S slots on."""
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
    seq_lens = torch.tensor([0, 1, 16, 17], dtype=torch.int32)
    got = _kernel()(table, seq_lens, block_size=16, num_state_slots=3, launch_pdl=False)
    assert got.tolist() == [[100, 101, 102], [110, 111, 112], [120, 121, 122], [131, 132, 133]]


@pytest.mark.parametrize(("rows", "slots", "block"), [(1, 1, 64), (33, 4, 16), (5, 3, 7)])  # 33: two programs
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_reference(rows: int, slots: int, block: int, dtype: torch.dtype) -> None:
    width = 12
    gen = torch.Generator().manual_seed(rows + slots)
    seq_lens = torch.randint(-3, (width - slots + 1) * block + 1, (rows,), generator=gen).to(dtype)
    table = _table(rows, width, seed=block).to(dtype)
    got = _kernel()(table, seq_lens, block_size=block, num_state_slots=slots, launch_pdl=False)
    want = aligned_state_indices_reference(table, seq_lens, block_size=block, num_state_slots=slots)
    assert got.dtype == dtype and torch.equal(got, want)


def test_strided_views() -> None:
    """A row slice of a wider persistent table, a column-major table, and a strided seq_lens: one binary."""
    kernel, seq_lens = _kernel(), torch.tensor([5, 70, 33, 1, 0, 64], dtype=torch.int32)
    persistent = _table(8, 20)[:6, :9]
    column_major = _table(9, 6, seed=1).t()
    strided_lens = torch.stack([seq_lens, seq_lens]).t()[:, 0]
    keys = set()
    for table, lens in ((persistent, seq_lens), (column_major, seq_lens), (persistent, strided_lens)):
        got = kernel(table, lens, block_size=16, num_state_slots=4, launch_pdl=False)
        assert torch.equal(got, aligned_state_indices_reference(table, lens, block_size=16, num_state_slots=4))
        keys.add(kernel.dispatch(block_table=table, seq_lens=lens, num_state_slots=4, launch_pdl=False))
    assert len(keys) == 1


def test_empty_batch_and_launch_errors() -> None:
    kernel, table = _kernel(), _table(2, 8)
    assert kernel(table[:0], torch.zeros(0, dtype=torch.int32), block_size=16, num_state_slots=4).shape == (0, 4)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(warmreg.LaunchError, match="num_state_slots"):
        kernel(table, lens, block_size=16, num_state_slots=9)
    with pytest.raises(warmreg.LaunchError, match="block_size"):
        kernel(table, lens, block_size=0, num_state_slots=4)
    with pytest.raises(warmreg.LaunchError, match="seq_lens"):
        kernel(table, lens[:1], block_size=16, num_state_slots=4)
    with pytest.raises(warmreg.LaunchError, match="block_table"):
        kernel(table.float(), lens, block_size=16, num_state_slots=4)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["kimi_k3", "kimi_k3_attn_res"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_one_key_with_a_slot_per_draft(example: str, target: str) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {
        "index_dtype": "int32", "seq_lens_dtype": "int32", "num_state_slots": 4, "block_state_slots": 4,
        "block_rows": 32, "launch_pdl": True, "num_warps": 1,
    }  # fmt: skip


def test_slots_follow_speculation_and_platforms() -> None:
    (key,) = warmreg.plan(example_config("kimi_k3", num_speculative_tokens=0), target="cuda:90").kernel(NAME).keys
    assert (key.fields()["num_state_slots"], key.fields()["block_state_slots"]) == (1, 1)
    (key,) = warmreg.plan(example_config("kimi_k3", num_speculative_tokens=4), target="cuda:90").kernel(NAME).keys
    assert (key.fields()["num_state_slots"], key.fields()["block_state_slots"]) == (5, 8)
    for target in ("rocm:gfx942", "xpu:pvc"):
        assert NAME not in {k.name for k in warmreg.plan(example_config("kimi_k3"), target=target).kernels}


@pytest.mark.parametrize("requests", [1, 33, 256])
def test_runtime_shapes_are_planned(requests: int) -> None:
    """The V1 builder's block table, sliced to the step's requests, at any width and block size."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    for width in (4097, 16388):
        table = warmreg.meta((256, width), torch.int32)[:requests]
        key = kp.kernel.dispatch(
            block_table=table, seq_lens=warmreg.meta((requests,), torch.int32), num_state_slots=4, launch_pdl=True
        )
        assert key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, [next(iter(kp.keys))])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        args = (_table(5, 12), torch.tensor([0, 1, 17, 40, 100], dtype=torch.int32))
        kw = {"block_size": 16, "num_state_slots": 3, "launch_pdl": False}
        return OpCall(AlignedStateIndices(max_num_seqs=4, num_speculative_tokens=3), args, kw)

    check_out(build)
