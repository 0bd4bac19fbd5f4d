"""DeepSeek-V4.1's ROCm one-launch Markov draft steps (the step and the last launch) against their PyTorch reference
under Triton's interpreter (the whole draft loop, hand-picked math, views, errors, warmup inputs), and the plan: which
targets and settings plan which keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.v41_rocm_markov import (
    BLOCK,
    V41RocmMarkovLast,
    V41RocmMarkovStep,
    markov_sequential_reference,
)

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I64, F32, BF16 = torch.int64, torch.float32, torch.bfloat16
STEP, LAST = V41RocmMarkovStep.name, V41RocmMarkovLast.name


def _inputs(rows: int, steps: int, vocab: int, rank: int, seed: int) -> dict[str, Any]:
    """Weights in eighths of -1..1 and base logits in 64ths of -2..2, so every bias and biased logit is exact in bf16
    (the interpreter truncates fp32 -> bf16, the GPU rounds: exact values make both agree with the reference). Row 1
    is greedy (temperature 0), the last row inert (``idx_map`` -1); request states 0..4 poisoned in the cache."""
    g = torch.Generator().manual_seed(seed)
    w = lambda: (torch.randint(-1, 2, (vocab, rank), generator=g) / 8).to(BF16)  # noqa: E731
    idx = torch.tensor([[4 - r] * steps for r in range(rows)], dtype=I64)
    idx[-1] = -1
    return {
        "input_ids": torch.randint(0, vocab, (rows * (steps + 1),), generator=g, dtype=torch.int32),
        "anchor_idx": torch.arange(rows, dtype=I64) * (steps + 1), "w1": w(), "w2": w(),
        "base_logits": (torch.randint(-128, 129, (rows, steps, vocab), generator=g) / 64).to(BF16),
        "cache": torch.full((5, steps, vocab), 9.0, dtype=BF16), "idx_map": idx,
        "sample_pos": torch.randint(1, 1000, (rows, steps), generator=g, dtype=I64),
        "temperature": torch.tensor([0.5, 1.0, 0.7, 0.0, 1.3], dtype=F32),
        "seeds": torch.randint(0, 2**62, (5,), generator=g, dtype=I64),
    }  # fmt: skip


def _run(x: dict[str, Any], base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``sample_sequential`` loop over warmreg's ops: scratch pairs of 8 rows, poisoned; returns (tokens,
    cache)."""
    base = x["base_logits"] if base is None else base
    rows, steps, vocab = base.shape
    nb = -(-vocab // BLOCK)
    bufs = [(torch.full((8, nb), 3.0e38), torch.full((8, nb), -7, dtype=I64)) for _ in range(2)]
    tokens, cache = torch.full((rows + 2, steps), -5, dtype=I64), x["cache"].clone()
    step, last = V41RocmMarkovStep(), V41RocmMarkovLast()
    for s in range(steps):
        step(bufs[(s + 1) % 2], bufs[s % 2], x["input_ids"], x["anchor_idx"], tokens, x["w1"], x["w2"], base[:, s],
             cache, x["idx_map"], x["sample_pos"], x["temperature"], x["seeds"], s)  # fmt: skip
    last(bufs[(steps - 1) % 2], tokens, rows, vocab)
    assert (tokens[rows:] == -5).all()
    return tokens[:rows], cache


@pytest.mark.parametrize(("rows", "steps", "vocab", "rank"), [(3, 2, 600, 64), (4, 3, 256, 128), (2, 1, 77, 64)])
def test_draft_loop_matches_the_reference(rows: int, steps: int, vocab: int, rank: int) -> None:
    """Every step's tokens and the logits cache, exactly (non-power-of-two vocabularies: a partial last block)."""
    x = _inputs(rows, steps, vocab, rank, seed=rows * 100 + vocab)
    tokens, cache = _run(x)
    want_tokens, want_cache = markov_sequential_reference(**x)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(cache, want_cache)


def test_by_hand_greedy_chain() -> None:
    """Temperature 0, base logits 0: ``w1[t] = e_t``, ``w2[v] = e_{(v - 1) % 64}`` -> bias 1 at ``prev + 1`` only, so
    the chain counts up from the anchor token 5: 6, 7, 8; the cache holds the one-hot rows."""
    vocab = 64
    eye = torch.eye(vocab, dtype=BF16)
    x = {
        "input_ids": torch.tensor([5, 0, 0, 0], dtype=torch.int32), "anchor_idx": torch.tensor([0], dtype=I64),
        "w1": eye, "w2": eye.roll(1, 0), "base_logits": torch.zeros(1, 3, vocab, dtype=BF16),
        "cache": torch.zeros(2, 3, vocab, dtype=BF16), "idx_map": torch.tensor([[1, 1, 1]], dtype=I64),
        "sample_pos": torch.tensor([[4, 5, 6]], dtype=I64), "temperature": torch.zeros(2, dtype=F32),
        "seeds": torch.zeros(2, dtype=I64),
    }  # fmt: skip
    tokens, cache = _run(x)
    assert tokens.tolist() == [[6, 7, 8]]
    assert cache[1].argmax(-1).tolist() == [6, 7, 8] and cache[1].sum().item() == 3 and not cache[0].any()


def test_strided_base_logits_view() -> None:
    """The step reads a column view of ``[R, S, V]`` base logits whose rows are padded (row stride above S * V)."""
    x = _inputs(3, 2, 300, 64, seed=5)
    padded = torch.zeros(3, 2, 320, dtype=BF16)
    padded[:, :, :300] = x["base_logits"]
    tokens, cache = _run(x, padded[:, :, :300])
    want_tokens, want_cache = markov_sequential_reference(**x)
    assert torch.equal(tokens, want_tokens) and torch.equal(cache, want_cache)


def test_errors() -> None:
    x = _inputs(2, 2, 256, 64, seed=1)
    bufs = (torch.zeros(8, 1), torch.zeros(8, 1, dtype=I64))
    tokens = torch.zeros(2, 2, dtype=I64)
    step, last = V41RocmMarkovStep(), V41RocmMarkovLast()

    def call(**over: Any) -> None:
        a = {**x, "base_logits": x["base_logits"][:, 0], "tokens": tokens, "src": bufs, "dest": bufs, "step": 0, **over}
        step(a["src"], a["dest"], a["input_ids"], a["anchor_idx"], a["tokens"], a["w1"], a["w2"], a["base_logits"],
             a["cache"], a["idx_map"], a["sample_pos"], a["temperature"], a["seeds"], a["step"])  # fmt: skip

    with pytest.raises(warmreg.LaunchError, match="w2 must be"):
        call(w2=x["w2"].float())
    with pytest.raises(warmreg.LaunchError, match="idx_map must be"):
        call(idx_map=x["idx_map"].int())
    with pytest.raises(warmreg.LaunchError, match=r"step 0\.\.1"):
        call(step=2)
    with pytest.raises(warmreg.LaunchError, match="rank a multiple of 64"):
        call(w1=x["w1"][:, :32].contiguous(), w2=x["w2"][:, :32].contiguous())
    with pytest.raises(warmreg.LaunchError, match="block maxima must be"):
        call(dest=(torch.zeros(8, 2), bufs[1]))
    with pytest.raises(warmreg.LaunchError, match="base_logits must be"):
        call(base_logits=x["base_logits"][:, 0].t().contiguous().t())
    with pytest.raises(warmreg.LaunchError, match=r"rows must be 1\.\.8"):
        last(bufs, tokens, 3, 256)
    with pytest.raises(warmreg.LaunchError, match="block token ids"):
        last((bufs[0], bufs[1].int()), tokens, 2, 256)


# -- the plan --------------------------------------------------------------------------------------------------------
def _config(**serving: Any) -> dict[str, Any]:
    """The V4.1 example as a ROCm DSpark deployment with probabilistic drafts under ``--monokernel``."""
    config = example_config("deepseek_v41")
    config["model"]["text_config"].update(vocab_size=129280, dspark_markov_rank=256)
    config["serving"].update({
        "attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", "speculative_method": "dspark", "num_speculative_tokens": 5,
        "draft_sample_method": "probabilistic", "monokernel": True, **serving,
    })  # fmt: skip
    return config


@pytest.mark.parametrize(("target", "rows"), [("rocm:gfx942", 8), ("rocm:gfx950", 5), ("rocm:gfx950+aiter", 5)])
def test_plans_every_step_and_row_count(target: str, rows: int) -> None:
    """5 steps x 1..8 rows (5 on gfx950), rank 256, 505 blocks (512 reduced); one last launch for column 4; vLLM's
    call (its 8-row scratch, the step's column of ``[R, 5, V]``) reproduces each key."""
    plan = warmreg.plan(_config(), target=target)
    keys = plan.kernel(STEP).keys
    assert sorted((k.step, k.rows) for k in keys) == [(s, r) for s in range(5) for r in range(1, rows + 1)]
    assert {(k.rank, k.blocks_pow2, k.num_warps) for k in keys} == {(256, 512, 4)}
    (lk,) = plan.kernel(LAST).keys
    assert lk.fields() == {"step": 4, "blocks_pow2": 512}
    m, v = warmreg.meta, 129280
    for key in keys:
        r = key.rows
        scratch = (m((8, 505), F32), m((8, 505), I64))
        args = (scratch, scratch, m((4096,), torch.int32), m((256,), I64), m((256, 5), I64), m((v, 256), BF16),
                m((v, 256), BF16), m((r, v), BF16, stride=(5 * v, 1), offset=key.step * v), m((256, 5, v), BF16),
                m((r, 5), I64), m((r, 5), I64), m((256,), F32), m((256,), I64), key.step)  # fmt: skip
        assert OpCall(plan.kernel(STEP).kernel, args, {}).launch_code().key == key
    last_args = ((m((8, 505), F32), m((8, 505), I64)), m((256, 5), I64), 3, v)
    assert OpCall(plan.kernel(LAST).kernel, last_args, {}).launch_code().key == lk
    assert_warmup_inputs_reproduce(plan.kernel(STEP).kernel, keys)
    assert_warmup_inputs_reproduce(plan.kernel(LAST).kernel, [lk])


def test_max_num_seqs_bounds_the_rows() -> None:
    keys = warmreg.plan(_config(max_num_seqs=3), target="rocm:gfx942").kernel(STEP).keys
    assert {k.rows for k in keys} == {1, 2, 3}


@pytest.mark.parametrize(
    ("serving", "target"),
    [
        ({"monokernel": False}, "rocm:gfx942"),
        ({"draft_sample_method": "greedy"}, "rocm:gfx950"),
        ({"speculative_method": "mtp", "num_speculative_tokens": 1}, "rocm:gfx942"),
        ({"attention_backend": "FLASHMLA_SPARSE_DSV41", "monokernel": False}, "cuda:90"),
    ],
)
def test_nothing_without_monokernel_probabilistic_dspark(serving: dict[str, Any], target: str) -> None:
    """vLLM's loop runs without ``--monokernel``, with greedy drafts (no draft logits cache) or without DSpark; CUDA
    has its own sampler (``v41_markov_*``)."""
    names = {k.name for k in warmreg.plan(_config(**serving), target=target).kernels}
    assert not {STEP, LAST} & names


def test_monokernel_off_cdna3_or_4_is_refused() -> None:
    with pytest.raises(warmreg.ConfigError, match="monokernel"):
        warmreg.plan(_config(), target="rocm:gfx90a")
