"""ROCm's gather of the C4 indexer's FP8 K rows for prefill: a hand-picked case, the reference under Triton's
interpreter on padded pages with bad table entries and rows outside their request, both scale buffer forms, errors,
the plan (the FP8 indexer on ROCm with aiter or on gfx950), and real cross-compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_indexer_gather
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_indexer_gather import RocmIndexerKGather, indexer_k_gather_reference

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, U8 = torch.int32, torch.uint8


def _cache(pages: int, bs: int, d: int, stride: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes in pages of ``stride`` bytes (padded past ``bs * (d + 4)``), viewed ``[pages, bs, d + 4]``."""
    backing = torch.randint(0, 256, (pages * stride,), generator=g, dtype=torch.int64).to(U8)
    return backing.as_strided((pages, bs, d + 4), (stride, d + 4, 1))


def test_copies_the_rows_bytes_and_scale_bits() -> None:
    """Two requests of 3 rows, block size 2: request 1's second page is -1 (scale 0, bytes untouched)."""
    bs, d = 2, 16
    cache = torch.zeros(4, bs, d + 4, dtype=U8)
    for p in range(4):
        flat = cache[p].view(-1)
        flat[: bs * d] = torch.arange(bs * d, dtype=U8) + 40 * p
        flat[bs * d :].view(torch.float32)[:] = torch.tensor([p + 0.5, p + 0.25])
    k_fp8, k_scale = torch.full((6, d), 7, dtype=torch.float8_e4m3fn), torch.full((6, 4), 9, dtype=U8)
    table = torch.tensor([[3, 1], [2, -1]], dtype=I32)
    cu, seq = torch.tensor([0, 3, 6], dtype=I32), torch.tensor([0, 0, 0, 1, 1, 1], dtype=I32)
    RocmIndexerKGather(head_dim=d)(cache, k_fp8, k_scale, table, cu, seq)
    rows, scales, first, second = (
        k_fp8.view(U8),
        k_scale.view(torch.float32).view(-1),
        torch.arange(d),
        torch.arange(d, 2 * d),
    )
    for t, (page, cols) in enumerate([(3, first), (3, second), (1, first), (2, first), (2, second)]):
        assert torch.equal(rows[t], (cols + 40 * page).to(U8)), t
    assert torch.equal(rows[5], torch.full((d,), 7, dtype=torch.float8_e4m3fn).view(U8))  # null page: untouched
    assert scales.tolist() == [3.5, 3.25, 1.5, 2.5, 2.25, 0.0]


@pytest.mark.parametrize(
    ("lens", "bs", "width", "stride"), [((5, 70, 1), 64, 1, 64 * 132 + 192), ((9, 3), 4, 3, 4 * 36)]
)
def test_matches_reference_on_engine_shaped_chunks(lens: tuple[int, ...], bs: int, width: int, stride: int) -> None:
    """The Flash indexer page (64 rows of 132 bytes, padded to 576-byte units) and a small awkward one; bad table
    entries (-1, past the pool), a table narrower than a request (70 rows, one page of 64 in the table), rows whose
    token_to_seq is -1, past the chunk, or a request they lie outside of: all as the reference."""
    d = 128 if bs == 64 else 32
    g = torch.Generator().manual_seed(bs + width)
    pages = 6
    cache = _cache(pages, bs, d, stride, g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    n = int(cu[-1]) + 2  # two workspace rows past the chunk: token_to_seq points them nowhere valid
    seq = torch.cat([torch.full((ln,), r, dtype=I32) for r, ln in enumerate(lens)] + [torch.tensor([-1, 0], dtype=I32)])
    seq[1] = len(lens) - 1  # a row claimed by a request it lies outside of
    table = torch.randint(0, pages, (len(lens) + 1, width + 2), generator=g, dtype=I32)[:, :width]
    table[0, 0], table[-2, -1] = -1, pages  # a null page and one past the pool
    k_fp8 = torch.randint(0, 256, (n, d), generator=g, dtype=torch.int64).to(U8).view(torch.float8_e4m3fnuz)
    k_scale = torch.randint(0, 256, (n, 4), generator=g, dtype=torch.int64).to(U8)
    want = indexer_k_gather_reference(cache, k_fp8, k_scale, table, cu, seq)
    got = RocmIndexerKGather(head_dim=d)(cache, k_fp8, k_scale, table, cu, seq)
    assert got[0] is k_fp8 and got[1] is k_scale
    assert torch.equal(k_fp8.view(U8), want[0]) and torch.equal(k_scale, want[1])


def test_float32_scales_and_an_empty_chunk() -> None:
    """``k_scale`` as fp32 ``[N]`` (vLLM's ``k_fp8_scale.view(torch.float32)``) gets the same bits; no rows: no
    launch, the empty buffers come back."""
    g = torch.Generator().manual_seed(3)
    cache, table = _cache(3, 4, 16, 4 * 20, g), torch.tensor([[2, 0]], dtype=I32)
    cu, seq = torch.tensor([0, 6], dtype=I32), torch.zeros(6, dtype=I32)
    rows = torch.zeros(6, 16, dtype=U8)
    as_bytes = torch.zeros(6, 4, dtype=U8)
    want = indexer_k_gather_reference(cache, rows, as_bytes, table, cu, seq)
    as_f32 = torch.zeros(6, dtype=torch.float32)
    RocmIndexerKGather(head_dim=16)(cache, rows, as_f32, table, cu, seq)
    assert torch.equal(rows, want[0]) and torch.equal(as_f32.view(U8).view(6, 4), want[1])
    empty = torch.empty(0, 16, dtype=U8), torch.empty(0, 4, dtype=U8)
    got = RocmIndexerKGather(head_dim=16)(cache, *empty, table, cu[:1], seq[:0])
    assert got[0] is empty[0] and got[1] is empty[1]


def test_launch_errors() -> None:
    op, cache = RocmIndexerKGather(head_dim=16), torch.zeros(2, 4, 20, dtype=U8)
    rows, scales, table = torch.zeros(3, 16, dtype=U8), torch.zeros(3, 4, dtype=U8), torch.zeros(1, 2, dtype=I32)
    cu, seq = torch.tensor([0, 3], dtype=I32), torch.zeros(3, dtype=I32)
    with pytest.raises(warmreg.LaunchError, match="k_fp8 must be"):
        op(cache, rows.to(torch.int8), scales, table, cu, seq)
    with pytest.raises(warmreg.LaunchError, match="k_cache must be"):
        op(torch.zeros(2, 4, 24, dtype=U8), rows, scales, table, cu, seq)
    with pytest.raises(warmreg.LaunchError, match="k_scale must be"):
        op(cache, rows, scales[:, :2], table, cu, seq)
    with pytest.raises(warmreg.LaunchError, match="block_table must be"):
        op(cache, rows, scales, table.long(), cu, seq)
    with pytest.raises(warmreg.LaunchError, match="token_to_seq"):
        op(cache, rows, scales, table, cu, seq[:2])


def _plan(target: str, value: str = "fp8") -> warmreg.Plan:
    config = example_config("deepseek_v4_flash")
    config["serving"]["indexer_kv_dtype"] = value
    plugin = RegisterPlugin(rocm_indexer_gather.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(
    ("target", "value"),
    [
        ("rocm:gfx950+aiter", "fp8"),
        ("rocm:gfx950", "auto"),
        ("rocm:gfx942+aiter", "auto"),
        ("rocm:gfx942+aiter", "fp8"),
    ],
)
def test_planned_for_the_fp8_indexer_on_rocm(target: str, value: str) -> None:
    """One binary but for ROCm's 32-bit buffer offsets: the cache and the workspace each at or past 2 GB."""
    keys = _plan(target, value).kernel(RocmIndexerKGather.name).keys
    assert {k.fields()["head_dim"] for k in keys} == {128} and {k.fields()["num_warps"] for k in keys} == {4}
    assert sorted(k.over_2gb for k in keys) == [(), ("k_cache",), ("k_cache", "k_fp8", "k_scale"), ("k_fp8", "k_scale")]
    assert_warmup_inputs_reproduce(RocmIndexerKGather(), keys)


def test_the_key_names_the_tensors_past_2gb() -> None:
    """What Triton's AMD backend specializes (``is_within_2gb`` of the storage, not the view)."""
    small = {
        "k_cache": torch.empty(2, 64, 132, dtype=U8, device="meta"), "k_fp8": torch.empty(3, 128, dtype=U8, device="meta"),
        "k_scale": torch.empty(3, 4, dtype=U8, device="meta"), "block_table": torch.empty(1, 2, dtype=I32, device="meta"),
        "cu_seq_lens": torch.empty(2, dtype=I32, device="meta"), "token_to_seq": torch.empty(3, dtype=I32, device="meta"),
    }  # fmt: skip
    pool = torch.empty(2**31, dtype=U8, device="meta")
    big = dict(small, k_cache=pool[: 2 * 64 * 132].view(2, 64, 132))
    assert RocmIndexerKGather().dispatch(**small).over_2gb == ()
    assert RocmIndexerKGather().dispatch(**big).over_2gb == ("k_cache",)


@pytest.mark.parametrize(
    ("target", "value"),
    [("rocm:gfx950+aiter", "auto"), ("rocm:gfx950+aiter", "mxfp4"), ("rocm:gfx942", "fp8"), ("cuda:90", "fp8")],
)
def test_not_planned_elsewhere(target: str, value: str) -> None:
    """MXFP4 (auto on gfx950 with aiter) reads on aiter's paged kernels; gfx942 without aiter has no ROCm indexer
    (``forward_hip`` raises); CUDA gathers with its own kernels."""
    assert not _plan(target, value).kernels


@pytest.mark.parametrize("target", ["rocm:gfx942+aiter", "rocm:gfx950"])
def test_warm_cross_compiles(target: str) -> None:
    config = example_config("deepseek_v4_flash")
    config["serving"]["indexer_kv_dtype"] = "fp8"
    plugin = RegisterPlugin(rocm_indexer_gather.register, model=DSV4.from_config)
    report = warmreg.warm(config, target=target, plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 4, [(r.kernel, r.error) for r in report.failed]
