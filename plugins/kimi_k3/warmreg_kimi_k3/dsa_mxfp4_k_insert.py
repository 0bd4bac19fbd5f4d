"""The DSA indexer's key insert on an MXFP4 key cache: LayerNorm + MXFP4 quant + cache insert of the indexer key,
and the -1 fill of the step's top-k rows (vLLM 0.34 ``models/kimi_k3/nvidia/ops/dsa_indexer_mxfp4.py``:
``mxfp4_k_norm_quant_insert`` -> ``_mxfp4_k_norm_quant_insert_kernel``).

Grid ``(num_tokens, 2)``, one warp a program. Program ``(t, 0)`` normalizes key row ``t`` and writes it to its
cache slot, program ``(t, 1)`` fills top-k row ``t``. For a token ``t`` with ``slot = slot_mapping[t] >= 0``
(``t < len(slot_mapping)``; padding rows and, under DCP, another rank's tokens have no slot), in fp32::

    y = dtype((k[t] - mean) * rsqrt(mean((k[t] - mean)**2) + eps) * norm_weight + norm_bias)   # LayerNorm
    packed, ue8m0 = MXFP4(y)                              # 32 values a scale (see :mod:`._mxfp4`)
    block, pos = slot // B, slot % B                      # B: kv_cache.shape[1] tokens a block
    cache[block][pos * D/2 : (pos + 1) * D/2] = packed    # the block's bytes: [B x D/2 values | B x D/32 scales]
    cache[block][B * D/2 + pos * D/32 : ...] = ue8m0
    topk_indices_buffer[t, :] = -1                        # every t < num_tokens, padding rows included

``y`` is rounded to the key's dtype (bf16) before the quant, as vLLM's kernel does so that the cached bytes are the
unfused path's. The key is a column view of the indexer's ``wkv_index`` projection (``[index_k | weights]``).
``kv_cache`` is uint8 ``[blocks, B, D/2 + D/32]``, possibly a strided page view of a packed cache (a block is
``stride(0)`` bytes apart; its ``B`` entries are contiguous).

Where it runs: ``KimiK3DSAIndexer._fused_k_insert`` (``models/kimi_k3/nvidia/dsa.py``) on every DSA layer of a
step with attention metadata, when the indexer keys are MXFP4 (``use_fp4_cache``: ``kimi_k3_indexer_uses_fp4``,
``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` on SM10x) and the layer does not run the fused forward
(``KimiK3DSAAttention.pack_projections`` declined it: DCP, a quantized projection, an MLA cache other than
``fp8_ds_mla``...); with the fused forward, :mod:`.dsa_mxfp4_prologue` inserts the key instead.

Key: the dtypes, ``D``, the top-k width and its fill tile, one warp. Unlike vLLM's kernel no integer is
specialized and no pointer on its alignment: the strides, slot count and block geometry are runtime values, and
one binary serves every batch and cache layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._mxfp4 import MXFP4_BLOCK, entry_bytes, fill_row, layer_norm_mxfp4_insert, mxfp4_reference
from .dsa import dsa_layout
from .model import KimiK3

__all__ = [
    "MXFP4KeyInsert",
    "MXFP4KeyInsertKey",
    "check_key_rows",
    "check_mxfp4_cache",
    "check_norm",
    "check_slots",
    "check_topk_buffer",
    "layer_norm_reference",
    "mxfp4_key_insert_reference",
    "register",
    "topk_block",
]

_INTS = ["k_stride", "num_slots", "block_size", "block_stride", "topk_stride"]
_POINTERS = ["k_ptr", "w_ptr", "b_ptr", "slot_ptr", "cache_ptr", "topk_ptr"]
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _mxfp4_key_insert_kernel(
    k_ptr,
    k_stride,
    w_ptr,
    b_ptr,
    eps,
    slot_ptr,
    num_slots,
    cache_ptr,  # uint8
    block_size,
    block_stride,  # bytes between cache blocks
    topk_ptr,
    topk_stride,
    D: tl.constexpr,  # index_head_dim: one program normalizes a whole row
    TOPK: tl.constexpr,  # index_topk: the top-k row width
    TOPK_BLOCK: tl.constexpr,  # min(1024, next_pow2(TOPK)): entries filled at a time
):
    tok = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        fill_row(topk_ptr + tok * topk_stride, TOPK, TOPK_BLOCK)
    else:
        layer_norm_mxfp4_insert(
            tok, k_ptr + tok * k_stride, w_ptr, b_ptr, eps, slot_ptr, num_slots, cache_ptr, block_size, block_stride, D
        )


def topk_block(topk: int) -> int:
    """The top-k fill tile: ``min(1024, next_pow2(topk))`` (vLLM's ``TOPK_BLOCK``)."""
    return min(1024, warmreg.next_pow2(topk))


@attrs.frozen(kw_only=True)
class MXFP4KeyInsertKey(warmreg.CompileKey):
    """What changes the binary of the MXFP4 key insert: no size, stride or alignment does."""

    k_dtype: str  # also the dtype the LayerNorm output is rounded to
    norm_dtype: str  # weight and bias (float32: KimiK3DSAIndexerKNorm keeps them in fp32)
    slot_dtype: str
    topk_dtype: str
    head_dim: int
    topk: int
    topk_block: int
    num_warps: int


def check_topk_buffer(name: str, topk_indices_buffer: torch.Tensor, num_tokens: int) -> None:
    """Refuse a top-k buffer the fill cannot take: int32 ``[rows >= num_tokens, topk]`` with unit column stride.

    :raises warmreg.LaunchError: naming ``topk_indices_buffer``.
    """
    buf = topk_indices_buffer
    if buf.ndim != 2 or buf.dtype != torch.int32 or buf.stride(1) != 1 or buf.shape[0] < num_tokens:
        raise warmreg.LaunchError(
            name,
            f"topk_indices_buffer must be int32 [rows >= num_tokens = {num_tokens}, topk] with a unit column stride "
            f"(got {buf.dtype} {tuple(buf.shape)}, strides {buf.stride()})",
        )


class MXFP4KeyInsert(warmreg.TritonKernel[MXFP4KeyInsertKey]):
    """LayerNorm + MXFP4 insert of the indexer key and the top-k -1 fill (the module docstring has the math).

    :param head_dim: ``dsa_config.index_head_dim`` (domains only).
    :param topk: ``dsa_config.index_topk`` (domains only).
    :param dtype: the key's dtype, the model's (domains only).
    """

    name = "kimi_k3.dsa_mxfp4_k_insert"
    key_type = MXFP4KeyInsertKey
    jit = _mxfp4_key_insert_kernel

    def __init__(self, *, head_dim: int = 128, topk: int = 2048, dtype: str = "bfloat16") -> None:
        self.head_dim, self.topk, self.dtype = head_dim, topk, dtype

    def dispatch(
        self,
        *,
        k: torch.Tensor,
        norm_weight: torch.Tensor,
        slot_mapping: torch.Tensor,
        topk_indices_buffer: torch.Tensor,
    ) -> MXFP4KeyInsertKey:
        topk = topk_indices_buffer.shape[-1]
        return MXFP4KeyInsertKey(
            k_dtype=warmreg.dtype_name(k.dtype),
            norm_dtype=warmreg.dtype_name(norm_weight.dtype),
            slot_dtype=warmreg.dtype_name(slot_mapping.dtype),
            topk_dtype=warmreg.dtype_name(topk_indices_buffer.dtype),
            head_dim=k.shape[-1],
            topk=topk,
            topk_block=topk_block(topk),
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        d = self.head_dim
        return {
            "k": [warmreg.meta((1, d), getattr(torch, self.dtype))],  # sizes and strides are not in the key
            "norm_weight": [warmreg.meta((d,), torch.float32)],
            "slot_mapping": [warmreg.meta((1,), torch.int64)],  # the indexer metadata's int64 slots
            "topk_indices_buffer": [warmreg.meta((1, self.topk), torch.int32)],
        }

    def warmup_inputs(self, key: MXFP4KeyInsertKey) -> Mapping[str, Any]:
        norm = getattr(torch, key.norm_dtype)
        return {
            "k": warmreg.meta((1, key.head_dim), getattr(torch, key.k_dtype)),
            "norm_weight": warmreg.meta((key.head_dim,), norm),
            "norm_bias": warmreg.meta((key.head_dim,), norm),
            "norm_eps": 1e-5,
            "slot_mapping": warmreg.meta((1,), getattr(torch, key.slot_dtype)),
            "kv_cache": warmreg.meta((1, 64, entry_bytes(key.head_dim)), torch.uint8),
            "topk_indices_buffer": warmreg.meta((1, key.topk), getattr(torch, key.topk_dtype)),
            "num_tokens": 1,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        k: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_bias: torch.Tensor,
        norm_eps: float,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices_buffer: torch.Tensor,
        num_tokens: int,
    ) -> warmreg.LaunchSpec[MXFP4KeyInsertKey]:
        """Insert the normalized, MXFP4-quantized keys of rows ``[:num_tokens]`` into ``kv_cache`` and set top-k
        rows ``[:num_tokens]`` to -1, in place (vLLM's ``mxfp4_k_norm_quant_insert``, same arguments).

        :param k: ``[T >= num_tokens, D]`` bf16, fp16 or fp32 with a unit last stride (any row stride); ``D`` a
            power of two, at least 32.
        :param norm_weight: ``[D]``, unit stride (the LayerNorm weight; fp32 in Kimi-K3.1).
        :param norm_bias: ``[D]``, of ``norm_weight``'s dtype, unit stride.
        :param norm_eps: the LayerNorm epsilon.
        :param slot_mapping: int32 or int64 ``[S]``, unit stride: the cache slot of each of the first ``S`` rows
            (negative: none).
        :param kv_cache: uint8 ``[blocks, B, D/2 + D/32]`` whose ``B`` entries of a block are contiguous (any block
            stride).
        :param topk_indices_buffer: int32 ``[rows >= num_tokens, topk]``, unit column stride.
        :param num_tokens: the rows to process (0: nothing is launched).
        :returns: ``(kv_cache, topk_indices_buffer)``, written.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, naming the
            argument.
        """
        self._check(k, norm_weight, norm_bias, slot_mapping, kv_cache, topk_indices_buffer, num_tokens)
        key = self.dispatch(
            k=k, norm_weight=norm_weight, slot_mapping=slot_mapping, topk_indices_buffer=topk_indices_buffer
        )
        kwargs = dict(
            k_ptr=k, k_stride=k.stride(0), w_ptr=norm_weight, b_ptr=norm_bias, eps=float(norm_eps),
            slot_ptr=slot_mapping, num_slots=slot_mapping.shape[0], cache_ptr=kv_cache, block_size=kv_cache.shape[1],
            block_stride=kv_cache.stride(0), topk_ptr=topk_indices_buffer, topk_stride=topk_indices_buffer.stride(0),
            D=key.head_dim, TOPK=key.topk, TOPK_BLOCK=key.topk_block,
        )  # fmt: skip
        grid = (num_tokens, 2) if num_tokens else None
        return warmreg.LaunchSpec(key, grid, kwargs, (kv_cache, topk_indices_buffer))

    def _check(
        self,
        k: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_bias: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        topk_indices_buffer: torch.Tensor,
        num_tokens: int,
    ) -> None:
        check_key_rows(self.name, "k", k)
        d = k.shape[1]
        if not 0 <= num_tokens <= k.shape[0]:
            raise warmreg.LaunchError(self.name, f"num_tokens ({num_tokens}) must be in [0, {k.shape[0]}] (k's rows)")
        check_norm(self.name, norm_weight, norm_bias, d)
        check_slots(self.name, "slot_mapping", slot_mapping)
        check_mxfp4_cache(self.name, "kv_cache", kv_cache, d)
        check_topk_buffer(self.name, topk_indices_buffer, num_tokens)
        devices = {t.device for t in (k, norm_weight, norm_bias, slot_mapping, kv_cache, topk_indices_buffer)}
        if len(devices) > 1:
            raise warmreg.LaunchError(self.name, f"inputs on {sorted(map(str, devices))}: use one device")


def check_key_rows(name: str, arg: str, k: torch.Tensor) -> None:
    """Refuse key rows the LayerNorm cannot take: 2-D bf16 / fp16 / fp32, unit last stride, a power-of-two width
    of whole MXFP4 blocks.

    :raises warmreg.LaunchError: naming ``arg``.
    """
    if k.ndim != 2 or k.dtype not in _FLOATS or k.stride(1) != 1:
        raise warmreg.LaunchError(
            name, f"{arg} must be a 2-D bf16, fp16 or fp32 tensor with a unit last stride (got {k.dtype} "
            f"{tuple(k.shape)}, strides {k.stride()})",
        )  # fmt: skip
    d = k.shape[1]
    if d < MXFP4_BLOCK or d & (d - 1):
        raise warmreg.LaunchError(
            name, f"{arg}'s width {d} must be a power of two >= {MXFP4_BLOCK} (whole MXFP4 blocks)"
        )


def check_norm(name: str, weight: torch.Tensor, bias: torch.Tensor, d: int) -> None:
    """Refuse a LayerNorm weight / bias that is not ``[d]``, float, unit stride, both of one dtype.

    :raises warmreg.LaunchError: naming ``norm_weight`` or ``norm_bias``.
    """
    for arg, t in (("norm_weight", weight), ("norm_bias", bias)):
        if t.shape != (d,) or t.dtype not in _FLOATS or t.stride(0) != 1 or t.dtype != weight.dtype:
            raise warmreg.LaunchError(
                name, f"{arg} must be [{d}] of one float dtype with norm_weight, unit stride (got {t.dtype} "
                f"{tuple(t.shape)}, strides {t.stride()})",
            )  # fmt: skip


def check_slots(name: str, arg: str, slots: torch.Tensor) -> None:
    """Refuse a slot mapping that is not a 1-D int32 / int64 tensor with a unit stride.

    :raises warmreg.LaunchError: naming ``arg``.
    """
    if slots.ndim != 1 or slots.dtype not in (torch.int32, torch.int64) or (slots.numel() > 1 and slots.stride(0) != 1):
        raise warmreg.LaunchError(
            name, f"{arg} must be a 1-D int32 or int64 tensor with a unit stride (got {slots.dtype} "
            f"{tuple(slots.shape)}, strides {slots.stride()})",
        )  # fmt: skip


def check_mxfp4_cache(name: str, arg: str, cache: torch.Tensor, d: int) -> None:
    """Refuse an MXFP4 indexer cache that is not uint8 ``[blocks, B, D/2 + D/32]`` with contiguous entries.

    :raises warmreg.LaunchError: naming ``arg``.
    """
    width = entry_bytes(d)
    if cache.ndim != 3 or cache.dtype != torch.uint8 or cache.shape[2] != width or cache.stride()[1:] != (width, 1):
        raise warmreg.LaunchError(
            name, f"{arg} must be uint8 [blocks, block_size, {width}] (the MXFP4 entry of D = {d}) with each block's "
            f"entries contiguous (got {cache.dtype} {tuple(cache.shape)}, strides {cache.stride()})",
        )  # fmt: skip


def layer_norm_reference(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The key LayerNorm in fp32 (population variance), rounded to ``k``'s dtype and returned as fp32."""
    x = k.float()
    diff = x - x.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(diff.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (diff * rstd * weight.float() + bias.float()).to(k.dtype).float()


def mxfp4_key_insert_reference(
    k: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`MXFP4KeyInsert`: writes ``kv_cache`` and ``topk_indices_buffer`` in place and
    returns them. The LayerNorm is torch's fp32 arithmetic (not the kernel's summation order)."""
    d, bs = k.shape[1], kv_cache.shape[1]
    packed, scales = mxfp4_reference(layer_norm_reference(k[:num_tokens], norm_weight, norm_bias, norm_eps))
    for t in range(min(num_tokens, slot_mapping.shape[0])):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        block = kv_cache[slot // bs].reshape(-1)  # a view: the block's contiguous entries
        pos = slot % bs
        block[pos * (d // 2) : (pos + 1) * (d // 2)] = packed[t]
        at = bs * (d // 2) + pos * (d // MXFP4_BLOCK)
        block[at : at + d // MXFP4_BLOCK] = scales[t]
    topk_indices_buffer[:num_tokens] = -1
    return kv_cache, topk_indices_buffer


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MXFP4 key insert where vLLM runs it: DSA layers with MXFP4 indexer keys whose projections are
    not packed into the fused prologue (:attr:`.dsa.DSALayout.fused_prologue`; ``KimiK3DSAIndexer._fused_k_insert``).

    :raises warmreg.ConfigError: for a malformed ``dsa_config`` or a ``serving.indexer_kv_dtype`` vLLM refuses.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or not layout.indexer_fp4 or layout.fused_prologue:
        return
    kernel = MXFP4KeyInsert(head_dim=layout.index_head_dim, topk=layout.index_topk, dtype=layout.dtype)
    registry.add(kernel, when=warmreg.is_cuda)
