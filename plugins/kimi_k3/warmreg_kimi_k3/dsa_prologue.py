"""The fused prologue of a Kimi-K3.1 DSA layer with an FP8 indexer cache: the q_a and kv_a RMSNorms, the fp8_ds_mla
insert of ``[kv_c_normed | k_pe]``, the indexer key's LayerNorm + FP8 insert and the top-k rows' -1 fill, in one
launch (vLLM 0.34 ``models/kimi_k3/nvidia/ops/dsa_indexer.py``: ``dsa_fused_prologue``,
``_dsa_fused_prologue_kernel`` with ``_rms_norm_row``, ``_index_k_insert`` and ``_fill_topk``).

Math, for each token ``t < T`` (``T = q_c.shape[0]``), one ``eps`` for the three norms::

    program (t, 0): the indexer key insert of :mod:`.dsa_k_insert` (index_k[t], LayerNorm weight and bias,
                    index_slot_mapping, index_cache)
    program (t, 1): kv = dtype(rmsnorm(kv_c[t]) * kv_norm_weight);   kv_out[t] = kv     (every token)
                    s = mla_slot_mapping[t] if t < len(mla_slot_mapping) else -1; if s >= 0, at the entry
                    e = (s // block_size) * stride(0) + (s % block_size) * stride(1) bytes of mla_cache:
                      per 128-column tile i:  sc_i = 2 ** ceil(log2(max(amax|kv tile i| / 448, 1e-4)))
                      bytes [e, e + KV)                  = e4m3fn(kv / sc)      (KV = kv_lora_rank, 512)
                      bytes [e + KV, e + KV + 4 KV/128)  = float32 sc_i
                      bytes [.., + 2 R)                  = bf16 k_pe[t]         (R = qk_rope_head_dim, 64)
    program (t, 2): q_out[t] = dtype(rmsnorm(q_c[t]) * q_norm_weight)          (Q = q_lora_rank, any width)
    program (t, 3): topk_indices_buffer[t, :TOPK] = -1

with ``rmsnorm(x) = x * rsqrt(mean(x^2) + eps)`` in fp32. The fp8_ds_mla entry is vLLM's 656-byte layout
(``concat_and_cache_ds_mla``). ``mla_cache`` / ``index_cache`` None (profile runs) skip the inserts (an empty slot
mapping takes their place, as in vLLM). Returns ``(q_c_normed [T, Q], kv_c_normed [T, KV])``, fresh or ``out``.
Grid ``(T, 4)``, four warps, PDL where the GPU has it (``current_platform.is_arch_support_pdl()``: SM 9.0 on).

Where it runs: ``KimiK3DSAAttention._fused_attention``, every forward step of a DSA layer whose projections are
packed (``pack_projections``: fused key insert, DCP 1, q-LoRA, NoPE MLA with output gate, an fp8_ds_mla MLA cache,
unquantized projections; see :mod:`.dsa`) and whose indexer cache is FP8.

Key: the dtypes, the widths (``Q`` and its power-of-two tile, ``KV``, ``R``, the index head), ``TOPK`` and its fill
tile, ``MX_SCALE`` and PDL. Unlike vLLM's kernel, strides, slot counts, block sizes and strides are unspecialized
runtime ints and no pointer is specialized on alignment: one binary serves every layout.
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

from .dsa import DSALayout, dsa_layout
from .dsa_k_insert import (
    FP8_MAX,
    _fill_minus_one,
    _key_insert,
    cache_pages,
    dsa_k_insert_reference,
    mx_scale_default,
    topk_block,
)
from .model import PLUGIN, KimiK3, local_pdl

__all__ = ["DSAFusedPrologue", "DSAPrologueKey", "dsa_prologue_reference", "mla_entry_bytes", "register"]

_INTS = [
    "q_stride", "kv_stride", "pe_stride", "k_stride", "mla_num_slots", "mla_block_size", "mla_block_stride",
    "mla_entry_stride", "index_num_slots", "index_block_size", "index_block_stride", "topk_stride",
]  # fmt: skip
_POINTERS = [
    "q_ptr", "q_w_ptr", "q_out_ptr", "kv_ptr", "kv_w_ptr", "kv_out_ptr", "pe_ptr", "k_ptr", "k_w_ptr", "k_b_ptr",
    "mla_slot_ptr", "mla_ptr", "mla_scale_ptr", "mla_rope_ptr", "index_slot_ptr", "index_ptr", "index_scale_ptr",
    "topk_ptr",
]  # fmt: skip


def mla_entry_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token in the fp8_ds_mla cache: the FP8 latent, a float32 scale per 128 columns, bf16 k_pe (656)."""
    return kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * rope_dim


@triton.jit
def _rms_norm(x_ptr, w_ptr, eps, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < SIZE, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < SIZE, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / SIZE + eps) * w


@triton.jit
def _latent_insert(
    t, kv_ptr, kv_w_ptr, kv_out_ptr, pe_ptr, eps, slot_ptr, num_slots, mla_ptr, scale_ptr, rope_ptr, block_size,
    block_stride, entry_stride, KV: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """kv_a RMSNorm of token t into kv_out, and its fp8_ds_mla entry (latent, tile scales, k_pe) when it has a slot."""
    cols = tl.arange(0, KV)
    y = _rms_norm(kv_ptr, kv_w_ptr, eps, KV, KV).to(kv_out_ptr.dtype.element_ty)
    tl.store(kv_out_ptr + t * KV + cols, y)
    slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
    if slot >= 0:
        entry = (slot // block_size) * block_stride + (slot % block_size) * entry_stride
        TILES: tl.constexpr = KV // 128
        tiles = tl.reshape(y.to(tl.float32), (TILES, 128))
        amax = tl.max(tl.abs(tiles), axis=1, keep_dims=True)
        scale = tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(amax / FP8_MAX, 1e-4))))
        tl.store(mla_ptr + entry + cols, tl.reshape((tiles / scale).to(tl.float8e4nv), (KV,)))
        tl.store(scale_ptr + entry // 4 + KV // 4 + tl.arange(0, TILES), tl.reshape(scale, (TILES,)))
        rope = tl.arange(0, R)
        tl.store(rope_ptr + entry // 2 + KV // 2 + 2 * TILES + rope, tl.load(pe_ptr + rope))


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _dsa_prologue_kernel(
    q_ptr, q_stride, q_w_ptr, q_out_ptr,  # q_c [T, Q] (row stride), q_a RMSNorm weight, q_out [T, Q] contiguous
    kv_ptr, kv_stride, kv_w_ptr, kv_out_ptr,  # kv_c [T, KV], kv_a RMSNorm weight, kv_out [T, KV] contiguous
    pe_ptr, pe_stride,  # k_pe [T, R]
    k_ptr, k_stride, k_w_ptr, k_b_ptr,  # index_k [T, INDEX_DIM], its LayerNorm weight and bias
    eps,
    mla_slot_ptr, mla_num_slots, mla_ptr, mla_scale_ptr, mla_rope_ptr,  # the MLA cache as fp8, float32, bf16
    mla_block_size, mla_block_stride, mla_entry_stride,  # tokens per block, bytes per block, bytes per token
    index_slot_ptr, index_num_slots, index_ptr, index_scale_ptr, index_block_size, index_block_stride,
    topk_ptr, topk_stride,
    Q: tl.constexpr,  # q_lora_rank
    Q_BLOCK: tl.constexpr,  # next_pow2(Q)
    KV: tl.constexpr,  # kv_lora_rank: a power of two, 128-column scale tiles
    R: tl.constexpr,  # qk_rope_head_dim: k_pe's width, a power of two
    INDEX_DIM: tl.constexpr,  # index_head_dim: one quant block per key
    TOPK: tl.constexpr,  # index_topk
    TOPK_BLOCK: tl.constexpr,  # min(1024, next_pow2(TOPK))
    MX_SCALE: tl.constexpr,  # index scales as UE8M0 x4 (CUDA sm_10x), else float32
    USE_PDL: tl.constexpr,  # wait for the previous kernel first; matches the launch option launch_pdl
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    if part == 0:
        _key_insert(
            t, k_ptr + t * k_stride, k_w_ptr, k_b_ptr, eps, index_slot_ptr, index_num_slots, index_ptr,
            index_scale_ptr, index_block_size, index_block_stride, INDEX_DIM, MX_SCALE,
        )  # fmt: skip
    elif part == 1:
        _latent_insert(
            t, kv_ptr + t * kv_stride, kv_w_ptr, kv_out_ptr, pe_ptr + t * pe_stride, eps, mla_slot_ptr, mla_num_slots,
            mla_ptr, mla_scale_ptr, mla_rope_ptr, mla_block_size, mla_block_stride, mla_entry_stride, KV, R,
        )  # fmt: skip
    elif part == 2:
        cols = tl.arange(0, Q_BLOCK)
        y = _rms_norm(q_ptr + t * q_stride, q_w_ptr, eps, Q, Q_BLOCK)
        tl.store(q_out_ptr + t * Q + cols, y.to(q_out_ptr.dtype.element_ty), mask=cols < Q)
    else:
        _fill_minus_one(topk_ptr + t * topk_stride, TOPK, TOPK_BLOCK)


@attrs.frozen(kw_only=True)
class DSAPrologueKey(warmreg.CompileKey):
    """What changes the binary of the DSA fused prologue: no stride, size or alignment does."""

    dtype: str  # q_c, kv_c, k_pe and index_k (column slices of one projection) and the outputs
    norm_dtype: str  # q_a / kv_a RMSNorm weights
    k_norm_dtype: str  # the indexer key's LayerNorm weight and bias
    mla_slot_dtype: str
    index_slot_dtype: str
    q_dim: int
    q_block: int
    kv_dim: int
    rope_dim: int
    index_dim: int
    topk: int
    topk_block: int
    mx_scale: bool
    launch_pdl: bool  # USE_PDL and the launch option
    num_warps: int


class DSAFusedPrologue(warmreg.TritonKernel[DSAPrologueKey]):
    """The DSA layer's fused prologue (the module docstring has the math).

    :param layout: the deployment's DSA layout (domains only).
    :param max_num_batched_tokens: tokens in a step (domains only).
    """

    name = "kimi_k3.dsa_fused_prologue"
    key_type = DSAPrologueKey
    jit = _dsa_prologue_kernel

    def __init__(self, *, layout: DSALayout, max_num_batched_tokens: int) -> None:
        self.layout, self.max_num_batched_tokens = layout, max_num_batched_tokens

    def dispatch(
        self, *, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor,
        q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, topk_indices_buffer: torch.Tensor,
        mla_slot_mapping: torch.Tensor | None, index_slot_mapping: torch.Tensor | None, mx_scale: bool,
        launch_pdl: bool,
    ) -> DSAPrologueKey:  # fmt: skip
        q, topk = q_c.shape[-1], topk_indices_buffer.shape[-1]
        return DSAPrologueKey(
            dtype=warmreg.dtype_name(q_c.dtype), norm_dtype=warmreg.dtype_name(q_norm_weight.dtype),
            k_norm_dtype=warmreg.dtype_name(k_norm_weight.dtype),
            mla_slot_dtype="int64" if mla_slot_mapping is None else warmreg.dtype_name(mla_slot_mapping.dtype),
            index_slot_dtype="int64" if index_slot_mapping is None else warmreg.dtype_name(index_slot_mapping.dtype),
            q_dim=q, q_block=warmreg.next_pow2(q), kv_dim=kv_c.shape[-1], rope_dim=k_pe.shape[-1],
            index_dim=index_k.shape[-1], topk=topk, topk_block=topk_block(topk), mx_scale=bool(mx_scale),
            launch_pdl=bool(launch_pdl), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lay, t = self.layout, self.max_num_batched_tokens
        act, q = getattr(torch, lay.dtype), lay.q_lora_rank or 1
        return {
            "q_c": [warmreg.meta((t, q), act)],
            "kv_c": [warmreg.meta((t, lay.kv_lora_rank), act)],
            "k_pe": [warmreg.meta((t, lay.qk_rope_head_dim), act)],
            "index_k": [warmreg.meta((t, lay.index_head_dim), act)],
            "q_norm_weight": [warmreg.meta((q,), act)],  # RMSNorm weights in the model dtype
            "k_norm_weight": [warmreg.meta((lay.index_head_dim,), torch.float32)],  # KimiK3DSAIndexerKNorm: fp32
            "topk_indices_buffer": [warmreg.meta((t, lay.index_topk), torch.int32)],
            "mla_slot_mapping": [warmreg.meta((t,), torch.int64)],  # the forward context's, and the placeholder
            "index_slot_mapping": [warmreg.meta((t,), torch.int64)],
            "mx_scale": [platform.is_cuda and platform.sm // 10 == 10],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: DSAPrologueKey) -> Mapping[str, Any]:
        act, norm, k_norm = (getattr(torch, n) for n in (key.dtype, key.norm_dtype, key.k_norm_dtype))
        return {
            "q_c": warmreg.meta((1, key.q_dim), act), "kv_c": warmreg.meta((1, key.kv_dim), act),
            "k_pe": warmreg.meta((1, key.rope_dim), act), "index_k": warmreg.meta((1, key.index_dim), act),
            "q_norm_weight": warmreg.meta((key.q_dim,), norm), "kv_norm_weight": warmreg.meta((key.kv_dim,), norm),
            "k_norm_weight": warmreg.meta((key.index_dim,), k_norm), "k_norm_bias": warmreg.meta((key.index_dim,), k_norm),
            "eps": 1e-5, "topk_indices_buffer": warmreg.meta((1, key.topk), torch.int32),
            "mla_cache": warmreg.meta((1, 64, mla_entry_bytes(key.kv_dim, key.rope_dim)), torch.uint8),
            "mla_slot_mapping": warmreg.meta((1,), getattr(torch, key.mla_slot_dtype)),
            "index_cache": warmreg.meta((1, 64, key.index_dim + 4), torch.uint8),
            "index_slot_mapping": warmreg.meta((1,), getattr(torch, key.index_slot_dtype)),
            "mx_scale": key.mx_scale, "launch_pdl": key.launch_pdl,
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
        mx_scale: bool | None = None,
        launch_pdl: bool | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[DSAPrologueKey]:
        """``(q_c_normed, kv_c_normed)``, with the caches and the top-k rows written (vLLM's ``dsa_fused_prologue``,
        same arguments).

        :param q_c: ``[T, Q]``; ``kv_c`` ``[T, KV]`` (KV a power-of-two multiple of 128), ``k_pe`` ``[T, R]`` and
            ``index_k`` ``[T, D]`` (R, D powers of two): one float dtype, unit column strides, any row strides.
        :param q_norm_weight: ``[Q]``; ``kv_norm_weight`` ``[KV]``, of one dtype.
        :param k_norm_weight: ``[D]`` LayerNorm weight; ``k_norm_bias`` its bias, of the same dtype.
        :param eps: the three norms' epsilon.
        :param topk_indices_buffer: int32 ``[>= T, TOPK]``, unit column stride.
        :param mla_cache: one-byte ``[blocks, block_size, 656]`` fp8_ds_mla cache (any block stride, a multiple of
            4), or None with ``mla_slot_mapping`` None: no MLA insert. ``index_cache``: ``[blocks, block_size,
            D + 4]`` likewise, with ``index_slot_mapping``.
        :param mla_slot_mapping: int32 or int64 ``[S]``; tokens ``>= S`` or with a negative slot are not inserted.
        :param mx_scale: index scales as UE8M0 x4 (default: the local GPU is CUDA sm_10x).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: preallocated ``(q_c_normed, kv_c_normed)``, contiguous, of the outputs' shapes and dtype.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take, or a wrong ``out``.
        """
        t = q_c.shape[0]
        self._check(
            q_c, kv_c, k_pe, index_k, q_norm_weight, kv_norm_weight, k_norm_weight, k_norm_bias, topk_indices_buffer
        )
        mla_cache, mla_slot_mapping = self._cache(q_c, "mla_cache", mla_cache, mla_slot_mapping,
                                                  mla_entry_bytes(kv_c.shape[1], k_pe.shape[1]))  # fmt: skip
        index_cache, index_slot_mapping = self._cache(q_c, "index_cache", index_cache, index_slot_mapping,
                                                      index_k.shape[1] + 4)  # fmt: skip
        mx, pdl = mx_scale_default(mx_scale), local_pdl(launch_pdl)
        key = self.dispatch(
            q_c=q_c, kv_c=kv_c, k_pe=k_pe, index_k=index_k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
            topk_indices_buffer=topk_indices_buffer, mla_slot_mapping=mla_slot_mapping,
            index_slot_mapping=index_slot_mapping, mx_scale=mx, launch_pdl=pdl,
        )  # fmt: skip
        q_out, kv_out = self._outputs(out, t, key, q_c.dtype, q_c.device)
        mla, index = mla_cache.view(torch.uint8), index_cache.view(torch.uint8)
        kwargs = dict(
            q_ptr=q_c, q_stride=q_c.stride(0), q_w_ptr=q_norm_weight, q_out_ptr=q_out,
            kv_ptr=kv_c, kv_stride=kv_c.stride(0), kv_w_ptr=kv_norm_weight, kv_out_ptr=kv_out,
            pe_ptr=k_pe, pe_stride=k_pe.stride(0), k_ptr=index_k, k_stride=index_k.stride(0),
            k_w_ptr=k_norm_weight, k_b_ptr=k_norm_bias, eps=eps,
            mla_slot_ptr=mla_slot_mapping, mla_num_slots=mla_slot_mapping.shape[0],
            mla_ptr=mla.view(torch.float8_e4m3fn), mla_scale_ptr=mla.view(torch.float32),
            mla_rope_ptr=mla.view(torch.bfloat16), mla_block_size=mla.shape[1], mla_block_stride=mla.stride(0),
            mla_entry_stride=mla.stride(1),
            index_slot_ptr=index_slot_mapping, index_num_slots=index_slot_mapping.shape[0],
            index_ptr=index.view(torch.float8_e4m3fn), index_scale_ptr=index.view(torch.int32 if mx else torch.float32),
            index_block_size=index.shape[1], index_block_stride=index.stride(0),
            topk_ptr=topk_indices_buffer, topk_stride=topk_indices_buffer.stride(0),
            Q=key.q_dim, Q_BLOCK=key.q_block, KV=key.kv_dim, R=key.rope_dim, INDEX_DIM=key.index_dim, TOPK=key.topk,
            TOPK_BLOCK=key.topk_block, MX_SCALE=key.mx_scale, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, 4) if t else None, kwargs, (q_out, kv_out))

    def _outputs(
        self, out: Any, t: int, key: DSAPrologueKey, dtype: torch.dtype, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is not None and (not isinstance(out, tuple | list) or len(out) != 2):
            raise warmreg.LaunchError(
                self.name, f"out must be a tuple of 2 buffers (q_c_normed, kv_c_normed), got {type(out).__name__}"
            )
        q_out = warmreg.output(self.name, "out[0]", None if out is None else out[0], (t, key.q_dim), dtype, dev)
        kv_out = warmreg.output(self.name, "out[1]", None if out is None else out[1], (t, key.kv_dim), dtype, dev)
        return q_out, kv_out

    def _check(self, q: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, k: torch.Tensor, qw: torch.Tensor,
               kvw: torch.Tensor, kw: torch.Tensor, kb: torch.Tensor, topk: torch.Tensor) -> None:  # fmt: skip
        rows = [x for x in (q, kv, pe, k) if x.ndim == 2 and x.stride(1) == 1 and x.shape[0] == q.shape[0]]
        kv_dim, r, d = (x.shape[-1] for x in (kv, pe, k))
        pow2 = all(n == warmreg.next_pow2(n) for n in (kv_dim, r, d)) and kv_dim % 128 == 0 and d >= 4
        if len(rows) != 4 or len({x.dtype for x in rows}) != 1 or not q.dtype.is_floating_point or not pow2:
            raise warmreg.LaunchError(self.name, "q_c, kv_c, k_pe and index_k must be [T, *] of one float dtype with "
                                      "unit column strides, kv_c's width a power-of-two multiple of 128, k_pe's and "
                                      "index_k's powers of two (got " + ", ".join(f"{x.dtype} {tuple(x.shape)} "
                                      f"{x.stride()}" for x in (q, kv, pe, k)) + ")")  # fmt: skip
        norms = ((qw, q.shape[1]), (kvw, kv_dim), (kw, d), (kb, d))
        if (
            any(w.shape != (n,) or not w.is_contiguous() for w, n in norms)
            or qw.dtype != kvw.dtype
            or kw.dtype != kb.dtype
        ):
            raise warmreg.LaunchError(self.name, "q_norm_weight [Q] and kv_norm_weight [KV] (one dtype), k_norm_weight "
                                      "and k_norm_bias [D] (one dtype) must be contiguous (got " + ", ".join(
                                          f"{w.dtype} {tuple(w.shape)}" for w, _ in norms) + ")")  # fmt: skip
        if topk.ndim != 2 or topk.dtype != torch.int32 or topk.stride(1) != 1 or topk.shape[0] < q.shape[0]:
            raise warmreg.LaunchError(self.name, f"topk_indices_buffer must be an int32 [>= T = {q.shape[0]}, TOPK] with "
                                      f"unit column stride (got {topk.dtype} {tuple(topk.shape)})")  # fmt: skip
        if len({x.device for x in (q, kv, pe, k, qw, kvw, kw, kb, topk)}) > 1:
            raise warmreg.LaunchError(self.name, "inputs on several devices: use one device")

    def _cache(
        self, q_c: torch.Tensor, what: str, cache: torch.Tensor | None, slots: torch.Tensor | None, entry: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as uint8 pages and its slot mapping, checked; for a None one (profile runs) vLLM's placeholder,
        a one-entry cache and an empty slot mapping, so that nothing is inserted."""
        if cache is None or slots is None:
            return q_c.new_empty((1, 1, 4), dtype=torch.uint8), q_c.new_empty((0,), dtype=torch.int64)
        name = what.replace("cache", "slot_mapping")
        if (
            slots.ndim != 1
            or slots.dtype not in (torch.int32, torch.int64)
            or (slots.numel() > 1 and slots.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"{name} must be a contiguous int32 or int64 [S] "
                                      f"(got {slots.dtype} {tuple(slots.shape)})")  # fmt: skip
        if cache.device != q_c.device or slots.device != q_c.device:
            raise warmreg.LaunchError(self.name, f"{what} or {name} is not on {q_c.device}: use one device")
        return cache_pages(self.name, what, cache, entry), slots


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.float()


def _latent_insert_reference(kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    u8, n = cache.view(torch.uint8), min(kv.shape[0], slots.shape[0])
    tiles = kv[:n].float().unflatten(-1, (-1, 128))
    scale = torch.exp2(torch.ceil(torch.log2((tiles.abs().amax(-1, keepdim=True) / FP8_MAX.value).clamp(min=1e-4))))
    latent = (tiles / scale).to(torch.float8_e4m3fn).flatten(-2).view(torch.uint8)
    tail = torch.cat([scale.flatten(-2).view(torch.uint8), k_pe[:n].to(torch.bfloat16).view(torch.uint8)], -1)
    for t, slot in enumerate(slots[:n].tolist()):
        if slot >= 0:
            entry = u8[slot // u8.shape[1], slot % u8.shape[1]]
            entry[: kv.shape[1]] = latent[t]
            entry[kv.shape[1] :] = tail[t]


def dsa_prologue_reference(
    q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor, q_norm_weight: torch.Tensor,
    kv_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, k_norm_bias: torch.Tensor, eps: float,
    topk_indices_buffer: torch.Tensor, mla_cache: torch.Tensor | None, mla_slot_mapping: torch.Tensor | None,
    index_cache: torch.Tensor | None, index_slot_mapping: torch.Tensor | None, *, mx_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`DSAFusedPrologue`: ``(q_c_normed, kv_c_normed)``, the caches and the top-k rows
    written in place."""
    q_out = _rms_norm_reference(q_c, q_norm_weight, eps).to(q_c.dtype)
    kv_out = _rms_norm_reference(kv_c, kv_norm_weight, eps).to(kv_c.dtype)
    t = q_c.shape[0]
    if mla_cache is not None and mla_slot_mapping is not None:
        _latent_insert_reference(kv_out, k_pe, mla_slot_mapping, mla_cache)
    if index_cache is not None and index_slot_mapping is not None:
        dsa_k_insert_reference(
            index_k, k_norm_weight, k_norm_bias, eps, index_slot_mapping, index_cache, topk_indices_buffer, t,
            mx_scale=mx_scale,
        )  # fmt: skip
    else:
        topk_indices_buffer[:t] = -1
    return q_out, kv_out


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the fused prologue where vLLM packs the DSA layers' projections and the indexer cache is FP8 (see
    :mod:`.dsa`).

    :raises warmreg.ConfigError: for a malformed ``dsa_config`` or a missing ``serving.max_num_batched_tokens``.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or not layout.fused_prologue or layout.indexer_fp4:
        return
    tokens = config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN)
    registry.add(DSAFusedPrologue(layout=layout, max_num_batched_tokens=tokens), when=warmreg.is_cuda)
