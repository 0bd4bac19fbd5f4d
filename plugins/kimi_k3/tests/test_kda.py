"""The KDA recurrent step in vLLM's convention against its PyTorch reference, under Triton's interpreter (CPU
tensors), and its planned keys.

Shapes are tiny on purpose: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import torch
from warmreg_kimi_k3.kda import (
    VLLM_TILES,
    KDARecurrent,
    KDARecurrentKey,
    kda_gate_reference,
    kda_recurrent_reference,
    vllm_tile,
)

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = KDARecurrent.name
# o is cast to the activation dtype once a token, from fp32 sums whose order differs between the kernel and the
# reference: at most one rounding step apart (bf16 has 8 mantissa bits, so rtol 2**-6 is one ulp). fp32
# activations and the fp32 state differ only by that summation order over K terms per token, and by exp/log/sigmoid
# of the gate and beta (numpy in the interpreter, torch in the reference: an ulp or two in fp32). The raw gate and
# beta are read from the same values by both and converted to fp32 exactly: the tolerances are per dtype of o.
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
}
STATE_TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}


def _step(
    lens: list[int],
    *,
    heads: int = 2,
    k_dim: int = 16,
    v_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    row: int | None = None,
    gate_first: int = 0,
    dt_bias: bool = True,
    lower_bound: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One step's inputs as vLLM's layer passes them: q, k, v ``[1, T, H, D]`` column slices of the conv update's
    output (rows ``row`` apart, default ``H(2K + V)``), the raw gate ``[1, T, H, K]`` (rows of the gate projection
    from row ``gate_first``), the raw beta a column block of a wider projection, A_log, dt_bias, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    t, h = sum(lens), heads
    width = h * (2 * k_dim + v_dim)
    conv = torch.randn(t, row or width, generator=gen).to(dtype)
    cols = ((0, k_dim), (h * k_dim, k_dim), (2 * h * k_dim, v_dim))
    q, k, v = (conv[:, c : c + h * w].view(1, t, h, w) for c, w in cols)
    # raw gate around -1 and exp(A_log) in [0.5, 2): decays exp(g) mostly in (0.1, 1), neither all 1 nor all 0
    raw_g = (torch.randn(1, gate_first + t, h, k_dim, generator=gen) - 1.0).to(dtype)[:, gate_first:]
    proj = (2 * torch.randn(t, width + h + 3, generator=gen)).to(dtype)
    return {
        "q": q, "k": k, "v": v, "raw_g": raw_g, "raw_beta": proj[:, width + 3 :].unsqueeze(0),
        "A_log": torch.log(0.5 + 1.5 * torch.rand(h, generator=gen)),
        "dt_bias": 0.5 * torch.randn(h * k_dim, generator=gen) if dt_bias else None, "lower_bound": lower_bound,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32),
    }  # fmt: skip


def _pool(slots: int, heads: int = 2, k_dim: int = 16, v_dim: int = 16, *, pad: int = 0, seed: int = 1) -> torch.Tensor:
    """The recurrent pool ``[slots, H, V, K]`` fp32; ``pad`` extra floats per slot (a KV page's stride)."""
    storage = 0.1 * torch.randn(slots, heads * v_dim * k_dim + pad, generator=torch.Generator().manual_seed(seed))
    return storage[:, pad:].unflatten(1, (heads, v_dim, k_dim))


def _same_layout(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` with its strides and storage offset (so its alignment too)."""
    flat = torch.empty(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype)
    return flat.as_strided(x.shape, x.stride(), x.storage_offset()).copy_(x)


def _i32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _run(
    kernel: KDARecurrent,
    step: dict[str, Any],
    pool: torch.Tensor,
    indices: torch.Tensor,
    accepted: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the op and the reference on the same inputs; compare o (null-slot sequences: exact zeros), the whole
    pool (slots nobody writes, slot 0 included: untouched bytes); returns o."""
    want_o, want_pool = kda_recurrent_reference(**step, initial_state=pool, ssm_state_indices=indices,
                                                num_accepted_tokens=accepted)  # fmt: skip
    written = _same_layout(pool)
    got = kernel(**step, initial_state=written, ssm_state_indices=indices, num_accepted_tokens=accepted, out=out,
                 launch_pdl=False)  # fmt: skip
    v = step["v"]
    assert got.shape == v.shape and got.dtype == v.dtype and (out is None or got is out)
    torch.testing.assert_close(got, want_o, **TOLERANCES[v.dtype])
    rows = (indices if indices.ndim == 2 else indices[:, None]).tolist()
    firsts = [row[a - 1] for row, a in zip(rows, [1] * len(rows) if accepted is None else accepted.tolist())]
    bounds = step["cu_seqlens"].tolist()
    for n, first in enumerate(firsts):
        if first <= 0:  # every token's row exactly zero (vLLM zeroes only the first: a deliberate superset)
            assert torch.equal(got[0, bounds[n] : bounds[n + 1]], torch.zeros_like(got[0, bounds[n] : bounds[n + 1]]))
    torch.testing.assert_close(written, want_pool, **STATE_TOL)
    live = {s for row, f in zip(rows, firsts) if f > 0 for s in row if s > 0}
    untouched = [s for s in range(pool.shape[0]) if s not in live]
    assert torch.equal(written[untouched], pool[untouched]), "slots no live token writes must keep their bytes"
    return got


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dt_bias", [True, False])
def test_spec_decode_matches_reference(dt_bias: bool, lower_bound: float | None) -> None:
    """A speculative step: 4 sequences of 4, 2, 1 and 3 tokens, ``[N, 4]`` indices with accepted counts 2, 1, 1, 4
    (initial state at column accepted - 1), a null first slot (sequence 1: zeros, nothing read or written), zero
    write columns (no write for that token), V over four BV = 4 tiles; softplus and bounded gates, dt_bias or not."""
    step = _step([4, 2, 1, 3], dt_bias=dt_bias, lower_bound=lower_bound)
    indices = _i32([[1, 2, 3, 4], [0, 5, 6, 7], [8, 9, 0, 0], [10, 0, 11, 12]])
    _run(KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16), step, _pool(14), indices, _i32([2, 1, 1, 4]))


def test_plain_decode_with_1d_indices() -> None:
    """One token a sequence with ``[N]`` indices (``T == N``, no accepted counts): a live slot, the null slot 0 and
    a padded -1 (zeros out, no state read or written; slot 0 keeps its bytes)."""
    step = _step([1, 1, 1, 1], seed=3)
    _run(KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16), step, _pool(6), _i32([3, 0, 5, -1]))


def test_awkward_shapes_and_layouts() -> None:
    """Non-power-of-two K = 24 (one 32-wide tile, masked) and V = 20 (five BV = 4 tiles), three heads, fp32
    activations; q/k/v rows of a wider projection, gate rows from a later token, beta a column of a projection,
    a padded KV page as the slot stride at a 4-byte offset, the indices a view of a wider block table, ``out=``
    given (garbage first), raw gates past softplus's threshold, 2-D indices without accepted counts (column 0)."""
    heads, k_dim, v_dim = 3, 24, 20
    step = _step([2, 3, 1], heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=torch.float32, row=heads * 68 + 5,
                 gate_first=2, seed=2)  # fmt: skip
    step["raw_g"][0, 0, 0, :3] = 25.0  # softplus past its threshold of 20: x itself
    pool = _pool(9, heads, k_dim, v_dim, pad=1)
    table = _i32([[4, 5, 1, 0, 77], [2, 0, 8, 0, 77], [0, 3, 6, 0, 77]])[:, :3]
    kernel = KDARecurrent(num_heads=heads, head_k_dim=k_dim, head_v_dim=v_dim, dtype="float32")
    key = kernel.dispatch(**{p: step[p] for p in ("q", "k", "v", "raw_g", "raw_beta", "dt_bias", "lower_bound",
                          "cu_seqlens")}, initial_state=pool, num_accepted_tokens=None, launch_pdl=False)  # fmt: skip
    assert (key.qkv_stride, key.g_stride, key.g_aligned, key.has_dt_bias, key.use_lower_bound) == (
        "other", "other", True, True, False)  # fmt: skip
    assert (key.state_stride, key.state_aligned, key.block_k, key.block_v, key.is_spec_decoding) == (
        "other", False, 32, 4, False)  # fmt: skip
    out = torch.full((1, 6, heads, v_dim), float("nan"))
    _run(kernel, step, pool, table, out=out)


def test_token_states_are_written_per_column() -> None:
    """Each token's state lands in its own column's slot: a 3-token speculative step equals three one-token steps
    chained through the pool (1-D indices), slot by slot and row by row."""
    kernel = KDARecurrent(num_heads=1, head_k_dim=16, head_v_dim=16)
    step = _step([3], heads=1, dtype=torch.float32, lower_bound=-5.0, seed=4)
    pool = _pool(5, 1)
    spec = pool.clone()
    o = kernel(**step, initial_state=spec, ssm_state_indices=_i32([[2, 3, 4]]), num_accepted_tokens=_i32([1]))
    chained, slots, rows = pool.clone(), [2, 3, 4], []
    for t in range(3):
        one = {**step, **{n: step[n][:, t : t + 1] for n in ("q", "k", "v", "raw_g", "raw_beta")},
               "cu_seqlens": _i32([0, 1])}  # fmt: skip
        if t:
            chained[slots[t]] = chained[slots[t - 1]]  # the next step starts where the last one wrote
        rows.append(kernel(**one, initial_state=chained, ssm_state_indices=_i32([slots[t]])))
    torch.testing.assert_close(o, torch.cat(rows, dim=1), **TOLERANCES[torch.float32])
    torch.testing.assert_close(spec, chained, **STATE_TOL)


@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_the_initial_state_is_read_at_the_accepted_column(accepted: int) -> None:
    """``num_accepted_tokens[n] = a`` reads the state of column ``a - 1``: the same as starting from that slot in
    column 0 (its other columns' states are never read)."""
    kernel = KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16)
    step = _step([2], dtype=torch.float32, seed=5)
    pool = _pool(6)
    columns = [1, 2, 3]
    spec = pool.clone()
    o = kernel(**step, initial_state=spec, ssm_state_indices=_i32([columns]), num_accepted_tokens=_i32([accepted]))
    direct = pool.clone()
    again = kernel(**step, initial_state=direct, ssm_state_indices=_i32([[columns[accepted - 1], 4, 5]]))
    assert torch.equal(o, again)


def test_null_slot_sequences_write_zeros_only() -> None:
    """A sequence whose initial slot is 0 (vLLM's null block) writes zero rows for all its tokens into a garbage
    ``out`` and no state, even where its other columns name live slots; a zero-length sequence writes nothing."""
    kernel = KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16)
    step = _step([3, 0, 1], seed=6)
    pool = _pool(8)
    written = pool.clone()
    out = torch.full((1, 4, 2, 16), float("nan"), dtype=torch.bfloat16)
    kernel(**step, initial_state=written, ssm_state_indices=_i32([[0, 5, 6], [1, 2, 3], [0, 7, 0]]),
           num_accepted_tokens=_i32([1, 1, 1]), out=out)  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(written, pool)


def test_empty_batch_launches_nothing() -> None:
    step = _step([])
    out = KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16)(
        **step, initial_state=_pool(2), ssm_state_indices=torch.empty(0, 4, dtype=torch.int32),
        num_accepted_tokens=torch.empty(0, dtype=torch.int32),
    )  # fmt: skip
    assert out.shape == (1, 0, 2, 16)


def test_vllm_tiles_by_head_sequences() -> None:
    """BV and num_stages follow vLLM's buckets of ``H * N`` (one warp); a launch in each bucket matches the
    reference (H = 16: N = 3, 6, 12 and 13 give 48, 96, 192 and 208 head-sequences)."""
    assert [vllm_tile(x) for x in (0, 1, 48, 49, 96, 97, 192, 193, 10**6)] == [
        (4, 4), (4, 4), (4, 4), (8, 3), (8, 3), (16, 3), (16, 3), (8, 3), (8, 3)]  # fmt: skip
    kernel = KDARecurrent(num_heads=16, head_k_dim=8, head_v_dim=16)
    for n, tile in ((3, (4, 4)), (6, (8, 3)), (12, (16, 3)), (13, (8, 3))):
        step = _step([1] * n, heads=16, k_dim=8, v_dim=16, seed=n)
        key = kernel.dispatch(**{p: step[p] for p in ("q", "k", "v", "raw_g", "raw_beta", "dt_bias",
                              "lower_bound", "cu_seqlens")}, initial_state=_pool(1, 16, 8, 16),
                              num_accepted_tokens=None, launch_pdl=False)  # fmt: skip
        assert (key.block_v, key.num_stages, key.num_warps) == (*tile, 1)
        _run(kernel, step, _pool(n + 1, 16, 8, 16), _i32(list(range(1, n + 1))))


def _error_args() -> dict[str, Any]:
    return {**_step([2, 1]), "initial_state": _pool(5), "ssm_state_indices": _i32([[1, 2], [3, 4]]),
            "num_accepted_tokens": _i32([1, 2])}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(3, 2, 16, dtype=torch.bfloat16)}, r"must be \[1, T, H, K\]"),
        ({"k": torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)}, "share one token stride"),
        ({"raw_g": torch.zeros(1, 3, 16, 2, dtype=torch.bfloat16).transpose(2, 3)}, "raw_g"),
        ({"raw_beta": torch.zeros(1, 3, 2, dtype=torch.bfloat16).transpose(1, 2)}, "raw_beta"),
        ({"initial_state": torch.zeros(5, 2, 16, 16).transpose(2, 3)}, r"must be \[slots, H, V, K\]"),
        ({"initial_state": torch.zeros(5, 2, 16, 8)}, r"must be \[slots, H, V, K\]"),
        ({"cu_seqlens": torch.tensor([0, 2, 3])}, "cu_seqlens must be contiguous int32"),
        ({"ssm_state_indices": torch.ones(2, 2, dtype=torch.int64)}, "ssm_state_indices must be int32"),
        ({"ssm_state_indices": _i32([[1, 2], [3, 4]]).t()}, "contiguous columns"),
        ({"ssm_state_indices": _i32([1, 2])}, "1-D ssm_state_indices take one token a sequence"),
        ({"num_accepted_tokens": _i32([1, 1, 1])}, "num_accepted_tokens must be int32 \\[N\\]"),
        ({"A_log": torch.zeros(2, dtype=torch.bfloat16)}, "A_log must be float32"),
        ({"dt_bias": torch.zeros(2)}, "dt_bias must be float32 with 32 contiguous elements"),
        ({"lower_bound": 0.5}, "lower_bound must be < 0"),
        ({"out": torch.zeros(1, 3, 2, 16)}, "out is "),
    ],
)  # fmt: skip
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(warmreg.LaunchError, match=message):
        KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16)(**{**_error_args(), **change}, launch_pdl=False)


def test_lower_bound_value_is_not_in_the_key() -> None:
    """The bound is a runtime float (vLLM passes it as a kernel argument); only whether it is set is a constexpr."""
    kernel = KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=16)
    keys = []
    for lb in (None, -5.0, -1.0):
        args = {**_error_args(), "lower_bound": lb, "launch_pdl": False}
        keys.append(kernel.dispatch(**{p: args[p] for p in kernel.dispatch_params()}))
    assert keys[1] == keys[2] != keys[0]


# -- the plan --------------------------------------------------------------------------------------------------


def _keys(kp: warmreg.KernelPlan) -> list[KDARecurrentKey]:
    return [cast(KDARecurrentKey, k) for k in kp.keys]


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "cuda:100+flashinfer"])
def test_plan_keys(target: str) -> None:
    """The example (12 heads a rank, head dim 128, 3 speculative tokens, bounded gate): vLLM's three launch variants
    (its own warmup's profiles 1, 48 // H + 1, 96 // H + 1), every stride div16 and every pointer aligned. FlashInfer's
    packed kernel takes only steps of speculative rows alone: mixed steps still run this one."""
    keys = _keys(warmreg.plan(example_config("kimi_k3"), target=target).kernel(NAME))
    assert sorted((k.block_v, k.num_stages) for k in keys) == [(4, 4), (8, 3), (16, 3)]
    for key in keys:
        assert (key.num_heads, key.head_k_dim, key.head_v_dim, key.block_k, key.num_warps) == (12, 128, 128, 128, 1)
        assert key.is_spec_decoding and key.has_dt_bias and key.use_lower_bound and key.launch_pdl
        assert (key.qkv_stride, key.g_stride, key.state_stride) == ("div16",) * 3
        assert key.q_aligned and key.k_aligned and key.v_aligned and key.g_aligned and key.state_aligned
        assert (key.dtype, key.gate_dtype, key.beta_dtype, key.state_dtype) == ("bfloat16",) * 3 + ("float32",)


@pytest.mark.parametrize(
    ("target", "serving", "planned"),
    [
        ("cuda:90", {}, True),
        ("cuda:90", {"num_speculative_tokens": 0}, False),  # plain decode: the packed decode or a fused C++ kernel
        ("cuda:80", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, False),
        ("rocm:gfx942", {}, False),  # ROCm's layer runs its own copy of the kernel: not modelled
    ],
)
def test_registration(target: str, serving: dict[str, Any], planned: bool) -> None:
    plan = warmreg.plan(example_config("kimi_k3", **serving), target=target)
    assert (NAME in {k.name for k in plan.kernels}) == planned


def test_every_bucket_of_the_batch_sizes_is_planned() -> None:
    """A smaller deployment (max_num_seqs 2, TP 2: 48 heads a rank: 48 and 96 head-sequences) reaches the first
    two buckets only."""
    kp = warmreg.plan(example_config("kimi_k3", max_num_seqs=2, tensor_parallel_size=2), target="cuda:90").kernel(NAME)
    assert sorted((k.block_v, k.num_stages, k.num_heads) for k in _keys(kp)) == [(4, 4, 48), (8, 3, 48)]


def test_runtime_shapes_are_planned() -> None:
    """vLLM's launches of every batch size 1 .. max_num_seqs (256) and token count N .. 4N: q/k/v from the conv
    update's [T, 3P] output or, for one token, the projection's 6288-wide row or the overlap path's 4P; the gate
    rows from row 0 or a later token; beta a projection column; the pool contiguous or in its KV page (after the
    conv state); indices a block-table view with accepted counts."""
    kp = warmreg.plan(example_config("kimi_k3"), target="cuda:90").kernel(NAME)
    kernel, keys = cast(KDARecurrent, kp.kernel), set(kp.keys)
    h, d, p = 12, 128, 1536
    page = (6 * 3 * p * 2 + h * d * d * 4) // 4
    pools = [warmreg.meta((1000, h, d, d), torch.float32),
             warmreg.meta((1000, h, d, d), torch.float32, stride=(page, d * d, d, 1), offset=6 * 3 * p // 2)]  # fmt: skip
    for n in range(1, 257):
        for t, row in {(n, 3 * p), (4 * n, 3 * p), (n, 6288) if n == 1 else (2 * n + 1, 3 * p), (1, 4 * p)}:
            conv = warmreg.meta((t, row), torch.bfloat16)
            q, k, v = (conv[:, i * p : (i + 1) * p].view(1, t, h, d) for i in range(3))
            for first, pool in ((0, pools[n % 2]), (5, pools[1 - n % 2])):
                key = kernel.dispatch(
                    q=q, k=k, v=v, raw_g=warmreg.meta((1, first + t, h, d), torch.bfloat16)[:, first:],
                    raw_beta=warmreg.meta((t, 6288), torch.bfloat16)[:, 6276:].unsqueeze(0),
                    dt_bias=warmreg.meta((h * d,), torch.float32), lower_bound=-5.0, initial_state=pool,
                    cu_seqlens=warmreg.meta((n + 1,), torch.int32), num_accepted_tokens=warmreg.meta((n,), torch.int32),
                    launch_pdl=True,
                )  # fmt: skip
                assert key in keys, (n, t, row, first, key)


def test_warmup_inputs_reproduce_every_key() -> None:
    """warm re-runs the launch code on warmup_inputs(key): dispatch gives the key back, planned keys and variants."""
    kp = warmreg.plan(example_config("kimi_k3"), target="cuda:90").kernel(NAME)
    extra = [
        attrs.evolve(_keys(kp)[0], is_spec_decoding=False, has_dt_bias=False, use_lower_bound=False, launch_pdl=False),
        attrs.evolve(_keys(kp)[1], qkv_stride="other", g_stride="other", state_stride="other", q_aligned=False,
                     k_aligned=False, v_aligned=False, g_aligned=False, state_aligned=False),
        attrs.evolve(_keys(kp)[2], dtype="float16", gate_dtype="float32", beta_dtype="float32", state_dtype="bfloat16",
                     head_k_dim=24, block_k=32, head_v_dim=20),
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(kp.kernel, [*kp.keys, *extra])


def test_bucket_edges_cover_every_tile() -> None:
    """The domains' sequence counts hit each bucket of VLLM_TILES that 1 .. max_num_seqs reaches."""
    kernel = KDARecurrent(num_heads=12, head_k_dim=128, head_v_dim=128, max_num_seqs=256)
    reached = {vllm_tile(12 * n) for n in range(1, 257)}
    assert {vllm_tile(12 * n) for n in kernel.sequence_counts()} == reached == {t for _, t in VLLM_TILES}


# -- the gate ----------------------------------------------------------------------------------------------------


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


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:  # a speculative step with a null-slot sequence (zero rows for all its tokens)
        step = _step([1, 3, 2], heads=2, k_dim=16, v_dim=32, lower_bound=-5.0)
        indices = torch.tensor([[3, 4, 5], [0, 6, 7], [1, 2, 0]], dtype=torch.int32)
        kwargs = {**step, "initial_state": _pool(8, 2, 16, 32), "ssm_state_indices": indices,
                  "num_accepted_tokens": torch.tensor([1, 1, 2], dtype=torch.int32), "launch_pdl": False}  # fmt: skip
        return OpCall(KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=32), (), kwargs)

    check_out(build)
