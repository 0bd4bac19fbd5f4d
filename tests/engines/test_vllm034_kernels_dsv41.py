"""DeepSeek-V4.1 ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under Triton's interpreter:
the padded interleaved Q of mega attention, the mHC stream expand, the compressor ring slots and the fused Q/KV
norm + MXFP8 query quant.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's entry point as its call site does (``_pad_interleaved_q(q, out)`` of
``DeepseekV4Attention._fused_qnorm_rope_kv_insert``, ``hc_expand(x, hc_mult)`` of the first decoder layer, the launch
of ``CompressorMetadataBuilder.build``, ``fused_q_kv_rmsnorm_quant`` of ``_split_qkv_and_norm``) and warmreg's op on
clones of the same seeded tensors, then compares every buffer either side writes, bitwise: the copies and index
kernels by nature, the norm + quant because both sides run the same fp32 operations and conversions under the
interpreter (whose fp32 -> bf16 and fp32 -> e4m3 conversions differ from the GPU's, identically on both sides).
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

vllm_attention = engine("vllm.models.deepseek_v41.attention")
vllm_mhc = engine("vllm.models.deepseek_v41.nvidia.ops.mhc")
vllm_compressor = engine("vllm.models.deepseek_v41.compressor")
vllm_query_quant = engine("vllm.models.deepseek_v41.common.ops.query_quant")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_hc_expand import HcExpand  # noqa: E402
from warmreg_deepseek_v4.v41_pad_q import PadInterleavedQ  # noqa: E402
from warmreg_deepseek_v4.v41_q_norm_quant import QKVNormQuant  # noqa: E402
from warmreg_deepseek_v4.v41_ring_slots import RingSlotMapping  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

BF16, I32, I64 = torch.bfloat16, torch.int32, torch.int64


@pytest.mark.parametrize(("tokens", "live", "padded"), [(3, 32, 64), (2, 4, 8)])  # TP2 of a 64-head model; a small pad
def test_pad_interleaved_q_equals_vllm(tokens: int, live: int, padded: int) -> None:
    """``_pad_interleaved_q(q, out)``: the raw ``wq_b`` output ``[N, H, 512]`` into a fresh ``[N, HP, 512]`` (garbage
    before the launch)."""
    g = seeded(tokens + live)
    args = {
        "q": torch.randn(tokens, live, 512, generator=g).to(BF16),
        "out": torch.randn(tokens, padded, 512, generator=g).to(BF16),
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_attention._pad_interleaved_q(theirs["q"], theirs["out"])
    PadInterleavedQ(live_heads=live, padded_heads=padded, head_dim=512, dtype="bfloat16", tokens=[tokens])(**ours)
    for name in theirs:
        assert_same(ours[name], theirs[name], f"_pad_interleaved_q: {name}")


@pytest.mark.parametrize(("tokens", "hidden", "hc_mult"), [(3, 5120, 4), (5, 80, 2)])
def test_hc_expand_equals_vllm(tokens: int, hidden: int, hc_mult: int) -> None:
    """``hc_expand(x, hc_mult)`` of the first decoder layer on the embedding output, and on a column-sliced view
    (another binary: the strides are constexprs)."""
    g = seeded(tokens + hidden)
    x = torch.randn(tokens, hidden + 16, generator=g).to(BF16)
    kernel = HcExpand(hidden_size=hidden, hc_mult=hc_mult, dtype="bfloat16")
    for view in (x[:, :hidden].contiguous(), x[:, :hidden]):
        assert_same(kernel(view, hc_mult), vllm_mhc.hc_expand(view, hc_mult), "hc_expand")


@pytest.mark.parametrize(("actual", "tokens", "capacity"), [(7, 9, 8), (300, 300, 16)])
def test_ring_slot_mapping_equals_vllm(actual: int, tokens: int, capacity: int) -> None:
    """``CompressorMetadataBuilder.build``'s launch on its persistent int64 buffer's prefix (garbage past the step),
    the group's block table (null blocks included, a wider row stride), token_to_req and positions padded past the
    actual tokens."""
    g = seeded(actual + capacity)
    table = torch.randint(0, 40, (6, 12), generator=g, dtype=I32)
    table[2, 0] = 0  # a request on the null block: -1
    args = {
        "slots": torch.randint(-(2**40), 2**40, (tokens + 5,), generator=g, dtype=I64),
        "table": table,
        "t2r": torch.randint(0, 6, (tokens,), generator=g, dtype=I32),
        "positions": torch.randint(0, 100_000, (tokens,), generator=g, dtype=I64),
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_compressor._ring_slot_mapping_kernel[(-(-tokens // 256),)](
        theirs["slots"][:tokens], theirs["table"], theirs["table"].stride(0), theirs["t2r"], theirs["positions"],
        actual, tokens, CAPACITY=capacity, BLOCK=256,
    )  # fmt: skip
    RingSlotMapping(capacity=capacity)(
        ours["table"], ours["t2r"], ours["positions"], num_actual_tokens=actual, num_tokens=tokens, capacity=capacity,
        out=ours["slots"][:tokens],
    )  # fmt: skip
    for name in theirs:
        assert_same(ours[name], theirs[name], f"_ring_slot_mapping_kernel: {name}")


@pytest.mark.parametrize(("tokens", "q_size", "kv_size"), [(3, 1280, 512), (130, 96, 64)])
def test_q_kv_norm_quant_equals_vllm(tokens: int, q_size: int, kv_size: int) -> None:
    """``fused_q_kv_rmsnorm_quant(qr, kv, q_norm.weight, kv_norm.weight, eps)`` on the two views of the fused
    ``wqa`` / ``wkv`` projection (V4.1-Flash's widths; and 130 rows of 3 groups: a second scale tile and padded
    groups). vLLM's CPU platform reports no PDL (``is_arch_support_pdl``), so both launch without it. The e4m3
    query, the scales (padding included) and the normed KV: bitwise."""
    g = seeded(tokens + q_size)
    fused = (torch.randn(tokens, q_size + kv_size, generator=g) * 3).to(BF16)
    qw, kvw = torch.randn(q_size, generator=g).to(BF16), torch.randn(kv_size, generator=g).to(BF16)
    qr, kv = fused[:, :q_size], fused[:, q_size:]
    quant, theirs_kv = vllm_query_quant.fused_q_kv_rmsnorm_quant(qr, kv, qw, kvw, 1e-6)
    qo, scales, kvo = QKVNormQuant(q_size=q_size, kv_size=kv_size, dtype="bfloat16")(
        qr, kv, qw, kvw, 1e-6, launch_pdl=False
    )
    for name, ours, theirs in (("qo", qo, quant.data), ("scales", scales, quant.scale), ("kvo", kvo, theirs_kv)):
        assert_same(ours.view(torch.uint8) if name == "qo" else ours, theirs.view(torch.uint8) if name == "qo" else theirs,
                    f"fused_q_kv_rmsnorm_quant: {name}")  # fmt: skip
