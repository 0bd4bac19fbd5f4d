"""The MXFP4 indexer path: E2M1 / UE8M0 helpers, the indexer Q RoPE + MXFP4 quant and the MXFP4 K insert against
their PyTorch references (Triton interpreter on CPU), ``serving.indexer_kv_dtype``'s resolution, what the Flash
example plans with it, and real cross-compiles for cuda:100.

The Q kernel is bit-exact against its reference: the same fp32 RoPE operations, RNE bf16, and exact E2M1 and
UE8M0 on both sides (the reference takes an independent route: nearest grid point in float64, float64 log2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import triton
import triton.language as tl
from warmreg_deepseek_v4 import indexer_kv, indexer_q, indexer_q_mxfp4, pack_seq, unpack_seq
from warmreg_deepseek_v4._mxfp4 import e2m1_code, e2m1_reference, mxfp4_quant, mxfp4_quant_reference
from warmreg_deepseek_v4._serving import indexer_kv_dtype
from warmreg_deepseek_v4.indexer_kv import IndexerKVCompressInsert, indexer_kv_compress_insert_reference
from warmreg_deepseek_v4.indexer_q_mxfp4 import IndexerQRopeMxfp4, indexer_q_rope_mxfp4_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

FLASH = EXAMPLES / "deepseek_v4_flash.json"
Q4, Q8, KV = IndexerQRopeMxfp4.name, "deepseek_v4.indexer_q_rope_quant", IndexerKVCompressInsert.name
PACK = {"deepseek_v4.pack_seq", "deepseek_v4.unpack_seq"}
SM10X = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def rope_cache(positions: int, rope_dim: int = 64) -> torch.Tensor:
    angles = torch.rand(positions, rope_dim // 2) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=1)


# -- the E2M1 / UE8M0 helpers --------------------------------------------------------------------------------------


@triton.jit
def _probe_kernel(x_ptr, code_ptr, packed_ptr, scale_ptr, N: tl.constexpr):
    offs = tl.arange(0, N * 32)
    x = tl.load(x_ptr + offs)
    tl.store(code_ptr + offs, e2m1_code(x).to(tl.uint8))
    even, odd = tl.split(tl.reshape(x, (N * 16, 2)))
    packed, scale = mxfp4_quant(tl.reshape(even, (N, 16)), tl.reshape(odd, (N, 16)))
    tl.store(packed_ptr + tl.arange(0, N * 16), tl.reshape(packed, (N * 16,)))
    tl.store(scale_ptr + tl.arange(0, N), scale)


@attrs.frozen(kw_only=True)
class _ProbeKey(warmreg.CompileKey):
    blocks: int


class _Probe(warmreg.TritonKernel[_ProbeKey]):
    key_type = _ProbeKey
    jit = _probe_kernel

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor) -> warmreg.LaunchSpec[_ProbeKey]:
        key = _ProbeKey(blocks=x.numel() // 32)
        out = (torch.empty_like(x, dtype=torch.uint8), torch.empty(x.numel() // 2, dtype=torch.uint8),
               torch.empty(key.blocks, dtype=torch.uint8))  # fmt: skip
        kwargs = dict(x_ptr=x, code_ptr=out[0], packed_ptr=out[1], scale_ptr=out[2], N=key.blocks)
        return warmreg.LaunchSpec(key, (1,), kwargs, out)


def _blocks() -> torch.Tensor:
    """Blocks of 32 that hit every rule: ties on the grid, scale boundaries, zero, huge and infinite values."""
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(9.0))])
    six = torch.tensor(6.0)
    rows = [
        torch.cat([grid, ties, -ties, near[:10]]),  # amax 6 = 6 * 2**0 exactly: k = 0, values as they are
        torch.cat([ties * 2**-5, -grid * 2**-5, near * 2**-5, six.view(1) * 2**-5, -six.view(1) * 2**-5]),
        torch.cat([torch.nextafter(six, torch.tensor(9.0)).view(1), ties * 2, -ties * 2, torch.zeros(17)]),  # k += 1
        torch.zeros(32),  # the floor: k = -126, byte 1
        torch.cat([torch.tensor([-0.0, 1e-42, -1e-42, 2.0**-130]), torch.zeros(28)]),  # signed zero, subnormals
        torch.full((32,), 3.0e38) * torch.tensor([1.0, -1.0]).repeat(16),  # huge finite: k = 126
        torch.cat([torch.tensor([float("inf"), -float("inf"), 5.0, -1e30]), torch.ones(28)]),  # k clamped to 127
        torch.randn(32) * 1e-3,
    ]
    return torch.stack([torch.cat([r, torch.zeros(32 - r.numel())]) for r in rows]).flatten()


def test_e2m1_and_ue8m0_are_exact() -> None:
    """Every E2M1 tie goes to the even code, thresholds round as RNE, signs (zero too) are kept; the UE8M0 byte
    holds at 6 * 2**k exactly and grows one above, floors at 1, is 253 for huge values and 254 for infinity."""
    torch.manual_seed(0)
    x = _blocks()
    codes, packed, scale = _Probe()(x)
    assert torch.equal(codes, e2m1_reference(x))
    want_packed, want_scale = mxfp4_quant_reference(x)
    assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
    assert scale[:4].tolist() == [127, 127 - 5, 128, 1] and scale[5:7].tolist() == [253, 254]
    first = codes[:32].tolist()
    assert first[:8] == list(range(8))  # the grid itself
    assert first[8:15] == [0, 2, 2, 4, 4, 6, 6]  # 0.25 .75 1.25 1.75 2.5 3.5 5: each tie to the even code
    assert first[15:22] == [8 | c for c in (0, 2, 2, 4, 4, 6, 6)]  # and signed
    assert codes[128:132].tolist() == [8, 0, 8, 0]  # -0.0, tiny positive, tiny negative, below 2**-126
    assert packed[96:98].tolist() == [0xF7, 0x80]  # (inf, -inf) saturate to +-6; (5, -1e30) * 2**-127 -> (0, -0)


# -- indexer Q ---------------------------------------------------------------------------------------------------


def q_inputs(tokens: int, heads: int, positions: int = 64, *, head_stride: int = 128) -> dict[str, Any]:
    buf = (torch.randn(tokens, heads, head_stride) * 2).to(torch.bfloat16)
    q = buf[:, :, :128]  # head_stride > 128: a strided view of a wider projection
    if tokens >= 2 and heads >= 2:
        q[0, 0] = 0.0  # all-zero head: every block at the floor
        q[1, 0, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # amax 6: k = 0, ties
        q[1, 0, 32:64] = torch.tensor([6.03125, 3.0] * 16)  # just above 6 (bf16's next): k = 1
        q[1, 1, :64] = torch.tensor([3.0e38, -1.0] * 32)  # huge (bf16): k = 126
    pos = torch.randint(0, positions, (tokens,))
    if tokens:
        pos[0], pos[-1] = 0, positions - 1  # the first and last RoPE rows
    return {
        "positions": pos,
        "index_q": q,
        "cos_sin_cache": rope_cache(positions),
        "index_weights": torch.randn(tokens, heads).to(torch.bfloat16),
        "softmax_scale": 128**-0.5,
        "head_scale": heads**-0.5,
    }


@pytest.mark.parametrize(("tokens", "heads", "head_stride"), [(1, 1, 128), (7, 3, 160)], ids=["one-token", "strided"])
def test_q_matches_reference(tokens: int, heads: int, head_stride: int) -> None:
    torch.manual_seed(tokens)
    inputs = q_inputs(tokens, heads, head_stride=head_stride)
    kernel = IndexerQRopeMxfp4()
    key = kernel.dispatch(
        index_q=inputs["index_q"], index_weights=inputs["index_weights"], cos_sin_cache=inputs["cos_sin_cache"]
    )
    assert key.q_stride_h == ("div16" if head_stride % 16 == 0 else "other") and key.block == 32
    (packed, scale), w = kernel(**inputs)
    (ref_packed, ref_scale), ref_w = indexer_q_rope_mxfp4_reference(**inputs)
    assert packed.shape == (tokens, heads, 64) and packed.dtype == torch.uint8
    assert scale.shape == (tokens, heads) and scale.dtype == torch.int32
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)  # identical fp32 products
    if tokens >= 2:
        bytes_ = scale.view(torch.uint8).view(tokens, heads, 4)  # byte 0 = block 0 (little-endian int32)
        assert bytes_[0, 0].tolist() == [1, 1, 1, 1]  # the all-zero head
        assert bytes_[1, 0, :2].tolist() == [127, 128] and bytes_[1, 1, :2].tolist() == [253, 253]
        assert packed[1, 0, :4].tolist() == [0x07, 0x22, 0x44, 0x66]  # (6, 0.25), (0.75, 1.25), ...


def test_q_empty_batch_and_errors() -> None:
    kernel = IndexerQRopeMxfp4()
    (packed, scale), w = kernel(**q_inputs(0, 2))
    assert packed.shape == (0, 2, 64) and scale.shape == (0, 2) and w.shape == (0, 2)
    inputs = q_inputs(2, 2)
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(**{**inputs, "positions": inputs["positions"].int()})
    with pytest.raises(warmreg.LaunchError, match="index_q"):
        kernel(**{**inputs, "index_q": inputs["index_q"].float()})
    with pytest.raises(warmreg.LaunchError, match="need power-of-two halves"):
        kernel(**{**inputs, "cos_sin_cache": rope_cache(64, 32)})  # NoPE 96
    small = {**inputs, "index_q": inputs["index_q"][..., :32].contiguous(), "cos_sin_cache": rope_cache(64, 16)}
    with pytest.raises(warmreg.LaunchError, match="whole MXFP4 blocks"):
        kernel(**small)  # NoPE 16 + RoPE 16: no block of 32 on either side


# -- MXFP4 K insert ----------------------------------------------------------------------------------------------


def kv_inputs(tokens: int, *, page_stride: int = 4 * 68 + 48) -> dict[str, Any]:
    """Two requests; positions: a first window with start < 0 (3), a non-closing token, a PAD token, two pages."""
    state_pages, kv_pages, kv_bs = 12, 3, 4
    buffer = torch.zeros(kv_pages * page_stride, dtype=torch.uint8)
    return {
        "state_cache": torch.randn(state_pages, 4, 4 * 128),
        "state_block_table": torch.randperm(state_pages).to(torch.int32).view(2, 6),
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)[:tokens],
        "positions": torch.tensor([3, 7, 8, 11, 15, 2, 19])[:tokens],
        "slot_mapping": torch.tensor([1, 2, 3, 4, -1, 5, 6])[:tokens],
        "compressed_slot_mapping": torch.tensor([0, 5, -1, 6, 7, -1, 11])[:tokens],
        "norm_weight": (torch.rand(128) + 0.5).to(torch.bfloat16),
        "cos_sin_cache": rope_cache(32),
        "kv_cache": buffer.as_strided((kv_pages, kv_bs, 68), (page_stride, 68, 1)),
        "eps": 1e-6,
    }


def test_kv_insert_mxfp4_matches_reference() -> None:
    torch.manual_seed(2)
    inputs = kv_inputs(7)
    expected = {**inputs, "kv_cache": inputs["kv_cache"].clone()}
    kernel = IndexerKVCompressInsert()
    out = kernel(**inputs, use_fp4_cache=True, mx_scale=True)  # mx_scale is an FP8 option: ignored
    assert out is inputs["kv_cache"]
    indexer_kv_compress_insert_reference(**expected, use_fp4_cache=True)
    got, want = inputs["kv_cache"].reshape(3, -1), expected["kv_cache"].reshape(3, -1)
    values, scales = slice(0, 4 * 64), slice(4 * 64, 4 * 68)
    written = [(0, 0), (1, 1), (1, 2), (2, 3)]  # (page, token) of slots 0, 5, 6 and 11
    for page, j in written:
        assert int(want[page, j * 64 : j * 64 + 64].ne(0).sum()) > 32
    # Softmax (exp), rsqrt and the mean are not correctly rounded in numpy nor in torch: a one-ulp fp32
    # difference can move a value across an E2M1 rounding boundary (one code apart, same sign) and, rarely,
    # an amax across a power of two; everything else must be identical.
    assert torch.equal(got[:, scales], want[:, scales])
    nib = torch.stack([got[:, values] & 15, got[:, values] >> 4]), torch.stack([want[:, values] & 15, want[:, values] >> 4])
    assert int(((nib[0] & 7).int() - (nib[1] & 7).int()).abs().max()) <= 1
    assert float((nib[0] == nib[1]).float().mean()) > 0.98
    untouched = got[1, 3 * 64 : 4 * 64]  # slot 7: a PAD token (slot_mapping -1)
    assert int(untouched.sum()) == 0 and int(got[1, 4 * 64 + 12 : 4 * 64 + 16].sum()) == 0


def test_kv_insert_mxfp4_rejects_an_fp8_row() -> None:
    inputs = kv_inputs(2)
    fp8_rows = torch.zeros(3, 4, 132, dtype=torch.uint8)
    with pytest.raises(warmreg.LaunchError, match=r"kv_cache must be uint8 \[pages, tokens_per_page, 68\]"):
        IndexerKVCompressInsert()(**{**inputs, "kv_cache": fp8_rows}, use_fp4_cache=True)


# -- the setting and the plans -----------------------------------------------------------------------------------


def _plan(target: str, **serving: Any) -> warmreg.Plan:
    plugin = RegisterPlugin(
        indexer_q.register, indexer_q_mxfp4.register, pack_seq.register, unpack_seq.register, indexer_kv.register, model=DSV4.from_config)
    return warmreg.plan(example_config("deepseek_v4_flash", **serving), target=target, plugins=[plugin], entry_points=False)


def _resolve(target: str, **serving: Any) -> str:
    cfg = warmreg.WarmConfig.load(example_config("deepseek_v4_flash", **serving))
    return indexer_kv_dtype(cfg, DSV4.from_config(cfg), warmreg.Platform.parse(target))


@pytest.mark.parametrize(
    ("target", "value", "resolved"),
    [
        ("cuda:90", "auto", "fp8"),
        ("cuda:100", "auto", "fp8"),
        ("cuda:100", "mxfp4", "mxfp4"),
        ("cuda:103", "mxfp4", "mxfp4"),
        ("rocm:gfx942+aiter", "auto", "fp8"),
        ("rocm:gfx950", "auto", "fp8"),  # aiter off (vLLM's default): the hook keeps FP8
        ("rocm:gfx950+aiter", "auto", "mxfp4"),
        ("rocm:gfx950+aiter", "fp8", "fp8"),
        ("xpu:pvc", "auto", "fp8"),
    ],
)
def test_resolution(target: str, value: str, resolved: str) -> None:
    assert _resolve(target, indexer_kv_dtype=value) == resolved


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("cuda:90", "sm_10x"),
        ("cuda:120", "sm_10x"),
        ("rocm:gfx942+aiter", "is not CDNA4"),
        ("rocm:gfx950", r"does not enable aiter \(\+aiter\)"),
        ("xpu:pvc", "only on CUDA sm_10x"),
    ],
)
def test_mxfp4_refused_where_vllm_refuses_it(target: str, match: str) -> None:
    with pytest.raises(warmreg.ConfigError, match=match) as info:
        _plan(target, indexer_kv_dtype="mxfp4")
    assert info.value.field == "serving.indexer_kv_dtype" and "set it to 'fp8'" in str(info.value)


def test_unknown_value_names_the_accepted_ones() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"accepted: auto, fp8, mxfp4"):
        _plan("cuda:100", indexer_kv_dtype="bf16")


def test_cuda_sm10x_plans_the_mxfp4_variants() -> None:
    plan = _plan("cuda:100", indexer_kv_dtype="mxfp4")
    assert {k.name for k in plan.kernels} == {Q4, KV}
    (q,) = plan.kernel(Q4).keys
    assert (q.dtype, q.weights_dtype, q.weights_out_dtype, q.head_dim, q.rope_dim, q.block) == (
        "bfloat16", "bfloat16", "float32", 128, 64, 32
    )  # fmt: skip
    assert (q.q_stride_t, q.q_stride_h, q.num_warps, q.enable_fp_fusion) == ("div16", "div16", 1, True)
    (kv,) = plan.kernel(KV).keys
    assert kv.use_fp4_cache and not kv.mx_scale and kv.kv_block_stride == 4608  # round_up(64 * 68, 576)
    assert {k.name for k in _plan("cuda:100+cutedsl", indexer_kv_dtype="mxfp4").kernels} == {KV}  # CuTeDSL Q


def test_rocm_mxfp4_plans_none_of_these() -> None:
    """ROCm's MXFP4 indexer is aiter's (Q quant, K store, logits) after compress_pool: no FP8 Q, K insert or pack."""
    assert not _plan("rocm:gfx950+aiter").kernels  # "auto" is MXFP4 there
    assert {k.name for k in _plan("rocm:gfx950").kernels} == {Q8, KV, *PACK}


def test_runtime_keys_are_planned() -> None:
    """The indexer's runtime tensors on an MXFP4 cache give the planned keys."""
    plan = _plan("cuda:100", indexer_kv_dtype="mxfp4")
    cos_sin = warmreg.meta((1 << 20, 64), torch.float32)
    for t in (1, 37, 8192):
        q = warmreg.meta((t, 64 * 128), torch.bfloat16).view(t, 64, 128)
        w = warmreg.meta((t, 64), torch.bfloat16)
        assert IndexerQRopeMxfp4().dispatch(index_q=q, index_weights=w, cos_sin_cache=cos_sin) in plan.kernel(Q4).keys
    cache = warmreg.meta((9000, 64, 68), torch.uint8, stride=(4608, 68, 1))
    key = IndexerKVCompressInsert().dispatch(
        state_cache=warmreg.meta((50_000, 4, 512), torch.float32), kv_cache=cache,
        norm_weight=warmreg.meta((128,), torch.bfloat16), cos_sin_cache=cos_sin, compress_ratio=4, mx_scale=True,
        use_fp4_cache=True,
    )  # fmt: skip
    assert plan.kernel(KV).keys == (key,)


def test_warm_cross_compiles_for_sm100() -> None:
    plugin = RegisterPlugin(indexer_q_mxfp4.register, indexer_kv.register, model=DSV4.from_config)
    cfg = example_config("deepseek_v4_flash", indexer_kv_dtype="mxfp4")
    report = warmreg.warm(cfg, target="cuda:100", plugins=[plugin], entry_points=False, workers=2)
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    assert len(report.results) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_q_on_the_gpu_matches_the_interpreter() -> None:
    """The same binary logic on a GPU (any CUDA arch: no PTX E2M1 here): the NoPE blocks, whose math has no
    fusable operations, bit-exact; RoPE blocks may differ by fma contraction (enable_fp_fusion), one code."""
    torch.manual_seed(3)
    inputs = q_inputs(7, 3, head_stride=160)
    (packed, scale), w = IndexerQRopeMxfp4()(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()})
    (ref_packed, ref_scale), ref_w = indexer_q_rope_mxfp4_reference(**inputs)
    packed = packed.cpu()
    assert torch.equal(packed[..., :32], ref_packed[..., :32])
    assert torch.equal(scale.cpu().view(torch.uint8).view(7, 3, 4)[..., :2], ref_scale.view(torch.uint8).view(7, 3, 4)[..., :2])
    lo, hi = (packed[..., 32:] & 7).int() - (ref_packed[..., 32:] & 7).int(), (packed[..., 32:] >> 4 & 7).int() - (ref_packed[..., 32:] >> 4 & 7).int()
    assert int(lo.abs().max()) <= 1 and int(hi.abs().max()) <= 1
    torch.testing.assert_close(w.cpu(), ref_w, rtol=0, atol=0)


@triton.jit
def _ptx_e2m1_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(x_ptr + 2 * offs)
    hi = tl.load(x_ptr + 2 * offs + 1)
    ptx = tl.inline_asm_elementwise(
        "{ .reg .b8 tmp; cvt.rn.satfinite.e2m1x2.f32 tmp, $1, $2; cvt.u32.u8 $0, tmp; }",
        constraints="=r,f,f", args=[hi, lo], dtype=tl.uint32, is_pure=True, pack=1,
    )  # fmt: skip
    ours = e2m1_code(lo) | (e2m1_code(hi) << 4)
    tl.store(out_ptr + offs, ptx.to(tl.uint8))
    tl.store(out_ptr + N + offs, ours.to(tl.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not SM10X, reason="the PTX e2m1x2 conversion needs an SM10x GPU")
def test_arithmetic_e2m1_equals_the_ptx_conversion() -> None:
    """On SM10x: :func:`e2m1_code` gives the nibbles of vLLM's ``cvt.rn.satfinite.e2m1x2.f32``, on every fp32
    value of a dense sweep of [-8, 8] (ties and their neighbours included), zeros, tiny values and infinities."""
    sweep = torch.linspace(-8, 8, 1 << 16)
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    edges = torch.cat([edges, -edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(9.0))])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), -float("inf"), 1e30, -1e30])
    x = torch.cat([sweep, edges, -edges, special])
    x = torch.cat([x, torch.zeros((1 << 17) - x.numel())]).cuda()
    out = torch.empty(1 << 17, dtype=torch.uint8, device="cuda")
    _ptx_e2m1_kernel[((1 << 16) // 1024,)](x, out, 1 << 16, BLOCK=1024)
    assert torch.equal(out[: 1 << 16], out[1 << 16 :])


def _full_plan(target: str, value: str) -> dict[str, int]:
    """Keys per kernel of the Flash example, every DeepSeek-V4 kernel registered (the installed plugins)."""
    plan = warmreg.plan(example_config("deepseek_v4_flash", indexer_kv_dtype=value), target=target)
    return {kp.name: len(kp.keys) for kp in plan.kernels}


def test_flash_example_plans() -> None:
    """Flash with MXFP4 indexer keys: on cuda:100 the MXFP4 Q and K insert replace the FP8 ones (74 keys either
    way); on gfx950 with aiter ("auto" is MXFP4 there) compress_pool's 2 keys replace the FP8 Q, K insert, pack,
    unpack, the aiter prefill's top-k localize and the FP8 indexer's Triton logits and K gather (120 -> 105); cuda:90
    refuses it."""
    fp8, fp4 = _full_plan("cuda:100", "fp8"), _full_plan("cuda:100", "mxfp4")
    assert set(fp8) - set(fp4) == {Q8} and set(fp4) - set(fp8) == {Q4}
    assert sum(fp8.values()) == sum(fp4.values()) == 74 and fp4[Q4] == fp4[KV] == 1
    rocm_fp8, rocm_auto = _full_plan("rocm:gfx950+aiter", "fp8"), _full_plan("rocm:gfx950+aiter", "auto")
    assert rocm_auto == _full_plan("rocm:gfx950+aiter", "mxfp4")
    fp8_only = {Q8, KV, *PACK, "deepseek_v4.rocm_localize_topk", "deepseek_v4.rocm_indexer_logits", "deepseek_v4.rocm_indexer_k_gather"}
    assert set(rocm_fp8) - set(rocm_auto) == fp8_only and set(rocm_auto) - set(rocm_fp8) == {"deepseek_v4.compress_pool"}
    assert (sum(rocm_fp8.values()), sum(rocm_auto.values()), rocm_auto["deepseek_v4.compress_pool"]) == (120, 105, 2)
    with pytest.raises(warmreg.ConfigError, match=r"serving\.indexer_kv_dtype' is 'mxfp4'.*cuda:90"):
        _full_plan("cuda:90", "mxfp4")


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def _indexer_q_mxfp4_call() -> OpCall:
    torch.manual_seed(3)
    return OpCall(IndexerQRopeMxfp4(), (), q_inputs(3, 2))


def test_indexer_q_mxfp4_out() -> None:
    check_out(_indexer_q_mxfp4_call, tuple_error=r"out must be a tuple of \d buffers")
