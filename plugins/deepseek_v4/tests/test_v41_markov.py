"""DeepSeek-V4.1's fused Markov sampler (a DSpark draft step's sample and select kernels) against their PyTorch
references under Triton's interpreter (hand-picked draws, random steps over fp32 and bf16 heads, inert rows,
errors, in place, the noise's Python twin), and the plan: which configs and targets plan which keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_markov_sample, v41_markov_select
from warmreg_deepseek_v4._v41_markov import BLOCK_SIZE, block_p, uniform32
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_markov_sample import MarkovSample, markov_sample_reference
from warmreg_deepseek_v4.v41_markov_select import MarkovSelect, markov_select_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I64, F32, BF16 = torch.int64, torch.float32, torch.bfloat16
NAMES = (MarkovSample.name, MarkovSelect.name)


def _dspark_config(**serving: Any) -> dict[str, Any]:
    """The V4.1 example as a DSpark deployment with the fused sampler (vocab and Markov rank of DeepSeek-V4's DSpark
    example)."""
    config = example_config("deepseek_v41")
    config["model"]["text_config"].update(vocab_size=129280, dspark_markov_rank=256)
    fused = {"speculative_method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "probabilistic",
             "dspark_fused_markov": True}  # fmt: skip
    config["serving"].update({**fused, **serving})
    return config


class _Step:
    """Random inputs of one draft step: ``R`` requests of ``S`` steps over a ``V`` vocabulary, the request states
    ``slots`` (``-1`` inert) with temperatures ``temps``."""

    def __init__(self, seed: int, *, reqs: int, steps: int, vocab: int, slots: list[int], temps: list[float],
                 dtype: torch.dtype, rank: int = 8, scale: float = 3.0) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        states = max(6, reqs)
        self.steps, self.vocab = steps, vocab
        self.base = (torch.randn(reqs * steps, vocab + 7, generator=gen) * scale).to(dtype)[:, 7:]  # a row-stride view
        self.bias = (torch.randn(reqs, vocab, generator=gen) * scale).to(dtype)
        self.idx = torch.tensor([s for s in slots for _ in range(steps)], dtype=I64)
        self.temp = torch.zeros(states, dtype=F32)
        for s, t in zip(slots, temps):
            if s >= 0:
                self.temp[s] = t
        self.cache = torch.randn(states, steps, vocab, generator=gen).to(dtype)
        self.pmax = torch.full((states, block_p(vocab)), 7.0)
        self.psum = torch.full((states, block_p(vocab)), 7.0)
        self.seeds = torch.randint(-(2**62), 2**62, (states,), generator=gen, dtype=I64)
        self.pos = torch.randint(0, 1 << 20, (reqs * steps,), generator=gen, dtype=I64)
        self.tokens = torch.full((states, steps), -3, dtype=I64)
        self.weight = torch.randn(vocab, rank, generator=gen).to(dtype)
        self.embed = torch.zeros(states, rank, dtype=dtype)
        self.reqs = reqs

    def sample_args(self, step: int) -> tuple[Any, ...]:
        return (self.base, self.bias, step, self.idx, self.temp, self.cache, self.pmax, self.psum)

    def select_args(self, step: int) -> tuple[Any, ...]:
        return (step, self.idx, self.pos, self.temp, self.seeds, self.cache, self.tokens, self.weight, self.embed,
                self.pmax, self.psum)  # fmt: skip


def _run_step(step: _Step, s: int) -> None:
    MarkovSample(num_steps=step.steps, vocab=step.vocab, dtype="float32")(*step.sample_args(s))
    MarkovSelect(num_steps=step.steps, vocab=step.vocab, rank=8, dtype="float32")(
        *step.select_args(s), num_reqs=step.reqs
    )


# -- the noise -------------------------------------------------------------------------------------------------------
def test_uniform_is_murmur3_of_the_four_words() -> None:
    """MurmurHash3 x86_32 of the 16 bytes ``seed`` (low, high), ``pos``, ``offset`` with seed 0, as the published
    hash computes it (mmh3's value for these bytes, written out), split into two exact halves."""
    import struct

    def murmur3(data: bytes) -> int:
        h = 0
        for (k,) in struct.iter_unpack("<I", data):
            k = (k * 0xCC9E2D51) & 0xFFFFFFFF
            k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
            k = (k * 0x1B873593) & 0xFFFFFFFF
            h ^= k
            h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
            h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
        h ^= len(data)
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = ((h ^ (h >> shift)) * mul) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seed, step, pos, vocab = 0x0123456789ABCDEF, 3, (1 << 30) + 41, 129280
    mixed = seed ^ (step << 32)
    h = murmur3(struct.pack("<IIII", mixed & 0xFFFFFFFF, mixed >> 32, pos, vocab))
    assert uniform32(seed, step, pos, vocab) == pytest.approx((h + 0.5) / 2**32, rel=1e-6)
    assert 0.0 < uniform32(0, 0, 0, 1) < 1.0


# -- the sample step -------------------------------------------------------------------------------------------------
def test_sample_by_hand() -> None:
    """One request, vocabulary 3000 (two blocks): greedy keeps each block's max and its index; at temperature 1 the
    partials are the log2-scaled max and the block's sum of exp2 around it; the cache row is the biased logits."""
    base = torch.zeros(2, 3000)
    base[1, 5], base[1, 2500] = 4.0, 6.0
    bias = torch.zeros(1, 3000)
    bias[0, 2600] = 9.0
    cache, pmax, psum = torch.zeros(2, 2, 3000), torch.zeros(2, 2), torch.zeros(2, 2)
    temp = torch.tensor([0.0, 1.0])
    MarkovSample(num_steps=2, vocab=3000, dtype="float32")(base, bias, 1, torch.tensor([0, 0]), temp, cache, pmax, psum)
    assert cache[0, 1].tolist() == (base[1] + bias[0]).tolist() and not cache[0, 0].any()
    assert pmax[0].tolist() == [4.0, 9.0] and psum[0].tolist() == [5.0, 2600.0]
    MarkovSample(num_steps=2, vocab=3000, dtype="float32")(base, bias, 1, torch.tensor([1, 1]), temp, cache, pmax, psum)
    log2e = 1.4426950408889634
    torch.testing.assert_close(pmax[0], torch.tensor([4.0, 9.0]) * log2e)
    # fp32 exp2 sums over 2048 and 952 entries: a few ulps
    want = torch.tensor([1 + 2047 * 2 ** (-4 * log2e), 1 + 2 ** ((6 - 9) * log2e) + 950 * 2 ** (-9 * log2e)])
    torch.testing.assert_close(psum[0], want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("dtype", "reqs", "steps", "vocab", "slots", "temps"),
    [
        (F32, 3, 2, 5000, [4, -1, 1], [0.7, 0.0, 0.0]),
        (BF16, 2, 3, 2048, [0, 5], [1.3, 0.8]),
        (F32, 1, 1, 7, [2], [0.05]),
        (F32, 0, 2, 100, [], []),
    ],
)
def test_sample_matches_reference(dtype: torch.dtype, reqs: int, steps: int, vocab: int, slots: list[int],
                                  temps: list[float]) -> None:  # fmt: skip
    """Random steps (an inert row, a vocabulary of one exact block, one smaller than a block, no requests): the
    cache rows exact in fp32; in bf16 within one bf16 ulp (the interpreter truncates fp32 -> bf16 where the GPU rounds
    to nearest even) and the partials of those values within bf16 resolution (sampled rows only: a greedy argmax may
    flip between two values the roundings tell apart); fp32 sums within 1e-5."""
    for s in range(steps):
        step = _Step(reqs * 31 + s, reqs=reqs, steps=steps, vocab=vocab, slots=slots, temps=temps, dtype=dtype)
        want = markov_sample_reference(*step.sample_args(s))
        MarkovSample(num_steps=steps, vocab=vocab, dtype="float32")(*step.sample_args(s))
        tol = {"rtol": 0.0, "atol": 0.0} if dtype == F32 else {"rtol": 2**-7, "atol": 1e-6}
        torch.testing.assert_close(step.cache, want[0], **tol)
        torch.testing.assert_close(
            step.pmax, want[1], **({"rtol": 0.0, "atol": 0.0} if dtype == F32 else {"rtol": 2**-7, "atol": 0.0})
        )
        torch.testing.assert_close(step.psum, want[2], rtol=1e-5 if dtype == F32 else 0.1, atol=0.0)


def test_sample_errors_name_the_argument() -> None:
    step = _Step(0, reqs=2, steps=2, vocab=300, slots=[0, 1], temps=[1.0, 0.0], dtype=F32)
    op, (base, bias, _, idx, temp, cache, pmax, psum) = (
        MarkovSample(num_steps=2, vocab=300, dtype="float32"),
        step.sample_args(0),
    )
    with pytest.raises(warmreg.LaunchError, match="cache"):
        op(base, bias, 0, idx, temp, cache.transpose(1, 2), pmax, psum)
    with pytest.raises(warmreg.LaunchError, match="bias"):
        op(base, bias[:, :299], 0, idx, temp, cache, pmax, psum)
    with pytest.raises(warmreg.LaunchError, match="base_logits"):
        op(base.t().contiguous().t(), bias, 0, idx, temp, cache, pmax, psum)
    with pytest.raises(warmreg.LaunchError, match="idx_mapping"):
        op(base, bias, 0, idx.int(), temp, cache, pmax, psum)
    with pytest.raises(warmreg.LaunchError, match="temperature"):
        op(base, bias, 0, idx, temp.double(), cache, pmax, psum)
    with pytest.raises(warmreg.LaunchError, match="partial_sum"):
        op(base, bias, 0, idx, temp, cache, pmax, psum[:1])
    with pytest.raises(warmreg.LaunchError, match="step"):
        op(base, bias, 2, idx, temp, cache, pmax, psum)


# -- the select step -------------------------------------------------------------------------------------------------
def test_select_by_hand() -> None:
    """Greedy takes the index kept in the partial sum of the block with the largest max (ties: the first); a
    one-hot distribution (every other logit -inf) draws its token at any temperature; the embedding row follows."""
    vocab, rank = 5000, 4
    cache = torch.full((2, 1, vocab), -float("inf"))
    cache[1, 0, 4321] = 0.0
    pmax, psum = torch.full((2, 4), -float("inf")), torch.zeros(2, 4)
    pmax[0, :3], psum[0, :3] = torch.tensor([3.0, 5.0, 5.0]), torch.tensor([17.0, 2222.0, 4444.0])
    pmax[1, :3], psum[1, :3] = torch.tensor([-float("inf"), -float("inf"), 0.0]), torch.tensor([0.0, 0.0, 1.0])
    weight = torch.arange(vocab * rank, dtype=F32).view(vocab, rank)
    tokens, embed = torch.zeros(2, 1, dtype=I64), torch.zeros(2, rank)
    args = (0, torch.tensor([0, 1]), torch.tensor([10, 20]), torch.tensor([0.0, 0.9]), torch.tensor([5, 6]), cache,
            tokens, weight, embed, pmax, psum)  # fmt: skip
    MarkovSelect(num_steps=1, vocab=vocab, rank=rank, dtype="float32")(*args, num_reqs=2)
    assert tokens.flatten().tolist() == [2222, 4321]
    assert torch.equal(embed, weight[[2222, 4321]])


@pytest.mark.parametrize(
    ("dtype", "vocab", "scale"), [(F32, 5000, 3.0), (BF16, 4096, 1.0), (F32, 129, 0.3), (F32, 9000, 12.0)]
)
def test_select_matches_reference(dtype: torch.dtype, vocab: int, scale: float) -> None:
    """A whole draft step (sample then select) for six requests, greedy and sampled, one inert: the drawn tokens and
    the gathered embeddings equal the reference's (which reads the kernel's own partials)."""
    reqs, steps = 6, 3
    slots, temps = [3, 0, -1, 5, 1, 2], [1.0, 0.0, 0.0, 0.6, 2.0, 0.25]
    for s in range(steps):
        step = _Step(vocab + s, reqs=reqs, steps=steps, vocab=vocab, slots=slots, temps=temps, dtype=dtype, scale=scale)
        MarkovSample(num_steps=steps, vocab=vocab, dtype="float32")(*step.sample_args(s))
        want = markov_select_reference(*step.select_args(s), num_reqs=reqs)
        MarkovSelect(num_steps=steps, vocab=vocab, rank=8, dtype="float32")(*step.select_args(s), num_reqs=reqs)
        assert torch.equal(step.tokens, want[0]) and torch.equal(step.embed, want[1])
        assert (step.tokens[:reqs, s] >= 0).all() and (step.tokens[:reqs, s] < vocab).all()


def test_select_samples_the_distribution() -> None:
    """Over 400 seeds a two-token distribution p = (0.8, 0.2) across two blocks is drawn in proportion (the block
    pick) and within a block a (0.25, 0.75) pair likewise (the in-block pick): binomial bounds at ~5 sigma."""
    import math

    vocab, reqs = 4096, 400
    for ids, p in (((7, 3000), 0.8), ((100, 101), 0.25)):
        step = _Step(1, reqs=reqs, steps=1, vocab=vocab, slots=[0] * reqs, temps=[1.0] * reqs, dtype=F32, rank=4)
        step.base.fill_(-float("inf"))
        step.base[:, ids[0]], step.base[:, ids[1]] = math.log(p), math.log(1 - p)
        step.bias.zero_()
        step.seeds = torch.arange(reqs, dtype=I64)  # one request state: vary the position instead
        step.pos = torch.arange(reqs, dtype=I64) * 7919
        _run_step(step, 0)
        first = int((step.tokens[:reqs, 0] == ids[0]).sum())
        assert int(((step.tokens[:reqs, 0] == ids[0]) | (step.tokens[:reqs, 0] == ids[1])).sum()) == reqs
        assert abs(first - reqs * p) < 5 * math.sqrt(reqs * p * (1 - p)), first


def test_select_errors_name_the_argument() -> None:
    step = _Step(0, reqs=2, steps=2, vocab=300, slots=[0, 1], temps=[1.0, 0.0], dtype=F32)
    op, a = MarkovSelect(num_steps=2, vocab=300, rank=8, dtype="float32"), list(step.select_args(0))
    for i, bad, name in (
        (1, a[1][:3], "idx_mapping"), (2, a[2].int(), "sample_pos"), (4, a[4].float(), "seeds"),
        (6, a[6].t(), "draft_tokens"), (7, a[7][:, :6].contiguous(), "embed_weight"), (8, a[8].double(), "embed must"),
        (9, a[9][:1], "partial_max"), (5, a[5].transpose(1, 2), "cache"),
    ):  # fmt: skip
        args = list(a)
        args[i] = bad
        with pytest.raises(warmreg.LaunchError, match=name):
            op(*args, num_reqs=2)


def test_both_steps_are_in_place_and_allocate_nothing() -> None:
    step = _Step(0, reqs=2, steps=2, vocab=300, slots=[0, 1], temps=[1.0, 0.0], dtype=F32)
    with Allocations() as fresh:
        sample = OpCall(MarkovSample(num_steps=2, vocab=300, dtype="float32"), step.sample_args(1), {}).launch_code()
        select = OpCall(MarkovSelect(num_steps=2, vocab=300, rank=8, dtype="float32"), step.select_args(1),
                        {"num_reqs": 2}).launch_code()  # fmt: skip
    assert not fresh.calls
    assert sample.outputs == (step.cache, step.pmax, step.psum) and select.outputs == (step.tokens, step.embed)
    assert sample.grid == (2, 1) and select.grid == (2,)


# -- the plan --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_fused_dspark_plans_one_key_each(target: str) -> None:
    """V4.1 DSpark with the fused sampler: one key each, the model dtype, 5 steps, vocabulary 129280 (64 partials),
    rank 256; the sampler's calls for any number of requests and steps reproduce them."""
    plan = warmreg.plan(_dspark_config(), target=target)
    (sample,) = plan.kernel(MarkovSample.name).keys
    (select,) = plan.kernel(MarkovSelect.name).keys
    assert sample.fields() == {"base_dtype": "bfloat16", "bias_dtype": "bfloat16", "cache_dtype": "bfloat16",
                               "num_steps": 5, "vocab": 129280, "block_size": 2048, "block_p": 64, "num_warps": 2}  # fmt: skip
    assert select.fields() == {"cache_dtype": "bfloat16", "embed_dtype": "bfloat16", "num_steps": 5, "vocab": 129280,
                               "rank": 256, "block_size": 2048, "block_p": 64, "num_warps": 4}  # fmt: skip
    for reqs in (1, 37, 256):
        m = warmreg.meta
        sample_args = (m((reqs * 5, 129280), BF16), m((reqs, 129280), BF16), 3, m((256 * 5,), I64), m((256,), F32),
                       m((256, 5, 129280), BF16), m((256, 64), F32), m((256, 64), F32))  # fmt: skip
        assert OpCall(plan.kernel(MarkovSample.name).kernel, sample_args, {}).launch_code().key == sample
        select_args = (4, m((256 * 5,), I64), m((256 * 5,), I64), m((256,), F32), m((256,), I64), m((256, 5, 129280), BF16),
                       m((256, 5), I64), m((129280, 256), BF16), m((256, 256), BF16), m((256, 64), F32), m((256, 64), F32))  # fmt: skip
        assert (
            OpCall(plan.kernel(MarkovSelect.name).kernel, select_args, {"num_reqs": reqs}).launch_code().key == select
        )
    assert_warmup_inputs_reproduce(plan.kernel(MarkovSample.name).kernel, [sample])
    assert_warmup_inputs_reproduce(plan.kernel(MarkovSelect.name).kernel, [select])


@pytest.mark.parametrize(
    ("serving", "target"),
    [
        ({"dspark_fused_markov": False}, "cuda:90"),
        ({"draft_sample_method": "greedy"}, "cuda:100"),
        ({"speculative_method": "mtp", "num_speculative_tokens": 1}, "cuda:90"),
    ],
)
def test_nothing_planned_without_the_fused_probabilistic_dspark(serving: dict[str, Any], target: str) -> None:
    """The flag off (vLLM's default), greedy drafts or MTP: vLLM keeps its own loop, nothing is planned; the
    example (MTP) plans neither; nor does DeepSeek-V4 or ROCm."""
    names = {k.name for k in warmreg.plan(_dspark_config(**serving), target=target).kernels}
    assert not names & set(NAMES)
    assert not {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels} & set(NAMES)
    rocm = _dspark_config(attention_backend="ROCM_FLASHMLA_SPARSE_DSV41")
    assert not {k.name for k in warmreg.plan(rocm, target="rocm:gfx942").kernels} & set(NAMES)
    v4 = example_config("deepseek_v4_flash_0731_dspark", dspark_fused_markov=True, draft_sample_method="probabilistic")
    assert not {k.name for k in warmreg.plan(v4, target="cuda:90").kernels} & set(NAMES)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(warmreg.ConfigError, match="dspark_fused_markov"):
        warmreg.plan(_dspark_config(dspark_fused_markov="yes"), target="cuda:90")
    config = _dspark_config()
    config["model"]["text_config"]["dspark_markov_rank"] = 96
    with pytest.raises(warmreg.ConfigError, match="dspark_markov_rank"):
        warmreg.plan(config, target="cuda:90")
    del config["model"]["text_config"]["vocab_size"]
    with pytest.raises(warmreg.ConfigError, match="vocab_size"):
        warmreg.plan(config, target="cuda:90")


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    plugins = [
        RegisterPlugin(module.register, model=DSV4.from_config) for module in (v41_markov_sample, v41_markov_select)
    ]
    report = warmreg.warm(_dspark_config(), target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


def test_block_constants() -> None:
    assert BLOCK_SIZE == 2048 and block_p(129280) == 64 and block_p(2048) == 1 and block_p(2049) == 2
