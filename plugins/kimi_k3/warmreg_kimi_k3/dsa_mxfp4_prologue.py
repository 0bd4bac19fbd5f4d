"""The fused prologue of a Kimi-K3.1 DSA layer on an MXFP4 indexer cache: the q_a and kv_a RMSNorms, the fp8_ds_mla
insert of ``[kv_c_normed | k_pe]``, the indexer key's LayerNorm + MXFP4 insert and the -1 fill of the top-k rows,
in one launch (vLLM 0.34 ``models/kimi_k3/nvidia/ops/dsa_indexer_mxfp4.py``: ``mxfp4_fused_prologue`` ->
``_mxfp4_fused_prologue_kernel``, whose programs 1-3 run ``dsa_indexer._dsa_fused_prologue_kernel``'s code).

Grid ``(T, 4)`` for the step's ``T`` rows (``T = q_c.shape[0]``), one token a program, in fp32::

    (t, 0): the indexer key of row t into index_cache, as :mod:`.dsa_mxfp4_k_insert` (LayerNorm, rounded to the
            key's dtype, MXFP4; slot index_slot_mapping[t], none when negative or t past the mapping)
    (t, 1): y = dtype(kv_c[t] * rsqrt(mean(kv_c[t]**2) + eps) * kv_norm_weight);  kv_out[t] = y
            with s = mla_slot_mapping[t] >= 0, the fp8_ds_mla entry of slot s (656 bytes for 512 + 64):
              scale_i = 2**ceil(log2(max(amax(y[128 i : 128 (i+1)]) / 448, 1e-4)))   per tile of 128 values
              entry = [e4m3fn(y / scale) (KV bytes) | float32 scale_i (4 per tile) | bfloat16 k_pe[t] (2 per value)]
    (t, 2): q_out[t] = dtype(q_c[t] * rsqrt(mean(q_c[t]**2) + eps) * q_norm_weight)
    (t, 3): topk_indices_buffer[t, :] = -1

Returns ``(q_out [T, Q], kv_out [T, KV])`` (contiguous, the inputs' dtypes). The caches are uint8 ``[blocks, B,
entry]`` (``index_cache``'s entry :func:`._mxfp4.entry_bytes`), possibly strided page views of a packed cache;
a slot ``s`` is entry ``s % B`` of block ``s // B``. ``None`` for a cache and its slot mapping (profile runs) skips
that insert: as vLLM, a one-entry placeholder with an empty int64 slot mapping stands in, so the binary is the same.
e4m3fn bytes and the bf16 roundings are formed from the bits (round to nearest even, saturating), which is what the
GPU's ``cvt.rn`` gives and what Triton's interpreter does not; the scales are vLLM's fp32 operations.

Where it runs: ``KimiK3DSAAttention._fused_attention`` (``models/kimi_k3/nvidia/dsa.py``) on every DSA layer of
every step, when the indexer keys are MXFP4 (``use_fp4_cache``: ``kimi_k3_indexer_uses_fp4``,
``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` on SM10x) and ``pack_projections`` packed the layer's
projections (:attr:`.dsa.DSALayout.fused_prologue`); otherwise :mod:`.dsa_mxfp4_k_insert` inserts the key.

Key: the dtypes, the widths (``Q``, its power-of-two tile, ``KV``, the RoPE and index dims), the top-k width and
tile, PDL (``USE_PDL`` and the launch option: vLLM's ``is_arch_support_pdl()``, SM >= 90) and vLLM's default four
warps. No integer is specialized and no pointer on its alignment: one binary serves every batch and cache layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from ._mxfp4 import entry_bytes, fill_row, layer_norm_mxfp4_insert, round_to
from .dsa import dsa_layout
from .dsa_mxfp4_k_insert import (
    check_key_rows,
    check_mxfp4_cache,
    check_norm,
    check_slots,
    check_topk_buffer,
    mxfp4_key_insert_reference,
    topk_block,
)
from .model import KimiK3, local_pdl

__all__ = [
    "FP8_MAX",
    "MLA_TILE",
    "MXFP4Prologue",
    "MXFP4PrologueKey",
    "e4m3fn_bits",
    "e4m3fn_reference",
    "fp8_ds_mla_entry_bytes",
    "fp8_ds_mla_insert_reference",
    "mxfp4_prologue_reference",
    "register",
]

#: e4m3fn's largest finite value (vLLM's ``_FP8_MAX`` on CUDA).
FP8_MAX = 448.0
#: Latent values per fp8_ds_mla scale.
MLA_TILE = 128
_INTS = [
    "q_c_stride", "kv_c_stride", "k_pe_stride", "index_k_stride", "num_mla_slots", "mla_block_size",
    "mla_block_stride", "mla_entry_stride", "num_index_slots", "index_block_size", "index_block_stride", "topk_stride",
]  # fmt: skip
_POINTERS = [
    "q_c_ptr", "q_w_ptr", "q_out_ptr", "kv_c_ptr", "kv_w_ptr", "kv_out_ptr", "k_pe_ptr", "index_k_ptr", "k_w_ptr",
    "k_b_ptr", "mla_slot_ptr", "mla_u8_ptr", "mla_f32_ptr", "mla_bf16_ptr", "index_slot_ptr", "index_cache_ptr",
    "topk_ptr",
]  # fmt: skip
_ACTIVATIONS = (torch.bfloat16, torch.float16)


def fp8_ds_mla_entry_bytes(kv_dim: int, rope_dim: int) -> int:
    """Bytes of an fp8_ds_mla entry: ``kv_dim`` e4m3fn values, a float32 scale per 128 of them, ``rope_dim`` bf16
    values (656 for 512 + 64)."""
    return kv_dim + 4 * (kv_dim // MLA_TILE) + 2 * rope_dim


@triton.jit
def e4m3fn_bits(v):
    """The e4m3fn byte (uint8) of fp32 ``v``: round to nearest even, saturating at +-448 (``cvt.rn.satfinite``),
    subnormals included, NaN to 0x7F with its sign."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # [2**-6, inf): round the 23-bit mantissa to 3 bits, nearest even, then rebias the exponent from 127 to 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # [0, 2**-6): multiples of 2**-9; 2**14's fp32 ulp is 2**-9, so adding it rounds to one (nearest even)
    subnormal = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.minimum(tl.where(bits < 0x3C800000, subnormal, normal), 0x7E)
    code = tl.where(v != v, 0x7F, code)
    return (code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, eps, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """``x * rsqrt(mean(x**2) + eps) * w`` of one row in fp32 (vLLM's ``_rms_norm_row`` order)."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < SIZE, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < SIZE, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / SIZE + eps) * w


@triton.jit
def _kv_norm_insert(
    tok, kv_c_ptr, kv_w_ptr, kv_out_ptr, k_pe_ptr, eps, slot_ptr, num_slots, u8_ptr, f32_ptr, bf16_ptr, block_size,
    block_stride, entry_stride, KV_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
):  # fmt: skip
    """kv_a RMSNorm of row ``tok`` into ``kv_out`` and, with a slot, its fp8_ds_mla entry (the module docstring)."""
    offs = tl.arange(0, KV_DIM)
    y = round_to(_rms_norm_row(kv_c_ptr, kv_w_ptr, eps, KV_DIM, KV_DIM), kv_out_ptr.dtype.element_ty)
    tl.store(kv_out_ptr + tok * KV_DIM + offs, y.to(kv_out_ptr.dtype.element_ty))  # exact: y is rounded
    slot = tl.load(slot_ptr + tok, mask=tok < num_slots, other=-1)
    if slot >= 0:
        base = (slot // block_size) * block_stride + (slot % block_size) * entry_stride  # bytes
        NUM_TILES: tl.constexpr = KV_DIM // 128
        tiles = tl.reshape(y, (NUM_TILES, 128))
        amax = tl.max(tl.abs(tiles), axis=1, keep_dims=True)
        scale = tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(amax / 448.0, 1e-4))))
        tl.store(u8_ptr + base + offs, tl.reshape(e4m3fn_bits(tiles / scale), (KV_DIM,)))
        tl.store(f32_ptr + base // 4 + KV_DIM // 4 + tl.arange(0, NUM_TILES), tl.reshape(scale, (NUM_TILES,)))
        rope = tl.arange(0, ROPE_DIM)
        k_pe = round_to(tl.load(k_pe_ptr + rope).to(tl.float32), tl.bfloat16).to(tl.bfloat16)  # exact for bf16 k_pe
        tl.store(bf16_ptr + base // 2 + KV_DIM // 2 + 2 * NUM_TILES + rope, k_pe)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _mxfp4_prologue_kernel(
    q_c_ptr, q_c_stride, q_w_ptr, q_out_ptr,
    kv_c_ptr, kv_c_stride, kv_w_ptr, kv_out_ptr, k_pe_ptr, k_pe_stride,
    index_k_ptr, index_k_stride, k_w_ptr, k_b_ptr, eps,
    mla_slot_ptr, num_mla_slots, mla_u8_ptr, mla_f32_ptr, mla_bf16_ptr,  # one cache: its bytes, floats and bf16s
    mla_block_size, mla_block_stride, mla_entry_stride,  # in bytes
    index_slot_ptr, num_index_slots, index_cache_ptr, index_block_size, index_block_stride,
    topk_ptr, topk_stride,
    Q_DIM: tl.constexpr,  # q_lora_rank
    Q_BLOCK: tl.constexpr,  # next_pow2(Q_DIM): one tile a row
    KV_DIM: tl.constexpr,  # kv_lora_rank: a power of two, whole 128-value tiles
    ROPE_DIM: tl.constexpr,  # qk_rope_head_dim: the k_pe values of an entry
    INDEX_DIM: tl.constexpr,  # index_head_dim
    TOPK: tl.constexpr,  # index_topk
    TOPK_BLOCK: tl.constexpr,  # min(1024, next_pow2(TOPK))
    USE_PDL: tl.constexpr,  # wait for the previous kernel first; matches the launch option launch_pdl
):  # fmt: skip
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        layer_norm_mxfp4_insert(
            tok, index_k_ptr + tok * index_k_stride, k_w_ptr, k_b_ptr, eps, index_slot_ptr, num_index_slots,
            index_cache_ptr, index_block_size, index_block_stride, INDEX_DIM,
        )  # fmt: skip
    elif part == 1:
        _kv_norm_insert(
            tok, kv_c_ptr + tok * kv_c_stride, kv_w_ptr, kv_out_ptr, k_pe_ptr + tok * k_pe_stride, eps, mla_slot_ptr,
            num_mla_slots, mla_u8_ptr, mla_f32_ptr, mla_bf16_ptr, mla_block_size, mla_block_stride, mla_entry_stride,
            KV_DIM, ROPE_DIM,
        )  # fmt: skip
    elif part == 2:
        offs = tl.arange(0, Q_BLOCK)
        y = round_to(
            _rms_norm_row(q_c_ptr + tok * q_c_stride, q_w_ptr, eps, Q_DIM, Q_BLOCK), q_out_ptr.dtype.element_ty
        )
        tl.store(q_out_ptr + tok * Q_DIM + offs, y.to(q_out_ptr.dtype.element_ty), mask=offs < Q_DIM)
    else:
        fill_row(topk_ptr + tok * topk_stride, TOPK, TOPK_BLOCK)


@attrs.frozen(kw_only=True)
class MXFP4PrologueKey(warmreg.CompileKey):
    """What changes the binary of the MXFP4 DSA prologue: dtypes, widths, PDL; no size, stride or alignment."""

    q_dtype: str  # q_c and q_out
    kv_dtype: str  # kv_c and kv_out
    rope_dtype: str  # k_pe
    index_k_dtype: str
    q_norm_dtype: str
    kv_norm_dtype: str
    k_norm_dtype: str  # the key LayerNorm's weight and bias
    mla_slot_dtype: str
    index_slot_dtype: str
    topk_dtype: str
    q_dim: int
    q_block: int
    kv_dim: int
    rope_dim: int
    index_dim: int
    topk: int
    topk_block: int
    launch_pdl: bool  # USE_PDL and the launch option
    num_warps: int


class MXFP4Prologue(warmreg.TritonKernel[MXFP4PrologueKey]):
    """The MXFP4 DSA layer prologue (the module docstring has the math).

    :param q_dim: ``text.q_lora_rank`` (domains only).
    :param kv_dim: ``text.kv_lora_rank`` (domains only).
    :param rope_dim: ``text.qk_rope_head_dim`` (domains only).
    :param index_dim: ``dsa_config.index_head_dim`` (domains only).
    :param topk: ``dsa_config.index_topk`` (domains only).
    :param dtype: the activations' dtype, the model's (domains only).
    """

    name = "kimi_k3.dsa_mxfp4_prologue"
    key_type = MXFP4PrologueKey
    jit = _mxfp4_prologue_kernel

    def __init__(
        self, *, q_dim: int = 1536, kv_dim: int = 512, rope_dim: int = 64, index_dim: int = 128, topk: int = 2048,
        dtype: str = "bfloat16",
    ) -> None:  # fmt: skip
        self.q_dim, self.kv_dim, self.rope_dim, self.index_dim = q_dim, kv_dim, rope_dim, index_dim
        self.topk, self.dtype = topk, dtype

    def dispatch(
        self, *, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor,
        q_norm_weight: torch.Tensor, kv_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
        topk_indices_buffer: torch.Tensor, mla_slot_mapping: torch.Tensor | None,
        index_slot_mapping: torch.Tensor | None, launch_pdl: bool,
    ) -> MXFP4PrologueKey:  # fmt: skip
        def name(t: torch.Tensor | None) -> str:  # no cache: vLLM's int64 placeholder
            return warmreg.dtype_name(torch.int64 if t is None else t.dtype)

        topk = topk_indices_buffer.shape[-1]
        return MXFP4PrologueKey(
            q_dtype=warmreg.dtype_name(q_c.dtype), kv_dtype=warmreg.dtype_name(kv_c.dtype),
            rope_dtype=warmreg.dtype_name(k_pe.dtype), index_k_dtype=warmreg.dtype_name(index_k.dtype),
            q_norm_dtype=warmreg.dtype_name(q_norm_weight.dtype), kv_norm_dtype=warmreg.dtype_name(kv_norm_weight.dtype),
            k_norm_dtype=warmreg.dtype_name(k_norm_weight.dtype), mla_slot_dtype=name(mla_slot_mapping),
            index_slot_dtype=name(index_slot_mapping), topk_dtype=warmreg.dtype_name(topk_indices_buffer.dtype),
            q_dim=q_c.shape[1], q_block=warmreg.next_pow2(q_c.shape[1]), kv_dim=kv_c.shape[1], rope_dim=k_pe.shape[1],
            index_dim=index_k.shape[1], topk=topk, topk_block=topk_block(topk), launch_pdl=bool(launch_pdl), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        act = getattr(torch, self.dtype)
        return {  # sizes and strides are not in the key: one row of each
            "q_c": [warmreg.meta((1, self.q_dim), act)],
            "kv_c": [warmreg.meta((1, self.kv_dim), act)],
            "k_pe": [warmreg.meta((1, self.rope_dim), act)],
            "index_k": [warmreg.meta((1, self.index_dim), act)],
            "q_norm_weight": [warmreg.meta((self.q_dim,), act)],  # RMSNorm weights: the model's dtype
            "kv_norm_weight": [warmreg.meta((self.kv_dim,), act)],
            "k_norm_weight": [warmreg.meta((self.index_dim,), torch.float32)],  # KimiK3DSAIndexerKNorm: fp32
            "topk_indices_buffer": [warmreg.meta((1, self.topk), torch.int32)],
            "mla_slot_mapping": [warmreg.meta((1,), torch.int64)],  # int64 slots, and the no-cache placeholder
            "index_slot_mapping": [warmreg.meta((1,), torch.int64)],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: MXFP4PrologueKey) -> Mapping[str, Any]:
        def m(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
            return warmreg.meta(shape, getattr(torch, dtype))

        return {
            "q_c": m((1, key.q_dim), key.q_dtype), "kv_c": m((1, key.kv_dim), key.kv_dtype),
            "k_pe": m((1, key.rope_dim), key.rope_dtype), "index_k": m((1, key.index_dim), key.index_k_dtype),
            "q_norm_weight": m((key.q_dim,), key.q_norm_dtype), "kv_norm_weight": m((key.kv_dim,), key.kv_norm_dtype),
            "k_norm_weight": m((key.index_dim,), key.k_norm_dtype), "k_norm_bias": m((key.index_dim,), key.k_norm_dtype),
            "eps": 1e-5, "topk_indices_buffer": m((1, key.topk), key.topk_dtype),
            "mla_cache": m((1, 64, fp8_ds_mla_entry_bytes(key.kv_dim, key.rope_dim)), "uint8"),
            "mla_slot_mapping": m((1,), key.mla_slot_dtype),
            "index_cache": m((1, 64, entry_bytes(key.index_dim)), "uint8"),
            "index_slot_mapping": m((1,), key.index_slot_dtype), "launch_pdl": key.launch_pdl,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        q_c: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        index_k: torch.Tensor,
        q_norm_weight: torch.Tensor,
        kv_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor,
        k_norm_bias: torch.Tensor,
        eps: float,
        topk_indices_buffer: torch.Tensor,
        mla_cache: torch.Tensor | None,
        mla_slot_mapping: torch.Tensor | None,
        index_cache: torch.Tensor | None,
        index_slot_mapping: torch.Tensor | None,
        *,
        launch_pdl: bool | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[MXFP4PrologueKey]:
        """Run the prologue of the ``T = q_c.shape[0]`` rows (vLLM's ``mxfp4_fused_prologue``, same arguments).

        :param q_c: ``[T, Q]`` bf16 / fp16, unit last stride (a column view of the packed projection).
        :param kv_c: ``[T, KV]`` of the same dtype, unit last stride; ``KV`` a power of two, a multiple of 128.
        :param k_pe: ``[T, R]``, unit last stride (``R`` a power of two).
        :param index_k: ``[T, D]``, unit last stride (``D`` a power of two >= 32).
        :param q_norm_weight: ``[Q]``, unit stride; ``kv_norm_weight``: ``[KV]``, unit stride.
        :param k_norm_weight: ``[D]`` (fp32 in Kimi-K3.1), unit stride; ``k_norm_bias`` the same.
        :param eps: the epsilon of the three norms.
        :param topk_indices_buffer: int32 ``[rows >= T, topk]``, unit column stride.
        :param mla_cache: uint8 ``[blocks, B, KV + 4 KV/128 + 2 R]`` (any block and entry stride, multiples of 4
            bytes), or None with ``mla_slot_mapping`` (no MLA insert).
        :param mla_slot_mapping: int32 / int64 ``[S]``, unit stride.
        :param index_cache: uint8 ``[blocks, B, D/2 + D/32]`` with contiguous entries, or None (no key insert).
        :param index_slot_mapping: int32 / int64 ``[S]``, unit stride.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it, as vLLM decides).
        :param out: ``(q_out, kv_out)`` to write instead of fresh tensors: exactly the outputs below, contiguous,
            16-byte aligned.
        :returns: ``(q_out [T, Q], kv_out [T, KV])`` in the dtypes of ``q_c`` and ``kv_c``.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out``
            unlike the fresh outputs, naming the argument.
        """
        self._check(q_c, kv_c, k_pe, index_k, q_norm_weight, kv_norm_weight, k_norm_weight, k_norm_bias)
        t, dev = q_c.shape[0], q_c.device
        check_topk_buffer(self.name, topk_indices_buffer, t)
        mla, mla_slots = self._mla(mla_cache, mla_slot_mapping, kv_c.shape[1], k_pe.shape[1], dev)
        index, index_slots = self._index(index_cache, index_slot_mapping, index_k.shape[1], dev)
        launch_pdl = local_pdl(launch_pdl)
        key = self.dispatch(
            q_c=q_c, kv_c=kv_c, k_pe=k_pe, index_k=index_k, q_norm_weight=q_norm_weight, kv_norm_weight=kv_norm_weight,
            k_norm_weight=k_norm_weight, topk_indices_buffer=topk_indices_buffer, mla_slot_mapping=mla_slots,
            index_slot_mapping=index_slots, launch_pdl=launch_pdl,
        )  # fmt: skip
        if out is not None and (not isinstance(out, tuple) or len(out) != 2):
            raise warmreg.LaunchError(self.name, "out must be a tuple of 2 tensors (q_out, kv_out)")
        q_out = warmreg.output(self.name, "out[0]", out and out[0], (t, key.q_dim), q_c.dtype, dev)
        kv_out = warmreg.output(self.name, "out[1]", out and out[1], (t, key.kv_dim), kv_c.dtype, dev)
        kwargs = dict(
            q_c_ptr=q_c, q_c_stride=q_c.stride(0), q_w_ptr=q_norm_weight, q_out_ptr=q_out,
            kv_c_ptr=kv_c, kv_c_stride=kv_c.stride(0), kv_w_ptr=kv_norm_weight, kv_out_ptr=kv_out,
            k_pe_ptr=k_pe, k_pe_stride=k_pe.stride(0), index_k_ptr=index_k, index_k_stride=index_k.stride(0),
            k_w_ptr=k_norm_weight, k_b_ptr=k_norm_bias, eps=float(eps),
            mla_slot_ptr=mla_slots, num_mla_slots=mla_slots.shape[0], mla_u8_ptr=mla,
            mla_f32_ptr=mla.view(torch.float32), mla_bf16_ptr=mla.view(torch.bfloat16), mla_block_size=mla.shape[1],
            mla_block_stride=mla.stride(0), mla_entry_stride=mla.stride(1),
            index_slot_ptr=index_slots, num_index_slots=index_slots.shape[0], index_cache_ptr=index,
            index_block_size=index.shape[1], index_block_stride=index.stride(0),
            topk_ptr=topk_indices_buffer, topk_stride=topk_indices_buffer.stride(0),
            Q_DIM=key.q_dim, Q_BLOCK=key.q_block, KV_DIM=key.kv_dim, ROPE_DIM=key.rope_dim, INDEX_DIM=key.index_dim,
            TOPK=key.topk, TOPK_BLOCK=key.topk_block, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, 4) if t else None, kwargs, (q_out, kv_out))

    def _check(
        self, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor, q_w: torch.Tensor,
        kv_w: torch.Tensor, k_w: torch.Tensor, k_b: torch.Tensor,
    ) -> None:  # fmt: skip
        t = q_c.shape[0] if q_c.ndim == 2 else -1
        for arg, x in (("q_c", q_c), ("kv_c", kv_c), ("k_pe", k_pe)):
            if x.ndim != 2 or x.shape[0] != t or x.dtype not in _ACTIVATIONS or x.stride(1) != 1:
                raise warmreg.LaunchError(
                    self.name, f"{arg} must be bf16 or fp16 [T, width] with q_c's T = {t} rows and a unit last stride "
                    f"(got {x.dtype} {tuple(x.shape)}, strides {x.stride()})",
                )  # fmt: skip
        kv, rope = kv_c.shape[1], k_pe.shape[1]
        if kv % MLA_TILE or kv & (kv - 1) or rope & (rope - 1):
            raise warmreg.LaunchError(
                self.name, f"kv_c's width {kv} must be a power of two of whole {MLA_TILE}-value tiles and k_pe's "
                f"{rope} a power of two",
            )  # fmt: skip
        check_key_rows(self.name, "index_k", index_k)
        if index_k.shape[0] != t:
            raise warmreg.LaunchError(self.name, f"index_k has {index_k.shape[0]} rows, q_c {t}: one row a token")
        for arg, w, width in (("q_norm_weight", q_w, q_c.shape[1]), ("kv_norm_weight", kv_w, kv)):
            if w.shape != (width,) or not w.dtype.is_floating_point or w.stride(0) != 1:
                raise warmreg.LaunchError(
                    self.name, f"{arg} must be a float [{width}] with a unit stride (got {w.dtype} {tuple(w.shape)})"
                )
        check_norm(self.name, k_w, k_b, index_k.shape[1])
        devices = {x.device for x in (q_c, kv_c, k_pe, index_k, q_w, kv_w, k_w, k_b)}
        if len(devices) > 1:
            raise warmreg.LaunchError(self.name, f"inputs on {sorted(map(str, devices))}: use one device")

    def _mla(
        self, cache: torch.Tensor | None, slots: torch.Tensor | None, kv: int, rope: int, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is None or slots is None:  # vLLM's profile-run placeholder: the insert is off, the binary the same
            return torch.empty(1, 1, 4, dtype=torch.uint8, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
        width = fp8_ds_mla_entry_bytes(kv, rope)
        if (
            cache.ndim != 3 or cache.dtype != torch.uint8 or cache.shape[2] != width or cache.stride(2) != 1
            or cache.stride(0) % 4 or cache.stride(1) % 4 or cache.storage_offset() % 4
        ):  # fmt: skip
            raise warmreg.LaunchError(
                self.name, f"mla_cache must be uint8 [blocks, block_size, {width}] (fp8_ds_mla of {kv} + {rope}) "
                f"with a unit last stride and 4-byte aligned entries (got {cache.dtype} {tuple(cache.shape)}, strides "
                f"{cache.stride()}, offset {cache.storage_offset()})",
            )  # fmt: skip
        check_slots(self.name, "mla_slot_mapping", slots)
        if cache.device != dev or slots.device != dev:
            raise warmreg.LaunchError(self.name, f"mla_cache and mla_slot_mapping must be on {dev}")
        return cache, slots

    def _index(
        self, cache: torch.Tensor | None, slots: torch.Tensor | None, d: int, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is None or slots is None:
            placeholder = torch.empty(1, 1, entry_bytes(d), dtype=torch.uint8, device=dev)
            return placeholder, torch.empty(0, dtype=torch.int64, device=dev)
        check_mxfp4_cache(self.name, "index_cache", cache, d)
        check_slots(self.name, "index_slot_mapping", slots)
        if cache.device != dev or slots.device != dev:
            raise warmreg.LaunchError(self.name, f"index_cache and index_slot_mapping must be on {dev}")
        return cache, slots


def e4m3fn_reference(x: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8) of fp32 ``x`` as torch converts them, saturated at +-448 first (``satfinite``)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def mxfp4_prologue_reference(
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    index_k: torch.Tensor,
    q_norm_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    k_norm_bias: torch.Tensor,
    eps: float,
    topk_indices_buffer: torch.Tensor,
    mla_cache: torch.Tensor | None,
    mla_slot_mapping: torch.Tensor | None,
    index_cache: torch.Tensor | None,
    index_slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`MXFP4Prologue`: writes the caches and the top-k rows in place and returns
    ``(q_out, kv_out)``. The norms are torch's fp32 arithmetic (not the kernel's summation order)."""
    t = q_c.shape[0]
    q_out, kv_out = _rms_norm_reference(q_c, q_norm_weight, eps), _rms_norm_reference(kv_c, kv_norm_weight, eps)
    if index_cache is not None and index_slot_mapping is not None:
        mxfp4_key_insert_reference(
            index_k, k_norm_weight, k_norm_bias, eps, index_slot_mapping, index_cache, topk_indices_buffer, t
        )
    topk_indices_buffer[:t] = -1
    if mla_cache is not None and mla_slot_mapping is not None:
        fp8_ds_mla_insert_reference(kv_out, k_pe, mla_slot_mapping, mla_cache)
    return q_out, kv_out


def fp8_ds_mla_insert_reference(
    kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor, mla_cache: torch.Tensor
) -> torch.Tensor:
    """The fp8_ds_mla entries of the normed latents ``kv [T, KV]`` and ``k_pe [T, R]`` written into ``mla_cache``
    at ``slot_mapping`` (rows past it or with a negative slot skipped), in place; returns ``mla_cache``."""
    tiles = kv.float().unflatten(-1, (-1, MLA_TILE))
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / torch.tensor(FP8_MAX), min=1e-4))))
    values = e4m3fn_reference(tiles / scale).flatten(-2)
    scales = scale.squeeze(-1).contiguous().view(torch.uint8)  # [T, 4 * tiles]: the float32 bytes
    rope_bytes = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    bs = mla_cache.shape[1]
    for i in range(min(kv.shape[0], slot_mapping.shape[0])):
        slot = int(slot_mapping[i])
        if slot >= 0:
            mla_cache[slot // bs, slot % bs] = torch.cat([values[i], scales[i], rope_bytes[i]])
    return mla_cache


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MXFP4 prologue where vLLM runs it: DSA layers with MXFP4 indexer keys whose projections are
    packed (:attr:`.dsa.DSALayout.fused_prologue`; ``KimiK3DSAAttention._fused_attention``).

    :raises warmreg.ConfigError: for a malformed ``dsa_config``, a ``serving.indexer_kv_dtype`` vLLM refuses, or a
        missing MLA field.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or not layout.indexer_fp4 or not layout.fused_prologue or layout.q_lora_rank is None:
        return
    kernel = MXFP4Prologue(
        q_dim=layout.q_lora_rank, kv_dim=layout.kv_lora_rank, rope_dim=layout.qk_rope_head_dim,
        index_dim=layout.index_head_dim, topk=layout.index_topk, dtype=layout.dtype,
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
