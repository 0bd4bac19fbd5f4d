"""ROCm's FP8 paged MQA logits of the C4 indexer's decode: a hand-picked case, the reference under Triton's
interpreter (both FP8 flavours, per-row and per-request lengths, a narrow table, padded pages, split counts), errors,
the plan (gfx942 / gfx950 where the ROCm FP8 indexer runs; N = 2 only with one draft token) and cross-compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_indexer_logits
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_indexer_logits import RocmIndexerLogits, indexer_logits_reference, num_splits

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, U8, F32 = torch.int32, torch.uint8, torch.float32


def _cache(g: torch.Generator, pages: int, page: int, dim: int, fp8: torch.dtype, stride: int = 0) -> torch.Tensor:
    """Random FP8 keys and positive scales in block-flat pages (``stride`` bytes each: padded past the page)."""
    stride = stride or page * (dim + 4)
    backing = torch.zeros(pages * stride, dtype=U8)
    flat = backing.as_strided((pages, page * (dim + 4)), (stride, 1))
    flat[:, : page * dim] = (torch.randn(pages, page * dim, generator=g) * 2).to(fp8).view(U8)
    flat[:, page * dim :] = (torch.rand(pages, page, generator=g) + 0.5).view(U8).reshape(pages, -1)
    return backing.as_strided((pages, page, 1, dim + 4), (stride, dim + 4, dim + 4, 1))


def test_one_key_by_hand() -> None:
    """One request, one visible key of scale 2: ``2 * sum_h w_h relu(k . q_h)`` (16 heads, dim 16, page 64)."""
    q = torch.zeros(1, 1, 16, 16)
    q[0, 0, :, 0] = torch.arange(16) - 8.0  # q_h . k = (h - 8) * k_0
    kv = torch.zeros(2, 64, 1, 20, dtype=U8)
    flat = kv.view(2, -1)
    k = torch.zeros(64, 16)
    k[0, 0] = 1.5
    flat[1, : 64 * 16] = k.to(torch.float8_e4m3fn).view(U8).reshape(-1)
    flat[1, 64 * 16 :] = torch.full((64,), 2.0).view(U8)
    w = torch.ones(1, 16)
    out = torch.full((1, 8), -3.0)
    RocmIndexerLogits()(
        q.to(torch.float8_e4m3fn), kv, w, torch.tensor([1], dtype=I32), torch.tensor([[1]], dtype=I32), out=out
    )
    assert out[0, 0] == 2 * sum(1.5 * (h - 8) for h in range(9, 16)) and (out[0, 1:] == -3).all()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize(("next_n", "per_row", "splits"), [(1, True, 3), (2, True, 1), (2, False, 4), (3, True, 7)])
def test_matches_reference(fp8: torch.dtype, next_n: int, per_row: bool, splits: int) -> None:
    """Flash's indexer (64 heads of 128, 64-token pages padded to 576-byte units); three requests, one past its
    table's width (its tail not written), one with no visible key; the workspace's other entries untouched. fp32 dots
    of 128 exact FP8 products in another order than PyTorch's: a relative tolerance of 1e-5 of the row's largest."""
    g = torch.Generator().manual_seed(next_n * 10 + splits)
    batch, heads, dim, page, pages, width, m = 3, 64, 128, 64, 6, 3, 260
    kv = _cache(g, pages, page, dim, fp8, stride=64 * 132 + 192)
    q = (torch.randn(batch + 1, next_n, heads, dim, generator=g) * 2).to(fp8)[1:]  # an offset view
    w = torch.randn(batch * next_n + 2, heads, generator=g)
    per_request = torch.tensor([250, 70, 0], dtype=I32)
    if per_row:
        lens = (per_request[:, None] - next_n + 1 + torch.arange(next_n)).clamp_min(0).to(I32)
    else:
        lens = per_request
    table = torch.randint(0, pages, (batch + 1, width), generator=g, dtype=I32)
    out = torch.full((batch * next_n, m), float("nan"))
    want = indexer_logits_reference(q, kv, w, lens, table, out)
    got = RocmIndexerLogits()(q, kv, w, lens, table, out=out, splits=splits)
    assert got is out
    assert torch.equal(out.isnan(), want.isnan())  # written exactly where the reference writes
    scale = want.nan_to_num().abs().amax().item()
    torch.testing.assert_close(out.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5 * scale)


def test_split_count_is_vllms() -> None:
    """``max(1, min(CUs, cdiv(M, 64), 1024 // rows))``: a launch detail (the logits do not depend on it)."""
    assert num_splits(4, 65536, 304) == 256 and num_splits(2048, 65536, 256) == 1 and num_splits(1, 100, 256) == 2


def test_launch_errors() -> None:
    op, fp8 = RocmIndexerLogits(), torch.float8_e4m3fn
    q, kv = torch.zeros(1, 1, 16, 16, dtype=fp8), torch.zeros(2, 64, 1, 20, dtype=U8)
    w, lens, table, out = torch.zeros(1, 16), torch.ones(1, dtype=I32), torch.zeros(1, 2, dtype=I32), torch.zeros(1, 8)
    with pytest.raises(warmreg.LaunchError, match="q_fp8 must be"):
        op(q.float(), kv, w, lens, table, out=out)
    with pytest.raises(warmreg.LaunchError, match="kv_cache must be"):
        op(q, torch.zeros(2, 32, 1, 20, dtype=U8), w, lens, table, out=out)
    with pytest.raises(warmreg.LaunchError, match="weights must be"):
        op(q, kv, w.half(), lens, table, out=out)
    with pytest.raises(warmreg.LaunchError, match="context_lens must be"):
        op(q, kv, w, torch.ones(3, dtype=I32), table, out=out)
    with pytest.raises(warmreg.LaunchError, match="block_table must be"):
        op(q, kv, w, lens, table[:0], out=out)
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        op(q, kv, w, lens, table, out=torch.zeros(2, 8))


def _plan(target: str, value: str = "fp8", **serving: object) -> warmreg.Plan:
    config = example_config("deepseek_v4_flash")
    config["serving"].update(indexer_kv_dtype=value, **serving)
    plugin = RegisterPlugin(rocm_indexer_logits.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(
    ("target", "spec", "next_ns", "fnuz"),
    [("rocm:gfx950", 0, [1], False), ("rocm:gfx942+aiter", 1, [1, 2], True), ("rocm:gfx950+aiter", 3, [1], False)],
)
def test_planned_where_the_rocm_fp8_indexer_decodes(target: str, spec: int, next_ns: list[int], fnuz: bool) -> None:
    """N = 1 always; N = 2 with one draft token (native decode); more drafts flatten every token into its own row."""
    keys = _plan(target, num_speculative_tokens=spec).kernel(RocmIndexerLogits.name).keys
    assert sorted({k.next_n for k in keys}) == next_ns and len(keys) == 4 * len(next_ns)
    assert {k.over_2gb for k in keys} == {(), ("kv_cache",), ("out",), ("kv_cache", "out")}
    assert all(
        k.fields() == {"num_heads": 64, "head_dim": 128, "page": 64, "block_kv": 64, "next_n": k.next_n,
                       "ctx_per_row": True, "fnuz": fnuz, "num_warps": 4, "num_stages": 2, "over_2gb": k.over_2gb}
        for k in keys
    )  # fmt: skip
    assert_warmup_inputs_reproduce(RocmIndexerLogits(), keys)


@pytest.mark.parametrize(
    ("target", "value"),
    [("rocm:gfx950+aiter", "auto"), ("rocm:gfx942", "fp8"), ("rocm:gfx90a+aiter", "fp8"), ("cuda:90", "fp8")],
)
def test_not_planned_elsewhere(target: str, value: str) -> None:
    """MXFP4 (auto on gfx950 with aiter) scores on aiter's kernels; gfx942 without aiter has no ROCm indexer; other
    ROCm archs take aiter's logits; CUDA takes DeepGEMM's."""
    assert not _plan(target, value).kernels


@pytest.mark.parametrize("target", ["rocm:gfx942+aiter", "rocm:gfx950"])
def test_warm_cross_compiles(target: str) -> None:
    config = example_config("deepseek_v4_flash")
    config["serving"].update(indexer_kv_dtype="fp8", num_speculative_tokens=1)
    plugin = RegisterPlugin(rocm_indexer_logits.register, model=DSV4.from_config)
    report = warmreg.warm(config, target=target, plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 8, [(r.kernel, r.error) for r in report.failed]
