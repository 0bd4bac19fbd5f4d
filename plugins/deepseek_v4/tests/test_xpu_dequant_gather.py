"""The XPU FP8 sparse decode's dequant gather (``deepseek_v4.xpu_dequant_gather_slots``): exact against its reference
and a hand-worked row under Triton's interpreter, page strides and zero rows, its errors, out=, and its plan (the
XPU targets only, one key a page size). vLLM 0.34's kernel is compared in
``tests/engines/test_vllm034_kernels_dsv4_xpu.py``.

Exactness: an e4m3 value has at most 4 significant bits and a UE8M0 scale is a power of two, so each NoPE value is a
BF16 number and the cast is exact, whatever the rounding (Triton's interpreter truncates fp32 -> bf16) as long as the
product is a normal fp32: the caches here hold the scales a quantizer writes (2**-17 .. 2**13), never the denormal
range of a zero scale byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.xpu_dequant_gather import XPUDequantGatherSlots, xpu_dequant_gather_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = XPUDequantGatherSlots.name
OP = XPUDequantGatherSlots()
ENTRY = 576 + 8


def _cache(blocks: int, bs: int, seed: int, extra: int = 0) -> torch.Tensor:
    """``[blocks, bs, 584]`` pages at a stride of ``bs * 584 + extra`` bytes: random FP8 codes (no NaN), quantizer
    scales, random BF16 RoPE values."""
    gen = torch.Generator().manual_seed(seed)
    stride = bs * ENTRY + extra
    raw = torch.randint(0, 256, (blocks * stride,), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x7E
    pages = raw.view(blocks, stride)
    for j in range(bs):
        rope = (torch.randn(blocks, 64, generator=gen) * 3).to(torch.bfloat16).view(torch.uint8)
        pages[:, j * 576 + 448 : (j + 1) * 576] = rope
        pages[:, bs * 576 + j * 8 : bs * 576 + j * 8 + 7] = torch.randint(110, 141, (blocks, 7), generator=gen,
                                                                          dtype=torch.uint8)  # fmt: skip
    return raw.as_strided((blocks, bs, ENTRY), (stride, ENTRY, 1))


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_hand_worked_row() -> None:
    """Token 1 of page 2 (2 tokens a page): e4m3 0x40 (2.0) times 2**(130 - 127) = 16; its RoPE copied."""
    cache = torch.zeros(3, 2, ENTRY, dtype=torch.uint8)
    page = cache.view(3, 2 * ENTRY)[2]  # token j's values at j * 576, its scales at 2 * 576 + j * 8
    page[576 : 576 + 448] = 0x40
    page[576 + 448 : 2 * 576] = torch.full((64,), -1.5, dtype=torch.bfloat16).view(torch.uint8)
    page[2 * 576 + 8 : 2 * 576 + 15] = 130
    out = OP(cache, torch.tensor([5, -1], dtype=torch.int32))
    assert out[0, :448].eq(16).all() and out[0, 448:].eq(-1.5).all() and out[1].eq(0).all()


@pytest.mark.parametrize(("bs", "extra"), [(64, 0), (2, 0), (2, 1000), (64, 576)])
def test_matches_reference(bs: int, extra: int) -> None:
    """The SWA / C4 (64 tokens a page) and C128 (2) caches, own and unified (larger) page strides, -1 slots."""
    cache = _cache(4, bs, seed=bs + extra, extra=extra)
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(-1, 4 * bs, (37,), generator=gen, dtype=torch.int32)
    _same(OP(cache, indices), xpu_dequant_gather_reference(cache, indices))


def test_into_a_workspace_half_and_empty() -> None:
    """vLLM's workspace: the top-k rows then the SWA rows of one buffer; no slots, no launch."""
    cache = _cache(3, 64, seed=5)
    indices = torch.tensor([3, 70, -1, 191], dtype=torch.int32)
    workspace = torch.full((6, 512), 7.0, dtype=torch.bfloat16)
    got = OP(cache, indices, out=workspace[2:])
    assert got.data_ptr() == workspace[2:].data_ptr() and workspace[:2].eq(7).all()
    _same(workspace[2:], xpu_dequant_gather_reference(cache, indices))
    assert OP(cache, indices[:0]).shape == (0, 512)


def test_errors_name_the_argument() -> None:
    cache, indices = _cache(2, 64, seed=2), torch.zeros(3, dtype=torch.int32)
    for args, match in (
        ((cache[:, :, :576], indices), "cache must be uint8"),
        ((cache, indices.long()), "indices must be"),
        ((cache.transpose(0, 1), indices), "packed"),
    ):
        with pytest.raises(warmreg.LaunchError, match=match):
            OP(*args)
    with pytest.raises(warmreg.LaunchError, match="out"):
        OP(cache, indices, out=torch.empty(3, 512, dtype=torch.float32))


def test_out() -> None:
    def build() -> OpCall:
        return OpCall(OP, (_cache(2, 64, seed=3), torch.tensor([1, -1, 100], dtype=torch.int32)), {})

    check_out(build)


def test_plan() -> None:
    """On XPU (whose only DeepSeek-V4 cache is fp8_ds_mla): one key a page size (Flash: SWA and C4 64, C128 2);
    nothing elsewhere."""
    kp = warmreg.plan(example_config("deepseek_v4_flash"), target="xpu:pvc").kernel(NAME)
    assert sorted(k.block_size for k in kp.keys) == [2, 64]  # type: ignore[attr-defined]
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    for target in ("cuda:90", "cuda:100", "rocm:gfx942"):
        assert NAME not in {k.name for k in warmreg.plan(example_config("deepseek_v4_flash"), target=target).kernels}
