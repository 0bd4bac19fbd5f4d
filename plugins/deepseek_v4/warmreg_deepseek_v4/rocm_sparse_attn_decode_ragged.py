"""ROCm DeepSeek-V4 sparse MLA decode in one pass over the ``fp8_ds_mla`` caches, on the archs vLLM has no split-KV
tuning for (vLLM 0.34 ``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_sparse_attn_decode_ragged_kernel``, launched
by ``_rocm_sparse_attn_decode_ragged_triton``'s fallback branch, ``if not (_ON_GFX942 or _ON_GFX950)``).

Decode query ``t`` (``q [T, H, 512]`` bf16) attends to two ragged segments of cache slots, the SWA cache's (``main``:
``main_indices[main_indptr[t]:main_indptr[t+1]]``) and, for C4 and C128 layers, the compressed cache's (``extra``),
each key dequantized as :func:`.rocm_sparse_attn_decode.dequant_fp8_ds_mla` reads it (a slot outside
``[0, pages * B)`` is skipped; NaN reads as 0; the SWA cache's FP8 is e4m3fnuz where the platform's is). One program
per ``(t, 16 heads)`` walks both segments in tiles of ``BLOCK_K`` keys with an online softmax (scores
``s_k = (q_nope . k_nope + q_rope . k_rope) * scale``, probabilities rounded to bf16 for the value dot, as in vLLM),
then folds in the head's sink ``z`` (``attn_sink``) and normalizes::

    M = max(max_k s_k, z);   L = sum_k exp(s_k - M) + exp(z - M);   out[t, h, :] = sum_k exp(s_k - M) k[:] / L

(without a sink: ``M = max_k s_k``, no ``exp(z - M)`` term; ``L == 0``, no key and no sink, writes zeros). The output
is bf16 ``[T, H, 512]``, fresh as vLLM allocates it (``torch.empty_like(q, dtype=torch.bfloat16)``; its caller copies
it into the layer's output), or ``out``. The RoPE lanes are not rotated back: on gfx1250 and RDNA the layer does not
fold the inverse RoPE into decode (``fuse_decode_inv_rope``), so ``forward_mqa``'s standalone pass rotates every row.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` (``models/deepseek_v4/amd/rocm.py``) on every step
with decode tokens, every layer type: ``rocm_sparse_attn_decode(q=q[:num_decode_tokens], kv_cache, swa_k_cache, ...)``
on any ROCm arch but gfx942 (:mod:`.rocm_sparse_attn_decode`) and gfx950 (:mod:`.rocm_sparse_attn_decode_gfx950`):
gfx1250 and RDNA (gfx11xx, gfx12xx). aiter's sparse MLA (:func:`._rocm_attention.aiter_sparse_mla`) is gfx950's alone.

Key: the q dtype, the sink, the extra segment, the NoPE / RoPE widths, both caches' FP8 flavours, the blocks (16 heads;
16 keys for vLLM's 512-wide heads, 32 below 256) and the warps (8), vLLM's constexprs. Strides, row counts, page sizes
and the head count are runtime ints (``do_not_specialize``; vLLM specializes them). Offsets into the caches are 64-bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from .model import DSV4
from .rocm_sparse_attn_decode import check_segment, dequant_fp8_ds_mla

__all__ = [
    "RocmSparseAttnDecodeRagged",
    "RocmSparseAttnDecodeRaggedKey",
    "SPLIT_KV_ARCHS",
    "decode_ragged_reference",
    "register",
]

_BLOCK_H, _NUM_WARPS = 16, 8
_TOKEN, _SCALES, _GROUP = 576, 8, 64  # fp8_ds_mla: token bytes, scale bytes a token, NoPE lanes a scale
_NEG = tl.constexpr(-3.4028234663852886e38)
_LAYOUT_TOKEN = tl.constexpr(_TOKEN)
_LAYOUT_SCALES = tl.constexpr(_SCALES)
_LAYOUT_GROUP = tl.constexpr(_GROUP)
#: The archs with vLLM's split-KV decode (``_ON_GFX942``, ``_ON_GFX950``); every other ROCm arch takes this kernel.
SPLIT_KV_ARCHS = ("gfx942", "gfx950")


@triton.jit
def _walk(q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, cache_ptr, idx_ptr, indptr_ptr, t, num_rows, page, page_stride,
          scale, head_ok, NOPE_DIM: tl.constexpr, NOPE_BLOCK: tl.constexpr, ROPE_DIM: tl.constexpr,
          FNUZ: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The online softmax over query ``t``'s segment of one cache (vLLM's key loop, no split); returns the state."""
    lanes = tl.arange(0, BLOCK_K)
    nope = tl.arange(0, NOPE_BLOCK)
    nope_ok = nope < NOPE_DIM
    rope = tl.arange(0, ROPE_DIM)
    start = tl.load(indptr_ptr + t)
    length = tl.load(indptr_ptr + t + 1) - start
    for k0 in tl.range(0, length, BLOCK_K):
        inside = k0 + lanes < length
        slot = tl.load(idx_ptr + start + k0 + lanes, mask=inside, other=-1)
        live = inside & (slot >= 0) & (slot < num_rows)
        slot = tl.where(live, slot, 0)
        base = cache_ptr + (slot // page).to(tl.int64) * page_stride
        token = base + (slot % page) * _LAYOUT_TOKEN
        both = live[:, None] & nope_ok[None, :]
        raw = tl.load(token[:, None] + nope[None, :], mask=both, other=0)
        fp8 = raw.to(tl.float8e4b8, bitcast=True) if FNUZ else raw.to(tl.float8e4nv, bitcast=True)
        exps = tl.load((base + page * _LAYOUT_TOKEN + (slot % page) * _LAYOUT_SCALES)[:, None] + nope[None, :] // _LAYOUT_GROUP,
                       mask=both, other=127)  # fmt: skip
        k_nope = fp8.to(tl.bfloat16) * tl.exp2(exps.to(tl.float32) - 127.0).to(tl.bfloat16)
        k_nope = tl.where(both & (k_nope == k_nope), k_nope, 0.0).to(tl.bfloat16)
        k_rope = tl.load((token + NOPE_DIM).to(tl.pointer_type(tl.bfloat16))[:, None] + rope[None, :],
                         mask=live[:, None], other=0.0)  # fmt: skip
        k_rope = tl.where(live[:, None] & (k_rope == k_rope), k_rope, 0.0).to(tl.bfloat16)
        scores = (tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))) * scale
        keep = head_ok[:, None] & live[None, :]
        scores = tl.where(keep, scores, _NEG)
        new_max = tl.maximum(m_i, tl.max(scores, axis=1))
        decay = tl.exp(m_i - new_max)
        p = tl.where(keep, tl.exp(scores - new_max[:, None]), 0.0)
        l_i = l_i * decay + tl.sum(p, axis=1)
        acc_nope = acc_nope * decay[:, None] + tl.dot(p.to(tl.bfloat16), k_nope)
        acc_rope = acc_rope * decay[:, None] + tl.dot(p.to(tl.bfloat16), k_rope)
        m_i = new_max
    return m_i, l_i, acc_nope, acc_rope


@triton.jit(
    do_not_specialize=[
        "q_stride_t", "q_stride_h", "out_stride_t", "out_stride_h", "main_stride", "extra_stride", "main_rows",
        "extra_rows", "main_page", "extra_page", "num_heads",
    ]
)  # fmt: skip
def _rocm_decode_ragged_kernel(
    q_ptr, main_ptr, main_idx_ptr, main_indptr_ptr, extra_ptr, extra_idx_ptr, extra_indptr_ptr, sink_ptr, out_ptr,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, main_stride, extra_stride, main_rows, extra_rows, main_page,
    extra_page, scale, num_heads,
    HAS_SINK: tl.constexpr,  # fold the head's sink into the normalization
    HAS_EXTRA: tl.constexpr,  # walk the compressed cache's segment too
    NOPE_DIM: tl.constexpr,  # FP8 lanes
    NOPE_BLOCK: tl.constexpr,  # next_pow2(NOPE_DIM)
    ROPE_DIM: tl.constexpr,  # bf16 lanes
    FNUZ_MAIN: tl.constexpr,  # the SWA cache's FP8 is e4m3fnuz
    FNUZ_EXTRA: tl.constexpr,  # the compressed cache's FP8 is e4m3fnuz
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_K: tl.constexpr,  # keys a tile
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    nope = tl.arange(0, NOPE_BLOCK)
    nope_ok = nope < NOPE_DIM
    rope = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + t * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h
    q_nope = tl.load(q_row + nope[None, :], mask=head_ok[:, None] & nope_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + NOPE_DIM + rope[None, :], mask=head_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), _NEG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_nope = tl.zeros((BLOCK_H, NOPE_BLOCK), dtype=tl.float32)
    acc_rope = tl.zeros((BLOCK_H, ROPE_DIM), dtype=tl.float32)
    m_i, l_i, acc_nope, acc_rope = _walk(
        q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, main_ptr, main_idx_ptr, main_indptr_ptr, t, main_rows, main_page,
        main_stride, scale, head_ok, NOPE_DIM, NOPE_BLOCK, ROPE_DIM, FNUZ_MAIN, BLOCK_K,
    )  # fmt: skip
    if HAS_EXTRA:
        m_i, l_i, acc_nope, acc_rope = _walk(
            q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, extra_ptr, extra_idx_ptr, extra_indptr_ptr, t, extra_rows,
            extra_page, extra_stride, scale, head_ok, NOPE_DIM, NOPE_BLOCK, ROPE_DIM, FNUZ_EXTRA, BLOCK_K,
        )  # fmt: skip
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=_NEG).to(tl.float32)
        top = tl.maximum(m_i, sink)
        decay = tl.exp(m_i - top)
        total = l_i * decay + tl.exp(sink - top)
        denom = tl.maximum(total, 1.0e-30)
        out_nope = tl.where(total[:, None] > 0.0, (acc_nope * decay[:, None]) / denom[:, None], 0.0)
        out_rope = tl.where(total[:, None] > 0.0, (acc_rope * decay[:, None]) / denom[:, None], 0.0)
    else:
        denom = tl.maximum(l_i, 1.0e-30)
        out_nope = tl.where(l_i[:, None] > 0.0, acc_nope / denom[:, None], 0.0)
        out_rope = tl.where(l_i[:, None] > 0.0, acc_rope / denom[:, None], 0.0)
    out_row = out_ptr + t * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h
    tl.store(out_row + nope[None, :], out_nope, mask=head_ok[:, None] & nope_ok[None, :])
    tl.store(out_row + NOPE_DIM + rope[None, :], out_rope, mask=head_ok[:, None])


@attrs.frozen(kw_only=True)
class RocmSparseAttnDecodeRaggedKey(warmreg.CompileKey):
    """What changes the binary of the single-pass decode: the q dtype, the sink, the extra segment, widths, FP8
    flavours, blocks and warps."""

    q_dtype: str
    has_sink: bool
    has_extra: bool
    nope: int
    nope_block: int
    rope: int
    fnuz_main: bool
    fnuz_extra: bool
    block_h: int
    block_k: int
    num_warps: int


class RocmSparseAttnDecodeRagged(warmreg.TritonKernel[RocmSparseAttnDecodeRaggedKey]):
    """ROCm's single-pass sparse MLA decode off gfx942 and gfx950 (see the module docstring).

    :param rope_head_dim: the RoPE lanes at the end of each head (64).
    """

    name = "deepseek_v4.rocm_sparse_attn_decode_ragged"
    key_type = RocmSparseAttnDecodeRaggedKey
    jit = _rocm_decode_ragged_kernel

    def __init__(self, *, rope_head_dim: int = 64) -> None:
        self.rope_head_dim = rope_head_dim

    def dispatch(
        self,
        *,
        q: torch.Tensor,
        fnuz_main: bool,
        attn_sink: torch.Tensor | None = None,
        extra_cache: torch.Tensor | None = None,
    ) -> RocmSparseAttnDecodeRaggedKey:
        dim = q.shape[-1]
        nope = dim - self.rope_head_dim
        return RocmSparseAttnDecodeRaggedKey(
            q_dtype=warmreg.dtype_name(q.dtype), has_sink=attn_sink is not None, has_extra=extra_cache is not None,
            nope=nope, nope_block=warmreg.next_pow2(nope), rope=self.rope_head_dim, fnuz_main=fnuz_main,
            fnuz_extra=False, block_h=_BLOCK_H, block_k=16 if dim >= 256 else 32, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        cache = warmreg.meta((1, 1, _TOKEN + _SCALES), torch.uint8)
        return {  # the layer always has its fp32 sink; SWA-only layers read the SWA cache alone
            "q": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "attn_sink": [warmreg.meta((heads,), torch.float32)],
            "extra_cache": [cache if r > 1 else None for r in sorted({min(r, 2) for r in model.ratios})],
            "fnuz_main": [platform.fp8_fnuz],
        }

    def warmup_inputs(self, key: RocmSparseAttnDecodeRaggedKey) -> Mapping[str, Any]:
        cache, vector = warmreg.meta((1, 1, _TOKEN + _SCALES), torch.uint8), warmreg.meta((2,), torch.int32)
        extra = {"extra_cache": cache, "extra_indices": vector, "extra_indptr": vector} if key.has_extra else {
            "extra_cache": None, "extra_indices": None, "extra_indptr": None}  # fmt: skip
        return {
            "q": warmreg.meta((1, 1, key.nope + key.rope), getattr(torch, key.q_dtype)), "main_cache": cache,
            "main_indices": vector, "main_indptr": vector, **extra,
            "attn_sink": warmreg.meta((1,), torch.float32) if key.has_sink else None, "scale": 0.5,
            "fnuz_main": key.fnuz_main,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        main_cache: torch.Tensor,
        main_indices: torch.Tensor,
        main_indptr: torch.Tensor,
        extra_cache: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_indptr: torch.Tensor | None = None,
        *,
        attn_sink: torch.Tensor | None,
        scale: float,
        fnuz_main: bool,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RocmSparseAttnDecodeRaggedKey]:
        """The bf16 attention output ``[T, H, D]``, fresh as vLLM allocates it, or ``out``.

        :param q: ``[T, H, D]`` queries (bf16), last dim contiguous, any row and head strides.
        :param main_cache: the SWA cache, uint8 ``[pages, B, >= 584]``: pages of ``B`` tokens at ``stride(0)``.
        :param main_indices: int32 contiguous ragged stream of SWA slots; ``main_indptr`` int32 ``[T + 1]``.
        :param extra_cache: the compressed cache (OCP FP8), with ``extra_indices`` and ``extra_indptr``, or none.
        :param attn_sink: the heads' fp32 sinks (``[>= H]``, contiguous), or None.
        :param scale: the softmax scale; ``fnuz_main``: the SWA cache's FP8 is FNUZ.
        :param out: a contiguous bf16 ``[T, H, D]`` buffer to write instead of a fresh one.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or an ``out`` unlike the fresh one.
        """
        extras = (extra_cache, extra_indices, extra_indptr)
        has_extra = extra_cache is not None
        if any((t is None) == has_extra for t in extras):
            raise warmreg.LaunchError(self.name, "pass extra_cache, extra_indices and extra_indptr together, or none")
        check_segment(self.name, self.rope_head_dim, q, main_cache, main_indices, main_indptr, "main")
        if extra_cache is not None and extra_indices is not None and extra_indptr is not None:
            check_segment(self.name, self.rope_head_dim, q, extra_cache, extra_indices, extra_indptr, "extra")
        tokens, heads, dim = q.shape
        if attn_sink is not None and (
            attn_sink.dtype != torch.float32 or attn_sink.ndim != 1 or attn_sink.shape[0] < heads
            or (attn_sink.shape[0] > 1 and attn_sink.stride(0) != 1)
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"attn_sink must be a contiguous fp32 [>= {heads}] tensor (got "
                                      f"{attn_sink.dtype} {tuple(attn_sink.shape)})")  # fmt: skip
        key = self.dispatch(q=q, fnuz_main=fnuz_main, attn_sink=attn_sink, extra_cache=extra_cache)
        output = warmreg.output(self.name, "out", out, (tokens, heads, dim), torch.bfloat16, q.device)
        extra = extra_cache if extra_cache is not None else main_cache
        kwargs = dict(
            q_ptr=q, main_ptr=main_cache, main_idx_ptr=main_indices, main_indptr_ptr=main_indptr, extra_ptr=extra,
            extra_idx_ptr=extra_indices if has_extra else main_indices,
            extra_indptr_ptr=extra_indptr if has_extra else main_indptr,
            sink_ptr=attn_sink if attn_sink is not None else main_indptr, out_ptr=output, q_stride_t=q.stride(0),
            q_stride_h=q.stride(1), out_stride_t=output.stride(0), out_stride_h=output.stride(1),
            main_stride=main_cache.stride(0), extra_stride=extra.stride(0),
            main_rows=main_cache.shape[0] * main_cache.shape[1], extra_rows=extra.shape[0] * extra.shape[1],
            main_page=main_cache.shape[1], extra_page=extra.shape[1], scale=float(scale), num_heads=heads,
            HAS_SINK=key.has_sink, HAS_EXTRA=key.has_extra, NOPE_DIM=key.nope, NOPE_BLOCK=key.nope_block,
            ROPE_DIM=key.rope, FNUZ_MAIN=key.fnuz_main, FNUZ_EXTRA=key.fnuz_extra, BLOCK_H=key.block_h,
            BLOCK_K=key.block_k,
        )  # fmt: skip
        grid = (tokens, triton.cdiv(heads, key.block_h)) if tokens and heads else None
        return warmreg.LaunchSpec(key, grid, kwargs, output)


def decode_ragged_reference(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]],
    attn_sink: torch.Tensor | None,
    *,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmSparseAttnDecodeRagged` (exact softmax in fp32, bf16 output): ``segments``
    are ``(cache, indices, indptr, fnuz)``, the SWA one first."""
    tokens, heads, dim = q.shape
    out = torch.zeros(tokens, heads, dim)
    for t in range(tokens):
        keys = []
        for cache, indices, indptr, fnuz in segments:
            slots = indices[int(indptr[t]) : int(indptr[t + 1])].long()
            slots = slots[(slots >= 0) & (slots < cache.shape[0] * cache.shape[1])]
            keys.append(dequant_fp8_ds_mla(cache, slots, fnuz=fnuz, nope=dim - 64).float())
        k = torch.cat(keys)
        s = q[t].float() @ k.T * scale  # [H, n]
        top = s.max(dim=1).values if k.shape[0] else torch.full((heads,), float("-inf"))
        if attn_sink is not None:
            top = torch.maximum(top, attn_sink[:heads].float())
        top = torch.where(top.isinf(), torch.zeros_like(top), top)  # no key and no (finite) sink: nothing to weigh
        w = torch.exp(s - top[:, None])
        total = w.sum(dim=1) + (torch.exp(attn_sink[:heads].float() - top) if attn_sink is not None else 0.0)
        out[t] = torch.where(total[:, None] > 0, (w @ k) / total.clamp_min(1e-30)[:, None], 0.0)
    return out.to(torch.bfloat16)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the single-pass decode on every ROCm arch but gfx942 and gfx950 (see the module docstring; aiter's
    sparse MLA decode is gfx950's alone, so it never takes this kernel's place)."""
    registry.add(RocmSparseAttnDecodeRagged(rope_head_dim=model.qk_rope_head_dim),
                 when=warmreg.is_rocm & ~warmreg.rocm_arch_in(*SPLIT_KV_ARCHS))  # fmt: skip
