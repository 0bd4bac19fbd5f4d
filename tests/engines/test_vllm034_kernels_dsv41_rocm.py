"""DeepSeek-V4.1's ROCm decode metadata ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under
Triton's interpreter: the one-launch top-k pack of gfx942 ``--monokernel`` (and V4.1's two-launch path for the batches
it does not take, which warmreg serves with DeepSeek-V4's ROCm ops: same math), the one-launch SWA decode metadata,
the decoder layer's mHC seam of gfx950 with aiter, the gfx942 mono decode's key lists, and the two-level indexer's
candidate mask on gfx942 / gfx950.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's Python entry point as its call site does: ``compute_global_topk_ragged_indices_and_indptr`` of
``models/deepseek_v41/amd/rocm.py`` (from ``_decode_topk_ragged``; it calls ``topk_pack.pack`` first) and
``swa_decode_meta.launch`` (what ``swa_decode_meta.build`` calls with the SWA builder's persistent buffers),
``mhc_post_collapse_rms_norm_triton`` (from ``amd/mhc.py: mhc_pre_delayed_overlap``), ``keylist.launch`` (from
``mono/runner.py``, the runner's ``kt`` / ``klen`` buffers), ``_apply_candidate_mask_strided`` (from the ROCm
indexers' decode), and warmreg's op on clones of
the same seeded tensors, then compares every buffer either side writes, bitwise: the index kernels, and the seam too
(both kernels compute the same fp32 expressions in the same order and round to bf16 the same way under the
interpreter). A ragged stream is compared over its written prefix (``[:indptr[-1]]``).

Patched, and only that: ``vllm/platforms/rocm.py``'s one platform query at import (answered ``gfx942``, as in
``test_vllm034_kernels_dsv4_rocm.py``), and ``topk_pack.enabled`` (``--monokernel`` on a gfx942 GPU, which reads the
process's recorded flag and the current platform: answered True where a test takes the one-launch path), and FlyDSL's
architecture query (a stand-in module answering gfx942; FlyDSL is not installed); for the candidate mask, the module's
``_ON_GFX942`` / ``_ON_GFX950`` flags (set: the fused kernel's branch; unset: the strided one) and its ``_wait_global_stores`` device function, an
``s_waitcnt vmcnt(0)`` inline-asm wait the interpreter cannot run, emulated as the no-op it is for a sequential
program (the interpreter's stores land at once). No other kernel code and no math is patched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

with mock.patch.object(
    torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx942:sramecc+")
):
    engine("vllm.platforms.rocm")
vllm_rocm41 = engine("vllm.models.deepseek_v41.amd.rocm")
vllm_topk_pack = engine("vllm.models.deepseek_v41.amd.ops.topk_pack")
vllm_swa_meta = engine("vllm.models.deepseek_v41.amd.ops.swa_decode_meta")
vllm_mhc = engine("vllm.model_executor.kernels.mhc.triton")
vllm_sparse = engine("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
# FlyDSL is not installed here: its one architecture query, made when mono/common/arch.py is imported, is answered by a
# stand-in module (gfx942) while keylist.py and its geometry module load.
_flydsl = {n: ModuleType(n) for n in ("flydsl", "flydsl.runtime", "flydsl.runtime.device")}
_flydsl["flydsl.runtime.device"].get_rocm_arch = lambda: "gfx942"  # type: ignore[attr-defined]
with mock.patch.dict(sys.modules, _flydsl):
    vllm_keylist = engine("vllm.models.deepseek_v41.amd.mono.keylist")
from warmreg_deepseek_v4.rocm_decode_topk import rocm_global_topk_ragged  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_candidate_mask import (  # noqa: E402
    RocmCandidateMask,
    RocmCandidateMaskStrided,
    candidate_flags_reference,
)
from warmreg_deepseek_v4.v41_rocm_keylist import V41RocmKeylist  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_mhc_post_collapse import MhcPostCollapseRmsNorm  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_swa_decode_meta import V41RocmSwaDecodeMeta  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_topk_pack import V41RocmTopkPack  # noqa: E402

I32 = torch.int32


def _same_ragged(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    assert_same(ours[1], theirs[1], f"{what} indptr")
    assert ours[0].shape == theirs[0].shape, f"{what}: stream of {ours[0].shape} vs the engine's {theirs[0].shape}"
    n = int(theirs[1][-1])
    assert_same(ours[0][:n], theirs[0][:n], f"{what} stream")


def _topk_args(tokens: int, topk: int, seed: int) -> dict[str, torch.Tensor]:
    """``topk_indices_buffer`` rows (-1 tails, a -1 inside a row), ``token_to_req_indices``, a block table of
    ``256 // 2 = 128``-token compressed pages (ratio 2), ``is_valid_token`` (a padded token)."""
    g = seeded(seed)
    buffer = torch.randint(0, 128 * 9, (tokens + 3, topk), generator=g, dtype=I32)
    buffer[0, topk // 3 :] = -1
    buffer[min(1, tokens - 1), 2] = -1
    valid = torch.rand(tokens + 3, generator=g) > 0.2
    return {
        "buffer": buffer, "t2r": torch.randint(0, 3, (tokens + 3,), generator=g, dtype=I32),
        "table": torch.randint(0, 700, (5, 9), generator=g, dtype=I32), "valid": valid,
    }  # fmt: skip


@pytest.mark.parametrize(("tokens", "topk"), [(1, 512), (5, 512), (16, 512), (3, 37)])
def test_topk_pack_equals_vllm(tokens: int, topk: int) -> None:
    """gfx942 ``--monokernel``, a decode batch of up to 16 tokens: ``compute_global_topk_ragged_indices_and_indptr``
    takes ``topk_pack.launch`` (``ROWS`` 1, 8, 16; a non-power-of-two top-k)."""
    args = _topk_args(tokens, topk, tokens + topk)
    theirs, ours = clones(**args), clones(**args)
    with mock.patch.object(vllm_topk_pack, "enabled", lambda: True):
        want = vllm_rocm41.compute_global_topk_ragged_indices_and_indptr(
            theirs["buffer"][:tokens], theirs["t2r"], theirs["table"][:3], 128, theirs["valid"][:tokens]
        )
    got = V41RocmTopkPack()(ours["buffer"][:tokens], ours["t2r"], ours["table"][:3], 128, ours["valid"][:tokens])
    assert_same(got[2], want[2], "topk_lens")
    _same_ragged(got[:2], want[:2], "decode top-k")
    for name in args:
        assert_same(ours[name], theirs[name], name)


@pytest.mark.parametrize("monokernel", [False, True])
def test_two_launch_path_equals_vllm(monokernel: bool) -> None:
    """V4.1's two-launch path (no ``--monokernel``, or 17 tokens under it) is DeepSeek-V4's ROCm count and pack:
    warmreg's :func:`rocm_global_topk_ragged` gives vLLM 0.34's V4.1 result."""
    tokens = 17
    args = _topk_args(tokens, 512, 99)
    theirs, ours = clones(**args), clones(**args)
    with mock.patch.object(vllm_topk_pack, "enabled", lambda: monokernel):
        want = vllm_rocm41.compute_global_topk_ragged_indices_and_indptr(
            theirs["buffer"][:tokens], theirs["t2r"], theirs["table"][:3], 128, theirs["valid"][:tokens]
        )
    got = rocm_global_topk_ragged(ours["buffer"][:tokens], ours["t2r"], ours["table"][:3], 128, ours["valid"][:tokens])
    assert_same(got[2], want[2], "topk_lens")
    _same_ragged(got[:2], want[:2], "decode top-k")


def _meta_args(tokens: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """A decode batch of ``tokens`` over 3 requests (1, 2 and the rest of the tokens: MTP's two a request), a padded
    token (slot -1), one request with a replay start, the SWA builder's buffers of 40 rows poisoned with -7."""
    g = seeded(seed)
    qsl = torch.tensor([0, 1, min(3, tokens), tokens], dtype=I32)
    qsl = torch.cummax(qsl, 0).values.to(I32)
    t2r = (torch.bucketize(torch.arange(tokens), qsl[1:].long(), right=True)).clamp(max=2).to(I32)
    slots = torch.randint(0, 4000, (tokens,), generator=g, dtype=torch.int64)
    slots[tokens // 2] = -1
    return {
        "slot_mapping": slots, "is_valid": torch.zeros(40, dtype=torch.bool),
        "indices": torch.full((40, 1, width), -7, dtype=I32), "lens": torch.full((40,), -7, dtype=I32),
        "ragged": torch.full((40 * width,), -7, dtype=I32), "indptr": torch.full((41,), -7, dtype=I32),
        "query_start_loc": qsl, "seq_lens": torch.tensor([300, 7, 190], dtype=I32), "token_to_req": t2r,
        "block_table": torch.randint(0, 900, (4, 16), generator=g, dtype=I32),
        "replay_start": torch.tensor([0, 0, 120, 0], dtype=I32),
    }  # fmt: skip


@pytest.mark.parametrize(("tokens", "width", "noncausal"), [(1, 128, False), (7, 128, False), (32, 128, False),
                                                            (4, 192, True)])  # fmt: skip
def test_swa_decode_meta_equals_vllm(tokens: int, width: int, noncausal: bool) -> None:
    """``swa_decode_meta.launch`` as ``build`` calls it: the SWA builder's ``is_valid_token[:T]``,
    ``decode_swa_indices`` ``[max_tokens, 1, W]``, all of ``decode_swa_lens``, the ragged graph buffers; window 128,
    V4.1's 32-token SWA blocks; the DSpark draft block (``round_up(128 + 3, 64) = 192`` wide) non-causal."""
    args = _meta_args(tokens, width, tokens + width)
    theirs, ours = clones(**args), clones(**args)
    vllm_swa_meta.launch(
        theirs["slot_mapping"], theirs["is_valid"][:tokens], theirs["indices"], theirs["lens"], theirs["ragged"],
        theirs["indptr"], theirs["query_start_loc"], theirs["seq_lens"], theirs["token_to_req"], theirs["block_table"],
        theirs["replay_start"], tokens, 128, 32, noncausal=noncausal,
    )  # fmt: skip
    V41RocmSwaDecodeMeta()(
        ours["slot_mapping"], ours["is_valid"][:tokens], ours["indices"], ours["lens"], ours["ragged"], ours["indptr"],
        ours["query_start_loc"], ours["seq_lens"], ours["token_to_req"], ours["block_table"], ours["replay_start"],
        tokens, 128, 32, noncausal,
    )  # fmt: skip
    for name in ("is_valid", "indices", "lens", "indptr"):
        assert_same(ours[name], theirs[name], name)
    _same_ragged(
        (ours["ragged"], ours["indptr"][: tokens + 1]), (theirs["ragged"], theirs["indptr"][: tokens + 1]), "swa"
    )
    for name in args:
        if name != "ragged":
            assert_same(ours[name], theirs[name], name)


# -- mhc_post_collapse_rms_norm_triton ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "hidden", "weight_dtype"), [(3, 5120, torch.bfloat16), (5, 300, torch.float32)])
def test_mhc_post_collapse_equals_vllm(tokens: int, hidden: int, weight_dtype: torch.dtype) -> None:
    """A delayed seam: bf16 ``[T, 4, H]`` streams, the sublayer output, fp32 post ``[T, 4, 1]`` / comb ``[T, 4, 4]`` /
    pre ``[T, 4]`` gates, the norm weight; V4.1-Flash's hidden size and a non-power-of-two one."""
    g = seeded(tokens * hidden)
    args = {
        "residual": torch.randn(tokens, 4, hidden, generator=g).to(torch.bfloat16),
        "x": torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
        "post": torch.rand(tokens, 4, 1, generator=g), "comb": torch.rand(tokens, 4, 4, generator=g),
        "pre": torch.rand(tokens, 4, generator=g), "weight": (torch.randn(hidden, generator=g) * 0.1 + 1).to(weight_dtype),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_mhc.mhc_post_collapse_rms_norm_triton(*theirs.values(), 1e-6)
    got = MhcPostCollapseRmsNorm()(*ours.values(), 1e-6)
    assert_same(got[0], want[0], "residual_out")
    assert_same(got[1], want[1], "layer_input")
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- keylist.launch -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "ratio"), [(1, 2), (6, 2), (4, 1)])
def test_keylist_equals_vllm(tokens: int, ratio: int) -> None:
    """An index layer of the gfx942 mono decode: the SWA slot mapping (a padded token), positions, the dense window
    rows ``[S + 2, 1, 128]`` and lengths, the indexer's top-k rows ``[S + 2, 512]`` (-1 entries), the compressed
    block table (``256 // ratio`` rows a block); the runner's poisoned ``kt`` / ``klen``."""
    g = seeded(tokens * 10 + ratio)
    slots = torch.randint(0, 9000, (tokens,), generator=g)
    slots[tokens // 2] = -1
    topk = torch.randint(-1, 2000, (tokens + 2, 512), generator=g, dtype=I32)
    args = {
        "kt": torch.full(((tokens + 2) * 640,), -7, dtype=I32), "klen": torch.full((2 * tokens + 4,), -7, dtype=I32),
        "slot_mapping": slots, "positions": torch.randint(0, 3000, (tokens,), generator=g),
        "swa_indices": torch.randint(0, 9000, (tokens + 2, 1, 128), generator=g, dtype=I32),
        "swa_lens": torch.randint(0, 129, (tokens + 2,), generator=g, dtype=I32),
        "token_to_req": torch.randint(0, 3, (tokens + 2,), generator=g, dtype=I32),
        "topk": topk, "bt": torch.randint(0, 700, (3, 40), generator=g, dtype=I32),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    t, o = list(theirs.values()), list(ours.values())
    vllm_keylist.launch(*t[:7], ratio, topk=t[7], comp_block_table=t[8], comp_block=256 // ratio)
    V41RocmKeylist()(*o[:7], ratio, topk=o[7], comp_block_table=o[8], comp_block=256 // ratio)
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- _apply_candidate_mask_strided (gfx942 / gfx950: _mask_candidates_fused_kernel) -------------------------------------
def _no_wait(x):  # type: ignore[no-untyped-def]
    """``s_waitcnt vmcnt(0)``: under the interpreter every store has landed already."""
    return x


@pytest.mark.parametrize(
    ("rows", "width", "block", "k", "repeat"), [(3, 700, 64, 5, 1), (4, 5000, 64, 8, 2), (17, 2100, 16, 3, 1)]
)
def test_candidate_mask_equals_vllm(rows: int, width: int, block: int, k: int, repeat: int) -> None:
    """The decode call: fp32 logits ``[rows, W]`` (``max_model_len`` wide), no starts, ``seq_lens`` as the ends (some
    past ``W``), candidate blocks ``[rows, K]`` (``-1`` entries, some past the live blocks and past ``W``: the last
    column's keep rule), rows sharing an end (``row_repeat`` = next_n); 17 rows take vLLM's 2048-column tile."""
    g = seeded(rows * width + k)
    args = {
        "logits": torch.randn(rows, width, generator=g),
        "ends": torch.randint(0, width + 50, (-(-rows // repeat),), generator=g, dtype=I32),
        "cand": torch.randint(-1, width // block + 3, (rows, k), generator=g, dtype=I32),
    }
    theirs, ours = clones(**args), clones(**args)
    with (
        mock.patch.object(vllm_sparse, "_ON_GFX942", True),
        mock.patch.object(vllm_sparse, "_wait_global_stores", _no_wait),
    ):
        vllm_sparse._apply_candidate_mask_strided(theirs["logits"], None, theirs["ends"], theirs["cand"], block, repeat)
    RocmCandidateMask()(ours["logits"], None, ours["ends"], ours["cand"], block, repeat)
    assert torch.isinf(theirs["logits"]).any() and not torch.isinf(theirs["logits"]).all()  # a real mask
    for name in args:
        assert_same(ours[name], theirs[name], name)


@pytest.mark.parametrize(("rows", "width", "block", "k", "repeat"), [(3, 700, 64, 5, 1), (4, 5000, 64, 8, 2)])
def test_candidate_mask_strided_equals_vllm(rows: int, width: int, block: int, k: int, repeat: int) -> None:
    """Off gfx942 / gfx950 (``_ON_GFX942`` and ``_ON_GFX950`` unset): vLLM's flags kernel and
    ``_mask_candidates_strided_kernel``; warmreg's strided mask on the same flags (built in PyTorch here: the flags
    kernel is :class:`.v41_candidate_flags.CandidateFlags`'s, compared in its own test). The logits, bitwise."""
    g = seeded(rows * width + k + 1)
    args = {
        "logits": torch.randn(rows, width, generator=g),
        "ends": torch.randint(0, width + 50, (-(-rows // repeat),), generator=g, dtype=I32),
        "cand": torch.randint(-1, width // block + 3, (rows, k), generator=g, dtype=I32),
    }
    theirs, ours = clones(**args), clones(**args)
    with mock.patch.object(vllm_sparse, "_ON_GFX942", False), mock.patch.object(vllm_sparse, "_ON_GFX950", False):
        vllm_sparse._apply_candidate_mask_strided(theirs["logits"], None, theirs["ends"], theirs["cand"], block, repeat)
    flags = candidate_flags_reference(ours["cand"], None, width, block, repeat)
    RocmCandidateMaskStrided()(ours["logits"], None, ours["ends"], flags, block, repeat)
    assert torch.isinf(theirs["logits"]).any() and not torch.isinf(theirs["logits"]).all()  # a real mask
    for name in args:
        assert_same(ours[name], theirs[name], name)
