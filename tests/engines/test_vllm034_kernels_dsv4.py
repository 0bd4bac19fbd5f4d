"""DeepSeek-V4 ops against vLLM 0.34's own kernels (the ones 0.34 added), on identical engine-shaped inputs, under
Triton's interpreter: the short-context top-k fill, the V2 runner's block-table gather, the image visibility.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's entry point exactly as its call site does (``DeepseekV4Indexer.forward``'s launch,
``BlockTables.gather_block_tables``, ``DeepseekSparseSWAMetadataBuilder._build_image_visibility``) and warmreg's op
on clones of the same seeded tensors, then compares every buffer either side writes, bitwise: all three are index
and metadata kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import triton

vllm_attention = engine("vllm.models.deepseek_v4.attention")
vllm_block_table = engine("vllm.v1.worker.gpu.block_table")
vllm_sparse_swa = engine("vllm.v1.attention.backends.mla.sparse_swa")
import vllm  # noqa: E402
import vllm.v1.worker.gpu.buffer_utils as vllm_buffers  # noqa: E402
from warmreg_deepseek_v4.gather_block_tables import GatherBlockTables, block_table_pointers  # noqa: E402
from warmreg_deepseek_v4.image_visibility import ImageVisibility  # noqa: E402
from warmreg_deepseek_v4.short_context_topk import ShortContextTopk  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, I64 = torch.int32, torch.int64


# -- DeepseekV4Indexer.forward: fill_short_context_topk_indices --------------------------------------------------------
@pytest.mark.parametrize(("topk", "tokens"), [(512, 6), (1024, 3), (40, 9)])  # Flash, Pro, a non-power-of-two width
def test_short_context_topk_equals_vllm(topk: int, tokens: int) -> None:
    """The indexer's persistent ``[max_num_batched_tokens, index_topk]`` buffer (garbage past the step), the step's
    positions padded past ``num_tokens``: vLLM's launch as ``DeepseekV4Indexer.forward`` writes it, warmreg's op on
    the buffer's prefix. Positions reach past ``4 * topk`` (every column kept) and below 3 (none)."""
    g = seeded(topk + tokens)
    args = {
        "buffer": torch.randint(-(2**31), 2**31 - 1, (tokens + 4, topk), generator=g, dtype=I32),
        "positions": torch.cat([torch.tensor([0, 2, 3]), torch.randint(0, 5 * topk, (tokens + 1,), generator=g)]),
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_attention.fill_short_context_topk_indices[(tokens,)](
        theirs["buffer"],
        theirs["positions"],
        TOP_K=topk,
        COMPRESS_RATIO=4,
        PADDED_TOP_K=triton.next_power_of_2(topk),
        num_warps=8,
    )
    out = ShortContextTopk(topk=topk)(ours["positions"], num_tokens=tokens, topk=topk, out=ours["buffer"][:tokens])
    assert out.data_ptr() == ours["buffer"].data_ptr()
    assert_same(ours["buffer"], theirs["buffer"], "topk_indices_buffer")
    assert_same(ours["positions"], theirs["positions"], "positions")


# -- BlockTables.gather_block_tables: _gather_block_tables_kernel -----------------------------------------------------
# DeepSeek-V4's KV-cache groups: the SWA cache (64-token pages, window 128: reach 127), the compressed and indexer
# caches (256 raw tokens a block, full attention), the C4 and C128 compressor states (block 4, window 8: reach 7;
# block 8, window 128: reach 127). Widths: small stand-ins for the runner's ``get_block_table_width`` values.
GROUPS = {"block_sizes": [64, 256, 4, 8], "widths": [7, 9, 13, 6], "reach": [127, 0, 7, 127]}
MAX_REQS = 6


def _block_tables(seed: int, cp_size: int = 1) -> object:
    """vLLM's ``BlockTables`` on the CPU, filled through its own staged writes for every request.

    UVA (pinned host memory mapped for the GPU) is CUDA-only: ``is_uva_available`` answers False so its buffers take
    vLLM's explicit-copy fallback, on the CPU. Nothing else is patched."""
    with mock.patch.object(vllm_buffers, "is_uva_available", lambda: False):
        tables = vllm_block_table.BlockTables(
            block_sizes=GROUPS["block_sizes"], max_num_reqs=MAX_REQS, max_num_batched_tokens=64,
            max_num_blocks_per_group=GROUPS["widths"], device=torch.device("cpu"),
            sliding_window_reach=GROUPS["reach"], cp_size=cp_size,
        )  # fmt: skip
        g = seeded(seed)
        for req in range(MAX_REQS):
            ids = tuple(
                torch.randint(1, 5000, (int(torch.randint(0, w + 1, (), generator=g)),), generator=g).tolist()
                for w in GROUPS["widths"]
            )
            tables.append_block_ids(req, ids, overwrite=True)
        tables.apply_staged_writes()
    return tables


def _ours(tables: object, idx: torch.Tensor, num_computed: torch.Tensor | None, num_rows: int) -> list[torch.Tensor]:
    """warmreg's op beside vLLM's tables: the same sources, its own forward-pass tables (clones of vLLM's before
    the gather), the mask as vLLM decides it."""
    t: object = tables
    dst = [b.clone() for b in t.input_block_tables]  # type: ignore[attr-defined]
    mask = t.has_sliding_window_groups and num_computed is not None  # type: ignore[attr-defined]
    GatherBlockTables(mask_sliding_window=mask)(
        idx, t.block_table_ptrs, block_table_pointers(dst), t.block_table_strides,  # type: ignore[attr-defined]
        t.num_blocks.gpu, num_computed if mask else t.sliding_window_reach,  # type: ignore[attr-defined]
        t.sliding_window_reach, t.block_sizes_tensor, num_rows=num_rows, mask_sliding_window=mask,  # type: ignore[attr-defined]
    )  # fmt: skip
    return dst


@pytest.mark.parametrize("cp_size", [1, 2])  # 2: DCP zeroes every reach, so the unmasked kernel
def test_gather_block_tables_equals_vllm(cp_size: int) -> None:
    """``GPUModelRunner.prepare_attn``'s gather, twice: a batch of 5 padded to 6 rows, then one of 2 padded to 2
    (the rows the larger batch dirtied are zeroed too: vLLM's ``num_rows = max(padded, dirty)``). Computed-token
    counts put some requests' windows past their first blocks."""
    tables: object = _block_tables(seed=cp_size, cp_size=cp_size)
    num_computed = torch.tensor([0, 130, 5000, 64 * 7, 127, 2000], dtype=I32)
    dirty = 0
    for idx_list, padded in (([4, 0, 5, 2, 1], 6), ([3, 5], 2)):
        idx = torch.tensor(idx_list, dtype=I32)
        num_rows = max(padded, dirty)
        ours = _ours(tables, idx, num_computed, num_rows)
        got = tables.gather_block_tables(idx, num_reqs_padded=padded, num_computed_tokens=num_computed)  # type: ignore[attr-defined]
        dirty = len(idx_list)
        for group, (mine, theirs) in enumerate(zip(ours, tables.input_block_tables, strict=True)):  # type: ignore[attr-defined]
            assert_same(mine, theirs, f"forward-pass table of group {group}")
            assert got[group].data_ptr() == theirs.data_ptr()


def test_gather_block_tables_into_given_tables_equals_vllm() -> None:
    """``PCPManager.prepare_attn``'s call: caller-owned tables and their addresses, no computed-token counts (the
    unmasked kernel even with sliding-window groups)."""
    tables: object = _block_tables(seed=7)
    g = seeded(7)
    local = [torch.randint(-9, 9, b.shape, generator=g, dtype=I32) for b in tables.input_block_tables]  # type: ignore[attr-defined]
    theirs, ours = [b.clone() for b in local], [b.clone() for b in local]
    idx = torch.tensor([2, 2, 0], dtype=I32)  # a request twice: rows are copies
    tables.gather_block_tables(idx, 4, out=tuple(theirs), out_ptrs=block_table_pointers(theirs))  # type: ignore[attr-defined]
    t: object = tables
    GatherBlockTables(mask_sliding_window=False)(
        idx, t.block_table_ptrs, block_table_pointers(ours), t.block_table_strides,  # type: ignore[attr-defined]
        t.num_blocks.gpu, t.sliding_window_reach, t.sliding_window_reach, t.block_sizes_tensor,  # type: ignore[attr-defined]
        num_rows=4, mask_sliding_window=False,
    )  # fmt: skip
    for group, (mine, want) in enumerate(zip(ours, theirs, strict=True)):
        assert_same(mine, want, f"given table of group {group}")


# -- DeepseekSparseSWAMetadataBuilder._build_image_visibility: _compute_image_visibility_kernel ----------------------
MAX_TOKENS, MAX_SEQS = 96, 8


def _builder_buffers(g: torch.Generator, max_image_tokens: int) -> SimpleNamespace:
    """The builder's vision side buffers (``__init__`` allocates them zeroed; garbage here, so that every element
    either side writes is compared) and its ``max_image_tokens``."""

    def garbage(n: int) -> torch.Tensor:
        return torch.randint(-1000, 1000, (n,), generator=g, dtype=I32)

    return SimpleNamespace(
        max_image_tokens=max_image_tokens, left_visible=garbage(MAX_TOKENS), right_visible=garbage(MAX_TOKENS),
        span_indptr=garbage(MAX_SEQS + 1), span_starts=garbage(MAX_TOKENS), span_ends=garbage(MAX_TOKENS),
    )  # fmt: skip


def _upload_spans(buffers: SimpleNamespace, mm_ranges: dict[int, list[tuple[int, int]]], num_reqs: int) -> None:
    """What the builder uploads before its launch: the spans as a CSR over the requests, in request order."""
    indptr, starts, ends = [0], [], []
    for req in range(num_reqs):
        for start, end in mm_ranges.get(req, ()):
            starts.append(start)
            ends.append(end)
        indptr.append(len(starts))
    buffers.span_indptr[: num_reqs + 1] = torch.tensor(indptr, dtype=I32)
    buffers.span_starts[: len(starts)] = torch.tensor(starts, dtype=I32)
    buffers.span_ends[: len(ends)] = torch.tensor(ends, dtype=I32)


@pytest.mark.parametrize("max_image_tokens", [1024, 6])  # DeepSeek-V4-Flash-Vision-Exp's, and one that clamps
def test_image_visibility_equals_vllm(max_image_tokens: int) -> None:
    """A decode-first batch: 2 decodes, then 3 prefill chunks over contexts with image spans (two overlapping, one
    cut by the chunk start, one past the chunk end, a request without spans)."""
    qlens, seqs = [1, 1, 12, 9, 7], [40, 90, 30, 9, 50]
    mm_ranges = {2: [(10, 21), (19, 25)], 3: [(0, 3), (5, 12)], 1: [(3, 8)], 4: []}
    qsl = torch.tensor([0, 1, 2, 14, 23, 30], dtype=I32)
    token_to_req = torch.tensor([r for r, q in enumerate(qlens) for _ in range(q)] + [0] * 6, dtype=I32)  # padded
    seq_lens, num_decode_tokens, num_prefill_tokens = torch.tensor(seqs, dtype=I32), 2, 28
    theirs = _builder_buffers(seeded(max_image_tokens), max_image_tokens)
    ours = SimpleNamespace(**clones(**vars(theirs)))
    inputs = {"seq_lens": seq_lens, "query_start_loc": qsl, "token_to_req_indices": token_to_req}
    their_inputs, our_inputs = clones(**inputs), clones(**inputs)

    want = vllm_sparse_swa.DeepseekSparseSWAMetadataBuilder._build_image_visibility(
        theirs, len(qlens), mm_ranges, num_decode_tokens, num_prefill_tokens, **their_inputs
    )
    _upload_spans(ours, mm_ranges, len(qlens))
    end = num_decode_tokens + num_prefill_tokens
    got = ImageVisibility()(
        ours.span_indptr, ours.span_starts, ours.span_ends, our_inputs["query_start_loc"], our_inputs["seq_lens"],
        our_inputs["token_to_req_indices"], num_tokens=num_prefill_tokens, max_image_tokens=max_image_tokens,
        token_offset=num_decode_tokens, out=(ours.left_visible[:end], ours.right_visible[:end]),
    )  # fmt: skip
    for name in ("left", "right"):
        i = 0 if name == "left" else 1
        assert_same(got[i], want[i], f"{name}_visible[:end] (returned)")
    for name in ("left_visible", "right_visible", "span_indptr", "span_starts", "span_ends"):
        assert_same(getattr(ours, name), getattr(theirs, name), name)
    for name in inputs:
        assert_same(our_inputs[name], their_inputs[name], name)
    assert int((want[0][num_decode_tokens:] > 0).sum()) and int((want[1][num_decode_tokens:] > 0).sum())
