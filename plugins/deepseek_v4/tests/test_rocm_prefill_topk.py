"""ROCm's prefill top-k slots for aiter's sparse MLA: the reference under Triton's interpreter, hand-picked rows, the
batch-wide views vLLM passes, the ragged composite, errors, the plan (aiter's sparse MLA prefill only), out=, and real
cross-compiles for gfx950."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_prefill_topk
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_prefill_topk import (
    RocmPrefillTopkSlots,
    prefill_topk_slots_reference,
    rocm_prefill_topk_ragged,
)
from warmreg_deepseek_v4.rocm_ragged import ragged_from_dense_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
AITER = "rocm:gfx950+aiter+aiter_sparse_mla"


def _batch(seed: int, topk: int, ratio: int) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """Two decode tokens (request 0), then request 1 (5 prefill tokens) and request 2 (3), with their top-k rows."""
    g = torch.Generator().manual_seed(seed)
    qsl, seq = torch.tensor([0, 2, 7, 10], dtype=I32), torch.tensor([40, 9 * ratio, 300 * ratio], dtype=I32)
    t2r = torch.tensor([0, 0, 1, 1, 1, 1, 1, 2, 2, 2], dtype=I32)
    valid = torch.tensor([True] * 6 + [False] + [True] * 3)
    table = torch.randint(0, 500, (3, 300 * ratio // (256 // 1) + 2), generator=g, dtype=I32)
    rows = torch.randint(-1, 400, (8, topk), generator=g, dtype=I32)
    return (rows, t2r, qsl, seq, valid, table), {
        "block_size": 256 // ratio, "compress_ratio": ratio, "num_compressed": 290, "token_offset": 2,
    }  # fmt: skip


@pytest.mark.parametrize(("topk", "ratio"), [(512, 4), (128, 128), (1500, 4), (37, 128)])
def test_matches_reference(topk: int, ratio: int) -> None:
    """C4 and C128 rows, a row past the 1024 tile, a non-power-of-two width; an invalid token; bounds on positions."""
    args, kwargs = _batch(topk + ratio, topk, ratio)
    dense, lens = RocmPrefillTopkSlots()(*args, **kwargs)
    want_dense, want_lens = prefill_topk_slots_reference(*args, **kwargs)
    assert torch.equal(lens, want_lens) and torch.equal(dense, want_dense)
    flat, indptr = rocm_prefill_topk_ragged(*args, *kwargs.values(), 1000)
    want_flat, want_indptr = ragged_from_dense_reference(want_dense, want_lens, 1000)
    assert torch.equal(indptr, want_indptr) and torch.equal(flat[: int(indptr[-1])], want_flat)


def test_hand_picked_row() -> None:
    """Token 2 of a 1-token prefill at position 11 (ratio 4: 3 compressed tokens), page size 2."""
    rows = torch.tensor([[0, 3, 1, 2], [5, -1, 0, 0]], dtype=I32)
    args = (rows, torch.tensor([0, 0, 1], dtype=I32), torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 12], dtype=I32),
            torch.tensor([True, True, True]), torch.tensor([[0, 0, 0], [7, 8, 9]], dtype=I32))  # fmt: skip
    dense, lens = RocmPrefillTopkSlots()(
        *args[:1], *args[1:], block_size=2, compress_ratio=4, num_compressed=5, token_offset=1
    )
    # row 0 is token 1 (request 0, position 4: 1 compressed token); row 1 token 2 (request 1, position 11: 3)
    assert lens.tolist() == [1, 3]
    assert dense.tolist() == [[0, -1, -1, -1], [-1, -1, 14, -1]]


def test_c128_rows_are_a_column_slice() -> None:
    args, kwargs = _batch(3, 256, 128)
    wide = torch.full((8, 512), 77, dtype=I32)
    wide[:, :256] = args[0]
    got = RocmPrefillTopkSlots()(wide[:, :256], *args[1:], **kwargs)
    want = prefill_topk_slots_reference(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_launch_errors() -> None:
    args, kwargs = _batch(1, 16, 4)
    with pytest.raises(warmreg.LaunchError, match="is_valid_token must be"):
        RocmPrefillTopkSlots()(*args[:4], args[4].int(), args[5], **kwargs)
    with pytest.raises(warmreg.LaunchError, match="block_size"):
        RocmPrefillTopkSlots()(*args, **{**kwargs, "block_size": 0})


def _plan(target: str, example: str = "deepseek_v4_flash", **serving: object) -> warmreg.Plan:
    config = example_config(example)
    config["serving"].update(serving)
    plugin = RegisterPlugin(rocm_prefill_topk.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


def test_planned_with_aiter_sparse_mla_prefill() -> None:
    """Flash: C4 rows of 512 on 64-token pages, C128 rows of every C128 width (128..8192) on 2-token pages."""
    keys = _plan(AITER).kernel(RocmPrefillTopkSlots.name).keys
    got = {(k.compress_ratio, k.topk, k.block_size, k.block_w) for k in keys}
    assert (4, 512, 64, 512) in got and (128, 8192, 2, 1024) in got and len(got) == 8
    assert_warmup_inputs_reproduce(RocmPrefillTopkSlots(), keys)


@pytest.mark.parametrize(
    ("target", "example", "tp", "planned"),
    [
        (AITER, "deepseek_v4_pro", 2, True),  # 64 heads a rank
        (AITER, "deepseek_v4_pro", 1, False),  # 128 heads a rank: gather + the in-tree prefill
        ("rocm:gfx950+aiter", "deepseek_v4_flash", 8, False),  # VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA unset
        ("rocm:gfx942+aiter+aiter_sparse_mla", "deepseek_v4_flash", 8, False),  # gfx950 only
        ("cuda:90", "deepseek_v4_flash", 8, False),
    ],
)
def test_planned_only_where_prefill_takes_aiter(target: str, example: str, tp: int, planned: bool) -> None:
    assert bool(_plan(target, example, tensor_parallel_size=tp).kernels) == planned


def test_warm_cross_compiles_for_gfx950() -> None:
    plugin = RegisterPlugin(rocm_prefill_topk.register, model=DSV4.from_config)
    report = warmreg.warm(
        example_config("deepseek_v4_flash"), target=AITER, plugins=[plugin], entry_points=False, workers=2
    )
    assert report.ok and report.compiled == 8, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        args, kwargs = _batch(5, 16, 4)
        return OpCall(RocmPrefillTopkSlots(), args, kwargs)

    check_out(build)
