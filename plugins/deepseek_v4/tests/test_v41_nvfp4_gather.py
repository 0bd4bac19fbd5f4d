"""DeepSeek-V4.1's NVFP4 compressed-record gather against its PyTorch reference under Triton's interpreter (every
nibble and scale by hand, random pages, strided workspaces, gather lens, errors, in place, warmup inputs), and the
plan: which configs and targets plan which keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_nvfp4_gather
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_nvfp4_gather import Nvfp4GatherKCache, nvfp4_gather_reference

import warmreg
from warmreg.testing import Allocations, OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8
NAME = Nvfp4GatherKCache.name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pages(gen: torch.Generator, blocks: int, block_size: int, page_pad: int = 0) -> torch.Tensor:
    """Random records (no NaN scale: e4m3 0x7F / 0xFF) in pages ``page_pad`` bytes wider than their records."""
    flat = torch.randint(0, 256, (blocks, block_size * 288 + page_pad), generator=gen, dtype=U8)
    pages = flat[:, : block_size * 288].view(blocks, block_size, 288)
    pages[:, :, 256:] = torch.randint(0, 0x7F, (blocks, block_size, 32), generator=gen, dtype=U8)
    return pages


def test_every_nibble_and_scale_by_hand() -> None:
    """Byte k holds elements 2k (low nibble) and 2k + 1; scale k // 8 of the record scales them: the 16 nibbles
    decode to 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, times e4m3 2.0 (0x40), 0.25 (0x28) or the smallest
    subnormal 2^-9 (0x01)."""
    cache = torch.zeros(1, 1, 288, dtype=U8)
    cache[0, 0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=U8)
    cache[0, 0, 8:16] = cache[0, 0, :8]
    cache[0, 0, 256], cache[0, 0, 257], cache[0, 0, 258] = 0x40, 0x28, 0x01
    cache[0, 0, 16] = 0x7F  # elements 32, 33 under scale 2: 6 * 2^-9 and -6 * 2^-9
    out = torch.full((1, 1, 512), 9.0, dtype=BF16)
    Nvfp4GatherKCache()(out, cache, torch.tensor([1], dtype=I32), None, torch.zeros(1, 1, dtype=I32), block_size=1)
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert out[0, 0, :16].tolist() == [2 * v for v in values]
    assert out[0, 0, 16:32].tolist() == [v / 4 for v in values]
    assert out[0, 0, 32:34].tolist() == [-6 * 2**-9, 6 * 2**-9] and not out[0, 0, 34:].any()
    assert torch.signbit(out[0, 0, 8].float())  # -0 stays negative


@pytest.mark.parametrize(
    ("seqs", "glens", "block_size", "offset"),
    [((5, 0, 9), None, 4, 0), ((13, 2), (3, 2), 64, 7), ((1,), None, 128, 0), ((300, 17), (130, 17), 64, 1)],
)
def test_matches_reference(seqs: tuple[int, ...], glens: tuple[int, ...] | None, block_size: int, offset: int) -> None:
    """Random pages (a page stride past the records), a block table sliced out of a wider one, a workspace column
    slice (mega attention's retained workspace) with rows to spare; gather lens take the last positions."""
    gen = _gen(sum(seqs) + block_size)
    pages = _pages(gen, 12, block_size, page_pad=64)
    width = max(-(-s // block_size) for s in seqs) + 1
    table = torch.randint(0, 12, (len(seqs) + 1, width + 3), generator=gen, dtype=I32)[1:, 2 : 2 + width]
    rows = max(glens or seqs) + offset
    out = torch.randn(len(seqs), rows + 5, 512, generator=gen).to(BF16)[:, : rows + 2]
    seq_lens = torch.tensor(seqs, dtype=I32)
    gather = None if glens is None else torch.tensor(glens, dtype=I32)
    kw = {"block_size": block_size, "offset": offset}
    want = nvfp4_gather_reference(out, pages, seq_lens, gather, table, **kw)
    Nvfp4GatherKCache()(out, pages, seq_lens, gather, table, **kw)
    assert torch.equal(out, want)  # exact: a 2-bit by 4-bit significand product fits bf16


def test_errors_name_the_argument() -> None:
    kernel, pages = Nvfp4GatherKCache(), torch.zeros(2, 4, 288, dtype=U8)
    out, seq, table = torch.zeros(2, 8, 512, dtype=BF16), torch.zeros(2, dtype=I32), torch.zeros(2, 3, dtype=I32)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("out", {"out": out.float()}),
        ("out", {"out": torch.zeros(2, 8, 256, dtype=BF16)}),
        ("k_cache", {"k_cache": torch.zeros(2, 4, 528, dtype=U8)}),
        ("k_cache", {"k_cache": torch.zeros(2, 4, 300, dtype=U8)[:, :, :288]}),
        ("seq_lens", {"seq_lens": torch.zeros(3, dtype=I32)}),
        ("gather_lens", {"gather_lens": torch.zeros(2, dtype=torch.int64)}),
        ("block_table", {"block_table": torch.zeros(2, 3, dtype=torch.int64)}),
        ("offset", {"offset": 9}),
        ("block_size", {"block_size": 5}),
    ]
    for name, change in cases:
        args: dict[str, Any] = {
            "out": out,
            "k_cache": pages,
            "seq_lens": seq,
            "gather_lens": None,
            "block_table": table,
        }
        kw = {"offset": change.pop("offset", 0), "block_size": change.pop("block_size", 4)}
        args.update(change)
        with pytest.raises(warmreg.LaunchError, match=name):
            kernel(*args.values(), **kw)


def test_in_place_and_allocates_nothing() -> None:
    args = (torch.zeros(1, 4, 512, dtype=BF16), torch.zeros(2, 4, 288, dtype=U8), torch.tensor([3], dtype=I32), None,
            torch.zeros(1, 2, dtype=I32))  # fmt: skip
    with Allocations() as fresh:
        spec = OpCall(Nvfp4GatherKCache(), args, {"block_size": 4}).launch_code()
    assert not fresh.calls and spec.outputs is args[0]


# -- the plan --------------------------------------------------------------------------------------------------------
def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _names(config: Any, target: str) -> set[str]:
    return {k.name for k in warmreg.plan(config, target=target).kernels}


def test_mega_attention_plans_one_key_for_every_gather() -> None:
    """Mega attention's auto cache is NVFP4: one key (no gather lens, aligned workspace, tile 8, 2 warps) for both
    ratios' block sizes, any table width, page stride, workspace and chunk, as FlashMLA and mega attention call it."""
    plan = warmreg.plan(
        _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2, kv_cache_dtype="auto"),
        target="cuda:100",
    )
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == {"has_gather_lens": False, "out_aligned": True, "tile": 8, "num_warps": 2}
    op = plan.kernel(NAME).kernel
    retained = warmreg.meta((4, 4096, 512), BF16)
    for chunk, n, block_size, width in ((1, 1, 128, 1024), (4, 3000, 64, 2048), (3, 4096, 64, 8)):
        cache = warmreg.meta((100, block_size, 288), U8)
        for out in (retained[:chunk, :n], warmreg.meta((chunk, n, 512), BF16)):
            args = (out, cache, warmreg.meta((chunk,), I32), None, warmreg.meta((8, width), I32)[1 : 1 + chunk])
            assert OpCall(op, args, {"block_size": block_size, "offset": 0}).launch_code().key == key
    assert_warmup_inputs_reproduce(op, [key])


def test_planned_only_for_nvfp4_records() -> None:
    """FlashMLA with nvfp4_ds_mla on SM100 gathers NVFP4; the example's fp8_ds_mla (MXFP8 records on SM100, under
    mega attention too), FlashInfer's plain rows and a model without compressed layers gather none through it."""
    assert NAME in _names(_v41(kv_cache_dtype="nvfp4_ds_mla"), "cuda:100")
    assert NAME not in _names(EXAMPLES / "deepseek_v41.json", "cuda:100")
    assert NAME not in _names(EXAMPLES / "deepseek_v41.json", "cuda:90")
    assert NAME not in _names(_v41(attention_backend="FLASHINFER_MLA_SPARSE_DSV41", kv_cache_dtype="auto"), "cuda:100")
    assert NAME not in _names(_v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2), "cuda:100")
    swa_only = _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2, kv_cache_dtype="auto")
    swa_only["model"]["text_config"]["compress_ratios"] = [0] * 43
    assert NAME not in _names(swa_only, "cuda:100")


def test_the_warmup_inputs_of_every_variant_reproduce() -> None:
    keys = [
        v41_nvfp4_gather.Nvfp4GatherKey(has_gather_lens=g, out_aligned=a, tile=8, num_warps=2)
        for g in (False, True)
        for a in (False, True)
    ]
    assert_warmup_inputs_reproduce(Nvfp4GatherKCache(), keys)


def test_warm_cross_compiles_for_sm100() -> None:
    plugins = [RegisterPlugin(v41_nvfp4_gather.register, model=DSV4.from_config)]
    config = _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2, kv_cache_dtype="auto")
    report = warmreg.warm(config, target="cuda:100", plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
