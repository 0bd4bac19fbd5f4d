"""The DCP all-to-all combine of the MLA decode (pack, then unpack and combine): the PyTorch references under Triton's
interpreter, the empty-shard mask, the lse packing, views and errors, and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.dcp_a2a_combine import DCPA2AUnpackCombine, dcp_a2a_unpack_combine_reference
from warmreg_kimi_k3.dcp_a2a_pack import DCPA2APackSend, dcp_a2a_pack_send_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
PACK, COMBINE = DCPA2APackSend.name, DCPA2AUnpackCombine.name
INF = float("inf")
A2A = {"dcp_comm_backend": "a2a", "direct_dcp_a2a": False}


def _pack(n: int = 2) -> DCPA2APackSend:
    return DCPA2APackSend(dtype="bfloat16", world_size=n, head_dims={64: 7})


def _combine(n: int = 2, base_e: bool = True) -> DCPA2AUnpackCombine:
    return DCPA2AUnpackCombine(dtype="bfloat16", world_size=n, head_dims=(64,), is_base_e=base_e)


def _inputs(tokens: int, heads: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, d, generator=g).to(dtype), torch.randn(tokens, heads, generator=g) * 4


def _mask(seq_lens: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


def test_hand_picked_pack_and_combine() -> None:
    """fp32: the lse is one word after the values; the second request's shard is empty and the last row padding, so
    their lses are -inf. Two ranks of equal lse halve each other's output and the lse grows by log 2."""
    out = torch.arange(4 * 2 * 2, dtype=torch.float32).view(4, 2, 2)
    lse = torch.zeros(4, 2)
    send = DCPA2APackSend(dtype="float32", world_size=2, head_dims={2: 7})(out, lse, 2, *_mask([5, 0], [0, 2, 3]))
    assert send.shape == (2, 4, 1, 3)
    assert send[1, 0, 0].tolist() == [2.0, 3.0, 0.0] and send[0, 2, 0].tolist() == [8.0, 9.0, -INF]
    assert send[:, :2, 0, 2].eq(0).all() and send[:, 2:, 0, 2].eq(-INF).all()
    recv = torch.stack([torch.tensor([[[2.0, 4.0, 0.0]]]), torch.tensor([[[4.0, 8.0, 0.0]]])])
    got, got_lse = DCPA2AUnpackCombine(dtype="float32", world_size=2, head_dims=(2,), is_base_e=True)(
        recv, return_lse=True
    )
    assert got.tolist() == [[[3.0, 6.0]]] and got_lse.item() == pytest.approx(0.6931472)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "n", "mask"), [(1, 2, 2, False), (5, 12, 4, True), (9, 8, 8, True)])
def test_pack_matches_reference(dtype: torch.dtype, tokens: int, heads: int, n: int, mask: bool) -> None:
    out, lse = _inputs(tokens, heads, 64, dtype, seed=tokens)
    seq_lens, starts = _mask([3, 0, 7][: max(1, tokens // 3)], [0, 1, 2, tokens - 1][: max(1, tokens // 3) + 1])
    args = (seq_lens, starts) if mask else ()
    got = DCPA2APackSend(dtype="bfloat16", world_size=n, head_dims={64: 7})(out, lse, n, *args)
    want = dcp_a2a_pack_send_reference(out, lse, n, *args)
    words = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(words), want.view(words))  # bitwise: copies and the lse's fp32 bits


def test_pack_masks_every_row_of_a_step_without_local_sequences() -> None:
    out, lse = _inputs(3, 4, 64, torch.bfloat16, seed=1)
    empty = torch.zeros(0, dtype=torch.int32)
    got = _pack()(out, lse, 2, empty, torch.zeros(1, dtype=torch.int32))
    assert got[..., 64:].contiguous().view(torch.float32).eq(-INF).all()


@pytest.mark.parametrize("base_e", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "n"), [(1, 1, 2), (5, 3, 4), (7, 16, 8)])
def test_combine_matches_reference(base_e: bool, dtype: torch.dtype, tokens: int, heads: int, n: int) -> None:
    out, _ = _inputs(tokens, heads * n, 64, dtype, seed=tokens + n)
    lse = torch.randn(tokens, heads * n, generator=torch.Generator().manual_seed(5)) * 4
    lse[0, 0], lse[-1, -1] = float("nan"), INF  # NaN and +inf count as -inf
    lse[tokens // 2] = -INF  # a row no rank attended to: zero output, lse -inf
    recv = dcp_a2a_pack_send_reference(out, lse, n)  # the all-to-all of equal ranks' buffers: a permutation
    got, got_lse = DCPA2AUnpackCombine(dtype="bfloat16", world_size=n, head_dims=(64,), is_base_e=base_e)(
        recv, return_lse=True, is_lse_base_on_e=base_e
    )
    want, want_lse = dcp_a2a_unpack_combine_reference(recv, return_lse=True, is_lse_base_on_e=base_e)
    # the same fp32 operations, summed in another order by torch's lse reduction; bf16: the interpreter truncates
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert got[tokens // 2].eq(0).all() and got_lse[tokens // 2].eq(-INF).all()


def test_views_of_vllm_call_sites() -> None:
    """The up-projected ``v`` written transposed by the bmm (head-strided), a column slice of the lse, a send buffer
    slice of a larger receive buffer: one binary each."""
    pack, combine = _pack(2), _combine(2)
    out, lse = _inputs(4, 6, 64, torch.bfloat16, seed=3)
    strided = out.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.randn(4, 12, generator=torch.Generator().manual_seed(5)).mul_(3)
    keys = set()
    for o, ls in ((out, lse), (strided, wide[:, ::2])):
        got = pack(o, ls, 2, *_mask([1, 2], [0, 1, 3]))
        want = dcp_a2a_pack_send_reference(o, ls, 2, *_mask([1, 2], [0, 1, 3]))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise: the lse's fp32 halves may read as NaN
        keys.add(pack.dispatch(cp_attn_out=o, cp_attn_lse=ls, world_size=2, seq_lens=_mask([1, 2], [0, 1, 3])[0]))
        sliced = torch.cat([got, got], dim=1)[:, 4:]
        torch.testing.assert_close(combine(sliced), dcp_a2a_unpack_combine_reference(got), rtol=2**-7, atol=2**-7)
    assert len(keys) == 1


def test_empty_batch_and_launch_errors() -> None:
    pack, combine = _pack(2), _combine(2)
    out, lse = _inputs(3, 4, 64, torch.bfloat16, seed=2)
    assert pack(out[:0], lse[:0], 2).shape == (2, 0, 2, 66) and combine(
        torch.zeros(2, 0, 2, 66, dtype=torch.bfloat16)
    ).shape == (0, 2, 64)
    with pytest.raises(warmreg.LaunchError, match="world_size"):
        pack(out, lse, 3)
    with pytest.raises(warmreg.LaunchError, match="together"):
        pack(out, lse, 2, torch.ones(1, dtype=torch.int32))
    with pytest.raises(warmreg.LaunchError, match="query_start_loc an"):
        pack(out, lse, 2, *_mask([1, 2], [0, 1]))
    with pytest.raises(warmreg.LaunchError, match="cp_attn_lse"):
        pack(out, lse[:2], 2)
    with pytest.raises(warmreg.LaunchError, match="D a power of two"):
        pack(out[..., :48], lse, 2)
    with pytest.raises(warmreg.LaunchError, match="unit stride"):
        pack(out.transpose(1, 2).contiguous().transpose(1, 2), lse, 2)
    with pytest.raises(warmreg.LaunchError, match="power of two"):
        combine(torch.zeros(2, 1, 1, 50, dtype=torch.bfloat16))
    with pytest.raises(warmreg.LaunchError, match="recv_buffer must"):
        combine(torch.zeros(2, 1, 66, dtype=torch.bfloat16))


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_keys_with_the_a2a_backend(target: str) -> None:
    """DCP 4: L = 512 below 8 tokens (at most 7 requests: arange bounds 1..8), V = 128 from 8 (256 requests: 1..256);
    the combine once per head dim; the all-gather correction is not planned."""
    plan = warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=4, **A2A), target=target)
    pack = {(k.head_dim, k.num_seqs_pow2) for k in plan.kernel(PACK).keys}
    assert pack == {(512, p) for p in (1, 2, 4, 8)} | {(128, 2**i) for i in range(9)}
    assert {k.fields()["head_dim"] for k in plan.kernel(COMBINE).keys} == {128, 512}
    assert all(k.world_size == 4 and not k.return_lse and k.is_base_e for k in plan.kernel(COMBINE).keys)
    assert "kimi_k3.dcp_correct_attn_out" not in {k.name for k in plan.kernels}


def test_few_tokens_combine_the_latent_only() -> None:
    plan = warmreg.plan(
        example_config("kimi_k3", decode_context_parallel_size=2, max_num_seqs=2, num_speculative_tokens=1, **A2A),
        target="cuda:90",
    )
    assert {(k.head_dim, k.num_seqs_pow2) for k in plan.kernel(PACK).keys} == {(512, 1), (512, 2)}
    assert {k.head_dim for k in plan.kernel(COMBINE).keys} == {512}


def test_not_planned_with_ag_rs_a_direct_workspace_or_off_cuda() -> None:
    names = {
        k.name
        for k in warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=4), target="cuda:90").kernels
    }
    assert PACK not in names and COMBINE not in names and "kimi_k3.dcp_correct_attn_out" in names
    direct = example_config("kimi_k3", decode_context_parallel_size=4, dcp_comm_backend="a2a")
    names = {k.name for k in warmreg.plan(direct, target="cuda:90").kernels}
    assert PACK not in names and COMBINE not in names and "kimi_k3.dcp_correct_attn_out" not in names
    rocm = {
        k.name
        for k in warmreg.plan(
            example_config("kimi_k3", decode_context_parallel_size=4, **A2A), target="rocm:gfx942"
        ).kernels
    }
    assert PACK not in rocm and COMBINE not in rocm
    with pytest.raises(warmreg.ConfigError, match="dcp_comm_backend"):
        warmreg.plan(
            example_config("kimi_k3", decode_context_parallel_size=4, dcp_comm_backend="ring"), target="cuda:90"
        )
    f32 = example_config("kimi_k3", decode_context_parallel_size=2, dcp_comm_backend="a2a", dtype="float32")
    assert {k.out_dtype for k in warmreg.plan(f32, target="cuda:90").kernel(PACK).keys} == {"float32"}  # never direct


@pytest.mark.parametrize(("tokens", "seqs"), [(1, 1), (7, 3), (8, 8), (37, 12), (1024, 256)])
def test_runtime_shapes_are_planned(tokens: int, seqs: int) -> None:
    plan = warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=8, **A2A), target="cuda:90")
    pack, combine = plan.kernel(PACK), plan.kernel(COMBINE)
    d = 512 if tokens < 8 else 128
    out, lse = warmreg.meta((tokens, 96, d), torch.bfloat16), warmreg.meta((tokens, 96), torch.float32)
    key = pack.kernel.dispatch(
        cp_attn_out=out, cp_attn_lse=lse, world_size=8, seq_lens=warmreg.meta((seqs,), torch.int32)
    )
    assert key in pack.keys
    recv = warmreg.meta((8, tokens, 12, d + 2), torch.bfloat16)
    assert combine.kernel.dispatch(recv_buffer=recv, return_lse=False, is_lse_base_on_e=True) in combine.keys
    assert_warmup_inputs_reproduce(pack.kernel, list(pack.keys)[:2])
    assert_warmup_inputs_reproduce(combine.kernel, list(combine.keys))


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build_pack() -> OpCall:
        out, lse = _inputs(3, 4, 64, torch.bfloat16, seed=9)
        return OpCall(_pack(2), (out, lse, 2, *_mask([2, 1], [0, 2, 3])), {})

    def build_combine() -> OpCall:
        out, lse = _inputs(3, 4, 64, torch.bfloat16, seed=9)
        return OpCall(_combine(2), (dcp_a2a_pack_send_reference(out, lse, 2),), {})

    check_out(build_pack)
    check_out(build_combine)
