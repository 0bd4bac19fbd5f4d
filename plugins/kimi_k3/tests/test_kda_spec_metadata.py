"""The speculative-decode staging into the graph buffers: exact equality with the PyTorch reference under Triton's
interpreter (padding rows inert, nothing past the buffers written), and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.kda_spec_metadata import StageSpecDecodeMetadata, stage_spec_decode_metadata_reference

import warmreg
from warmreg.testing import assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = StageSpecDecodeMetadata.name
SENTINEL = -7  # what the persistent buffers hold before staging: left alone past B (+1)


def _sources(n: int, slots: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The builder's sources: block-table rows ``[n, :slots]`` of a wider table, query offsets, accepted counts."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 1000, (n + 2, width), generator=gen, dtype=torch.int32)
    lens = torch.randint(1, slots + 1, (n,), generator=gen, dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    accepted = torch.randint(1, slots + 1, (n,), generator=gen, dtype=torch.int32)
    return table[:n, :slots], qsl, accepted


def _buffers(rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent graph buffers (``rows`` entries, more than any batch uses), pre-filled with SENTINEL."""
    return (torch.full((rows, slots), SENTINEL, dtype=torch.int32), torch.full((rows + 1,), SENTINEL, dtype=torch.int32),
            torch.full((rows,), SENTINEL, dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize(
    ("n", "batch", "slots"),
    [(1, 1, 4), (3, 8, 4), (0, 5, 4), (31, 33, 4), (5, 5, 3), (2, 40, 1)],  # 33: B + 1 = 34 rows, two programs
)
def test_matches_reference(n: int, batch: int, slots: int) -> None:
    state, qsl, accepted = _sources(n, slots, width=slots + 5, seed=n + batch)
    bufs = _buffers(64, slots)
    staged = (bufs[0][:batch], bufs[1][: batch + 1], bufs[2][:batch])  # the builder's [:B] / [:B + 1] views
    want = stage_spec_decode_metadata_reference(state, qsl, accepted, *staged, num_spec_decodes=n)
    got = StageSpecDecodeMetadata(max_num_seqs=4, num_speculative_tokens=slots - 1)(
        state, qsl, accepted, *staged, num_spec_decodes=n, launch_pdl=False
    )
    for g, w, buf in zip(got, want, bufs):
        assert torch.equal(g, w)
        assert g.data_ptr() == buf.data_ptr()  # written in place
    assert (bufs[0][batch:] == SENTINEL).all() and (bufs[1][batch + 1 :] == SENTINEL).all()
    assert (bufs[2][batch:] == SENTINEL).all()


def test_padding_rows_are_inert() -> None:
    """The math by hand: rows past n get the NULL slot, a repeat of the last offset (no tokens), one accepted."""
    state = torch.tensor([[5, 6, 7, 9], [8, 9, 10, 9]], dtype=torch.int32)[:, :3]
    qsl, accepted = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    staged = _buffers(4, 3)
    StageSpecDecodeMetadata(max_num_seqs=4, num_speculative_tokens=2)(
        state, qsl, accepted, *staged, num_spec_decodes=2, launch_pdl=False
    )
    assert staged[0].tolist() == [[5, 6, 7], [8, 9, 10], [0, 0, 0], [0, 0, 0]]
    assert staged[1].tolist() == [0, 3, 5, 5, 5]
    assert staged[2].tolist() == [2, 1, 1, 1]


def test_launch_errors() -> None:
    kernel = StageSpecDecodeMetadata(max_num_seqs=4, num_speculative_tokens=3)
    state, qsl, accepted = _sources(2, 4, width=6, seed=0)
    staged = _buffers(4, 4)
    with pytest.raises(warmreg.LaunchError, match=r"num_spec_decodes \(5\)"):
        kernel(state, qsl, accepted, *staged, num_spec_decodes=5)
    with pytest.raises(warmreg.LaunchError, match="at least 3 rows"):
        kernel(state, qsl, accepted, *staged, num_spec_decodes=3)
    with pytest.raises(warmreg.LaunchError, match="staged_query_start_loc"):
        kernel(state, qsl, accepted, staged[0], staged[1][:4], staged[2], num_spec_decodes=2)
    with pytest.raises(warmreg.LaunchError, match="share one dtype"):
        kernel(state, qsl, accepted, staged[0], staged[1].long(), staged[2], num_spec_decodes=2)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["kimi_k3", "kimi_k3_attn_res"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_one_key_with_a_slot_per_draft(example: str, target: str) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {
        "index_dtype": "int32", "qsl_dtype": "int32", "accepted_dtype": "int32", "num_state_slots": 4,
        "block_state_slots": 4, "null_state_id": 0, "block_rows": 32, "launch_pdl": True, "num_warps": 1,
    }  # fmt: skip


def test_only_with_speculation_and_only_on_cuda() -> None:
    assert NAME not in {
        k.name for k in warmreg.plan(example_config("kimi_k3", num_speculative_tokens=0), target="cuda:90").kernels
    }
    (key,) = warmreg.plan(example_config("kimi_k3", num_speculative_tokens=1), target="cuda:90").kernel(NAME).keys
    assert (key.fields()["num_state_slots"], key.fields()["block_state_slots"]) == (2, 2)
    for target in ("rocm:gfx942", "xpu:pvc"):
        assert NAME not in {k.name for k in warmreg.plan(example_config("kimi_k3"), target=target).kernels}


@pytest.mark.parametrize(("n", "batch"), [(1, 1), (7, 8), (200, 256), (256, 1024)])
def test_runtime_shapes_are_planned(n: int, batch: int) -> None:
    """The builder's call: block-table rows of any width, the graph buffers' [:B] views; one key for every step."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    staged = warmreg.meta((1024, 4), torch.int32)[:batch]
    key = kp.kernel.dispatch(
        staged_state_indices=staged, query_start_loc=warmreg.meta((n + 1,), torch.int32),
        num_accepted_tokens=warmreg.meta((n,), torch.int32), launch_pdl=True,
    )  # fmt: skip
    assert key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, [key])
