"""DeepSeek-V4.1's engram ops (the n-gram hash, the table lookup, the gate) against their PyTorch references under
Triton's interpreter (hand-picked math, views, errors, out=, warmup inputs), and the plan: which configs and targets
plan which keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4._v41_engram import EngramLayout
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_engram_gate import EngramGate, engram_gate_reference
from warmreg_deepseek_v4.v41_engram_hash import EngramHash, engram_hash_reference
from warmreg_deepseek_v4.v41_engram_lookup import EngramLookup, engram_lookup_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64
NAMES = {"deepseek_v4.v41_engram_hash", "deepseek_v4.v41_engram_lookup", "deepseek_v4.v41_engram_gate"}
LAYOUT = EngramLayout(layer_ids=(1, 14), max_ngram_size=4, n_heads=3, head_dim=64)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(layers: int, n: int, h: int, seed: int = 0) -> dict[str, Any]:
    primes = torch.tensor([101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173, 179, 181, 191])
    primes = primes[: layers * (n - 1) * h].reshape(layers, n - 1, h).to(I64)
    flat = primes.reshape(layers, -1)
    mult = torch.randint(0, 2**40, (layers, n), generator=_gen(seed)) * 2 + 1
    tmap = torch.randint(0, 30, (50,), generator=_gen(seed + 1), dtype=I32)
    return dict(token_map=tmap, multipliers=mult, primes=primes, offsets=torch.cumsum(flat, 1) - flat, pad_id=2)


# -- the n-gram hash -------------------------------------------------------------------------------------------------
def test_hash_by_hand() -> None:
    """One request, one layer, a 2-gram, one head, multipliers 1: ``h_1 = map[x_t] XOR map[x_{t-1}]``; the first
    token has no predecessor (``q < 0``: the pad id 1 stands for it); a dead token is a pad id from itself on, in its
    own n-grams and those reaching back through it."""
    params = dict(token_map=torch.arange(10, dtype=I32) * 2, multipliers=torch.ones(1, 2, dtype=I64),
                  primes=torch.tensor([[[1000]]]), offsets=torch.tensor([[5]]), pad_id=1)  # fmt: skip
    ids, pos = torch.tensor([3, 4, 5, 6], dtype=I32), torch.arange(4)
    dead = torch.tensor([False, False, True, False])
    lb, lbd = torch.full((1, 1), -1, dtype=I32), torch.zeros(1, 1, dtype=torch.bool)
    args = (ids, pos, torch.tensor([0, 4], dtype=I32), dead, lb, lbd)
    got = EngramHash(n_layers=1, max_ngram_size=2, n_heads=1)(*args, **params)
    assert got.flatten().tolist() == [(6 ^ 1) + 5, (8 ^ 6) + 5, (1 ^ 1) + 5, (12 ^ 1) + 5]
    assert torch.equal(got, engram_hash_reference(*args, **params))


def test_hash_matches_reference_across_chunks_and_lookback() -> None:
    """Three requests (a continued chunk that reads the look-back window, a one-token decode, a fresh prefill), a
    repeated padding boundary, dead tokens in the batch and the window, unknown (-1) window ids, offset views."""
    layers, n, h = 2, 4, 3
    params = _params(layers, n, h)
    qsl = torch.tensor([0, 4, 5, 11, 11], dtype=I32)
    pos = torch.cat([torch.arange(7, 11), torch.arange(0, 1), torch.arange(2, 8)])
    ids_base = torch.randint(0, 50, (2 * 11,), generator=_gen(2), dtype=I32)
    ids = ids_base[::2]  # stride 2
    dead = torch.zeros(11, dtype=torch.bool)
    dead[8] = True
    lb = torch.randint(-1, 50, (5, n - 1), generator=_gen(3), dtype=I32)
    lbd = torch.zeros(5, n - 1, dtype=torch.bool)
    lbd[0, 1] = True
    args = (ids, pos, qsl, dead, lb, lbd)
    got = EngramHash(n_layers=layers, max_ngram_size=n, n_heads=h)(*args, **params)
    assert got.shape == (11, layers, (n - 1) * h) and got.dtype == I32
    assert torch.equal(got, engram_hash_reference(*args, **params))


def _small_hash() -> EngramHash:
    return EngramHash(n_layers=1, max_ngram_size=2, n_heads=3)


def _small_gate() -> EngramGate:
    return EngramGate(hidden_size=16, hc_mult=2, dtype="bfloat16")


def test_hash_empty_step_and_errors() -> None:
    kernel, params = _small_hash(), _params(1, 2, 3)
    lb, lbd = torch.zeros(1, 1, dtype=I32), torch.zeros(1, 1, dtype=torch.bool)
    empty = (
        torch.zeros(0, dtype=I32),
        torch.zeros(0, dtype=I64),
        torch.zeros(2, dtype=I32),
        torch.zeros(0, dtype=torch.bool),
    )
    assert kernel(*empty, lb, lbd, **params).shape == (0, 1, 3)
    ids, pos, qsl, dead = (
        torch.zeros(2, dtype=I32),
        torch.arange(2),
        torch.tensor([0, 2], dtype=I32),
        torch.zeros(2, dtype=torch.bool),
    )
    with pytest.raises(warmreg.LaunchError, match="dead_mask"):
        kernel(ids, pos, qsl, dead.int(), lb, lbd, **params)
    with pytest.raises(warmreg.LaunchError, match="lookback_token_ids"):
        kernel(ids, pos, qsl, dead, lb.float(), lbd, **params)
    with pytest.raises(warmreg.LaunchError, match="offsets"):
        kernel(ids, pos, qsl, dead, lb, lbd, **{**params, "offsets": params["offsets"][:, :1]})
    check_out(lambda: OpCall(_small_hash(), (ids, pos, qsl, dead, lb, lbd), dict(params)))


# -- the lookup ------------------------------------------------------------------------------------------------------
def _table(rows: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.randn(rows, d, generator=_gen(seed)) * 4).to(torch.float8_e4m3fn)
    scales = torch.randint(120, 135, (rows, d // 32), generator=_gen(seed + 1), dtype=torch.uint8)
    scales[3, 0] = 0  # a zero scale byte: a zero row block
    return weight, scales


@pytest.mark.parametrize(("head_start", "programs"), [(0, None), (4, 1), (4, 3)])
def test_lookup_matches_reference(head_start: int, programs: int | None) -> None:
    """Rank 0 and the last rank of 6 heads over 4 a rank (heads 6, 7 padded: zero rows), the ids a strided column of
    the hash output, a persistent grid of 1 and 3 programs; rows outside ``[vs, ve)`` are zeros."""
    weight, scales = _table(40, 64, 0)
    ids = torch.randint(90, 140, (5, 3, 6), generator=_gen(1), dtype=I32)[:, 1]
    out = torch.full((5, 4, 64), 9.0, dtype=BF16)
    got = EngramLookup(layout=LAYOUT)(
        ids, out, weight=weight, scales=scales, vocab_start=100, head_start=head_start, max_programs=programs
    )
    want = engram_lookup_reference(ids, weight, scales, vocab_start=100, head_start=head_start, local_heads=4)
    assert got is out and torch.equal(got, want) and (want == 0).all(-1).any() and not (want == 0).all()


def test_lookup_sorted_rows_land_in_place() -> None:
    """The SORTED path (vLLM's large lookups of small-page host tables) writes the unsorted result."""
    weight, scales = _table(40, 64, 2)
    ids = torch.randint(90, 140, (7, 6), generator=_gen(3), dtype=I32)
    local = ids[:, 2:6] - 100
    local = torch.where((local >= 0) & (local < 40), local, -1)
    rows, dst = local.flatten().sort()
    out = torch.empty(7, 4, 64, dtype=BF16)
    EngramLookup(layout=LAYOUT)(
        rows.int(),
        out,
        weight=weight,
        scales=scales,
        vocab_start=100,
        head_start=2,
        sorted_dst=dst.int(),
        total_heads=6,
    )
    assert torch.equal(out, engram_lookup_reference(ids, weight, scales, vocab_start=100, head_start=2, local_heads=4))


def test_lookup_errors() -> None:
    kernel, (weight, scales) = EngramLookup(layout=LAYOUT), _table(8, 64, 4)
    ids, out = torch.zeros(2, 6, dtype=I32), torch.empty(2, 4, 64, dtype=BF16)
    table = dict(weight=weight, scales=scales, vocab_start=0, head_start=0)
    with pytest.raises(warmreg.LaunchError, match="weight"):
        kernel(ids, out, **{**table, "weight": weight.float()})
    with pytest.raises(warmreg.LaunchError, match="scales"):
        kernel(ids, out, **{**table, "scales": scales[:, :1]})
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        kernel(ids, out.float(), **table)
    with pytest.raises(warmreg.LaunchError, match="indices"):
        kernel(ids.long(), out, **table)
    with pytest.raises(warmreg.LaunchError, match="sorted_dst"):
        kernel(ids.flatten()[:8], out, **table, sorted_dst=torch.zeros(3, dtype=I32))


# -- the gate --------------------------------------------------------------------------------------------------------
def test_gate_by_hand() -> None:
    """``x`` and the key equal to ``1`` everywhere, weights 1: ``dot = D * 1 * 1 / sqrt(D) = sqrt(D)``, so the gate is
    ``sigmoid(D^(1/4))``; a masked token and a token past ``num_kv_tokens`` pass through unchanged."""
    c, d = 2, 16
    hidden = torch.ones(3, c, d, dtype=BF16)
    kv = torch.ones(3, (c + 1) * d, dtype=BF16)
    kv[:, c * d :] = 2.0
    ones = torch.ones(c, d, dtype=BF16)
    got = EngramGate(hidden_size=d, hc_mult=c, dtype="bfloat16")(
        hidden, kv, torch.tensor([True, False, True]), 2, q_weight=ones, k_weight=ones, eps=1e-6
    )
    gate = torch.sigmoid(torch.tensor(d**0.25))
    torch.testing.assert_close(got[0].float(), torch.full((c, d), 1 + 2 * gate.item()), atol=0.0, rtol=2**-7)
    assert torch.equal(got[1], hidden[1]) and torch.equal(got[2], hidden[2])


@pytest.mark.parametrize(("t", "kv_tokens", "d"), [(5, 5, 48), (4, 2, 40), (0, 0, 16)])
def test_gate_matches_reference(t: int, kv_tokens: int, d: int) -> None:
    """A regular step, a sequence-parallel-like shard (fewer kv rows; non-power-of-two D), an empty step; views with
    offsets and a transposed weight. Tolerance: one bf16 rounding (the interpreter truncates fp32 -> bf16)."""
    c = 4
    hidden = torch.randn(t, c, d + 8, generator=_gen(t)).to(BF16)[:, :, 8:]
    kv = torch.randn(max(kv_tokens, 1), (c + 1) * d, generator=_gen(t + 1)).to(BF16)
    q = torch.randn(d, c, generator=_gen(2)).to(BF16).t()
    k = torch.randn(c, d, generator=_gen(3)).to(BF16)
    mask = torch.rand(max(kv_tokens, 1), generator=_gen(4)) < 0.7
    call = dict(q_weight=q, k_weight=k, eps=1e-6)
    got = EngramGate(hidden_size=d, hc_mult=c, dtype="bfloat16")(hidden, kv, mask, kv_tokens, **call)
    want = engram_gate_reference(hidden, kv, mask, kv_tokens, **call)
    torch.testing.assert_close(got.float(), want.float(), atol=2**-6, rtol=2**-7)


def test_gate_errors_and_out() -> None:
    kernel, c, d = _small_gate(), 2, 16
    hidden, kv, w = (
        torch.zeros(3, c, d, dtype=BF16),
        torch.zeros(3, (c + 1) * d, dtype=BF16),
        torch.zeros(c, d, dtype=BF16),
    )
    with pytest.raises(warmreg.LaunchError, match="kv must be"):
        kernel(hidden, kv[:, :-1], q_weight=w, k_weight=w, eps=1e-6)
    with pytest.raises(warmreg.LaunchError, match="token_mask"):
        kernel(hidden, kv, torch.zeros(3, dtype=I32), q_weight=w, k_weight=w, eps=1e-6)
    with pytest.raises(warmreg.LaunchError, match="k_weight"):
        kernel(hidden, kv, q_weight=w, k_weight=w.float(), eps=1e-6)
    check_out(
        lambda: OpCall(_small_gate(), (hidden, kv, torch.ones(3, dtype=torch.bool)), dict(q_weight=w, k_weight=w, eps=1e-6))
    )


# -- the plan --------------------------------------------------------------------------------------------------------
def test_model_reads_the_engram_fields() -> None:
    m = DSV4.from_config(warmreg.WarmConfig.load(EXAMPLES / "deepseek_v41.json"))
    assert m.engram == EngramLayout(layer_ids=(1, 14), max_ngram_size=4, n_heads=8, head_dim=256)
    assert m.engram.n_hash_cols == 24 and m.engram.local_heads(8) == 3 and m.engram.local_heads(5) == 5
    config = example_config("deepseek_v41")
    config["model"]["text_config"]["engram_head_dim"] = 48
    with pytest.raises(warmreg.ConfigError, match="engram_head_dim"):
        DSV4.from_config(warmreg.WarmConfig.load(config))


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_plans_one_key_each(target: str) -> None:
    """Flash (two engram layers, TP 8) plans one key a kernel on both targets: no rank's head range, size or
    stride is in a key; the gate's keys are hidden 5120 (tile 8192, 8 warps), 4 streams, the mask on."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    kernels = {k.name: k for k in plan.kernels if k.name in NAMES}
    assert set(kernels) == NAMES and all(len(k.keys) == 1 for k in kernels.values())
    (gate,) = kernels["deepseek_v4.v41_engram_gate"].keys
    assert (gate.dim, gate.block, gate.hc_mult, gate.has_mask, gate.num_warps) == (5120, 8192, 4, True, 8)
    (hash_key,) = kernels["deepseek_v4.v41_engram_hash"].keys
    assert (hash_key.max_ngram, hash_key.block_h, hash_key.ids_dtype) == (4, 8, "int32")
    for kernel in kernels.values():
        op = kernel.kernel
        assert_warmup_inputs_reproduce(op, list(kernel.keys))


def test_nothing_without_engram_layers() -> None:
    """Neither on CUDA nor on ROCm (where ``v41_rocm_shared`` registers the three: ``test_v41_rocm_shared.py``)."""
    config = example_config("deepseek_v41")
    del config["model"]["text_config"]["engram_layer_ids"]
    assert not NAMES & {k.name for k in warmreg.plan(config, target="cuda:100").kernels}
    config["serving"]["attention_backend"] = "ROCM_FLASHMLA_SPARSE_DSV41"
    config["serving"]["tensor_parallel_size"] = 1
    assert not NAMES & {k.name for k in warmreg.plan(config, target="rocm:gfx942").kernels}
