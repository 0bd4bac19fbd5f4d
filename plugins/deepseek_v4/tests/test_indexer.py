"""C4 indexer kernels: Q RoPE + FP8 quant and KV compress + insert, against their PyTorch references
(Triton interpreter on CPU), plus warm coverage of the example deployments and real cross-compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import triton
import triton.language as tl
from warmreg_deepseek_v4 import indexer_kv, indexer_q
from warmreg_deepseek_v4._quant import bf16_round, ceil_log2, ceil_log2_reference, fp8_bits
from warmreg_deepseek_v4.indexer_kv import IndexerKVCompressInsert, indexer_kv_compress_insert_reference
from warmreg_deepseek_v4.indexer_q import IndexerQRopeQuant, indexer_q_rope_quant_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CONFIGS = [EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"]
TARGETS = ["cuda:90", "cuda:100", "rocm:gfx942"]
Q_NAME, KV_NAME = IndexerQRopeQuant.name, IndexerKVCompressInsert.name


def IndexerPlugin() -> RegisterPlugin:
    """Registers only this module's kernels."""
    return RegisterPlugin(indexer_q.register, indexer_kv.register, model=DSV4.from_config)


def rope_cache(positions: int, rope_dim: int = 64) -> torch.Tensor:
    angles = torch.rand(positions, rope_dim // 2) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp8 codes between two fp8 tensors (same sign: adjacent codes differ by 1)."""
    return (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()


# -- the shared bit-exact helpers ------------------------------------------------------------------


@triton.jit
def _probe_kernel(x_ptr, fp8_ptr, bf16_ptr, log_ptr, N: tl.constexpr, FNUZ: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(fp8_ptr + offs, fp8_bits(x, FNUZ))
    tl.store(bf16_ptr + offs, bf16_round(x))
    tl.store(log_ptr + offs, ceil_log2(tl.maximum(tl.abs(x), 1e-30)))


@attrs.frozen(kw_only=True)
class _ProbeKey(warmreg.CompileKey):
    n: int
    fnuz: bool


class _Probe(warmreg.TritonKernel[_ProbeKey]):
    key_type = _ProbeKey
    jit = _probe_kernel

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, fnuz: bool) -> warmreg.LaunchSpec[_ProbeKey]:
        key = _ProbeKey(n=x.numel(), fnuz=fnuz)
        out = (torch.empty_like(x, dtype=torch.uint8), torch.empty_like(x), torch.empty_like(x, dtype=torch.int32))
        kwargs = dict(x_ptr=x, fp8_ptr=out[0], bf16_ptr=out[1], log_ptr=out[2], N=key.n, FNUZ=fnuz)
        return warmreg.LaunchSpec(key, (1,), kwargs, out)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy, on the NaN inputs
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_bit_exact_helpers_match_torch(fp8_dtype: torch.dtype) -> None:
    """Every fp8 rounding case (normal, subnormal, ties, saturation, NaN, signed zero), bf16 RNE and
    ceil(log2) at and next to powers of two: bit-exact against torch's own conversions."""
    torch.manual_seed(0)
    fp8_max = torch.finfo(fp8_dtype).max
    grid = torch.cat([torch.linspace(1, 2, 257)[:-1] * 2.0**e for e in range(-14, 9)])
    ties = torch.arange(0, 256, dtype=torch.uint8).view(fp8_dtype).float()  # fp8 values and their midpoints
    ties = torch.cat([ties, (ties[:-1] + ties[1:]) / 2])
    pow2 = torch.tensor([2.0**e for e in range(-20, 9)])
    specials = torch.tensor([0.0, -0.0, float("nan"), fp8_max, 1e-12, 2.0**-30, 500.0])
    values = torch.cat(
        [grid, -grid, ties, pow2, torch.nextafter(pow2, torch.tensor(1e9)), specials, torch.randn(1000) * 50]
    )
    values = values[torch.isnan(values) | (values.abs() <= fp8_max)]
    x = torch.zeros(triton.next_power_of_2(values.numel()))
    x[: values.numel()] = values
    fp8, bf16, log2 = _Probe()(x, fp8_dtype == torch.float8_e4m3fnuz)
    assert torch.equal(fp8, x.to(fp8_dtype).view(torch.uint8))
    # bf16 round trip: bit-exact (NaN payloads aside)
    torch.testing.assert_close(bf16, x.to(torch.bfloat16).float(), rtol=0, atol=0, equal_nan=True)
    finite = ~torch.isnan(x)
    assert torch.equal(log2[finite], ceil_log2_reference(x.abs().clamp(min=1e-30))[finite])


# -- indexer Q ---------------------------------------------------------------------------------------


def q_inputs(tokens: int, heads: int, positions: int = 64) -> dict[str, Any]:
    q = (torch.randn(tokens, heads, 128) * 2).to(torch.bfloat16)
    if tokens >= 2 and heads >= 2:
        q[0, 0] = 0.0  # amax below the 1e-4 floor
        q[1, 0, :64] = 448.0  # amax exactly FP8_MAX * 2**0: s = 1 (exact ceil(log2) at a power of two)
        q[1, 1, :64] = 452.0  # just above: s = 2 (log2 = 0.0128 rounds up)
        q[1, :, 64:] = 0.0
    return {
        "positions": torch.randint(0, positions, (tokens,)),
        "index_q": q,
        "cos_sin_cache": rope_cache(positions),
        "index_weights": torch.randn(tokens, heads).to(torch.bfloat16),
        "softmax_scale": 128**-0.5,
        "head_scale": heads**-0.5,
    }


@pytest.mark.parametrize(
    ("tokens", "fp8_dtype", "explicit_fma"),
    [(3, torch.float8_e4m3fn, False), (3, torch.float8_e4m3fnuz, True), (1, torch.float8_e4m3fn, False)],
    ids=["cuda-e4m3fn", "gfx942-e4m3fnuz-fma", "one-token"],
)
def test_q_matches_reference(tokens: int, fp8_dtype: torch.dtype, explicit_fma: bool) -> None:
    torch.manual_seed(tokens)
    inputs = q_inputs(tokens, heads=2)
    q, w = IndexerQRopeQuant()(**inputs, fp8_dtype=fp8_dtype, explicit_fma=explicit_fma)
    ref_q, ref_w = indexer_q_rope_quant_reference(**inputs, fp8_dtype=fp8_dtype, explicit_fma=explicit_fma)
    assert q.dtype == fp8_dtype and q.shape == inputs["index_q"].shape
    distance = ulp_distance(q, ref_q)
    if explicit_fma:
        # The interpreter's tl.fma rounds the product (numpy), the reference emulates a true fma:
        # a RoPE output can land one bf16 ulp apart, so one fp8 code apart at most.
        assert int(distance.max()) <= 1
        assert torch.equal(distance[..., :64], torch.zeros_like(distance[..., :64]))  # NoPE: exact
    else:
        # Same fp32 operations in the same order, RNE bf16, exact power-of-two scales: bit-exact.
        assert int(distance.max()) == 0
    # w_out = w * 2**e * softmax_scale * head_scale: identical fp32 products, so exact.
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    if tokens >= 2:
        fp8_max = torch.finfo(fp8_dtype).max if fp8_dtype == torch.float8_e4m3fn else 224.0
        scales = w.float() / (inputs["index_weights"].float() * inputs["softmax_scale"] * inputs["head_scale"])
        assert scales[1, 0].item() == pytest.approx(2.0 ** torch.ceil(torch.log2(torch.tensor(448.0 / fp8_max))).item())
        assert q[0, 0].float().abs().max() == 0.0


def test_q_offset_view_and_empty_batch() -> None:
    torch.manual_seed(1)
    inputs = q_inputs(2, heads=2)
    proj = torch.zeros(2, 2 * 128 + 3, dtype=torch.bfloat16)  # a view at element 3: not 16-byte aligned
    proj[:, 3:].copy_(inputs["index_q"].reshape(2, -1))
    inputs["index_q"] = proj[:, 3:].view(2, 2, 128)
    kernel = IndexerQRopeQuant()
    key = kernel.dispatch(
        index_q=inputs["index_q"], index_weights=inputs["index_weights"], cos_sin_cache=inputs["cos_sin_cache"],
        fp8_dtype=torch.float8_e4m3fn, explicit_fma=False,
    )  # fmt: skip
    assert not key.q_aligned and key.q_stride_t == "other"
    q, w = kernel(**inputs)
    ref_q, ref_w = indexer_q_rope_quant_reference(**inputs)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # bit-exact as above
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    empty = q_inputs(0, heads=2)
    q, w = kernel(**empty)
    assert q.shape == (0, 2, 128) and w.shape == (0, 2) and q.dtype == torch.float8_e4m3fn


def test_q_launch_errors() -> None:
    inputs = q_inputs(2, heads=2)
    kernel = IndexerQRopeQuant()
    with pytest.raises(warmreg.LaunchError, match="positions"):
        kernel(**{**inputs, "positions": inputs["positions"].int()})
    with pytest.raises(warmreg.LaunchError, match="fp8_dtype"):
        kernel(**inputs, fp8_dtype=torch.float8_e5m2)
    with pytest.raises(warmreg.LaunchError, match="index_weights"):
        kernel(**{**inputs, "index_weights": inputs["index_weights"][:1]})


# -- indexer KV compress + insert ----------------------------------------------------------------


def kv_inputs(tokens: int, *, page_stride: int = 4 * 132 + 16, cache_offset: int = 0) -> dict[str, Any]:
    """Two requests; positions include a partial first window (3), a non-closing token and a PAD."""
    state_pages, kv_pages, kv_bs = 12, 3, 4
    pos = torch.tensor([3, 7, 8, 11, 15, 2, 19])[:tokens]
    buffer = torch.zeros(cache_offset + kv_pages * page_stride, dtype=torch.uint8)
    return {
        "state_cache": torch.randn(state_pages, 4, 4 * 128),
        "state_block_table": torch.randperm(state_pages).to(torch.int32).view(2, 6),
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)[:tokens],
        "positions": pos,
        "slot_mapping": torch.tensor([1, 2, 3, 4, -1, 5, 6])[:tokens],
        "compressed_slot_mapping": torch.tensor([0, 5, -1, 6, 7, -1, 11])[:tokens],
        "norm_weight": (torch.rand(128) + 0.5).to(torch.bfloat16),
        "cos_sin_cache": rope_cache(32),
        "kv_cache": buffer[cache_offset:].as_strided((kv_pages, kv_bs, 132), (page_stride, 132, 1)),
        "eps": 1e-6,
    }


def _backing(kv_cache: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(kv_cache.untyped_storage())


@pytest.mark.parametrize(
    ("mx_scale", "cache_offset"), [(False, 0), (True, 0), (False, 4)], ids=["fp32-scale", "mx-scale", "offset-view"]
)
def test_kv_insert_matches_reference(mx_scale: bool, cache_offset: int) -> None:
    torch.manual_seed(2)
    inputs = kv_inputs(7, cache_offset=cache_offset)
    expected = {**inputs, "kv_cache": inputs["kv_cache"].clone()}  # clone: a packed copy of the pages
    kernel = IndexerKVCompressInsert()
    key = kernel.dispatch(
        state_cache=inputs["state_cache"], kv_cache=inputs["kv_cache"], norm_weight=inputs["norm_weight"],
        cos_sin_cache=inputs["cos_sin_cache"], compress_ratio=4, mx_scale=mx_scale,
    )  # fmt: skip
    assert key.kv_cache_aligned == (cache_offset == 0) and key.state_block_size == "other"
    out = kernel(**inputs, mx_scale=mx_scale)
    assert out is inputs["kv_cache"]
    indexer_kv_compress_insert_reference(**expected, mx_scale=mx_scale)
    got, want = inputs["kv_cache"], expected["kv_cache"]
    assert int((want != 0).sum()) > 4 * 128 // 2  # four tokens (3, 7, 11, 19) were written
    page1 = got[1].reshape(-1)  # slot 7 = page 1, token 3 belongs to a PAD token (slot_mapping -1): untouched
    assert int(page1[3 * 128 : 4 * 128].sum()) == 0 and int(page1[4 * 128 + 12 : 4 * 128 + 16].sum()) == 0
    # Softmax (exp), rsqrt and the mean are not correctly rounded, neither in numpy (interpreter) nor
    # in torch: a one-ulp fp32 difference can move a value across an fp8 rounding boundary, so the
    # K bytes may differ by one code; everything else, the scales included, must be identical.
    values_got, values_want = got[:, :, :128], want[:, :, :128]
    assert int(ulp_distance(values_got, values_want).max()) <= 1
    got_scales = got.reshape(3, -1)[:, 4 * 128 : 4 * 132]
    want_scales = want.reshape(3, -1)[:, 4 * 128 : 4 * 132]
    assert torch.equal(got_scales, want_scales)
    page_stride = got.stride(0)
    backing = _backing(got)[cache_offset:]
    tails = backing.view(3, page_stride)[:, 4 * 132 :]  # page padding past the scales: untouched
    assert int(tails.abs().sum()) == 0
    if mx_scale:  # 4 identical UE8M0 bytes per written token
        words = got_scales.reshape(3, 4, 4)
        assert torch.equal(words, words[..., :1].expand_as(words))


def test_kv_insert_grid_is_the_state_slot_mapping_under_dp_padding() -> None:
    """vLLM launches ``num_actual = slot_mapping.shape[0]`` programs: under DP padding the state slot mapping is
    shorter than ``positions``, and the tokens past it (here 19, closing a window with slot 11) write nothing."""
    torch.manual_seed(3)
    inputs = kv_inputs(7)
    inputs["slot_mapping"] = inputs["slot_mapping"][:6]
    expected = {**inputs, "kv_cache": inputs["kv_cache"].clone()}
    IndexerKVCompressInsert()(**inputs)
    indexer_kv_compress_insert_reference(**expected)
    page2 = inputs["kv_cache"][2].reshape(-1)  # compressed slot 11: page 2, token 3
    assert int(page2[3 * 128 : 4 * 128].sum()) == 0 and int(inputs["kv_cache"][1].sum()) > 0
    scales = [cache.reshape(3, -1)[:, 4 * 128 :] for cache in (inputs["kv_cache"], expected["kv_cache"])]
    assert torch.equal(*scales)


def test_kv_insert_empty_batch_and_errors() -> None:
    inputs = kv_inputs(0)
    kernel = IndexerKVCompressInsert()
    kernel(**inputs)
    assert int(inputs["kv_cache"].sum()) == 0
    inputs = kv_inputs(2)
    with pytest.raises(warmreg.LaunchError, match="4-byte"):
        kernel(**kv_inputs(2, cache_offset=2))
    with pytest.raises(warmreg.LaunchError, match="state_cache"):
        kernel(**{**inputs, "state_cache": inputs["state_cache"].double()})
    with pytest.raises(warmreg.LaunchError, match="kv_cache"):
        kernel(**{**inputs, "kv_cache": torch.zeros(3, 4, 130, dtype=torch.uint8)})


# -- warm coverage ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("target", [*TARGETS, "cuda:90+cutedsl"])
def test_runtime_keys_are_planned(config: Path, target: str) -> None:
    """Runtime-shaped inputs of the example deployments give keys that the plan warms."""
    plan = warmreg.plan(config, target=target, plugins=[IndexerPlugin()], entry_points=False)
    platform = warmreg.Platform.parse(target)
    cfg = warmreg.WarmConfig.load(config)
    m = DSV4.from_config(cfg)
    serving = cfg.serving
    cos_sin = warmreg.meta((65536 * 16, m.qk_rope_head_dim), torch.float32)
    if platform.features:  # CuTeDSL replaces the Triton indexer Q on CUDA
        assert Q_NAME in {s.kernel for s in plan.skipped}
    else:
        q_keys = plan.kernel(Q_NAME).keys
        fp8 = torch.float8_e4m3fnuz if platform.fp8_fnuz else torch.float8_e4m3fn
        for tokens in (1, 3, 64, 1000, serving["max_num_batched_tokens"]):
            # index_q = wq_b(qr).view(T, H, D): a fresh contiguous GEMM output; weights_proj(hidden) likewise
            q = warmreg.meta((tokens, m.index_n_heads * m.index_head_dim), torch.bfloat16).view(
                tokens, m.index_n_heads, -1
            )
            w = warmreg.meta((tokens, m.index_n_heads), torch.bfloat16)
            key = IndexerQRopeQuant().dispatch(
                index_q=q, index_weights=w, cos_sin_cache=cos_sin, fp8_dtype=fp8, explicit_fma=platform.is_rocm
            )
            assert key in q_keys, key
    kv_keys = plan.kernel(KV_NAME).keys
    tokens_per_page = serving["block_size"] // 4
    # state pages of 4 tokens x (kv | score) x 2 halves; the indexer cache as the KV manager lays it out
    state = warmreg.meta((50_000, 4, 4 * m.index_head_dim), torch.float32)
    cache = warmreg.meta((9000, tokens_per_page, 132), torch.uint8, stride=(8640, 132, 1))
    kv_key = IndexerKVCompressInsert().dispatch(
        state_cache=state, kv_cache=cache, norm_weight=warmreg.meta((m.index_head_dim,), torch.bfloat16),
        cos_sin_cache=cos_sin, compress_ratio=4, mx_scale=platform.is_cuda and platform.sm // 10 == 10,
    )  # fmt: skip
    assert kv_keys == (kv_key,)


@pytest.mark.parametrize("target", TARGETS)
def test_warm_cross_compiles(target: str) -> None:
    """Both kernels compile for real: e4m3fn/fp32 scales (sm90), UE8M0 scales (sm100), fnuz + fma (gfx942)."""
    report = warmreg.warm(
        CONFIGS[0], target=target, plugins=[IndexerPlugin()], entry_points=False, workers=2, on_error="continue"
    )
    failures = [(r.kernel, str(r.key), r.error) for r in report.failed]
    assert report.ok, failures
    assert len(report.results) == 2
    # compiled now (fresh TRITON_CACHE_DIR), unless an earlier test of this process warmed the same target
    assert report.compiled > 0 or all(r.status == "memory" for r in report.results)


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def _indexer_q_call() -> OpCall:
    torch.manual_seed(3)
    kw = dict(q_inputs(3, heads=2), fp8_dtype=torch.float8_e4m3fn, explicit_fma=False)
    return OpCall(IndexerQRopeQuant(), (), kw)


def test_indexer_q_out() -> None:
    check_out(_indexer_q_call, tuple_error=r"out must be a tuple of \d buffers")
