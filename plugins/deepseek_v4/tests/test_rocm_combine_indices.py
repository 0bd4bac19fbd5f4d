"""ROCm's own prefill combine of top-k and SWA indices: the reference under Triton's interpreter, the cases where it
differs from CUDA's op, chunk slices, images, errors, the plan (ROCm without aiter's sparse MLA prefill), out=, and
real cross-compiles for gfx942 and gfx950."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import rocm_combine_indices
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_combine_indices import RocmCombineTopkSwaIndices, rocm_combine_topk_swa_indices_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
W = 8  # a small window


def _chunk(seed: int, topk_width: int, image: bool = False) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """A chunk of 3 requests (query 4, 1, 6 tokens) after 2 decode tokens: ``query_start_loc`` not rebased."""
    g = torch.Generator().manual_seed(seed)
    qsl, seq = torch.tensor([2, 6, 7, 13], dtype=I32), torch.tensor([30, 5, 200], dtype=I32)
    gather = torch.tensor([12, 5, 20], dtype=I32)
    topk = torch.randint(-1, 70, (11, topk_width), generator=g, dtype=I32)
    kwargs: dict[str, Any] = {"M": 100, "N": 60}
    if image:
        kwargs.update(max_image_tokens=6, left_visible=torch.randint(0, 9, (11,), generator=g, dtype=I32),
                      right_visible=torch.randint(0, 4, (11,), generator=g, dtype=I32))  # fmt: skip
    return (topk, qsl, seq, gather), kwargs


@pytest.mark.parametrize(("ratio", "topk", "image"), [(4, 16, False), (128, 2, False), (1, 0, False), (4, 37, True)])
def test_matches_reference(ratio: int, topk: int, image: bool) -> None:
    """C4, C128, SWA-only (top-k 0 over the indexer buffer's rows), and an image batch on an odd width. Entries at or
    past ``N`` become -1 (ROCm's rule; CUDA's keeps them)."""
    args, kwargs = _chunk(ratio + topk, max(topk, 16), image)
    got = RocmCombineTopkSwaIndices(window_size=W)(*args, compress_ratio=ratio, topk=topk, **kwargs)
    want = rocm_combine_topk_swa_indices_reference(*args, window_size=W, compress_ratio=ratio, topk=topk, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_window_clamped_at_seq_and_at_its_width() -> None:
    """A right visibility past the sequence end stops at ``seq``; the stored SWA columns stop at window + image."""
    args = (torch.zeros(1, 4, dtype=I32), torch.tensor([0, 1], dtype=I32), torch.tensor([3], dtype=I32),
            torch.tensor([3], dtype=I32))  # fmt: skip
    kwargs: dict[str, Any] = dict(compress_ratio=4, topk=4, M=10, N=2, max_image_tokens=1,
                                  left_visible=torch.tensor([0], dtype=I32), right_visible=torch.tensor([5], dtype=I32))  # fmt: skip
    rows, lens = RocmCombineTopkSwaIndices(window_size=2)(*args, **kwargs)
    # pos 2: topk_len = 0; window start max(2 - 1, 0) = 1, end min(2 + 5 + 1, 3) = 3: 2 rows at N + 1
    assert lens.tolist() == [2] and rows[0, :4].tolist() == [3, 4, -1, -1] and rows.shape == (1, 128)


def test_launch_errors() -> None:
    args, kwargs = _chunk(1, 16)
    kernel = RocmCombineTopkSwaIndices(window_size=W)
    with pytest.raises(warmreg.LaunchError, match="topk_indices must be"):
        kernel(args[0].t(), *args[1:], compress_ratio=4, topk=16, **kwargs)
    with pytest.raises(warmreg.LaunchError, match="query_start_loc needs"):
        kernel(args[0], args[1][:3], *args[2:], compress_ratio=4, topk=16, **kwargs)
    with pytest.raises(warmreg.LaunchError, match="left_visible and right_visible"):
        kernel(*args, compress_ratio=4, topk=16, left_visible=args[1], **kwargs)


def _plan(target: str, example: str = "deepseek_v4_flash") -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_combine_indices.register, model=DSV4.from_config)
    return warmreg.plan(example_config(example), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "rocm:gfx950+aiter"])
def test_planned_for_the_in_tree_prefill(target: str) -> None:
    """Flash: the SWA-only rows (top-k 0, width 128), C4 (512), C128 (each width 128..8192)."""
    keys = _plan(target).kernel(RocmCombineTopkSwaIndices.name).keys
    got = {(k.compress_ratio, k.top_k, k.topk_width, k.width) for k in keys}
    assert (1, 0, 0, 128) in got and (4, 512, 512, 640) in got and (128, 8192, 8192, 8320) in got and len(got) == 9
    assert_warmup_inputs_reproduce(RocmCombineTopkSwaIndices(window_size=128), keys)


@pytest.mark.parametrize("target", ["rocm:gfx950+aiter+aiter_sparse_mla", "cuda:90"])
def test_not_planned_with_aiter_prefill_or_off_rocm(target: str) -> None:
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_combine_indices.register, model=DSV4.from_config)
    for target in ("rocm:gfx942", "rocm:gfx950"):
        report = warmreg.warm(
            example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False, workers=2
        )
        assert report.ok and report.compiled == 9, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        args, kwargs = _chunk(2, 16)
        return OpCall(RocmCombineTopkSwaIndices(window_size=W), args, {"compress_ratio": 4, "topk": 16, **kwargs})

    check_out(build)
