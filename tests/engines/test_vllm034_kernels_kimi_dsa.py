"""Kimi-K3.1 DSA indexer ops (FP8 indexer cache) against vLLM 0.34's own kernels, on identical engine-shaped inputs,
under Triton's interpreter.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls the engine's Python entry point in
``vllm/models/kimi_k3/nvidia/ops/dsa_indexer.py`` exactly as ``models/kimi_k3/nvidia/dsa.py`` calls it (the fused
forward's column slices of one projection, the indexer's own cache, the model-level top-k buffer) and warmreg's op on
clones of the same seeded tensors, then compares every output and every buffer both write. All comparisons are
bitwise (cache bytes, top-k rows, the normed rows and the folded weights): both sides run the same fp32 operations
in the same order, and the interpreter rounds them the same way.

vLLM asks two CUDA-only questions on the way: ``mqa_logits_use_mx_scales()`` (whether the GPU is of the sm_10x family,
false on this CPU platform) and, in the prologue, ``current_platform.is_arch_support_pdl()``. The MX-scale cases patch
the first to true in vLLM's module, nothing else; PDL stays off on both sides (the interpreter has no PDL).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_dsa = engine("vllm.models.kimi_k3.nvidia.ops.dsa_indexer")
from warmreg_kimi_k3.dsa import DSALayout  # noqa: E402
from warmreg_kimi_k3.dsa_k_insert import DSAKNormQuantInsert  # noqa: E402
from warmreg_kimi_k3.dsa_prologue import DSAFusedPrologue, mla_entry_bytes  # noqa: E402
from warmreg_kimi_k3.dsa_q_quant import DSAQQuantFoldWeights  # noqa: E402

# Kimi-K3.1's widths (examples/kimi_k3_dsa.json) but a short q-LoRA (not a power of two, as 1536) and top-k,
# so that the interpreter stays quick.
Q, KV, R, D, TOPK, HEADS = 96, 512, 64, 128, 300, 5
LAYOUT = DSALayout(
    layers=(4,), index_topk=TOPK, index_head_dim=D, index_num_heads=HEADS, index_k_norm_type="layernorm",
    indexer_fp4=False, fused_k_insert=True, fused_prologue=True, q_lora_rank=Q, kv_lora_rank=KV,
    qk_rope_head_dim=R, eps=1e-5, dtype="bfloat16",
)  # fmt: skip


def _mx(on: bool) -> Any:
    """vLLM's ``mqa_logits_use_mx_scales`` (a CUDA device query) answering ``on`` inside its kernel module."""
    return mock.patch.object(vllm_dsa, "mqa_logits_use_mx_scales", lambda: on)


def _cache(blocks: int, entry: int, packed_with: int = 0) -> torch.Tensor:
    """A ``[blocks, 64, entry]`` uint8 cache of garbage bytes; ``packed_with`` > 0: a page view into a block row
    that holds ``packed_with`` more bytes after it (vLLM's packed KDA + DSA row)."""
    row = torch.randint(0, 256, (blocks, 64 * entry + packed_with), generator=seeded(99), dtype=torch.uint8)
    return row[:, : 64 * entry].view(blocks, 64, entry)


def _projection(t: int, seed: int) -> dict[str, torch.Tensor]:
    """``low_latency_linear(hidden, input_weight).split([q_lora, kv_lora, rope, index_head_dim, index_heads])``."""
    g = seeded(seed)
    proj = (torch.randn(t, Q + KV + R + D + HEADS, generator=g) * 2).bfloat16()
    q_c, kv_c, k_pe, index_k, weights = proj.split([Q, KV, R, D, HEADS], -1)
    return {"q_c": q_c, "kv_c": kv_c, "k_pe": k_pe, "index_k": index_k, "index_weights": weights}


def _norms(seed: int) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    return {
        "q_norm_weight": (torch.randn(Q, generator=g) * 0.2 + 1).bfloat16(),  # RMSNorm weights: model dtype
        "kv_norm_weight": (torch.randn(KV, generator=g) * 0.2 + 1).bfloat16(),
        "k_norm_weight": torch.randn(D, generator=g) * 0.3 + 1,  # KimiK3DSAIndexerKNorm: float32
        "k_norm_bias": torch.randn(D, generator=g) * 0.1,
    }


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(
    ("t", "slots", "packed"),
    [
        (1, [70], 0),  # a decode token
        (6, [0, 65, -1, 130, 3], 4096),  # a padded row past the slots, a token of another DCP rank, packed pages
    ],
)
def test_k_norm_quant_insert_equals_vllm(t: int, slots: list[int], packed: int, mx: bool) -> None:
    """``indexer_k_norm_quant_insert`` (``KimiK3DSAIndexer._fused_k_insert``): cache bytes and top-k rows bitwise."""
    p, n = _projection(t, t), _norms(t)
    args = dict(
        k=p["index_k"], norm_weight=n["k_norm_weight"], norm_bias=n["k_norm_bias"], norm_eps=1e-5,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), kv_cache=_cache(3, D + 4, packed),
        topk_indices_buffer=torch.full((t + 3, TOPK), 11, dtype=torch.int32), num_tokens=t,
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    with _mx(mx):
        vllm_dsa.indexer_k_norm_quant_insert(**theirs)
    DSAKNormQuantInsert(layout=LAYOUT, max_num_batched_tokens=8)(*ours.values(), mx_scale=mx)  # same order
    assert_same(ours["kv_cache"], theirs["kv_cache"], "index cache bytes")
    assert_same(ours["topk_indices_buffer"], theirs["topk_indices_buffer"], "top-k rows")


@pytest.mark.parametrize(("t", "heads", "padded"), [(1, 32, 32), (4, HEADS, 32), (3, 40, 64)])
def test_q_quant_fold_weights_equals_vllm(t: int, heads: int, padded: int) -> None:
    """``indexer_q_quant_fold_weights`` (``KimiK3DSAIndexer.score``): the FP8 query and the folded weights bitwise,
    the padded heads zero on both sides."""
    g = seeded(heads)
    query = (torch.randn(t, 64 + heads * D, generator=g) * 3).bfloat16()[:, 64:]  # [q | index_q] column slice
    weights = torch.randn(t, 7 + heads, generator=g).bfloat16()[:, 7:]
    index_q = query.view(t, heads, D)
    scale = D**-0.5 * heads**-0.5  # index_softmax_scale * indexer_weight_scale
    want_q, want_w = vllm_dsa.indexer_q_quant_fold_weights(index_q, weights, scale, padded)
    got_q, got_w = DSAQQuantFoldWeights(layout=LAYOUT, max_num_batched_tokens=8)(index_q, weights, scale, padded)
    assert_same(got_q, want_q, "q_fp8")
    assert_same(got_w, want_w, "weights")


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(
    ("t", "mla_slots", "index_slots", "packed"),
    [
        (1, [5], [5], 0),
        (5, [1, 64, -1, 130], [129, -1, 0, 66, 2], 2048),  # a padded row, no-slot tokens, packed pages
    ],
)
def test_fused_prologue_equals_vllm(
    t: int, mla_slots: list[int], index_slots: list[int], packed: int, mx: bool
) -> None:
    """``dsa_fused_prologue`` (``KimiK3DSAAttention._fused_attention``): both normed rows, the fp8_ds_mla cache,
    the index cache and the top-k rows bitwise."""
    p, n = _projection(t, 10 + t), _norms(10 + t)
    args = dict(
        q_c=p["q_c"], kv_c=p["kv_c"], k_pe=p["k_pe"], index_k=p["index_k"], **n, eps=1e-5,
        topk_indices_buffer=torch.full((t + 2, TOPK), 11, dtype=torch.int32),
        mla_cache=_cache(3, mla_entry_bytes(KV, R), packed), mla_slot_mapping=torch.tensor(mla_slots),
        index_cache=_cache(3, D + 4, packed), index_slot_mapping=torch.tensor(index_slots),
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    with _mx(mx):
        want = vllm_dsa.dsa_fused_prologue(**theirs)
    got = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)(*ours.values(), mx_scale=mx, launch_pdl=False)
    assert_same(got[0], want[0], "q_c_normed")
    assert_same(got[1], want[1], "kv_c_normed")
    for name in ("mla_cache", "index_cache", "topk_indices_buffer"):
        assert_same(ours[name], theirs[name], name)


def test_fused_prologue_profile_run_equals_vllm() -> None:
    """A dummy run: no caches (None), so only the norms and the top-k fill; both sides agree."""
    p, n = _projection(3, 7), _norms(7)
    args = dict(
        q_c=p["q_c"], kv_c=p["kv_c"], k_pe=p["k_pe"], index_k=p["index_k"], **n, eps=1e-5,
        topk_indices_buffer=torch.full((3, TOPK), 11, dtype=torch.int32),
        mla_cache=None, mla_slot_mapping=None, index_cache=None, index_slot_mapping=None,
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_dsa.dsa_fused_prologue(**theirs)
    got = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)(*ours.values(), mx_scale=False, launch_pdl=False)
    assert_same(got[0], want[0], "q_c_normed")
    assert_same(got[1], want[1], "kv_c_normed")
    assert_same(ours["topk_indices_buffer"], theirs["topk_indices_buffer"], "top-k rows")
