"""ROCm's single-pass sparse MLA decode (the archs without vLLM's split-KV tuning): the reference under Triton's
interpreter on fp8_ds_mla pages (OCP and FNUZ SWA caches, OCP compressed cache), the sink (finite, ``-inf``, none),
rows without keys, two head blocks, strided q, errors, out=, the plan (every ROCm arch but gfx942 and gfx950) and a
real cross-compile. The NaN scrub is not tested here: Triton 3.8's interpreter converts the e4m3fn NaN code 0x7f to
480, not NaN (the reference's scrub is tested in ``test_rocm_sparse_attn_decode.py``; vLLM's kernel reads the same
480 under the interpreter, so the differential test compares NaN codes too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_sparse_attn_decode_ragged
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_sparse_attn_decode_ragged import RocmSparseAttnDecodeRagged, decode_ragged_reference

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
    """``[pages, bs, 584]`` fp8_ds_mla pages at the allocated page stride: e4m3 NoPE values, bf16 RoPE, scales 2**-9
    to 2**-4."""
    flat = torch.zeros(pages, page_bytes(bs), dtype=U8)
    tokens = flat[:, : bs * 576].view(pages, bs, 576)
    nope = (torch.randn(pages, bs, 448, generator=g) * 30).clamp(-200, 200)
    tokens[..., :448] = nope.to(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn).view(U8)
    tokens[..., 448:] = torch.randn(pages, bs, 64, generator=g).to(BF16).view(U8)
    flat[:, bs * 576 : bs * 584] = torch.randint(118, 124, (pages, bs * 8), generator=g).to(U8)
    return flat[:, : bs * 584].view(pages, bs, 584)


def _stream(g: torch.Generator, lens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *lens], dtype=I32).cumsum(0).to(I32)
    return torch.randint(-1, rows + 3, (int(indptr[-1]) + 2,), generator=g, dtype=I32), indptr


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # the kernel rounds each tile's probabilities to bf16 for the value dot (a relative 2**-9 a term), sums the
    # scores' lanes in another order and rounds the output to bf16 (2**-8): within one bf16 step of outputs ~1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize(
    ("heads", "extra", "fnuz", "sink"),
    [(8, True, False, "finite"), (19, True, True, "finite"), (3, False, False, "none"), (16, True, False, "-inf")],
)
def test_decode_matches_reference(heads: int, extra: bool, fnuz: bool, sink: str) -> None:
    """A C4/C128-like layer on OCP caches; 19 heads (two head blocks, the second partial) with a FNUZ SWA cache; an
    SWA-only layer without a sink; a sink at ``-inf`` (a padded head). Query 1 has no compressed keys."""
    g = torch.Generator().manual_seed(heads * 3 + extra)
    q = torch.randn(3, heads, 512, generator=g).to(BF16)
    main, extra_cache = fp8_pages(g, 4, 16, fnuz), fp8_pages(g, 3, 64, False)
    mi, mp = _stream(g, [20, 15, 25], 64)
    ei, ep = _stream(g, [40, 0, 60], 192)
    attn_sink = None if sink == "none" else torch.randn(heads + 2, generator=g)
    if sink == "-inf" and attn_sink is not None:
        attn_sink[:] = float("-inf")
    segments = [(main, mi, mp, fnuz)] + ([(extra_cache, ei, ep, False)] if extra else [])
    args = (q, main, mi, mp, *((extra_cache, ei, ep) if extra else ()))
    got = RocmSparseAttnDecodeRagged()(*args, attn_sink=attn_sink, scale=0.05, fnuz_main=fnuz)
    assert got.dtype == BF16 and got.shape == q.shape
    _close(got, decode_ragged_reference(q, segments, attn_sink, scale=0.05))


def test_rows_without_keys_and_strided_q() -> None:
    """A query whose slots are all skipped (out of range or -1) writes exactly zeros without a sink and is the sink's
    alone (still zeros) with one; q a head-sliced view (row stride 8 * 512) of a wider buffer."""
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 8, 512, generator=g).to(BF16)
    q = wide[:, 2:7]
    main = fp8_pages(g, 2, 4, False)
    mi = torch.tensor([-1, 99, 3, 5, 6], dtype=I32)
    mp = torch.tensor([0, 2, 5], dtype=I32)
    for sink in (None, torch.randn(5, generator=g)):
        got = RocmSparseAttnDecodeRagged()(q, main, mi, mp, attn_sink=sink, scale=0.1, fnuz_main=False)
        assert torch.equal(got[0], torch.zeros(5, 512, dtype=BF16))
        _close(got, decode_ragged_reference(q, [(main, mi, mp, False)], sink, scale=0.1))


def test_launch_errors() -> None:
    g = torch.Generator().manual_seed(2)
    q, main = torch.randn(1, 2, 512, generator=g).to(BF16), fp8_pages(g, 1, 4, False)
    mi, mp = _stream(g, [3], 4)
    kernel = RocmSparseAttnDecodeRagged()
    with pytest.raises(warmreg.LaunchError, match="q must be bf16"):
        kernel(q.float(), main, mi, mp, attn_sink=None, scale=1.0, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="main_cache must be"):
        kernel(q, main[..., :500], mi, mp, attn_sink=None, scale=1.0, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="extra_indptr must be"):
        kernel(q, main, mi, mp, main, mi, mp[:1], attn_sink=None, scale=1.0, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="together, or none"):
        kernel(q, main, mi, mp, main, attn_sink=None, scale=1.0, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="attn_sink must be"):
        kernel(q, main, mi, mp, attn_sink=torch.zeros(1), scale=1.0, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="out"):
        kernel(q, main, mi, mp, attn_sink=None, scale=1.0, fnuz_main=False, out=torch.empty(1, 2, 512))


def _plan(target: str, example: str = "deepseek_v4_flash") -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_sparse_attn_decode_ragged.register, model=DSV4.from_config)
    return warmreg.plan(example_config(example), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(("target", "fnuz"), [("rocm:gfx1250", False), ("rocm:gfx1201", False), ("rocm:gfx1100", False),
                                              ("rocm:gfx90a", False), ("rocm:gfx940", True)])  # fmt: skip
def test_planned_off_gfx942_and_gfx950(target: str, fnuz: bool) -> None:
    """Flash has SWA-only, C4 and C128 layers: the SWA segment alone, and with the compressed one; the sink always;
    16 keys a tile for the 512-wide heads; the SWA cache FNUZ where the arch's FP8 is (gfx940: vLLM's ``gfx94``)."""
    keys = _plan(target).kernel(RocmSparseAttnDecodeRagged.name).keys
    assert sorted((k.has_extra, k.has_sink, k.fnuz_main, k.fnuz_extra, k.nope, k.rope, k.block_h, k.block_k,
                   k.num_warps) for k in keys) == [
        (False, True, fnuz, False, 448, 64, 16, 16, 8),
        (True, True, fnuz, False, 448, 64, 16, 16, 8),
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(RocmSparseAttnDecodeRagged(), keys)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "cuda:90", "cuda:100"])
def test_not_planned_on_the_split_kv_archs_or_cuda(target: str) -> None:
    """gfx942 and gfx950 run the split-KV decode (``rocm_sparse_attn_decode_partial`` / ``_gfx950``, or aiter's
    sparse MLA: gfx950 too); CUDA runs FlashMLA. The predicate reads no target feature (this plugin alone knows
    none, so ``+aiter`` targets are covered by the sweep test)."""
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx1250() -> None:
    plugin = RegisterPlugin(rocm_sparse_attn_decode_ragged.register, model=DSV4.from_config)
    report = warmreg.warm(
        example_config("deepseek_v4_flash"), target="rocm:gfx1250", plugins=[plugin], entry_points=False, workers=1
    )
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        g = torch.Generator().manual_seed(6)
        q, main = torch.randn(2, 3, 512, generator=g).to(BF16), fp8_pages(g, 2, 4, False)
        mi, mp = _stream(g, [5, 3], 8)
        return OpCall(
            RocmSparseAttnDecodeRagged(), (q, main, mi, mp),
            {"attn_sink": torch.randn(3, generator=g), "scale": 0.1, "fnuz_main": False},
        )  # fmt: skip

    check_out(build)
