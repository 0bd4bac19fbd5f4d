"""DeepSeek-V4.1's launches of DeepSeek-V4 kernels (issue 37): the kernels are V4's own objects in vLLM 0.34 (an import
or a verbatim re-export, so warmreg's V4 ops and their V4 differential tests cover them), V4.1's indexer backends
build their metadata with V4's indexer builder, and the short-context fill at V4.1's ratio 2, launched as
``models/deepseek_v41/attention.py: DeepseekV4Indexer.forward`` launches it, equals warmreg's op bitwise (an index
kernel) under Triton's interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere.
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
from warmreg_deepseek_v4.short_context_topk import ShortContextTopk

v41_attention = engine("vllm.models.deepseek_v41.attention")
v41_ops = engine("vllm.models.deepseek_v41.common.ops")
v4_attention = engine("vllm.models.deepseek_v4.attention")
v4_indexer_q = engine("vllm.models.deepseek_v4.common.ops.fused_indexer_q")
v4_inv_rope = engine("vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant")
mla_indexer = engine("vllm.v1.attention.backends.mla.indexer")
sparse_indexer = engine("vllm.v1.attention.backends.mla.sparse_indexer")


def test_v41_launches_v4s_kernel_objects() -> None:
    assert v41_attention.fill_short_context_topk_indices is v4_attention.fill_short_context_topk_indices
    assert v41_ops.fused_indexer_q_rope_quant is v4_indexer_q.fused_indexer_q_rope_quant
    assert v41_ops.fused_inv_rope_fp8_quant is v4_inv_rope.fused_inv_rope_fp8_quant


def test_v41_indexer_backends_use_v4s_builder() -> None:
    """The compressed slot mapping, prefill-chunk metadata and uniform decode of V4.1's indexer come from the builder
    V4's indexer uses (``DeepseekV32IndexerMetadataBuilder``), at the cache's ``tokens_per_state``."""
    builder = mla_indexer.DeepseekV32IndexerMetadataBuilder
    assert mla_indexer.DeepseekV41IndexerBackend.get_builder_cls() is builder
    assert issubclass(sparse_indexer.DeepseekV41SparseIndexerBackend.get_builder_cls(), builder)


@pytest.mark.parametrize("num_tokens", [5, 1])
def test_short_context_fill_at_ratio_2(num_tokens: int) -> None:
    """``DeepseekV4Indexer.forward``'s launch: the shared ``[max_num_batched_tokens, index_topk]`` buffer, its
    prefix filled; positions include ones whose ``(p + 1) // 2`` passes ``index_topk`` (a full row)."""
    topk, rows = 512, 8
    g = seeded(num_tokens)
    base = dict(
        positions=torch.tensor([0, 1, 6, 1100, 1023, 3, 2, 9], dtype=torch.int64),
        buffer=torch.randint(-9, 9, (rows, topk), generator=g, dtype=torch.int32),  # rows past the prefix: kept
    )
    theirs, ours = clones(**base), clones(**base)
    v41_attention.fill_short_context_topk_indices[(num_tokens,)](
        theirs["buffer"], theirs["positions"], TOP_K=topk, COMPRESS_RATIO=2, PADDED_TOP_K=topk, num_warps=8
    )
    ShortContextTopk(topk=topk, compress_ratios=(2,))(
        ours["positions"], num_tokens=num_tokens, topk=topk, compress_ratio=2, out=ours["buffer"][:num_tokens]
    )
    assert_same(ours["buffer"], theirs["buffer"], "topk_indices_buffer")
