"""DeepSeek-V4.1's engram look-back gather (the V2 runner's ``_fill_lookback``) against its PyTorch reference under
Triton's interpreter (hand-picked rows, a strided history, errors, the required buffer, warmup inputs), and the plan:
which configs and targets plan which keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_lookback import GatherLookback, gather_lookback_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, I64 = torch.int32, torch.int64
NAME = GatherLookback.name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_lookback_by_hand() -> None:
    """Row 0 (state 2) starts at position 5: ids 4, 3, 2 of its history; row 1 (state 0) at 2: ids 1, 0, then -1;
    row 2 schedules no token and rows 3, 4 lie past the batch: -1 (their garbage overwritten)."""
    history = torch.arange(30, dtype=I32).reshape(3, 10) + 100
    lookback = torch.full((5, 3), 7777, dtype=I32)
    idx = torch.tensor([2, 0, 1], dtype=I64)
    qsl = torch.tensor([0, 4, 6, 6], dtype=I32)
    pos = torch.tensor([5, 6, 7, 8, 2, 3], dtype=I64)
    got = GatherLookback(depth=3)(lookback, idx, qsl, pos, history)
    assert got is lookback
    assert lookback.tolist() == [[124, 123, 122], [101, 100, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]


@pytest.mark.parametrize(("reqs", "rows", "depth"), [(6, 9, 3), (1, 1, 5), (0, 4, 1), (13, 16, 8)])
def test_lookback_matches_reference_with_a_strided_history(reqs: int, rows: int, depth: int) -> None:
    """Random chunks (some empty, some at position 0) over a history sliced out of a wider buffer (row stride 67)."""
    gen = _gen(reqs * 31 + depth)
    history = torch.randint(0, 50_000, (16, 67), generator=gen, dtype=I32)[:, 3:]
    idx = torch.randperm(16, generator=gen)[:reqs].to(I64)
    qlens = torch.randint(0, 4, (reqs,), generator=gen)
    qsl = torch.zeros(reqs + 1, dtype=I32)
    qsl[1:] = torch.cumsum(qlens, 0)
    starts = torch.randint(0, 40, (reqs,), generator=gen)
    pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts.tolist(), qlens.tolist())] + [torch.zeros(0)]).to(
        I64
    )
    lookback = torch.full((rows, depth), 7777, dtype=I32)
    want = gather_lookback_reference(lookback, idx, qsl, pos, history)
    GatherLookback(depth=depth)(lookback, idx, qsl, pos, history)
    assert torch.equal(lookback, want)


def test_lookback_errors_name_the_argument() -> None:
    kernel, history = GatherLookback(depth=3), torch.zeros(2, 8, dtype=I32)
    lb, idx, qsl, pos = (
        torch.zeros(2, 3, dtype=I32),
        torch.zeros(2, dtype=I64),
        torch.zeros(3, dtype=I32),
        torch.zeros(2, dtype=I64),
    )
    with pytest.raises(warmreg.LaunchError, match="lookback must be"):
        kernel(lb.long(), idx, qsl, pos, history)
    with pytest.raises(warmreg.LaunchError, match="lookback must be"):
        kernel(torch.zeros(3, 2, dtype=I32).t(), idx, qsl, pos, history)
    with pytest.raises(warmreg.LaunchError, match="idx_mapping"):
        kernel(lb, idx.int(), qsl, pos, history)
    with pytest.raises(warmreg.LaunchError, match="query_start_loc"):
        kernel(lb, idx, qsl[:2], pos, history)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(lb, idx, qsl, pos.int(), history)
    with pytest.raises(warmreg.LaunchError, match="3 requests"):
        kernel(lb, torch.zeros(3, dtype=I64), torch.zeros(4, dtype=I32), pos, history)
    with pytest.raises(warmreg.LaunchError, match="all_token_ids"):
        kernel(lb, idx, qsl, pos, history.t())


def test_lookback_allocates_nothing() -> None:
    """The runner's persistent buffer is the output (a captured graph reads it): the launch allocates nothing."""
    args = (torch.zeros(4, 3, dtype=I32), torch.tensor([1], dtype=I64), torch.tensor([0, 2], dtype=I32),
            torch.tensor([4, 5], dtype=I64), torch.ones(2, 9, dtype=I32))  # fmt: skip
    with Allocations() as fresh:
        spec = OpCall(GatherLookback(depth=3), args, {}).launch_code()
    assert not fresh.calls and spec.outputs is args[0]


# -- the plan --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_plans_one_key(target: str) -> None:
    """Flash's engram hash looks back 3 ids (max n-gram 4): one key, 4 lanes; the runner's calls (buffers of
    max_num_reqs rows, any batch, any max_model_len) reproduce it."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == {"depth": 3, "block_depth": 4, "num_warps": 4}
    op = plan.kernel(NAME).kernel
    for reqs, model_len in ((1, 4096), (17, 131072), (256, 1000)):
        args = (warmreg.meta((256, 3), I32), warmreg.meta((reqs,), I64), warmreg.meta((257,), I32),
                warmreg.meta((8192,), I64), warmreg.meta((256, model_len), I32))  # fmt: skip
        assert OpCall(op, args, {}).launch_code().key == key
    assert_warmup_inputs_reproduce(op, [key])


def test_depth_follows_the_ngram_size_and_needs_engram_and_cuda() -> None:
    config = example_config("deepseek_v41")
    config["model"]["text_config"]["engram_max_ngram_size"] = 6
    (key,) = warmreg.plan(config, target="cuda:90").kernel(NAME).keys
    assert (key.depth, key.block_depth) == (5, 8)
    del config["model"]["text_config"]["engram_layer_ids"]
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}
    rocm = example_config("deepseek_v41")
    rocm["serving"]["attention_backend"] = "ROCM_FLASHMLA_SPARSE_DSV41"
    assert NAME not in {k.name for k in warmreg.plan(rocm, target="rocm:gfx942").kernels}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    from warmreg_deepseek_v4 import v41_lookback

    plugins = [RegisterPlugin(v41_lookback.register, model=DSV4.from_config)]
    report = warmreg.warm(example_config("deepseek_v41"), target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
