"""ROCm's two-stage C128 compressor: each stage against its reference under Triton's interpreter (every split count,
gfx950's sanitizing, closing and non-closing rows, a window reaching before position 0, null slots, padded pages), the
two stages together against the single-stage op's reference, the split choice, errors, the plan (ROCm only, C128
layers) and cross-compiles.

Stage 1's fp32 sums run in another order than PyTorch's (a relative 1e-5). Stage 2's bf16 and e4m3fn bits come from
exact encoders (round to nearest even, as the references), but its sums too run in another order, so a value next to
a rounding boundary may land on the neighbouring code and a block maximum next to a power of two on the next UE8M0
scale: entries are compared decoded within an e4m3 step (2**-3 of the block's largest value) and a bf16 step, scales
within one exponent, every byte outside the written entries exactly. ``tests/engines/test_vllm034_kernels_dsv4_rocm_compress.py``
compares the bytes with vLLM's kernels bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_compress_two_stage
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_compress_insert import rocm_sparse_compress_insert_reference
from warmreg_deepseek_v4.rocm_compress_two_stage import (
    SPLITS,
    RocmCompressFinalize,
    RocmCompressGatherSplit,
    compress_num_splits,
    rocm_compress_finalize_reference,
    rocm_compress_gather_reference,
)

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, I64, U8 = torch.int32, torch.int64, torch.uint8
BS, ROW = 64, 584


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    """Two requests' C128 states (8-token pages), closing rows (one whose window starts before position 0 cannot
    exist at 128, so the first closes at 127), non-closing rows, a null state slot, a null compressed slot, a padded
    ``fp8_ds_mla`` cache of random bytes and a scratch of garbage."""
    g = torch.Generator().manual_seed(seed)
    pb = page_bytes(BS) + 64
    return {
        "state_cache": torch.randn(40, 8, 1024, generator=g),
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=I32),
        "positions": torch.tensor([127, 126, 255, 383, 127, 0, 511]),
        "slot_mapping": torch.tensor([1, 2, -1, 4, 5, 6, 7]),
        "block_table": torch.randint(0, 40, (2, 70), generator=g, dtype=I32),
        "scratch": torch.randn(9, 512, generator=g),
        "norm_weight": (torch.randn(512, generator=g) * 0.1 + 1).to(torch.bfloat16),
        "cos_sin_cache": torch.rand(600, 64, generator=g) * 2 - 1,
        "backing": torch.randint(0, 256, (3 * pb,), generator=g, dtype=I64).to(U8),
        "kv_slot_mapping": torch.tensor([3, 70, 5, 133, -1, 9, 130]),
        "page_stride": torch.tensor(pb),
    }


def _cache(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return d["backing"].as_strided((3, BS, ROW), (int(d["page_stride"]), ROW, 1))


_STATE = ("state_cache", "token_to_req_indices", "positions", "slot_mapping", "block_table")
_CLOSING = [0, 3, 4, 6]  # slot >= 0 and (pos + 1) % 128 == 0


@pytest.mark.parametrize("splits", SPLITS)
def test_gather_matches_reference(splits: int) -> None:
    d = _inputs(splits)
    before = d["scratch"].clone()
    want = rocm_compress_gather_reference(*(d[n] for n in _STATE), d["scratch"])
    got = RocmCompressGatherSplit()(*(d[n] for n in _STATE), d["scratch"], num_splits=splits)
    assert got is d["scratch"]
    torch.testing.assert_close(got[_CLOSING], want[_CLOSING], rtol=1e-5, atol=1e-6)  # fp32 sums in another order
    rest = [i for i in range(9) if i not in _CLOSING]
    assert torch.equal(got[rest], before[rest]) and torch.equal(want[rest], before[rest])


def _decode(pages: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ``j``'s NoPE values (FP8 code x 2**(scale - 127)), RoPE part (bf16) and 7 scale bytes."""
    row, scales = pages[j * 576 : (j + 1) * 576], pages[BS * 576 + 8 * j : BS * 576 + 8 * j + 7]
    codes = row[:448].view(torch.float8_e4m3fn).float().reshape(7, 64)
    nope = codes * torch.exp2(scales.float() - 127)[:, None]
    return nope.reshape(-1), row[448:].view(torch.bfloat16).float(), scales


def _assert_entries(d: dict[str, torch.Tensor], before: torch.Tensor, want: torch.Tensor, sanitize: bool) -> None:
    pb = int(d["page_stride"])
    pages, written = d["backing"].view(3, pb), torch.zeros(3, pb, dtype=torch.bool)
    for t in _CLOSING:
        if int(d["kv_slot_mapping"][t]) < 0:
            continue
        page, j = divmod(int(d["kv_slot_mapping"][t]), BS)
        written[page, j * 576 : (j + 1) * 576] = True
        written[page, BS * 576 + 8 * j : BS * 576 + 8 * j + 8] = True
        (gn, gr, gs), (wn, wr, ws) = _decode(pages[page], j), _decode(want[page], j)
        assert (gs.int() - ws.int()).abs().max() <= 1 and pages[page, BS * 576 + 8 * j + 7] == 0
        step = wn.reshape(7, 64).abs().amax(1, keepdim=True).expand(7, 64).reshape(-1) * 2**-3
        assert ((gn - wn).abs() <= step).all(), t
        torch.testing.assert_close(gr, wr, rtol=2**-7, atol=1e-6)
        assert not gr.isnan().any() or not sanitize
    assert int(written.sum()) == 3 * 584
    assert torch.equal(pages[~written], before.view(3, pb)[~written])  # nothing else touched
    assert torch.equal(want[~written], before.view(3, pb)[~written])


@pytest.mark.parametrize("sanitize", [False, True])
def test_finalize_matches_reference(sanitize: bool) -> None:
    d = _inputs(7 + sanitize)
    d["scratch"][5] = float("nan")  # a non-closing row: never read
    rest = ("positions", "slot_mapping", "norm_weight", "cos_sin_cache")
    before = d["backing"].clone()
    want = rocm_compress_finalize_reference(
        d["scratch"], *(d[n] for n in rest), _cache(d), d["kv_slot_mapping"], 1e-6, sanitize_nans=sanitize
    )
    got = RocmCompressFinalize()(
        d["scratch"], *(d[n] for n in rest), _cache(d), d["kv_slot_mapping"], 1e-6, sanitize_nans=sanitize
    )
    assert got.data_ptr() == d["backing"].data_ptr()
    _assert_entries(d, before, want, sanitize)


def test_two_stages_equal_single_stage_math() -> None:
    """Stage 1 then stage 2 writes what the single-stage op's reference writes at ratio 128."""
    d = _inputs(11)
    before = d["backing"].clone()
    want = rocm_sparse_compress_insert_reference(
        *(d[n] for n in _STATE), d["norm_weight"], d["cos_sin_cache"], _cache(d), d["kv_slot_mapping"], 1e-6,
        compress_ratio=128,
    )  # fmt: skip
    RocmCompressGatherSplit()(*(d[n] for n in _STATE), d["scratch"], num_splits=4)
    RocmCompressFinalize()(
        d["scratch"], d["positions"], d["slot_mapping"], d["norm_weight"], d["cos_sin_cache"], _cache(d),
        d["kv_slot_mapping"], 1e-6,
    )  # fmt: skip
    _assert_entries(d, before, want, False)


@pytest.mark.parametrize(
    ("rows", "cu", "splits"),
    [(1, 256, 16), (2048, 256, 16), (4096, 256, 8), (8192, 304, 4), (16384, 256, 2), (32768, 256, 1), (200, 3, 2)],
)
def test_split_choice(rows: int, cu: int, splits: int) -> None:
    """vLLM's ``_pick_compress_num_splits``: ``ceil(CU / max(1, rows // 128))`` rounded down to a power of two,
    at most 16."""
    assert compress_num_splits(rows, cu) == splits


def test_launch_errors() -> None:
    d = _inputs(0)
    gather, fin, state = RocmCompressGatherSplit(), RocmCompressFinalize(), [d[n] for n in _STATE]
    with pytest.raises(warmreg.LaunchError, match="num_splits must be"):
        gather(*state, d["scratch"], num_splits=3)
    with pytest.raises(warmreg.LaunchError, match="state_cache must be"):
        gather(d["state_cache"][..., :512], *state[1:], d["scratch"], num_splits=2)
    with pytest.raises(warmreg.LaunchError, match="scratch must be"):
        gather(*state, d["scratch"][:3], num_splits=2)
    with pytest.raises(warmreg.LaunchError, match="slot_mapping must be int64"):
        gather(*state[:3], state[3].to(I32), state[4], d["scratch"], num_splits=2)
    with pytest.raises(warmreg.LaunchError, match="kv_cache must be"):
        fin(d["scratch"], d["positions"], d["slot_mapping"], d["norm_weight"], d["cos_sin_cache"],
            torch.zeros(3, BS, 576, dtype=U8), d["kv_slot_mapping"], 1e-6)  # fmt: skip
    with pytest.raises(warmreg.LaunchError, match="cos_sin_cache must be"):
        fin(d["scratch"], d["positions"], d["slot_mapping"], d["norm_weight"], d["cos_sin_cache"][:, :32], _cache(d),
            d["kv_slot_mapping"], 1e-6)  # fmt: skip


def _plan(target: str, example: str = "deepseek_v4_flash") -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_compress_two_stage.register, model=DSV4.from_config)
    return warmreg.plan(example_config(example), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(("target", "sanitize"), [("rocm:gfx942", False), ("rocm:gfx950", True)])
def test_planned_on_rocm(target: str, sanitize: bool) -> None:
    """Every split count with the state cache at or past 2 GB; one finalize a KV-cache side of 2 GB."""
    plan = _plan(target)
    gkeys = plan.kernel(RocmCompressGatherSplit.name).keys
    assert {(k.num_splits, k.over_2gb) for k in gkeys} == {(s, b) for s in SPLITS for b in ((), ("state_cache",))}
    fkeys = plan.kernel(RocmCompressFinalize.name).keys
    assert {k.over_2gb for k in fkeys} == {(), ("kv_cache",)} and {k.sanitize_nans for k in fkeys} == {sanitize}
    assert {k.weight_dtype for k in fkeys} == {"bfloat16"} and {k.num_warps for k in (*gkeys, *fkeys)} == {4}
    assert_warmup_inputs_reproduce(RocmCompressGatherSplit(), gkeys)
    assert_warmup_inputs_reproduce(RocmCompressFinalize(), fkeys)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_not_planned_on_cuda(target: str) -> None:
    """CUDA compresses head-512 entries with CuTeDSL's kernel (``_prefer_two_stage_compressor`` is ROCm only)."""
    assert not _plan(target).kernels


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950"])
def test_warm_cross_compiles(target: str) -> None:
    plugin = RegisterPlugin(rocm_compress_two_stage.register, model=DSV4.from_config)
    report = warmreg.warm(example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 12, [(r.kernel, r.error) for r in report.failed]
