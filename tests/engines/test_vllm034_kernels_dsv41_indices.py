"""DeepSeek-V4.1's index kernels against vLLM 0.34's own, on identical engine-shaped inputs, under Triton's
interpreter: the global top-k (``compute_global_topk_indices_and_lens``), the FlashMLA prefill combine
(``combine_topk_swa_indices``), FlashInfer's mixed sparse indices (``build_flashinfer_mixed_sparse_indices``), all in
``vllm/models/deepseek_v41/common/ops/cache_utils.py``, and the indexer key store (``indexer_k_norm_rope_store``,
``common/ops/indexer_k_store.py``).

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point as its call site does
(``nvidia/flashmla.py``, ``nvidia/flash_mla_mega_attn.py``, ``nvidia/flashinfer_sparse.py``,
``attention.py: DeepseekV4Indexer._produce_k``: the same arguments, buffer views and dtypes) and warmreg's op on
clones of the same seeded tensors, then compares every output and every cache byte, bitwise: the index kernels are
integer arithmetic, and the key store's bf16 and e4m3 casts, ``log2`` and ``exp2`` are the same operations on both
sides, so the interpreter gives both the same bits.

**Not interpretable as is.** vLLM's MXFP4 key store converts to E2M1 with inline PTX (``_fp32x2_to_fp4x2``); the
emulation of ``cvt.rn.satfinite.e2m1x2.f32`` from ``test_vllm034_kernels_dsv41_cache.py`` (written from the
instruction's definition, independent of warmreg's ``e2m1_code``) stands in for it. ``current_platform`` is vLLM's
CPU platform here: no ROCm tiled layout, no PDL, and ``mqa_logits_use_mx_scales()`` False; the MX-scale test
patches that platform query (only it) to True, as it is on the SM100 family. Nothing CUDA-only is asked.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_cache = engine("vllm.models.deepseek_v41.common.ops.cache_utils")
vllm_kstore = engine("vllm.models.deepseek_v41.common.ops.indexer_k_store")
import vllm  # noqa: E402
from test_vllm034_kernels_dsv41_cache import _cvt_rn_satfinite_e2m1x2  # noqa: E402
from warmreg_deepseek_v4.v41_combine_indices import V41CombineTopkSwa  # noqa: E402
from warmreg_deepseek_v4.v41_flashinfer_indices import V41FlashinferMixedIndices  # noqa: E402
from warmreg_deepseek_v4.v41_global_topk import V41GlobalTopkIndices  # noqa: E402
from warmreg_deepseek_v4.v41_indexer_k_store import V41IndexerKStore, row_bytes  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, I64 = torch.int32, torch.int64
WINDOW, TOPK = 128, 64  # V4.1's window; a 64-wide top-k buffer (index_topk 512 in the model: the same code)


# -- compute_global_topk_indices_and_lens: FlashMLA / mega decode, FlashInfer SM120 prefill ---------------------------
@pytest.mark.parametrize("prefill", [False, True])
def test_global_topk_equals_vllm(prefill: bool) -> None:
    g = seeded(1)
    nd, npf, block_size = 5, 6, 64  # ratio 2 on 128-token kernel pages
    args = {
        "buffer": torch.randint(-1, 700, (16, TOPK), generator=g, dtype=I32),
        "t2r": torch.tensor([0, 1, 1, 2, 3, 4, 4, 5, 5, 5, 5, 0, 0], dtype=I32),
        "table": torch.randint(0, 90, (7, 16), generator=g, dtype=I32),
        "valid": torch.rand(13, generator=g) > 0.2,
    }
    theirs, ours = clones(**args), clones(**args)
    # flashinfer_sparse.py's prefill slice, or the decode prefix
    rows = slice(nd, nd + npf) if prefill else slice(0, nd)
    table = (lambda t: t) if prefill else (lambda t: t[:nd])
    want = vllm_cache.compute_global_topk_indices_and_lens(
        theirs["buffer"][rows], theirs["t2r"][rows] if prefill else theirs["t2r"], table(theirs["table"]), block_size,
        theirs["valid"][rows],
    )  # fmt: skip
    got = V41GlobalTopkIndices()(ours["buffer"][rows], ours["t2r"][rows] if prefill else ours["t2r"],
                                 table(ours["table"]), ours["valid"][rows], block_size=block_size)  # fmt: skip
    assert_same(got[0], want[0], "global top-k")
    assert_same(got[1], want[1], "lens")


# -- combine_topk_swa_indices: FlashMLA's _forward_prefill chunk ------------------------------------------------------
@pytest.mark.parametrize(("ratio", "n"), [(2, 40), (1, 80), (0, 0)])
def test_combine_equals_vllm(ratio: int, n: int) -> None:
    """Two decode requests then four prefill requests, the chunk of the last three (a late chunk, a replayed request
    whose gathered rows start above its window, a short one), through the workspace of flashmla.py."""
    g = seeded(ratio)
    qlens, seqs, gathers = [1, 1, 5, 9, 7, 4], [30, 31, 5, 200, 150, 3], [30, 31, 5, 135, 100, 3]
    qsl_cpu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=I32)
    num_decodes, num_decode_tokens = 2, 2
    buffer = torch.randint(-1, n + 8, (40, TOPK), generator=g, dtype=I32)  # -1, in-pool and out-of-pool candidates
    top_k = 0 if ratio == 0 else TOPK
    M, chunk_n = n + WINDOW + 64, n
    chunk_start, chunk_end = 1, 4  # prefill requests 1..3 of this step's prefills
    prefill_base = int(qsl_cpu[num_decodes])
    qs = int(qsl_cpu[num_decodes + chunk_start]) - prefill_base
    qe = int(qsl_cpu[num_decodes + chunk_end]) - prefill_base
    args = {"buffer": buffer, "qsl": qsl_cpu.clone(), "seqs": torch.tensor(seqs[2:], dtype=I32),
            "gathers": torch.tensor(gathers[2:], dtype=I32), "idx_ws": torch.full((40, 256 if top_k else 128), 77, dtype=I32),
            "lens_ws": torch.full((40,), 77, dtype=I32)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)

    def inputs(side: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        topk = side["buffer"][num_decode_tokens:][: sum(qlens[2:])]
        return (topk[qs:qe], side["qsl"][num_decodes + chunk_start : num_decodes + chunk_end + 1],
                side["seqs"][chunk_start:chunk_end], side["gathers"][chunk_start:chunk_end])  # fmt: skip

    want = vllm_cache.combine_topk_swa_indices(
        *inputs(theirs), WINDOW, ratio, top_k, M, chunk_n, out=(theirs["idx_ws"][: qe - qs], theirs["lens_ws"][: qe - qs])
    )  # fmt: skip
    got = V41CombineTopkSwa(window_size=WINDOW)(
        *inputs(ours), top_k=top_k, compress_ratio=ratio, M=M, N=chunk_n, out=(ours["idx_ws"][: qe - qs], ours["lens_ws"][: qe - qs])
    )  # fmt: skip
    assert_same(got[0], want[0], "combined indices")
    assert_same(got[1], want[1], "combined lens")
    assert_same(ours["idx_ws"], theirs["idx_ws"], "the index workspace")  # rows past the chunk untouched on both
    assert_same(ours["lens_ws"], theirs["lens_ws"], "the lens workspace")


# -- build_flashinfer_mixed_sparse_indices: DeepseekV4FlashInferMLAAttention._build_sparse_index_metadata --------------
def _flashinfer_step(seed: int, nd: int, prefill_qlens: list[int]) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    reqs = nd + len(prefill_qlens)
    qlens = [1] * nd + prefill_qlens
    seqs = [int(x) for x in torch.randint(40, 400, (nd,), generator=g)] + [300, 90, 17][: len(prefill_qlens)]
    T = sum(qlens)
    return {
        "buffer": torch.randint(-1, 150, (T + 4, TOPK), generator=g, dtype=I32),  # local compressed indices
        "decode_swa": torch.randint(-1, 3000, (nd, 1, WINDOW), generator=g, dtype=I32),
        "qsl": torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=I32),
        "seqs": torch.tensor(seqs, dtype=I32),
        "t2r": torch.repeat_interleave(torch.arange(reqs), torch.tensor(qlens)).to(I32),
        "swa_bt": torch.randint(0, 60, (reqs + 2, 8), generator=g, dtype=I32),
        "c_bt": torch.randint(0, 60, (reqs + 2, 8), generator=g, dtype=I32),
        "valid": torch.rand(T, generator=g) > 0.2,
        "replay": torch.tensor([0] * nd + [250, 0, 5][: len(prefill_qlens)], dtype=I32),
    }


@pytest.mark.parametrize(("nd", "prefill", "swa_only"), [(3, [7, 4, 2], False), (4, [], False), (0, [5, 3], False),
                                                         (3, [7, 4, 2], True)])  # fmt: skip
def test_flashinfer_mixed_equals_vllm(nd: int, prefill: list[int], swa_only: bool) -> None:
    """Mixed, decode-only and prefill-only steps of a ratio-2 layer (64-token SWA pages, 32 compressed tokens a
    128-token page, packed pages of span 80 and 40), and an SWA-only layer, as _build_sparse_index_metadata calls it."""
    args = _flashinfer_step(nd + len(prefill), nd, prefill)
    theirs, ours = clones(**args), clones(**args)
    npf = sum(prefill)
    T = nd + npf
    reqs = nd + len(prefill)

    def inputs(side: dict[str, torch.Tensor]) -> tuple[tuple[object, ...], dict[str, object]]:
        buf = side["buffer"]
        if swa_only:
            decode, ptopk, c_bt, top_k, ratio, local, valid = None, buf[nd:T, :0], None, 0, 0, False, None
        else:
            ptopk = buf[nd:T] if npf else buf[:0, :0]
            decode = buf[:nd] if nd else ptopk[:0]
            c_bt, top_k, ratio, local, valid = side["c_bt"][:reqs], ptopk.shape[-1], 2, True, side["valid"][:nd]
        positional = (side["decode_swa"].reshape(nd, WINDOW), decode, None, ptopk[:npf], side["qsl"][: reqs + 1],
                      side["seqs"][:reqs], side["t2r"][:T], side["swa_bt"][:reqs])  # fmt: skip
        keywords = dict(compressed_block_table=c_bt, compressed_block_size=64 if swa_only else 32, compress_ratio=ratio,
                        top_k=top_k, decode_compressed_indices_are_local=local, decode_is_valid_token=valid,
                        swa_block_span=80, compressed_block_span=80 if swa_only else 40,
                        replay_start=side["replay"][:reqs])  # fmt: skip
        return positional, keywords

    (dswa, dtopk, dlens, ptopk, qsl, seqs, t2r, swa_bt), kw = inputs(theirs)
    want = vllm_cache.build_flashinfer_mixed_sparse_indices(
        dswa, dtopk, dlens, ptopk, qsl, seqs, t2r, swa_bt, 64, kw["compressed_block_table"], kw["compressed_block_size"],
        WINDOW, kw["compress_ratio"], kw["top_k"], decode_compressed_indices_are_local=kw["decode_compressed_indices_are_local"],
        decode_is_valid_token=kw["decode_is_valid_token"], swa_block_span=80, compressed_block_span=kw["compressed_block_span"],
        replay_start=kw["replay_start"],
    )  # fmt: skip
    (dswa, dtopk, dlens, ptopk, qsl, seqs, t2r, swa_bt), kw = inputs(ours)
    got = V41FlashinferMixedIndices(window_size=WINDOW)(
        dswa, dtopk, dlens, ptopk, qsl, seqs, t2r, swa_bt, kw.pop("compressed_block_table"), kw.pop("replay_start"),
        swa_block_size=64, **kw,
    )  # fmt: skip
    assert_same(got[0], want[0], "sparse indices")
    assert_same(got[1], want[1], "sparse top-k lens")


# -- indexer_k_norm_rope_store: DeepseekV4Indexer._produce_k ----------------------------------------------------------
def _k_store_step(seed: int, fp4: bool) -> tuple[dict[str, torch.Tensor], int]:
    """A step of 11 tokens (positions across group ends, padding slots -1) into 3 pages of 16 keys, each page padded
    by 64 bytes (the indexer page shares a physical block with the KV pages)."""
    g = seeded(seed)
    row = row_bytes(128, fp4)
    return {
        "k_pre": (torch.randn(11, 128, generator=g) * 2).to(torch.bfloat16),
        "positions": torch.tensor([0, 1, 2, 3, 4, 5, 17, 18, 19, 40, 41]),
        "cos_sin": torch.randn(64, 64, generator=g),
        "weight": (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16),
        "pages": torch.randint(0, 256, (3, 16 * row + 64), generator=g, dtype=torch.uint8),
        "slots": torch.tensor([3, 0, 47, 20, -1, 9, 30, 31, 14, -1, 33]),
    }, row


@pytest.mark.parametrize(
    ("fp4", "mx", "ratio"), [(False, False, 2), (False, True, 2), (True, False, 2), (False, False, 1)]
)
def test_indexer_k_store_equals_vllm(fp4: bool, mx: bool, ratio: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_kstore, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)  # inline PTX (module docstring)
    monkeypatch.setattr(vllm_kstore, "mqa_logits_use_mx_scales", lambda: mx)  # a platform query: SM100 family or not
    args, row = _k_store_step(ratio + 2 * fp4 + 4 * mx, fp4)
    theirs, ours = clones(**args), clones(**args)

    def cache(side: dict[str, torch.Tensor]) -> torch.Tensor:
        return side["pages"][:, : 16 * row].unflatten(1, (16, row))  # [blocks, block_size, row], padded page stride

    vllm_kstore.indexer_k_norm_rope_store(
        theirs["k_pre"], theirs["positions"], theirs["cos_sin"], theirs["weight"], 1e-6, cache(theirs), theirs["slots"],
        ratio, fp4,
    )  # fmt: skip
    V41IndexerKStore()(ours["k_pre"], ours["positions"], ours["cos_sin"], ours["weight"], 1e-6, cache(ours),
                       ours["slots"], compress_ratio=ratio, use_fp4_cache=fp4, mx_scale=mx)  # fmt: skip
    assert_same(ours["pages"], theirs["pages"], "indexer K cache pages")
    assert not torch.equal(ours["pages"], args["pages"])  # keys were written
