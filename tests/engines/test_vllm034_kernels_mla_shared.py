"""The shared sparse-MLA index remap (``warmreg.ops.sparse_mla_index_remap``) against vLLM 0.34's own kernel, on
identical engine-shaped inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's Python entry point in
``vllm/v1/attention/backends/mla/sparse_utils.py`` (``triton_convert_req_index_to_global_index`` or
``triton_filter_and_convert_dcp_index``) with the arguments one of its call sites passes (``flashmla_sparse.py:
FlashMLASparseImpl``: the FP8 mixed batch, the FP8 separate decode and prefill, the BF16 flat cache, the DCP filter;
``index_group.py``: HiSparse's ``idx_mapping``) and warmreg's op on clones of the same seeded tensors, then compares
every output: bitwise (integer rows and counts). A compacting multi-tile launch orders a row's prefix by the order
its tiles take the atomic counter; under the interpreter both kernels run the tiles in the same order, so the
prefix compares bitwise too (on a GPU only the set is defined, for both).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_sparse = engine("vllm.v1.attention.backends.mla.sparse_utils")
from warmreg.ops import SparseMLAIndexRemap  # noqa: E402

I32 = torch.int32
BLOCK = 64  # the sparse backends' kernel page (Kimi-K3.1's DSA caches, FlashMLA's FP8 pages)


def _inputs(tokens: int, topk: int, requests: int, width: int, seed: int, *, offset_view: bool = False) -> dict[str, Any]:
    """A step's ``req_id_per_token``, block table and per-request top-k ids (-1 for unfilled slots, some ids past
    the table: both give -1). ``offset_view``: the top-k rows a column slice of a wider buffer, as a model-level
    top-k buffer sliced to the step."""
    gen = seeded(seed)
    req = torch.sort(torch.randint(0, requests, (tokens,), generator=gen, dtype=I32)).values
    table = torch.randint(0, 5000, (requests, width), generator=gen, dtype=I32)
    ids = torch.randint(-1, BLOCK * width + 40, (tokens, topk + 8 * offset_view), generator=gen, dtype=I32)
    ids[:, : topk // 3][torch.rand(tokens, topk // 3, generator=gen) < 0.3] = -1
    return {"req": req, "table": table, "ids": ids[:, 8:] if offset_view else ids}


def _both(args: dict[str, Any], **kw: Any) -> tuple[Any, Any]:
    """vLLM's entry point and warmreg's op on clones of ``args`` with the same keywords."""
    ours = clones(**args)
    extra = {k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}
    ours_kw = {**kw, **clones(**extra)}
    convert = kw.pop("_entry", "convert")
    ours_kw.pop("_entry", None)
    if convert == "filter":
        want = vllm_sparse.triton_filter_and_convert_dcp_index(
            args["req"], args["table"], args["ids"], kw["dcp_size"], kw["dcp_rank"],
            cp_kv_cache_interleave_size=kw.get("dcp_interleave", 1), BLOCK_SIZE=BLOCK,
            BLOCK_STRIDE_ROWS=kw.get("block_stride_rows"), NUM_TOPK_TOKENS=args["ids"].shape[1],
            return_valid_counts=kw["return_valid_counts"], compact_valid_to_front=kw["compact_to_front"],
        )  # fmt: skip
    else:
        want = vllm_sparse.triton_convert_req_index_to_global_index(
            args["req"], args["table"], args["ids"], BLOCK_SIZE=BLOCK, BLOCK_STRIDE_ROWS=kw.get("block_stride_rows"),
            NUM_TOPK_TOKENS=args["ids"].shape[1], BLOCK_N=kw.get("block_n", 128),
            HAS_PREFILL_WORKSPACE=kw.get("prefill_workspace_request_ids") is not None,
            prefill_workspace_request_ids=kw.get("prefill_workspace_request_ids"),
            prefill_workspace_starts=kw.get("prefill_workspace_starts"),
            prefill_workspace_rank_stride=kw.get("prefill_workspace_rank_stride"),
            return_valid_counts=kw.get("return_valid_counts", False), idx_mapping=kw.get("idx_mapping"),
        )  # fmt: skip
    # the top-k ids are only read: the op gets the view itself (vLLM copies it contiguous, the op reads its strides)
    got = SparseMLAIndexRemap()(ours["req"], ours["table"], args["ids"], block_size=BLOCK, **ours_kw)
    return got, want


def _compare(got: Any, want: Any) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple)
        assert_same(got[0], want[0], "topk rows")
        assert_same(got[1], want[1], "valid counts")
        assert int(got[1].sum()) > 0
    else:
        assert_same(got, want, "topk rows")
        assert bool((got >= 0).any())


@pytest.mark.parametrize(("tokens", "topk"), [(7, 256), (1, 2048), (5, 2176)])
@pytest.mark.parametrize("counts", [False, True], ids=["fp8-mixed", "counted"])
def test_convert_equals_vllm(tokens: int, topk: int, counts: bool) -> None:
    """The FP8 mixed batch (no counts) and the counting sites (FP8 decode, BF16 flat cache): single tile, GLM's
    non-power-of-two width padded to one tile, and a one-token step."""
    args = _inputs(tokens, topk, 3, 9, seed=tokens + topk)
    _compare(*_both(args, return_valid_counts=counts))


def test_convert_with_a_block_row_stride_and_an_offset_top_k_view() -> None:
    """Pages of one layer interleaved with others' (``block_stride_rows`` > block size) and the top-k rows a view."""
    args = _inputs(6, 512, 4, 5, seed=3, offset_view=True)
    _compare(*_both(args, block_stride_rows=3 * BLOCK + 16, return_valid_counts=True))
    _compare(*_both(args, block_stride_rows=3 * BLOCK + 16))


def test_convert_multi_tile_counts_with_atomics() -> None:
    """A width past one tile (4224: not a power of two, next_pow2 8192 > 4096): column tiles count with atomics and compact through the counter."""
    args = _inputs(2, 4224, 2, 140, seed=5)
    _compare(*_both(args, return_valid_counts=True))


def test_convert_prefill_workspace_equals_vllm() -> None:
    """The FP8 separate path's prefill rows: workspace offsets for prefill tokens, cache rows for decode tokens."""
    args = _inputs(6, 256, 3, 6, seed=7)
    ids = torch.tensor([-1, -1, 0, 0, 1, 1], dtype=I32)
    starts = torch.tensor([0, 700], dtype=I32)
    got, want = _both(args, prefill_workspace_request_ids=ids, prefill_workspace_starts=starts, return_valid_counts=True)
    _compare(got, want)


def test_convert_with_idx_mapping_equals_vllm() -> None:
    """HiSparse's conversion: the table row of a request through ``idx_mapping`` (a -1 entry clamped to row 0)."""
    args = _inputs(5, 256, 4, 6, seed=9)
    mapping = torch.tensor([3, -1, 0, 2], dtype=I32)
    for counts in (False, True):
        _compare(*_both(args, idx_mapping=mapping, return_valid_counts=counts))


@pytest.mark.parametrize(("rank", "interleave", "compact"), [(0, 1, True), (1, 16, True), (2, 64, False)])
def test_dcp_filter_equals_vllm(rank: int, interleave: int, compact: bool) -> None:
    """``triton_filter_and_convert_dcp_index`` (FlashMLA sparse under DCP): this rank's slots, compacted to a prefix
    (the counter-allocated prefix) or left in place with counts."""
    args = _inputs(5, 512, 3, 8, seed=rank + interleave)
    kw = dict(dcp_size=3, dcp_rank=rank, dcp_interleave=interleave, return_valid_counts=True, compact_to_front=compact)
    _compare(*_both(args, _entry="filter", **kw))


def test_empty_step_launches_nothing() -> None:
    args = _inputs(0, 256, 1, 4, seed=1)
    got, want = _both(args, return_valid_counts=True)
    assert got[0].shape == want[0].shape == (0, 256) and got[1].shape == want[1].shape == (0,)
