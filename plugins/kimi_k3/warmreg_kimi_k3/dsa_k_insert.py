"""The DSA indexer key of a Kimi-K3.1 layer into its FP8 cache, and the -1 fill of the step's top-k rows (vLLM 0.34
``models/kimi_k3/nvidia/ops/dsa_indexer.py``: ``indexer_k_norm_quant_insert``, ``_indexer_k_norm_quant_insert_kernel``
with its ``_index_k_insert`` and ``_fill_topk``).

Math, for each token ``t < T`` (``T = num_tokens``, the step's rows, padding included), with the key ``x = k[t]`` of
``D = index_head_dim`` values (a power of two), the fp32 LayerNorm weight ``w`` and bias ``b`` and ``eps``::

    topk[t, :TOPK] = -1                                       (every row t < T, padded rows included)
    s = slot_mapping[t]   if t < len(slot_mapping) else -1   (no insert when s < 0)
    y = dtype(LayerNorm(float32(x)) * w + b)                  (mean, then rsqrt(mean((x - mean)^2) + eps))
    scale = 2 ** ceil(log2(max(amax|y|, 1e-4) / 448))          (a power of two, UE8M0)
    page, j = divmod(s, block_size)
    cache_u8[page, j * D : (j + 1) * D] = e4m3fn(y / scale)          (the page's first block_size * D bytes)
    cache_u8[page, block_size * D + 4 j : +4] = float32(scale)       or, MX_SCALE, its UE8M0 exponent byte x4

where ``cache_u8`` is the cache ``[num_blocks, block_size, D + 4]`` read as flat pages of ``stride(0)`` bytes (a
page may be a strided view into a packed block row: only ``stride(0)`` and ``shape[1]`` are read). ``y`` is rounded
to the key's dtype before quantizing, as the unfused path's LayerNorm returns it, so the cached bytes match it.
``MX_SCALE`` (vLLM's ``mqa_logits_use_mx_scales()``: the CUDA sm_10x family) stores the scale as four equal UE8M0
bytes, which the SM100 MQA-logits kernels read. FP8 is OCP e4m3fn (max 448): vLLM runs Kimi-K3's DSA on CUDA only.

Grid ``(T, 2)``: program ``(t, 0)`` inserts, ``(t, 1)`` fills; one warp, as in vLLM.

Where it runs: ``KimiK3DSAIndexer._fused_k_insert`` on every forward step with metadata of a DSA layer whose
indexer uses the fused key insert (``index_k_norm_type == "layernorm"``, no indexer RoPE, no PCP) and an FP8 cache,
when the layer's projections are not packed into :mod:`.dsa_prologue` (see :mod:`.dsa`).

Key: the dtypes, ``D``, ``TOPK`` and its fill tile, ``MX_SCALE``. Unlike vLLM's kernel, the strides, the slot
count and the block size and stride are unspecialized runtime ints and no pointer is specialized on alignment (the
key and weights are column views of projection outputs, the cache pages views of a packed row): one binary serves
every layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dsa import DSALayout, dsa_layout
from .model import PLUGIN, KimiK3

__all__ = [
    "FP8_MAX",
    "DSAKInsertKey",
    "DSAKNormQuantInsert",
    "cache_pages",
    "dsa_k_insert_reference",
    "fp8_pow2_quant_reference",
    "layer_norm_reference",
    "mx_scale_default",
    "register",
    "topk_block",
]

#: e4m3fn's largest finite value.
FP8_MAX: tl.constexpr = tl.constexpr(448.0)
_INTS = ["k_stride", "num_slots", "block_size", "block_stride", "topk_stride"]
_POINTERS = ["k_ptr", "w_ptr", "b_ptr", "slot_ptr", "cache_ptr", "scale_ptr", "topk_ptr"]


@triton.jit
def _pow2_scale(amax, FLOOR: tl.constexpr):
    """``2 ** ceil(log2(max(amax, FLOOR) / 448))``: the UE8M0 scale of a block whose largest magnitude is amax."""
    return tl.math.exp2(tl.math.ceil(tl.math.log2(tl.div_rn(tl.maximum(amax, FLOOR), FP8_MAX))))


@triton.jit
def _fill_minus_one(row_ptr, TOPK: tl.constexpr, TOPK_BLOCK: tl.constexpr):
    """``row[:TOPK] = -1`` in tiles of TOPK_BLOCK."""
    for start in range(0, TOPK, TOPK_BLOCK):
        cols = start + tl.arange(0, TOPK_BLOCK)
        tl.store(row_ptr + cols, -1, mask=cols < TOPK)


@triton.jit
def _key_insert(
    t, x_ptr, w_ptr, b_ptr, eps, slot_ptr, num_slots, cache_ptr, scale_ptr, block_size, block_stride,
    D: tl.constexpr, MX_SCALE: tl.constexpr,
):  # fmt: skip
    """LayerNorm, FP8 quant and cache insert of token t's key (row at x_ptr); nothing without a slot."""
    slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, D)
        x = tl.load(x_ptr + d).to(tl.float32)
        centred = x - tl.sum(x, axis=0) / D
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / D + eps)
        y = centred * rstd * tl.load(w_ptr + d).to(tl.float32) + tl.load(b_ptr + d).to(tl.float32)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the key's dtype, as the unfused LayerNorm returns it
        scale = _pow2_scale(tl.max(tl.abs(y), axis=0), 1e-4)
        page = (slot // block_size) * block_stride
        j = slot % block_size
        tl.store(cache_ptr + page + j * D + d, tl.div_rn(y, scale).to(tl.float8e4nv))
        word = (page + block_size * D + j * 4) // 4  # the scale's 4-byte word in the page
        if MX_SCALE:
            tl.store(scale_ptr + word, ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) * 0x01010101)
        else:
            tl.store(scale_ptr + word, scale)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _dsa_k_insert_kernel(
    k_ptr,  # [T, D] rows, unit column stride
    k_stride,
    w_ptr,  # [D] LayerNorm weight (float32 in vLLM)
    b_ptr,  # [D] LayerNorm bias
    eps,
    slot_ptr,  # [num_slots] cache slot per token, -1: none
    num_slots,
    cache_ptr,  # the cache's bytes as float8e4nv
    scale_ptr,  # the same bytes as float32 (int32 with MX_SCALE)
    block_size,
    block_stride,  # bytes per cache page
    topk_ptr,  # [>= T, TOPK] int32, unit column stride
    topk_stride,
    D: tl.constexpr,  # index_head_dim: one quant block per key
    TOPK: tl.constexpr,  # index_topk: the top-k row's width
    TOPK_BLOCK: tl.constexpr,  # min(1024, next_pow2(TOPK)): the fill's tile
    MX_SCALE: tl.constexpr,  # the scale as UE8M0 x4 (CUDA sm_10x), else float32
):
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        _fill_minus_one(topk_ptr + t * topk_stride, TOPK, TOPK_BLOCK)
    else:
        _key_insert(
            t, k_ptr + t * k_stride, w_ptr, b_ptr, eps, slot_ptr, num_slots, cache_ptr, scale_ptr, block_size,
            block_stride, D, MX_SCALE,
        )  # fmt: skip


def topk_block(topk: int) -> int:
    """The -1 fill's tile: ``min(1024, next_pow2(topk))`` (vLLM's ``TOPK_BLOCK``)."""
    return min(1024, warmreg.next_pow2(topk))


def mx_scale_default(mx_scale: bool | None) -> bool:
    """``mx_scale``, or when None whether the local GPU is of the CUDA sm_10x family (vLLM's
    ``mqa_logits_use_mx_scales()``), so that runtime launches match what the domains planned."""
    if mx_scale is not None:
        return bool(mx_scale)
    local = warmreg.runtime_platform()
    return bool(local and local.is_cuda and local.sm // 10 == 10)


def cache_pages(name: str, what: str, cache: torch.Tensor, entry: int) -> torch.Tensor:
    """``cache`` (``[num_blocks, block_size, entry]`` of one-byte elements, any page stride, unit strides within a
    page) as uint8, or a :class:`warmreg.LaunchError` naming ``what``."""
    if (
        cache.ndim != 3 or cache.shape[2] != entry or cache.element_size() != 1
        or (cache.shape[1] > 1 and cache.stride(1) != entry) or cache.stride(2) != 1 or cache.stride(0) % 4
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name, f"{what} must be a one-byte [num_blocks, block_size, {entry}] cache with packed pages and a page "
            f"stride of whole 4-byte words (got {cache.dtype} {tuple(cache.shape)}, strides {cache.stride()})",
        )  # fmt: skip
    return cache.view(torch.uint8)


@attrs.frozen(kw_only=True)
class DSAKInsertKey(warmreg.CompileKey):
    """What changes the binary of the DSA key insert: no stride, size or alignment does."""

    k_dtype: str
    norm_dtype: str  # LayerNorm weight and bias
    slot_dtype: str
    topk_dtype: str
    head_dim: int
    topk: int
    topk_block: int
    mx_scale: bool
    num_warps: int


class DSAKNormQuantInsert(warmreg.TritonKernel[DSAKInsertKey]):
    """The DSA indexer key's LayerNorm, FP8 quant and cache insert, and the top-k rows' -1 fill (the module
    docstring has the math).

    :param layout: the deployment's DSA layout (domains only).
    :param max_num_batched_tokens: tokens in a step (domains only).
    """

    name = "kimi_k3.dsa_k_norm_quant_insert"
    key_type = DSAKInsertKey
    jit = _dsa_k_insert_kernel

    def __init__(self, *, layout: DSALayout, max_num_batched_tokens: int) -> None:
        self.layout, self.max_num_batched_tokens = layout, max_num_batched_tokens

    def dispatch(
        self, *, k: torch.Tensor, norm_weight: torch.Tensor, slot_mapping: torch.Tensor,
        topk_indices_buffer: torch.Tensor, mx_scale: bool,
    ) -> DSAKInsertKey:  # fmt: skip
        topk = topk_indices_buffer.shape[-1]
        return DSAKInsertKey(
            k_dtype=warmreg.dtype_name(k.dtype), norm_dtype=warmreg.dtype_name(norm_weight.dtype),
            slot_dtype=warmreg.dtype_name(slot_mapping.dtype), topk_dtype=warmreg.dtype_name(topk_indices_buffer.dtype),
            head_dim=k.shape[-1], topk=topk, topk_block=topk_block(topk), mx_scale=bool(mx_scale), num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lay, t = self.layout, self.max_num_batched_tokens
        return {
            "k": [warmreg.meta((t, lay.index_head_dim), getattr(torch, lay.dtype))],
            "norm_weight": [warmreg.meta((lay.index_head_dim,), torch.float32)],  # KimiK3DSAIndexerKNorm: fp32
            "slot_mapping": [warmreg.meta((t,), torch.int64)],  # the indexer builder's int64 buffer
            "topk_indices_buffer": [warmreg.meta((t, lay.index_topk), torch.int32)],  # the model-level buffer
            "mx_scale": [platform.is_cuda and platform.sm // 10 == 10],
        }

    def warmup_inputs(self, key: DSAKInsertKey) -> Mapping[str, Any]:
        d, norm = key.head_dim, getattr(torch, key.norm_dtype)
        return {
            "k": warmreg.meta((1, d), getattr(torch, key.k_dtype)),
            "norm_weight": warmreg.meta((d,), norm),
            "norm_bias": warmreg.meta((d,), norm),
            "eps": 1e-5,
            "slot_mapping": warmreg.meta((1,), getattr(torch, key.slot_dtype)),
            "kv_cache": warmreg.meta((1, 64, d + 4), torch.uint8),
            "topk_indices_buffer": warmreg.meta((1, key.topk), getattr(torch, key.topk_dtype)),
            "num_tokens": 1,
            "mx_scale": key.mx_scale,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        k: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_bias: torch.Tensor,
        eps: float,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices_buffer: torch.Tensor,
        num_tokens: int,
        *,
        mx_scale: bool | None = None,
    ) -> warmreg.LaunchSpec[DSAKInsertKey]:
        """Insert the first ``num_tokens`` keys of ``k`` into ``kv_cache`` and fill those rows of
        ``topk_indices_buffer`` with -1 (vLLM's ``indexer_k_norm_quant_insert``, same arguments). Returns None.

        :param k: ``[>= num_tokens, D]`` keys, unit column stride, any row stride (``D`` a power of two).
        :param norm_weight: ``[D]`` LayerNorm weight; ``norm_bias`` its bias, of the same dtype.
        :param slot_mapping: ``[S]`` int32 or int64 slots; tokens ``>= S`` or with a negative slot are not inserted.
        :param kv_cache: one-byte ``[num_blocks, block_size, D + 4]`` cache, any page stride (a multiple of 4).
        :param topk_indices_buffer: int32 ``[>= num_tokens, TOPK]``, unit column stride.
        :param mx_scale: scales as UE8M0 x4 (default: the local GPU is CUDA sm_10x, as vLLM decides).
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take.
        """
        u8 = self._check(k, norm_weight, norm_bias, slot_mapping, kv_cache, topk_indices_buffer, num_tokens)
        mx = mx_scale_default(mx_scale)
        key = self.dispatch(
            k=k,
            norm_weight=norm_weight,
            slot_mapping=slot_mapping,
            topk_indices_buffer=topk_indices_buffer,
            mx_scale=mx,
        )
        kwargs = dict(
            k_ptr=k, k_stride=k.stride(0), w_ptr=norm_weight, b_ptr=norm_bias, eps=eps, slot_ptr=slot_mapping,
            num_slots=slot_mapping.shape[0], cache_ptr=u8.view(torch.float8_e4m3fn),
            scale_ptr=u8.view(torch.int32 if mx else torch.float32), block_size=u8.shape[1], block_stride=u8.stride(0),
            topk_ptr=topk_indices_buffer, topk_stride=topk_indices_buffer.stride(0),
            D=key.head_dim, TOPK=key.topk, TOPK_BLOCK=key.topk_block, MX_SCALE=key.mx_scale,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_tokens, 2) if num_tokens else None, kwargs, None)

    def _check(
        self, k: torch.Tensor, w: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
        topk: torch.Tensor, num_tokens: int,
    ) -> torch.Tensor:  # fmt: skip
        d = k.shape[-1] if k.ndim == 2 else 0
        if k.ndim != 2 or not k.dtype.is_floating_point or k.stride(1) != 1 or d != warmreg.next_pow2(d) or d < 4:
            raise warmreg.LaunchError(self.name, f"k must be a float [T, D] with D a power of two and unit column "
                                      f"stride (got {k.dtype} {tuple(k.shape)}, strides {k.stride()})")  # fmt: skip
        if w.shape != (d,) or b.shape != (d,) or w.dtype != b.dtype or not w.is_contiguous() or not b.is_contiguous():
            raise warmreg.LaunchError(self.name, f"norm_weight and norm_bias must be contiguous [{d}] of one dtype "
                                      f"(got {w.dtype} {tuple(w.shape)}, {b.dtype} {tuple(b.shape)})")  # fmt: skip
        if (
            slots.ndim != 1
            or slots.dtype not in (torch.int32, torch.int64)
            or (slots.numel() > 1 and slots.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"slot_mapping must be a contiguous int32 or int64 [S] "
                                      f"(got {slots.dtype} {tuple(slots.shape)})")  # fmt: skip
        if (
            topk.ndim != 2
            or topk.dtype != torch.int32
            or topk.stride(1) != 1
            or not 0 <= num_tokens <= min(k.shape[0], topk.shape[0])
        ):
            raise warmreg.LaunchError(self.name, f"topk_indices_buffer must be an int32 [>= num_tokens, TOPK] with unit "
                                      f"column stride, and num_tokens ({num_tokens}) at most the rows of k and of it "
                                      f"(got {topk.dtype} {tuple(topk.shape)}, k rows {k.shape[0]})")  # fmt: skip
        if len({t.device for t in (k, w, b, slots, cache, topk)}) > 1:
            raise warmreg.LaunchError(self.name, "inputs on several devices: use one device")
        return cache_pages(self.name, "kv_cache", cache, d + 4)


def fp8_pow2_quant_reference(x: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (float32) as e4m3fn with one power-of-two scale each, ``2 ** ceil(log2(max(amax, floor) / 448))``:
    ``(fp8 [..., D], scale [..., 1] float32)``. No clamp: ``|x| / scale <= 448`` by construction."""
    amax = x.abs().amax(-1, keepdim=True).clamp(min=floor)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX.value)))
    return (x / scale).to(torch.float8_e4m3fn), scale


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's two-pass fp32 LayerNorm of the rows of ``x`` (float32 result)."""
    x = x.float()
    centred = x - x.sum(-1, keepdim=True) / x.shape[-1]
    rstd = torch.rsqrt((centred * centred).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return centred * rstd * weight.float() + bias.float()


def dsa_k_insert_reference(
    k: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float, slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor, topk_indices_buffer: torch.Tensor, num_tokens: int, *, mx_scale: bool,
) -> None:  # fmt: skip
    """PyTorch reference of :class:`DSAKNormQuantInsert`: writes ``kv_cache`` and ``topk_indices_buffer`` in place."""
    if num_tokens == 0:
        return
    topk_indices_buffer[:num_tokens] = -1
    d = k.shape[-1]
    n = min(num_tokens, slot_mapping.shape[0])
    y = layer_norm_reference(k[:n], norm_weight, norm_bias, eps).to(k.dtype).float()
    q, scale = fp8_pow2_quant_reference(y, 1e-4)
    pages = kv_cache.view(torch.uint8)
    flat = pages.as_strided((pages.shape[0], pages.shape[1] * (d + 4)), (pages.stride(0), 1))
    bs = pages.shape[1]
    for t, slot in enumerate(slot_mapping[:n].tolist()):
        if slot < 0:
            continue
        page, j = divmod(slot, bs)
        flat[page, j * d : (j + 1) * d] = q[t].view(torch.uint8)
        word = torch.tensor([scale[t, 0].item()], dtype=torch.float32)
        if mx_scale:
            e = (word.view(torch.int32) >> 23) & 0xFF
            word = (e * 0x01010101).to(torch.int32).view(torch.float32)
        flat[page, bs * d + 4 * j : bs * d + 4 * j + 4] = word.view(torch.uint8).to(flat.device)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the key insert where vLLM runs it: DSA layers with the fused key insert and an FP8 cache whose
    projections are not packed into the fused prologue (see :mod:`.dsa`).

    :raises warmreg.ConfigError: for a malformed ``dsa_config`` or a missing ``serving.max_num_batched_tokens``.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or not layout.fused_k_insert or layout.indexer_fp4 or layout.fused_prologue:
        return
    tokens = config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN)
    registry.add(DSAKNormQuantInsert(layout=layout, max_num_batched_tokens=tokens), when=warmreg.is_cuda)
