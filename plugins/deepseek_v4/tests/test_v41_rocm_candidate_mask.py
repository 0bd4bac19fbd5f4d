"""DeepSeek-V4.1's ROCm candidate masks (the fused one of gfx942 / gfx950, the strided one elsewhere): the references
under Triton's interpreter, hand-picked rows, starts and repeated rows, strided views, errors, a real cross-compile
for both archs, and that nothing plans them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import v41
from warmreg_deepseek_v4.v41_rocm_candidate_mask import (
    RocmCandidateMask,
    RocmCandidateMaskStrided,
    candidate_flags_reference,
    rocm_candidate_mask_reference,
    rocm_candidate_mask_strided_reference,
)

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32, INF = torch.int32, float("inf")


def test_hand_picked_row() -> None:
    """W 10, blocks of 3, end 8: blocks 0 [0, 3), 1 [3, 6), 2 [6, 8); candidate 1 kept, 0 and 2 masked; candidate 9
    (past W: 9 * 3 >= 10) keeps the last column, which lies past the end here, so nothing; columns 8, 9 untouched."""
    logits = torch.arange(10, dtype=torch.float32).reshape(1, 10)
    RocmCandidateMask()(logits, None, torch.tensor([8], dtype=I32), torch.tensor([[1, 9]], dtype=I32), 3)
    assert logits[0].tolist() == [-INF, -INF, -INF, 3, 4, 5, -INF, -INF, 8, 9]


def test_edge_keeps_the_last_column() -> None:
    """End at W: a candidate past W keeps column W - 1 of an unchosen block."""
    logits = torch.zeros(1, 10)
    RocmCandidateMask()(logits, None, torch.tensor([10], dtype=I32), torch.tensor([[0, 4]], dtype=I32), 3)
    assert torch.isinf(logits[0]).tolist() == [False] * 3 + [True] * 6 + [False]


@pytest.mark.parametrize(
    ("rows", "width", "block", "k", "repeat", "starts"),
    [(3, 700, 64, 5, 1, False), (4, 5000, 64, 8, 2, False), (3, 300, 16, 3, 1, True), (2, 640, 64, 4, 1, False)],
)
def test_matches_reference(rows: int, width: int, block: int, k: int, repeat: int, starts: bool) -> None:
    """Ends past W and inside it, candidates -1 and past the live blocks, repeated rows, starts (the head masked)."""
    g = torch.Generator().manual_seed(rows * width + k)
    groups = -(-rows // repeat)
    logits = torch.randn(rows, width, generator=g)
    ends = torch.randint(0, width + 50, (groups,), generator=g, dtype=I32)
    ks = torch.randint(0, 100, (groups,), generator=g, dtype=I32) if starts else None
    cand = torch.randint(-1, width // block + 3, (rows, k), generator=g, dtype=I32)
    want = rocm_candidate_mask_reference(logits, ks, ends, cand, block, repeat)
    RocmCandidateMask()(logits, ks, ends, cand, block, repeat)
    assert torch.equal(logits, want)


def test_strided_views() -> None:
    """A column-strided logits view and a transposed candidate table."""
    g = torch.Generator().manual_seed(5)
    backing = torch.randn(3, 2 * 400, generator=g)
    logits, cand = backing[:, ::2], torch.randint(-1, 8, (4, 3), generator=g, dtype=I32).t()
    ends, untouched = torch.tensor([400, 250, 90], dtype=I32), backing[:, 1::2].clone()
    want = rocm_candidate_mask_reference(logits, None, ends, cand, 64)
    RocmCandidateMask()(logits, None, ends, cand, 64)
    assert torch.equal(logits, want) and torch.equal(backing[:, 1::2], untouched)


def test_strided_hand_picked_row() -> None:
    """Off gfx942 / gfx950: start 2, end 8, blocks of 3, flags of block 1 ([5, 8)): the head, block 0 and the tile past
    the end (up to W, inside the first 1024-column tile) are masked."""
    logits = torch.arange(12, dtype=torch.float32).reshape(1, 12)
    flags = candidate_flags_reference(torch.tensor([[1]], dtype=I32), torch.tensor([2], dtype=I32), 12, 3)
    assert flags.tolist() == [[0, 1, 0, 0, 0]]
    RocmCandidateMaskStrided()(logits, torch.tensor([2], dtype=I32), torch.tensor([8], dtype=I32), flags, 3)
    assert logits[0].tolist() == [-INF] * 5 + [5, 6, 7] + [-INF] * 4


@pytest.mark.parametrize(
    ("rows", "width", "block", "k", "repeat", "starts"),
    [(3, 700, 64, 5, 1, False), (4, 5000, 64, 8, 2, False), (3, 2300, 16, 3, 1, True)],
)
def test_strided_matches_reference(rows: int, width: int, block: int, k: int, repeat: int, starts: bool) -> None:
    """The flags of candidates past W (the edge), ends past W and inside it (the end's tile masked), starts."""
    g = torch.Generator().manual_seed(rows * width + k + 1)
    groups = -(-rows // repeat)
    logits = torch.randn(rows, width, generator=g)
    ends = torch.randint(0, width + 50, (groups,), generator=g, dtype=I32)
    ks = torch.randint(0, 100, (groups,), generator=g, dtype=I32) if starts else None
    cand = torch.randint(-1, width // block + 3, (rows, k), generator=g, dtype=I32)
    flags = candidate_flags_reference(cand, ks, width, block, repeat)
    want = rocm_candidate_mask_strided_reference(logits, ks, ends, flags, block, repeat)
    RocmCandidateMaskStrided()(logits, ks, ends, flags, block, repeat)
    assert torch.equal(logits, want)


def test_launch_errors() -> None:
    logits, ends, cand = torch.zeros(2, 64), torch.tensor([9, 9], dtype=I32), torch.zeros(2, 3, dtype=I32)
    op = RocmCandidateMask()
    with pytest.raises(warmreg.LaunchError, match="logits must be"):
        op(logits.double(), None, ends, cand, 8)
    with pytest.raises(warmreg.LaunchError, match="row_ke must be"):
        op(logits, None, ends[:1], cand, 8)
    with pytest.raises(warmreg.LaunchError, match="candidate_blocks must be"):
        op(logits, None, ends, cand.long(), 8)
    with pytest.raises(warmreg.LaunchError, match="block_size and row_repeat"):
        op(logits, None, ends, cand, 0)
    with pytest.raises(warmreg.LaunchError, match="flags must be"):
        RocmCandidateMaskStrided()(logits, None, ends, torch.zeros(2, 9, dtype=torch.uint8), 16)


def test_cross_compiles_for_gfx942_and_gfx950() -> None:
    """Registered by hand (a checkpoint with candidate blocks), both archs compile the key."""
    kernel, strided = RocmCandidateMask(block_size=64, k=64), RocmCandidateMaskStrided(block_size=64)

    def register(registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
        registry.add(kernel, when=warmreg.rocm_arch_in("gfx942", "gfx950"))
        registry.add(strided, when=warmreg.is_rocm)

    for target in ("rocm:gfx942", "rocm:gfx950"):
        plugin = RegisterPlugin(register)
        report = warmreg.warm(example_config("deepseek_v41"), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
        plan = warmreg.plan(example_config("deepseek_v41"), target=target, plugins=[plugin], entry_points=False)
        assert_warmup_inputs_reproduce(kernel, plan.kernel(kernel.name).keys)
        assert_warmup_inputs_reproduce(strided, plan.kernel(strided.name).keys)


def test_not_planned() -> None:
    """The model does not read the candidate fields: no deployment plans the mask."""
    config = example_config("deepseek_v41")
    config["serving"]["attention_backend"] = "ROCM_FLASHMLA_SPARSE_DSV41"
    for target in ("rocm:gfx942", "rocm:gfx950"):
        names = {k.name for k in warmreg.plan(config, target=target).kernels}
        assert not {RocmCandidateMask.name, RocmCandidateMaskStrided.name} & names
    assert any(m.__name__.endswith("v41_rocm_candidate_mask") for m in v41.ROCM_OP_MODULES)
