"""DeepSeek-V4.1's first ops: the padded interleaved Q, the mHC stream expand, the compressor ring slots and the fused
Q/KV norm + MXFP8 query quant, against their PyTorch references under Triton's interpreter (hand-picked math, views,
errors, out=, warmup inputs)."""

from __future__ import annotations

import pytest
import torch
from warmreg_deepseek_v4._v41_mxfp8 import mxfp8_scale_bytes
from warmreg_deepseek_v4.v41_hc_expand import HcExpand, hc_expand_reference
from warmreg_deepseek_v4.v41_pad_q import PadInterleavedQ, pad_interleaved_q_reference
from warmreg_deepseek_v4.v41_q_norm_quant import QKVNormQuant, q_kv_norm_quant_reference
from warmreg_deepseek_v4.v41_ring_slots import RingSlotMapping, ring_capacity, ring_slot_mapping_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the padded interleaved Q --------------------------------------------------------------------------------------
def test_pad_rows_copy_then_zero() -> None:
    """Each 16-dim chunk row: the live heads' 16 values each, bit for bit, then zeros (+0.0) for the padding heads."""
    q = torch.arange(2 * 2 * 32, dtype=torch.float32).reshape(2, 2, 32).to(BF16)
    got = PadInterleavedQ(live_heads=2, padded_heads=4, head_dim=32, dtype="bfloat16", tokens=[2])(
        q, torch.full((2, 4, 32), 7.0, dtype=BF16)
    )
    rows = got.reshape(4, 64)
    assert torch.equal(rows[:, :32], q.reshape(4, 32)) and (rows[:, 32:] == 0).all()
    assert not torch.signbit(rows[:, 32:].float()).any()


@pytest.mark.parametrize(("tokens", "live", "padded"), [(5, 4, 8), (3, 2, 6), (0, 4, 8)])
def test_pad_matches_reference(tokens: int, live: int, padded: int) -> None:
    """A pow-2 pad, a 4-head pad of 2 live heads (16 * 4 = 64: still a power of two), and an empty step."""
    q = torch.randn(tokens, live, 64, generator=_gen(tokens)).to(BF16)
    out = torch.empty(tokens, padded, 64, dtype=BF16)
    got = PadInterleavedQ(live_heads=live, padded_heads=padded, head_dim=64, dtype="bfloat16", tokens=[1])(q, out)
    assert got is out and torch.equal(got, pad_interleaved_q_reference(q, padded))


def test_pad_errors() -> None:
    kernel = PadInterleavedQ(live_heads=4, padded_heads=8, head_dim=64, dtype="bfloat16", tokens=[1])
    q, out = torch.zeros(2, 4, 64, dtype=BF16), torch.zeros(2, 8, 64, dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="q must be a contiguous"):
        kernel(torch.zeros(2, 64, 4, dtype=BF16).transpose(1, 2), out)
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        kernel(q, out.float())
    with pytest.raises(warmreg.LaunchError, match="powers of two"):
        kernel(torch.zeros(2, 3, 64, dtype=BF16), out)


def test_pad_warmup_inputs_reproduce() -> None:
    kernel = PadInterleavedQ(live_heads=32, padded_heads=64, head_dim=512, dtype="bfloat16", tokens=[2048, 8192])
    config = warmreg.WarmConfig.load({"model_type": "x"})
    keys = warmreg.enumerate_keys(kernel, kernel.domains(config, warmreg.Platform.parse("cuda:100")))
    assert len(keys) == 1 and keys[0].fields()["rows"] == "div16"
    assert_warmup_inputs_reproduce(kernel, keys)


# -- the mHC stream expand -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("m", "h", "n"), [(5, 48, 4), (1, 40, 1), (0, 16, 4)])
def test_hc_expand_matches_reference(m: int, h: int, n: int) -> None:
    x = torch.randn(m, h, generator=_gen(m + h)).to(BF16)
    assert torch.equal(HcExpand(hidden_size=h, hc_mult=n, dtype="bfloat16")(x, n), hc_expand_reference(x, n))


def test_hc_expand_strided_x_is_another_key() -> None:
    """The strides are constexprs of vLLM's kernel: a column-major or row-sliced view reads right, under its own key."""
    kernel, base = HcExpand(hidden_size=32, hc_mult=4, dtype="bfloat16"), torch.randn(6, 64, generator=_gen(1)).to(BF16)
    views = (base[:, :32], base[:, :32].t().contiguous().t(), base[:, :32].contiguous())
    for x in views:
        assert torch.equal(kernel(x, 4), hc_expand_reference(x, 4))
    keys = {kernel.dispatch(x=x, hc_mult=4) for x in views}
    assert len(keys) == 3
    with pytest.raises(warmreg.LaunchError, match="hc_mult"):
        kernel(base, 0)
    with pytest.raises(warmreg.LaunchError, match="x must be"):
        kernel(base.reshape(-1), 4)


def test_hc_expand_out() -> None:
    check_out(lambda: OpCall(HcExpand(hidden_size=32, hc_mult=4, dtype="bfloat16"), (torch.ones(3, 32, dtype=BF16), 4), {}))


# -- the compressor ring slots -------------------------------------------------------------------------------------
def test_ring_capacity_as_vllm_sizes_the_ring() -> None:
    """``max(8, 1 << (num_speculative_tokens + 1).bit_length())``: drafts + bonus + the previous row."""
    assert [ring_capacity(n) for n in (0, 1, 3, 5, 6, 7, 14, 15)] == [8, 8, 8, 8, 8, 16, 16, 32]


def test_ring_slots_by_hand() -> None:
    """Block * C + pos % C; the null block (0) and the padding tokens get -1."""
    bt = torch.tensor([[3, 9], [0, 1], [7, 2]], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([5, 6, 0, 13, 14])
    got = RingSlotMapping(capacity=8)(bt, t2r, pos, num_actual_tokens=5, num_tokens=7, capacity=8)
    assert got.tolist() == [29, 30, -1, 61, 62, -1, -1]


@pytest.mark.parametrize(("actual", "tokens", "capacity"), [(300, 512, 8), (17, 17, 16), (0, 3, 8)])
def test_ring_slots_match_reference_with_a_strided_table(actual: int, tokens: int, capacity: int) -> None:
    gen = _gen(actual)
    table = torch.randint(0, 50, (6, 9), generator=gen, dtype=torch.int32)[:, 1:]  # a row stride of 9
    t2r = torch.randint(0, 6, (actual + 3,), generator=gen, dtype=torch.int32)
    pos = torch.randint(0, 10_000, (actual + 3,), generator=gen)
    kwargs = dict(num_actual_tokens=actual, num_tokens=tokens, capacity=capacity)
    got = RingSlotMapping(capacity=capacity)(table, t2r, pos, **kwargs)
    assert torch.equal(got, ring_slot_mapping_reference(table, t2r, pos, **kwargs))


def test_ring_slots_errors_and_out() -> None:
    kernel, bt = RingSlotMapping(capacity=8), torch.ones(2, 2, dtype=torch.int32)
    t2r, pos = torch.zeros(4, dtype=torch.int32), torch.arange(4)
    with pytest.raises(warmreg.LaunchError, match="block_table"):
        kernel(bt.long(), t2r, pos, num_actual_tokens=4, num_tokens=4, capacity=8)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(bt, t2r, pos.int(), num_actual_tokens=4, num_tokens=4, capacity=8)
    with pytest.raises(warmreg.LaunchError, match="num_actual_tokens"):
        kernel(bt, t2r, pos, num_actual_tokens=4, num_tokens=3, capacity=8)
    check_out(
        lambda: OpCall(RingSlotMapping(capacity=8), (bt, t2r, pos), {"num_actual_tokens": 3, "num_tokens": 4, "capacity": 8})
    )


# -- the fused Q/KV norm + MXFP8 query quant -------------------------------------------------------------------------
def _interpreter_e4m3_ok(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the e4m3 values agree within one e4m3 step (Triton 3.8's interpreter truncates fp32 -> bf16 and does not
    round fp32 -> e4m3 to nearest even) or differ only by the interpreter losing the exponent carry of a rounding that
    crosses a binade (it stores 127.0 as 64 where the GPU and torch round to 128). The comparison with vLLM's own
    kernel (the same conversions) is exact: tests/engines/test_vllm034_kernels_dsv41.py."""
    g, w = got.float(), want.float()
    return ((g - w).abs() <= torch.maximum(w.abs() / 8, torch.tensor(2.0**-9))) | (g * 2 == w)  # 2^-9: a subnormal step


@pytest.mark.parametrize(("tokens", "q_size", "kv_size"), [(5, 128, 64), (130, 96, 64), (1, 1280, 512)])
def test_q_kv_norm_quant_matches_reference(tokens: int, q_size: int, kv_size: int) -> None:
    """Rows past 128 (a second scale tile), a group count that is not a multiple of 4 (96 / 32 = 3: padded scale
    groups), and V4.1-Flash's widths (a 2048 tile, eight warps), on the fused projection's two views. Scales exact;
    the KV norm within one bf16 ulp (the interpreter truncates fp32 -> bf16); the query see
    :func:`_interpreter_e4m3_ok`."""
    gen = _gen(tokens + q_size)
    fused = (torch.randn(tokens, q_size + kv_size, generator=gen) * 3).to(BF16)
    qr, kv = fused[:, :q_size], fused[:, q_size:]
    qw, kvw = torch.randn(q_size, generator=gen).to(BF16), torch.randn(kv_size, generator=gen).to(BF16)
    kernel = QKVNormQuant(q_size=q_size, kv_size=kv_size, dtype="bfloat16")
    qo, scales, kvo = kernel(qr, kv, qw, kvw, 1e-6, launch_pdl=False)
    want_q, want_scales, want_kv = q_kv_norm_quant_reference(qr, kv, qw, kvw, 1e-6)
    assert scales.shape == (mxfp8_scale_bytes(tokens, q_size),) and torch.equal(scales, want_scales)
    torch.testing.assert_close(kvo, want_kv, atol=1e-2, rtol=2**-7)
    assert qo.dtype == torch.float8_e4m3fn and _interpreter_e4m3_ok(qo, want_q).all()
    assert (qo.float() == want_q.float()).float().mean() > 0.8  # most values need no rounding excuse


def test_q_kv_norm_quant_zero_rows_and_scale_padding() -> None:
    """An all-zero query row gets scale 0 and zeros; the padding rows (up to 128) and groups (up to 4) are 0."""
    fused = torch.zeros(2, 96 + 32, dtype=BF16)
    fused[1, :96] = 1.0
    qo, scales, _ = QKVNormQuant(q_size=96, kv_size=32, dtype="bfloat16")(
        fused[:, :96], fused[:, 96:], torch.ones(96, dtype=BF16), torch.ones(32, dtype=BF16), 1e-6, launch_pdl=False
    )
    assert (qo[0].float() == 0).all()
    # row 1: amax ~1 -> 1/448 = 1.1 * 2^-9, rounded up to 2^-8: biased 119; row 1's scales at bytes 16..18
    assert scales[16:19].tolist() == [119, 119, 119] and scales[19] == 0 and int(scales.count_nonzero()) == 3


def test_q_kv_norm_quant_errors() -> None:
    kernel = QKVNormQuant(q_size=64, kv_size=32, dtype="bfloat16")
    fused = torch.zeros(2, 96, dtype=BF16)
    w, kw = torch.ones(64, dtype=BF16), torch.ones(32, dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="multiple of 32"):
        kernel(fused[:, :48], fused[:, 48:80], torch.ones(48, dtype=BF16), kw, 1e-6, launch_pdl=False)
    with pytest.raises(warmreg.LaunchError, match="kv_weight"):
        kernel(fused[:, :64], fused[:, 64:], w, w, 1e-6, launch_pdl=False)
    with pytest.raises(warmreg.LaunchError, match="kv must be"):
        kernel(fused[:, :64], fused[:, 64:].t().contiguous().t(), w, kw, 1e-6, launch_pdl=False)
