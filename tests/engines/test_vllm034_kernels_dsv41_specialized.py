"""DeepSeek-V4.1's specialized-decode kernels against vLLM 0.34's own, on identical engine-shaped inputs, under Triton's
interpreter: the FP32 indexer key store (``indexer_k_norm_rope_store_fp32``,
``models/deepseek_v41/nvidia/specialized_decode/attention/indexer_k_store.py``), and the indexer's BF16 logits upcast
(``as_fp32_logits``, ``model_executor/layers/sparse_attn_indexer.py``) that the specialized decode's ``_decode_rows``
and the stock indexer's prefill chunks and decode rows run on the SM100 family, and the candidate consumers' mask
(``apply_candidate_mask``, ``model_executor/kernels/attention/dsa/candidate_blocks.py``: the flags, then the mask),
the candidate source's selection (``select_candidate_blocks``, same module: the block scores, ``torch.topk``, the store),
the specialized decode's cooperative selection (``select_candidate_blocks_cooperative``, ``specialized_decode/attention/
candidate_topk.py``: the block scores, ``cooperative_topk``, the finalization), and the sparse-logits consumers'
candidate expansion (``candidate_blocks_to_sparse_indices``,
``model_executor/kernels/attention/dsa/sparse_mqa_logits.py``).

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point as its call site does
(``attention/step.py: AttentionStep._produce_k``: the FP32 ``aux_projection_gemm`` output, the positions, the indexer
RoPE's ``cos_sin_cache``, the k_norm weight and epsilon, the indexer's MXFP4 ``k_cache`` and the indexer metadata's
``slot_mapping``, the layer's compress ratio) and warmreg's op on clones of the same seeded tensors, then compares every
cache byte, written or not, bitwise: the bf16 casts, ``log2`` and ``exp2`` are the same operations on both sides, so
the interpreter gives both the same bits. The upcast is called as ``sparse_attn_indexer``'s prefill branch calls it
(``row_ends = cu_seqlen_ke - cu_seqlen_ks``) and as the decode branches do (``seq_lens.view(-1)``, a row slice of the
decode metadata in ``_decode_rows``), on BF16 logits with DeepGEMM's padded row stride; the FP32 buffer vLLM allocates
uninitialised (``torch.empty_strided``) is compared only below each row's end, the columns either side writes, and the
columns past it are checked unwritten on warmreg's side (its ``out`` starts as a sentinel). The candidate mask is
called as ``sparse_attn_indexer``'s decode branch calls it (no starts, ``row_repeat`` 1 or ``next_n``, the candidate
buffer's first rows) and as its XPU prefill branch does (starts), on the same logits; both sides' logits are compared
bitwise. ``apply_candidate_mask`` asserts ``logits.is_cuda``: the logits are handed to it as :class:`_OnCuda`, a CPU
tensor that reports CUDA (as in ``test_vllm034_kernels_kimi_recoverssm.py``), which changes no kernel and no math.
The cooperative selection calls ``torch.ops._C.cooperative_topk``, a CUDA op this CPU build of vLLM lacks: the test
registers a CPU stand-in for it under that name (:func:`_cooperative_topk`: each row's top ids of its prefix, in
reversed order, as the op's rows are sets) and both sides rank with it; ``current_workspace_manager`` (the engine's
workspace allocator, unset outside a model runner) is replaced by a stub that hands out the workspace tensor.

**Not interpretable as is.** vLLM's store converts to E2M1 with inline PTX (``_fp32x2_to_fp4x2``); the emulation of
``cvt.rn.satfinite.e2m1x2.f32`` from ``test_vllm034_kernels_dsv41_cache.py`` (written from the instruction's
definition, independent of warmreg's ``e2m1_code``) stands in for it. Nothing CUDA-only is asked.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

vllm_kstore = engine("vllm.models.deepseek_v41.nvidia.specialized_decode.attention.indexer_k_store")
vllm_indexer = engine("vllm.model_executor.layers.sparse_attn_indexer")
vllm_candidates = engine("vllm.model_executor.kernels.attention.dsa.candidate_blocks")
vllm_sparse = engine("vllm.model_executor.kernels.attention.dsa.sparse_mqa_logits")
vllm_coop = engine("vllm.models.deepseek_v41.nvidia.specialized_decode.attention.candidate_topk")
import vllm  # noqa: E402
from test_vllm034_kernels_dsv41_cache import _cvt_rn_satfinite_e2m1x2  # noqa: E402
from warmreg_deepseek_v4.v41_candidate_expand import CandidateExpand  # noqa: E402
from warmreg_deepseek_v4.v41_candidate_flags import CandidateFlags  # noqa: E402
from warmreg_deepseek_v4.v41_candidate_mask import CandidateMask, apply_candidate_mask  # noqa: E402
from warmreg_deepseek_v4.v41_candidate_select import (  # noqa: E402
    CandidateScores,
    CandidateStore,
    select_candidate_blocks,
)
from warmreg_deepseek_v4.v41_specialized_candidates import (  # noqa: E402
    CooperativeFinalize,
    CooperativeScores,
    select_candidate_blocks_cooperative,
)
from warmreg_deepseek_v4.v41_specialized_k_store import V41SpecializedKStore  # noqa: E402
from warmreg_deepseek_v4.v41_upcast_logits import UpcastLogits  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

ROW = 68  # MXFP4 key: 64 nibble bytes + 4 UE8M0 scales


# -- indexer_k_norm_rope_store_fp32: AttentionStep._produce_k ---------------------------------------------------------
def _k_store_step(seed: int, rows: int) -> dict[str, torch.Tensor]:
    """A low-batch decode step of ``rows`` tokens (positions across group ends, a padding slot -1) into 3 pages of 16
    keys, each page padded by 64 bytes (the indexer page shares a physical block with the KV pages). The GEMM output
    is wider than the step (``aux_projection_gemm`` of the padded graph rows: vLLM asserts ``T <= k_pre.shape[0]``)
    and holds values that are not bf16, so the load's rounding is exercised."""
    g = seeded(seed)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 17, 18, 19, 40, 41])[:rows]
    slots = torch.tensor([3, 0, 47, 20, -1, 9, 30, 31, 14, -1, 33])[:rows]
    return {
        "k_pre": torch.randn(rows + 2, 128, generator=g) * 2,
        "positions": positions,
        "cos_sin": torch.randn(64, 64, generator=g),
        "weight": (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16),
        "pages": torch.randint(0, 256, (3, 16 * ROW + 64), generator=g, dtype=torch.uint8),
        "slots": slots,
    }


@pytest.mark.parametrize(("ratio", "rows"), [(2, 6), (1, 8), (2, 11)])
def test_specialized_k_store_equals_vllm(ratio: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_kstore, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)  # inline PTX (module docstring)
    args = _k_store_step(ratio + rows, rows)
    theirs, ours = clones(**args), clones(**args)

    def cache(side: dict[str, torch.Tensor]) -> torch.Tensor:
        return side["pages"][:, : 16 * ROW].unflatten(1, (16, ROW))  # [blocks, block_size, row], padded page stride

    vllm_kstore.indexer_k_norm_rope_store_fp32(
        theirs["k_pre"], theirs["positions"], theirs["cos_sin"], theirs["weight"], 1e-6, cache(theirs),
        theirs["slots"], ratio,
    )  # fmt: skip
    V41SpecializedKStore()(ours["k_pre"], ours["positions"], ours["cos_sin"], ours["weight"], 1e-6, cache(ours),
                           ours["slots"], ratio)  # fmt: skip
    assert_same(ours["pages"], theirs["pages"], "indexer K cache pages")
    assert not torch.equal(ours["pages"], args["pages"])  # keys were written


# -- as_fp32_logits: sparse_attn_indexer's prefill chunks and decode rows, the specialized decode's _decode_rows --------
@pytest.mark.parametrize(
    ("rows", "width", "pitch", "decode"),
    [(3, 2500, 2560, False), (1, 5000, 5120, True), (40, 300, 1536, True), (1100, 20, 32, False)],
)
def test_upcast_logits_equals_vllm(rows: int, width: int, pitch: int, decode: bool) -> None:
    """Prefill: a chunk's rows, ends from the chunk's ``cu_seqlen_ke - cu_seqlen_ks``; decode: the row slice
    ``seq_lens[start:end].view(-1)`` of the decode metadata (an offset int32 view) of a padded logits row stride."""
    g = seeded(rows + width)
    logits = (torch.randn(rows, pitch, generator=g) * 6).to(torch.bfloat16)[:, :width]
    if decode:
        seq_lens = torch.randint(1, width + 1, (rows + 5, 1), generator=g, dtype=torch.int32)
        ends = seq_lens[5:].view(-1)  # rows [5, 5 + rows) of the step
    else:
        cu_seqlen_ks = torch.randint(0, 50, (rows,), generator=g, dtype=torch.int32)
        cu_seqlen_ke = cu_seqlen_ks + torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
        ends = cu_seqlen_ke - cu_seqlen_ks  # a fresh tensor
    ends[0] = width  # a full row
    # neither side writes the logits or the ends: both read the same tensors (a clone would drop the row padding)
    theirs = vllm_indexer.as_fp32_logits(logits, ends)
    out = torch.full((rows, pitch), 7777.0)[:, :width]
    ours = UpcastLogits()(logits, ends, out=out)
    assert ours.stride() == theirs.stride() == logits.stride() and ours.dtype == theirs.dtype == torch.float32
    written = torch.arange(width)[None, :] < ends.long()[:, None]
    assert_same(ours[written], theirs[written], "fp32 logits below each row's end")
    assert (ours[~written] == 7777.0).all()  # the columns past each row's end: unwritten


# -- apply_candidate_mask: the candidate consumers' indexer, decode rows and (XPU) prefill chunks ----------------------
class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: ``apply_candidate_mask`` asserts ``logits.is_cuda`` before its Triton
    launches, which the interpreter runs on CPU tensors. It changes no kernel and no math."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


@pytest.mark.parametrize(
    ("rows", "width", "k", "repeat", "starts", "dtype"),
    [
        (6, 2500, 64, 1, False, torch.float32),  # decode rows, one length each
        (6, 1030, 32, 3, False, torch.bfloat16),  # SM100 decode: bf16 logits, (B, 1) lengths for next_n = 3
        (4, 300, 16, 2, True, torch.float32),  # a prefill chunk with starts (XPU's branch)
        (3, 1, 5, 1, False, torch.float32),  # one column: the edge flag
    ],
)
def test_candidate_mask_equals_vllm(
    rows: int, width: int, k: int, repeat: int, starts: bool, dtype: torch.dtype
) -> None:
    g = seeded(rows * width + k)
    nblocks, groups = -(-width // 8), -(-rows // repeat)
    logits = (torch.randn(rows, width + 24, generator=g) * 3).to(dtype)[:, :width]
    args = {
        "logits": logits,
        "cands": torch.randint(-1, nblocks + 3, (rows + 4, k), generator=g, dtype=torch.int32),  # the whole buffer
        "row_ks": torch.randint(0, 20, (groups,), generator=g, dtype=torch.int32) if starts else None,
        "row_ke": torch.randint(width // 2, width + 30, (groups,), generator=g, dtype=torch.int32),
    }
    theirs, ours = clones(**args), clones(**args)
    # clone() of a padded-row view is contiguous: rebuild both sides' logits with the padded stride
    for side in (theirs, ours):
        side["logits"] = torch.empty(rows, width + 24, dtype=dtype)[:, :width].copy_(args["logits"])
    vllm_candidates.apply_candidate_mask(
        theirs["logits"].as_subclass(_OnCuda), theirs["row_ks"], theirs["row_ke"], theirs["cands"][:rows], 8, repeat
    )
    apply_candidate_mask(CandidateFlags(), CandidateMask(), ours["logits"], ours["row_ks"], ours["row_ke"],
                         ours["cands"], 8, repeat)  # fmt: skip
    assert_same(ours["logits"], theirs["logits"], "masked logits")
    assert_same(ours["cands"], theirs["cands"], "candidate buffer (read only)")
    assert width == 1 or not torch.equal(ours["logits"], args["logits"])  # something was masked


# -- candidate_blocks_to_sparse_indices: decode_schedule (specialized decode) and sparse_mqa_logits_paged_decode -------
@pytest.mark.parametrize(("k", "block", "sbk", "paged"), [(64, 8, 8, True), (32, 16, 8, False), (16, 32, 16, False)])
def test_candidate_expand_equals_vllm(k: int, block: int, sbk: int, paged: bool) -> None:
    """The consumer's first rows of the candidate buffer (a row-strided view, as ``op.candidate_blocks[:rows]``), the
    paged path's zero starts or a packed workspace's unaligned ones, into the builder's persistent ``(sparse_indices,
    end)`` (``out=``, sentinel-filled, a row past the step's untouched)."""
    g = seeded(k + block)
    rows = 7
    buf = torch.full((rows + 3, k), -1, dtype=torch.int32)
    for r in range(rows):
        n = int(torch.randint(0, k + 1, (1,), generator=g))
        buf[r, :n] = torch.randperm(2 * k, generator=g)[:n].int()
    ks = (
        torch.zeros(rows, dtype=torch.int32) if paged else torch.randint(0, 41, (rows,), generator=g, dtype=torch.int32)
    )
    ke = ks + torch.randint(0, k * block + 1, (rows,), generator=g, dtype=torch.int32)
    ratio = block // sbk
    args = {
        "cands": buf, "ks": ks, "ke": ke,
        "si": torch.full((rows + 1, k * ratio), 7777, dtype=torch.int32), "end": torch.full((rows + 1,), 7777, dtype=torch.int32),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    vllm_sparse.candidate_blocks_to_sparse_indices(
        theirs["cands"][:rows], theirs["ks"], theirs["ke"], block, sbk, out=(theirs["si"][:rows], theirs["end"][:rows])
    )
    CandidateExpand()(
        ours["cands"][:rows], ours["ks"], ours["ke"], block, sbk, out=(ours["si"][:rows], ours["end"][:rows])
    )
    assert_same(ours["si"], theirs["si"], "sparse block ids")
    assert_same(ours["end"], theirs["end"], "valid sparse-token columns")
    assert (ours["si"][rows] == 7777).all() and ours["end"][rows] == 7777  # the row past the step: untouched


# -- select_candidate_blocks: the candidate source's indexer, prefill chunks and decode rows ---------------------------
@pytest.mark.parametrize(
    ("rows", "width", "k", "repeat", "dtype", "score_dtype"),
    [
        (5, 2100, 64, 1, torch.float32, None),  # a prefill chunk: fp32 logits, scores in the logits' dtype
        (6, 333, 16, 2, torch.bfloat16, torch.float32),  # SM100 decode: bf16 logits, fp32 scores, (B, 1) lengths
        (4, 330, 16, 1, torch.bfloat16, None),  # bf16 scores (another top-k backend)
        (3, 100, 32, 1, torch.float32, None),  # fewer blocks (13) than candidates: -1 past them
    ],
)
def test_select_candidate_blocks_equals_vllm(
    rows: int, width: int, k: int, repeat: int, dtype: torch.dtype, score_dtype: torch.dtype | None
) -> None:
    """vLLM without DeepSelect (``has_deep_select()`` is False off CUDA): the FULL_WIDTH scores, torch.topk, the store
    into the candidate buffer's first rows (a row slice of the persistent ``[tokens, K]`` buffer)."""
    g = seeded(rows * width + k)
    groups = -(-rows // repeat)
    logits = torch.empty(rows, width + 24, dtype=dtype)[:, :width].copy_(torch.randn(rows, width, generator=g) * 3)
    logits[0, 3] = float("nan")  # a NaN block: ranked first by torch.topk on both sides
    row_ke = torch.randint(0, width + 30, (groups,), generator=g, dtype=torch.int32)
    buffers = {"theirs": torch.full((rows + 2, k), 7777, dtype=torch.int32)}
    buffers["ours"] = buffers["theirs"].clone()
    vllm_candidates.select_candidate_blocks(
        logits.as_subclass(_OnCuda), None, row_ke, k, 8, buffers["theirs"][:rows], repeat, score_dtype=score_dtype
    )
    select_candidate_blocks(CandidateScores(), CandidateStore(), logits, None, row_ke, k, 8, buffers["ours"][:rows],
                            repeat, score_dtype)  # fmt: skip
    assert_same(buffers["ours"], buffers["theirs"], "candidate buffer")
    assert (buffers["ours"][:rows] >= 0).any() and (buffers["ours"][rows:] == 7777).all()


# -- select_candidate_blocks_cooperative: the specialized decode's candidate source (fast_candidates) -----------------
def _cooperative_topk(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """The stand-in for ``cooperative_topk`` (module docstring): the top ``min(k, L)`` ids of each row's prefix."""
    for r in range(scores.shape[0]):
        n = min(k, int(lengths[r]))
        if n:
            out[r, :n] = scores[r, : int(lengths[r])].topk(n).indices.flip(0).int()


@pytest.fixture
def _cooperative_topk_op() -> Iterator[None]:
    """``torch.ops._C.cooperative_topk`` as :func:`_cooperative_topk` on CPU for one test (the module docstring says
    why); the registration is removed afterwards, so no other test sees the op."""
    if hasattr(torch.ops._C, "cooperative_topk"):  # a vLLM build with its CUDA op: nothing to stand in
        yield
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("cooperative_topk(Tensor scores, Tensor lengths, Tensor(a!) out, Tensor workspace, int k, int n) -> ()")
    lib.impl(
        "cooperative_topk", lambda scores, lengths, out, ws, k, n: _cooperative_topk(scores, lengths, out, k), "CPU"
    )
    try:
        yield
    finally:
        lib._destroy()


@pytest.mark.usefixtures("_cooperative_topk_op")
@pytest.mark.parametrize(("rows", "width", "k"), [(5, 3200, 512), (14, 4096 + 32, 512), (3, 8 * 1024, 1024)])
def test_cooperative_candidates_equal_vllm(rows: int, width: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows of fp32 upcast logits (``as_fp32_logits``' strides), the row lengths (a row past the logits, an
    empty row), into the candidate buffer's slice of the rank's rows (contiguous, as vLLM asserts)."""
    workspace = torch.empty(vllm_coop.RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8)
    stub = SimpleNamespace(get_simultaneous=lambda *specs: (workspace,))
    monkeypatch.setattr(vllm_coop, "current_workspace_manager", lambda: stub)
    g = seeded(rows + width + k)
    logits = torch.empty(rows, width + 32)[:, :width].copy_(torch.randn(rows, width, generator=g) * 3)
    logits[0, 17] = float("nan")
    ends = torch.randint(1, width + 50, (rows,), generator=g, dtype=torch.int32)
    ends[-1] = 0
    assert vllm_coop.supports_cooperative_candidates(rows, -(-width // 8), k)
    buffers = {"theirs": torch.full((rows + 2, k), 7777, dtype=torch.int32)}
    buffers["ours"] = buffers["theirs"].clone()
    vllm_coop.select_candidate_blocks_cooperative(logits, ends, 8, buffers["theirs"][1 : rows + 1])
    select_candidate_blocks_cooperative(
        CooperativeScores(), CooperativeFinalize(), logits, ends, 8, buffers["ours"][1 : rows + 1], _cooperative_topk
    )
    assert_same(buffers["ours"], buffers["theirs"], "candidate buffer")
    assert (buffers["ours"][1 : rows + 1] >= 0).any() and (buffers["ours"][rows] == -1).all()  # the empty row: -1
