"""DeepSeek-V4.1 compressor ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under Triton's
interpreter: the fused state save + pooling + RMSNorm (``fused_save_compress_norm``), the PCP ring store
(``save_ring_rows``) and the compressed-cache insert for every record (``rope_quant_insert``: 584-byte fp8_ds_mla,
528-byte MXFP8, 288-byte NVFP4, plain bf16 and per-tensor FP8 rows).

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point in
``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` exactly as ``DeepseekCompressor.forward`` and
``insert_cache`` call it, and warmreg's op on clones of the same seeded tensors, then compares every buffer both
write, bitwise (the latent buffer, the ring, every cache byte, written or not). The bf16 and e4m3 casts and the
``log2``/``exp2`` are the same operations on both sides, so the interpreter's truncating casts give both the same
bits and no tolerance is needed.

**Not interpretable as is.** vLLM's NVFP4 kernel converts to E2M1 with inline PTX (``_fp32x2_to_fp4x2``:
``cvt.rn.satfinite.e2m1x2.f32``), which the interpreter cannot run; :func:`_cvt_rn_satfinite_e2m1x2` stands in for
it, an emulation written from the instruction's definition (round to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4,
6}, saturating, sign bit 3, the second operand in the low nibble), independent of warmreg's ``e2m1_code``.
``current_platform`` is vLLM's CPU platform here: no PDL, ``_JOIN_ROW_PTRS`` true and ``_ON_GFX950`` false, as on
CUDA; nothing CUDA-only is asked.
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
import triton
import triton.language as tl

vllm_v41 = engine("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_compress import V41SaveCompressNorm  # noqa: E402
from warmreg_deepseek_v4.v41_ring_rows import V41SaveRingRows  # noqa: E402
from warmreg_deepseek_v4.v41_rope_insert import V41RopeInsert  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, I64 = torch.int32, torch.int64
EPS = 1e-6


@triton.jit
def _e2m1_from_bits(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``: RNE onto the grid, saturating at 6, from the fp32 bits."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - (126 << 1)  # [1, 8): one mantissa bit, RNE
    f = tl.minimum(a, 1.0) * 2.0  # [0, 1): multiples of 0.5, nearest even
    i = f.to(tl.int32)
    frac = f - i.to(tl.float32)
    sub = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(a < 1.0, sub, normal), 7)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _cvt_rn_satfinite_e2m1x2(x_lo, x_hi):
    """``cvt.rn.satfinite.e2m1x2.f32 d, x_hi, x_lo`` as vLLM's ``_fp32x2_to_fp4x2`` returns it."""
    return (_e2m1_from_bits(x_lo) | (_e2m1_from_bits(x_hi) << 4)).to(tl.uint8)


@pytest.fixture(autouse=True)
def _ptx_e2m1(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's inline-PTX E2M1 conversion replaced by the emulation (the module docstring says why)."""
    monkeypatch.setattr(vllm_v41, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)


# -- DeepseekCompressor.forward: fused_save_compress_norm --------------------------------------------------------------
def _ratio2_step(seed: int, capacity: int) -> dict[str, torch.Tensor]:
    """A mixed step of four requests in ring blocks 1..4 (block 0 is the null block): a chunk starting on an odd
    position (its first token closes a group with the ring), one starting on an even position, a longer chunk than
    the ring, a decode token; then two padding rows (slot -1)."""
    g = seeded(seed)
    chunks = [(5, 5), (0, 3), (2, capacity + 5), (13, 1)]  # (first position, length)
    positions = torch.cat([torch.arange(p, p + n) for p, n in chunks] + [torch.zeros(2, dtype=I64)])
    lens = torch.tensor([n for _, n in chunks])
    qsl = torch.cat([torch.zeros(1, dtype=I64), lens.cumsum(0)]).to(I32)
    req = torch.cat([torch.full((n,), b) for b, (_, n) in enumerate(chunks)] + [torch.zeros(2, dtype=I64)]).to(I32)
    blocks = torch.tensor([1, 2, 3, 4])
    slots = torch.where(
        torch.arange(len(positions)) < int(qsl[-1]), blocks[req.long()] * capacity + positions % capacity, -1
    )
    T = len(positions)
    return {
        "kv_score": torch.randn(T + 3, 1024, generator=g) * 2,
        "positions": positions,
        "state": torch.randn(5, capacity, 1024, generator=g),
        "slots": slots.to(I64),
        "qsl": qsl,
        "req": req,
        "weight": (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16),
        "latent": torch.full((T + 3, 512), 7.0, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("capacity", [8, 16])  # no drafts; 7 drafts (next_pow2(9))
def test_save_compress_norm_ratio2_equals_vllm(capacity: int) -> None:
    args = _ratio2_step(capacity, capacity)
    theirs, ours = clones(**args), clones(**args)
    vllm_v41.fused_save_compress_norm(
        theirs["kv_score"], theirs["positions"], theirs["state"], theirs["slots"], theirs["qsl"], theirs["req"],
        theirs["weight"], EPS, 2, theirs["latent"],
    )  # fmt: skip
    V41SaveCompressNorm()(
        ours["kv_score"], ours["positions"], ours["state"], ours["slots"], ours["qsl"], ours["req"], ours["weight"],
        eps=EPS, compress_ratio=2, out=ours["latent"],
    )  # fmt: skip
    for name in ("latent", "state", "kv_score"):
        assert_same(ours[name], theirs[name], name)
    assert (ours["latent"] != 7.0).any(dim=1).sum() > 5  # groups were written


def test_save_compress_norm_ratio1_equals_vllm() -> None:
    """Ratio 1: the main cache's slot mapping (some tokens without a slot), no ring."""
    g = seeded(1)
    T = 9
    args = {
        "kv_score": torch.randn(T, 512, generator=g) * 3,
        "positions": torch.randint(0, 1000, (T + 2,), generator=g),
        "slots": torch.tensor([4, -1, 9, 10, 11, -1, 70, 71, 3], dtype=I64),
        "weight": (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16),
        "latent": torch.full((T, 512), -3.0, dtype=torch.bfloat16),
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_v41.fused_save_compress_norm(
        theirs["kv_score"], theirs["positions"], None, theirs["slots"], None, None, theirs["weight"], EPS, 1,
        theirs["latent"],
    )  # fmt: skip
    V41SaveCompressNorm()(
        ours["kv_score"], ours["positions"], None, ours["slots"], None, None, ours["weight"], eps=EPS,
        compress_ratio=1, out=ours["latent"],
    )  # fmt: skip
    assert_same(ours["latent"], theirs["latent"], "latent")


def test_save_compress_norm_pcp_and_ring_rows_equal_vllm() -> None:
    """PCP: predecessors from rows gathered across ranks where ``prev_row_indices >= 0`` (else the ring), then
    ``save_ring_rows`` of the gathered rows (slot -1 rows skipped), as ``DeepseekCompressor.forward`` calls both."""
    args = _ratio2_step(3, 8)
    g = seeded(4)
    args["prev_rows"] = torch.randn(6, 1024, generator=g)
    args["prev_idx"] = torch.tensor([2, -1, 0, 5], dtype=I64)
    args["ring_slots"] = torch.tensor([9, -1, 17, 18, -1, 33], dtype=I64)
    theirs, ours = clones(**args), clones(**args)
    vllm_v41.fused_save_compress_norm(
        theirs["kv_score"], theirs["positions"], theirs["state"], theirs["slots"], theirs["qsl"], theirs["req"],
        theirs["weight"], EPS, 2, theirs["latent"], prev_rows=theirs["prev_rows"], prev_row_indices=theirs["prev_idx"],
    )  # fmt: skip
    vllm_v41.save_ring_rows(theirs["prev_rows"], theirs["ring_slots"], theirs["state"])
    V41SaveCompressNorm()(
        ours["kv_score"], ours["positions"], ours["state"], ours["slots"], ours["qsl"], ours["req"], ours["weight"],
        eps=EPS, compress_ratio=2, prev_rows=ours["prev_rows"], prev_row_indices=ours["prev_idx"], out=ours["latent"],
    )  # fmt: skip
    V41SaveRingRows()(ours["prev_rows"], ours["ring_slots"], ours["state"])
    for name in ("latent", "state"):
        assert_same(ours[name], theirs[name], name)
    assert not torch.equal(ours["state"], args["state"])


# -- DeepseekCompressor.insert_cache: rope_quant_insert ---------------------------------------------------------------
def _insert_args(seed: int, width: int, dtype: torch.dtype, ratio: int) -> dict[str, torch.Tensor]:
    """A step's latents and positions, the model's fp32 cos/sin cache, and a garbage-filled cache whose pages sit
    in a wider allocation (a page stride past the records) for the packed ones."""
    g = seeded(seed)
    T, blocks, bs = 11, 4, 16
    positions = torch.cat([torch.arange(20, 27), torch.tensor([3, 63, 64, 0])])
    angles = torch.rand(128, 32, generator=g) * 6.3
    if dtype == torch.uint8:
        pages = torch.randint(0, 256, (blocks, bs * width + 48), generator=g, dtype=torch.uint8)
        cache = pages.as_strided((blocks, bs, width), (bs * width + 48, width, 1))
    else:
        cache = (torch.randn(blocks, bs, 512, generator=g) * 9).to(dtype)
    return {
        "latent": (torch.randn(T + 2, 512, generator=g) * torch.rand(T + 2, 1, generator=g) * 4).to(torch.bfloat16),
        "positions": positions,
        "cos_sin": torch.cat([angles.cos(), angles.sin()], dim=1),
        "cache": cache,
        "slots": torch.tensor([0, 5, 17, -1, 18, 33, 47, 63, 2, -1, 50], dtype=I64),
        "scale": torch.tensor([0.0173], dtype=torch.float32),
    }


@pytest.mark.parametrize(
    ("width", "dtype"),
    [(584, torch.uint8), (528, torch.uint8), (288, torch.uint8), (512, torch.bfloat16), (512, torch.float8_e4m3fn)],
)
@pytest.mark.parametrize("ratio", [1, 2])
def test_rope_insert_equals_vllm(width: int, dtype: torch.dtype, ratio: int) -> None:
    args = _insert_args(width + ratio, width, dtype, ratio)
    theirs, ours = clones(**args), clones(**args)
    fp8 = dtype == torch.float8_e4m3fn
    vllm_v41.rope_quant_insert(
        theirs["latent"], theirs["positions"], theirs["cos_sin"], theirs["cache"], theirs["slots"], ratio,
        fp8_scale=theirs["scale"] if fp8 else None,
    )  # fmt: skip
    V41RopeInsert()(
        ours["latent"], ours["positions"], ours["cos_sin"], ours["cache"], ours["slots"], compress_ratio=ratio,
        fp8_scale=ours["scale"] if fp8 else None,
    )  # fmt: skip
    assert_same(ours["cache"], theirs["cache"], "kv_cache")
    written = ours["cache"].view(torch.uint8) != args["cache"].view(torch.uint8)
    assert written.flatten(1).any(dim=1).sum() >= 3  # records landed in several pages
    if dtype == torch.uint8:  # the bytes between and after the pages, too
        storage = lambda t: torch.frombuffer(bytearray(t.untyped_storage()), dtype=torch.uint8)  # noqa: E731
        assert_same(storage(ours["cache"]), storage(theirs["cache"]), "cache allocation")
