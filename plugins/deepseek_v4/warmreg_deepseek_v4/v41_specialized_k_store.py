"""DeepSeek-V4.1's specialized-decode indexer key store: the FP32 ``wk`` output, k_norm, RoPE, MXFP4 and paged store
(vLLM 0.34 ``models/deepseek_v41/nvidia/specialized_decode/attention/indexer_k_store.py``:
``indexer_k_norm_rope_store_fp32`` and ``_k_norm_rope_mxfp4_store_kernel``; launched by ``attention/step.py:
AttentionStep._produce_k`` on the indexers that own their keys, in low-batch decode steps of at most
``LOW_BATCH_MAX_ROWS`` (8) rows, where ``wk`` runs on the ``ll_bf16`` GEMM and returns its FP32 accumulation).

It is the MXFP4 path of V4.1's key store (:mod:`.v41_indexer_k_store`) with an FP32 ``k_pre`` rounded to bf16 as it
is loaded, so it writes the bytes the shared store writes for the bf16 GEMM output. Token ``t < T``
(``T = kv_slot_mapping.numel()``) with ``s = kv_slot_mapping[t] >= 0`` and ``p = positions[t]`` a group end
(``(p + 1) % R == 0``), ``w`` the k_norm weight, ``q = p // R * R``, ``c_i, s_i = cos_sin[q, i], cos_sin[q, 32 + i]``::

    x = float32(bf16(k_pre[t]))                                                  (k_pre float32 [T, 128])
    k = float32(bf16(x * rsqrt(sum(x**2) / 128 + eps) * w))
    y = k, but y[64 + 2i], y[65 + 2i] = bf16(k_e c_i - k_o s_i), bf16(k_o c_i + k_e s_i)   (i < 32: GPT-J RoPE; the
                                                                                            NoPE part rounded too)
    page, j = s // block_size, s % block_size             (k_cache uint8 [blocks, block_size, 68], page stride stride(0))
    per 32-dim block b: k_b = clamp(ceil(log2(max(amax_b, 6 * 2^-126) / 6)), +-127);
    page bytes [64 j + 16 b, +16) = E2M1 pairs of y_b / 2^k_b (even dim in the low nibble);
    page bytes [64 block_size + 4 j + b] = k_b + 127

The casts, ``log2`` and ``exp2`` are vLLM's operations. E2M1 is :func:`._mxfp4.e2m1_code` (round to nearest even,
saturating), the portable form of vLLM's inline PTX ``cvt.rn.satfinite.e2m1x2.f32``. One program per token, one
warp, no PDL, as in vLLM.

Where it runs: the specialized decode only (:func:`.v41_specialized.specialized_decode`: ``cuda:103``, which needs the
MXFP4 indexer), on the indexers of the layers both in ``kv_source_layer_ids`` and ``index_source_layer_ids``
(``owns_k``), at their compress ratios (vLLM asserts 1 or 2), when ``aux_projection_gemm_accepts([wk])``: ``wk`` is
stored in bf16 (``DeepseekV4Indexer`` builds it unquantized), 2-D, contiguous, with ``main_head_dim % 8 == 0``, and
``ll_bf16.is_available()``, taken as true on the GB300 the specialized decode requires.

Key: the head and RoPE sizes, ``R``, the weight's and the cos/sin cache's dtypes, one warp, no PDL. Unlike vLLM (a
constexpr ``KV_BLOCK_STRIDE``, and specialized ints), the page stride, ``block_size`` and the row strides are
unspecialized runtime ints, and no pointer is specialized on alignment: one binary serves every page layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._indexer_common import cos_sin_meta
from ._mxfp4 import e2m1_code, mxfp4_row_bytes
from .model import DSV4
from .v41_indexer_k_store import v41_indexer_k_store_reference
from .v41_specialized import specialized_decode

__all__ = [
    "V41SpecializedKStore", "V41SpecializedKStoreKey", "register", "v41_specialized_k_store_reference",
]  # fmt: skip

_INTS = ["k_pre_stride", "cos_stride", "page_stride", "block_size", "eps"]
_PTRS = ["k_pre_ptr", "positions_ptr", "weight_ptr", "cos_ptr", "cache_ptr", "slots_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _v41_specialized_k_store_kernel(
    k_pre_ptr, positions_ptr, weight_ptr, cos_ptr, cache_ptr, slots_ptr, k_pre_stride, cos_stride, page_stride,
    block_size, eps,
    HEAD: tl.constexpr,  # index_head_dim (128): HEAD / 32 MXFP4 blocks
    ROPE: tl.constexpr,  # qk_rope_head_dim (64): the rotated tail of the key
    R: tl.constexpr,  # the compress ratio: which positions end a group
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        d = tl.arange(0, HEAD)
        k = tl.load(k_pre_ptr + t.to(tl.int64) * k_pre_stride + d).to(tl.bfloat16).to(tl.float32)  # the bf16 GEMM row
        w = tl.load(weight_ptr + d).to(tl.float32)
        k = (k * tl.rsqrt(tl.sum(k * k, axis=0) / HEAD + eps) * w).to(tl.bfloat16).to(tl.float32)
        even, odd = tl.split(tl.reshape(k, (HEAD // 2, 2)))
        pair = tl.arange(0, HEAD // 2) - (HEAD - ROPE) // 2  # NoPE pairs load (cos, sin) = (1, 0): the identity
        cs = cos_ptr + (p // R * R) * cos_stride + tl.maximum(pair, 0)
        c = tl.load(cs, mask=pair >= 0, other=1.0)
        s = tl.load(cs + ROPE // 2, mask=pair >= 0, other=0.0)
        e_r = (even * c - odd * s).to(tl.bfloat16).to(tl.float32)
        o_r = (odd * c + even * s).to(tl.bfloat16).to(tl.float32)
        page = cache_ptr + (slot // block_size).to(tl.int64) * page_stride
        j = slot % block_size
        NB: tl.constexpr = HEAD // 32  # MXFP4 blocks: 16 (even, odd) pairs each
        lo = tl.reshape(e_r, (NB, 16))
        hi = tl.reshape(o_r, (NB, 16))
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1)), 6.0 * (2**-126))
        k2 = tl.minimum(tl.maximum(tl.ceil(tl.log2(amax * (1.0 / 6.0))), -127.0), 127.0)
        inv = tl.reshape(tl.exp2(-k2), (NB, 1))
        packed = (e2m1_code(lo * inv) | (e2m1_code(hi * inv) << 4)).to(tl.uint8)
        tl.store(page + j * (HEAD // 2) + tl.arange(0, HEAD // 2), tl.reshape(packed, (HEAD // 2,)))
        tl.store(page + block_size * (HEAD // 2) + j * NB + tl.arange(0, NB), (k2 + 127.0).to(tl.uint8))


@attrs.frozen(kw_only=True)
class V41SpecializedKStoreKey(warmreg.CompileKey):
    """What changes the binary of the specialized decode's indexer key store."""

    head_dim: int
    rope_dim: int
    compress_ratio: int
    weight_dtype: str
    cos_sin_dtype: str
    num_warps: int  # 1, as vLLM launches it
    launch_pdl: bool  # always False, as vLLM launches it


class V41SpecializedKStore(warmreg.TritonKernel[V41SpecializedKStoreKey]):
    """The specialized decode's FP32-input MXFP4 indexer key store (see the module docstring).

    :param ratios: the compress ratios of the layers whose indexer owns its keys (domains only).
    :param dtype: the k_norm weight's dtype name.
    :param rope_dim: ``qk_rope_head_dim``.
    """

    name = "deepseek_v4.v41_specialized_k_store"
    key_type = V41SpecializedKStoreKey
    jit = _v41_specialized_k_store_kernel

    def __init__(self, *, ratios: Iterable[int] = (2,), dtype: str = "bfloat16", rope_dim: int = 64) -> None:
        self.ratios, self.dtype, self.rope_dim = tuple(sorted(set(ratios))), getattr(torch, dtype), rope_dim

    def dispatch(
        self, *, k_pre: torch.Tensor, cos_sin_cache: torch.Tensor, rms_norm_weight: torch.Tensor, compress_ratio: int
    ) -> V41SpecializedKStoreKey:
        return V41SpecializedKStoreKey(
            head_dim=k_pre.shape[1], rope_dim=cos_sin_cache.shape[1], compress_ratio=compress_ratio,
            weight_dtype=warmreg.dtype_name(rms_norm_weight.dtype), cos_sin_dtype=warmreg.dtype_name(cos_sin_cache.dtype),
            num_warps=1, launch_pdl=False,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        head = DSV4.from_config(config).index_head_dim
        return {
            "k_pre": [warmreg.meta((8, head), torch.float32)], "cos_sin_cache": [cos_sin_meta(config, self.rope_dim)],
            "rms_norm_weight": [warmreg.meta((head,), self.dtype)], "compress_ratio": list(self.ratios),
        }  # fmt: skip

    def warmup_inputs(self, key: V41SpecializedKStoreKey) -> Mapping[str, Any]:
        row = mxfp4_row_bytes(key.head_dim)
        ids = warmreg.meta((1,), torch.int64)
        return {
            "k_pre": warmreg.meta((1, key.head_dim), torch.float32), "positions": ids,
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), getattr(torch, key.cos_sin_dtype)),
            "rms_norm_weight": warmreg.meta((key.head_dim,), getattr(torch, key.weight_dtype)), "rms_norm_eps": 1e-6,
            "k_cache": warmreg.meta((1, 16, row), torch.uint8, stride=(16 * (row + 4), row, 1)), "kv_slot_mapping": ids,
            "compress_ratio": key.compress_ratio,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        k_pre: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        rms_norm_weight: torch.Tensor,
        rms_norm_eps: float,
        k_cache: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        compress_ratio: int,
    ) -> warmreg.LaunchSpec[V41SpecializedKStoreKey]:
        """Store the keys of the group-end tokens into ``k_cache`` (in place; returned), as
        ``indexer_k_norm_rope_store_fp32(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
        kv_slot_mapping, compress_ratio)``.

        :param k_pre: float32 ``[>= T, head_dim]`` (the FP32 ``wk(latent)``), unit column stride; only group-end rows
            are read.
        :param positions: int64 ``[>= T]``.
        :param cos_sin_cache: ``[max_pos, rope_dim]`` (cos half, then sin half), unit column stride.
        :param rms_norm_weight: ``[head_dim]`` k_norm weight, contiguous.
        :param k_cache: uint8 ``[blocks, block_size, head_dim / 2 + head_dim / 32]`` MXFP4 pages, the scales after a
            page's values (the page stride may exceed the page's bytes).
        :param kv_slot_mapping: int64 ``[T]`` cache slots (``-1``: skip), contiguous.
        :param compress_ratio: the group size (1 or 2).
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        _check(self.name, k_pre, positions, cos_sin_cache, rms_norm_weight, k_cache, kv_slot_mapping, compress_ratio)
        key = self.dispatch(k_pre=k_pre, cos_sin_cache=cos_sin_cache, rms_norm_weight=rms_norm_weight,
                            compress_ratio=compress_ratio)  # fmt: skip
        T = kv_slot_mapping.numel()
        kwargs = dict(
            k_pre_ptr=k_pre, positions_ptr=positions, weight_ptr=rms_norm_weight, cos_ptr=cos_sin_cache, cache_ptr=k_cache,
            slots_ptr=kv_slot_mapping, k_pre_stride=k_pre.stride(0), cos_stride=cos_sin_cache.stride(0),
            page_stride=k_cache.stride(0), block_size=k_cache.shape[1], eps=rms_norm_eps, HEAD=key.head_dim,
            ROPE=key.rope_dim, R=key.compress_ratio,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, k_cache)


def _check(
    name: str, k_pre: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor,
    cache: torch.Tensor, slots: torch.Tensor, ratio: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's caller passes it."""
    head = k_pre.shape[1] if k_pre.ndim == 2 else 0
    T = slots.numel()
    if k_pre.dtype != torch.float32 or head < 32 or head & (head - 1) or k_pre.stride(1) != 1 or k_pre.shape[0] < T:
        raise warmreg.LaunchError(name, f"k_pre must be float32 [>= {T}, 2^n >= 32] with unit column stride (got "
                                        f"{k_pre.dtype} {tuple(k_pre.shape)})")  # fmt: skip
    if slots.dtype != torch.int64 or slots.ndim != 1 or (T > 1 and slots.stride(0) != 1):
        raise warmreg.LaunchError(
            name, f"kv_slot_mapping must be contiguous 1-D int64 (got {slots.dtype} {tuple(slots.shape)})"
        )
    if positions.dtype != torch.int64 or positions.ndim != 1 or positions.shape[0] < T:
        raise warmreg.LaunchError(
            name, f"positions must be int64 [>= {T}] (got {positions.dtype} {tuple(positions.shape)})"
        )
    rope = cos.shape[1] if cos.ndim == 2 else 0
    if rope < 2 or rope & (rope - 1) or rope > head or cos.stride(1) != 1 or not cos.dtype.is_floating_point:
        raise warmreg.LaunchError(
            name, f"cos_sin_cache must be float [positions, 2^n <= {head}] with unit column stride"
        )
    if weight.ndim != 1 or weight.shape[0] != head or weight.stride(0) != 1:
        raise warmreg.LaunchError(name, f"rms_norm_weight must be a contiguous [{head}] (got {tuple(weight.shape)})")
    row = mxfp4_row_bytes(head)
    if cache.dtype != torch.uint8 or cache.ndim != 3 or cache.shape[2] != row or cache.stride(1) != row \
            or cache.stride(2) != 1 or cache.stride(0) < cache.shape[1] * row:  # fmt: skip
        raise warmreg.LaunchError(name, f"k_cache must be uint8 [blocks, block_size, {row}] MXFP4 pages (got "
                                        f"{cache.dtype} {tuple(cache.shape)}, strides {cache.stride()})")  # fmt: skip
    if ratio not in (1, 2):
        raise warmreg.LaunchError(name, f"compress_ratio must be 1 or 2 (got {ratio})")


def v41_specialized_k_store_reference(
    k_pre: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rms_norm_weight: torch.Tensor,
    rms_norm_eps: float, k_cache: torch.Tensor, kv_slot_mapping: torch.Tensor, compress_ratio: int,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`V41SpecializedKStore`: a copy of ``k_cache`` with the keys stored, which is the
    shared store's MXFP4 reference on the bf16-rounded ``k_pre`` (rounding to nearest even, where Triton's interpreter
    truncates)."""
    return v41_indexer_k_store_reference(
        k_pre.bfloat16(), positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache, kv_slot_mapping,
        compress_ratio=compress_ratio, use_fp4_cache=True,
    )  # fmt: skip


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the key store under the specialized decode (:func:`.v41_specialized.specialized_decode`), for the
    indexers that own their keys (layers both in ``kv_source_layer_ids`` and ``index_source_layer_ids``), at their
    ratios (a ratio-0 layer runs no indexer), on CUDA: ``AttentionStep._produce_k``.

    :raises warmreg.ConfigError: from :func:`.v41_specialized.specialized_decode`.
    """
    owners = set(model.kv_source_layer_ids) & set(model.index_source_layer_ids)
    ratios = sorted({model.ratios[i] for i in owners if i < min(len(model.ratios), model.num_hidden_layers)} - {0})
    if not platform.is_cuda or not model.v41 or not ratios or not specialized_decode(config, model, platform):
        return
    kernel = V41SpecializedKStore(ratios=ratios, dtype=model.dtype, rope_dim=model.qk_rope_head_dim)
    registry.add(kernel, when=warmreg.is_cuda)
