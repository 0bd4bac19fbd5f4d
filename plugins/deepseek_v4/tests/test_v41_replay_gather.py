"""DeepSeek-V4.1's decoder replay batch gather (the V2 runner's ``_kept_input_batch``) against its PyTorch reference
under Triton's interpreter (hand-picked rows, trims longer than a tile, a PCP chunk view, errors, in place, warmup
inputs), and the plan: which configs and targets plan which keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import v41_replay_gather
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_replay_gather import GatherReplayBatch, gather_replay_batch_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, I64 = torch.int32, torch.int64
NAME = GatherReplayBatch.name


def _args(qlens: list[int], kept: list[int], seq_lens: list[int], replay: list[int], groups: int, seed: int,
          offset: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A batch of ``qlens`` rows keeping ``kept`` of each, its slots (``offset`` columns into a wider buffer) and
    garbage in every output (a larger step wrote them before)."""
    gen = torch.Generator().manual_seed(seed)
    qsl, kqsl = torch.zeros(len(qlens) + 1, dtype=I32), torch.zeros(len(qlens) + 1, dtype=I32)
    qsl[1:], kqsl[1:] = torch.tensor(qlens).cumsum(0), torch.tensor(kept).cumsum(0)
    T = int(qsl[-1])
    slots = torch.randint(0, 1 << 40, (groups, T + offset + 3), generator=gen, dtype=I64)[:, offset:]
    rows = T + 5
    return (
        qsl, (qsl - kqsl).to(I32), torch.tensor(seq_lens, dtype=I32), torch.tensor(replay, dtype=I32),
        torch.randint(0, 1 << 20, (T,), generator=gen, dtype=I64), slots,
        torch.full((rows,), -9, dtype=I64), torch.full((len(qlens) + 1,), -9, dtype=I32),
        torch.full((rows,), -9, dtype=I64), torch.full((groups, rows), -9, dtype=I64),
        torch.full((len(qlens),), -9, dtype=I32),
    )  # fmt: skip


def test_gather_by_hand() -> None:
    """Window 2: a decode of 1 row keeps it and its replay start; a prefill of 4 rows at sequence length 10 keeps its
    last 2 (batch rows 3, 4) and holds window KV from 10 - 2 = 8 (above its replay start 5); an untrimmed prefill of 2
    keeps both and its replay start 0."""
    qsl, kqsl = torch.tensor([0, 1, 5, 7], dtype=I32), torch.tensor([0, 1, 3, 5], dtype=I32)
    pos = torch.tensor([100, 6, 7, 8, 9, 0, 1], dtype=I64)
    slots = torch.arange(14, dtype=I64).view(2, 7) + 50
    outs = (torch.full((6,), -1, dtype=I64), torch.zeros(4, dtype=I32), torch.zeros(6, dtype=I64),
            torch.full((2, 6), -1, dtype=I64), torch.zeros(3, dtype=I32))  # fmt: skip
    seq, replay = torch.tensor([101, 10, 2], dtype=I32), torch.tensor([3, 5, 0], dtype=I32)
    got = GatherReplayBatch()(qsl, (qsl - kqsl).to(I32), seq, replay, pos, slots, *outs, window=2)
    assert all(g is o for g, o in zip(got, outs))
    assert outs[0].tolist() == [0, 3, 4, 5, 6, -1] and outs[1].tolist() == [0, 1, 3, 5]
    assert outs[2].tolist() == [100, 8, 9, 0, 1, 0] and outs[4].tolist() == [3, 8, 0]
    assert outs[3].tolist() == [[50, 53, 54, 55, 56, -1], [57, 60, 61, 62, 63, -1]]


@pytest.mark.parametrize(
    ("qlens", "kept", "groups", "offset"),
    [
        ([2, 1, 3000, 7, 128], [2, 1, 128, 7, 128], 4, 0),
        ([5, 2100], [5, 1100], 3, 1),
        ([1], [1], 1, 0),
        ([0, 4, 0], [0, 4, 0], 2, 0),
    ],
)
def test_gather_matches_reference(qlens: list[int], kept: list[int], groups: int, offset: int) -> None:
    """Decodes, prefills trimmed to the window (128) or to more than a 1024 tile, an empty request, a PCP-like chunk
    of the slot buffer (8 bytes off), one group or four: every output equals the reference."""
    gen = torch.Generator().manual_seed(sum(qlens))
    seqs = [q + int(torch.randint(0, 500, (1,), generator=gen)) for q in qlens]
    replay = [int(torch.randint(0, 400, (1,), generator=gen)) for _ in qlens]
    args = _args(qlens, kept, seqs, replay, groups, sum(qlens), offset)
    want = gather_replay_batch_reference(*args, window=128)
    GatherReplayBatch()(*args, window=128)
    for got, ref, what in zip(args[6:], want, ("rows", "kept_qsl", "kept_positions", "kept_slots", "kv_start")):
        assert torch.equal(got, ref), what


def test_gather_errors_name_the_argument() -> None:
    op, args = GatherReplayBatch(), list(_args([3, 2], [3, 1], [9, 9], [0, 0], 2, 0))
    for i, bad, name in (
        (0, args[0][:2], "query_start_loc"), (1, args[1].long(), "dropped_before"), (2, args[2].long(), "seq_lens"),
        (3, args[3][:1], "replay_start"), (4, args[4].int(), "positions"), (5, args[5].t(), "slot_mappings"),
        (6, args[6].int(), "rows"), (7, args[7][:2], "kept_query_start_loc"), (8, args[8].float(), "kept_positions"),
        (9, args[9][:1], "groups"), (10, args[10].long(), "kept_kv_start"),
    ):  # fmt: skip
        bad_args = list(args)
        bad_args[i] = bad
        with pytest.raises(warmreg.LaunchError, match=name):
            op(*bad_args, window=8)
    with pytest.raises(warmreg.LaunchError, match="window"):
        op(*args, window=0)


def test_gather_is_in_place_and_allocates_nothing() -> None:
    args = _args([3, 2], [3, 1], [9, 9], [0, 0], 2, 0)
    with Allocations() as fresh:
        spec = OpCall(GatherReplayBatch(), args, {"window": 1}).launch_code()
    assert not fresh.calls and spec.outputs == args[6:] and spec.grid == (2,)


# -- the plan --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_plans_the_aligned_key(target: str) -> None:
    """The example's last kv source (36) is not its last layer (42), its engram layers (1, 14) sit below it, MTP drafts
    with the target's window, bounded replay is vLLM's default: one key; the runner's calls with any number of groups,
    requests and tokens reproduce it."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == {"block": 1024, "slots_aligned": True, "num_warps": 4}
    op, m = plan.kernel(NAME).kernel, warmreg.meta
    for groups, reqs, tokens in ((3, 1, 1), (5, 17, 8192), (1, 256, 3000)):
        args = (m((reqs + 1,), I32), m((reqs + 1,), I32), m((reqs,), I32), m((256,), I32), m((tokens,), I64),
                m((groups, 8192), I64), m((8192,), I64), m((257,), I32), m((8192,), I64), m((groups, tokens), I64),
                m((256,), I32))  # fmt: skip
        assert OpCall(op, args, {"window": 128}).launch_code().key == key
    assert_warmup_inputs_reproduce(op, [key])


def _config(**serving: object) -> dict[str, object]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def test_what_turns_it_off() -> None:
    """PCP plans both alignments, expert parallelism alone one key; bounded replay off, an engram layer at or past
    the last kv source, the last kv source as the last layer, a draft model of another method, sequence parallelism
    (EP at TP 8 with DP 2 or a MegaMoE backend), ROCm or DeepSeek-V4 plan nothing."""
    ep = warmreg.plan(_config(enable_expert_parallel=True), target="cuda:90")  # EP alone: no sequence parallelism
    assert len(ep.kernel(NAME).keys) == 1
    plan = warmreg.plan(_config(prefill_context_parallel_size=2), target="cuda:90")
    assert {k.fields()["slots_aligned"] for k in plan.kernel(NAME).keys} == {True, False}
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    engram_late = _config()
    engram_late["model"]["text_config"]["engram_layer_ids"] = [1, 36]
    last = _config()
    text = last["model"]["text_config"]
    text["kv_source_layer_ids"] = text["index_source_layer_ids"] = [2, 8, 14, 20, 24, 28, 32, 42]
    for config, target in (
        (_config(swa_bounded_replay=False), "cuda:90"), (engram_late, "cuda:90"), (last, "cuda:100"),
        (_config(speculative_method="eagle"), "cuda:90"),
        (_config(enable_expert_parallel=True, data_parallel_size=2), "cuda:90"),
        (_config(enable_expert_parallel=True, moe_backend="deep_gemm_mega_moe"), "cuda:100"),
        (_config(attention_backend="ROCM_FLASHMLA_SPARSE_DSV41"), "rocm:gfx942"),
    ):  # fmt: skip
        assert NAME not in {k.name for k in warmreg.plan(config, target=target).kernels}
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v4_flash.json", target="cuda:90").kernels}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    plugins = [RegisterPlugin(v41_replay_gather.register, model=DSV4.from_config)]
    report = warmreg.warm(_config(prefill_context_parallel_size=2), target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
