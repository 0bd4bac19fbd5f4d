"""DeepSeek-V4.1's specialized-decode cooperative candidate selection (the block scores before ``cooperative_topk``, the
finalization after it): against the PyTorch references under Triton's interpreter (exact: block maxima and integer
ids), padded logits rows, rows longer than the logits, empty and negative ends, NaN blocks, the ``-1`` fill, stale and
out-of-prefix ids, a hand-computed row, errors and cross-compiles. ``cooperative_topk`` (a CUDA op) is a torch stand-in
here. Not planned yet (the module docstring says why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_specialized_candidates import (
    CooperativeFinalize,
    CooperativeScores,
    cooperative_finalize_reference,
    cooperative_scores_reference,
    select_candidate_blocks_cooperative,
)

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BS = 8


def _topk(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """A stand-in for cooperative_topk: the top min(k, L) ids of each row's prefix, reversed (rows are sets)."""
    for r in range(scores.shape[0]):
        n = min(k, int(lengths[r]))
        if n:
            out[r, :n] = scores[r, : int(lengths[r])].topk(n).indices.flip(0).int()


def _inputs(seed: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width + 24, generator=g) * 3)[:, :width]
    logits[0, 5] = float("nan")
    ends = torch.randint(-3, width + 40, (rows,), generator=g, dtype=torch.int32)
    ends[-1] = 0  # an empty row
    return logits, ends


@pytest.mark.parametrize(("rows", "width", "k"), [(5, 2100, 64), (3, 333, 16), (4, 64, 32)])
def test_scores_and_finalize_match_reference(rows: int, width: int, k: int) -> None:
    logits, ends = _inputs(rows + width, rows, width)
    nblocks = -(-width // BS)
    scores = torch.full((rows, nblocks), float("nan"))
    lengths = torch.empty(rows, dtype=torch.int32)
    out = torch.full((rows, k), 7777, dtype=torch.int32)
    CooperativeScores()(logits, ends, scores, lengths, out, block_size=BS)
    want_scores, want_lengths = cooperative_scores_reference(logits, ends, BS)
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(lengths, want_lengths) and (out == -1).all()  # the whole output row filled with -1
    _topk(scores, lengths, out, k)
    out[0, -1] = nblocks + 5  # a stale id past the prefix
    want = cooperative_finalize_reference(out, scores, lengths)
    CooperativeFinalize()(out, scores, lengths)
    assert torch.equal(out, want) and out[0, -1] == -1


def test_select_by_hand() -> None:
    """W = 20, BS = 8, end 12: lengths 2; block 0 scores 7, block 1 (newest) +inf; K = 4: ids {1, 0} then -1."""
    out = torch.zeros(1, 4, dtype=torch.int32)
    select_candidate_blocks_cooperative(CooperativeScores(), CooperativeFinalize(),
                                        torch.arange(20, dtype=torch.float32)[None, :],
                                        torch.tensor([12], dtype=torch.int32), BS, out, _topk)  # fmt: skip
    assert out.tolist() == [[0, 1, -1, -1]]


def test_errors_name_the_argument() -> None:
    logits, ends = _inputs(1, 3, 100)
    scores, lengths, out = torch.empty(3, 13), torch.empty(3, dtype=torch.int32), torch.empty(3, 8, dtype=torch.int32)
    op = CooperativeScores()
    with pytest.raises(warmreg.LaunchError, match="row_ends must be a contiguous int32"):
        op(logits, ends.long(), scores, lengths, out, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match=r"scores must be a contiguous float \[3, 13\]"):
        op(logits, ends, scores[:, :12], lengths, out, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="out must be a contiguous int32"):
        op(logits, ends, scores, lengths, out.t(), block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="lengths must be a contiguous int32"):
        CooperativeFinalize()(out, scores, lengths[:2])


def test_warmup_inputs_reproduce_and_cross_compile() -> None:
    scores_op, final_op = CooperativeScores(), CooperativeFinalize()
    out = warmreg.meta((14, 2048), torch.int32)
    scores = warmreg.meta((14, 131072), torch.float32)
    key = scores_op.dispatch(logits=warmreg.meta((14, 1 << 20), torch.float32), scores=scores, out=out, block_size=BS)
    assert_warmup_inputs_reproduce(scores_op, [key])
    assert_warmup_inputs_reproduce(final_op, [final_op.dispatch(out=out, scores=scores)])

    def register(
        registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        registry.add(scores_op, when=warmreg.is_cuda)
        registry.add(final_op, when=warmreg.is_cuda)

    plugin = RegisterPlugin(register, model=DSV4.from_config)
    report = warmreg.warm(
        config_loader(EXAMPLES)("deepseek_v41"), target="cuda:103", plugins=[plugin], entry_points=False
    )
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
