"""The KDA recurrent step against its PyTorch reference, under Triton's interpreter (CPU tensors).

Shapes are tiny on purpose: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from warmreg_kimi_k3.kda import KDARecurrent, KDARecurrentKey, kda_gate_reference, kda_recurrent_reference

import warmreg

# o is cast to the activation dtype once, from fp32 sums whose order differs between the kernel and
# the reference: at most one rounding step apart (bf16 has 8 mantissa bits, so rtol 2**-6 is one ulp).
# fp32 activations and the fp32 state differ only by that summation order over K terms per token, and by
# exp/log/sigmoid of the gate and beta (numpy in the interpreter, torch in the reference: an ulp or two in
# fp32). The raw gate and beta are read from the same bf16 values by both and converted to fp32 exactly,
# so their dtype adds no error of its own: the tolerances are per dtype of q/k/v/o.
TOLERANCES = {
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}
STATE_TOL = {"atol": 1e-5, "rtol": 1e-5}
#: The per-token inputs of a batch (sliced by token); the rest are per-layer parameters.
TOKEN_INPUTS = ("q", "k", "v", "raw_g", "raw_beta")


def _batch(
    lens: list[int],
    *,
    heads: int,
    k_dim: int,
    v_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    fused: bool = False,
    dt_bias: bool = True,
    lower_bound: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A varlen decode batch: q, k, v (separate, or views of one fused projection), the raw gate and beta
    (in the activation dtype, as the model's projections), A_log, dt_bias, the lower bound, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    if fused:  # [T, H*(2K+V)] split into views, as an engine with one fused qkv projection does
        proj = torch.randn(tokens, heads * (2 * k_dim + v_dim), generator=gen).to(dtype)
        q = proj[:, : heads * k_dim].view(tokens, heads, k_dim)
        k = proj[:, heads * k_dim : 2 * heads * k_dim].view(tokens, heads, k_dim)
        v = proj[:, 2 * heads * k_dim :].view(tokens, heads, v_dim)
    else:
        q = torch.randn(tokens, heads, k_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, heads, k_dim, generator=gen).to(dtype)
        v = torch.randn(tokens, heads, v_dim, generator=gen).to(dtype)
    # raw gate around -1 and exp(A_log) in [0.5, 2): decays exp(g) mostly in (0.1, 1), neither all 1 nor all 0
    raw_g = (torch.randn(tokens, heads, k_dim, generator=gen) - 1.0).to(dtype)
    raw_beta = (2 * torch.randn(tokens, heads, generator=gen)).to(dtype)
    a_log = torch.log(0.5 + 1.5 * torch.rand(heads, generator=gen))
    bias = 0.5 * torch.randn(heads * k_dim, generator=gen) if dt_bias else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": q, "k": k, "v": v, "raw_g": raw_g, "raw_beta": raw_beta, "A_log": a_log, "dt_bias": bias,
        "lower_bound": lower_bound, "cu_seqlens": cu,
    }  # fmt: skip


def _pool(slots: int, heads: int, k_dim: int, v_dim: int, seed: int = 1) -> torch.Tensor:
    return 0.1 * torch.randn(slots, heads, k_dim, v_dim, generator=torch.Generator().manual_seed(seed))


def _run(kernel: KDARecurrent, batch: dict[str, Any], pool: torch.Tensor, slots: list[int], **kw: object) -> None:
    """Launch the kernel and the reference; compare o, and the pool (written back in place)."""
    state_slots = torch.tensor(slots, dtype=torch.int32)
    expected_o, expected_pool = kda_recurrent_reference(**batch, state_pool=pool, state_slots=state_slots, **kw)
    written = torch.empty_strided(pool.shape, pool.stride(), dtype=pool.dtype).copy_(pool)  # same layout
    out = kernel(**batch, state_pool=written, state_slots=state_slots, **kw)
    assert out.shape == batch["v"].shape and out.dtype == batch["v"].dtype
    torch.testing.assert_close(out, expected_o, **TOLERANCES[batch["v"].dtype])
    torch.testing.assert_close(written, expected_pool, **STATE_TOL)
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(written[untouched], pool[untouched]), "slots not in the batch must not be written"


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dt_bias", [True, False])
def test_matches_reference(dt_bias: bool, lower_bound: float | None) -> None:
    """Sequences of 1, 3 and 2 tokens, a negative slot (no state), V split over two tiles; the softplus gate
    and the lower-bounded one, with and without dt_bias."""
    heads, k_dim, v_dim = 2, 16, 64  # V = 64: two BLOCK_V = 32 tiles per head
    batch = _batch([1, 3, 2, 1], heads=heads, k_dim=k_dim, v_dim=v_dim, dt_bias=dt_bias, lower_bound=lower_bound)
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    _run(kernel, batch, _pool(5, heads, k_dim, v_dim), [3, -1, 0, 2])


def test_matches_reference_without_l2norm() -> None:
    heads, k_dim, v_dim = 2, 16, 32
    batch = _batch([2, 3], heads=heads, k_dim=k_dim, v_dim=v_dim, seed=5)
    # keep |k| near 1 so the delta rule stays bounded, as the L2 norm would
    batch["k"] = (batch["k"].float() * k_dim**-0.5).to(batch["k"].dtype)
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    _run(kernel, batch, _pool(3, heads, k_dim, v_dim), [1, 2], use_qk_l2norm=False)


def test_awkward_shapes_fused_views_fp32() -> None:
    """Non-power-of-two K and V (masked tiles), q/k/v as strided offset views of one projection,
    a non-power-of-two token count (3 + 3), an explicit scale, fp32 activations and raw gate/beta, a padded
    pool slot stride, raw gates past softplus's threshold."""
    heads, k_dim, v_dim = 3, 24, 20
    batch = _batch([2, 1, 3], heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=torch.float32, fused=True, seed=2)
    batch["raw_g"][0, 0, :3] = 25.0  # softplus past its threshold of 20: x itself
    storage = _pool(4, heads, k_dim + 1, v_dim).flatten(1)  # each slot padded by V floats
    pool = storage[:, : heads * k_dim * v_dim].unflatten(1, (heads, k_dim, v_dim))
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim, dtype="float32")
    params = kernel.dispatch_params()
    key = kernel.dispatch(**{p: batch[p] for p in params if p in batch}, state_pool=pool, use_qk_l2norm=True)
    assert (key.q_stride, key.k_aligned, key.state_stride) == ("other", True, "other")  # 3*(2*24+20), 3*25*20
    assert (key.gate_dtype, key.beta_dtype, key.has_dt_bias, key.use_lower_bound) == ("float32", "float32", True, False)
    _run(kernel, batch, pool, [-1, 1, 3], scale=0.3)


def test_decode_one_token_per_sequence() -> None:
    """Plain decode: every sequence has one token; a fresh request (slot -1) writes nothing."""
    heads, k_dim, v_dim = 2, 16, 16
    batch = _batch([1, 1, 1], heads=heads, k_dim=k_dim, v_dim=v_dim, seed=3)
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    _run(kernel, batch, _pool(3, heads, k_dim, v_dim), [2, 0, -1])


def test_state_carries_over_steps() -> None:
    """Two decode steps through the pool equal one step over both tokens (the write-back is the state)."""
    heads, k_dim, v_dim = 1, 16, 16
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    both = _batch([2], heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=torch.float32, lower_bound=-5.0, seed=4)
    pool, slots = _pool(1, heads, k_dim, v_dim), torch.tensor([0], dtype=torch.int32)
    one_cu = torch.tensor([0, 1], dtype=torch.int32)
    stepped = pool.clone()
    outs = []
    for t in range(2):
        step = {**both, **{name: both[name][t : t + 1] for name in TOKEN_INPUTS}, "cu_seqlens": one_cu}
        outs.append(kernel(**step, state_pool=stepped, state_slots=slots))
    whole = pool.clone()
    out = kernel(**both, state_pool=whole, state_slots=slots)
    torch.testing.assert_close(torch.cat(outs), out, **TOLERANCES[torch.float32])
    torch.testing.assert_close(stepped, whole, **STATE_TOL)


def test_empty_batch_launches_nothing() -> None:
    heads, k_dim, v_dim = 2, 16, 16
    batch = _batch([], heads=heads, k_dim=k_dim, v_dim=v_dim)
    pool = _pool(2, heads, k_dim, v_dim)
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    out = kernel(**batch, state_pool=pool, state_slots=torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, heads, v_dim)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state_pool": torch.zeros(2, 2, 16, 16, dtype=torch.bfloat16)}, "must be float32"),
        ({"state_pool": torch.zeros(2, 3, 16, 16)}, "must be \\[num_slots, H, K, V\\]"),
        ({"q": torch.zeros(3, 16, 2).transpose(1, 2)}, "contiguous heads"),
        ({"cu_seqlens": torch.tensor([0, 1, 3], dtype=torch.int64)}, "cu_seqlens must be int32"),
        ({"state_slots": torch.zeros(3, dtype=torch.int32)}, "state_slots must be int32 \\[N\\]"),
        ({"raw_beta": torch.zeros(3, 2, 1)}, "raw_beta"),
        ({"A_log": torch.zeros(2, dtype=torch.bfloat16)}, "A_log must be float32"),
        ({"dt_bias": torch.zeros(2)}, "dt_bias must be float32 with 32 contiguous elements"),
        ({"lower_bound": 0.5}, "lower_bound must be < 0"),
    ],
)
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    heads, k_dim, v_dim = 2, 16, 16
    args: dict[str, Any] = {
        **_batch([1, 2], heads=heads, k_dim=k_dim, v_dim=v_dim),
        "state_pool": _pool(2, heads, k_dim, v_dim),
        "state_slots": torch.tensor([0, 1], dtype=torch.int32),
    }
    if "q" in change:
        change = {**change, "q": change["q"].bfloat16()}
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    with pytest.raises(warmreg.LaunchError, match=message):
        kernel(**{**args, **change})


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"use_qk_l2norm": False, "num_warps": 1, "head_k_dim": 24, "block_k": 32, "head_v_dim": 20, "block_v": 32},
        {"q_stride": "other", "k_aligned": False, "v_stride": "one", "g_aligned": False, "has_dt_bias": False},
        {"state_stride": "other", "state_aligned": False, "dtype": "float16", "beta_dtype": "float32"},
        {"use_lower_bound": True, "gate_dtype": "float32", "has_dt_bias": False},
    ],
)
def test_warmup_inputs_reproduce_the_key(changes: dict[str, object]) -> None:
    """warm re-runs the launch code on warmup_inputs(key); dispatch must give the same key back."""
    import attrs

    base = KDARecurrentKey(
        dtype="bfloat16", gate_dtype="bfloat16", beta_dtype="bfloat16", num_heads=12, head_k_dim=128,
        head_v_dim=128, block_k=128, block_v=32, use_qk_l2norm=True, has_dt_bias=True, use_lower_bound=False,
        q_stride="div16", k_stride="div16",
        v_stride="div16", q_aligned=True, k_aligned=True, v_aligned=True, g_aligned=True,
        state_stride="div16", state_aligned=True, num_warps=4,
    )  # fmt: skip
    key = attrs.evolve(base, **changes)
    kernel = KDARecurrent(num_heads=1, head_k_dim=1, head_v_dim=1)  # any instance serves any key
    inputs = kernel.warmup_inputs(key)
    params = kernel.dispatch_params()
    assert kernel.dispatch(**{p: inputs[p] for p in params}) == key


def test_lower_bound_value_is_not_in_the_key() -> None:
    """The bound is a runtime float (vLLM passes it as a kernel argument); only whether it is set is a constexpr."""
    heads, k_dim, v_dim = 2, 16, 16
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    pool = _pool(2, heads, k_dim, v_dim)
    keys = []
    for lb in (None, -5.0, -1.0):
        batch = _batch([1, 2], heads=heads, k_dim=k_dim, v_dim=v_dim, lower_bound=lb)
        params = kernel.dispatch_params()
        keys.append(kernel.dispatch(**{p: batch[p] for p in params if p in batch}, state_pool=pool, use_qk_l2norm=True))
    assert keys[1] == keys[2] != keys[0]


def _softplus(x: float) -> float:
    return x if x > 20 else math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("lower_bound", [None, -5.0, -2.5])
@pytest.mark.parametrize("dt_bias", [True, False])
def test_gate_reference_is_the_formula(dt_bias: bool, lower_bound: float | None) -> None:
    """The reference's gate, against the formula evaluated independently one value at a time in float64:
    lb * sigmoid(exp(A_log[h]) * (x + dt_bias[h * K + c])), or -exp(A_log[h]) * softplus(x + dt_bias[...])
    with softplus(y) = y above 20 (a wrong activation, bias index or head of A_log fails)."""
    raw = [[[-3.0, 0.0, 1.5], [0.25, 21.0, -30.0]]]  # [T=1, H=2, K=3]; 21 and 19.5 + 1.5 straddle the threshold
    a_log = [math.log(0.7), math.log(3.0)]
    bias = [0.1, -0.2, 18.0, 0.5, -1.0, 2.0] if dt_bias else [0.0] * 6
    g = kda_gate_reference(
        torch.tensor(raw),
        torch.tensor(a_log).view(1, 1, 2, 1),  # the model's A_log shape
        torch.tensor(bias) if dt_bias else None,
        lower_bound,
    )
    assert g.dtype == torch.float32 and g.shape == (1, 2, 3)
    for h in range(2):
        for c in range(3):
            a, x = math.exp(a_log[h]), raw[0][h][c] + bias[h * 3 + c]
            want = lower_bound * _sigmoid(a * x) if lower_bound is not None else -a * _softplus(x)
            assert g[0, h, c].item() == pytest.approx(want, rel=1e-6, abs=1e-7), (h, c)
