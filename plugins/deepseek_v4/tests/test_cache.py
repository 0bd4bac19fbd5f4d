"""The ``fp8_ds_mla`` cache kernels: gather and insert against their references (Triton interpreter),
an insert -> gather round trip within the FP8 bound, and warm coverage of runtime-shaped gathers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from warmreg_deepseek_v4 import DSV4, cache_insert
from warmreg_deepseek_v4 import cache as cache_module
from warmreg_deepseek_v4.cache import DequantGatherKCache, dequant_gather_k_reference
from warmreg_deepseek_v4.cache_insert import AMAX_FLOOR, WRITER_FP8_MAX, QuantInsertKCache, quant_insert_k_reference
from warmreg_deepseek_v4.fp8_ds_mla import (
    HEAD_DIM,
    NOPE_DIM,
    SCALE_BYTES,
    TOKEN_BYTES,
    PagedCache,
    page_bytes,
    paged_caches,
)

import warmreg
from warmreg.testing import assert_warmup_inputs_reproduce

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FLASH, PRO = EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"
GATHER, INSERT = DequantGatherKCache.name, QuantInsertKCache.name
I32, BF16 = torch.int32, torch.bfloat16
FP8 = {False: torch.float8_e4m3fn, True: torch.float8_e4m3fnuz}


class _Plugin:
    """Registers this module's kernels (optionally only those named, optionally ignoring predicates)."""

    def __init__(self, *names: str, always: bool = False) -> None:
        self.names, self.always = set(names), always

    @warmreg.hookimpl
    def warmreg_register_kernels(
        self, registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        names, always = self.names, self.always

        class Only:
            def add(self, kernel: warmreg.TritonKernel[Any], *, when: Any = True) -> None:
                if not names or kernel.name in names:
                    registry.add(kernel, when=True if always else when)

        model = DSV4.from_config(config)
        for module in (cache_module, cache_insert):
            module.register(Only(), model, config, platform)  # type: ignore[arg-type]


def _gather() -> DequantGatherKCache:
    return DequantGatherKCache(cache=PagedCache("swa", 64, (page_bytes(64),), 16))


def _cache(pages: int, bs: int, *, padded: bool = True) -> torch.Tensor:
    """Zeroed pages ``[pages, bs, 584]`` at the allocated page stride (padding at the end of each page)."""
    stride = page_bytes(bs) if padded else bs * (TOKEN_BYTES + SCALE_BYTES)
    flat = torch.zeros(pages, stride, dtype=torch.uint8)
    return flat[:, : bs * (TOKEN_BYTES + SCALE_BYTES)].view(pages, bs, TOKEN_BYTES + SCALE_BYTES)


def _k(tokens: int, *, seed: int = 0, width: int = HEAD_DIM, offset: int = 0) -> torch.Tensor:
    """bf16 ``[tokens, 512]`` (a view of rows ``width`` long starting ``offset`` elements in) whose 64-blocks
    span magnitudes from 1e-6 to 1e4, with an all-zero block and ties of the e4m3 grid."""
    gen = torch.Generator().manual_seed(seed)
    mags = 10.0 ** torch.linspace(-6, 4, HEAD_DIM // 64).repeat_interleave(64)
    x = torch.randn(tokens, HEAD_DIM, generator=gen) * mags
    if tokens:
        x[0, 64:128] = 0.0  # amax 0: scale byte 0, every code 0
        x[-1, :64] = torch.tensor([448.0, 17.0, 8.5, 2.125, -4.25, 7.96875, -0.0, 2.0**-9] * 8)  # ties and edges
    buf = torch.zeros(tokens * width + offset, dtype=BF16)
    view = buf[offset:].view(tokens, width)[:, :HEAD_DIM]
    view.copy_(x.to(BF16))
    return view


def _storage(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's storage, padding included."""
    return torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())


def _scale_bytes(cache: torch.Tensor, slots: torch.Tensor, bs: int) -> torch.Tensor:
    """The 8 scale bytes of each slot: page ``slot // bs`` at ``bs * 576 + (slot % bs) * 8``."""
    return torch.stack([cache[int(s) // bs].view(-1)[bs * TOKEN_BYTES + int(s) % bs * 8 :][:8] for s in slots])


def _filled(k: torch.Tensor, slots: torch.Tensor, pages: int, bs: int, use_fnuz: bool = False) -> torch.Tensor:
    cache = _cache(pages, bs)
    return quant_insert_k_reference(k, cache, slots, block_size=bs, use_fnuz=use_fnuz)


# -- insert -------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_fnuz", [False, True])
@pytest.mark.parametrize(
    ("tokens", "bs", "width", "offset"), [(5, 64, HEAD_DIM, 0), (3, 2, 600, 3), (1, 2, HEAD_DIM, 0)]
)
def test_insert_matches_reference_bit_exact(use_fnuz: bool, tokens: int, bs: int, width: int, offset: int) -> None:
    """FP8 codes and UE8M0 bytes are exact functions of the input: every byte must match (padding untouched)."""
    k = _k(tokens, width=width, offset=offset)
    slots = torch.tensor([3, -1, 0, 5, 2][:tokens], dtype=torch.int64)
    slots[-1] = 1  # T = 1 writes too
    cache, ref = _cache(4, bs), _cache(4, bs)
    QuantInsertKCache(block_size=bs)(k, cache, slots, block_size=bs, use_fnuz=use_fnuz)
    quant_insert_k_reference(k, ref, slots, block_size=bs, use_fnuz=use_fnuz)
    assert torch.equal(_storage(cache), _storage(ref))
    scales = _scale_bytes(cache, slots[slots >= 0], bs)
    assert scales[:, -1].eq(0).all() and scales[:, :7].ne(0).any()  # the pad byte is 0


@pytest.mark.parametrize(("use_fnuz", "byte"), [(False, 105), (True, 106)])
def test_insert_floors_the_block_amax_at_1e_4_as_vllm_does(use_fnuz: bool, byte: int) -> None:
    """vLLM's writer (``quantize_and_insert_k_kernel``) takes ``max(amax, 1e-4)`` before the UE8M0 scale, with
    ``fp8_max`` 448 (224 on a FNUZ platform): an all-zero block gets ``ceil(log2(1e-4 / 448)) + 127 = 105`` (106),
    and a block of tiny values is quantized at that scale, not at its own."""
    k = torch.zeros(2, HEAD_DIM, dtype=BF16)
    k[1, :64] = 3e-6  # amax below the floor: coded at the floor's scale, 3e-6 * 2**22 = 12.56 -> e4m3 13.0
    cache = _cache(1, 2)
    QuantInsertKCache(block_size=2)(k, cache, torch.tensor([0, 1]), block_size=2, use_fnuz=use_fnuz)
    scales = _scale_bytes(cache, torch.tensor([0, 1]), 2)
    assert scales[:, :7].eq(byte).all() and scales[:, 7].eq(0).all()
    codes = cache[0].view(-1)[TOKEN_BYTES : TOKEN_BYTES + 64].view(FP8[use_fnuz]).float()
    assert codes.eq((k[1, :64].float() * 2.0 ** (127 - byte)).to(FP8[use_fnuz]).float()).all()


def test_insert_of_a_block_holding_an_infinity_is_vllms() -> None:
    """vLLM's scale for an infinite amax is inf (byte 255), so the block's finite values code as +-0 and the
    infinity itself as ``clamp(inf / inf)``, a NaN the NaN-ignoring clamp takes to -448 (0xFE)."""
    k = _k(1)
    k[0, 64:128] = 300.0
    k[0, 65], k[0, 66] = float("inf"), -5.0
    cache, ref = _cache(1, 2), _cache(1, 2)
    QuantInsertKCache(block_size=2)(k, cache, torch.tensor([0]), block_size=2)
    quant_insert_k_reference(k, ref, torch.tensor([0]), block_size=2)
    assert torch.equal(_storage(cache), _storage(ref))
    codes = cache[0].view(-1)[64:128]
    assert int(_scale_bytes(cache, torch.tensor([0]), 2)[0, 1]) == 255
    assert int(codes[1]) == 0xFE and int(codes[2]) == 0x80 and codes[3:].eq(0).all()


def test_insert_writes_only_the_slot_mapping_tokens_under_dp_padding() -> None:
    """Under DP padding ``slot_mapping`` is shorter than ``k``: vLLM launches ``slot_mapping.shape[0]`` programs."""
    k = _k(3)
    cache, ref = _cache(2, 2), _cache(2, 2)
    QuantInsertKCache(block_size=2)(k, cache, torch.tensor([2, 0]), block_size=2)
    quant_insert_k_reference(k[:2], ref, torch.tensor([2, 0]), block_size=2)
    assert torch.equal(_storage(cache), _storage(ref))


def test_insert_skips_padded_tokens_and_empty_batches() -> None:
    cache = _cache(2, 2)
    kernel = QuantInsertKCache(block_size=2)
    kernel(_k(0), cache, torch.empty(0, dtype=torch.int64), block_size=2)
    kernel(_k(2), cache, torch.tensor([-1, -1]), block_size=2)
    assert cache.eq(0).all()


# -- gather -------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_fnuz", [False, True])
def test_gather_decodes_every_fp8_byte_exactly(use_fnuz: bool) -> None:
    """Raw bytes 0..255 under scale bytes 120..134: the output is bit-exact torch decoding, the NaN codes
    (0x7F/0xFF; 0x80 in e4m3fnuz) giving NaN as in vLLM's gather."""
    cache = _cache(1, 2)
    codes = torch.arange(NOPE_DIM * 2, dtype=torch.int64).remainder(256).to(torch.uint8)
    page = cache[0].view(-1)
    for j in range(2):
        page[j * TOKEN_BYTES : j * TOKEN_BYTES + NOPE_DIM] = codes[j * NOPE_DIM : (j + 1) * NOPE_DIM]
        page[j * TOKEN_BYTES + NOPE_DIM : (j + 1) * TOKEN_BYTES] = torch.randn(64).to(BF16).view(torch.uint8)
    page[2 * TOKEN_BYTES : 2 * TOKEN_BYTES + 16] = torch.arange(120, 136, dtype=torch.uint8)
    seq_lens, table = torch.tensor([2], dtype=I32), torch.zeros(1, 1, dtype=I32)
    out, ref = torch.zeros(1, 2, HEAD_DIM, dtype=BF16), torch.zeros(1, 2, HEAD_DIM, dtype=BF16)
    _gather()(out, cache, seq_lens, table, block_size=2, use_fnuz=use_fnuz)
    dequant_gather_k_reference(ref, cache, seq_lens, table, block_size=2, use_fnuz=use_fnuz)
    nan = ref.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan)  # NaN payloads aside
    assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))


@pytest.mark.parametrize("use_fnuz", [False, True])
def test_swa_gather_with_gather_lens_and_offset(use_fnuz: bool) -> None:
    """SWA gather: the last glen tokens of each sequence land at rows offset.. (offset 5: class 'other');
    a sliced block table (unaligned, odd width) and sliced seq_lens work; other rows stay untouched."""
    bs, pages = 64, 5
    table_full = torch.tensor([[9, 9, 9], [4, 1, 3], [0, 2, 4], [3, 4, 1]], dtype=I32)  # width 3
    table = table_full[1:]  # an offset view: alignment of the index pointers is not specialized
    seq_lens = torch.tensor([0, 70, 130, 3], dtype=I32)[1:]
    gather_lens = torch.tensor([6, 4, 3], dtype=I32)  # crosses a page boundary for request 0 (64..69)
    slots = torch.arange(pages * bs, dtype=torch.int64)
    cache = _filled(_k(pages * bs, seed=1), slots, pages, bs, use_fnuz)
    out = torch.full((3, 12, HEAD_DIM), -7.0, dtype=BF16)
    ref = out.clone()
    _gather()(out, cache, seq_lens, table, block_size=bs, offset=5, gather_lens=gather_lens, use_fnuz=use_fnuz)
    dequant_gather_k_reference(
        ref, cache, seq_lens, table, block_size=bs, offset=5, gather_lens=gather_lens, use_fnuz=use_fnuz
    )
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))  # a scaled e4m3 value is exact in bf16
    assert out[:, :5].eq(-7).all() and out[1, 9:].eq(-7).all()


def test_compressed_gather_c128_pages_of_two() -> None:
    """Compressed gather (gather_lens None: whole sequence at offset 0), 2-token pages, odd page counts, T = 1."""
    bs = 2
    cache = _filled(_k(7 * bs, seed=2), torch.arange(7 * bs), 7, bs)
    table = torch.tensor([[6, 0, 5, 1], [2, 3, 0, 0]], dtype=I32)
    seq_lens = torch.tensor([7, 1], dtype=I32)  # 4 pages (last one half used), and one token
    out, ref = torch.zeros(2, 8, HEAD_DIM, dtype=BF16), torch.zeros(2, 8, HEAD_DIM, dtype=BF16)
    _gather()(out, cache, seq_lens, table, block_size=bs)
    dequant_gather_k_reference(ref, cache, seq_lens, table, block_size=bs)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_gather_of_no_request_or_no_row_launches_nothing() -> None:
    cache, table = _cache(1, 2), torch.zeros(1, 1, dtype=I32)
    out = torch.zeros(0, 4, HEAD_DIM, dtype=BF16)
    assert _gather()(out, cache, torch.zeros(0, dtype=I32), table, block_size=2) is out
    full = torch.zeros(1, 4, HEAD_DIM, dtype=BF16)
    _gather()(full, cache, torch.ones(1, dtype=I32), table, block_size=2, offset=4)
    assert full.eq(0).all()


def test_round_trip_is_within_the_fp8_bound() -> None:
    """insert -> gather. Per element, |x - y| <= 2**-4 |x| + 2**-(bias+3) * scale: e4m3 keeps 3 mantissa bits
    (half an ulp is 2**-4 relative) and subnormal codes are multiples of 2**-(bias+2) * scale. The scale is the
    least power of two with fp8_max * scale >= max(amax, 1e-4) (fp8_max 224 for FNUZ, as vLLM's writer), and the
    RoPE half comes back bit-exact."""
    bs, tokens = 64, 9
    k = _k(tokens, seed=3)
    slots = torch.tensor([70, 71, 3, 4, 5, 127, 64, 0, 1], dtype=torch.int64)
    for use_fnuz, bias in ((False, 7), (True, 8)):
        cache = _cache(2, bs)
        QuantInsertKCache()(k, cache, slots, block_size=bs, use_fnuz=use_fnuz)
        seq_lens = (slots + 1).to(I32)  # request t gathers its last token: slot t
        table = torch.tensor([[0, 1]] * tokens, dtype=I32)
        out = torch.zeros(tokens, 1, HEAD_DIM, dtype=BF16)
        _gather()(
            out, cache, seq_lens, table, block_size=bs, gather_lens=torch.ones(tokens, dtype=I32), use_fnuz=use_fnuz
        )
        y = out[:, 0].float()
        x = k.float()
        scale_bytes = _scale_bytes(cache, slots, bs)[:, :7].to(torch.int32)
        scale = torch.ldexp(torch.ones(scale_bytes.shape), scale_bytes - 127).repeat_interleave(64, dim=1)
        err = (x[:, :NOPE_DIM] - y[:, :NOPE_DIM]).abs()
        assert (err <= 2.0**-4 * x[:, :NOPE_DIM].abs() + 2.0 ** -(bias + 3) * scale).all()
        amax = x[:, :NOPE_DIM].abs().view(tokens, 7, 64).amax(-1).repeat_interleave(64, dim=1).clamp(min=AMAX_FLOOR)
        fp8_max = WRITER_FP8_MAX[use_fnuz]
        assert ((fp8_max * scale >= amax) & (fp8_max * scale < 2 * amax)).all()
        assert torch.equal(y[:, NOPE_DIM:], x[:, NOPE_DIM:])


def test_bad_inputs_are_named() -> None:
    gather, cache, table = _gather(), _cache(2, 2), torch.zeros(1, 2, dtype=I32)
    out, seq = torch.zeros(1, 4, HEAD_DIM, dtype=BF16), torch.ones(1, dtype=I32)
    with pytest.raises(warmreg.LaunchError, match="page of 64 tokens"):
        gather(out, cache, seq, table, block_size=64)
    with pytest.raises(warmreg.LaunchError, match="seq_lens must be int32"):
        gather(out, cache, seq.long(), table, block_size=2)
    with pytest.raises(warmreg.LaunchError, match="16-byte aligned"):
        gather(torch.zeros(4 * HEAD_DIM + 1, dtype=BF16)[1:].view(1, 4, HEAD_DIM), cache, seq, table, block_size=2)
    with pytest.raises(warmreg.LaunchError, match="gather_lens"):
        gather(out, cache, seq, table, block_size=2, gather_lens=torch.ones(2, dtype=I32))
    with pytest.raises(warmreg.LaunchError, match="slot_mapping"):
        QuantInsertKCache()(_k(2), cache, torch.zeros(2, dtype=I32), block_size=2)


# -- warm coverage ------------------------------------------------------------------------------


def _runtime_gathers(model: DSV4, config: warmreg.WarmConfig, fnuz: bool) -> list[dict[str, Any]]:
    """What the prefill path passes per chunk: one compressed gather per compressed cache (offset 0) and the
    SWA gather at offset N (the chunk's largest compressed count), for chunks of 1, 7 and max_num_seqs requests."""
    seqs = config.get("serving.max_num_seqs", int, plugin="test")
    window, points = model.sliding_window, []
    for cache in paged_caches(model, config):
        k_cache = warmreg.meta(
            (1000, cache.block_size, TOKEN_BYTES + SCALE_BYTES), torch.uint8, stride=(cache.page_strides[0], 584, 1)
        )
        unified = warmreg.meta((1000, cache.page_strides[-1]), torch.uint8)
        for reqs in (1, 7, seqs):
            for n in (0, 1, 5, 16, 37, 2048, 262144) if cache.kind == "swa" else (1, 37, 8192):
                swa = cache.kind == "swa"
                out = warmreg.meta((reqs, n + window + 1, HEAD_DIM), BF16)
                for kc in (k_cache, unified):
                    points.append(dict(
                        out=out, k_cache=kc, block_size=cache.block_size, offset=n if swa else 0,
                        gather_lens=warmreg.meta((reqs,), I32, offset=3) if swa else None, use_fnuz=swa and fnuz,
                    ))  # fmt: skip
    return points


@pytest.mark.parametrize("example", [FLASH, PRO])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_runtime_gathers_hit_warmed_keys(example: Path, target: str) -> None:
    plan = warmreg.plan(example, target=target, plugins=[_Plugin()], entry_points=False)
    kp = plan.kernel(GATHER)
    model = DSV4.from_config(plan.config)
    for point in _runtime_gathers(model, plan.config, plan.platform.fp8_fnuz):
        key = kp.kernel.dispatch(**point)
        assert key in kp.keys, (key, point["offset"])
    assert len(kp.keys) == 5  # SWA x 3 offset classes + C4 + C128
    assert INSERT not in {k.name for k in plan.kernels}


def test_registration_follows_the_platform() -> None:
    names = {
        t: {k.name for k in warmreg.plan(FLASH, target=t, plugins=[_Plugin()], entry_points=False).kernels}
        for t in ("cuda:90+cutedsl", "xpu:pvc", "rocm:gfx950")
    }
    assert names["cuda:90+cutedsl"] == set()  # CuTeDSL replaces the Triton gather on CUDA
    assert names["xpu:pvc"] == {GATHER, INSERT}
    assert names["rocm:gfx950"] == {GATHER}
    fnuz = warmreg.plan(FLASH, target="rocm:gfx942", plugins=[_Plugin()], entry_points=False).kernel(GATHER).keys
    assert {(k.cache_block_size, k.has_gather_lens, k.use_fnuz) for k in fnuz} == {
        (64, True, True),
        (64, False, False),
        (2, False, False),
    }


def test_warmup_inputs_reproduce_every_key_including_unlikely_classes() -> None:
    gather, insert = _gather(), QuantInsertKCache()
    keys = warmreg.plan(FLASH, target="rocm:gfx942", plugins=[_Plugin()], entry_points=False).kernel(GATHER).keys
    variants = (
        {"out_stride0": "other"},
        {"out_stride1": "other"},
        {"block_stride": "other"},
        {"block_stride": "div16_i64"},
    )
    odd = [*keys, *(attrs.evolve(k, **v) for k in keys for v in variants)]
    assert_warmup_inputs_reproduce(gather, odd)
    for k in (_k(3, width=600, offset=1), _k(2)):
        key = insert.dispatch(k=k, k_cache=_cache(1, 64), block_size=64, use_fnuz=True)
        assert_warmup_inputs_reproduce(insert, [key])


def test_warm_cross_compiles_the_gather_for_cuda_and_gfx942() -> None:
    """Flash: 5 gather keys on cuda:90; 5 on gfx942 (the FNUZ SWA variants among them)."""
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(
            FLASH, target=target, plugins=[_Plugin(GATHER)], entry_points=False, workers=2, on_error="continue"
        )
        assert report.ok, [(r.key, r.error) for r in report.failed]
        assert report.compiled == 5


def test_warm_compiles_the_writer_for_a_real_backend() -> None:
    """The writer is registered for XPU only (not cross-compilable here); force it onto cuda:90 to prove it compiles."""
    report = warmreg.warm(
        FLASH, target="cuda:90", plugins=[_Plugin(INSERT, always=True)], entry_points=False, workers=2
    )
    assert report.ok and report.compiled == 1


def test_a_kv_cache_dtype_the_plugin_does_not_know_is_an_error_listing_the_known_ones() -> None:
    """``int3`` (or a typo) must not silently drop the FP8 cache kernels: the plan refuses it."""
    with pytest.raises(warmreg.ConfigError, match=r"serving.kv_cache_dtype' is 'int3', which warmreg-deepseek-v4 does not know "
                                                 r"\(accepted: fp8_ds_mla, auto, bfloat16, fp8, fp8_e4m3\)"):  # fmt: skip
        warmreg.plan(FLASH, target="cuda:90", plugins=[_Plugin()], entry_points=False, serving={"kv_cache_dtype": "int3"})

    def names(target: str, **serving: str) -> set[str]:
        plan = warmreg.plan(FLASH, target=target, plugins=[_Plugin()], entry_points=False, serving=serving)
        return {k.name for k in plan.kernels}

    # a known value still chooses the kernels: bf16 rows (FlashInfer on SM10x) have no fp8_ds_mla gather
    assert GATHER not in names("cuda:100", kv_cache_dtype="auto", attention_backend="FLASHINFER_MLA_SPARSE_DSV4")
    # auto is fp8_ds_mla on ROCm, as under FlashMLA (vLLM writes it back onto cache_config.cache_dtype)
    assert GATHER in names("rocm:gfx942", kv_cache_dtype="auto")
