"""DeepSeek-V4 numeric and cache ops against vLLM 0.33's own kernels, on identical engine-shaped inputs,
under Triton's interpreter.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere. Each test
calls the Python entry the engine's model code calls (named in its docstring), with the arguments of that call
site, and warmreg's op on clones of the same seeded tensors, then compares every output and every byte of every
buffer either side writes (whole cache storages, untouched pages and page padding included): bitwise.

**Casts.** Triton 3.8's interpreter converts fp32 -> bf16 by truncation and fp32 -> fp8 with a broken round
(7.97 -> 4.0, ties away from even: 1.0625 -> 1.125, overflow to NaN), and reads the e4m3 NaN codes as +-480;
a GPU rounds to nearest even (``cvt.rn``; to fp8 ``cvt.rn.satfinite``: finite values past the max saturate,
NaN stays NaN) and reads NaN. So that vLLM's kernels write their GPU bytes here, :func:`_hardware_casts`
routes the interpreter's float conversions that involve bf16 or fp8 through torch, whose CPU casts round to
nearest even and which supports ``float8_e4m3fn`` and ``float8_e4m3fnuz`` on CPU (fp8 targets are clamped to
the format's max first: satfinite). warmreg's quant kernels form their fp8 (and RoPE'd bf16) bits with integer
operations; where a warmreg kernel casts (the bf16 stores of the gather, the pooling, the norms) it goes through
the same stand-in, as on a GPU both sides' casts are the same ``cvt.rn``.

**Not interpretable.** vLLM converts to E2M1 (MXFP4) with inline PTX ``cvt.rn.satfinite.e2m1x2.f32``
(``_fp32x2_to_fp4x2``), which the interpreter cannot run (and which exists on SM10x only, so not on the H200
either). The MXFP4 tests put :func:`_cvt_rn_satfinite_e2m1x2` in its place, an independent emulation of the
PTX semantics (round to nearest even onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating, sign bit 3, the second
operand in the low nibble); everything else in those kernels (scales, RoPE, rounding, layout) is vLLM's.

**Platform branches.** Where the entry picks its kernel from ``current_platform`` (the CPU platform here), the
test stands the module's ``current_platform`` in for the platform whose branch launches the Triton kernel
(:class:`_Platform`), and names it in the parametrization.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, assert_within_ulps, clones, engine, seeded  # isort: skip

from unittest import mock

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interp

CACHE = engine("vllm.models.deepseek_v4.common.ops.cache_utils")
COMPRESS = engine("vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache")
INDEXER_Q = engine("vllm.models.deepseek_v4.common.ops.fused_indexer_q")
INV_ROPE = engine("vllm.models.deepseek_v4.common.ops.fused_inv_rope_fp8_quant")
MTP = engine("vllm.models.deepseek_v4.common.ops.fused_mtp_input_rmsnorm")
SAVE = engine("vllm.models.deepseek_v4.common.ops.save_partial_states")
QUANT_UTILS = engine("vllm.model_executor.layers.quantization.utils.quant_utils")

from warmreg_deepseek_v4.cache import DequantGatherKCache  # noqa: E402
from warmreg_deepseek_v4.cache_insert import QuantInsertKCache  # noqa: E402
from warmreg_deepseek_v4.compress_pool import CompressPool  # noqa: E402
from warmreg_deepseek_v4.fp8_ds_mla import PagedCache, page_bytes  # noqa: E402
from warmreg_deepseek_v4.indexer_kv import IndexerKVCompressInsert  # noqa: E402
from warmreg_deepseek_v4.indexer_q import IndexerQRopeQuant  # noqa: E402
from warmreg_deepseek_v4.indexer_q_mxfp4 import IndexerQRopeMxfp4  # noqa: E402
from warmreg_deepseek_v4.inv_rope_quant import InvRopeFP8Quant  # noqa: E402
from warmreg_deepseek_v4.mtp_input_norm import MTPInputRMSNorm  # noqa: E402
from warmreg_deepseek_v4.mtp_shared_head_norm import MTPSharedHeadRMSNorm  # noqa: E402
from warmreg_deepseek_v4.state_cache import SavePartialStates  # noqa: E402

I32, I64, BF16, F32, U8 = torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.uint8

# -- the interpreter's casts, as the hardware rounds ----------------------------------------------------------

_TORCH_FLOAT = {
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e4b8: torch.float8_e4m3fnuz,
    tl.float8e5: torch.float8_e5m2,
    tl.bfloat16: torch.bfloat16,
    tl.float16: torch.float16,
    tl.float32: torch.float32,
    tl.float64: torch.float64,
}
_FP8 = (tl.float8e4nv, tl.float8e4b8, tl.float8e5)


def _torch_convert(data: np.ndarray, src: Any, dst: Any) -> np.ndarray:
    """The interpreter's storage (fp8 as uint8, bf16 as uint16) of ``data`` converted from ``src`` to ``dst``."""
    flat = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).copy())
    x = flat.view(_TORCH_FLOAT[src])
    if dst in _FP8:  # cvt.rn.satfinite: finite overflow and infinities saturate, NaN stays NaN
        big = torch.finfo(_TORCH_FLOAT[dst]).max
        x = x.float().clamp(-big, big)
    y = x.to(_TORCH_FLOAT[dst])
    store = U8 if dst in _FP8 else torch.int16 if dst == tl.bfloat16 else _TORCH_FLOAT[dst]
    return y.view(store).numpy().view(_interp._get_np_dtype(dst)).reshape(np.shape(data))


def _converts_by_torch(src: Any, dst: Any) -> bool:
    return src in _TORCH_FLOAT and dst in _TORCH_FLOAT and any(d in (*_FP8, tl.bfloat16) for d in (src, dst))


@pytest.fixture(autouse=True, scope="module")
def _hardware_casts() -> Any:
    """Float conversions involving bf16 or fp8 through torch (round to nearest even, satfinite) while this
    module's tests run; the module docstring says why."""
    builder = _interp.InterpreterBuilder
    interp_cast, interp_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _converts_by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_cast(self, src, dst_type)

    def fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _converts_by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_fp_to_fp(self, src, dst_type, rounding_mode)

    with mock.patch.object(builder, "cast_impl", cast), mock.patch.object(builder, "create_fp_to_fp", fp_to_fp):
        yield


def test_hardware_casts_round_to_nearest_even() -> None:
    """The cast stand-in itself: fp32 -> bf16 / e4m3fn / e4m3fnuz bytes as torch rounds them (ties to even,
    saturating), and e4m3 bytes -> fp32 with the NaN codes read as NaN."""
    vals = torch.tensor([7.97, 1.0625, 1.1875, 3 * 2.0**-10, 464.0, -1e9, float("inf"), 2.0**-10, 1.00390625])
    out8, outz, out16 = torch.empty(9, dtype=U8), torch.empty(9, dtype=U8), torch.empty(9, dtype=BF16)
    codes = torch.tensor([0x7F, 0xFF, 0x7E, 0x01], dtype=U8)
    back = torch.empty(4, dtype=F32)
    _cast_probe[(1,)](vals, out8, outz, out16, codes, back)
    assert_same(out8, vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(U8), "fp32 -> e4m3fn")
    assert_same(outz, vals.clamp(-240, 240).to(torch.float8_e4m3fnuz).view(U8), "fp32 -> e4m3fnuz")
    assert_same(out16, vals.to(BF16), "fp32 -> bf16")
    assert back[:2].isnan().all() and back[2:].tolist() == [448.0, 2.0**-9]


@triton.jit
def _cast_probe(x_ptr, fp8_ptr, fnuz_ptr, bf16_ptr, code_ptr, back_ptr):
    x = tl.load(x_ptr + tl.arange(0, 16), mask=tl.arange(0, 16) < 9)
    r = tl.arange(0, 16)
    tl.store(fp8_ptr + r, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=r < 9)
    tl.store(fnuz_ptr + r, x.to(tl.float8e4b8).to(tl.uint8, bitcast=True), mask=r < 9)
    tl.store(bf16_ptr + r, x.to(tl.bfloat16), mask=r < 9)
    c = tl.arange(0, 4)
    tl.store(back_ptr + c, tl.load(code_ptr + c).to(tl.float8e4nv, bitcast=True).to(tl.float32))


@triton.jit
def _e2m1(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``: RNE, saturating at 6; from the fp32 bits."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # [1, 8): round the 23-bit mantissa to 1 bit (nearest even), rebias the exponent from 127 to 1
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - (126 << 1)
    # [0, 1): multiples of 0.5, nearest even
    f = tl.minimum(a, 1.0) * 2.0
    i = f.to(tl.int32)
    frac = f - i.to(tl.float32)
    sub = i + ((frac > 0.5) | ((frac == 0.5) & ((i & 1) == 1))).to(tl.int32)
    code = tl.minimum(tl.where(a < 1.0, sub, normal), 7)
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _cvt_rn_satfinite_e2m1x2(x_lo, x_hi):
    """``cvt.rn.satfinite.e2m1x2.f32 d, x_hi, x_lo`` (PTX: the first source in the upper nibble) as vLLM's
    ``_fp32x2_to_fp4x2`` returns it: a uint8."""
    return (_e2m1(x_lo) | (_e2m1(x_hi) << 4)).to(tl.uint8)


def test_e2m1_emulation_is_round_to_nearest_even() -> None:
    """The PTX stand-in: every grid point, every midpoint (ties to the even code), saturation, signs."""
    mags = [0.0, 0.25, 0.2500001, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 5.0001, 6.0, 7.0, 1e30]
    want = [0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 7, 7, 7]
    lo = torch.tensor(mags + [-m for m in mags] + [0.0] * 26)[:64].view(2, 32)
    hi = torch.full((2, 32), -0.75)
    out = torch.empty(2, 32, dtype=U8)
    _e2m1_probe[(1,)](lo, hi, out)
    codes = want + [8 | w for w in want]
    assert out.view(-1)[: len(codes)].bitwise_and(15).tolist() == codes
    assert out.bitwise_right_shift(4).eq(8 | 2).all()  # -0.75: the high nibble, -1.0


@triton.jit
def _e2m1_probe(lo_ptr, hi_ptr, out_ptr):
    r = tl.arange(0, 64)
    tl.store(out_ptr + r, _cvt_rn_satfinite_e2m1x2(tl.load(lo_ptr + r), tl.load(hi_ptr + r)))


# -- stand-ins ----------------------------------------------------------------------------------------------


class _Platform:
    """What the entries ask ``current_platform``, for the platform whose branch runs the Triton kernel."""

    def __init__(self, *, rocm: bool = False, fnuz: bool = False) -> None:
        self.rocm, self.fnuz = rocm, fnuz

    def is_rocm(self) -> bool:
        return self.rocm

    def is_cuda(self) -> bool:
        return not self.rocm

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def is_fp8_fnuz(self) -> bool:
        return self.fnuz

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.fnuz else torch.float8_e4m3fn

    def is_arch_support_pdl(self) -> bool:
        return False


_ROCM: types.ModuleType | None = None


def _rocm_module() -> types.ModuleType:
    """``vllm.models.deepseek_v4.amd.rocm``: importing it reads the GPU's arch (``vllm.platforms.rocm``), which
    finds no device here; it imports with the arch reported as gfx950 (CDNA4, where the MXFP4 indexer runs)."""
    global _ROCM
    if _ROCM is None:
        arch = types.SimpleNamespace(gcnArchName="gfx950")
        with mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: arch):
            _ROCM = engine("vllm.models.deepseek_v4.amd.rocm")
    return _ROCM


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (padding, untouched pages and rows included)."""
    return torch.empty(0, dtype=U8).set_(t.untyped_storage())


def _rope_cache(g: torch.Generator, positions: int, rope_dim: int = 64) -> torch.Tensor:
    angles = torch.rand(positions, rope_dim // 2, generator=g) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Float bits with every NaN made one canonical NaN: a GPU's ``cvt.rn.bf16.f32`` gives its canonical NaN
    whatever NaN went in, so NaN payloads and signs carry no meaning across two kernels."""
    x = torch.where(x.isnan(), torch.full_like(x, float("nan")), x)
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


# -- fp8_ds_mla cache: gather and insert --------------------------------------------------------------------


def _fp8_ds_mla_pages(g: torch.Generator, pages: int, bs: int) -> torch.Tensor:
    """Random pages ``[pages, bs, 584]`` at the allocated page stride: every e4m3 code (NaN codes too), RoPE
    bf16s, and scale bytes over the whole 0..255 range."""
    flat = torch.randint(0, 256, (pages, page_bytes(bs)), generator=g, dtype=U8)
    return flat[:, : bs * 584].view(pages, bs, 584)


# random scale bytes reach 255: values overflow to inf on both sides, as on a GPU
@pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)
@pytest.mark.parametrize(  # only the SWA cache is FNUZ (gfx942); the compressed caches are always OCP
    ("cache", "use_fnuz"),
    [("swa", False), ("swa", True), ("c4", False), ("c128", False)],
    ids=["swa", "swa-fnuz", "c4", "c128"],
)
def test_dequant_gather_k_cache_equals_vllm(cache: str, use_fnuz: bool) -> None:
    """``dequantize_and_gather_k_cache`` (``models/deepseek_v4/common/ops/cache_utils.py`` →
    ``DequantizeAndGatherKCacheKernel``; the ROCm/XPU prefill and CUDA without CuTeDSL), called per prefill
    chunk as ``xpu_sparse.py`` / ``amd/rocm.py`` call it: the compressed cache at offset 0 with ``gather_lens``
    None and ``seq_lens // cr``, the SWA cache at offset N with the chunk's gather lens; row-offset views of the
    block tables and lens. Every row of the workspace compared (rows neither side writes keep their sentinel);
    NaN codes decode to NaN on both."""
    g = seeded(1)
    bs = {"swa": 64, "c4": 64, "c128": 2}[cache]
    k_cache = _fp8_ds_mla_pages(g, 6, bs)
    table_full = torch.randint(0, 6, (5, 7), generator=g, dtype=I32)
    block_table = table_full[2:]  # block_table[num_decodes:][chunk]: a row-offset view
    if cache == "swa":
        seq_lens = torch.tensor([9, 70, 130, 3, 64], dtype=I32)[2:]
        gather_lens = torch.tensor([0, 0, 6, 3, 3], dtype=I32)[2:]  # request 0 crosses a page boundary
        offset, rows = 5, 12
    else:
        seq_lens = torch.tensor([0, 0, 7, 1, 13] if bs == 2 else [0, 0, 70, 1, 3], dtype=I32)[2:]  # compressed
        gather_lens, offset, rows = None, 0, 80 if bs == 64 else 14
    out = torch.full((4, rows, 512), -7.0, dtype=BF16)[:3]  # kv[:chunk_size] of the workspace
    args: dict[str, Any] = dict(out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens,
                                block_table=block_table, block_size=bs, offset=offset)  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    CACHE.dequantize_and_gather_k_cache(**theirs, use_fnuz=use_fnuz)
    DequantGatherKCache(cache=PagedCache(cache, bs, (page_bytes(bs),), 7))(
        ours["out"], ours["k_cache"], ours["seq_lens"], ours["block_table"], block_size=bs, offset=offset,
        gather_lens=ours["gather_lens"], use_fnuz=use_fnuz,
    )  # fmt: skip
    assert theirs["out"].isnan().any() and theirs["out"].eq(-7).any()  # NaN codes read, and untouched rows
    assert_same(_bits(ours["out"]), _bits(theirs["out"]), "gathered K")


def _k_blocks(g: torch.Generator, tokens: int) -> torch.Tensor:
    """bf16 ``[tokens, 512]`` whose 64-blocks span 1e-7 .. 1e4 (blocks below the 1e-4 amax floor among them),
    with an all-zero block, a block of bf16 subnormals, amax exactly 448 * 2**k, e4m3 ties, and a block holding
    infinities."""
    mags = 10.0 ** torch.linspace(-7, 4, 8).repeat_interleave(64)
    x = torch.randn(tokens, 512, generator=g) * mags
    x[0, 64:128] = 0.0  # all zero: vLLM's floor gives scale byte 105 (2**-22)
    x[1, :64] = torch.tensor([1e-40, -3e-39, 0.0, 2e-39] * 16)  # bf16 subnormals
    x[2, 128:192] = torch.tensor([448.0, 17.0, 8.5, 2.125, -4.25, 7.96875, -0.0, 2.0**-9] * 8)  # amax 448, ties
    x[3, 192:256] = torch.tensor([-0.875, 0.1, 0.2, 0.3] * 16)  # amax 448 * 2**-9 exactly
    x[3, 320:384] = torch.tensor([float("inf"), -5.0, 3e4, -0.0] * 16)  # an infinity: vLLM's scale is inf
    return x.to(BF16)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf, inf * 0: NaN
@pytest.mark.parametrize("use_fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("dp_padding", [False, True], ids=["all-tokens", "dp-padded"])
def test_quant_insert_k_cache_equals_vllm(dp_padding: bool, use_fnuz: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantize_and_insert_k_cache`` (``models/deepseek_v4/common/ops/cache_utils.py`` →
    ``quantize_and_insert_k_kernel``), the XPU SWA insert as ``xpu/xpu_qnorm_rope_kv_fp8_insert.py`` calls it:
    the RoPE'd ``[T, 512]`` K, the cache viewed ``[num_blocks, page bytes]``, ``slot_mapping`` (-1 skips; under
    DP padding shorter than K: only its tokens are written). Every byte of the cache storage compared: written
    tokens, their scale bytes (the all-zero block gets vLLM's 1e-4 amax floor: byte 105; a block holding an
    infinity, byte 255), other pages' random bytes and page padding. FNUZ: vLLM's writer takes
    ``get_fp8_min_max()`` (224 on a FNUZ platform, which the test stands in for)."""
    if use_fnuz:  # vLLM refuses use_fnuz unless the platform is FNUZ (gfx942)
        gfx942 = _Platform(rocm=True, fnuz=True)
        monkeypatch.setattr(CACHE, "current_platform", gfx942)
        monkeypatch.setattr(QUANT_UTILS, "current_platform", gfx942)
    g = seeded(2)
    bs, tokens = 64, 6
    k = _k_blocks(g, tokens)
    slots = torch.tensor([3, 64 + 17, -1, 127, 0, 130], dtype=I64)
    slot_mapping = slots[:4] if dp_padding else slots
    k_cache = torch.randint(0, 256, (3, page_bytes(bs)), generator=g, dtype=U8)
    args: dict[str, Any] = dict(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    theirs, ours = clones(**args), clones(**args)
    CACHE.quantize_and_insert_k_cache(**theirs, block_size=bs, use_fnuz=use_fnuz)
    QuantInsertKCache(block_size=bs)(**ours, block_size=bs, use_fnuz=use_fnuz)
    scales = theirs["k_cache"][:2, bs * 576 : bs * 584].reshape(2, bs, 8)
    assert int(scales[0, 3, 1]) == (106 if use_fnuz else 105)  # token 0 (slot 3), block 1: ceil(log2(1e-4/max))+127
    assert int(scales[1, 63, 5]) == 255  # token 3 (slot 127), block 5: an infinity
    assert_same(_storage(ours["k_cache"]), _storage(theirs["k_cache"]), "fp8_ds_mla cache bytes")


# -- compressor: save partial states, the C4 indexer's KV compress + insert, ROCm's pooling --------------------

HD, CR, STATE_BS = 128, 4, 4  # indexer head, C4 ratio, C4 state page size


def _compressor_batch(g: torch.Generator) -> dict[str, Any]:
    """A C4 indexer compressor step after ``save_partial_states``. Tokens 0..11: request 0, positions 0..11
    (boundaries at 3, 7, 11); token 12: request 1 decoding at 19 (its window reaches back to 12); tokens 13..16:
    request 2 at 4..7, whose states hold an all-zero kv (a zero K: the scale floors); token 17: DP padding,
    past the state slot mapping (the grid is ``slot_mapping.shape[0]``). The state cache is a view of a wider
    pool (page stride 4 * 520 floats). The state slot of token 7 is PAD (nothing written at that boundary);
    token 11 closes a window but has no indexer slot (-1)."""
    width = 2 * HD  # overlap: STATE_WIDTH = coff * head_dim
    pool = torch.randn(12, STATE_BS, 2 * width + 8, generator=g) * 2
    state_cache = pool[:, :, : 2 * width]
    state_cache[8, :, :width] = 0.0  # request 2's kv states
    state_cache[10, :, :width] = 0.0
    table = torch.tensor([[3, 1, 7, 0, 0, 0], [2, 5, 9, 4, 11, 6], [8, 10, 0, 0, 0, 0]], dtype=I32)
    positions = torch.tensor([*range(12), 19, *range(4, 8), 0], dtype=I64)
    req = torch.tensor([0] * 12 + [1] + [2] * 4 + [0], dtype=I32)
    bt = table[req.long(), positions // STATE_BS].long()
    slot_mapping = (bt * STATE_BS + positions % STATE_BS)[:17].clone()
    slot_mapping[7] = -1
    compressed = torch.full((18,), -1, dtype=I64)
    compressed[[3, 7, 12, 16]] = torch.tensor([70, 66, 3, 127])
    return dict(
        state_cache=state_cache, token_to_req_indices=req, positions=positions, slot_mapping=slot_mapping,
        block_table=table, compressed_slot_mapping=compressed,
    )  # fmt: skip


def _indexer_k_cache(g: torch.Generator, fp4: bool) -> torch.Tensor:
    """The indexer K cache ``[pages, 64, token bytes]`` at the allocated page stride (rounded to 576), random."""
    row = HD // 2 + HD // 32 if fp4 else HD + 4
    stride = -(-64 * row // 576) * 576
    flat = torch.randint(0, 256, (2, stride), generator=g, dtype=U8)
    return flat[:, : 64 * row].view(2, 64, row)


@pytest.mark.parametrize(
    ("use_fp4_cache", "mx_scale"), [(False, False), (False, True), (True, False)], ids=["fp8", "fp8-mx", "mxfp4"]
)
def test_indexer_kv_compress_insert_equals_vllm(
    use_fp4_cache: bool, mx_scale: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compress_norm_rope_store_triton`` (``models/deepseek_v4/common/ops/fused_compress_quant_cache.py`` →
    ``FusedKVCompressNormRopeInsertIndexerTritonKernel`` → ``_fused_kv_compress_norm_rope_insert_indexer_attn``,
    or ``..._indexer_mxfp4_attn`` with ``use_fp4_cache``), as ``DeepseekCompressor._compress_norm_rope_store``
    calls it for the C4 indexer (head 128, overlap, ``quant_block/token_stride/scale_dim`` 128/128/4 or
    32/64/4). ``mx_scale``: ``mqa_logits_use_mx_scales()`` (CUDA SM100: the scale as UE8M0 x4). MXFP4: vLLM's
    PTX E2M1 conversion replaced by :func:`_cvt_rn_satfinite_e2m1x2`. Every byte of the cache storage compared."""
    monkeypatch.setattr(COMPRESS, "mqa_logits_use_mx_scales", lambda: mx_scale)
    if use_fp4_cache:
        monkeypatch.setattr(COMPRESS, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)
    g = seeded(3)
    batch = _compressor_batch(g)
    norm_weight = torch.rand(HD, generator=g) + 0.5
    norm_weight[5::16] = 2048.0  # amax past 896: UE8M0 bytes >= 128 (the MX word's sign bit)
    args: dict[str, Any] = dict(
        **batch, norm_weight=norm_weight.to(BF16), cos_sin_cache=_rope_cache(g, 32),
        kv_cache=_indexer_k_cache(g, use_fp4_cache),
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    COMPRESS.compress_norm_rope_store_triton(
        state_cache=theirs["state_cache"], num_actual=theirs["slot_mapping"].shape[0],
        token_to_req_indices=theirs["token_to_req_indices"], positions=theirs["positions"],
        slot_mapping=theirs["slot_mapping"], block_table=theirs["block_table"], block_size=STATE_BS,
        state_width=theirs["state_cache"].shape[-1] // 2, cos_sin_cache=theirs["cos_sin_cache"],
        kv_cache=theirs["kv_cache"],
        k_cache_metadata=types.SimpleNamespace(slot_mapping=theirs["compressed_slot_mapping"]),
        pdl_kwargs={}, head_dim=HD, rope_head_dim=64, compress_ratio=CR, overlap=True, use_fp4_cache=use_fp4_cache,
        rms_norm_weight=theirs["norm_weight"], rms_norm_eps=1e-6, quant_block=32 if use_fp4_cache else 128,
        token_stride=HD // 2 if use_fp4_cache else HD, scale_dim=4,
    )  # fmt: skip
    IndexerKVCompressInsert()(
        ours["state_cache"], ours["block_table"], ours["token_to_req_indices"], ours["positions"],
        ours["slot_mapping"], ours["compressed_slot_mapping"], ours["norm_weight"], ours["cos_sin_cache"],
        ours["kv_cache"], 1e-6, compress_ratio=CR, mx_scale=mx_scale, use_fp4_cache=use_fp4_cache,
    )  # fmt: skip
    page1, before = theirs["kv_cache"][1].reshape(-1), args["kv_cache"][1].reshape(-1)
    # the zero K (token 16 at slot 127): codes +-0 (RoPE can make -0), scales at the floors
    if use_fp4_cache:  # 6 * 2**-126: byte 1
        assert page1[63 * 64 : 64 * 64].bitwise_and(0x77).eq(0).all() and page1[64 * 64 + 63 * 4 :][:4].eq(1).all()
    else:  # 1e-4: 2**-22
        floor = (torch.tensor([105 * 0x01010101], dtype=I32) if mx_scale else torch.tensor([2.0**-22])).view(U8)
        assert page1[63 * 128 : 64 * 128].bitwise_and(0x7F).eq(0).all()
        assert torch.equal(page1[64 * 128 + 63 * 4 :][:4], floor)
    assert not torch.equal(page1, before)
    if not use_fp4_cache:  # token 12 (slot 3): a scale of at least 2 (byte >= 128)
        assert theirs["kv_cache"][0].reshape(-1)[64 * 128 + 3 * 4 + 3] >= (128 if mx_scale else 0x40)
    assert_same(_storage(ours["kv_cache"]), _storage(theirs["kv_cache"]), "indexer K cache bytes")


def test_compress_pool_equals_vllm() -> None:
    """``compress_pool`` (``models/deepseek_v4/amd/rocm.py`` → ``_compress_pool_kernel``), as
    ``DeepseekV4RocmMxfp4Compressor._compress_norm_rope_store`` calls it: ``num_tokens`` = the state slot
    mapping's length, the indexer cache's slot mapping ``[:num_tokens]``, ``pooled_k`` the first rows of the
    persistent ``[max_num_batched_tokens, 128]`` bf16 buffer. The whole buffer compared (rows of tokens that do
    not close a window, or have no indexer slot, keep their sentinel)."""
    rocm = _rocm_module()
    g = seeded(4)
    batch = _compressor_batch(g)
    n = batch["slot_mapping"].shape[0]
    args: dict[str, Any] = dict(
        state_cache=batch["state_cache"], token_to_req_indices=batch["token_to_req_indices"],
        positions=batch["positions"], kv_slot_mapping=batch["compressed_slot_mapping"][:n],
        block_table=batch["block_table"], pooled_k=torch.full((24, HD), -3.0, dtype=BF16),
    )  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    rocm.compress_pool(
        theirs["state_cache"], theirs["token_to_req_indices"], theirs["positions"], theirs["kv_slot_mapping"],
        theirs["block_table"], STATE_BS, theirs["pooled_k"][:n], 2 * HD, CR, True,
    )  # fmt: skip
    CompressPool()(
        ours["state_cache"], ours["token_to_req_indices"], ours["positions"], ours["kv_slot_mapping"],
        ours["block_table"], STATE_BS, ours["pooled_k"][:n], compress_ratio=CR,
    )  # fmt: skip
    assert theirs["pooled_k"][16].eq(0).all() and theirs["pooled_k"][12].ne(-3).all()  # the zero-state window
    assert_same(ours["pooled_k"], theirs["pooled_k"], "pooled_k")


@pytest.mark.parametrize(
    ("head_dim", "cr", "page_bs"), [(128, 4, 4), (512, 4, 4), (512, 128, 8)], ids=["indexer-c4", "c4", "c128"]
)
def test_save_partial_states_equals_vllm(head_dim: int, cr: int, page_bs: int) -> None:
    """``_SAVE_PARTIAL_STATES_KERNEL`` (``models/deepseek_v4/common/ops/save_partial_states.py`` →
    ``SavePartialStatesKernel``), as ``DeepseekCompressor.forward`` calls it: ``kv, score = kv_score.split``
    (column views, row stride ``2 * coff * hd``), ``state_width = state_cache.shape[-1] // 2``, the state cache a
    view of a wider pool; PAD slots (-1) and DP padding (a slot mapping shorter than the tokens) skip. The whole
    pool compared."""
    coff = 2 if cr == 4 else 1
    width, tokens = coff * head_dim, 7
    g = seeded(5)
    kv_score = torch.randn(tokens, 2 * width, generator=g)
    pool = torch.randn(6, page_bs, 2 * width + 4, generator=g)
    positions = torch.tensor([0, 1, 2, 3, 130, 7, 5], dtype=I64)
    slot_mapping = torch.tensor([5, 6, -1, 0, 2 * page_bs + 3, 4 * page_bs + page_bs - 1], dtype=I64)  # 6 < 7
    args: dict[str, Any] = dict(kv_score=kv_score, ape=torch.randn(cr, width, generator=g), positions=positions,
                                pool=pool, slot_mapping=slot_mapping)  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    for side in (theirs, ours):
        side["kv"], side["score"] = side["kv_score"].split([width, width], dim=-1)
        side["state_cache"] = side["pool"][:, :, : 2 * width]
    SAVE._SAVE_PARTIAL_STATES_KERNEL(
        kv=theirs["kv"], score=theirs["score"], ape=theirs["ape"], positions=theirs["positions"],
        state_cache=theirs["state_cache"], slot_mapping=theirs["slot_mapping"], block_size=page_bs,
        state_width=theirs["state_cache"].shape[-1] // 2, compress_ratio=cr, pdl_kwargs={},
    )  # fmt: skip
    SavePartialStates(head_size=width, compress_ratio=cr, state_block_size=page_bs)(
        ours["kv"], ours["score"], ours["ape"], ours["positions"], ours["slot_mapping"], ours["state_cache"]
    )
    assert not torch.equal(theirs["pool"], args["pool"])
    assert_same(ours["pool"], theirs["pool"], "state cache pool")


# -- the C4 indexer's Q: RoPE + FP8 / MXFP4 --------------------------------------------------------------------

H_IDX = 8  # index heads on this rank (64 in DSv4; only the grid depends on it)


def _index_q(g: torch.Generator, tokens: int) -> dict[str, Any]:
    """``q = wq_b(qr).view(T, H, 128)`` and ``weights_proj(hidden)``: per-head magnitudes 1e-6 .. 1e3, an
    all-zero head, a head whose amax sits below the 1e-4 floor."""
    mags = 10.0 ** torch.linspace(-6, 3, H_IDX)[torch.randperm(H_IDX, generator=g)]
    q = torch.randn(tokens, H_IDX, HD, generator=g) * mags[:, None]
    q[0, 1] = 0.0
    q[1, 2] = torch.randn(HD, generator=g) * 1e-6
    return dict(
        positions=torch.tensor([0, 5, 17, 31, 2][:tokens], dtype=I64), index_q=q.to(BF16),
        cos_sin_cache=_rope_cache(g, 32), index_weights=torch.randn(tokens, H_IDX, generator=g).to(BF16),
    )  # fmt: skip


_Q_PLATFORMS = {
    "cuda": _Platform(),  # CUDA without CuTeDSL: OCP e4m3fn, max 448
    "gfx950": _Platform(rocm=True),  # ROCm OCP: explicit fma in the rotation
    "gfx942": _Platform(rocm=True, fnuz=True),  # ROCm FNUZ: e4m3fnuz, vLLM's max 224, explicit fma
}


@pytest.mark.parametrize("platform", list(_Q_PLATFORMS))
def test_indexer_q_rope_quant_equals_vllm(platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_indexer_q_rope_quant`` (``models/deepseek_v4/common/ops/fused_indexer_q.py`` →
    ``FusedIndexerQRopeQuantTritonKernel``: CUDA without CuTeDSL, and ROCm), as ``DeepseekV4Indexer._q_rope_quant``
    calls it (``softmax_scale = 128**-0.5``, ``head_scale = n_head**-0.5``, ``use_fp4`` False). The FP8 Q bytes and
    the fp32 weights (q scale folded in) compared bitwise."""
    stand_in = _Q_PLATFORMS[platform]
    monkeypatch.setattr(INDEXER_Q, "current_platform", stand_in)
    g = seeded(6)
    args = _index_q(g, 5)
    theirs, ours = clones(**args), clones(**args)
    q_want, w_want = INDEXER_Q.fused_indexer_q_rope_quant(
        theirs["positions"], theirs["index_q"], theirs["cos_sin_cache"], theirs["index_weights"], HD**-0.5,
        64**-0.5, use_fp4=False,
    )  # fmt: skip
    q_got, w_got = IndexerQRopeQuant(num_heads=H_IDX)(
        ours["positions"], ours["index_q"], ours["cos_sin_cache"], ours["index_weights"], HD**-0.5, 64**-0.5,
        fp8_dtype=stand_in.fp8_dtype(), explicit_fma=stand_in.is_rocm(),
    )  # fmt: skip
    assert q_want.dtype == stand_in.fp8_dtype() and q_got.dtype == q_want.dtype
    assert_same(q_got.view(U8), q_want.view(U8), "indexer Q fp8 bytes")
    assert_same(w_got, w_want, "indexer weights (q scale folded)")


def test_indexer_q_rope_mxfp4_equals_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_indexer_q_rope_quant(..., use_fp4=True)`` (same module → ``FusedIndexerQRopeMxFp4TritonKernel``:
    CUDA SM10x without CuTeDSL), vLLM's PTX E2M1 conversion replaced by :func:`_cvt_rn_satfinite_e2m1x2`. Packed
    nibbles, the UE8M0 bytes (as the int32 ``[T, H]`` vLLM returns) and the fp32 weights compared bitwise."""
    monkeypatch.setattr(INDEXER_Q, "current_platform", _Platform())
    monkeypatch.setattr(INDEXER_Q, "_fp32x2_to_fp4x2", _cvt_rn_satfinite_e2m1x2)
    g = seeded(7)
    args = _index_q(g, 5)
    theirs, ours = clones(**args), clones(**args)
    (packed_want, scale_want), w_want = INDEXER_Q.fused_indexer_q_rope_quant(
        theirs["positions"], theirs["index_q"], theirs["cos_sin_cache"], theirs["index_weights"], HD**-0.5,
        64**-0.5, use_fp4=True,
    )  # fmt: skip
    (packed_got, scale_got), w_got = IndexerQRopeMxfp4(num_heads=H_IDX)(
        ours["positions"], ours["index_q"], ours["cos_sin_cache"], ours["index_weights"], HD**-0.5, 64**-0.5
    )
    assert int(scale_want[0, 1]) == 0x01010101  # the zero head: every block at the 6 * 2**-126 floor
    assert_same(packed_got, packed_want, "indexer Q MXFP4 nibbles")
    assert_same(scale_got, scale_want, "indexer Q UE8M0 scales")
    assert_same(w_got, w_want, "indexer weights")


# -- inverse RoPE + FP8 block quant of the attention output -------------------------------------------------------


@pytest.mark.parametrize(
    ("quantize", "tma_aligned_scales"), [(True, False), (True, True), (False, False)], ids=["sm90", "sm100", "bf16"]
)
def test_inv_rope_fp8_quant_equals_vllm(quantize: bool, tma_aligned_scales: bool) -> None:
    """``fused_inv_rope_fp8_quant`` (``models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py`` → the custom op
    ``vllm::fused_inv_rope_fp8_quant_kernel`` → ``FusedInvRopeFP8QuantKernel``), as ``deep_gemm_fp8_o_proj`` /
    the XPU backend call it: ``o [T, H, 512]``, ``n_groups``, ``heads_per_group``, 448 + 64, group 128; T = 5
    (TMA padding rows 5..7 get zero scales). Values (fp8 bytes, or bf16) and every element of the scale storage
    compared bitwise. A block of token 4 has an fp32 amax one ulp above 448 * 2**-9 (after the inverse rotation:
    ``cos`` made that value), where vLLM's ``ceil(log2(amax * (1/448)))`` in fp32 gives -9, not the exact -8;
    an all-zero head takes the 1e-10 floor; a head of values past 448 has scale bytes >= 128."""
    g = seeded(8)
    tokens, n_groups, hpg = 5, 2, 8
    o = (torch.randn(tokens, n_groups * hpg, 512, generator=g) * 3).to(BF16)
    o[1, 3] = 0.0
    o[2, 5] *= 1000  # scales past 1: UE8M0 bytes >= 128, the sm100 word's top byte sets its sign bit
    cos_sin = _rope_cache(g, 40)
    positions = torch.tensor([0, 7, 39, 12, 33], dtype=I64)
    o[4, 0] = 0.0
    o[4, 0, 448] = 1.0  # block 3 of head 0: its amax is cos[33, 0] after the rotation
    cos_sin[33, 0] = float(np.nextafter(np.float32(0.875), np.float32(1.0)))  # 448 * 2**-9 * (1 + 2**-23)
    cos_sin[33, 32] = 0.0
    args: dict[str, Any] = dict(o=o, positions=positions, cos_sin_cache=cos_sin)
    theirs, ours = clones(**args), clones(**args)
    out_want, scale_want = INV_ROPE.fused_inv_rope_fp8_quant(
        theirs["o"], theirs["positions"], theirs["cos_sin_cache"], n_groups=n_groups, heads_per_group=hpg,
        nope_dim=448, rope_dim=64, quant_group_size=128, tma_aligned_scales=tma_aligned_scales, quantize=quantize,
    )  # fmt: skip
    out_got, scale_got = InvRopeFP8Quant(num_heads=n_groups * hpg, n_groups=n_groups)(
        ours["o"], ours["positions"], ours["cos_sin_cache"], n_groups, quantize=quantize,
        tma_aligned_scales=tma_aligned_scales, launch_pdl=False,
    )  # fmt: skip
    assert out_got.shape == out_want.shape and out_got.stride() == out_want.stride()
    if not quantize:
        assert scale_got is None and scale_want.numel() == 0
        assert_same(out_got, out_want, "bf16 output")
        return
    assert_same(out_got.view(U8), out_want.view(U8), "fp8 output")
    assert scale_got is not None and scale_got.shape == scale_want.shape and scale_got.stride() == scale_want.stride()
    if tma_aligned_scales:
        assert int(scale_want[2, 0, 5]) < 0  # token 2, head 5: block 3's byte >= 128
    assert_same(_storage(scale_got), _storage(scale_want), "scale storage (padding rows included)")


# -- MTP norms ------------------------------------------------------------------------------------------------------


def _rms_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The recipe both kernels implement, in torch (fp32: x * rsqrt(mean(x^2) + eps) * w, one cast)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


# Both kernels against torch: the interpreter's sum (numpy's pairwise order over the padded row) and 1/sqrt
# (two roundings) differ from torch's mean and rsqrt in the last fp32 bits, so an output can land one bf16
# step apart when its fp32 value sits next to a rounding boundary; never more.
_TORCH_ULPS = 1


@pytest.mark.parametrize("hidden", [4096, 200], ids=["flash", "odd-hidden"])
def test_mtp_input_rmsnorm_equals_vllm(hidden: int) -> None:
    """``_FUSED_MTP_INPUT_RMSNORM_KERNEL`` (``models/deepseek_v4/common/ops/fused_mtp_input_rmsnorm.py`` →
    ``FusedMTPInputRMSNormKernel``), as the MTP draft's ``forward`` calls it (``nvidia/mtp.py``, same on amd/xpu):
    ``inputs_embeds [T, H]``, positions (rows at position 0 masked to zero), the target's residual viewed
    ``[T, hc_mult, H]``, the two weights, ``eps``, ``hc_mult``. Both outputs bitwise; both within 1 bf16 ulp of
    torch."""
    g = seeded(9)
    tokens, hc = 3, 4
    args: dict[str, Any] = dict(
        inputs_embeds=torch.randn(tokens, hidden, generator=g).to(BF16),
        positions=torch.tensor([0, 7, 1], dtype=I64),
        previous_hidden_states=(torch.randn(tokens, hc * hidden, generator=g) * 5).to(BF16).view(tokens, hc, hidden),
        enorm_weight=(torch.rand(hidden, generator=g) + 0.5).to(BF16),
        hnorm_weight=(torch.rand(hidden, generator=g) + 0.5).to(BF16),
    )  # fmt: skip
    args["inputs_embeds"][0, :5] = float("nan")  # masked at position 0: zero whatever it held
    theirs, ours = clones(**args), clones(**args)
    e_want, h_want = MTP._FUSED_MTP_INPUT_RMSNORM_KERNEL(
        theirs["inputs_embeds"], theirs["positions"], theirs["previous_hidden_states"], theirs["enorm_weight"],
        theirs["hnorm_weight"], 1e-6, hc,
    )  # fmt: skip
    e_got, h_got = MTPInputRMSNorm(hidden=hidden, hc_mult=hc)(
        ours["inputs_embeds"], ours["positions"], ours["previous_hidden_states"], ours["enorm_weight"],
        ours["hnorm_weight"], 1e-6,
    )  # fmt: skip
    assert e_want[0].eq(0).all()
    assert_same(e_got, e_want, "enorm_out")
    assert_same(h_got, h_want, "hnorm_out")
    embeds = torch.where(args["positions"][:, None] == 0, 0.0, args["inputs_embeds"].float()).to(BF16)
    for got, want, what in (
        (e_got, _rms_torch(embeds, args["enorm_weight"], 1e-6), "enorm_out vs torch"),
        (h_got, _rms_torch(args["previous_hidden_states"], args["hnorm_weight"], 1e-6), "hnorm_out vs torch"),
    ):
        assert_within_ulps(got, want, _TORCH_ULPS, what)


@pytest.mark.parametrize("hidden", [4096, 200], ids=["flash", "odd-hidden"])
def test_mtp_shared_head_rmsnorm_equals_vllm(hidden: int) -> None:
    """``_MTP_SHARED_HEAD_RMSNORM_KERNEL`` (same module → ``MTPSharedHeadRMSNormKernel``), as the MTP draft's
    ``compute_logits`` calls it: ``hidden_states [T, H]`` after ``hc_head``, ``shared_head.norm`` weight and
    eps. Bitwise; within 1 bf16 ulp of torch."""
    g = seeded(10)
    x = (torch.randn(4, hidden, generator=g) * 3).to(BF16)
    x[2] = 0.0  # a zero row: rsqrt(eps) * 0
    w = (torch.rand(hidden, generator=g) + 0.5).to(BF16)
    want = MTP._MTP_SHARED_HEAD_RMSNORM_KERNEL(x.clone(), w.clone(), 1e-6)
    got = MTPSharedHeadRMSNorm(hidden=hidden)(x.clone(), w.clone(), 1e-6)
    assert_same(got, want, "shared-head norm")
    assert_within_ulps(got, _rms_torch(x, w, 1e-6), _TORCH_ULPS, "shared-head norm vs torch")
