"""DeepSeek-V4.1's candidate selection (block scores, torch.topk, store): against the PyTorch references under Triton's
interpreter (exact: block maxima of the logits, integer ids), FULL_WIDTH and DeepSelect's valid-prefix scoring,
padded logits rows, starts shared by groups of rows, NaN and empty blocks, bf16 logits, a hand-computed row, a candidate
buffer wider than the blocks, errors and cross-compiles; the plan of a two-level checkpoint (CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_candidate_select import (
    CandidateScores,
    CandidateStore,
    candidate_scores_reference,
    select_candidate_blocks,
    select_candidate_blocks_reference,
)

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BS = 8


def _inputs(seed: int, rows: int, width: int, starts: bool, repeat: int, dtype: torch.dtype) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    groups = -(-rows // repeat)
    logits = (torch.randn(rows, width + 24, generator=g) * 3).to(dtype)[:, :width]
    logits[0, 3] = float("nan")  # a NaN block
    row_ks = torch.randint(0, 20, (groups,), generator=g, dtype=torch.int32) if starts else None
    row_ke = torch.randint(0, width + 30, (groups,), generator=g, dtype=torch.int32)
    return logits, row_ks, row_ke


@pytest.mark.parametrize("full_width", [True, False])
@pytest.mark.parametrize(
    ("rows", "width", "starts", "repeat", "dtype"),
    [(5, 2100, False, 1, torch.float32), (6, 333, False, 3, torch.bfloat16), (4, 1030, True, 2, torch.float32)],
)
def test_scores_match_reference(
    rows: int, width: int, starts: bool, repeat: int, dtype: torch.dtype, full_width: bool
) -> None:
    logits, row_ks, row_ke = _inputs(rows + width, rows, width, starts, repeat, dtype)
    nblocks = -(-width // BS)
    scores = torch.full((rows, nblocks + 5), float("nan"), dtype=dtype)[:, :nblocks]  # a padded row stride
    valid = torch.empty(rows, dtype=torch.int32)
    CandidateScores()(logits, row_ks, row_ke, scores, valid, block_size=BS, full_width=full_width, row_repeat=repeat)
    want, want_valid = candidate_scores_reference(logits, row_ks, row_ke, block_size=BS, full_width=full_width,
                                                  row_repeat=repeat)  # fmt: skip
    assert torch.equal(valid, want_valid)
    torch.testing.assert_close(scores, want, rtol=0, atol=0, equal_nan=True)  # unwritten blocks stay NaN on both


@pytest.mark.parametrize(("rows", "width", "k", "repeat", "dtype", "score_dtype"), [
    (5, 2100, 64, 1, torch.float32, None),  # a prefill chunk's fp32 logits
    (6, 333, 16, 2, torch.bfloat16, torch.float32),  # SM100 decode: bf16 logits, fp32 scores (auto top-k)
    (3, 100, 32, 1, torch.float32, None),  # fewer blocks (13) than candidates: -1 past them
])  # fmt: skip
def test_select_matches_reference(
    rows: int, width: int, k: int, repeat: int, dtype: torch.dtype, score_dtype: torch.dtype | None
) -> None:
    logits, _, row_ke = _inputs(rows * k, rows, width, False, repeat, dtype)
    out = torch.full((rows + 2, k + 3), 7777, dtype=torch.int32)[:rows, :k]  # a row-strided slice of a buffer
    select_candidate_blocks(CandidateScores(), CandidateStore(), logits, None, row_ke, k, BS, out, repeat, score_dtype)
    want = select_candidate_blocks_reference(logits, None, row_ke, k, BS, repeat, score_dtype)
    assert torch.equal(out, want)
    nblocks = -(-width // BS)
    assert (out >= 0).any() and (k <= nblocks or (out[:, nblocks:] == -1).all())  # -1 past the blocks


def test_one_row_by_hand() -> None:
    """W = 20, BS = 8: blocks [0, 8), [8, 16), [16, 20); end 12 (col_end 12): block 1 is the newest (pinned +inf),
    block 0 scores max(cols 0..7) = 7, block 2 is empty (-inf). Top 2: blocks 1, 0; the third slot -1 (a -inf score)."""
    logits = torch.arange(20, dtype=torch.float32)[None, :]
    out = torch.zeros(1, 3, dtype=torch.int32)
    select_candidate_blocks(CandidateScores(), CandidateStore(), logits, None, torch.tensor([12], dtype=torch.int32),
                            3, BS, out)  # fmt: skip
    assert out.tolist() == [[1, 0, -1]]
    scores, valid = torch.empty(1, 3), torch.empty(1, dtype=torch.int32)
    CandidateScores()(logits, None, torch.tensor([12], dtype=torch.int32), scores, valid, block_size=BS,
                      full_width=True)  # fmt: skip
    assert scores.tolist() == [[7.0, float("inf"), float("-inf")]] and valid.tolist() == [2]


def test_empty_and_zero_width() -> None:
    out = torch.zeros(2, 4, dtype=torch.int32)
    select_candidate_blocks(CandidateScores(), CandidateStore(), torch.empty(2, 0), None,
                            torch.zeros(2, dtype=torch.int32), 4, BS, out)  # fmt: skip
    assert (out == -1).all()
    select_candidate_blocks(CandidateScores(), CandidateStore(), torch.empty(0, 5), None,
                            torch.zeros(0, dtype=torch.int32), 4, BS, out[:0])  # fmt: skip


def test_errors_name_the_argument() -> None:
    logits, _, row_ke = _inputs(1, 3, 100, False, 1, torch.float32)
    scores, valid = torch.empty(3, 13), torch.empty(3, dtype=torch.int32)
    op = CandidateScores()
    with pytest.raises(warmreg.LaunchError, match="logits must be a float"):
        op(logits.int(), None, row_ke, scores, valid, block_size=BS, full_width=True)
    with pytest.raises(warmreg.LaunchError, match=r"scores must be a float \[3, 13\]"):
        op(logits, None, row_ke, scores[:, :12], valid, block_size=BS, full_width=True)
    with pytest.raises(warmreg.LaunchError, match="valid_blocks must be a contiguous int32"):
        op(logits, None, row_ke, scores, valid.long(), block_size=BS, full_width=True)
    with pytest.raises(warmreg.LaunchError, match="row_ends must be a 1-D int32"):
        op(logits, None, row_ke[:1], scores, valid, block_size=BS, full_width=True)
    top = scores.topk(4)
    with pytest.raises(warmreg.LaunchError, match="indices must be a contiguous int64"):
        CandidateStore()(top.values, top.indices.int(), torch.empty(3, 4, dtype=torch.int32))
    with pytest.raises(warmreg.LaunchError, match="out must be an int32"):
        CandidateStore()(top.values, top.indices, torch.empty(3, 4))


def test_warmup_inputs_reproduce_and_cross_compile() -> None:
    scores_op, store_op = CandidateScores(), CandidateStore()
    logits, scores = warmreg.meta((4, 3000), torch.bfloat16), warmreg.meta((4, 375), torch.float32)
    s_keys = [scores_op.dispatch(logits=logits, row_starts=None, scores=scores, block_size=BS, full_width=f)
              for f in (True, False)]  # fmt: skip
    assert_warmup_inputs_reproduce(scores_op, s_keys)
    out = warmreg.meta((4, 2048), torch.int32)
    assert_warmup_inputs_reproduce(store_op, [store_op.dispatch(values=warmreg.meta((4, 375), torch.float32), out=out)])

    def register(
        registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        registry.add(scores_op, when=warmreg.is_cuda)
        registry.add(store_op, when=warmreg.is_cuda)

    plugin = RegisterPlugin(register, model=DSV4.from_config)
    report = warmreg.warm(
        config_loader(EXAMPLES)("deepseek_v41"), target="cuda:90", plugins=[plugin], entry_points=False
    )
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


# -- the plan ----------------------------------------------------------------------------------------------------------
def _two_level(source: int = 20, k: int = 512, bs: int = 8, **serving: Any) -> dict[str, Any]:
    """examples/deepseek_v41.json with two-level candidate filtering (index layers 2, 8, ..., 36)."""
    config = config_loader(EXAMPLES)("deepseek_v41", **serving)
    config["model"]["text_config"].update(
        candidate_source_layer_id=source, candidate_topk_blocks=k, candidate_block_size=bs
    )
    return config


def _keys(config: dict[str, Any], target: str) -> dict[str, list[dict[str, Any]]]:
    plan = warmreg.plan(config, target=target)
    return {kp.name: [key.fields() for key in kp.keys] for kp in plan.kernels if kp.name in (SCORES, STORE)}


SCORES, STORE = CandidateScores.name, CandidateStore.name


@pytest.mark.parametrize("target", ["cuda:90", "cuda:120"])
def test_plan_off_sm100_one_fp32_full_width_key_each(target: str) -> None:
    """FP32 logits and scores, no starts, FULL_WIDTH (no DeepSelect), BS and K from the checkpoint."""
    got = _keys(_two_level(k=1024, bs=16), target)
    assert got == {
        SCORES: [{"logits_dtype": "float32", "scores_dtype": "float32", "block_size": 16, "has_starts": False,
                  "full_width": True, "tile": 128, "num_warps": 4}],
        STORE: [{"values_dtype": "float32", "out_k": 1024, "tile": 256, "num_warps": 4}],
    }  # fmt: skip
    plan = warmreg.plan(_two_level(k=1024, bs=16), target=target)
    for name in (SCORES, STORE):
        assert_warmup_inputs_reproduce(plan.kernel(name).kernel, plan.kernel(name).keys)


def test_plan_runtime_calls_hit_the_planned_keys() -> None:
    """vLLM's prefill chunk and decode calls (no starts, int32 ends, a padded row stride, rows sharing ends) dispatch
    to the planned keys."""
    plan = warmreg.plan(_two_level(), target="cuda:90")
    scores_kp, store_kp = plan.kernel(SCORES), plan.kernel(STORE)
    for rows, width, pitch, repeat in ((5, 700, 704, 1), (6, 4096, 4096, 2)):
        logits = warmreg.meta((rows, pitch), torch.float32)[:, :width]
        ends, n = warmreg.meta((rows // repeat,), torch.int32), -(-width // 8)
        scores, valid = warmreg.meta((rows, n), torch.float32), warmreg.meta((rows,), torch.int32)
        kw = dict(block_size=8, full_width=True, row_repeat=repeat)
        assert OpCall(scores_kp.kernel, (logits, None, ends, scores, valid), kw).launch_code().key in scores_kp.keys
        top = (warmreg.meta((rows, 512), torch.float32), warmreg.meta((rows, 512), torch.int64))
        out = warmreg.meta((rows + 4, 512), torch.int32)[4:]  # the buffer's rows of the chunk
        assert OpCall(store_kp.kernel, (*top, out), {}).launch_code().key in store_kp.keys


def test_plan_nothing_without_a_source_index_layer() -> None:
    for config in (
        config_loader(EXAMPLES)("deepseek_v41"),  # no candidate fields (vLLM's defaults: -1, 0, 0)
        _two_level(source=-1), _two_level(k=0),  # vLLM allocates no candidate buffer
        _two_level(source=21),  # not an index layer: nothing writes (layers above it still read)
    ):  # fmt: skip
        assert not _keys(config, "cuda:90")
        assert not _keys(config, "cuda:100")


def test_plan_refuses_a_zero_block_size() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"text\.candidate_block_size.*needs a block size > 0"):
        warmreg.plan(_two_level(bs=0), target="cuda:90")
    with pytest.raises(warmreg.ConfigError, match=r"candidate_topk_blocks"):
        warmreg.plan(_two_level(k=-1), target="cuda:90")


def _scores(config: dict[str, Any], target: str) -> set[tuple[str, str, bool]]:
    return {(k["logits_dtype"], k["scores_dtype"], k["full_width"]) for k in _keys(config, target).get(SCORES, [])}


@pytest.mark.parametrize("target", ["cuda:100", "cuda:103", "cuda:100+deepgemm"])
def test_plan_sm100(target: str) -> None:
    """The SM100 family (_v41_candidates' assumptions): the decode rows' BF16 logits (index_topk 512: the auto top-k
    takes BF16) scored into FP32 and ranked by DeepSelect (1 Mi positions / layer 20's ratio 1 / 8 = 131072 blocks >= K); the
    prefill chunks' FP32 logits, narrow (FULL_WIDTH, the store) or wide (DeepSelect)."""
    assert _scores(_two_level(), target) == {
        ("bfloat16", "float32", False), ("float32", "float32", False), ("float32", "float32", True)
    }  # fmt: skip
    assert _keys(_two_level(), target)[STORE] == [
        {"values_dtype": "float32", "out_k": 512, "tile": 256, "num_warps": 4}
    ]
    # K = 100: DeepSelect's 32-byte output rows refuse it; torch.topk ranks every call
    assert _scores(_two_level(k=100), target) == {("bfloat16", "float32", True), ("float32", "float32", True)}
    # index_topk 2047: the auto top-k takes no BF16 (per_row), so the decode logits are upcast first
    fp32 = _two_level()
    fp32["model"]["text_config"]["index_topk"] = 2047
    assert _scores(fp32, target) == {("float32", "float32", False), ("float32", "float32", True)}
    # a short context: the decode rows (max_model_len 2048 / layer 20's ratio 1 / 8 = 256 blocks) stay under K,
    # prefill chunks of 256 requests reach it
    short = _two_level(max_model_len=2048)
    assert _scores(short, target) == {
        ("bfloat16", "float32", True), ("float32", "float32", False), ("float32", "float32", True)
    }  # fmt: skip
    plan = warmreg.plan(_two_level(), target=target)
    for name in (SCORES, STORE):
        assert_warmup_inputs_reproduce(plan.kernel(name).kernel, plan.kernel(name).keys)
