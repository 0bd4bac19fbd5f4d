"""ROCm's sparse MLA decode, split-KV partial pass (and the gfx942 pipeline of partial and reduce): the reference under
Triton's interpreter on fp8_ds_mla pages (FNUZ SWA cache, OCP compressed cache), splits with and without keys, the
NaN scrub, the split count as vLLM picks it, errors, out=, the plan (gfx942 without aiter's sparse MLA), and real
cross-compiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_sparse_attn_decode
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4._rocm_decode_splits import decode_num_splits, partial_iters
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_sparse_attn_decode import (
    RocmSparseAttnDecodePartial,
    decode_gfx942,
    decode_partial_reference,
    dequant_fp8_ds_mla,
)
from warmreg_deepseek_v4.rocm_sparse_attn_reduce import decode_reduce_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8


@pytest.fixture(autouse=True)
def _bf16_by_value() -> Iterator[None]:
    """Triton 3.8's interpreter computes on raw bf16 bits (dots, products, comparisons): by value here (see
    :mod:`warmreg_deepseek_v4._interpreter_dot`); compiled kernels are untouched."""
    with bf16_dot_by_value():
        yield


def fp8_pages(g: torch.Generator, pages: int, bs: int, fnuz: bool) -> torch.Tensor:
    """``[pages, bs, 584]`` fp8_ds_mla pages at the allocated page stride: e4m3 NoPE values, bf16 RoPE, scales 2**-6..."""
    flat = torch.zeros(pages, page_bytes(bs), dtype=U8)
    tokens = flat[:, : bs * 576].view(pages, bs, 576)
    nope = (torch.randn(pages, bs, 448, generator=g) * 30).clamp(-200, 200)
    tokens[..., :448] = nope.to(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn).view(U8)
    tokens[..., 448:] = torch.randn(pages, bs, 64, generator=g).to(BF16).view(U8)
    scales = flat[:, bs * 576 : bs * 584].view(pages, bs, 8)
    scales[..., :7] = torch.randint(118, 124, (pages, bs, 7), generator=g).to(U8)
    return flat[:, : bs * 584].view(pages, bs, 584)


def _stream(g: torch.Generator, lens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *lens], dtype=I32).cumsum(0).to(I32)
    return torch.randint(-1, rows + 3, (int(indptr[-1]) + 2,), generator=g, dtype=I32), indptr


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    # the kernel rounds each tile's probabilities to bf16 for the value dot (a relative 2**-9 a term) and sums the
    # scores' lanes in another order: the maxima agree to fp32 rounding, the sums within 2**-7 of their size
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=2**-7)
    torch.testing.assert_close(got[2], want[2], atol=0.1, rtol=2**-7)


@pytest.mark.parametrize(("splits", "heads", "extra"), [(1, 8, True), (3, 19, True), (4, 3, False), (16, 8, True)])
def test_partial_matches_reference(splits: int, heads: int, extra: bool) -> None:
    """One split; 19 heads (two head blocks); an SWA-only layer; more splits than a short segment has keys (splits
    without keys keep fp32's lowest, 0 and zeros)."""
    g = torch.Generator().manual_seed(splits * heads)
    q = torch.randn(3, heads, 512, generator=g).to(BF16)
    main, extra_cache = fp8_pages(g, 4, 16, True), fp8_pages(g, 3, 64, False)
    mi, mp = _stream(g, [20, 15, 25], 64)
    ei, ep = _stream(g, [40, 0, 60], 192)
    segments = [(main, mi, mp, True)] + ([(extra_cache, ei, ep, False)] if extra else [])
    args = (q, main, mi, mp, *((extra_cache, ei, ep) if extra else ()))
    got = RocmSparseAttnDecodePartial()(*args, scale=0.05, num_splits=splits, fnuz_main=True)
    _close(got, decode_partial_reference(q, segments, scale=0.05, num_splits=splits))


def test_dequant_scrubs_nan_and_reads_fnuz() -> None:
    """A NaN code reads as 0 (e4m3fn 0x7f; e4m3fnuz 0x80), the RoPE tail is the stored bf16."""
    g = torch.Generator().manual_seed(1)
    for fnuz, nan in ((False, 0x7F), (True, 0x80)):
        cache = fp8_pages(g, 1, 2, fnuz)
        flat = cache.as_strided((1, 2 * 584), (cache.stride(0), 1))
        flat[0, 576 + 5] = nan  # token 1, lane 5
        k = dequant_fp8_ds_mla(cache, torch.tensor([1]), fnuz=fnuz)
        assert k[0, 5] == 0 and not k.isnan().any()
        assert torch.equal(k[0, 448:], flat[0, 576 + 448 : 2 * 576].view(BF16))


def test_split_count_as_vllm_picks_it() -> None:
    """gfx942: a lone query fills the device with 16 splits of a long segment, then snaps down to the fewest splits
    with the same waves and tiles; a batch that fills the device takes 1. gfx950: 4 splits where they walk at most 3
    tiles."""
    assert partial_iters(128, 512, 4, 32) == 1 + 4
    assert decode_num_splits(1, 1, 128, 512, cu=304, gfx950=False) == 16
    assert decode_num_splits(1, 1, 30, 0, cu=304, gfx950=False) == 1  # one tile whatever the split: snaps to 1
    assert decode_num_splits(304, 1, 128, 512, cu=304, gfx950=False) == 1
    assert decode_num_splits(20, 1, 128, 128, cu=256, gfx950=True) == 4


def test_pipeline_equals_partial_then_reduce() -> None:
    """:func:`decode_gfx942`: vLLM's split count, the partial pass and the reduce with the sink and the
    rotation; against the two references chained (the reduce's reordering: within a bf16 step)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 512, generator=g).to(BF16)
    main, extra = fp8_pages(g, 4, 16, True), fp8_pages(g, 3, 64, False)
    mi, mp = _stream(g, [30, 12], 64)
    ei, ep = _stream(g, [100, 80], 192)
    sink, pos, cs = torch.randn(8, generator=g), torch.tensor([4, 9]), torch.randn(10, 64, generator=g)
    out = torch.empty(2, 8, 512, dtype=BF16)
    got = decode_gfx942(q, (main, mi, mp), (extra, ei, ep), sink, scale=0.05, fnuz=True, positions=pos,
                                  cos_sin_cache=cs, out=out, cu=304)  # fmt: skip
    splits = decode_num_splits(2, 1, mi.numel() / 2, ei.numel() / 2, cu=304, gfx950=False)
    parts = decode_partial_reference(q, [(main, mi, mp, True), (extra, ei, ep, False)], scale=0.05, num_splits=splits)
    want = decode_reduce_reference(*parts, sink, positions=pos, cos_sin_cache=cs)
    assert got.data_ptr() == out.data_ptr() and splits > 1
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2**-6)


def test_launch_errors() -> None:
    g = torch.Generator().manual_seed(2)
    q, main = torch.randn(1, 2, 512, generator=g).to(BF16), fp8_pages(g, 1, 4, False)
    mi, mp = _stream(g, [3], 4)
    kernel = RocmSparseAttnDecodePartial()
    with pytest.raises(warmreg.LaunchError, match="q must be bf16"):
        kernel(q.float(), main, mi, mp, scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="main_cache must be"):
        kernel(q, main[..., :500], mi, mp, scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="main_indptr must be"):
        kernel(q, main, mi, mp[:1], scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="together, or none"):
        kernel(q, main, mi, mp, main, scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="num_splits"):
        kernel(q, main, mi, mp, scale=1.0, num_splits=0, fnuz_main=False)


def _plan(target: str, example: str = "deepseek_v4_flash") -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_sparse_attn_decode.register, model=DSV4.from_config)
    return warmreg.plan(example_config(example), target=target, plugins=[plugin], entry_points=False)


def test_planned_on_gfx942_swa_and_compressed_layers() -> None:
    """Flash has SWA-only, C4 and C128 layers: the SWA segment alone, and with the compressed one; gfx942's SWA cache
    is FNUZ."""
    keys = _plan("rocm:gfx942").kernel(RocmSparseAttnDecodePartial.name).keys
    assert sorted((k.has_extra, k.fnuz_main, k.fnuz_extra, k.nope, k.rope, k.block_h, k.block_k) for k in keys) == [
        (False, True, False, 448, 64, 16, 32),
        (True, True, False, 448, 64, 16, 32),
    ]
    assert_warmup_inputs_reproduce(RocmSparseAttnDecodePartial(), keys)


@pytest.mark.parametrize("target", ["rocm:gfx950", "rocm:gfx950+aiter", "cuda:90"])
def test_not_planned_off_gfx942(target: str) -> None:
    """gfx950 runs its own partial kernel (``rocm_sparse_attn_decode_gfx950``); CUDA runs FlashMLA."""
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx942() -> None:
    plugin = RegisterPlugin(rocm_sparse_attn_decode.register, model=DSV4.from_config)
    report = warmreg.warm(
        example_config("deepseek_v4_flash"), target="rocm:gfx942", plugins=[plugin], entry_points=False, workers=1
    )
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        g = torch.Generator().manual_seed(6)
        q, main = torch.randn(2, 3, 512, generator=g).to(BF16), fp8_pages(g, 2, 4, False)
        mi, mp = _stream(g, [5, 3], 8)
        return OpCall(
            RocmSparseAttnDecodePartial(), (q, main, mi, mp), {"scale": 0.1, "num_splits": 2, "fnuz_main": False}
        )

    check_out(build)
