"""DeepSeek-V4.1's indexer key store: k_norm, RoPE, quant and paged store (vLLM 0.34
``models/deepseek_v41/common/ops/indexer_k_store.py``: ``indexer_k_norm_rope_store`` and
``_indexer_k_norm_rope_quant_store_kernel``; launched by ``models/deepseek_v41/attention.py:
DeepseekV4Indexer._produce_k`` on the indexers of kv-source layers, every step, short contexts included).

V4.1 derives the index key from the main compressor's latent (``k_pre = wk(latent)``, bf16 ``[T, 128]``). Token ``t < T``
(``T = kv_slot_mapping.numel()``) with ``s = kv_slot_mapping[t] >= 0`` and ``p = positions[t]`` a group end
(``(p + 1) % R == 0``), ``w`` the k_norm weight, ``q = p // R * R``, ``c_i, s_i = cos_sin[q, i], cos_sin[q, 32 + i]``::

    k = float32(bf16(k_pre[t] * rsqrt(mean(k_pre[t]**2) + eps) * w))
    y = k, but y[64 + 2i], y[65 + 2i] = bf16(k_e c_i - k_o s_i), bf16(k_o c_i + k_e s_i)   (i < 32: GPT-J RoPE; rounded
                                                                                            through bf16, the NoPE part too)
    page, j = s // block_size, s % block_size             (k_cache uint8 [blocks, block_size, row], page stride stride(0))
    FP8:   e = ceil(log2(max(amax|y|, 1e-4) / 448));  page bytes [128 j, +128) = e4m3(clamp(y / 2^e, +-448))
           page bytes [128 block_size + 4 j, +4) = float32 2^e, or (MX scales) the UE8M0 byte e + 127 four times
    MXFP4: per 32-dim block b: k_b = clamp(ceil(log2(max(amax_b, 6 * 2^-126) / 6)), +-127);
           page bytes [64 j + 16 b, +16) = E2M1 pairs of y_b / 2^k_b (even dim in the low nibble);
           page bytes [64 block_size + 4 j + b] = k_b + 127

The casts, ``log2`` and ``exp2`` are vLLM's operations, so the bytes are the engine's on the same backend. E2M1 is
:func:`._mxfp4.e2m1_code` (round to nearest even, saturating), the portable form of vLLM's inline PTX
``cvt.rn.satfinite.e2m1x2.f32``. vLLM's ROCm tiled layout (``SHUFFLE``) is not reproduced: this plugin plans V4.1 on
CUDA only. One program per token, one warp, no PDL, as in vLLM.

Key: the head and RoPE sizes, ``R``, the cache format (FP8 or MXFP4), the FP8 scale form (MX on the SM100 family:
``mqa_logits_use_mx_scales``), the weight's dtype, one warp, no PDL. Unlike vLLM (a constexpr, and specialized
ints), the page stride, ``block_size`` and the row strides are unspecialized runtime ints, and no pointer is
specialized on alignment: one binary serves every page layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._indexer_common import cos_sin_meta, rope_pairs
from ._mxfp4 import e2m1_code, mxfp4_quant_reference, mxfp4_row_bytes
from ._serving import INDEXER_KV_DTYPES
from .model import DSV4, PLUGIN

__all__ = ["V41IndexerKStore", "V41IndexerKStoreKey", "register", "use_fp4_indexer", "v41_indexer_k_store_reference"]

_INTS = ["k_pre_stride", "cos_stride", "page_stride", "block_size", "eps"]
_PTRS = ["k_pre_ptr", "positions_ptr", "weight_ptr", "cos_ptr", "cache_ptr", "slots_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _v41_indexer_k_store_kernel(
    k_pre_ptr, positions_ptr, weight_ptr, cos_ptr, cache_ptr, slots_ptr, k_pre_stride, cos_stride, page_stride,
    block_size, eps,
    HEAD: tl.constexpr,  # index_head_dim (128): one FP8 block, HEAD / 32 MXFP4 blocks
    ROPE: tl.constexpr,  # qk_rope_head_dim (64): the rotated tail of the key
    R: tl.constexpr,  # the compress ratio: which positions end a group
    USE_FP4: tl.constexpr,  # MXFP4 cache rows (else FP8 + one scale)
    MX_SCALE: tl.constexpr,  # FP8 scale as four UE8M0 bytes (SM100 family) instead of a float32
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    p = tl.load(positions_ptr + t)
    if (slot >= 0) & ((p + 1) % R == 0):  # a written slot and a group end
        d = tl.arange(0, HEAD)
        k = tl.load(k_pre_ptr + t.to(tl.int64) * k_pre_stride + d).to(tl.float32)
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
        if USE_FP4:
            NB: tl.constexpr = HEAD // 32  # MXFP4 blocks: 16 (even, odd) pairs each
            lo = tl.reshape(e_r, (NB, 16))
            hi = tl.reshape(o_r, (NB, 16))
            amax = tl.maximum(tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1)), 6.0 * (2**-126))
            k2 = tl.minimum(tl.maximum(tl.ceil(tl.log2(amax * (1.0 / 6.0))), -127.0), 127.0)
            inv = tl.reshape(tl.exp2(-k2), (NB, 1))
            packed = (e2m1_code(lo * inv) | (e2m1_code(hi * inv) << 4)).to(tl.uint8)
            tl.store(page + j * (HEAD // 2) + tl.arange(0, HEAD // 2), tl.reshape(packed, (HEAD // 2,)))
            tl.store(page + block_size * (HEAD // 2) + j * NB + tl.arange(0, NB), (k2 + 127.0).to(tl.uint8))
        else:
            y = tl.interleave(e_r, o_r)
            e = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-4) * (1.0 / 448.0)))
            q = tl.clamp(y * tl.exp2(-e), -448.0, 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(page + j * HEAD + d, q)
            scale = page + block_size * HEAD + j * 4
            if MX_SCALE:
                bits = ((tl.exp2(e).to(tl.int32, bitcast=True) >> 23) & 0xFF) * 0x01010101
                tl.store(scale.to(tl.pointer_type(tl.int32)), bits)
            else:
                tl.store(scale.to(tl.pointer_type(tl.float32)), tl.exp2(e))


@attrs.frozen(kw_only=True)
class V41IndexerKStoreKey(warmreg.CompileKey):
    """What changes the binary of V4.1's indexer key store."""

    head_dim: int
    rope_dim: int
    compress_ratio: int
    use_fp4_cache: bool
    mx_scale: bool  # FP8 rows only: the scale's form
    weight_dtype: str
    cos_sin_dtype: str
    num_warps: int
    launch_pdl: bool  # always False, as vLLM launches it on CUDA


def row_bytes(head_dim: int, fp4: bool) -> int:
    """Bytes of one key in the indexer cache: MXFP4 ``head_dim / 2 + head_dim / 32``, FP8 ``head_dim + 4``."""
    return mxfp4_row_bytes(head_dim) if fp4 else head_dim + 4


class V41IndexerKStore(warmreg.TritonKernel[V41IndexerKStoreKey]):
    """V4.1's indexer key norm + RoPE + quant + paged store (see the module docstring).

    :param ratios: the compress ratios of the layers whose indexer owns its keys (domains only).
    :param use_fp4_cache: the deployment's indexer cache format (domains only).
    :param mx_scale: the deployment's FP8 scale form (domains only).
    :param dtype: the k_norm weight's dtype name.
    """

    name = "deepseek_v4.v41_indexer_k_store"
    key_type = V41IndexerKStoreKey
    jit = _v41_indexer_k_store_kernel

    def __init__(self, *, ratios: Iterable[int] = (2,), use_fp4_cache: bool = False, mx_scale: bool = False,
                 dtype: str = "bfloat16", rope_dim: int = 64) -> None:  # fmt: skip
        self.ratios, self.use_fp4_cache, self.mx_scale = tuple(sorted(set(ratios))), use_fp4_cache, mx_scale
        self.dtype, self.rope_dim = getattr(torch, dtype), rope_dim

    def dispatch(
        self, *, k_pre: torch.Tensor, cos_sin_cache: torch.Tensor, rms_norm_weight: torch.Tensor, compress_ratio: int,
        use_fp4_cache: bool, mx_scale: bool,
    ) -> V41IndexerKStoreKey:  # fmt: skip
        return V41IndexerKStoreKey(
            head_dim=k_pre.shape[1], rope_dim=cos_sin_cache.shape[1], compress_ratio=compress_ratio,
            use_fp4_cache=use_fp4_cache, mx_scale=mx_scale and not use_fp4_cache,
            weight_dtype=warmreg.dtype_name(rms_norm_weight.dtype), cos_sin_dtype=warmreg.dtype_name(cos_sin_cache.dtype),
            num_warps=1, launch_pdl=False,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        head = DSV4.from_config(config).index_head_dim
        return {
            "k_pre": [warmreg.meta((8, head), torch.bfloat16)], "cos_sin_cache": [cos_sin_meta(config, self.rope_dim)],
            "rms_norm_weight": [warmreg.meta((head,), self.dtype)], "compress_ratio": list(self.ratios),
            "use_fp4_cache": [self.use_fp4_cache], "mx_scale": [self.mx_scale],
        }  # fmt: skip

    def warmup_inputs(self, key: V41IndexerKStoreKey) -> Mapping[str, Any]:
        row = row_bytes(key.head_dim, key.use_fp4_cache)
        ids = warmreg.meta((1,), torch.int64)
        return {
            "k_pre": warmreg.meta((1, key.head_dim), torch.bfloat16), "positions": ids,
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), getattr(torch, key.cos_sin_dtype)),
            "rms_norm_weight": warmreg.meta((key.head_dim,), getattr(torch, key.weight_dtype)), "rms_norm_eps": 1e-6,
            "k_cache": warmreg.meta((1, 16, row), torch.uint8, stride=(16 * (row + 4), row, 1)), "kv_slot_mapping": ids,
            "compress_ratio": key.compress_ratio, "use_fp4_cache": key.use_fp4_cache, "mx_scale": key.mx_scale,
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
        *,
        compress_ratio: int,
        use_fp4_cache: bool,
        mx_scale: bool = False,
    ) -> warmreg.LaunchSpec[V41IndexerKStoreKey]:
        """Store the keys of the group-end tokens into ``k_cache`` (in place; returned), as
        ``indexer_k_norm_rope_store(k_pre, positions, cos_sin_cache, rms_norm_weight, rms_norm_eps, k_cache,
        kv_slot_mapping, compress_ratio, use_fp4_cache)`` on CUDA.

        :param k_pre: bf16 ``[>= T, head_dim]`` (``wk(latent)``), unit column stride; only group-end rows are read.
        :param positions: int64 ``[>= T]``.
        :param cos_sin_cache: ``[max_pos, rope_dim]`` (cos half, then sin half), unit column stride.
        :param rms_norm_weight: ``[head_dim]`` k_norm weight, contiguous.
        :param k_cache: uint8 ``[blocks, block_size, row]`` pages (row: :func:`row_bytes`), the scales after a page's
            values (the page stride may exceed ``block_size * row``).
        :param kv_slot_mapping: int64 ``[T]`` cache slots (``-1``: skip), contiguous.
        :param compress_ratio: the group size (1 or 2).
        :param use_fp4_cache: MXFP4 rows (else FP8 + one scale).
        :param mx_scale: FP8 rows: the scale as four UE8M0 bytes (vLLM on the SM100 family) instead of a float32.
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        _check(self.name, k_pre, positions, cos_sin_cache, rms_norm_weight, k_cache, kv_slot_mapping, compress_ratio,
               use_fp4_cache)  # fmt: skip
        key = self.dispatch(k_pre=k_pre, cos_sin_cache=cos_sin_cache, rms_norm_weight=rms_norm_weight,
                            compress_ratio=compress_ratio, use_fp4_cache=use_fp4_cache, mx_scale=mx_scale)  # fmt: skip
        T = kv_slot_mapping.numel()
        kwargs = dict(
            k_pre_ptr=k_pre, positions_ptr=positions, weight_ptr=rms_norm_weight, cos_ptr=cos_sin_cache, cache_ptr=k_cache,
            slots_ptr=kv_slot_mapping, k_pre_stride=k_pre.stride(0), cos_stride=cos_sin_cache.stride(0),
            page_stride=k_cache.stride(0), block_size=k_cache.shape[1], eps=rms_norm_eps, HEAD=key.head_dim,
            ROPE=key.rope_dim, R=key.compress_ratio, USE_FP4=key.use_fp4_cache, MX_SCALE=key.mx_scale,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, k_cache)


def _check(
    name: str, k_pre: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, weight: torch.Tensor,
    cache: torch.Tensor, slots: torch.Tensor, ratio: int, fp4: bool,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's caller passes it."""
    head = k_pre.shape[1] if k_pre.ndim == 2 else 0
    T = slots.numel()
    if k_pre.dtype != torch.bfloat16 or head < 32 or head & (head - 1) or k_pre.stride(1) != 1 or k_pre.shape[0] < T:
        raise warmreg.LaunchError(name, f"k_pre must be bf16 [>= {T}, 2^n >= 32] with unit column stride (got "
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
    row = row_bytes(head, fp4)
    if cache.dtype != torch.uint8 or cache.ndim != 3 or cache.shape[2] != row or cache.stride(1) != row \
            or cache.stride(2) != 1 or cache.stride(0) < cache.shape[1] * row:  # fmt: skip
        raise warmreg.LaunchError(name, f"k_cache must be uint8 [blocks, block_size, {row}] pages (got {cache.dtype} "
                                        f"{tuple(cache.shape)}, strides {cache.stride()})")  # fmt: skip
    if ratio not in (1, 2):
        raise warmreg.LaunchError(name, f"compress_ratio must be 1 or 2 (got {ratio})")


def v41_indexer_k_store_reference(
    k_pre: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rms_norm_weight: torch.Tensor,
    rms_norm_eps: float, k_cache: torch.Tensor, kv_slot_mapping: torch.Tensor, *, compress_ratio: int,
    use_fp4_cache: bool, mx_scale: bool = False,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`V41IndexerKStore`: a copy of ``k_cache`` with the keys stored (bf16 rounding to
    nearest even, where Triton's interpreter truncates)."""
    # a copy whose pages keep the cache's page stride
    out = torch.empty_strided(k_cache.shape, k_cache.stride(), dtype=k_cache.dtype).copy_(k_cache)
    bs, head, span = k_cache.shape[1], k_pre.shape[1], k_cache.shape[1] * k_cache.shape[2]
    half = cos_sin_cache.shape[1] // 2
    for t in range(kv_slot_mapping.numel()):
        s, p = int(kv_slot_mapping[t]), int(positions[t])
        if s < 0 or (p + 1) % compress_ratio:
            continue
        k = k_pre[t].float()
        k = (k * torch.rsqrt((k * k).sum() / head + rms_norm_eps) * rms_norm_weight.float()).bfloat16().float()
        q = p // compress_ratio * compress_ratio
        cos, sin = cos_sin_cache[q, :half].float(), cos_sin_cache[q, half:].float()
        y = torch.cat([k[: head - 2 * half], rope_pairs(k[head - 2 * half :], cos, sin)]).bfloat16().float()
        flat, j = out.as_strided((span,), (1,), out.storage_offset() + (s // bs) * out.stride(0)), s % bs
        if use_fp4_cache:
            packed, scales = mxfp4_quant_reference(y)
            flat[j * (head // 2) : (j + 1) * (head // 2)] = packed
            flat[bs * (head // 2) + j * (head // 32) : bs * (head // 2) + (j + 1) * (head // 32)] = scales
            continue
        e = torch.ceil(torch.log2(y.abs().max().clamp(min=1e-4) * torch.tensor(1 / 448, dtype=torch.float32)))
        q8 = (y * torch.exp2(-e)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        flat[j * head : (j + 1) * head] = q8
        scale = torch.exp2(e).reshape(1)
        bits = (((scale.view(torch.int32) >> 23) & 0xFF) * 0x01010101) if mx_scale else scale.view(torch.int32)
        flat[bs * head + 4 * j : bs * head + 4 * j + 4] = bits.view(torch.uint8)
    return out


def use_fp4_indexer(config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether a V4.1 deployment's indexer cache is MXFP4 on a CUDA ``platform`` (``dsa_indexer_uses_fp4``):
    ``serving.indexer_kv_dtype`` ``mxfp4``; ``auto`` (vLLM's ``resolve_indexer_kv_dtype("fp8")``) and ``fp8`` are FP8.

    :raises warmreg.ConfigError: for ``mxfp4`` off the SM100 family, which vLLM refuses.
    """
    value = config.get("serving.indexer_kv_dtype", str, plugin=PLUGIN, default="auto", choices=INDEXER_KV_DTYPES)
    if value == "mxfp4" and platform.is_cuda and platform.sm // 10 != 10:
        raise warmreg.ConfigError(
            "serving.indexer_kv_dtype", f"is 'mxfp4', which vLLM runs only on sm_10x (not {platform})", plugin=PLUGIN,
            fix="set it to 'fp8' (or 'auto'), or target cuda:100",
        )  # fmt: skip
    return value == "mxfp4"


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the key store for the indexers that own their keys: the layers both in ``kv_source_layer_ids`` and
    ``index_source_layer_ids`` (``owns_k``), on CUDA, at their ratios (a ratio-0 layer runs no indexer).

    :raises warmreg.ConfigError: from :func:`use_fp4_indexer`.
    """
    owners = set(model.kv_source_layer_ids) & set(model.index_source_layer_ids)
    ratios = sorted({model.ratios[i] for i in owners if i < min(len(model.ratios), model.num_hidden_layers)} - {0})
    if not platform.is_cuda or not model.v41 or not ratios:
        return
    fp4 = use_fp4_indexer(config, platform)
    kernel = V41IndexerKStore(ratios=ratios, use_fp4_cache=fp4, mx_scale=not fp4 and platform.sm // 10 == 10,
                              dtype=model.dtype, rope_dim=model.qk_rope_head_dim)  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
