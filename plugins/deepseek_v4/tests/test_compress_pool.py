"""ROCm's MXFP4 indexer compressor pooling: against its PyTorch reference (Triton interpreter on CPU), its two
ROCm pointer-range keys, registration, and a real cross-compile for gfx950 whose two binaries differ in exactly
the state cache's ``tt.pointer_range`` attribute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import compress_pool
from warmreg_deepseek_v4.compress_pool import CompressPool, compress_pool_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import RegisterPlugin, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

NAME = CompressPool.name
UNWRITTEN = -7.0  # rows the kernel must leave as they were


def inputs(tokens: int) -> dict[str, Any]:
    """Two requests over 12 state pages of 4: the first windows (3, 7, 11: start < 0 for 3), tokens that close no
    window (8, 2), a boundary whose indexer slot is -1 (15), and windows spanning two state pages (7, 11, 19)."""
    state = torch.randn(12, 4, 4 * 128)
    return {
        "state_cache": state,
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)[:tokens],
        "positions": torch.tensor([3, 7, 8, 11, 15, 2, 19])[:tokens],
        "kv_slot_mapping": torch.tensor([0, 5, 9, 6, -1, 3, 11])[:tokens],
        "block_table": torch.randperm(12).to(torch.int32).view(2, 6),
        "block_size": 4,
        "pooled_k": torch.full((tokens, 128), UNWRITTEN, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("tokens", [1, 7])
def test_matches_reference(tokens: int) -> None:
    torch.manual_seed(tokens)
    args = inputs(tokens)
    expected = {**args, "pooled_k": args["pooled_k"].clone()}
    out = CompressPool()(**args)
    assert out is args["pooled_k"]
    compress_pool_reference(**expected)
    # fp32 softmax and sum, then one bf16 rounding: exp is not correctly rounded in numpy nor torch, so a
    # sum may land one bf16 ulp (2**-8 relative) apart; unwritten rows are exact.
    torch.testing.assert_close(out.float(), expected["pooled_k"].float(), rtol=2**-7, atol=1e-6)
    written = (out != UNWRITTEN).any(dim=1).tolist()
    assert written == [True, True, False, True, False, False, True][:tokens]


def test_pooled_rows_of_a_strided_workspace_and_a_first_window() -> None:
    """pooled_k as rows of a wider buffer; position 3's window has 4 positions before 0, softmax over the rest."""
    torch.manual_seed(3)
    args = inputs(7)
    buffer = torch.full((7, 160), UNWRITTEN, dtype=torch.bfloat16)
    args["pooled_k"] = buffer[:, 16:144]
    CompressPool()(**args)
    assert bool((buffer[:, :16] == UNWRITTEN).all() and (buffer[:, 144:] == UNWRITTEN).all())
    state, page = args["state_cache"], int(args["block_table"][0, 0])
    score, kv = state[page, :, 256 + 128 : 256 + 256], state[page, :, 128:256]  # positions 0..3: second halves
    want = (torch.softmax(score, dim=0) * kv).sum(dim=0)
    torch.testing.assert_close(buffer[0, 16:144].float(), want.bfloat16().float(), rtol=2**-7, atol=1e-6)


def test_empty_batch_and_errors() -> None:
    args = inputs(0)
    assert CompressPool()(**args).shape == (0, 128)
    args = inputs(2)
    with pytest.raises(warmreg.LaunchError, match="pooled_k must be bfloat16"):
        CompressPool()(**{**args, "pooled_k": args["pooled_k"].float()})
    with pytest.raises(warmreg.LaunchError, match=r"kv_slot_mapping must be a contiguous torch\.int64"):
        CompressPool()(**{**args, "kv_slot_mapping": args["kv_slot_mapping"].int()})
    with pytest.raises(warmreg.LaunchError, match="block_size 8"):
        CompressPool()(**{**args, "block_size": 8})


def test_key_follows_the_state_cache_storage() -> None:
    """A state cache viewing a pool over 2 GB loses ROCm's 32-bit pointer range: a key of its own."""
    kernel, args = CompressPool(), inputs(2)
    small = {k: v for k, v in args.items() if k != "block_size"}
    assert kernel.dispatch(**small, compress_ratio=4).over_2gb == ()
    pool = warmreg.meta((300_000, 4, 512), torch.float32)  # 2.3 GiB of compressor states
    big = {**small, "state_cache": pool[100:200]}
    key = kernel.dispatch(**big, compress_ratio=4)
    assert key.over_2gb == ("state_cache",) and (key.head_size, key.state_width, key.overlap) == (128, 256, True)


def _plan(target: str, **serving: Any) -> warmreg.Plan:
    config = example_config("deepseek_v4_flash", **serving)
    plugin = RegisterPlugin(compress_pool.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("value", ["auto", "mxfp4"])
def test_planned_on_gfx950_with_aiter(value: str) -> None:
    keys = _plan("rocm:gfx950+aiter", indexer_kv_dtype=value).kernel(NAME).keys
    assert sorted(k.over_2gb for k in keys) == [(), ("state_cache",)]
    assert {(k.head_size, k.state_width, k.compress_ratio, k.overlap, k.num_warps) for k in keys} == {(128, 256, 4, True, 1)}


@pytest.mark.parametrize(
    ("target", "value"),
    [("rocm:gfx950+aiter", "fp8"), ("rocm:gfx950", "auto"), ("rocm:gfx942", "auto"), ("cuda:100", "mxfp4"), ("cuda:90", "auto")],
)
def test_not_planned_elsewhere(target: str, value: str) -> None:
    assert not _plan(target, indexer_kv_dtype=value).kernels


def test_runtime_keys_are_planned() -> None:
    """The compressor's runtime tensors: states in a small and in a large pool, the persistent workspaces."""
    keys = set(_plan("rocm:gfx950+aiter").kernel(NAME).keys)
    kernel = CompressPool()
    ids = warmreg.meta((8192,), torch.int64)
    common = dict(
        token_to_req_indices=warmreg.meta((8192,), torch.int32)[:300], positions=ids, kv_slot_mapping=ids[:300],
        block_table=warmreg.meta((256, 262144), torch.int32)[:20], pooled_k=warmreg.meta((8192, 128), torch.bfloat16)[:300],
        compress_ratio=4,
    )  # fmt: skip
    for pages in (1000, 400_000):
        state = warmreg.meta((pages, 4, 512), torch.float32)
        assert kernel.dispatch(state_cache=state, **common) in keys


def test_warm_cross_compiles_both_pointer_ranges() -> None:
    config = example_config("deepseek_v4_flash")  # "auto": MXFP4 on gfx950 with aiter
    plugin = RegisterPlugin(compress_pool.register, model=DSV4.from_config)
    report = warmreg.warm(config, target="rocm:gfx950+aiter", plugins=[plugin], entry_points=False, workers=2)
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    by_range = {r.key.over_2gb: r for r in report.results}
    assert set(by_range) == {(), ("state_cache",)}
    assert by_range[()].binary_hash != by_range[("state_cache",)].binary_hash
    small, big = (str(by_range[k].triton_key) for k in ((), ("state_cache",)))
    assert small.startswith("[('*fp32', 'S')") and big.startswith("[('*fp32', '')")  # tt.pointer_range = 32 or not
