"""Fused indexer Q RoPE + FP8 quant of the C4 indexer, with the q scale folded into the weights (vLLM
0.33 ``models/deepseek_v4/common/ops/fused_indexer_q.py``, the FP8 kernel; the MXFP4 one is
:mod:`.indexer_q_mxfp4`).

``rope(x, p)`` below is GPT-J interleaved RoPE on the last ``R = cos_sin_cache.shape[1]`` dims: pairs
``(e, o) = (x[2i], x[2i+1])`` of that part, ``c, s = cos_sin_cache[p, i], cos_sin_cache[p, R/2 + i]``,
``e' = e*c - o*s``, ``o' = o*c + e*s``. Scales are exact powers of two,
``s = 2**ceil(log2(max(amax, 1e-4) / FP8_MAX))`` (``ceil(log2)`` from the exponent bits), and FP8
bytes come from a bit-exact encoder (see :mod:`._quant`).

Grid ``(T, H)``, one program per token and head::

    y = float32(index_q[t, h]);  y[rot] = float32(bf16(rope(y, positions[t])[rot]))   # NoPE part as is
    s = pow2 scale of amax(|y|) with FP8_MAX (448 e4m3fn; 224 e4m3fnuz on gfx942)
    q_fp8[t, h] = fp8(y / s);   w_out[t, h] = float32(index_weights[t, h]) * s * softmax_scale * head_scale

There is no q-scale tensor. On ROCm the rotation uses explicit ``fma(e, c, -(o*s))``, ``fma(o, c, e*s)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_rope_cache, out_parts
from ._indexer_common import SCALE_FLOOR, IndexerQBase, rope_pairs
from ._quant import bf16_round, ceil_log2, exp2i, fp8_bits, pow2_scale_reference
from ._serving import mxfp4_indexer
from ._v41 import index_ratios, v41_fp8_indexer
from .model import DSV4

__all__ = [
    "IndexerQKey",
    "IndexerQRopeQuant",
    "indexer_q_rope_quant_reference",
    "register",
]


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "cos_sin_ptr", "weights_ptr"])
def _indexer_q_rope_quant_kernel(
    q_ptr,
    positions_ptr,
    cos_sin_ptr,
    weights_ptr,
    q_out_ptr,
    w_out_ptr,
    q_stride_t,
    q_stride_h,
    weights_stride,
    cos_sin_stride,
    softmax_scale,
    head_scale,
    HEAD_DIM: tl.constexpr,  # index_head_dim (128): one program quantizes one whole head
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32): the interleaved pairs rotated
    FP8_MAX: tl.constexpr,  # 448 (e4m3fn) or 224 (e4m3fnuz): the scale maps amax onto it
    FNUZ: tl.constexpr,  # write e4m3fnuz bytes (gfx942) instead of e4m3fn
    EXPLICIT_FMA: tl.constexpr,  # ROCm: rotate with explicit fma (the reference numerics there)
):
    NOPE: tl.constexpr = HEAD_DIM - 2 * HALF_ROT
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = q_ptr + t * q_stride_t + h * q_stride_h
    nope = tl.load(row + tl.arange(0, NOPE)).to(tl.float32)
    rot = tl.load(row + NOPE + tl.arange(0, 2 * HALF_ROT)).to(tl.float32)
    even, odd = tl.split(tl.reshape(rot, (HALF_ROT, 2)))
    cs = cos_sin_ptr + tl.load(positions_ptr + t) * cos_sin_stride + tl.arange(0, HALF_ROT)
    cos = tl.load(cs)
    sin = tl.load(cs + HALF_ROT)
    if EXPLICIT_FMA:
        even_r = tl.fma(even, cos, -(odd * sin))
        odd_r = tl.fma(odd, cos, even * sin)
    else:
        even_r = even * cos - odd * sin
        odd_r = odd * cos + even * sin
    even_r = bf16_round(even_r)
    odd_r = bf16_round(odd_r)
    amax = tl.maximum(
        tl.max(tl.abs(nope), axis=0), tl.maximum(tl.max(tl.abs(even_r), axis=0), tl.max(tl.abs(odd_r), axis=0))
    )
    e = ceil_log2(tl.math.div_rn(tl.maximum(amax, 1e-4), FP8_MAX))
    inv = exp2i(-e)  # x / 2**e == x * 2**-e exactly
    out = q_out_ptr + (t * tl.num_programs(1) + h) * HEAD_DIM
    tl.store(out + tl.arange(0, NOPE), fp8_bits(nope * inv, FNUZ))
    rot_q = tl.reshape(tl.join(even_r, odd_r), (2 * HALF_ROT,)) * inv
    tl.store(out + NOPE + tl.arange(0, 2 * HALF_ROT), fp8_bits(rot_q, FNUZ))
    w = tl.load(weights_ptr + t * weights_stride + h).to(tl.float32)
    tl.store(w_out_ptr + t * tl.num_programs(1) + h, w * exp2i(e) * softmax_scale * head_scale)


@attrs.frozen(kw_only=True)
class IndexerQKey(warmreg.CompileKey):
    """What changes the binary of the indexer Q RoPE + FP8 quant."""

    dtype: str  # index_q dtype (bfloat16: also the RoPE round-trip dtype)
    weights_dtype: str
    head_dim: int
    rope_dim: int
    fp8_dtype: str  # float8_e4m3fn or float8_e4m3fnuz (gfx942)
    fp8_max: float
    explicit_fma: bool
    q_stride_t: str  # int classes of the specialized strides
    q_stride_h: str
    weights_stride: str
    cos_sin_stride: str
    q_aligned: bool
    num_warps: int
    enable_fp_fusion: bool


class IndexerQRopeQuant(IndexerQBase[IndexerQKey]):
    """Indexer Q RoPE + FP8 quant with the q scale folded into the weights (see the module docstring; the
    parameters are :class:`~._indexer_common.IndexerQBase`'s)."""

    name = "deepseek_v4.indexer_q_rope_quant"
    key_type = IndexerQKey
    jit = _indexer_q_rope_quant_kernel

    def dispatch(
        self,
        *,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        fp8_dtype: torch.dtype,
        explicit_fma: bool,
    ) -> IndexerQKey:
        fields = self.q_key_fields(index_q, index_weights, cos_sin_cache)
        fp8_max = 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0
        return IndexerQKey(**fields, fp8_dtype=warmreg.dtype_name(fp8_dtype), fp8_max=fp8_max, explicit_fma=explicit_fma)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            **self.q_domains(config),
            "fp8_dtype": [torch.float8_e4m3fnuz if platform.fp8_fnuz else torch.float8_e4m3fn],
            "explicit_fma": [platform.is_rocm],
        }

    def warmup_inputs(self, key: IndexerQKey) -> Mapping[str, Any]:
        return {**self.q_warmup_inputs(key), "fp8_dtype": getattr(torch, key.fp8_dtype), "explicit_fma": key.explicit_fma}

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        index_q: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        index_weights: torch.Tensor,
        softmax_scale: float,
        head_scale: float,
        *,
        fp8_dtype: torch.dtype | None = None,
        explicit_fma: bool | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[IndexerQKey]:
        """RoPE and quantize ``index_q [T, H, D]``; returns ``(q_fp8 [T, H, D], w_out [T, H] float32)`` (fresh, or
        ``out``).

        :param positions: int64 ``[T]``.
        :param index_q: ``[T, H, D]`` with a contiguous last dim (token and head strides are passed).
        :param cos_sin_cache: float32 ``[P, R]``: ``R/2`` cosines then ``R/2`` sines per position.
        :param index_weights: ``[T, H]`` with a contiguous last dim.
        :param softmax_scale: ``D**-0.5``, folded into ``w_out``.
        :param head_scale: ``H**-0.5``, folded into ``w_out``.
        :param fp8_dtype: ``float8_e4m3fn`` or ``float8_e4m3fnuz`` (default: the local GPU's; e4m3fn on CPU).
        :param explicit_fma: rotate with explicit fma (default: the local GPU is ROCm).
        :param out: the two outputs to write instead of fresh ones: exactly ``fp8_dtype`` ``[T, H, D]`` and
            float32 ``[T, H]``, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve, or an ``out`` unlike
            the fresh outputs.
        """
        self.check_q_inputs(positions, index_q, index_weights)
        t, h, d = index_q.shape
        check_rope_cache(self.name, cos_sin_cache, d)
        local = warmreg.runtime_platform()
        if fp8_dtype is None:
            fp8_dtype = torch.float8_e4m3fnuz if local is not None and local.fp8_fnuz else torch.float8_e4m3fn
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise warmreg.LaunchError(
                self.name, f"fp8_dtype must be float8_e4m3fn or float8_e4m3fnuz (got {fp8_dtype})"
            )
        if explicit_fma is None:
            explicit_fma = local is not None and local.is_rocm
        key = self.dispatch(
            index_q=index_q,
            index_weights=index_weights,
            cos_sin_cache=cos_sin_cache,
            fp8_dtype=fp8_dtype,
            explicit_fma=explicit_fma,
        )
        out_q, out_w = out_parts(self.name, out, 2)
        q_fp8 = warmreg.output(self.name, "out[0]", out_q, (t, h, d), fp8_dtype, index_q.device)
        w_out = warmreg.output(self.name, "out[1]", out_w, (t, h), torch.float32, index_q.device)
        q_out = q_fp8.view(torch.uint8)  # the kernel stores the fp8 bytes
        kwargs = dict(
            q_ptr=index_q, positions_ptr=positions, cos_sin_ptr=cos_sin_cache, weights_ptr=index_weights,
            q_out_ptr=q_out, w_out_ptr=w_out, q_stride_t=index_q.stride(0), q_stride_h=index_q.stride(1),
            weights_stride=index_weights.stride(0), cos_sin_stride=cos_sin_cache.stride(0),
            softmax_scale=float(softmax_scale), head_scale=float(head_scale), HEAD_DIM=key.head_dim, HALF_ROT=key.rope_dim // 2,
            FP8_MAX=key.fp8_max, FNUZ=key.fp8_dtype == "float8_e4m3fnuz", EXPLICIT_FMA=key.explicit_fma,
        )  # fmt: skip
        grid = (t, h) if t and h else None
        return warmreg.LaunchSpec(key, grid, kwargs, (q_fp8, w_out))


def indexer_q_rope_quant_reference(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    explicit_fma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`IndexerQRopeQuant`: ``(q_fp8 [T, H, D], w_out [T, H] float32)``."""
    rope = cos_sin_cache.shape[1]
    x = index_q.float()
    cs = cos_sin_cache[positions][:, None, :]
    rot = rope_pairs(x[..., -rope:], cs[..., : rope // 2], cs[..., rope // 2 :], fma=explicit_fma)
    y = torch.cat([x[..., :-rope], rot.to(index_q.dtype).float()], dim=-1)
    fp8_max = 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0
    _, s = pow2_scale_reference(y.abs().amax(dim=-1), SCALE_FLOOR, fp8_max)
    q = (y / s[..., None]).to(fp8_dtype)
    f32 = torch.float32
    w = index_weights.float() * s * torch.tensor(softmax_scale, dtype=f32) * torch.tensor(head_scale, dtype=f32)
    return q, w


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register indexer Q when the model has C4 layers on an FP8 indexer cache: Triton runs it on ROCm and on
    CUDA without CuTeDSL (CuTeDSL replaces it; XPU has its own op). On an MXFP4 cache
    (``serving.indexer_kv_dtype``) CUDA runs :mod:`.indexer_q_mxfp4` and ROCm aiter's MXFP4 Q instead.

    DeepSeek-V4.1 launches the same function (``models/deepseek_v41/common/ops`` re-exports V4's
    ``fused_indexer_q_rope_quant`` verbatim) from ``DeepseekV4Indexer.forward_q`` with the same arguments (its FP8
    path takes ``weights_out_dtype`` float32 only, V4's default): on CUDA without CuTeDSL, when the index-source
    layers build an indexer (:func:`._v41.index_ratios`) on an FP8 K cache (:func:`._v41.v41_fp8_indexer`).

    :raises warmreg.ConfigError: for a ``serving.indexer_kv_dtype`` the platform cannot serve.
    """
    kernel = IndexerQRopeQuant(
        num_heads=model.index_n_heads, head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, dtype=model.dtype
    )
    if model.v41:
        v41_fp8 = bool(index_ratios(model)) and v41_fp8_indexer(config)
        registry.add(kernel, when=warmreg.is_cuda & ~warmreg.has_feature("cutedsl") if v41_fp8 else False)
        return
    triton_q = warmreg.is_rocm | (warmreg.is_cuda & ~warmreg.has_feature("cutedsl"))
    fp8 = model.has_c4 and not mxfp4_indexer(config, model, platform)
    registry.add(kernel, when=triton_q if fp8 else False)
