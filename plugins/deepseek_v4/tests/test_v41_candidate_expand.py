"""DeepSeek-V4.1's candidate expansion into DeepGEMM's sparse block ids: against the PyTorch reference under Triton's
interpreter (exact: integers), ratios 1 and 2, packed-workspace rows (``ks > 0``, unaligned), empty and out-of-range
rows, strided candidate rows, a hand-computed row, errors, ``out=`` and cross-compiles. Not planned yet (the module
docstring says why): no plan test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_candidate_expand import CandidateExpand, candidate_expand_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _inputs(seed: int, rows: int, k: int, block: int, sbk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unique candidates of a row (-1 padded) in a wider buffer; starts 0..40 (unaligned), lengths 0..k * block."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((rows, k + 8), -1, dtype=torch.int32)
    for r in range(rows):
        n = int(torch.randint(0, k + 1, (1,), generator=g))
        buf[r, :n] = torch.randperm(2 * k, generator=g)[:n].int()
    ks = torch.randint(0, 41, (rows,), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(0, k * block + 1, (rows,), generator=g, dtype=torch.int32)
    ke[0] = ks[0]  # an empty row
    return buf[:, :k], ks, ke


@pytest.mark.parametrize(("rows", "k", "block", "sbk"), [(6, 16, 8, 8), (5, 32, 16, 8), (3, 64, 32, 16)])
def test_matches_reference(rows: int, k: int, block: int, sbk: int) -> None:
    args = (*_inputs(rows + k, rows, k, block, sbk), block, sbk)
    si, end = CandidateExpand()(*args)
    want_si, want_end = candidate_expand_reference(*args)
    assert torch.equal(si, want_si) and torch.equal(end, want_end)
    assert end[0] == 0 and (si[0] == args[1][0] // sbk).all()  # the empty row: the base, repeated


def test_one_row_by_hand() -> None:
    """K = 4, block 16 = 2 x SBK 8: candidates [3, -1, 0, 9] -> sparse [6, 7, 0, 1, 18, 19] (-1 drops); ks 5, ke 5 +
    60 -> 8 sparse blocks inside: 6, 7, 0, 1 kept; sorted 0, 1, 6, 7 + base 0; padding 7; end 3 * 8 + min(max(65 -
    (7 * 8 + 5), 1), 8) = 28."""
    si, end = CandidateExpand()(
        torch.tensor([[3, -1, 0, 9]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
        torch.tensor([65], dtype=torch.int32), 16, 8,
    )  # fmt: skip
    assert si.tolist() == [[0, 1, 6, 7, 7, 7, 7, 7]] and end.tolist() == [28]


def test_empty_batch_launches_nothing() -> None:
    none = torch.empty(0, dtype=torch.int32)
    si, end = CandidateExpand()(torch.empty(0, 8, dtype=torch.int32), none, none, 8, 8)
    assert si.shape == (0, 8) and end.shape == (0,)


def test_errors_name_the_argument() -> None:
    cands, ks, ke = _inputs(1, 3, 16, 8, 8)
    op = CandidateExpand()
    with pytest.raises(warmreg.LaunchError, match="candidate_blocks must be int32"):
        op(cands[:, :12], ks, ke, 8, 8)  # not a power of two
    with pytest.raises(warmreg.LaunchError, match="candidate_blocks must be int32"):
        op(cands.long(), ks, ke, 8, 8)
    with pytest.raises(warmreg.LaunchError, match="candidate_block_size"):
        op(cands, ks, ke, 32, 8)
    with pytest.raises(warmreg.LaunchError, match="row_ke must be int32"):
        op(cands, ks, ke[:2], 8, 8)


def test_out() -> None:
    check_out(lambda: OpCall(CandidateExpand(), (*_inputs(2, 4, 16, 16, 8), 16, 8), {}))


def test_warmup_inputs_reproduce_and_cross_compile() -> None:
    op = CandidateExpand(topk_blocks=2048, block_size=8, sparse_block_kv=8)
    keys = [
        op.dispatch(candidate_blocks=warmreg.meta((4, 2048), torch.int32), candidate_block_size=b, sparse_block_kv=8)
        for b in (8, 16)
    ]
    assert_warmup_inputs_reproduce(op, keys)

    def register(
        registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        registry.add(op, when=warmreg.is_cuda)

    plugin = RegisterPlugin(register, model=DSV4.from_config)
    report = warmreg.warm(
        config_loader(EXAMPLES)("deepseek_v41"), target="cuda:100", plugins=[plugin], entry_points=False
    )
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]


# -- the plan ----------------------------------------------------------------------------------------------------------
def _two_level(k: int = 512, bs: int = 8, **serving: Any) -> dict[str, Any]:
    """examples/deepseek_v41.json with two-level candidate filtering (source 20; index layers 24, 28, ... read)."""
    config = config_loader(EXAMPLES)("deepseek_v41", **serving)
    config["model"]["text_config"].update(
        candidate_source_layer_id=20, candidate_topk_blocks=k, candidate_block_size=bs
    )
    return config


def _expand_keys(config: dict[str, Any], target: str) -> list[dict[str, Any]]:
    plan = warmreg.plan(config, target=target)
    return [key.fields() for kp in plan.kernels if kp.name == CandidateExpand.name for key in kp.keys]


def test_plan_sm100_with_deepgemm_only() -> None:
    """The sparse-logits consumers: the SM100 family with DeepGEMM's sparse kernels (``+deepgemm``); SBK the largest
    of 16 and 8 dividing BS; nothing on Hopper, without ``+deepgemm``, or where DeepSelect's layout refuses K * BS."""
    (key,) = _expand_keys(_two_level(), "cuda:100+deepgemm")
    assert {f: key[f] for f in ("k", "ratio", "sparse_block_kv")} == {"k": 512, "ratio": 1, "sparse_block_kv": 8}
    (key,) = _expand_keys(_two_level(k=1024, bs=32), "cuda:103+deepgemm")
    assert {f: key[f] for f in ("k", "ratio", "sparse_block_kv")} == {"k": 1024, "ratio": 2, "sparse_block_kv": 16}
    plan = warmreg.plan(_two_level(), target="cuda:100+deepgemm")
    assert_warmup_inputs_reproduce(plan.kernel(CandidateExpand.name).kernel, plan.kernel(CandidateExpand.name).keys)
    for config, target in (
        (_two_level(), "cuda:100"), (_two_level(), "cuda:90"), (_two_level(k=100), "cuda:100+deepgemm"),
        (_two_level(decode_context_parallel_size=2), "cuda:100+deepgemm"),
    ):  # fmt: skip
        assert not _expand_keys(config, target)
