"""ROCm DeepSeek-V4 sparse MLA decode, split-KV partial pass over the ``fp8_ds_mla`` caches (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_sparse_attn_decode_partial_kernel``, launched by
``_rocm_sparse_attn_decode_ragged_triton`` off gfx950; its reduce is :mod:`.rocm_sparse_attn_reduce`).

Decode query ``t`` (``q [T, H, 512]`` bf16) attends to two ragged segments of cache slots: the SWA cache's
(``main``: ``main_indices[main_indptr[t]:main_indptr[t+1]]``) and, for C4 and C128 layers, the compressed cache's
(``extra``). A slot ``s`` is token ``s % B`` of page ``s // B`` (``B = cache.shape[1]``; a slot outside
``[0, pages * B)`` is skipped); its key and value are the same 512 lanes, dequantized as vLLM does::

    k[:448] = bf16(fp8(bytes[576 p : 576 p + 448])) * bf16(2 ** (scale_byte[p, d // 64] - 127))  (NaN -> 0)
    k[448:] = bf16(bytes[576 p + 448 : 576 p + 576])                                           (NaN -> 0)

(token ``p`` of its page; scale bytes after the page's ``B * 576`` token bytes, 8 a token; fp8 is e4m3fnuz where the
cache is FNUZ: the SWA cache on gfx942, never the compressed one). Split ``j`` of ``S`` takes the ``j``-th
``ceil(len / S)`` of each segment and keeps, per head, the raw online-softmax state over its keys
(``s_k = (q_nope . k_nope + q_rope . k_rope) * scale``, tiles of 32 keys, probabilities rounded to bf16 for the value
dot, as in vLLM)::

    part_m[t, j, h] = max_k s_k  (fp32 lowest without keys);   part_l[t, j, h] = sum_k exp(s_k - m)
    part_acc[t, j, h, :] = sum_k exp(s_k - m) k[:]

Grid ``(T, S, cdiv(H, 16))``. vLLM's ``NUM_SPLITS`` is a constexpr; this kernel reads ``S`` as ``tl.num_programs(1)``
(the same arithmetic), so one binary serves every split count. :func:`decode_gfx942` picks ``S`` as vLLM does
(:mod:`._rocm_decode_splits`) and chains the reduce.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` (``models/deepseek_v4/amd/rocm.py``) on every step
with decode tokens, every layer type, unless decode takes aiter's sparse MLA (:func:`._rocm_attention.aiter_sparse_mla`):
``rocm_sparse_attn_decode(q=q[:num_decode_tokens], kv_cache, swa_k_cache, ...)`` with the SWA builder's decode rows,
and the C4 layers' top-k stream or the C128 builder's rows. gfx942 launches this kernel; gfx950 its own partial kernel
(:mod:`.rocm_sparse_attn_decode_gfx950`), other archs a single-pass kernel (``_sparse_attn_decode_ragged_kernel``,
not an op yet).

Key: the q dtype, the extra segment, the NoPE / RoPE widths, both caches' FP8 flavours, the blocks (16 heads, 32 keys),
the pipelining of the key loop (1 stage) and the warps (4), vLLM's constexprs. Strides, row counts, page sizes and the
head count are runtime ints (``do_not_specialize``; vLLM specializes them). Offsets into the caches are 64-bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import out_parts
from ._rocm_attention import aiter_sparse_mla
from ._rocm_decode_splits import cu_count, decode_num_splits
from ._serving import serving_int
from .model import DSV4
from .rocm_sparse_attn_reduce import RocmSparseAttnReduce

__all__ = [
    "RocmSparseAttnDecodePartial",
    "RocmSparseAttnDecodePartialKey",
    "check_segment",
    "decode_gfx942",
    "decode_partial_reference",
    "dequant_fp8_ds_mla",
    "register",
]

_BLOCK_H, _BLOCK_K, _NUM_STAGES, _NUM_WARPS = 16, 32, 1, 4
_TOKEN, _SCALES, _GROUP = 576, 8, 64  # fp8_ds_mla: token bytes, scale bytes a token, NoPE lanes a scale
_NEG = tl.constexpr(-3.4028234663852886e38)
_LAYOUT_TOKEN = tl.constexpr(_TOKEN)
_LAYOUT_SCALES = tl.constexpr(_SCALES)
_LAYOUT_GROUP = tl.constexpr(_GROUP)


@triton.jit
def _segment(q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, cache_ptr, idx_ptr, lo, hi, num_rows, page, page_stride,
             scale, head_ok, NOPE_DIM: tl.constexpr, NOPE_BLOCK: tl.constexpr, ROPE_DIM: tl.constexpr,
             FNUZ: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """The online softmax over slots ``idx_ptr[lo:hi]`` of one cache; returns the updated state."""
    lanes = tl.arange(0, BLOCK_K)
    nope = tl.arange(0, NOPE_BLOCK)
    nope_ok = nope < NOPE_DIM
    rope = tl.arange(0, ROPE_DIM)
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=NUM_STAGES):
        inside = k0 + lanes < hi
        slot = tl.load(idx_ptr + k0 + lanes, mask=inside, other=-1)
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
        "q_stride_t", "q_stride_h", "main_stride", "extra_stride", "pm_stride_t", "pm_stride_s", "pa_stride_t",
        "pa_stride_s", "pa_stride_h", "main_rows", "extra_rows", "main_page", "extra_page", "num_heads",
    ]
)  # fmt: skip
def _rocm_decode_partial_kernel(
    q_ptr, main_ptr, main_idx_ptr, main_indptr_ptr, extra_ptr, extra_idx_ptr, extra_indptr_ptr, part_m_ptr,
    part_l_ptr, part_acc_ptr, q_stride_t, q_stride_h, main_stride, extra_stride, pm_stride_t, pm_stride_s, pa_stride_t,
    pa_stride_s, pa_stride_h, main_rows, extra_rows, main_page, extra_page, scale, num_heads,
    HAS_EXTRA: tl.constexpr,  # walk the compressed cache's segment too
    NOPE_DIM: tl.constexpr,  # FP8 lanes
    NOPE_BLOCK: tl.constexpr,  # next_pow2(NOPE_DIM)
    ROPE_DIM: tl.constexpr,  # bf16 lanes
    FNUZ_MAIN: tl.constexpr,  # the SWA cache's FP8 is e4m3fnuz
    FNUZ_EXTRA: tl.constexpr,  # the compressed cache's FP8 is e4m3fnuz
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_K: tl.constexpr,  # keys a tile
    NUM_STAGES: tl.constexpr,  # pipelining of the key loop
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    nope = tl.arange(0, NOPE_BLOCK)
    rope = tl.arange(0, ROPE_DIM)
    q_row = q_ptr + t * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h
    q_nope = tl.load(q_row + nope[None, :], mask=head_ok[:, None] & (nope < NOPE_DIM)[None, :], other=0.0)
    q_rope = tl.load(q_row + NOPE_DIM + rope[None, :], mask=head_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), _NEG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_nope = tl.zeros((BLOCK_H, NOPE_BLOCK), dtype=tl.float32)
    acc_rope = tl.zeros((BLOCK_H, ROPE_DIM), dtype=tl.float32)
    start = tl.load(main_indptr_ptr + t)
    length = tl.load(main_indptr_ptr + t + 1) - start
    chunk = (length + splits - 1) // splits
    lo = split * chunk
    m_i, l_i, acc_nope, acc_rope = _segment(
        q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, main_ptr, main_idx_ptr + start, lo,
        tl.minimum(lo + chunk, length), main_rows, main_page, main_stride, scale, head_ok, NOPE_DIM, NOPE_BLOCK,
        ROPE_DIM, FNUZ_MAIN, BLOCK_K, NUM_STAGES,
    )  # fmt: skip
    if HAS_EXTRA:
        start = tl.load(extra_indptr_ptr + t)
        length = tl.load(extra_indptr_ptr + t + 1) - start
        chunk = (length + splits - 1) // splits
        lo = split * chunk
        m_i, l_i, acc_nope, acc_rope = _segment(
            q_nope, q_rope, m_i, l_i, acc_nope, acc_rope, extra_ptr, extra_idx_ptr + start, lo,
            tl.minimum(lo + chunk, length), extra_rows, extra_page, extra_stride, scale, head_ok, NOPE_DIM,
            NOPE_BLOCK, ROPE_DIM, FNUZ_EXTRA, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
    at = t * pm_stride_t + split * pm_stride_s + heads
    tl.store(part_m_ptr + at, m_i, mask=head_ok)
    tl.store(part_l_ptr + at, l_i, mask=head_ok)
    acc_row = part_acc_ptr + t * pa_stride_t + split * pa_stride_s + heads[:, None].to(tl.int64) * pa_stride_h
    tl.store(acc_row + nope[None, :], acc_nope, mask=head_ok[:, None] & (nope < NOPE_DIM)[None, :])
    tl.store(acc_row + NOPE_DIM + rope[None, :], acc_rope, mask=head_ok[:, None])


@attrs.frozen(kw_only=True)
class RocmSparseAttnDecodePartialKey(warmreg.CompileKey):
    """What changes the binary of the decode partial pass: the q dtype, the extra segment, widths, FP8 flavours,
    blocks, stages and warps."""

    q_dtype: str
    has_extra: bool
    nope: int
    nope_block: int
    rope: int
    fnuz_main: bool
    fnuz_extra: bool
    block_h: int
    block_k: int
    num_stages: int
    num_warps: int


class RocmSparseAttnDecodePartial(warmreg.TritonKernel[RocmSparseAttnDecodePartialKey]):
    """The split-KV partial pass of ROCm's sparse MLA decode (see the module docstring).

    :param rope_head_dim: the RoPE lanes at the end of each head (64).
    """

    name = "deepseek_v4.rocm_sparse_attn_decode_partial"
    key_type = RocmSparseAttnDecodePartialKey
    jit = _rocm_decode_partial_kernel

    def __init__(self, *, rope_head_dim: int = 64) -> None:
        self.rope_head_dim = rope_head_dim

    def dispatch(
        self, *, q: torch.Tensor, fnuz_main: bool, extra_cache: torch.Tensor | None = None
    ) -> RocmSparseAttnDecodePartialKey:
        nope = q.shape[-1] - self.rope_head_dim
        return RocmSparseAttnDecodePartialKey(
            q_dtype=warmreg.dtype_name(q.dtype), has_extra=extra_cache is not None, nope=nope, nope_block=warmreg.next_pow2(nope),
            rope=self.rope_head_dim, fnuz_main=fnuz_main, fnuz_extra=False, block_h=_BLOCK_H, block_k=_BLOCK_K,
            num_stages=_NUM_STAGES, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        cache = warmreg.meta((1, 1, _TOKEN + _SCALES), torch.uint8)
        return {  # SWA-only layers read the SWA cache alone; the SWA cache is FNUZ where the platform's FP8 is
            "q": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "extra_cache": [cache if r > 1 else None for r in sorted({min(r, 2) for r in model.ratios})],
            "fnuz_main": [platform.fp8_fnuz],
        }

    def warmup_inputs(self, key: RocmSparseAttnDecodePartialKey) -> Mapping[str, Any]:
        cache, vector = warmreg.meta((1, 1, _TOKEN + _SCALES), torch.uint8), warmreg.meta((2,), torch.int32)
        extra = {"extra_cache": cache, "extra_indices": vector, "extra_indptr": vector} if key.has_extra else {
            "extra_cache": None, "extra_indices": None, "extra_indptr": None}  # fmt: skip
        return {
            "q": warmreg.meta((1, 1, key.nope + key.rope), getattr(torch, key.q_dtype)), "main_cache": cache,
            "main_indices": vector, "main_indptr": vector, **extra, "scale": 0.5, "num_splits": 1,
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
        scale: float,
        num_splits: int,
        fnuz_main: bool,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RocmSparseAttnDecodePartialKey]:
        """``(part_m [T, S, H], part_l [T, S, H], part_acc [T, S, H, D])`` fp32 (``S = num_splits``), fresh as vLLM
        allocates them, or ``out``.

        :param q: ``[T, H, D]`` queries (bf16), last dim contiguous, any row and head strides.
        :param main_cache: the SWA cache, uint8 ``[pages, B, >= 584]``: pages of ``B`` tokens at ``stride(0)``.
        :param main_indices: int32 contiguous ragged stream of SWA slots; ``main_indptr`` int32 ``[T + 1]``.
        :param extra_cache: the compressed cache (OCP FP8), with ``extra_indices`` and ``extra_indptr``, or none.
        :param scale: the softmax scale; ``num_splits``: ``S >= 1``; ``fnuz_main``: the SWA cache's FP8 is FNUZ.
        :param out: the three buffers to write instead of fresh ones, exactly as they would be allocated.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or an ``out`` unlike the fresh ones.
        """
        extras = (extra_cache, extra_indices, extra_indptr)
        has_extra = extra_cache is not None
        if any((t is None) == has_extra for t in extras):
            raise warmreg.LaunchError(self.name, "pass extra_cache, extra_indices and extra_indptr together, or none")
        check_segment(self.name, self.rope_head_dim, q, main_cache, main_indices, main_indptr, "main")
        if extra_cache is not None and extra_indices is not None and extra_indptr is not None:
            check_segment(self.name, self.rope_head_dim, q, extra_cache, extra_indices, extra_indptr, "extra")
        if num_splits < 1:
            raise warmreg.LaunchError(self.name, f"num_splits must be >= 1 (got {num_splits})")
        key = self.dispatch(q=q, fnuz_main=fnuz_main, extra_cache=extra_cache)
        tokens, heads, dim = q.shape
        out_m, out_l, out_acc = out_parts(self.name, out, 3)
        f32, dev = torch.float32, q.device
        part_m = warmreg.output(self.name, "out[0]", out_m, (tokens, num_splits, heads), f32, dev)
        part_l = warmreg.output(self.name, "out[1]", out_l, (tokens, num_splits, heads), f32, dev)
        part_acc = warmreg.output(self.name, "out[2]", out_acc, (tokens, num_splits, heads, dim), f32, dev)
        extra = extra_cache if extra_cache is not None else main_cache
        kwargs = dict(
            q_ptr=q, main_ptr=main_cache, main_idx_ptr=main_indices, main_indptr_ptr=main_indptr, extra_ptr=extra,
            extra_idx_ptr=extra_indices if has_extra else main_indices,
            extra_indptr_ptr=extra_indptr if has_extra else main_indptr, part_m_ptr=part_m, part_l_ptr=part_l,
            part_acc_ptr=part_acc, q_stride_t=q.stride(0), q_stride_h=q.stride(1), main_stride=main_cache.stride(0),
            extra_stride=extra.stride(0), pm_stride_t=part_m.stride(0), pm_stride_s=part_m.stride(1),
            pa_stride_t=part_acc.stride(0), pa_stride_s=part_acc.stride(1), pa_stride_h=part_acc.stride(2),
            main_rows=main_cache.shape[0] * main_cache.shape[1], extra_rows=extra.shape[0] * extra.shape[1],
            main_page=main_cache.shape[1], extra_page=extra.shape[1], scale=float(scale), num_heads=heads,
            HAS_EXTRA=key.has_extra, NOPE_DIM=key.nope, NOPE_BLOCK=key.nope_block, ROPE_DIM=key.rope,
            FNUZ_MAIN=key.fnuz_main, FNUZ_EXTRA=key.fnuz_extra, BLOCK_H=key.block_h, BLOCK_K=key.block_k,
            NUM_STAGES=key.num_stages,
        )  # fmt: skip
        grid = (tokens, num_splits, triton.cdiv(heads, key.block_h)) if tokens and heads else None
        return warmreg.LaunchSpec(key, grid, kwargs, (part_m, part_l, part_acc))


def check_segment(
    kernel: str,
    rope_head_dim: int,
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    which: str,
) -> None:
    """The decode partial passes' checks of ``q`` and one segment (``which``: ``"main"`` or ``"extra"``).

    :raises warmreg.LaunchError: naming ``kernel`` and the argument.
    """
    if q.dtype != torch.bfloat16 or q.ndim != 3 or q.stride(2) != 1 or q.shape[2] <= rope_head_dim:
        raise warmreg.LaunchError(kernel, f"q must be bf16 [T, H, D > {rope_head_dim}] with a contiguous "
                                  f"last dim (got {q.dtype} {tuple(q.shape)})")  # fmt: skip
    if cache.dtype != torch.uint8 or cache.ndim != 3 or cache.shape[2] < _TOKEN + _SCALES or cache.stride(2) != 1:
        raise warmreg.LaunchError(kernel, f"{which}_cache must be uint8 [pages, B, >= 584] fp8_ds_mla pages "
                                  f"(got {cache.dtype} {tuple(cache.shape)})")  # fmt: skip
    for name, t, n in ((f"{which}_indptr", indptr, q.shape[0] + 1), (f"{which}_indices", indices, 0)):
        if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < n or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(kernel, f"{name} must be a contiguous int32 [>= {n}] tensor (got "
                                      f"{t.dtype} {tuple(t.shape)})")  # fmt: skip


def dequant_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor, *, fnuz: bool, nope: int = 448) -> torch.Tensor:
    """bf16 ``[n, nope + 64]`` keys of ``slots`` (valid slots of a ``[pages, B, *]`` cache), as the kernel reads them."""
    page = cache.shape[1]
    pages = cache.as_strided((cache.shape[0], page * (_TOKEN + _SCALES)), (cache.stride(0), 1))
    blocks, pos = slots // page, slots % page
    token = pages[blocks[:, None], pos[:, None] * _TOKEN + torch.arange(_TOKEN)]
    exps = pages[blocks[:, None], page * _TOKEN + pos[:, None] * _SCALES + torch.arange(nope) // _GROUP]
    fp8 = token[:, :nope].contiguous().view(torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    k_nope = fp8.float() * torch.exp2(exps.float() - 127.0)  # exact: a power of two times a 4-bit mantissa
    k_rope = token[:, nope:].contiguous().view(torch.bfloat16).float()
    k = torch.cat((k_nope, k_rope), dim=1).to(torch.bfloat16)
    return torch.where(k.isnan(), torch.zeros_like(k), k)


def decode_partial_reference(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]],
    *,
    scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmSparseAttnDecodePartial` (exact softmax state in fp32): ``segments`` are
    ``(cache, indices, indptr, fnuz)``, the SWA one first."""
    tokens, heads, dim = q.shape
    part_m = torch.full((tokens, num_splits, heads), -3.4028234663852886e38)
    part_l = torch.zeros(tokens, num_splits, heads)
    part_acc = torch.zeros(tokens, num_splits, heads, dim)
    for t in range(tokens):
        for j in range(num_splits):
            keys = []
            for cache, indices, indptr, fnuz in segments:
                a, length = int(indptr[t]), int(indptr[t + 1] - indptr[t])
                chunk = -(-length // num_splits)
                slots = indices[a + j * chunk : a + min(j * chunk + chunk, length)].long()
                slots = slots[(slots >= 0) & (slots < cache.shape[0] * cache.shape[1])]
                keys.append(dequant_fp8_ds_mla(cache, slots, fnuz=fnuz, nope=dim - 64).float())
            k = torch.cat(keys)
            if not k.shape[0]:
                continue
            s = q[t].float() @ k.T * scale
            m = s.max(dim=1).values
            w = torch.exp(s - m[:, None])
            part_m[t, j], part_l[t, j], part_acc[t, j] = m, w.sum(dim=1), w @ k
    return part_m, part_l, part_acc


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the partial pass on gfx942 unless decode takes aiter's sparse MLA (see the module docstring)."""
    on = not aiter_sparse_mla(platform)
    registry.add(RocmSparseAttnDecodePartial(rope_head_dim=model.qk_rope_head_dim),
                 when=warmreg.rocm_arch_in("gfx942") if on else False)  # fmt: skip


def decode_gfx942(
    q: torch.Tensor,
    swa: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    attn_sink: torch.Tensor | None,
    *,
    scale: float,
    fnuz: bool,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cu: int | None = None,
    partial: RocmSparseAttnDecodePartial | None = None,
    reduce: RocmSparseAttnReduce | None = None,
) -> torch.Tensor:
    """The drop-in for vLLM's gfx942 ``_rocm_sparse_attn_decode_ragged_triton``: the split count as vLLM picks it
    (``cu`` compute units: the device's by default), the partial pass, then the reduce (rotating the RoPE lanes back
    at ``positions`` where given) into ``out``; returns the bf16 output.

    :param swa: the SWA ``(cache, indices, indptr)``; ``extra``: the compressed cache's, or None (SWA-only layers).
    """
    partial = partial or RocmSparseAttnDecodePartial()
    reduce = reduce or RocmSparseAttnReduce()
    tokens, heads = q.shape[0], q.shape[1]
    inv = 1.0 / max(1, tokens)
    splits = decode_num_splits(
        tokens, triton.cdiv(heads, _BLOCK_H), swa[1].numel() * inv, extra[1].numel() * inv if extra else 0.0,
        cu=cu if cu is not None else cu_count(q.device), gfx950=False, block_k=_BLOCK_K,
    )  # fmt: skip
    parts = partial(q, *swa, *(extra or (None, None, None)), scale=scale, num_splits=splits, fnuz_main=fnuz)
    return reduce(*parts, attn_sink, positions=positions, cos_sin_cache=cos_sin_cache, out=out)  # type: ignore[no-any-return]
