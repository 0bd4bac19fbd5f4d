"""ROCm's head-512 attention compressor: the reference under Triton's interpreter (C4 with overlapping windows and C128,
gfx950's sanitizing, closing and non-closing tokens, null slots, padded pages), errors, the plan (every ROCm target,
one instance a compressed layer type) and cross-compiles.

The op's bf16 and e4m3fn bits come from exact encoders (round to nearest even, as the reference), but its softmax
and sums run in another order than PyTorch's, so a value next to a rounding boundary may land on the neighbouring
code, and a block maximum next to a power of two on the next UE8M0 scale: the entries are compared decoded (FP8
code times its block's scale, the bf16 RoPE part) within an e4m3 step (2**-3 of the block's largest value) and a
bf16 step, the scales within one exponent; every byte outside the written entries exactly.
``tests/engines/test_vllm034_kernels_dsv4_rocm_indexer.py`` compares the bytes with vLLM's kernel bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_compress_insert
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_compress_insert import RocmSparseCompressInsert, rocm_sparse_compress_insert_reference

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, I64, U8 = torch.int32, torch.int64, torch.uint8
BS, ROW = 64, 584


def _inputs(ratio: int, seed: int) -> dict[str, torch.Tensor]:
    """Two requests' compressor states, closing and non-closing tokens (a null state slot, a null compressed slot),
    a padded ``fp8_ds_mla`` cache of random bytes."""
    g = torch.Generator().manual_seed(seed)
    width, sbs, spages = (2 if ratio == 4 else 1) * 512, (4 if ratio == 4 else 8), 40
    positions = torch.tensor([3, 7, 8, 11, 2, 15] if ratio == 4 else [127, 126, 255, 383, 127, 0])
    pb = page_bytes(BS) + 64
    return {
        "state_cache": torch.randn(spages, sbs, 2 * width, generator=g),
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1], dtype=I32),
        "positions": positions,
        "slot_mapping": torch.tensor([1, 2, -1, 4, 5, 6]),
        "block_table": torch.randint(0, spages, (2, 60), generator=g, dtype=I32),
        "norm_weight": (torch.randn(512, generator=g) * 0.1 + 1).to(torch.bfloat16),
        "cos_sin_cache": torch.rand(400, 64, generator=g) * 2 - 1,
        "backing": torch.randint(0, 256, (3 * pb,), generator=g, dtype=I64).to(U8),
        "kv_slot_mapping": torch.tensor([3, 70, 5, 133, 9, -1] if ratio == 4 else [3, 70, 5, 133, 9, 130]),
        "page_stride": torch.tensor(pb),
    }


def _cache(d: dict[str, torch.Tensor]) -> torch.Tensor:
    pb = int(d["page_stride"])
    return d["backing"].as_strided((3, BS, ROW), (pb, ROW, 1))


def _decode(pages: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ``j``'s NoPE values (FP8 code x 2**(scale - 127)), RoPE part (bf16) and 7 scale bytes."""
    row, scales = pages[j * 576 : (j + 1) * 576], pages[BS * 576 + 8 * j : BS * 576 + 8 * j + 7]
    codes = row[:448].view(torch.float8_e4m3fn).float().reshape(7, 64)
    nope = codes * torch.exp2(scales.float() - 127)[:, None]
    return nope.reshape(-1), row[448:].view(torch.bfloat16).float(), scales


@pytest.mark.parametrize("sanitize", [False, True])
@pytest.mark.parametrize("ratio", [4, 128])
def test_matches_reference(ratio: int, sanitize: bool) -> None:
    d = _inputs(ratio, ratio + sanitize)
    args = [d[n] for n in ("state_cache", "token_to_req_indices", "positions", "slot_mapping", "block_table",
                           "norm_weight", "cos_sin_cache")]  # fmt: skip
    before = d["backing"].clone()
    cache = _cache(d)
    want = rocm_sparse_compress_insert_reference(*args, cache, d["kv_slot_mapping"], 1e-6, compress_ratio=ratio,
                                                 sanitize_nans=sanitize)  # fmt: skip
    got = RocmSparseCompressInsert()(
        *args, cache, d["kv_slot_mapping"], 1e-6, compress_ratio=ratio, sanitize_nans=sanitize
    )
    assert got is cache
    pb = int(d["page_stride"])
    pages = d["backing"].view(3, pb)
    written = torch.zeros(3, pb, dtype=torch.bool)
    closing = [t for t in range(6) if int(d["slot_mapping"][t]) >= 0 and (int(d["positions"][t]) + 1) % ratio == 0
               and int(d["kv_slot_mapping"][t]) >= 0]  # fmt: skip
    assert len(closing) >= 3
    for t in closing:
        page, j = divmod(int(d["kv_slot_mapping"][t]), BS)
        written[page, j * 576 : (j + 1) * 576] = True
        written[page, BS * 576 + 8 * j : BS * 576 + 8 * j + 8] = True
        (gn, gr, gs), (wn, wr, ws) = _decode(pages[page], j), _decode(want[page], j)
        assert (gs.int() - ws.int()).abs().max() <= 1 and pages[page, BS * 576 + 8 * j + 7] == 0
        step = wn.reshape(7, 64).abs().amax(1, keepdim=True).expand(7, 64).reshape(-1) * 2**-3
        assert ((gn - wn).abs() <= step).all(), t
        torch.testing.assert_close(gr, wr, rtol=2**-7, atol=1e-6)
        assert not gr.isnan().any() or not sanitize
    assert torch.equal(pages[~written], before.view(3, pb)[~written])  # nothing else touched
    assert torch.equal(want[~written], before.view(3, pb)[~written])


def test_launch_errors() -> None:
    d = _inputs(4, 0)
    args = [d[n] for n in ("state_cache", "token_to_req_indices", "positions", "slot_mapping", "block_table",
                           "norm_weight", "cos_sin_cache")]  # fmt: skip
    op, cache, kv_slots = RocmSparseCompressInsert(), _cache(d), d["kv_slot_mapping"]
    with pytest.raises(warmreg.LaunchError, match="compress_ratio must be"):
        op(*args, cache, kv_slots, 1e-6, compress_ratio=128)
    with pytest.raises(warmreg.LaunchError, match="slot_mapping must be int64"):
        op(*args[:3], args[3].to(I32), *args[4:], cache, kv_slots, 1e-6, compress_ratio=4)
    with pytest.raises(warmreg.LaunchError, match="kv_cache must be"):
        op(*args, torch.zeros(3, BS, 576, dtype=U8), kv_slots, 1e-6, compress_ratio=4)
    with pytest.raises(warmreg.LaunchError, match="cos_sin_cache must be"):
        op(*args[:6], args[6][:, :32], cache, kv_slots, 1e-6, compress_ratio=4)


def _plan(target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_compress_insert.register, model=DSV4.from_config)
    return warmreg.plan(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(("target", "sanitize"), [("rocm:gfx942", False), ("rocm:gfx950", True)])
def test_planned_on_rocm(target: str, sanitize: bool) -> None:
    """The C4 and the C128 compressors, each with its state and KV caches at or past 2 GB; gfx950 sanitizes."""
    keys = _plan(target).kernel(RocmSparseCompressInsert.name).keys
    assert sorted({(k.compress_ratio, k.overlap) for k in keys}) == [(4, True), (128, False)] and len(keys) == 8
    assert {k.sanitize_nans for k in keys} == {sanitize} and {k.weight_dtype for k in keys} == {"bfloat16"}
    assert {k.over_2gb for k in keys} == {(), ("state_cache",), ("kv_cache",), ("state_cache", "kv_cache")}
    assert_warmup_inputs_reproduce(RocmSparseCompressInsert(), keys)


def test_not_planned_on_cuda() -> None:
    """CUDA compresses head-512 entries with CuTeDSL's kernel."""
    assert not _plan("cuda:90").kernels


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950"])
def test_warm_cross_compiles(target: str) -> None:
    plugin = RegisterPlugin(rocm_compress_insert.register, model=DSV4.from_config)
    report = warmreg.warm(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 8, [(r.kernel, r.error) for r in report.failed]
