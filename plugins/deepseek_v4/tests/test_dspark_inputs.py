"""DSpark draft-step inputs: exact equality with the PyTorch reference (Triton interpreter on CPU) over the
engine's cases, the BLOCK_SIZE a step picks, DCP slot math, registration, warm coverage, a real cross-compile."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import dspark_inputs
from warmreg_deepseek_v4.dspark_inputs import DraftInputs, DSparkInputs, step_block
from warmreg_deepseek_v4.dspark_inputs_reference import prepare_dspark_inputs_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_allocates_nothing, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

DSPARK = "deepseek_v4_flash_0731_dspark"
N, NOISE, PAGE = 5, 128799, 8  # small pages: more block-table columns per span in the interpreter
MAX_REQS, MAX_TOKENS = 8, 96


def _step(
    qlens: list[int], *, seed: int, nrej: list[int] | None = None, sampled: list[int] | None = None,
    max_model_len: int = 4096, last_at: int | None = None, null_block: bool = False, width: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A target step: request ``r`` verified ``qlens[r]`` tokens (decode 1, 1 + N, or a prefill chunk), ``nrej[r]``
    of them rejected; states shuffled; the last request's span ends at ``last_at`` when given."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    reqs = len(qlens)
    nrej = nrej or [0] * reqs
    ends = [rng.randint(q, max_model_len - N - 1) for q in qlens]
    if last_at is not None:
        ends[-1] = last_at + nrej[-1] + 1  # the last verified position is last_at
    positions = torch.tensor([p for q, e in zip(qlens, ends) for p in range(e - q, e)], dtype=torch.int64)
    qsl = torch.zeros(reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens).cumsum(0)
    width = width or max_model_len // PAGE + 1
    table = torch.randint(1, 1000, (MAX_REQS, width + 3), generator=gen, dtype=torch.int32)[:, :width]
    if null_block:
        table[:, ::3] = 0  # evicted sliding-window pages
    states = torch.randperm(MAX_REQS, generator=gen)[:reqs].to(torch.int64)
    return dict(
        target_positions=positions, target_query_start_loc=qsl, idx_mapping=states,
        last_sampled=torch.randint(0, 1 << 17, (MAX_REQS, 1), generator=gen, dtype=torch.int64),
        next_prefill_tokens=torch.randint(0, 1 << 17, (2, MAX_REQS), generator=gen, dtype=torch.int32),
        num_sampled=torch.tensor(sampled or [1 + rng.randint(0, N) for _ in qlens], dtype=torch.int32),
        num_rejected=torch.tensor(nrej, dtype=torch.int32),
        temperature=torch.rand(MAX_REQS, generator=gen), seeds=torch.randint(0, 1 << 40, (MAX_REQS,), generator=gen),
        block_table=table, num_reqs=reqs, max_model_len=max_model_len,
    )  # fmt: skip


def _stale(tokens: int) -> DraftInputs:
    """Buffers holding a previous step's values (-7, True): what the kernel does not write must stay."""
    fresh = DraftInputs.zeros(MAX_REQS, tokens, N)
    return DraftInputs(*(torch.full_like(t, -7) if t.dtype != torch.bool else torch.ones_like(t) for t in fresh))


def _run(
    step: dict[str, Any], *, anchor: bool = True, cp: tuple[int, int, int] = (0, 1, 1), tokens: int = MAX_TOKENS
) -> DraftInputs:
    qlens = (step["target_query_start_loc"][1:] - step["target_query_start_loc"][:-1]).tolist()
    kw: dict[str, Any] = dict(
        block_size=PAGE, parallel_drafting_token_id=NOISE, num_query_per_req=N + (not anchor), num_speculative_steps=N,
        max_num_reqs=MAX_REQS, max_num_tokens=tokens, cp_rank=cp[0], cp_size=cp[1], cp_interleave=cp[2],
        sample_from_anchor=anchor,
    )  # fmt: skip
    args = {k: v for k, v in step.items() if k not in ("num_reqs", "max_model_len")}
    extra = dict(num_reqs=step["num_reqs"], max_model_len=step["max_model_len"])
    want = prepare_dspark_inputs_reference(_stale(tokens), *args.values(), **kw, **extra)
    got = DSparkInputs()(*args.values(), **kw, **extra, max_query_len=max(qlens), out=_stale(tokens))
    for name, g, w in zip(DraftInputs._fields, got, want):
        assert torch.equal(g, w), name
    return got


@pytest.mark.parametrize("qlens", [[1], [1 + N, 1, 1 + N], [1, 1 + N, 7], [40], [1 + N] * 8], ids=str)
def test_decode_spec_and_prefill_spans(qlens: list[int]) -> None:
    """Decode (1), verified 1 + N and prefill chunks; 8 requests is the graph-padded maximum (no padding)."""
    _run(_step(qlens, seed=len(qlens) + sum(qlens)))


def test_a_long_prefill_span_uses_several_blocks() -> None:
    """max_q + Nq > 256: BLOCK_SIZE 256 and two programs per request (the engine's 8192-token chunks, scaled)."""
    assert step_block(300, N) == 256
    _run(_step([300, 1 + N], seed=1), tokens=400)


@pytest.mark.parametrize("nrej", [[0, 0, 0], [N, 0, N]], ids=str)
def test_rejected_drafts(nrej: list[int]) -> None:
    """nrej = N: the query block starts after the first verified token; the rejected rows get position 0, PAD."""
    out = _run(_step([1 + N, 1, 1 + N], seed=5, nrej=[r if q > 1 else 0 for r, q in zip(nrej, [1 + N, 1, 1 + N])]))
    if nrej[0]:
        assert (
            out.context_slot_mapping[1 : 1 + N].tolist() == [-1] * N
            and out.context_positions[1 : 1 + N].tolist() == [0] * N
        )


def test_position_at_max_model_len_and_null_blocks() -> None:
    """Query positions past max_model_len - 1 are clamped (seq_lens to max_model_len); null block 0 gives PAD."""
    out = _run(_step([1, 1 + N], seed=7, last_at=4095 - 2, null_block=True))
    assert out.positions[N : 2 * N].max() == 4095 and out.seq_lens[1] == 4096
    assert (out.query_slot_mapping[: 2 * N] == -1).any() and (out.context_slot_mapping[:7] == -1).any()


def test_chunked_prefill_splices_the_next_prefill_token() -> None:
    """num_sampled 0 (a prefill chunk that samples nothing): the anchor is next_prefill_tokens[state]."""
    step = _step([12, 1], seed=9, sampled=[0, 2])
    out = _run(step)
    assert out.input_ids[0] == step["next_prefill_tokens"][0, step["idx_mapping"][0]]
    assert out.input_ids[N] == step["last_sampled"][step["idx_mapping"][1], 0] and out.input_ids[1] == NOISE


def test_without_sample_from_anchor() -> None:
    """The 1 + N fill-in layout (speculators-format checkpoints): samples start at the first noise slot."""
    _run(_step([1 + N, 3], seed=11), anchor=False)


@pytest.mark.parametrize("cp", [(0, 2, 1), (1, 2, 1), (2, 4, 2), (3, 4, 8)], ids=str)
def test_dcp_slots(cp: tuple[int, int, int]) -> None:
    """DCP: a table entry spans bs * CP positions; slots of positions another rank holds are PAD."""
    _run(_step([1 + N, 9, 1], seed=sum(cp), width=4096 // (PAGE * cp[1]) + 1), cp=cp)


def test_bad_inputs() -> None:
    step = _step([1], seed=0)
    args = [v for k, v in step.items() if k not in ("num_reqs", "max_model_len")]
    kw: dict[str, Any] = dict(
        num_reqs=1, max_query_len=1, block_size=PAGE, parallel_drafting_token_id=NOISE, num_query_per_req=N,
        num_speculative_steps=N, max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS, max_model_len=4096,
    )  # fmt: skip
    with pytest.raises(warmreg.LaunchError, match="num_query_per_req=6"):
        DSparkInputs()(*args, **{**kw, "num_query_per_req": N + 1})
    with pytest.raises(warmreg.LaunchError, match="idx_mapping must be"):
        DSparkInputs()(*args[:2], args[2].int(), *args[3:], **kw)
    with pytest.raises(warmreg.LaunchError, match="bad DCP"):
        DSparkInputs()(*args, **kw, cp_size=2, cp_rank=2)
    with pytest.raises(warmreg.LaunchError, match=r"out\.seq_lens"):
        DSparkInputs()(
            *args,
            **kw,
            out=DraftInputs.zeros(MAX_REQS, MAX_TOKENS, N)._replace(seq_lens=torch.zeros(2, dtype=torch.int32)),
        )


# -- registration, coverage, warm --------------------------------------------------------------------
def _plan(config: Any, target: str = "cuda:90") -> warmreg.Plan:
    plugin = RegisterPlugin(dspark_inputs.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_key_per_block_size(target: str) -> None:
    """Every BLOCK_SIZE a step picks (max_q + 5 from 6 to 8197: 8..256) is a key; the ints have their classes."""
    keys = _plan(example_config(DSPARK), target).kernel(DSparkInputs.name).keys
    assert sorted(k.block for k in keys) == [8, 16, 32, 64, 128, 256]
    key = keys[0]
    ints = (key.block_table_stride, key.noise_token_id, key.kv_block_size, key.num_query_per_req,
            key.num_speculative_steps, key.max_num_reqs, key.max_num_tokens, key.max_model_len, key.cp_rank)  # fmt: skip
    assert ints == ("div16", "other", "div16", "other", "other", "div16", "div16", "div16", "div16")
    assert (key.sample_from_anchor, key.pad_slot_id, key.cp_size, key.cp_interleave, key.num_warps) == (
        True,
        -1,
        1,
        1,
        4,
    )


def test_runtime_steps_hit_planned_keys() -> None:
    plan = _plan(example_config(DSPARK)).kernel(DSparkInputs.name)
    table = warmreg.meta((256, 16384), torch.int32)
    rng = random.Random(0)
    for max_q in [1, 3, 1 + N, 8192, *(rng.randint(1, 8192) for _ in range(30))]:
        key = plan.kernel.dispatch(
            max_query_len=max_q, block_table=table, parallel_drafting_token_id=NOISE, block_size=64, num_query_per_req=N,
            num_speculative_steps=N, max_num_reqs=256, max_num_tokens=8192, max_model_len=1 << 20, cp_rank=0, cp_size=1,
            cp_interleave=1, sample_from_anchor=True,
        )  # fmt: skip
        assert key in plan.keys, max_q


def test_num_speculative_tokens_and_small_budgets_change_the_keys() -> None:
    """N = 1 (one query slot: BLOCK_SIZE from 2, N in class 'one'); a 100-token budget stops at 128."""
    keys = _plan(example_config(DSPARK, num_speculative_tokens=1)).kernel(DSparkInputs.name).keys
    assert sorted(k.block for k in keys) == [2, 4, 8, 16, 32, 64, 128, 256] and keys[0].num_speculative_steps == "one"
    keys = _plan(example_config(DSPARK, max_num_batched_tokens=100)).kernel(DSparkInputs.name).keys
    assert sorted(k.block for k in keys) == [8, 16, 32, 64, 128]


def test_dcp_is_refused_with_c4_layers() -> None:
    with pytest.raises(warmreg.ConfigError, match="decode_context_parallel_size"):
        _plan(example_config(DSPARK, decode_context_parallel_size=2))


def test_dcp_ranks_without_c4_layers() -> None:
    """A model without C4 layers may run DCP: one key per rank class and BLOCK_SIZE (ranks 0, 1, 2-3)."""
    config = example_config(DSPARK, decode_context_parallel_size=4, cp_kv_cache_interleave_size=8)
    config["model"]["compress_ratios"] = [0 if r == 4 else r for r in config["model"]["compress_ratios"]]
    keys = _plan(config).kernel(DSparkInputs.name).keys
    assert {k.cp_rank for k in keys} == {"div16", "one", "other"} and len(keys) == 18
    assert {(k.cp_size, k.cp_interleave) for k in keys} == {(4, 8)}


def test_warm_cross_compiles_for_cuda_90() -> None:
    plugin = RegisterPlugin(dspark_inputs.register, model=DSV4.from_config)
    report = warmreg.warm(example_config(DSPARK), target="cuda:90", plugins=[plugin], entry_points=False, workers=2)
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 6


# -- out= (the engine's persistent buffers: what they hold past this step is tested above) ---------------------
def test_launch_with_out_allocates_nothing() -> None:
    step = _step([1, 1 + N], seed=3)
    kw: dict[str, Any] = dict(
        block_size=PAGE, parallel_drafting_token_id=NOISE, num_query_per_req=N, num_speculative_steps=N,
        max_num_reqs=MAX_REQS, max_num_tokens=MAX_TOKENS, num_reqs=step.pop("num_reqs"), max_query_len=1 + N,
        max_model_len=step.pop("max_model_len"),
    )  # fmt: skip
    assert_allocates_nothing(OpCall(DSparkInputs(), tuple(step.values()), kw), _stale(MAX_TOKENS))
