"""The DSpark Markov drafter's ops (noise, step, select): equality with the PyTorch references under Triton's
interpreter, hand-picked cases, errors, the plan and cross-compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3 import markov_noise, markov_select, markov_step
from warmreg_kimi_k3._markov import DRAFT_SALT, gumbel_log_arg_reference, step_seed_reference
from warmreg_kimi_k3.markov_noise import MarkovNoise, markov_noise_reference
from warmreg_kimi_k3.markov_select import MarkovSelect, markov_select_reference
from warmreg_kimi_k3.markov_step import MarkovStep
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAMES = (MarkovNoise.name, MarkovStep.name, MarkovSelect.name)



def _bf16_as_f32(handle: Any) -> Any:
    """A bf16 operand's numpy bits (uint16) as the fp32 values they are (exact)."""
    import numpy as np
    import triton.language as tl

    if handle.dtype.scalar == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.8's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits
    (``interpreter.py: InterpreterBuilder.create_dot`` converts only fp8): multiply their values (bf16 -> fp32 is
    exact; numpy accumulates in fp32, the dot's accumulator). A fix to the interpreter, not to any kernel."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar != interpreter.tl.bfloat16 and b.dtype.scalar != interpreter.tl.bfloat16:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = interpreter.np.matmul(_bf16_as_f32(a), _bf16_as_f32(b), dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _specialized(**serving: Any) -> dict[str, Any]:
    config = example_config("kimi_k3")
    config["model"]["text_config"]["vocab_size"] = 163840
    settings = {
        "decode_backend": "latency_specialized",
        "speculative_method": "dspark",
        "draft_sample_method": "probabilistic",
    }
    settings.update(serving)
    config["serving"].update(settings)
    return config


def _batch(reqs: int, k: int, states: int, seed: int, hole: bool = True) -> dict[str, torch.Tensor]:
    """Request states (one -1 row with ``hole``), positions, temperatures (one greedy request) and seeds."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(states, generator=g)[:reqs].repeat_interleave(k).view(reqs, k)
    if hole:
        idx[0, -1] = -1
    pos = (torch.randint(1, 1 << 20, (reqs, 1), generator=g) + torch.arange(k)).long()
    temp = torch.rand(states, generator=g) + 0.2
    temp[idx[-1, 0]] = 0.0  # one greedy request
    seeds = torch.randint(-(1 << 62), 1 << 62, (states,), generator=g)
    return {"idx": idx, "pos": pos, "temp": temp, "seeds": seeds}


# -- the noise --------------------------------------------------------------------------------------------------
def test_noise_matches_reference_and_the_formula() -> None:
    """Three 1024-blocks, a -1 row (seed 0), and one value recomputed from the hash by hand."""
    b = _batch(3, 2, 6, seed=1)
    got = MarkovNoise(num_speculative_tokens=2)(b["idx"], b["pos"], b["seeds"], vocab=2500)
    # Two fp32 ulps: PyTorch's log and the interpreter's (numpy's) differ in the last bit on some values; the hash
    # and the uniform are exact (vLLM's own kernel agrees bitwise: tests/engines/test_vllm034_kernels_kimi_specialized).
    want_all = markov_noise_reference(b["idx"], b["pos"], b["seeds"], 2500)
    torch.testing.assert_close(got, want_all, rtol=2.5e-7, atol=0)
    seed = step_seed_reference(b["seeds"][b["idx"][1, 1]], 1)
    want = gumbel_log_arg_reference(seed, b["pos"][1, 1] - 1 + DRAFT_SALT, torch.tensor(2049))
    torch.testing.assert_close(got[1, 1, 2049], want, rtol=2.5e-7, atol=0)
    assert 0 < float(want) < 40  # -log1p(-u) of u in (0, 1)


def test_noise_out_view_and_errors() -> None:
    b, kernel = _batch(2, 2, 4, seed=2), MarkovNoise(num_speculative_tokens=2)
    buf = torch.full((32 * 300,), 5.0)
    out = buf[: 2 * 2 * 300].view(2, 2, 300)  # vLLM's view of its persistent buffer
    assert kernel(b["idx"], b["pos"], b["seeds"], vocab=300, out=out) is out and (buf[1200:] == 5).all()
    with pytest.raises(warmreg.LaunchError, match="vocab"):
        kernel(b["idx"], b["pos"], b["seeds"])
    with pytest.raises(warmreg.LaunchError, match="sample_pos"):
        kernel(b["idx"], b["pos"][:1], b["seeds"], vocab=8)
    with pytest.raises(warmreg.LaunchError, match="seeds"):
        kernel(b["idx"], b["pos"], b["seeds"].int(), vocab=8)


def test_noise_out() -> None:
    """``out=`` (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated)."""

    def build() -> OpCall:
        b = _batch(2, 3, 5, seed=4)
        return OpCall(MarkovNoise(num_speculative_tokens=3), (b["idx"], b["pos"], b["seeds"]), {"vocab": 70})

    check_out(build)


# -- the step and the select ------------------------------------------------------------------------------------
def _logits_reference(base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    bias = (w1[prev].float() @ w2.float().T).to(base.dtype)
    return (base.float() + bias.float()).to(base.dtype)


@pytest.mark.parametrize(("reqs", "vocab", "noise"), [(3, 700, True), (18, 300, False)])  # partial blocks; 2 row blocks
def test_steps_match_references(bf16_dot: None, reqs: int, vocab: int, noise: bool) -> None:
    """Two steps chained as vLLM's ``FusedMarkov.run``: the cached logits within one bf16 ulp of the reference (the
    interpreter truncates fp32 -> bf16, PyTorch rounds; the dot's summation order may differ), the tokens exactly the
    first argmax of the reference keys over the kernel's own cached logits, ``prev`` the last step's tokens."""
    k, states, rank = 2, reqs + 3, 16
    g = torch.Generator().manual_seed(reqs)
    b = _batch(reqs, k, states, seed=reqs, hole=False)
    w1, w2 = (torch.randn(vocab, rank, generator=g).to(torch.bfloat16) for _ in range(2))
    base = (torch.randn(reqs, k, vocab, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (reqs * k,), generator=g, dtype=torch.int32)
    anchor = torch.arange(reqs, dtype=torch.int64) * k
    cache = torch.full((states, k, vocab), 9.0, dtype=torch.bfloat16)
    nb = -(-vocab // 256)
    out_max, out_arg = torch.empty(reqs, nb), torch.empty(reqs, nb, dtype=torch.int64)
    prev, tokens = torch.zeros(reqs, dtype=torch.int64), torch.zeros(states, k, dtype=torch.int64)
    noise_t = MarkovNoise(num_speculative_tokens=k)(b["idx"], b["pos"], b["seeds"], vocab=vocab) if noise else None
    step_op = MarkovStep(num_speculative_tokens=k, max_num_seqs=reqs, vocab_size=vocab, rank=rank, dtype="bfloat16")
    want_prev = ids[anchor].long()
    for step in range(k):
        step_op(prev, ids, anchor, w1, w2, base[:, step], cache, b["idx"], b["pos"], b["temp"], b["seeds"], out_max,
                out_arg, noise_t, step=step)  # fmt: skip
        MarkovSelect(vocab_size=vocab)(out_max, out_arg, prev, tokens, num_rows=reqs, step=step)
        req = b["idx"][:, step]
        got = cache[req, step]
        want = _logits_reference(base[:, step], w1, w2, want_prev)
        # The interpreter truncates fp32 -> bf16 (the bias, then the sum) where PyTorch rounds: at most one bf16 ulp
        # of each term's magnitude apart, however much the sum cancels.
        bias = (w1[want_prev].float() @ w2.float().T).abs()
        assert ((got.float() - want.float()).abs() <= 2**-7 * (base[:, step].float().abs() + bias) * 2).all()
        temp, seed = b["temp"][req][:, None], step_seed_reference(b["seeds"][req], step)[:, None]
        arg = gumbel_log_arg_reference(seed, b["pos"][:, step, None] - 1 + DRAFT_SALT, torch.arange(vocab))
        lf = got.float()
        keys = torch.where(temp != 0, lf / temp - torch.log(arg), lf)
        assert torch.equal(tokens[:reqs, step], keys.argmax(dim=1)), step
        want_prev = tokens[:reqs, step].clone()
        assert torch.equal(prev, want_prev)
    untouched = torch.ones(states, dtype=torch.bool)
    untouched[b["idx"][:, 0]] = False
    assert (cache[untouched] == 9).all()  # only the batch's request states are written


def test_select_first_of_equal_maxima() -> None:
    out_max = torch.tensor([[1.0, 3.0, 3.0, -float("inf")], [0.5, 0.25, 0.5, 0.1]])
    out_arg = torch.tensor([[10, 20, 30, 40], [1, 2, 3, 4]])
    prev, tokens = torch.zeros(2, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.int64)
    MarkovSelect(vocab_size=1024)(out_max, out_arg, prev, tokens, num_rows=2, step=2)
    assert prev.tolist() == [20, 1] == tokens[:2, 2].tolist() == markov_select_reference(out_max, out_arg).tolist()
    assert tokens[:, :2].eq(0).all() and tokens[2:].eq(0).all()


def test_step_errors() -> None:
    op = MarkovStep(num_speculative_tokens=2, max_num_seqs=2, vocab_size=64, rank=16, dtype="bfloat16")
    w = torch.zeros(64, 16, dtype=torch.bfloat16)
    base, cache = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    i64, f32 = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2)
    good = (i64[0], i64[0].int(), i64[0], w, w, base, cache, i64, i64, f32, i64[0], torch.zeros(2, 1),
            torch.zeros(2, 1, dtype=torch.int64))  # fmt: skip
    with pytest.raises(warmreg.LaunchError, match="rank"):
        op(*good[:3], w[:, :12].contiguous(), w[:, :12].contiguous(), *good[5:], step=0)
    with pytest.raises(warmreg.LaunchError, match="cache"):
        op(*good[:6], cache.float(), *good[7:], step=0)
    with pytest.raises(warmreg.LaunchError, match="step"):
        op(*good, step=2)
    with pytest.raises(warmreg.LaunchError, match="out_max"):
        op(*good[:11], torch.zeros(2, 3), good[12], step=0)


# -- the plan ---------------------------------------------------------------------------------------------------
def test_planned_on_sm100_only_with_probabilistic_dspark() -> None:
    for target in ("cuda:90", "cuda:120"):
        assert not set(NAMES) & {kp.name for kp in warmreg.plan(_specialized(), target=target).kernels}
    kps = {kp.name: kp for kp in warmreg.plan(_specialized(), target="cuda:100").kernels}
    assert set(NAMES) <= set(kps)
    assert len(kps[MarkovNoise.name].keys) == 1 and len(kps[MarkovSelect.name].keys) == 1
    (select,) = kps[MarkovSelect.name].keys
    assert select.fields()["nb_pow2"] == 1024  # cdiv(163840, 256) = 640
    steps = kps[MarkovStep.name].keys  # the noise read (<= 32 rows) or drawn (256 requests x 3)
    assert sorted(key.noise for key in steps) == [False, True] and {key.rank for key in steps} == {256}
    for name in NAMES:
        assert_warmup_inputs_reproduce(kps[name].kernel, kps[name].keys)
    assert set(NAMES) <= {kp.name for kp in warmreg.plan(_specialized(), target="cuda:103").kernels}
    for serving in ({"draft_sample_method": "greedy"}, {"speculative_method": "mtp"}, {"decode_backend": "auto"}):
        config = _specialized(**serving)
        assert not set(NAMES) & {kp.name for kp in warmreg.plan(config, target="cuda:100").kernels}, serving


def test_few_requests_always_read_the_noise() -> None:
    kp = warmreg.plan(_specialized(max_num_seqs=8), target="cuda:100").kernel(MarkovStep.name)
    assert [key.noise for key in kp.keys] == [True]  # 8 x 3 <= 32 sampled rows


def test_runtime_step_is_planned() -> None:
    """vLLM's launch shapes: ``base_logits[:, s]`` of ``[R, 3, V]``, the ``[256, 3, V]`` cache, the noise view."""
    kp = warmreg.plan(_specialized(), target="cuda:100").kernel(MarkovStep.name)
    v = 163840
    base = warmreg.meta((5, 3, v), torch.bfloat16)
    for step in range(3):
        key = kp.kernel.dispatch(
            w1=warmreg.meta((v, 256), torch.bfloat16), w2=warmreg.meta((v, 256), torch.bfloat16), base=base[:, step],
            cache=warmreg.meta((256, 3, v), torch.bfloat16), noise=warmreg.meta((32 * v,), torch.float32)[: 15 * v]
            .view(5, 3, v), out_max=warmreg.meta((256, 640), torch.float32),
        )  # fmt: skip
        assert key in kp.keys


def test_cross_compile() -> None:
    plugin = RegisterPlugin(
        markov_noise.register, markov_step.register, markov_select.register, model=KimiK3.from_config
    )
    report = warmreg.warm(_specialized(), target="cuda:100", plugins=[plugin], entry_points=False, workers=1)
    assert report.ok and {r.kernel for r in report.results} == set(NAMES), [r.error for r in report.failed]
