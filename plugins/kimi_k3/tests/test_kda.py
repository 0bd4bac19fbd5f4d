"""The KDA recurrent step against its PyTorch reference, under Triton's interpreter (CPU tensors).

Shapes are tiny on purpose: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import pytest
import torch
from warmreg_kimi_k3.kda import KDARecurrent, KDARecurrentKey, kda_recurrent_reference

import warmreg

# o is cast to the activation dtype once, from fp32 sums whose order differs between the kernel and
# the reference: at most one rounding step apart (bf16 has 8 mantissa bits, so rtol 2**-6 is one ulp).
# fp32 activations and the fp32 state differ only by that summation order over K terms per token.
TOLERANCES = {
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}
STATE_TOL = {"atol": 1e-5, "rtol": 1e-5}


def _batch(
    lens: list[int],
    *,
    heads: int,
    k_dim: int,
    v_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    fused: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A varlen decode batch: q, k, v (separate, or views of one fused projection), g, beta, cu_seqlens."""
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
    g = -0.5 * torch.rand(tokens, heads, k_dim, generator=gen)  # log-space decay: exp(g) in (0.6, 1]
    beta = torch.rand(tokens, heads, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu}


def _pool(slots: int, heads: int, k_dim: int, v_dim: int, seed: int = 1) -> torch.Tensor:
    return 0.1 * torch.randn(slots, heads, k_dim, v_dim, generator=torch.Generator().manual_seed(seed))


def _run(
    kernel: KDARecurrent, batch: dict[str, torch.Tensor], pool: torch.Tensor, slots: list[int], **kw: object
) -> None:
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


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_matches_reference(use_qk_l2norm: bool) -> None:
    """Sequences of 1..4 tokens, a negative slot (no state), V split over two tiles."""
    heads, k_dim, v_dim = 2, 16, 64  # V = 64: two BLOCK_V = 32 tiles per head
    batch = _batch([1, 3, 4, 2], heads=heads, k_dim=k_dim, v_dim=v_dim)
    if not use_qk_l2norm:  # keep |k| near 1 so the delta rule stays bounded, as the L2 norm would
        batch["k"] = (batch["k"].float() * k_dim**-0.5).to(batch["k"].dtype)
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim)
    _run(kernel, batch, _pool(5, heads, k_dim, v_dim), [3, -1, 0, 2], use_qk_l2norm=use_qk_l2norm)


def test_awkward_shapes_fused_views_fp32() -> None:
    """Non-power-of-two K and V (masked tiles), q/k/v as strided offset views of one projection,
    a non-power-of-two token count (7), an explicit scale, fp32 activations, a padded pool slot stride."""
    heads, k_dim, v_dim = 3, 24, 20
    batch = _batch([2, 1, 4], heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=torch.float32, fused=True, seed=2)
    storage = _pool(4, heads, k_dim + 1, v_dim).flatten(1)  # each slot padded by V floats
    pool = storage[:, : heads * k_dim * v_dim].unflatten(1, (heads, k_dim, v_dim))
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim, dtype="float32")
    key = kernel.dispatch(**{n: batch[n] for n in ("q", "k", "v", "g", "beta")}, state_pool=pool, use_qk_l2norm=True)
    assert (key.q_stride, key.k_aligned, key.state_stride) == ("other", True, "other")  # 3*(2*24+20), 3*25*20
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
    both = _batch([2], heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=torch.float32, seed=4)
    pool, slots = _pool(1, heads, k_dim, v_dim), torch.tensor([0], dtype=torch.int32)
    one_cu = torch.tensor([0, 1], dtype=torch.int32)
    stepped = pool.clone()
    outs = []
    for t in range(2):
        step = {name: x[t : t + 1] for name, x in both.items() if name != "cu_seqlens"}
        outs.append(kernel(**step, cu_seqlens=one_cu, state_pool=stepped, state_slots=slots))
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
        ({"beta": torch.zeros(3, 2, 1)}, "beta"),
    ],
)
def test_launch_errors(change: dict[str, torch.Tensor], message: str) -> None:
    heads, k_dim, v_dim = 2, 16, 16
    args: dict[str, torch.Tensor] = {
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
        {"q_stride": "other", "k_aligned": False, "v_stride": "one", "g_aligned": False},
        {"state_stride": "other", "state_aligned": False, "dtype": "float16", "beta_dtype": "bfloat16"},
    ],
)
def test_warmup_inputs_reproduce_the_key(changes: dict[str, object]) -> None:
    """warm re-runs the launch code on warmup_inputs(key); dispatch must give the same key back."""
    import attrs

    base = KDARecurrentKey(
        dtype="bfloat16", gate_dtype="float32", beta_dtype="float32", num_heads=12, head_k_dim=128,
        head_v_dim=128, block_k=128, block_v=32, use_qk_l2norm=True, q_stride="div16", k_stride="div16",
        v_stride="div16", q_aligned=True, k_aligned=True, v_aligned=True, g_aligned=True,
        state_stride="div16", state_aligned=True, num_warps=4,
    )  # fmt: skip
    key = attrs.evolve(base, **changes)
    kernel = KDARecurrent(num_heads=1, head_k_dim=1, head_v_dim=1)  # any instance serves any key
    inputs = kernel.warmup_inputs(key)
    params = kernel.dispatch_params()
    assert kernel.dispatch(**{p: inputs[p] for p in params}) == key
