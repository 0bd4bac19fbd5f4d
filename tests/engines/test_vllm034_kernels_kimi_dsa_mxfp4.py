"""Kimi-K3.1 DSA indexer ops on an MXFP4 indexer cache against vLLM 0.34's own kernels, on identical engine-shaped
inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls the engine's Python entry point in
``vllm/models/kimi_k3/nvidia/ops/dsa_indexer_mxfp4.py`` exactly as ``models/kimi_k3/nvidia/dsa.py`` calls it (the
fused forward's column slices of one projection, the indexer's own cache as a page view of a packed block row, the
model-level top-k buffer) and warmreg's op on clones of the same seeded tensors, then compares every output and
every byte of every buffer both write, bitwise: cache bytes (values, scales, untouched entries and the bytes after
the pages), top-k rows, the normed rows, the packed query, its scales and the scaled weights.

**Not interpretable as is.** vLLM converts to E2M1 with inline PTX (``_fp32x2_to_fp4x2``:
``cvt.rn.satfinite.e2m1x2.f32``), which the interpreter cannot run and which exists on SM10x only; the tests put
:func:`_cvt_rn_satfinite_e2m1x2` in its place, an emulation of the PTX semantics written from the instruction's
definition (round to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating, sign bit 3, the second operand in
the low nibble), independent of warmreg's comparison form. Everything else in vLLM's kernels (scales, LayerNorm,
RMSNorms, the fp8_ds_mla insert, layout) is vLLM's own code.

**Casts.** Triton 3.8's interpreter converts fp32 to bf16 by truncation and fp32 to fp8 with a broken round, where
a GPU rounds to nearest even (``cvt.rn``, ``cvt.rn.satfinite`` for fp8). vLLM rounds its LayerNorm and RMSNorm
outputs to bf16 and its latents to e4m3fn with plain casts; warmreg forms those bits with integer operations. So
that vLLM's kernels write their GPU bytes here, :func:`_hardware_casts` routes the interpreter's float conversions
to or from bf16 / fp8 through torch (round to nearest even; fp8 clamped to +-448 first: satfinite) while the tests
run. warmreg's kernels only cast values that are already exact in the target type, which the stand-in leaves as
they are.

``current_platform`` is vLLM's CPU platform here: ``is_arch_support_pdl()`` is false, so PDL is off on both sides
(the interpreter has no PDL); nothing else CUDA-only is asked.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interp

vllm_fp4 = engine("vllm.models.kimi_k3.nvidia.ops.dsa_indexer_mxfp4")
from warmreg_kimi_k3.dsa_mxfp4_k_insert import MXFP4KeyInsert  # noqa: E402
from warmreg_kimi_k3.dsa_mxfp4_prologue import MXFP4Prologue, fp8_ds_mla_entry_bytes  # noqa: E402
from warmreg_kimi_k3.dsa_mxfp4_q_quant import MXFP4QQuant  # noqa: E402

# Kimi-K3.1's widths (kv_lora 512, rope 64, index head 128) with a short q-LoRA (not a power of two, as 1536) and
# top-k, so that the interpreter stays quick.
Q, KV, R, D, TOPK = 96, 512, 64, 128, 300
ENTRY = D // 2 + D // 32  # 68: vLLM's indexer_cache_entry_bytes(128, True)

# -- the PTX E2M1 conversion, emulated ----------------------------------------------------------------------------


@triton.jit
def _e2m1_from_bits(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``: RNE onto the grid, saturating at 6, from the fp32 bits."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # [1, 8): keep one mantissa bit, round to nearest even, rebias the exponent (127 -> 1); codes 2..7
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - (126 << 1)
    # [0, 1): multiples of 0.5 (codes 0, 1, 2), nearest even
    f = tl.minimum(a, 1.0) * 2.0
    i = f.to(tl.int32)
    frac = f - i.to(tl.float32)
    sub = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(a < 1.0, sub, normal), 7)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _cvt_rn_satfinite_e2m1x2(x_lo, x_hi):
    """``cvt.rn.satfinite.e2m1x2.f32 d, x_hi, x_lo`` as vLLM's ``_fp32x2_to_fp4x2`` returns it: a uint8 with
    ``x_lo``'s code in the low nibble."""
    return (_e2m1_from_bits(x_lo) | (_e2m1_from_bits(x_hi) << 4)).to(tl.uint8)


@triton.jit
def _e2m1_probe(lo_ptr, hi_ptr, out_ptr):
    r = tl.arange(0, 64)
    tl.store(out_ptr + r, _cvt_rn_satfinite_e2m1x2(tl.load(lo_ptr + r), tl.load(hi_ptr + r)))


def test_e2m1_emulation_rounds_to_nearest_even() -> None:
    """The PTX stand-in itself: every grid point, each midpoint to the even code, just past a midpoint, saturation,
    signs (zero included), the high nibble."""
    mags = [0.0, 0.25, 0.2500001, 0.5, 0.75, 1.0, 1.25, 1.2500001, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 5.0001, 6.0,
            7.0, 1e30]  # fmt: skip
    want = [0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 7, 7, 7]
    lo = torch.tensor(mags + [-m for m in mags] + [0.0] * 26)
    hi = torch.full((64,), -0.75)
    out = torch.empty(64, dtype=torch.uint8)
    _e2m1_probe[(1,)](lo, hi, out)
    assert (out[:38] & 15).tolist() == want + [8 | w for w in want]
    assert (out >> 4).eq(8 | 2).all()


@pytest.fixture(autouse=True)
def _ptx_e2m1(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's inline-PTX E2M1 conversion replaced by the emulation (the module docstring says why)."""
    monkeypatch.setattr(vllm_fp4, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)


# -- the interpreter's casts, as the hardware rounds ----------------------------------------------------------------

_TORCH_FLOAT = {
    tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
    tl.float32: torch.float32, tl.float64: torch.float64,
}  # fmt: skip


def _torch_convert(data: np.ndarray, src: Any, dst: Any) -> np.ndarray:
    """The interpreter's storage of ``data`` (fp8 as uint8, bf16 as uint16) converted from ``src`` to ``dst``."""
    x = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).copy()).view(_TORCH_FLOAT[src])
    if dst == tl.float8e4nv:  # satfinite: finite overflow and infinities saturate
        x = x.float().clamp(-448.0, 448.0)
    y = x.to(_TORCH_FLOAT[dst])
    store = torch.uint8 if dst == tl.float8e4nv else torch.int16 if dst == tl.bfloat16 else _TORCH_FLOAT[dst]
    return y.view(store).numpy().view(_interp._get_np_dtype(dst)).reshape(np.shape(data))


def _by_torch(src: Any, dst: Any) -> bool:
    return src in _TORCH_FLOAT and dst in _TORCH_FLOAT and any(d in (tl.float8e4nv, tl.bfloat16) for d in (src, dst))


@pytest.fixture(autouse=True, scope="module")
def _hardware_casts() -> Iterator[None]:
    """Float conversions to or from bf16 / e4m3fn through torch while this module's tests run."""
    builder = _interp.InterpreterBuilder
    interp_cast, interp_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_cast(self, src, dst_type)

    def fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_fp_to_fp(self, src, dst_type, rounding_mode)

    with mock.patch.object(builder, "cast_impl", cast), mock.patch.object(builder, "create_fp_to_fp", fp_to_fp):
        yield


@triton.jit
def _cast_probe(x_ptr, fp8_ptr, bf16_ptr):
    r = tl.arange(0, 8)
    x = tl.load(x_ptr + r)
    tl.store(fp8_ptr + r, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    tl.store(bf16_ptr + r, x.to(tl.bfloat16))


def test_hardware_casts_round_to_nearest_even() -> None:
    """The cast stand-in: fp32 to e4m3fn and bf16 as torch rounds (ties to even, saturating)."""
    x = torch.tensor([7.97, 1.0625, 1.1875, 3 * 2.0**-10, 464.0, -1e9, 1.00390625, 1.01171875])
    fp8, bf16 = torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.bfloat16)
    _cast_probe[(1,)](x, fp8, bf16)
    assert_same(fp8, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), "fp32 -> e4m3fn")
    assert_same(bf16, x.to(torch.bfloat16), "fp32 -> bf16")


# -- engine-shaped inputs -----------------------------------------------------------------------------------------


def _row_cache(blocks: int, entry: int, packed_with: int, seed: int) -> torch.Tensor:
    """A ``[blocks, 64, entry]`` uint8 cache of garbage bytes; ``packed_with`` > 0: a page view into a block row
    holding that many more bytes after the page (vLLM's packed KDA + DSA row)."""
    row = torch.randint(0, 256, (blocks, 64 * entry + packed_with), generator=seeded(seed), dtype=torch.uint8)
    return row[:, : 64 * entry].view(blocks, 64, entry)


def _projection(t: int, seed: int) -> dict[str, torch.Tensor]:
    """``low_latency_linear(hidden, input_weight).split([q_lora, kv_lora, rope, index_head_dim, index_heads])``."""
    proj = (torch.randn(t, Q + KV + R + D + 32, generator=seeded(seed)) * 2).bfloat16()
    q_c, kv_c, k_pe, index_k, weights = proj.split([Q, KV, R, D, 32], -1)
    return {"q_c": q_c, "kv_c": kv_c, "k_pe": k_pe, "index_k": index_k, "index_weights": weights}


def _norms(seed: int) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    return {
        "q_norm_weight": (torch.randn(Q, generator=g) * 0.2 + 1).bfloat16(),  # RMSNorm weights: the model dtype
        "kv_norm_weight": (torch.randn(KV, generator=g) * 0.2 + 1).bfloat16(),
        "k_norm_weight": torch.randn(D, generator=g) * 0.3 + 1,  # KimiK3DSAIndexerKNorm: float32
        "k_norm_bias": torch.randn(D, generator=g) * 0.1,
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (the bytes after the pages and unwritten entries included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


# -- the ops ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "slots", "packed"),
    [
        (1, [70], 0),  # a decode token
        (6, [0, 65, -1, 130, 3], 4096),  # a padded row past the slots, another DCP rank's token, packed pages
    ],
)
def test_k_norm_quant_insert_equals_vllm(t: int, slots: list[int], packed: int) -> None:
    """``mxfp4_k_norm_quant_insert`` (``KimiK3DSAIndexer._fused_k_insert`` with ``use_fp4_cache``): every cache
    byte and the top-k rows bitwise."""
    p, n = _projection(t, t), _norms(t)
    args = dict(
        k=p["index_k"], norm_weight=n["k_norm_weight"], norm_bias=n["k_norm_bias"], norm_eps=1e-5,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), kv_cache=_row_cache(3, ENTRY, packed, t),
        topk_indices_buffer=torch.full((t + 3, TOPK), 11, dtype=torch.int32), num_tokens=t,
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    vllm_fp4.mxfp4_k_norm_quant_insert(**theirs)
    MXFP4KeyInsert()(**ours)
    assert_same(_whole(ours["kv_cache"]), _whole(theirs["kv_cache"]), "index cache bytes")
    assert_same(ours["topk_indices_buffer"], theirs["topk_indices_buffer"], "top-k rows")


@pytest.mark.parametrize(
    ("t", "heads", "padded"),
    [(1, 32, 32), (3, 5, 32), (2, 40, 64), (130, 8, 32)],
    ids=["decode-32", "odd-heads-padded", "padded-64", "8-heads-a-program"],
)
def test_q_quant_equals_vllm(t: int, heads: int, padded: int) -> None:
    """``mxfp4_q_quant`` (``KimiK3DSAIndexer.score`` with ``use_fp4_cache``): the packed query, the int32 scale
    words and the scaled weights bitwise, the padded heads zero on both sides (vLLM's ``torch.zeros``, warmreg's
    kernel). 130 tokens take vLLM's 8-heads-a-program tile."""
    g = seeded(heads + t)
    query = (torch.randn(t, 64 + heads * D, generator=g) * 3).bfloat16()[:, 64:]  # [q | index_q] column slice
    weights = torch.randn(t, 7 + heads, generator=g).bfloat16()[:, 7:]
    index_q = query.view(t, heads, D)
    scale = D**-0.5 * heads**-0.5  # index_softmax_scale * indexer_weight_scale
    want = vllm_fp4.mxfp4_q_quant(index_q, weights, scale, padded)
    got = MXFP4QQuant()(index_q, weights, scale, padded)
    for name, g_, w_ in zip(("q_packed", "q_scale", "weights"), got, want):
        assert_same(g_, w_, name)


@pytest.mark.parametrize(
    ("t", "mla_slots", "index_slots", "packed"),
    [
        (1, [5], [5], 0),
        (5, [1, 64, -1, 130], [129, -1, 0, 66, 2], 2048),  # a padded row, no-slot tokens, packed pages
    ],
)
def test_fused_prologue_equals_vllm(t: int, mla_slots: list[int], index_slots: list[int], packed: int) -> None:
    """``mxfp4_fused_prologue`` (``KimiK3DSAAttention._fused_attention`` with ``use_fp4_cache``): both normed rows,
    every byte of the fp8_ds_mla and MXFP4 caches and the top-k rows bitwise."""
    p, n = _projection(t, 10 + t), _norms(10 + t)
    args = dict(
        q_c=p["q_c"], kv_c=p["kv_c"], k_pe=p["k_pe"], index_k=p["index_k"], **n, eps=1e-5,
        topk_indices_buffer=torch.full((t + 2, TOPK), 11, dtype=torch.int32),
        mla_cache=_row_cache(3, fp8_ds_mla_entry_bytes(KV, R), packed, 1), mla_slot_mapping=torch.tensor(mla_slots),
        index_cache=_row_cache(3, ENTRY, packed, 2), index_slot_mapping=torch.tensor(index_slots),
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_fp4.mxfp4_fused_prologue(**theirs)
    got = MXFP4Prologue()(*ours.values(), launch_pdl=False)  # vLLM's argument order
    assert_same(got[0], want[0], "q_c_normed")
    assert_same(got[1], want[1], "kv_c_normed")
    for name in ("mla_cache", "index_cache"):
        assert_same(_whole(ours[name]), _whole(theirs[name]), name)
    assert_same(ours["topk_indices_buffer"], theirs["topk_indices_buffer"], "top-k rows")


def test_fused_prologue_profile_run_equals_vllm() -> None:
    """A dummy run: no caches (None), so only the norms and the top-k fill; both sides agree."""
    p, n = _projection(3, 7), _norms(7)
    args = dict(
        q_c=p["q_c"], kv_c=p["kv_c"], k_pe=p["k_pe"], index_k=p["index_k"], **n, eps=1e-5,
        topk_indices_buffer=torch.full((3, TOPK), 11, dtype=torch.int32),
        mla_cache=None, mla_slot_mapping=None, index_cache=None, index_slot_mapping=None,
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_fp4.mxfp4_fused_prologue(**theirs)
    got = MXFP4Prologue()(*ours.values(), launch_pdl=False)
    assert_same(got[0], want[0], "q_c_normed")
    assert_same(got[1], want[1], "kv_c_normed")
    assert_same(ours["topk_indices_buffer"], theirs["topk_indices_buffer"], "top-k rows")
