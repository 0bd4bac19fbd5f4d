"""DeepSeek-V4.1's ROCm ``fp8_ds_mla`` gather (``warmreg_deepseek_v4.v41_rocm_gather_k``) against its PyTorch reference
under Triton's interpreter (hand-picked bytes, random pages, strided workspaces and tables, gather lens, FNUZ, errors,
in place, warmup inputs), the plan (which ROCm targets plan which keys; nothing on CUDA or under aiter's sparse MLA),
and the V4.1 ROCm sweep's launches of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41, v41_rocm_gather_k
from warmreg_deepseek_v4._sweep_v41_rocm_gather import random_fp8_ds_mla_pages
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sweep import DSV4Sweep
from warmreg_deepseek_v4.v41_rocm_gather_k import V41RocmGatherKCache, V41RocmGatherKey, v41_rocm_gather_k_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader
from warmreg.testing.sweep import driver_for, run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8
NAME = V41RocmGatherKCache.name


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("fnuz", [False, True])
def test_bytes_by_hand(fnuz: bool) -> None:
    """Token 1 of a 2-token page: e4m3 0x38 is 1.0 in e4m3fn (0.5 in e4m3fnuz), 0xB8 its negative, 0x01 the smallest
    subnormal 2^-9 (2^-10), a NaN code reads NaN; scale 128 doubles block 0, 125 quarters block 6; the RoPE bf16 values
    are copied."""
    cache = torch.zeros(1, 2, 584, dtype=U8)
    flat = cache.view(-1)
    token = flat[576:1152]
    token[0], token[1], token[2], token[447] = 0x38, 0xB8, 0x01, 0x38
    token[3] = 0x80 if fnuz else 0x7F  # NaN
    token[448:].view(BF16)[:] = torch.arange(64, dtype=BF16)
    flat[2 * 576 + 8 : 2 * 576 + 16] = torch.tensor([128, 127, 127, 127, 127, 127, 125, 0], dtype=U8)
    out = torch.full((1, 2, 512), 9.0, dtype=BF16)
    V41RocmGatherKCache()(
        out, cache, torch.tensor([2], dtype=I32), torch.tensor([1], dtype=I32), torch.zeros(1, 1, dtype=I32),
        block_size=2, offset=1, use_fnuz=fnuz,
    )  # fmt: skip
    one = 0.5 if fnuz else 1.0
    row = out[0, 1].float()
    assert row[:3].tolist() == [2 * one, -2 * one, 2 * 2 ** (-10 if fnuz else -9)] and row[3].isnan()
    assert row[447].item() == one / 4 and not row[4:447].any()
    assert torch.equal(out[0, 1, 448:], torch.arange(64, dtype=BF16)) and (out[0, 0] == 9).all()


@pytest.mark.parametrize(
    ("seqs", "glens", "block_size", "offset", "fnuz"),
    [((5, 0, 9), None, 4, 0, False), ((13, 2), (3, 2), 32, 7, True), ((1,), None, 128, 0, False),
     ((70, 17), (40, 17), 32, 1, False)],
)  # fmt: skip
def test_matches_reference(
    seqs: tuple[int, ...], glens: tuple[int, ...] | None, block_size: int, offset: int, fnuz: bool
) -> None:
    """Random e4m3 bytes (NaN codes included) in pages with a stride past their records, a block table sliced out of a
    wider one, a workspace column slice with rows to spare; gather lens take the last positions."""
    gen = torch.Generator().manual_seed(sum(seqs) + block_size)
    size = block_size * 584
    flat = torch.randint(0, 256, (6, size + 64), generator=gen, dtype=U8)[:, :size]
    # scales 2^-27..2^22: products that underflow to fp32 subnormals are where Triton's interpreter (numpy) and torch
    # round differently; real UE8M0 scales of K rows are near 1
    flat[:, block_size * 576 :] = torch.randint(100, 150, (6, block_size * 8), generator=gen, dtype=U8)
    pages = flat.view(6, block_size, 584)
    width = max(-(-s // block_size) for s in seqs) + 1
    table = torch.randint(0, 6, (len(seqs) + 1, width + 3), generator=gen, dtype=I32)[1:, 2 : 2 + width]
    rows = max(glens or seqs) + offset
    out = torch.randn(len(seqs), rows + 5, 520, generator=gen).to(BF16)[:, : rows + 2, 8:]
    seq_lens = torch.tensor(seqs, dtype=I32)
    gather = None if glens is None else torch.tensor(glens, dtype=I32)
    kw: dict[str, Any] = {"block_size": block_size, "offset": offset, "use_fnuz": fnuz}
    want = v41_rocm_gather_k_reference(out, pages, seq_lens, gather, table, **kw)
    V41RocmGatherKCache()(out, pages, seq_lens, gather, table, **kw)
    assert _same(out, want)  # exact: an e4m3 value times a power of two fits bf16


def test_max_gather_len_bounds_the_grid_only() -> None:
    """vLLM's compressed gather passes the chunk's longest length: the rows gathered are the same."""
    gen = torch.Generator().manual_seed(3)
    pages = random_fp8_ds_mla_pages(4, 8, gen, torch.device("cpu"))
    table, seq_lens = torch.randint(0, 4, (2, 3), generator=gen, dtype=I32), torch.tensor([17, 6], dtype=I32)
    out = torch.zeros(2, 40, 512, dtype=BF16)
    want = v41_rocm_gather_k_reference(out, pages, seq_lens, None, table, block_size=8)
    V41RocmGatherKCache()(out, pages, seq_lens, None, table, block_size=8, max_gather_len=17)
    assert torch.equal(out, want) and out[0, :17].any() and not out[:, 17:].any()


def test_errors_name_the_argument() -> None:
    kernel, pages = V41RocmGatherKCache(), torch.zeros(2, 4, 584, dtype=U8)
    out, seq, table = torch.zeros(2, 8, 512, dtype=BF16), torch.zeros(2, dtype=I32), torch.zeros(2, 3, dtype=I32)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("out", {"out": out.float()}),
        ("out", {"out": torch.zeros(2, 8, 256, dtype=BF16)}),
        ("k_cache", {"k_cache": torch.zeros(2, 4, 288, dtype=U8)}),
        ("k_cache", {"k_cache": torch.zeros(2, 4, 600, dtype=U8)[:, :, :584]}),
        ("seq_lens", {"seq_lens": torch.zeros(3, dtype=I32)}),
        ("gather_lens", {"gather_lens": torch.zeros(2, dtype=torch.int64)}),
        ("block_table", {"block_table": torch.zeros(2, 3, dtype=torch.int64)}),
        ("offset", {"offset": 9}),
        ("block_size", {"block_size": 5}),
        ("max_gather_len", {"max_gather_len": -1}),
    ]
    for name, change in cases:
        args: dict[str, Any] = {
            "out": out,
            "k_cache": pages,
            "seq_lens": seq,
            "gather_lens": None,
            "block_table": table,
        }
        kw = {k: change.pop(k, d) for k, d in (("offset", 0), ("block_size", 4), ("max_gather_len", None))}
        args.update(change)
        with pytest.raises(warmreg.LaunchError, match=name):
            kernel(*args.values(), **kw)


def test_in_place_and_allocates_nothing() -> None:
    args = (torch.zeros(1, 4, 512, dtype=BF16), torch.zeros(2, 4, 584, dtype=U8), torch.tensor([3], dtype=I32), None,
            torch.zeros(1, 2, dtype=I32))  # fmt: skip
    with Allocations() as fresh:
        spec = OpCall(V41RocmGatherKCache(), args, {"block_size": 4}).launch_code()
    assert not fresh.calls and spec.outputs is args[0]


def test_the_warmup_inputs_of_every_variant_reproduce() -> None:
    keys = [
        V41RocmGatherKey(has_gather_lens=g, use_fnuz=f, out_aligned=a, tile=8, num_warps=4)
        for g in (False, True)
        for f in (False, True)
        for a in (False, True)
    ]
    assert_warmup_inputs_reproduce(V41RocmGatherKCache(), keys)


# -- the plan --------------------------------------------------------------------------------------------------------
def _config(ratios: list[int] | None = None, **serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    if ratios is not None:
        text = config["model"]["text_config"]
        text["compress_ratios"] = [ratios[i % len(ratios)] for i in range(text["num_hidden_layers"])]
    return config


def _keys(config: Any, target: str) -> list[dict[str, Any]] | None:
    plan = warmreg.plan(config, target=target)
    if NAME not in {k.name for k in plan.kernels}:
        return None
    return sorted((k.fields() for k in plan.kernel(NAME).keys), key=lambda f: f["has_gather_lens"])


@pytest.mark.parametrize(
    ("target", "fnuz"), [("rocm:gfx942", True), ("rocm:gfx950+aiter", False), ("rocm:gfx1250", False)]
)
def test_in_tree_prefill_plans_the_compressed_and_swa_gathers(target: str, fnuz: bool) -> None:
    """The compressed gather (whole lengths, OCP) and the SWA gather (gather lens, FNUZ where the platform's FP8 is),
    aligned workspace, tile 8, 4 warps; any chunk, page stride, block size and table width launch these keys."""
    common = {"out_aligned": True, "tile": 8, "num_warps": 4}
    assert _keys(_config(), target) == [
        {"has_gather_lens": False, "use_fnuz": False, **common},
        {"has_gather_lens": True, "use_fnuz": fnuz, **common},
    ]
    plan = warmreg.plan(_config(), target=target)
    op, keys = plan.kernel(NAME).kernel, set(plan.kernel(NAME).keys)
    workspace = warmreg.meta((4, 9000, 512), BF16)
    for chunk, n, block, width in ((1, 0, 32, 4096), (3, 4096, 128, 1024), (4, 2048, 256, 17)):
        cache = warmreg.meta((100, block, 584), U8)
        table = warmreg.meta((9, width), I32)[1 : 1 + chunk]
        lens = warmreg.meta((8,), I32)[1 : 1 + chunk]
        comp = (workspace[:chunk], cache, warmreg.meta((chunk,), I32), None, table)
        swa = (workspace[:chunk], cache, lens, lens, table)
        got = {
            OpCall(op, comp, {"block_size": block, "max_gather_len": n}).launch_code().key,
            OpCall(op, swa, {"block_size": block, "offset": n, "use_fnuz": fnuz}).launch_code().key,
        }
        assert got == keys
    assert_warmup_inputs_reproduce(op, list(keys))


def test_swa_only_models_plan_the_swa_gather_alone() -> None:
    assert _keys(_config(ratios=[0]), "rocm:gfx942") == [
        {"has_gather_lens": True, "use_fnuz": True, "out_aligned": True, "tile": 8, "num_warps": 4}
    ]


def test_not_planned_under_aiter_sparse_mla_nor_on_cuda() -> None:
    """aiter's sparse MLA prefill reads the caches in place; CUDA takes CuTeDSL's gather (or the NVFP4 one)."""
    assert _keys(_config(), "rocm:gfx950+aiter+aiter_sparse_mla") is None
    assert _keys(EXAMPLES / "deepseek_v41.json", "cuda:90") is None
    assert _keys(EXAMPLES / "deepseek_v41.json", "cuda:100") is None
    assert v41_rocm_gather_k in v41.ROCM_OP_MODULES and v41_rocm_gather_k not in v41.OP_MODULES


def test_warm_cross_compiles_for_gfx942() -> None:
    plugins = [RegisterPlugin(v41_rocm_gather_k.register, model=DSV4.from_config)]
    report = warmreg.warm(_config(), target="rocm:gfx942", plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


# -- the sweep -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx1250"])
def test_sweep_launches_the_gathers_against_the_reference(target: str) -> None:
    """Three steps (decode, prefill, mixed): every prefill step gathers each layer kind's caches, matching the
    reference, with no miss under the monitor in ``error`` mode."""
    plan = warmreg.plan(_config(max_num_seqs=4), target=target)
    assert issubclass(driver_for(plan), DSV4Sweep)
    run = run_steps(plan, 5)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    k = run["kernels"][NAME]
    assert k["launches"] >= 3 and k["failures"] == 0 and k["misses"] == 0, k
    assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
