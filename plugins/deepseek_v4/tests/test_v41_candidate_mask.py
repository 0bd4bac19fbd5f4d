"""DeepSeek-V4.1's candidate mask (the candidate flags, then the mask of the logits): against the PyTorch references
under Triton's interpreter (exact: flags are integers, the mask writes -inf or leaves a value), with strided candidate
buffers, padded logits rows, starts shared by groups of rows, blocks past the logits (the edge flag), -1 padding, bf16
logits, a hand-computed row, empty inputs, errors, ``out=`` and cross-compiles; the plan of a two-level checkpoint's
consumers (CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_candidate_flags import CandidateFlags, candidate_flags_reference
from warmreg_deepseek_v4.v41_candidate_mask import CandidateMask, apply_candidate_mask, candidate_mask_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BS = 8


def _inputs(seed: int, rows: int, width: int, k: int, starts: bool, repeat: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """Logits with a padded row stride, a transposed (column-major) candidate buffer with -1 padding and blocks past
    the width, per-group ends (and starts) of which some lie past the width."""
    g = torch.Generator().manual_seed(seed)
    nblocks, groups = -(-width // BS), -(-rows // repeat)
    logits = (torch.randn(rows, width + 24, generator=g) * 3).to(dtype)[:, :width]
    cands = torch.randint(-1, nblocks + 3, (k, rows + 2), generator=g, dtype=torch.int32).t()  # strides (1, rows + 2)
    row_ks = torch.randint(0, 20, (groups,), generator=g, dtype=torch.int32) if starts else None
    row_ke = torch.randint(width // 2, width + 30, (groups,), generator=g, dtype=torch.int32)
    return logits, row_ks, row_ke, cands


@pytest.mark.parametrize(
    ("rows", "width", "k", "starts", "repeat", "dtype"),
    [
        (5, 300, 16, False, 1, torch.float32),  # decode rows
        (6, 2500, 64, False, 3, torch.bfloat16),  # SM100 decode: bf16, (B, 1) lens for next_n = 3
        (4, 1030, 24, True, 2, torch.float32),  # starts shared by two rows (an XPU prefill chunk)
        (3, 1, 5, False, 1, torch.float32),  # one column: the edge flag
    ],
)
def test_matches_reference(rows: int, width: int, k: int, starts: bool, repeat: int, dtype: torch.dtype) -> None:
    logits, row_ks, row_ke, cands = _inputs(rows * width + k, rows, width, k, starts, repeat, dtype)
    flags = CandidateFlags()(cands[:rows], row_ks, width=width, block_size=BS, row_repeat=repeat)
    want_flags = candidate_flags_reference(cands[:rows], row_ks, width=width, block_size=BS, row_repeat=repeat)
    assert torch.equal(flags, want_flags)
    want = candidate_mask_reference(logits, row_ks, row_ke, cands, BS, repeat)
    apply_candidate_mask(CandidateFlags(), CandidateMask(), logits, row_ks, row_ke, cands, BS, repeat)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert (logits != float("-inf")).any() and (width == 1 or (logits == float("-inf")).any())  # both kinds


def test_one_row_by_hand() -> None:
    """W = 20, BS = 8 (blocks [0, 8), [8, 16), [16, 20)), end 18; candidates 2 and 9 (past the width: the edge flag,
    keeping column 19 only if it were valid) and -1. Kept: columns 16 and 17 (block 2 below the end)."""
    logits = torch.arange(20, dtype=torch.float32)[None, :].clone()
    cands = torch.tensor([[2, 9, -1]], dtype=torch.int32)
    ends = torch.tensor([18], dtype=torch.int32)
    flags = CandidateFlags()(cands, None, width=20, block_size=BS)
    assert flags.tolist() == [[0, 0, 1, 1]]  # N = 3 blocks, then the edge
    CandidateMask()(logits, None, ends, flags, block_size=BS)
    inf = float("-inf")
    assert logits.tolist() == [[inf] * 16 + [16.0, 17.0] + [inf] * 2]
    logits = torch.arange(20, dtype=torch.float32)[None, :].clone()
    CandidateMask()(logits, None, torch.tensor([20], dtype=torch.int32), flags, block_size=BS)
    assert logits[0, 16:].tolist() == [16.0, 17.0, 18.0, 19.0]  # the edge keeps column 19; block 2 keeps 16-19


def test_empty_inputs_launch_nothing() -> None:
    logits = torch.empty(0, 16)
    apply_candidate_mask(CandidateFlags(), CandidateMask(), logits, None, torch.empty(0, dtype=torch.int32),
                         torch.empty(0, 4, dtype=torch.int32), BS)  # fmt: skip
    flags = CandidateFlags()(torch.empty(0, 4, dtype=torch.int32), None, width=16, block_size=BS)
    assert flags.shape == (0, 3)


def test_errors_name_the_argument() -> None:
    logits, _, row_ke, cands = _inputs(1, 4, 100, 8, False, 1, torch.float32)
    flags = CandidateFlags()(cands[:4], None, width=100, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="candidate_blocks must be an int"):
        CandidateFlags()(cands[:4].float(), None, width=100, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="row_starts must be a 1-D int32"):
        CandidateFlags()(cands[:4], row_ke[:1], width=100, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="row_repeat must be >= 1"):
        CandidateFlags()(cands[:4], None, width=100, block_size=BS, row_repeat=0)
    with pytest.raises(warmreg.LaunchError, match="width"):
        CandidateFlags()(cands[:4], None, width=0, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="logits must be a float"):
        CandidateMask()(logits.int(), None, row_ke, flags, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match="row_ends must be a 1-D int32"):
        CandidateMask()(logits, None, row_ke.long(), flags, block_size=BS)
    with pytest.raises(warmreg.LaunchError, match=r"flags must be a contiguous uint8 \[4, 14\]"):
        CandidateMask()(logits, None, row_ke, flags[:, :-1], block_size=BS)


def test_flags_out() -> None:
    check_out(lambda: OpCall(CandidateFlags(), (_inputs(2, 3, 200, 16, True, 1, torch.float32)[3][:3], None),
                             {"width": 200, "block_size": BS}))  # fmt: skip


def test_warmup_inputs_reproduce_and_cross_compile() -> None:
    flags, mask = CandidateFlags(block_size=BS, topk_blocks=2048), CandidateMask(logits_dtypes=("float32", "bfloat16"))
    cands = warmreg.meta((64, 2048), torch.int32)
    f_keys = [flags.dispatch(candidate_blocks=cands, row_starts=s, block_size=BS)
              for s in (None, warmreg.meta((4,), torch.int32))]  # fmt: skip
    assert_warmup_inputs_reproduce(flags, f_keys)
    ends = warmreg.meta((4,), torch.int32)
    m_keys = [mask.dispatch(logits=warmreg.meta((4, 3000), d), row_starts=None, row_ends=ends, block_size=BS)
              for d in (torch.float32, torch.bfloat16)]  # fmt: skip
    assert_warmup_inputs_reproduce(mask, m_keys)

    def register(
        registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        registry.add(flags, when=warmreg.is_cuda)
        registry.add(mask, when=warmreg.is_cuda)

    plugin = RegisterPlugin(register, model=DSV4.from_config)
    report = warmreg.warm(
        config_loader(EXAMPLES)("deepseek_v41"), target="cuda:90", plugins=[plugin], entry_points=False
    )
    assert report.ok and report.compiled == 3, [(r.kernel, r.error) for r in report.failed]


# -- the plan ----------------------------------------------------------------------------------------------------------
FLAGS, MASK = CandidateFlags.name, CandidateMask.name


def _two_level(source: int = 20, k: int = 512, bs: int = 8, **serving: Any) -> dict[str, Any]:
    """examples/deepseek_v41.json with two-level candidate filtering (index layers 2, 8, ..., 36)."""
    config = config_loader(EXAMPLES)("deepseek_v41", **serving)
    config["model"]["text_config"].update(
        candidate_source_layer_id=source, candidate_topk_blocks=k, candidate_block_size=bs
    )
    return config


def _keys(config: dict[str, Any], target: str) -> dict[str, list[dict[str, Any]]]:
    plan = warmreg.plan(config, target=target)
    return {kp.name: [key.fields() for key in kp.keys] for kp in plan.kernels if kp.name in (FLAGS, MASK)}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:120"])
def test_plan_off_sm100_one_key_each(target: str) -> None:
    """The consumers' dense FP32 logits, no starts, int32 ends and candidates, BS and K from the checkpoint."""
    assert _keys(_two_level(k=256, bs=16), target) == {
        FLAGS: [{"block_size": 16, "k": 256, "has_starts": False, "candidates_dtype": "int32", "starts_dtype": "",
                 "num_warps": 4}],
        MASK: [{"logits_dtype": "float32", "block_size": 16, "has_starts": False, "starts_dtype": "",
                "ends_dtype": "int32", "tile": 1024, "num_warps": 4}],
    }  # fmt: skip
    plan = warmreg.plan(_two_level(k=256, bs=16), target=target)
    for name in (FLAGS, MASK):
        assert_warmup_inputs_reproduce(plan.kernel(name).kernel, plan.kernel(name).keys)


def test_plan_runtime_calls_hit_the_planned_keys() -> None:
    """vLLM's ``apply_candidate_mask(logits, None, row_ends, candidates, block_size, row_repeat)`` of a prefill chunk
    and of decode rows: both launches dispatch to the planned keys."""
    plan = warmreg.plan(_two_level(), target="cuda:90")
    flags_kp, mask_kp = plan.kernel(FLAGS), plan.kernel(MASK)
    for rows, width, pitch, repeat in ((5, 700, 704, 1), (6, 4096, 4096, 2)):
        logits = warmreg.meta((rows, pitch), torch.float32)[:, :width]
        ends = warmreg.meta((rows // repeat,), torch.int32)
        cands = warmreg.meta((rows + 3, 512), torch.int32)[3:]  # the buffer's rows of the chunk
        kw = dict(block_size=8, row_repeat=repeat)
        flags_call = OpCall(flags_kp.kernel, (cands[:rows], None), dict(width=width, **kw))
        assert flags_call.launch_code().key in flags_kp.keys
        flags = warmreg.meta((rows, -(-width // 8) + 1), torch.uint8)
        assert OpCall(mask_kp.kernel, (logits, None, ends, flags), kw).launch_code().key in mask_kp.keys


def test_plan_nothing_without_a_consumer() -> None:
    for config in (
        config_loader(EXAMPLES)("deepseek_v41"),  # no candidate fields (vLLM's defaults: -1, 0, 0)
        _two_level(source=-1), _two_level(k=0),  # vLLM allocates no candidate buffer
        _two_level(source=36),  # the top index layer: nothing reads
    ):  # fmt: skip
        assert not _keys(config, "cuda:90")
        assert not _keys(config, "cuda:100")


@pytest.mark.parametrize("target", ["cuda:100", "cuda:103"])
def test_plan_sm100_dense_consumers(target: str) -> None:
    """The SM100 family without DeepGEMM's sparse kernels (no ``+deepgemm``): dense logits, FP32 in prefill chunks and
    BF16 in decode rows (index_topk 512: the auto top-k takes BF16); the same flags."""
    got = _keys(_two_level(), target)
    assert [k["logits_dtype"] for k in got[MASK]] == ["bfloat16", "float32"]
    assert [k["k"] for k in got[FLAGS]] == [512]


def test_plan_sm100_sparse_consumers_with_deepgemm() -> None:
    """With ``+deepgemm`` the sparse-logits indexer takes the consumers (no flags, no mask; the expansion instead),
    unless DCP or PCP, or DeepSelect's layout of K * BS bf16 columns refuses it."""
    assert not _keys(_two_level(), "cuda:100+deepgemm")
    for config in (_two_level(k=100), _two_level(prefill_context_parallel_size=2)):
        assert FLAGS in _keys(config, "cuda:100+deepgemm")
