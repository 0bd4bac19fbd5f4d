"""gfx950's sparse MLA decode partial pass: the reference under Triton's interpreter (SWA-only, with a compressed
segment, trusted or scrubbed, adaptive splits), E8M0 byte 0, the gfx950 pipeline of partial and reduce, errors, the
plan (gfx950 without aiter's sparse MLA decode), out=, and a real cross-compile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_sparse_attn_decode_gfx950
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4._rocm_decode_splits import decode_num_splits
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_sparse_attn_decode_gfx950 import (
    RocmSparseAttnDecodeGfx950,
    decode_gfx950,
    decode_gfx950_partial_reference,
    work_splits,
)
from warmreg_deepseek_v4.rocm_sparse_attn_reduce import decode_reduce_reference
from warmreg_deepseek_v4.sweep_inputs import fp8_ds_mla_cache

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32 = torch.bfloat16, torch.int32
LOWEST = -3.4028234663852886e38


@pytest.fixture(autouse=True)
def _bf16_by_value() -> Iterator[None]:
    """Triton 3.8's interpreter computes on raw bf16 bits: by value here (:mod:`warmreg_deepseek_v4._interpreter_dot`)."""
    with bf16_dot_by_value():
        yield


def fp8_pages(g: torch.Generator, pages: int, bs: int, fnuz: bool) -> torch.Tensor:
    """The sweep's OCP fp8_ds_mla pages viewed ``[pages, bs, 584]`` at their stride, as vLLM's cache."""
    assert not fnuz
    flat = fp8_ds_mla_cache(pages, bs, g, torch.device("cpu"))
    return flat.as_strided((pages, bs, 584), (flat.stride(0), 584, 1))


def _case(seed: int, main_lens: list[int], extra_lens: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(main_lens), 8, 512, generator=g).to(BF16)
    main, extra = fp8_pages(g, 4, 16, False), fp8_pages(g, 3, 64, False)
    mp = torch.tensor([0, *main_lens], dtype=I32).cumsum(0).to(I32)
    ep = torch.tensor([0, *extra_lens], dtype=I32).cumsum(0).to(I32)
    mi = torch.randint(-1, 66, (int(mp[-1]) + 1,), generator=g, dtype=I32)
    ei = torch.randint(-1, 194, (int(ep[-1]) + 1,), generator=g, dtype=I32)
    return q, main, mi, mp, extra, ei, ep


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], active: torch.Tensor | None = None) -> None:
    # base-2 softmax and bf16 probabilities in the value dot: maxima to fp32 rounding, sums within 2**-7
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=2**-7)
    acc = got[2] if active is None else torch.where(active[..., None], got[2], want[2])
    torch.testing.assert_close(acc, want[2], atol=0.1, rtol=2**-7)


@pytest.mark.parametrize(("splits", "extra", "trust"), [(1, False, False), (3, True, True), (5, True, False)])
def test_matches_reference(splits: int, extra: bool, trust: bool) -> None:
    """SWA-only; a compressed segment the kernel trusts; one it scrubs (more splits than a short segment's keys)."""
    q, main, mi, mp, ec, ei, ep = _case(splits, [20, 15, 25], [40, 0, 100])
    segments = [(main, mi, mp, False)] + ([(ec, ei, ep, False)] if extra else [])
    args = (q, main, mi, mp, *((ec, ei, ep) if extra else ()))
    got = RocmSparseAttnDecodeGfx950()(*args, scale=0.05, num_splits=splits, fnuz_main=False, trust_extra=trust)
    _close(got, decode_gfx950_partial_reference(q, segments, scale=0.05, num_splits=splits))


def test_adaptive_splits_leave_the_rest_empty() -> None:
    """Adaptive, 8 splits: queries within 3 tiles of 128 keys work on 4; one past that on ``one_wave`` 6 (within 3
    tiles of 192); the splits past a query's work hold fp32's lowest and 0."""
    q, main, mi, mp, ec, ei, ep = _case(7, [20, 15, 25], [40, 0, 300])
    assert [work_splits(int(mp[t + 1] - mp[t]), int(ep[t + 1] - ep[t]), 8, 6, adaptive=True) for t in range(3)] == [
        4,
        4,
        6,
    ]
    kw = dict(scale=0.05, num_splits=8, adaptive=True, one_wave_splits=6)
    got = RocmSparseAttnDecodeGfx950()(q, main, mi, mp, ec, ei, ep, fnuz_main=False, trust_extra=True, **kw)
    want = decode_gfx950_partial_reference(q, [(main, mi, mp, False), (ec, ei, ep, False)], **kw)  # type: ignore[arg-type]
    assert (got[0][:2, 4:] == LOWEST).all() and (got[1][2, 6:] == 0).all()
    _close(got, want, active=want[0] > LOWEST)


def test_e8m0_zero_is_two_to_the_minus_127() -> None:
    """A scale byte 0 reads as the subnormal 2**-127: a NoPE lane of 448 * 2**-127, not 0."""
    q, main, mi, mp, *_ = _case(3, [1], [0])
    pages = main.as_strided((main.shape[0], 16 * 584), (main.stride(0), 1))
    pages[:, 16 * 576 : 16 * 584] = 0
    mi[:1] = 0
    got = RocmSparseAttnDecodeGfx950()(q, main, mi[:1], mp, scale=0.05, num_splits=1, fnuz_main=False)
    want = decode_gfx950_partial_reference(q, [(main, mi[:1], mp, False)], scale=0.05, num_splits=1)
    assert want[2][0, 0, 0, :448].abs().max() > 0
    _close(got, want)


def test_pipeline_equals_partial_then_reduce() -> None:
    q, main, mi, mp, ec, ei, ep = _case(11, [30, 12], [100, 80])
    sink, pos, cs = torch.zeros(8), torch.tensor([4, 9]), torch.randn(10, 64)
    got = decode_gfx950(q, (main, mi, mp), (ec, ei, ep), sink, scale=0.05, trust_extra=True, positions=pos,
                        cos_sin_cache=cs, cu=256)  # fmt: skip
    splits = decode_num_splits(2, 1, mi.numel() / 2, ei.numel() / 2, cu=256, gfx950=True)
    parts = decode_gfx950_partial_reference(q, [(main, mi, mp, False), (ec, ei, ep, False)], scale=0.05,
                                            num_splits=splits)  # fmt: skip
    want = decode_reduce_reference(*parts, sink, positions=pos, cos_sin_cache=cs)
    assert splits > 1
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2**-6)


def test_launch_errors() -> None:
    q, main, mi, mp, ec, ei, ep = _case(2, [3], [4])
    kernel = RocmSparseAttnDecodeGfx950()
    with pytest.raises(warmreg.LaunchError, match="512-lane heads"):
        kernel(q[..., :256].contiguous(), main, mi, mp, scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="together, or none"):
        kernel(q, main, mi, mp, ec, scale=1.0, num_splits=1, fnuz_main=False)
    with pytest.raises(warmreg.LaunchError, match="extra_indptr must be"):
        kernel(q, main, mi, mp, ec, ei, ep[:1], scale=1.0, num_splits=1, fnuz_main=False)


def _plan(target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_sparse_attn_decode_gfx950.register, model=DSV4.from_config)
    return warmreg.plan(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)


def test_planned_on_gfx950() -> None:
    """SWA-only (scrubbed), and with the trusted fp8_ds_mla compressed cache, adaptive or not (Flash has C128)."""
    keys = _plan("rocm:gfx950+aiter").kernel(RocmSparseAttnDecodeGfx950.name).keys
    assert sorted((k.has_extra, k.trust_extra, k.adaptive, k.fnuz_main) for k in keys) == [
        (False, False, False, False),
        (True, True, False, False),
        (True, True, True, False),
    ]
    assert_warmup_inputs_reproduce(RocmSparseAttnDecodeGfx950(), keys)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter+aiter_sparse_mla", "cuda:100"])
def test_not_planned(target: str) -> None:
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx950() -> None:
    plugin = RegisterPlugin(rocm_sparse_attn_decode_gfx950.register, model=DSV4.from_config)
    report = warmreg.warm(
        example_config("deepseek_v4_flash"), target="rocm:gfx950", plugins=[plugin], entry_points=False, workers=1
    )
    assert report.ok and report.compiled == 3, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        q, main, mi, mp, *_ = _case(6, [5, 3], [0, 0])
        return OpCall(
            RocmSparseAttnDecodeGfx950(), (q, main, mi, mp), {"scale": 0.1, "num_splits": 2, "fnuz_main": False}
        )

    check_out(build)
