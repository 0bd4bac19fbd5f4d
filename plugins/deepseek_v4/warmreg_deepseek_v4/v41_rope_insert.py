"""DeepSeek-V4.1's compressed-cache insert: GPT-J RoPE on the latent's last 64 dims, then the cache's record (vLLM
0.34 ``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``: ``rope_quant_insert`` and its kernels
``_rope_quant_insert_kernel``, ``_rope_quant_insert_mxfp8_kernel``, ``_rope_quant_insert_nvfp4_kernel``,
``_rope_plain_insert_kernel``; launched by ``DeepseekCompressor.insert_cache``).

For token ``t < T`` (``T = slot_mapping.numel()``) with ``s = slot_mapping[t] >= 0`` and ``p = positions[t]`` a
group end (``(p + 1) % R == 0``), ``x`` the bf16 latent row read as fp32, ``q = p // R * R`` and
``c_i, s_i = cos_sin[q, i], cos_sin[q, 32 + i]``::

    y = x, but y[448 + 2i], y[449 + 2i] = x_e c_i - x_o s_i, x_o c_i + x_e s_i        (i < 32: RoPE, interleaved)
    page, j = s // block_size, s % block_size          (cache [blocks, block_size, width], page stride stride(0))

and by record (:func:`._v41.compressed_record`), ``e(v) = ceil(log2(max(v, 1e-4) / 448))`` the UE8M0 exponent::

    fp8_ds_mla (584 B): bytes j*576 + [0, 448) = e4m3(x_k / 2^e_k) per 64-dim block k < 7 (NoPE, unrotated),
                        j*576 + [448, 576) = bf16(y[448:]); scales block_size*576 + 8j + k = e_k + 127, byte 7 = 0
    mxfp8 (528 B):      j*528 + [0, 512) = e4m3(y_k / 2^e_k) per 32-dim block k < 16; j*528 + 512 + k = e_k + 127
    nvfp4 (288 B):      per 16-dim block k < 32: sc_k = e4m3(clamp(amax_k / 6, 2^-9, 448));
                        j*288 + [0, 256) = e2m1 pairs of y_k / sc_k (even dim low nibble); j*288 + 256 + k = sc_k
    bfloat16 / fp8:     row j of the page = bf16(y), or e4m3(clamp(bf16(y) / fp8_scale, +-448))  (plain [512] rows)

Scales are clamped to ``[0, 255]``; values to ``+-448`` before the e4m3 cast. One program per token, four warps, no
PDL on CUDA, as in vLLM. E2M1 is :func:`._mxfp4.e2m1_code` (round to nearest even, saturating), the portable
form of vLLM's inline PTX ``cvt.rn.satfinite.e2m1x2.f32``; NaN, which a normed latent does not hold, gives 0.
The ROCm gfx950 NaN sanitizing (``SANITIZE_CACHE_NANS``) is not reproduced: these ops are planned on CUDA only.

Key: the record (it picks the kernel, :meth:`V41RopeInsert.jit_for`) and ``R``. Unlike vLLM (constexprs), the
cos/sin row stride, the page stride, the row stride and ``block_size`` are unspecialized runtime ints, and the
scalar-read vectors are not specialized on alignment: one binary serves every page layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._mxfp4 import e2m1_code
from ._v41 import RECORDS, check_index_vector, compressed_record, v41_register_predicate
from .model import DSV4

__all__ = ["V41RopeInsert", "V41RopeInsertKey", "record_of", "register", "v41_rope_reference"]

_INTS = ["cos_stride", "page_stride", "row_stride", "block_size"]
_SCALARS = ["positions_ptr", "slots_ptr", "scale_ptr"]


@triton.jit
def _rope(latent_ptr, t, p, cos_ptr, cos_stride, R: tl.constexpr):
    """``(x, y)``: token t's fp32 latent and its RoPE (position p's group start)."""
    x = tl.load(latent_ptr + t.to(tl.int64) * 512 + tl.arange(0, 512)).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (256, 2)))
    pair = tl.arange(0, 256) - 224  # NoPE pairs load (cos, sin) = (1, 0): the identity
    cs = cos_ptr + (p // R * R) * cos_stride
    c = tl.load(cs + tl.maximum(pair, 0), pair >= 0, other=1.0).to(tl.float32)
    s = tl.load(cs + 32 + tl.maximum(pair, 0), pair >= 0, other=0.0).to(tl.float32)
    return x, tl.interleave(even * c - odd * s, odd * c + even * s)


@triton.jit
def _ue8m0(blocks, N: tl.constexpr):
    """Per row of ``blocks``: ``(exponent e, fp8 bytes of block / 2^e)``, e = ceil(log2(max(amax, 1e-4) / 448))."""
    e = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(blocks), 1), 1e-4) * (1.0 / 448.0)))
    q = tl.clamp(blocks * tl.reshape(tl.exp2(-e), (N, 1)), -448.0, 448.0).to(tl.float8e4nv)
    return e, q.to(tl.uint8, bitcast=True)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALARS)
def _v41_rope_fp8_ds_mla_kernel(
    latent_ptr, positions_ptr, cos_ptr, cache_ptr, slots_ptr, scale_ptr, cos_stride, page_stride, row_stride,
    block_size, R: tl.constexpr,  # the compress ratio: which positions end a group
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        x, y = _rope(latent_ptr, t, p, cos_ptr, cos_stride, R)
        _, y = _rope(latent_ptr, t, p, cos_ptr, cos_stride, R)
        d = tl.arange(0, 512)
        page = cache_ptr + (slot // block_size).to(tl.int64) * page_stride
        values = page + (slot % block_size) * 576
        e, q = _ue8m0(tl.reshape(x, (8, 64)), 8)
        tl.store(values + d, tl.reshape(q, (512,)), d < 448)
        k = tl.arange(0, 8)
        sc = tl.minimum(tl.maximum(e + 127.0, 0.0), 255.0).to(tl.uint8)
        tl.store(page + block_size * 576 + (slot % block_size) * 8 + k, tl.where(k < 7, sc, 0))
        tl.store((values + 448).to(tl.pointer_type(tl.bfloat16)) + d - 448, y.to(tl.bfloat16), d >= 448)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALARS)
def _v41_rope_mxfp8_kernel(
    latent_ptr, positions_ptr, cos_ptr, cache_ptr, slots_ptr, scale_ptr, cos_stride, page_stride, row_stride,
    block_size, R: tl.constexpr,  # the compress ratio: which positions end a group
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        _, y = _rope(latent_ptr, t, p, cos_ptr, cos_stride, R)
        values = cache_ptr + (slot // block_size).to(tl.int64) * page_stride + (slot % block_size) * 528
        e, q = _ue8m0(tl.reshape(y, (16, 32)), 16)
        tl.store(values + tl.arange(0, 512), tl.reshape(q, (512,)))
        tl.store(values + 512 + tl.arange(0, 16), tl.minimum(tl.maximum(e + 127.0, 0.0), 255.0).to(tl.uint8))


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALARS)
def _v41_rope_nvfp4_kernel(
    latent_ptr, positions_ptr, cos_ptr, cache_ptr, slots_ptr, scale_ptr, cos_stride, page_stride, row_stride,
    block_size, R: tl.constexpr,  # the compress ratio: which positions end a group
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        _, y = _rope(latent_ptr, t, p, cos_ptr, cos_stride, R)
        tiles = tl.reshape(y, (32, 16))
        sc = tl.clamp(tl.max(tl.abs(tiles), 1) * (1.0 / 6.0), 0.001953125, 448.0).to(tl.float8e4nv)
        scaled = tl.math.div_rn(tiles, tl.reshape(sc.to(tl.float32), (32, 1)))  # RN: exact e2m1 ties
        lo, hi = tl.split(tl.reshape(tl.reshape(scaled, (512,)), (256, 2)))
        values = cache_ptr + (slot // block_size).to(tl.int64) * page_stride + (slot % block_size) * 288
        tl.store(values + tl.arange(0, 256), (e2m1_code(lo) | (e2m1_code(hi) << 4)).to(tl.uint8))
        tl.store(values + 256 + tl.arange(0, 32), sc.to(tl.uint8, bitcast=True))


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALARS)
def _v41_rope_plain_kernel(
    latent_ptr, positions_ptr, cos_ptr, cache_ptr, slots_ptr, scale_ptr, cos_stride, page_stride, row_stride,
    block_size, R: tl.constexpr,  # the compress ratio: which positions end a group
    STORE_FP8: tl.constexpr,  # per-tensor FP8 rows (scale_ptr), else bf16 rows
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        _, y = _rope(latent_ptr, t, p, cos_ptr, cos_stride, R)
        d = tl.arange(0, 512)
        row = y.to(tl.bfloat16)
        dst = cache_ptr + (slot // block_size).to(tl.int64) * page_stride + (slot % block_size) * row_stride
        if STORE_FP8:
            scaled = row.to(tl.float32) * (1.0 / tl.load(scale_ptr))
            tl.store(dst + d, tl.clamp(scaled, -448.0, 448.0).to(tl.float8e4nv))
        else:
            tl.store(dst + d, row)


_JITS = {
    "fp8_ds_mla": _v41_rope_fp8_ds_mla_kernel,
    "mxfp8": _v41_rope_mxfp8_kernel,
    "nvfp4": _v41_rope_nvfp4_kernel,
    "bfloat16": _v41_rope_plain_kernel,
    "fp8": _v41_rope_plain_kernel,
}
_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@attrs.frozen(kw_only=True)
class V41RopeInsertKey(warmreg.CompileKey):
    """What changes the binary of V4.1's compressed-cache insert."""

    record: str  # a key of _v41.RECORDS: the kernel
    compress_ratio: int
    num_warps: int
    launch_pdl: bool  # always False, as vLLM launches it on CUDA


def record_of(kv_cache: torch.Tensor) -> str | None:
    """The record a cache tensor holds, as ``rope_quant_insert`` picks its kernel: uint8 by the per-token width
    (584, 528, 288), else the plain row's dtype; None for anything else."""
    if kv_cache.dtype == torch.uint8:
        return {w: r for r, w in RECORDS.items() if w}.get(kv_cache.shape[-1])
    return {v: k for k, v in _CACHE_DTYPES.items()}.get(kv_cache.dtype) if kv_cache.shape[-1] == 512 else None


class V41RopeInsert(warmreg.TritonKernel[V41RopeInsertKey]):
    """RoPE and publish V4.1 latents to the compressed cache, one kernel per record (the module docstring).

    :param compress_ratios: the model's V4.1 compressor ratios (domains only).
    :param record: the deployment's record (:func:`._v41.compressed_record`; domains only).
    """

    name = "deepseek_v4.v41_rope_insert"
    key_type = V41RopeInsertKey
    jit = _v41_rope_fp8_ds_mla_kernel

    def __init__(self, *, compress_ratios: tuple[int, ...] = (1, 2), record: str = "fp8_ds_mla") -> None:
        self.compress_ratios, self.record = compress_ratios, record

    def jit_for(self, key: V41RopeInsertKey) -> Any:
        return _JITS[key.record]

    def jits(self) -> tuple[Any, ...]:
        return tuple(dict.fromkeys(_JITS.values()))

    def dispatch(self, *, kv_cache: torch.Tensor, compress_ratio: int) -> V41RopeInsertKey:
        record = record_of(kv_cache)
        if record is None:
            raise warmreg.LaunchError(
                self.name, f"kv_cache must be uint8 [.., .., 584 | 528 | 288] or bf16 / e4m3fn [.., .., 512] (got "
                f"{kv_cache.dtype} {tuple(kv_cache.shape)})",
            )  # fmt: skip
        return V41RopeInsertKey(record=record, compress_ratio=compress_ratio, num_warps=4, launch_pdl=False)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"kv_cache": [_cache_meta(self.record)], "compress_ratio": sorted(self.compress_ratios)}

    def warmup_inputs(self, key: V41RopeInsertKey) -> Mapping[str, Any]:
        return {
            "latent": warmreg.meta((1, 512), torch.bfloat16),
            "positions": warmreg.meta((1,), torch.int64),
            "cos_sin_cache": warmreg.meta((2, 64), torch.float32),
            "kv_cache": _cache_meta(key.record),
            "slot_mapping": warmreg.meta((1,), torch.int64),
            "compress_ratio": key.compress_ratio,
            "fp8_scale": warmreg.meta((1,), torch.float32) if key.record == "fp8" else None,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        latent: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        compress_ratio: int,
        fp8_scale: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[V41RopeInsertKey]:
        """Write the group-closing tokens' records into ``kv_cache`` in place (as ``rope_quant_insert``); returns
        ``kv_cache``.

        :param latent: bf16 ``[>= T, 512]``, contiguous (the compressor's latent).
        :param positions: int64 ``[>= T]``, contiguous.
        :param cos_sin_cache: float32 ``[P, 64]`` with contiguous rows (32 cos, then 32 sin).
        :param kv_cache: the compressed cache ``[blocks, block_size, width]``: uint8 records (584, 528, 288 bytes a
            token; pages of any stride) or plain bf16 / e4m3fn ``[512]`` rows with a unit column stride.
        :param slot_mapping: int64 ``[T]`` cache slots (``-1``: none), contiguous.
        :param compress_ratio: 1 or 2.
        :param fp8_scale: float32 ``[1]``, the per-tensor scale of an e4m3fn plain cache (only then).
        :raises warmreg.LaunchError: naming the argument that breaks these rules.
        """
        if compress_ratio not in (1, 2):
            raise warmreg.LaunchError(self.name, f"compress_ratio must be 1 or 2 (got {compress_ratio})")
        key = self.dispatch(kv_cache=kv_cache, compress_ratio=compress_ratio)
        T = slot_mapping.numel()
        check_index_vector(self.name, "slot_mapping", slot_mapping, T, torch.int64)
        check_index_vector(self.name, "positions", positions, T, torch.int64)
        if (
            latent.dtype != torch.bfloat16
            or latent.ndim != 2
            or latent.shape[0] < T
            or latent.shape[1] != 512
            or not latent.is_contiguous()
        ):
            raise warmreg.LaunchError(
                self.name, f"latent must be contiguous bf16 [>= {T}, 512] (got {latent.dtype} {tuple(latent.shape)})"
            )
        if (
            cos_sin_cache.dtype != torch.float32
            or cos_sin_cache.ndim != 2
            or cos_sin_cache.shape[1] != 64
            or cos_sin_cache.stride(1) != 1
        ):
            raise warmreg.LaunchError(
                self.name,
                f"cos_sin_cache must be float32 [P, 64] with contiguous rows (got {tuple(cos_sin_cache.shape)})",
            )
        if kv_cache.ndim != 3 or kv_cache.stride(2) != 1 or (key.record in _CACHE_DTYPES and kv_cache.stride(1) % 16):
            raise warmreg.LaunchError(
                self.name, f"kv_cache must be 3-D with contiguous rows (got strides {kv_cache.stride()})"
            )
        store_fp8 = key.record == "fp8"
        if store_fp8 != (fp8_scale is not None) or (
            fp8_scale is not None and (fp8_scale.dtype != torch.float32 or fp8_scale.numel() != 1)
        ):
            raise warmreg.LaunchError(
                self.name, "fp8_scale (float32, one element) goes with an e4m3fn plain cache only"
            )
        kwargs: dict[str, Any] = dict(
            latent_ptr=latent, positions_ptr=positions, cos_ptr=cos_sin_cache, cache_ptr=kv_cache, slots_ptr=slot_mapping,
            scale_ptr=fp8_scale, cos_stride=cos_sin_cache.stride(0), page_stride=kv_cache.stride(0),
            row_stride=kv_cache.stride(1), block_size=kv_cache.shape[1], R=compress_ratio,
        )  # fmt: skip
        if key.record in _CACHE_DTYPES:
            kwargs["STORE_FP8"] = store_fp8
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, kv_cache)


def v41_rope_reference(
    latent: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, compress_ratio: int
) -> torch.Tensor:
    """PyTorch reference of the rotation every record starts from: fp32 ``y [T, 512]`` (the module docstring), for
    ``T = positions.numel()`` tokens; the records' quantization is checked against it by decoding them."""
    x = latent[: positions.numel()].float()
    q = torch.div(positions, compress_ratio, rounding_mode="floor") * compress_ratio
    c, s = cos_sin_cache[q, :32].float(), cos_sin_cache[q, 32:].float()
    even, odd = x[:, 448::2], x[:, 449::2]
    y = x.clone()
    y[:, 448::2], y[:, 449::2] = even * c - odd * s, odd * c + even * s
    return y


def _cache_meta(record: str) -> torch.Tensor:
    if RECORDS[record]:
        return warmreg.meta((2, 64, RECORDS[record]), torch.uint8)
    return warmreg.meta((2, 64, 512), _CACHE_DTYPES[record])


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the insert for a DeepSeek-V4.1 model with compressor layers on CUDA (``DeepseekCompressor.
    insert_cache`` after every compressor step), with the record the deployment's compressed cache stores.

    :raises warmreg.ConfigError: as :func:`._v41.compressed_record`, on a CUDA target.
    """
    when, ratios = v41_register_predicate(model, config)
    record = compressed_record(config, model, platform) if ratios and platform.is_cuda else "fp8_ds_mla"
    registry.add(V41RopeInsert(compress_ratios=ratios, record=record), when=when)
