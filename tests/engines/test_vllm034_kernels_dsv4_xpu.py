"""DeepSeek-V4's XPU ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. The Q norm + RoPE: vLLM's ``xpu_qnorm_rope_kv_fp8_insert``
against the op (q and the rotated kv handed to the FP8 insert, bitwise). The dequant gather: vLLM's ``dequant_gather_slots``
(``models/deepseek_v4/xpu/xpu_sparse_decode_fp8.py``) called as ``xpu_sparse_decode_fp8`` calls it (the top-k half and
the SWA half of one BF16 workspace, ``int32`` global slots, the cache's own page size) and warmreg's op on clones of
the same seeded tensors; the whole workspace is compared bitwise (both kernels run the same fp32 operations, and the
interpreter rounds both alike, the denormal products of a zero scale byte included).
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_xpu_decode = engine("vllm.models.deepseek_v4.xpu.xpu_sparse_decode_fp8")
vllm_qnorm = engine("vllm.models.deepseek_v4.xpu.xpu_qnorm_rope_kv_fp8_insert")
vllm_cache_utils = engine("vllm.models.deepseek_v4.common.ops.cache_utils")
from warmreg_deepseek_v4.xpu_dequant_gather import XPUDequantGatherSlots  # noqa: E402
from warmreg_deepseek_v4.xpu_qnorm_rope import XPUQNormRope  # noqa: E402

ENTRY = 576 + 8  # a token's fp8_ds_mla bytes: 448 FP8 + 64 BF16 values, 8 scale bytes


def _cache(blocks: int, bs: int, extra: int, seed: int) -> torch.Tensor:
    """``[blocks, bs, 584]`` uint8 pages of random bytes at a page stride of ``bs * 584 + extra`` (a unified page);
    the FP8 NaN codes left in, zero scale bytes among the scales."""
    stride = bs * ENTRY + extra
    raw = torch.randint(0, 256, (blocks * stride,), generator=seeded(seed), dtype=torch.uint8)
    pages = raw.view(blocks, stride)
    scales = torch.randint(100, 150, (blocks, bs * 8), generator=seeded(seed + 1), dtype=torch.uint8)
    scales[:, ::5] = 0
    pages[:, bs * 576 : bs * 584] = scales
    return raw.as_strided((blocks, bs, ENTRY), (stride, ENTRY, 1))


@pytest.mark.parametrize(("bs", "extra"), [(64, 0), (2, 0), (2, 37_376 - 2 * ENTRY)])
def test_dequant_gather_equals_vllm(bs: int, extra: int) -> None:
    """The C4 (64 tokens a page) and C128 (2) caches into the top-k half, the SWA cache (64) into the other half; a
    C128 page at the unified (SWA) page stride; -1 slots."""
    topk_cache, swa_cache = _cache(5, bs, extra, seed=bs), _cache(4, 64, 0, seed=7)
    topk = torch.randint(-1, 5 * bs, (3, 8), generator=seeded(3), dtype=torch.int32)
    swa = torch.randint(-1, 4 * 64, (3, 5), generator=seeded(4), dtype=torch.int32)
    n_topk = topk.numel()
    theirs = {"workspace": torch.full((n_topk + swa.numel(), 512), 3.0, dtype=torch.bfloat16)}
    ours = clones(**theirs)
    vllm_xpu_decode.dequant_gather_slots(theirs["workspace"][:n_topk], topk_cache, topk.reshape(-1), bs)
    vllm_xpu_decode.dequant_gather_slots(theirs["workspace"][n_topk:], swa_cache, swa.reshape(-1), 64)
    op = XPUDequantGatherSlots(block_sizes=(bs, 64))
    op(topk_cache.clone(), topk.reshape(-1), out=ours["workspace"][:n_topk])
    op(swa_cache.clone(), swa.reshape(-1), out=ours["workspace"][n_topk:])
    assert_same(ours["workspace"], theirs["workspace"], "BF16 workspace")


def test_dequant_gather_no_slots_equals_vllm() -> None:
    """A step with no top-k rows: vLLM returns before launching; the op launches nothing and returns ``[0, 512]``."""
    cache = _cache(2, 64, 0, seed=9)
    out = torch.empty(0, 512, dtype=torch.bfloat16)
    vllm_xpu_decode.dequant_gather_slots(out, cache, torch.empty(0, dtype=torch.int32), 64)
    assert XPUDequantGatherSlots()(cache, torch.empty(0, dtype=torch.int32)).shape == (0, 512)



@pytest.mark.parametrize(("tokens", "heads"), [(1, 1), (5, 16), (3, 7)])
def test_qnorm_rope_insert_equals_vllm(tokens: int, heads: int) -> None:
    """``xpu_qnorm_rope_kv_fp8_insert`` as ``xpu_sparse.py: _fused_qnorm_rope_kv_insert`` calls it (the step's SWA
    cache ``[blocks, 64, 584]``, its int64 slots with a -1, positions, the fp32 rope cache, ``rms_norm_eps``) against
    ``deepseek_v4.xpu_qnorm_rope``: ``q`` (normalized and rotated in place) and the rotated ``kv`` the wrapper hands to
    its FP8 insert, both bitwise (the same fp32 operations in the same order). The insert itself is replaced by a
    recorder of its arguments: it is ``deepseek_v4.quant_insert_k_cache``'s engine kernel, compared with the FP8 casts
    routed through torch in ``test_vllm_kernels_dsv4_numeric.py`` (the interpreter does not round fp32 -> e4m3 to
    nearest even)."""
    gen = seeded(tokens * heads)
    angles = torch.rand(64, 32, generator=gen) * 6.28
    args = {
        "q": (torch.randn(tokens, heads, 512, generator=gen) * 3).to(torch.bfloat16),
        "kv": torch.randn(tokens, 512, generator=gen).to(torch.bfloat16),
        "swa_kv_cache": torch.randint(0, 256, (3, 64, ENTRY), generator=gen, dtype=torch.uint8),
        "slot_mapping": torch.randperm(3 * 64, generator=gen)[:tokens].masked_fill(torch.arange(tokens) == 1, -1),
        "positions": torch.randint(0, 64, (tokens,), generator=gen),
        "cos_sin_cache": torch.cat([angles.cos(), angles.sin()], 1),
    }
    theirs, ours = clones(**args), clones(**args)
    inserted: list[torch.Tensor] = []
    with mock.patch.object(vllm_cache_utils, "quantize_and_insert_k_cache", lambda k, *a, **kw: inserted.append(k)):
        vllm_qnorm.xpu_qnorm_rope_kv_fp8_insert(**theirs, eps=1e-6, block_size=64)
    _, kv_roped = XPUQNormRope(num_heads=heads)(ours["q"], ours["kv"], ours["positions"], ours["cos_sin_cache"], 1e-6)
    assert_same(ours["q"], theirs["q"], "q (in place)")
    assert_same(kv_roped, inserted[0], "rotated kv (the FP8 insert's input)")
