"""DeepSeek-V4.1's SWA bounded-replay slot padding (the V2 runner's ``prepare_attn``) against its PyTorch reference
under Triton's interpreter (hand-picked rows, a PCP chunk view, errors, in place, warmup inputs), and the plan: which
configs and targets plan which keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import v41_replay_pad
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_replay_pad import PadReplayedSlots, pad_replayed_slots_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, I64 = torch.int32, torch.int64
NAME = PadReplayedSlots.name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_pad_by_hand() -> None:
    """Request 0 replays from position 10 with a window of 3: its tokens at 10, 11, 12 are padded in groups 0 and 2
    (not group 1, the SWA group; not position 13); request 1 has no replay start; request 2 replays from 4 but its
    chunk starts at 20, past the window: nothing."""
    slots = torch.arange(30, dtype=I64).reshape(3, 10) + 100
    groups = torch.tensor([0, 2], dtype=I32)
    qsl = torch.tensor([0, 5, 7, 9], dtype=I32)
    pos = torch.tensor([9, 10, 11, 12, 13, 3, 4, 20, 21], dtype=I64)
    replay = torch.tensor([10, 0, 4], dtype=I32)
    got = PadReplayedSlots()(slots, groups, qsl, pos, replay, window=3)
    assert got is slots
    want = (torch.arange(30, dtype=I64).reshape(3, 10) + 100).tolist()
    for g in (0, 2):
        want[g][1:4] = [-1, -1, -1]
    assert slots.tolist() == want


@pytest.mark.parametrize(("reqs", "tokens", "window"), [(5, 40, 8), (1, 1, 128), (3, 2100, 128), (0, 4, 8)])
def test_pad_matches_reference(reqs: int, tokens: int, window: int) -> None:
    """Random chunks and replay starts around them (some 0), more tokens than a 1024 tile, the padded step wider
    than the scheduled tokens, over a PCP-like column chunk of a wider buffer (an 8-byte offset)."""
    gen = _gen(reqs * 13 + tokens)
    qlens = torch.randint(0, max(1, 2 * tokens // max(reqs, 1)), (reqs,), generator=gen)
    qsl = torch.zeros(reqs + 1, dtype=I32)
    qsl[1:] = torch.cumsum(qlens, 0).clamp(max=tokens)
    starts = torch.randint(0, 300, (reqs,), generator=gen)
    pos = torch.randint(0, 3, (tokens,), generator=gen)  # leftovers past the batch
    for r in range(reqs):
        a, e = int(qsl[r]), int(qsl[r + 1])
        pos[a:e] = torch.arange(int(starts[r]), int(starts[r]) + e - a)
    replay = (starts + torch.randint(-window, window, (reqs,), generator=gen)).clamp(min=0).to(I32)
    replay[torch.rand(reqs, generator=gen) < 0.3] = 0
    groups = torch.tensor([0, 2, 3], dtype=I32)
    slots = torch.randint(0, 1 << 40, (4, 2 * tokens + 9), generator=gen, dtype=I64)[:, tokens + 1 :]
    want = pad_replayed_slots_reference(slots, groups, qsl, pos.to(I64), replay, window=window)
    PadReplayedSlots()(slots, groups, qsl, pos.to(I64), replay, window=window)
    assert torch.equal(slots, want)


def test_pad_errors_name_the_argument() -> None:
    kernel, slots = PadReplayedSlots(), torch.zeros(2, 8, dtype=I64)
    groups, qsl, replay = torch.zeros(1, dtype=I32), torch.zeros(3, dtype=I32), torch.zeros(2, dtype=I32)
    pos = torch.zeros(4, dtype=I64)
    with pytest.raises(warmreg.LaunchError, match="slot_mappings"):
        kernel(slots.int(), groups, qsl, pos, replay, window=8)
    with pytest.raises(warmreg.LaunchError, match="slot_mappings"):
        kernel(torch.zeros(8, 2, dtype=I64).t(), groups, qsl, pos, replay, window=8)
    with pytest.raises(warmreg.LaunchError, match="cacheable_groups"):
        kernel(slots, groups.long(), qsl, pos, replay, window=8)
    with pytest.raises(warmreg.LaunchError, match="query_start_loc"):
        kernel(slots, groups, qsl[:2], pos, replay, window=8)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(slots, groups, qsl, pos.int(), replay, window=8)
    with pytest.raises(warmreg.LaunchError, match="replay_start"):
        kernel(slots, groups, qsl, pos, replay.long(), window=8)
    with pytest.raises(warmreg.LaunchError, match="window"):
        kernel(slots, groups, qsl, pos, replay, window=0)
    with pytest.raises(warmreg.LaunchError, match="columns"):
        kernel(slots, groups, qsl, torch.zeros(9, dtype=I64), replay, window=8)


def test_pad_is_in_place_and_allocates_nothing() -> None:
    args = (torch.zeros(2, 8, dtype=I64), torch.zeros(1, dtype=I32), torch.tensor([0, 2], dtype=I32),
            torch.tensor([4, 5], dtype=I64), torch.tensor([4], dtype=I32))  # fmt: skip
    with Allocations() as fresh:
        spec = OpCall(PadReplayedSlots(), args, {"window": 8}).launch_code()
    assert not fresh.calls and spec.outputs is args[0]


# -- the plan --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_plans_the_aligned_key(target: str) -> None:
    """vLLM's default bounded replay: one key (tile 1024, 4 warps, the runner's aligned buffer); the runner's calls
    with any number of groups, requests and tokens reproduce it."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == {"block": 1024, "slots_aligned": True, "num_warps": 4}
    op = plan.kernel(NAME).kernel
    for groups, reqs, tokens in ((2, 1, 1), (5, 17, 8192), (1, 256, 3000)):
        slots = warmreg.meta((groups + 1, 8192), I64)
        args = (slots, warmreg.meta((groups,), I32), warmreg.meta((257,), I32), warmreg.meta((tokens,), I64),
                warmreg.meta((reqs,), I32))  # fmt: skip
        assert OpCall(op, args, {"window": 128}).launch_code().key == key
    assert_warmup_inputs_reproduce(op, [key])


def test_pcp_plans_both_alignments_and_the_flag_turns_it_off() -> None:
    """Under prefill context parallelism the kernel pads this rank's column chunk, which may start 8 bytes off;
    ``serving.swa_bounded_replay`` false (vLLM's --no-swa-bounded-replay) plans nothing, as ROCm here."""
    config = example_config("deepseek_v41")
    config["serving"]["prefill_context_parallel_size"] = 2
    plan = warmreg.plan(config, target="cuda:90")
    assert {k.fields()["slots_aligned"] for k in plan.kernel(NAME).keys} == {True, False}
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    config = example_config("deepseek_v41")
    config["serving"]["swa_bounded_replay"] = False
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}
    rocm = example_config("deepseek_v41")
    rocm["serving"]["attention_backend"] = "ROCM_FLASHMLA_SPARSE_DSV41"
    assert NAME not in {k.name for k in warmreg.plan(rocm, target="rocm:gfx942").kernels}
    config["serving"]["swa_bounded_replay"] = "yes"
    with pytest.raises(warmreg.ConfigError, match="swa_bounded_replay"):
        warmreg.plan(config, target="cuda:90")


def test_not_for_deepseek_v4() -> None:
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v4_flash.json", target="cuda:90").kernels}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    plugins = [RegisterPlugin(v41_replay_pad.register, model=DSV4.from_config)]
    config = example_config("deepseek_v41")
    config["serving"]["prefill_context_parallel_size"] = 2
    report = warmreg.warm(config, target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
