"""Dequantize-and-gather from the ``fp8_ds_mla`` paged K cache (vLLM 0.33
``models/deepseek_v4/common/ops/cache_utils.py``: ``DequantizeAndGatherKCacheKernel``).

The layout and the exact FP8 bit conversions are in :mod:`.fp8_ds_mla`; the writer that builds such
caches (the inverse) is :mod:`.cache_insert`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import FLASHMLA_SPARSE, attention_backend
from .fp8_ds_mla import (
    HEAD_DIM,
    NOPE,
    NOPE_DIM,
    NQB,
    QB,
    QUANT_BLOCK,
    ROPE,
    SCALE_BYTES,
    SCALES,
    TOKEN,
    TOKEN_BYTES,
    PagedCache,
    cache_problem,
    check_model_layout,
    e4m3_to_f32,
    paged_caches,
    ue8m0_to_f32,
    uses_fp8_ds_mla,
    value_in_class,
)
from .model import DSV4, PLUGIN

__all__ = ["DequantGatherKCache", "DequantGatherKey", "dequant_gather_k_reference", "register"]


@triton.jit(
    do_not_specialize=["block_table_stride"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "gather_lens_ptr", "block_table_ptr"],
)
def _dequant_gather_k_kernel(
    out_ptr,
    k_cache_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    block_table_ptr,
    block_table_stride,
    block_stride,
    out_stride0,
    out_stride1,
    offset,
    CACHE_BLOCK_SIZE: tl.constexpr,  # tokens per page: 64 (SWA, C4) or 2 (C128); locates the scale area
    USE_FNUZ: tl.constexpr,  # e4m3fnuz bytes (the SWA cache on gfx942) instead of OCP e4m3fn
):
    i = tl.program_id(0)  # gather row: grid axis 0 has no 65535 limit
    b = tl.program_id(1)  # request
    seq = tl.load(seq_lens_ptr + b)
    if gather_lens_ptr is None:
        glen = seq
    else:
        glen = tl.load(gather_lens_ptr + b)
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    live = tl.where(i < glen, True, False)
    pos = seq - glen + i
    page = tl.load(block_table_ptr + b.to(tl.int64) * block_table_stride + pos // CACHE_BLOCK_SIZE, mask=live, other=0)
    j = pos % CACHE_BLOCK_SIZE
    base = k_cache_ptr + page.to(tl.int64) * block_stride
    token = base + j * TOKEN
    rows = tl.arange(0, 8)[:, None]
    cols = tl.arange(0, QB)[None, :]
    nope = (rows < NQB) & live
    q = tl.load(token + rows * QB + cols, mask=nope, other=0)
    scale = tl.load(base + CACHE_BLOCK_SIZE * TOKEN + j * SCALES + rows, mask=(rows < NQB) & live, other=127)
    vals = e4m3_to_f32(q, USE_FNUZ) * ue8m0_to_f32(scale)
    # the NaN codes (0x7F/0xFF; 0x80 in e4m3fnuz) read as NaN, as the hardware fp8 -> fp32 conversion reads them
    nan = (q == 0x80) if USE_FNUZ else ((q & 0x7F) == 0x7F)
    vals = tl.where(nan, float("nan"), vals)
    dst = out_ptr + b.to(tl.int64) * out_stride0 + (offset + i).to(tl.int64) * out_stride1
    tl.store(dst + rows * QB + cols, vals.to(tl.bfloat16), mask=nope)
    r = tl.arange(0, ROPE)
    rope = tl.load((token + NOPE).to(tl.pointer_type(tl.bfloat16)) + r, mask=live & (r < ROPE))
    tl.store(dst + NOPE + r, rope, mask=live & (r < ROPE))


@attrs.frozen(kw_only=True)
class DequantGatherKey(warmreg.CompileKey):
    """What changes the binary of the dequantize-and-gather kernel."""

    cache_block_size: int  # tokens per page (constexpr)
    block_stride: str  # int class of the page stride k_cache.stride(0), in bytes
    use_fnuz: bool
    has_gather_lens: bool  # gather_lens=None (compressed gather) is a constexpr None
    offset: str  # int class of the first output row (0 compressed, the chunk's compressed count for SWA)
    out_stride0: str
    out_stride1: str
    num_warps: int


class DequantGatherKCache(warmreg.TritonKernel[DequantGatherKey]):
    """Dequantize ``fp8_ds_mla`` pages into a bf16 ``[num_reqs, M, 512]`` workspace.

    For request ``b`` and gather row ``i < glen`` (``glen = gather_lens[b]``, or ``seq_lens[b]``
    when ``gather_lens`` is None)::

        pos = seq_lens[b] - glen + i;  page = block_table[b, pos // bs];  j = pos % bs
        out[b, offset + i, 64q:64q+64] = bf16(e4m3(token j, block q) * 2**(scale_j[q] - 127))  q < 7
                                         (an e4m3 NaN code gives NaN)
        out[b, offset + i, 448:512]    = the token's bf16 RoPE part

    Grid ``(out.shape[1] - offset, num_reqs)``: one program per output row (rows past ``glen``
    write nothing; the gather lens must fit in the workspace). This has no loop with a runtime bound,
    which Triton 3.6's interpreter cannot run under numpy >= 2.4 (``int()`` of its 1-element scalars). The block table's row stride is a
    runtime integer (not specialized), so one binary serves every block-table width; the page
    stride ``k_cache.stride(0)`` is a specialized integer (its class is in the key).

    One instance per cache group it is registered for (their keys merge under one name); any
    instance launches any gather.

    :param cache: the cache group whose gathers :meth:`domains` describes.
    :param max_num_seqs: the most requests one gather can cover (``serving.max_num_seqs``).
    :param window: SWA rows per request (``sliding_window``), for the workspace size in domains.
    """

    name = "deepseek_v4.dequant_gather_k_cache"
    key_type = DequantGatherKey
    jit = _dequant_gather_k_kernel

    def __init__(self, *, cache: PagedCache, max_num_seqs: int = 1, window: int = 128) -> None:
        self.cache, self.max_num_seqs, self.window = cache, max_num_seqs, window

    def dispatch(
        self,
        *,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        block_size: int,
        gather_lens: torch.Tensor | None,
        offset: int,
        use_fnuz: bool,
    ) -> DequantGatherKey:
        return DequantGatherKey(
            cache_block_size=block_size,
            block_stride=warmreg.int_class(k_cache.stride(0)),
            use_fnuz=use_fnuz,
            has_gather_lens=gather_lens is not None,
            offset=warmreg.int_class(offset),
            out_stride0=warmreg.int_class(out.stride(0)),
            out_stride1=warmreg.int_class(out.stride(1)),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        c, swa = self.cache, self.cache.kind == "swa"
        rows = [1, 17, self.window + 1]  # workspace rows M (the row stride M * 512 is always a multiple of 16)
        return {
            "out": [warmreg.meta((r, m, HEAD_DIM), torch.bfloat16) for r in (1, self.max_num_seqs) for m in rows],
            "k_cache": [warmreg.meta((2, s), torch.uint8) for s in c.page_strides],
            "block_size": [c.block_size],
            "gather_lens": [warmreg.meta((r,), torch.int32) for r in (1, self.max_num_seqs)] if swa else [None],
            # SWA rows start after the chunk's largest compressed count: 0 (SWA-only layers) or any count
            "offset": [0, 1, 2, 16, 17] if swa else [0],
            "use_fnuz": [platform.fp8_fnuz if swa else False],  # compressed caches are always OCP
        }

    def warmup_inputs(self, key: DequantGatherKey) -> Mapping[str, Any]:
        bs, offset = key.cache_block_size, warmreg.int_class_rep(key.offset)
        rows = offset + 1
        stride1 = value_in_class(key.out_stride1, HEAD_DIM)
        stride0 = value_in_class(key.out_stride0, rows * stride1)
        page_stride = value_in_class(key.block_stride, bs * (TOKEN_BYTES + SCALE_BYTES))
        return {
            "out": warmreg.meta((1, rows, HEAD_DIM), torch.bfloat16, stride=(stride0, stride1, 1)),
            "k_cache": warmreg.meta((1, page_stride), torch.uint8),
            "seq_lens": warmreg.meta((1,), torch.int32),
            "block_table": warmreg.meta((1, 1), torch.int32),
            "block_size": bs,
            "offset": offset,
            "gather_lens": warmreg.meta((1,), torch.int32) if key.has_gather_lens else None,
            "use_fnuz": key.use_fnuz,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        block_size: int,
        offset: int = 0,
        gather_lens: torch.Tensor | None = None,
        use_fnuz: bool = False,
    ) -> warmreg.LaunchSpec[DequantGatherKey]:
        """Gather and dequantize into ``out`` (written in place and returned).

        :param out: bf16 ``[num_reqs, M, 512]`` workspace, last dim contiguous, 16-byte aligned.
        :param k_cache: uint8 pages ``[num_pages, ...]``; ``k_cache.stride(0)`` is the page stride.
        :param seq_lens: int32 ``[num_reqs]`` tokens in each sequence (compressed tokens for a
            compressed cache).
        :param block_table: int32 ``[>= num_reqs, width]`` pages of each request (last dim contiguous).
        :param block_size: tokens per page of this cache.
        :param offset: first row of ``out`` to write.
        :param gather_lens: int32 ``[num_reqs]`` rows to gather (the last ``glen`` tokens), or None
            for the whole sequence.
        :param use_fnuz: the cache holds e4m3fnuz bytes (the SWA cache on gfx942).
        :raises warmreg.LaunchError: for wrong dtypes, shapes or layouts.
        """
        self._check(out, k_cache, seq_lens, block_table, gather_lens, block_size, offset)
        key = self.dispatch(
            out=out, k_cache=k_cache, block_size=block_size, gather_lens=gather_lens, offset=offset, use_fnuz=use_fnuz
        )
        rows, num_reqs = out.shape[1] - offset, seq_lens.shape[0]
        kwargs = dict(
            out_ptr=out, k_cache_ptr=k_cache, seq_lens_ptr=seq_lens, gather_lens_ptr=gather_lens,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_stride=k_cache.stride(0),
            out_stride0=out.stride(0), out_stride1=out.stride(1), offset=offset,
            CACHE_BLOCK_SIZE=key.cache_block_size, USE_FNUZ=key.use_fnuz,
        )  # fmt: skip
        grid = (rows, num_reqs) if rows > 0 and num_reqs > 0 else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(
        self,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        gather_lens: torch.Tensor | None,
        block_size: int,
        offset: int,
    ) -> None:
        def fail(problem: str, fix: str | None = None) -> NoReturn:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if out.dtype != torch.bfloat16 or out.ndim != 3 or out.shape[-1] != HEAD_DIM or out.stride(-1) != 1:
            fail(f"out must be a bf16 [num_reqs, M, {HEAD_DIM}] workspace with a contiguous last dim "
                 f"(got {out.dtype} {tuple(out.shape)} stride {out.stride()})")  # fmt: skip
        if not warmreg.is_aligned(out):
            fail(
                "out must be 16-byte aligned",
                fix="pass the workspace tensor (or a slice of whole rows), not an offset view",
            )
        problem = cache_problem(k_cache, block_size)
        if problem:
            fail(problem, fix="check block_size against the cache group")
        num_reqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
        if seq_lens.dtype != torch.int32 or num_reqs != out.shape[0]:
            fail(f"seq_lens must be int32 [num_reqs={out.shape[0]}] (got {seq_lens.dtype} {tuple(seq_lens.shape)})")
        if gather_lens is not None and (gather_lens.dtype != torch.int32 or tuple(gather_lens.shape) != (num_reqs,)):
            fail(f"gather_lens must be int32 [{num_reqs}] (got {gather_lens.dtype} {tuple(gather_lens.shape)})")
        if block_table.dtype != torch.int32 or block_table.ndim != 2 or block_table.shape[0] < num_reqs:
            fail(
                f"block_table must be int32 [>= {num_reqs}, width] (got {block_table.dtype} {tuple(block_table.shape)})"
            )
        if block_table.stride(1) != 1:
            fail("block_table needs a contiguous last dim")
        if not 0 <= offset <= out.shape[1]:
            fail(f"offset {offset} is outside the workspace's {out.shape[1]} rows")
        if num_reqs > 65535:
            fail(f"{num_reqs} requests exceed the grid's 65535 limit on axis 1", fix="gather in chunks of requests")


def dequant_gather_k_reference(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    offset: int = 0,
    gather_lens: torch.Tensor | None = None,
    use_fnuz: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :class:`DequantGatherKCache` (writes ``out`` in place and returns it)."""
    fp8 = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
    for b in range(seq_lens.shape[0]):
        seq = int(seq_lens[b])
        glen = seq if gather_lens is None else int(gather_lens[b])
        for i in range(glen):
            pos = seq - glen + i
            page = k_cache[int(block_table[b, pos // block_size])].reshape(-1)
            j = pos % block_size
            token = page[j * TOKEN_BYTES : (j + 1) * TOKEN_BYTES]
            scale_bytes = page[block_size * TOKEN_BYTES + j * SCALE_BYTES :][: NOPE_DIM // QUANT_BLOCK]
            vals = token[:NOPE_DIM].view(fp8).float().view(-1, QUANT_BLOCK)
            scales = torch.ldexp(torch.ones(scale_bytes.shape), scale_bytes.to(torch.int32) - 127)
            out[b, offset + i, :NOPE_DIM] = (vals * scales[:, None]).reshape(-1).to(torch.bfloat16)
            out[b, offset + i, NOPE_DIM:] = token[NOPE_DIM:].view(torch.bfloat16)
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the ``fp8_ds_mla`` gather, one instance per cache group; nothing for another ``kv_cache_dtype``.

    The Triton gather serves ROCm and XPU, and on CUDA only FlashMLA without CuTeDSL (a CuTeDSL kernel replaces it
    there; FlashInfer's kernels read the pages themselves: vLLM registers the gather for FLASHMLA_SPARSE_DSV4 only).

    :raises warmreg.ConfigError: if the model's head does not fit the layout (448 + 64).
    """
    if not uses_fp8_ds_mla(config, platform):
        return
    check_model_layout(model)
    seqs = config.get("serving.max_num_seqs", int, plugin=PLUGIN, default=1)
    triton_path = warmreg.is_rocm | warmreg.is_xpu
    if attention_backend(config) == FLASHMLA_SPARSE:
        triton_path = triton_path | (warmreg.is_cuda & ~warmreg.has_feature("cutedsl"))
    for cache in paged_caches(model, config):
        registry.add(DequantGatherKCache(cache=cache, max_num_seqs=seqs, window=model.sliding_window), when=triton_path)
