"""DeepSeek-V4.1's gather of ``fp8_ds_mla`` cache pages into a bf16 prefill workspace on ROCm (vLLM 0.34
``models/deepseek_v41/common/ops/cache_utils.py``: ``_dequantize_and_gather_k_one_pass_kernel``, which
``dequantize_and_gather_k_cache_triton`` launches for 584-byte ``fp8_ds_mla`` records when
``current_platform.is_rocm()``: the token read as one 512-byte tile instead of seven 64-byte blocks).

A page of ``block_size`` tokens holds ``block_size`` 576-byte token records (448 e4m3 bytes, then 64 bf16 RoPE values)
followed by ``block_size`` 8-byte UE8M0 scale records (7 scales and a pad byte). For request ``b`` and gather row
``i < glen`` (``glen = gather_lens[b]``, or ``seq_lens[b]`` when ``gather_lens`` is None)::

    pos = seq_lens[b] - glen + i;  page = block_table[b, pos // block_size];  j = pos % block_size
    base = page * k_cache.stride(0)  (bytes);  token = base + 576 j;  scales = base + 576 block_size + 8 j
    out[b, offset + i, e] = bf16(e4m3(token[e]) * 2 ** (scales[e // 64] - 127))      e < 448
                            (an e4m3 NaN code gives NaN, as the hardware conversion does)
    out[b, offset + i, 448 + r] = bf16 at token + 448 + 2 r                            r < 64

``e4m3`` is OCP e4m3fn, or e4m3fnuz with ``use_fnuz`` (the SWA cache on gfx942, written by the C++ encoder). An e4m3
value times a power of two is exact in bf16, so the result does not depend on rounding. Rows ``i >= glen`` and the rest
of ``out`` are untouched.

vLLM runs ``(num_reqs, workers)`` programs looping over rows, its block size, page stride and block-table width
constexprs. Here the grid is ``(cdiv(rows, 8), num_reqs)`` with ``rows = out.shape[1] - offset`` (or
``max_gather_len`` where the caller bounds the gather, as vLLM's compressed gather does), one 8-row tile a program (no
loop with a runtime bound), and those sizes and every stride are unspecialized runtime integers: one binary serves
every layer ratio, page layout, chunk and ``max_model_len``.

Where it runs: V4.1 on ROCm where prefill attends in-tree (``DeepseekV41ROCMAiterMLAAttention._forward_prefill`` in
``models/deepseek_v41/amd/rocm.py``; not where aiter's Triton sparse MLA takes prefill,
:func:`._rocm_attention.aiter_sparse_mla`), every prefill chunk of every layer: the SWA cache with the chunk's gather
lens, ``offset=chunk_N`` and ``use_fnuz=current_platform.is_fp8_fnuz()``; for a compressed layer (ratios 1 and 2) also
the compressed cache, ``gather_lens=None``, ``offset=0``, ``use_fnuz=False`` (the Triton encoder is OCP everywhere).

Key: whether ``gather_lens`` is given, FNUZ bytes, whether ``out`` is 16-byte aligned, the tile and the warps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._rocm_attention import aiter_sparse_mla
from .cache import dequant_gather_k_reference
from .fp8_ds_mla import HEAD_DIM, SCALE_BYTES, TOKEN_BYTES, e4m3_to_f32, ue8m0_to_f32
from .model import DSV4

__all__ = ["V41RocmGatherKCache", "V41RocmGatherKey", "register", "v41_rocm_gather_k_reference"]

#: Bytes of an ``fp8_ds_mla`` record: 576 bytes of token data and 8 of scales.
RECORD_BYTES = TOKEN_BYTES + SCALE_BYTES
_TILE, _NUM_WARPS = 8, 4
_INTS = ["out_stride0", "out_stride1", "page_stride", "block_size", "table_stride", "offset"]


@triton.jit(
    do_not_specialize=_INTS,
    do_not_specialize_on_alignment=["cache_ptr", "seq_lens_ptr", "gather_lens_ptr", "table_ptr"],
)
def _v41_rocm_gather_k_kernel(
    out_ptr,  # bf16 [num_reqs, M, 512]
    out_stride0,
    out_stride1,
    cache_ptr,  # uint8 pages
    page_stride,
    block_size,
    seq_lens_ptr,  # int32 [num_reqs]
    gather_lens_ptr,  # int32 [num_reqs], or None
    table_ptr,  # int32 [num_reqs, width]
    table_stride,
    offset,
    HAS_GATHER_LENS: tl.constexpr,  # gather_lens given (else every request gathers its whole length)
    USE_FNUZ: tl.constexpr,  # e4m3fnuz bytes (the SWA cache on gfx942) instead of OCP e4m3fn
    TILE: tl.constexpr,  # rows a program
):
    req = tl.program_id(1)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    seq_len = tl.load(seq_lens_ptr + req)
    if HAS_GATHER_LENS:
        glen = tl.load(gather_lens_ptr + req)
    else:
        glen = seq_len
    valid = rows < glen
    pos = seq_len - glen + rows
    page = tl.load(table_ptr + req.to(tl.int64) * table_stride + pos // block_size, mask=valid, other=0)
    j = (pos % block_size).to(tl.int64)
    base = cache_ptr + page.to(tl.int64) * page_stride
    token = base + j * 576
    e = tl.arange(0, 512)[None, :]
    nope = valid[:, None] & (e < 448)
    q = tl.load(token[:, None] + e, mask=nope, other=0)
    bits = tl.load((base + block_size * 576 + j * 8)[:, None] + e // 64, mask=nope, other=127)
    vals = e4m3_to_f32(q, USE_FNUZ) * ue8m0_to_f32(bits)
    nan = (q == 0x80) if USE_FNUZ else ((q & 0x7F) == 0x7F)
    vals = tl.where(nan, float("nan"), vals)
    rope_ptr = (token + 448).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptr[:, None] + (e - 448), mask=valid[:, None] & (e >= 448), other=0.0)
    row = tl.where(e < 448, vals.to(tl.bfloat16), rope)
    dst = out_ptr + req.to(tl.int64) * out_stride0 + (offset + rows).to(tl.int64)[:, None] * out_stride1 + e
    tl.store(dst, row, mask=valid[:, None])


@attrs.frozen(kw_only=True)
class V41RocmGatherKey(warmreg.CompileKey):
    """What changes the binary of V4.1's ROCm gather: the gather lens' presence, FNUZ bytes, ``out``'s alignment,
    the tile and the warps."""

    has_gather_lens: bool
    use_fnuz: bool
    out_aligned: bool
    tile: int
    num_warps: int


class V41RocmGatherKCache(warmreg.TritonKernel[V41RocmGatherKey]):
    """Dequantize ``fp8_ds_mla`` pages into a bf16 workspace (the module docstring has the math). The workspace is the
    caller's (a required ``out``, written in place; only the gathered rows).

    :param swa: the instance's domains describe the SWA cache's gather (gather lens, the platform's FNUZ); else the
        compressed cache's (whole lengths, OCP bytes). Any instance launches any gather; their keys merge by name.
    """

    name = "deepseek_v4.v41_rocm_gather_k_cache"
    key_type = V41RocmGatherKey
    jit = _v41_rocm_gather_k_kernel

    def __init__(self, *, swa: bool = True) -> None:
        self.swa = swa

    def dispatch(self, *, out: torch.Tensor, gather_lens: torch.Tensor | None, use_fnuz: bool) -> V41RocmGatherKey:
        return V41RocmGatherKey(
            has_gather_lens=gather_lens is not None, use_fnuz=use_fnuz, out_aligned=warmreg.is_aligned(out),
            tile=_TILE, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lens = warmreg.meta((1,), torch.int32)
        return {
            "out": [warmreg.meta((1, 1, HEAD_DIM), torch.bfloat16)],  # the workspace: whole rows from its start
            "gather_lens": [lens if self.swa else None],
            "use_fnuz": [platform.fp8_fnuz if self.swa else False],
        }

    def warmup_inputs(self, key: V41RocmGatherKey) -> Mapping[str, Any]:
        wide = warmreg.meta((1, 2, HEAD_DIM + 8), torch.bfloat16)  # an unaligned out: a view one value in
        return {
            "out": wide[:, :, :HEAD_DIM] if key.out_aligned else wide[:, :, 1 : HEAD_DIM + 1],
            "k_cache": warmreg.meta((2, 4, RECORD_BYTES), torch.uint8),
            "seq_lens": warmreg.meta((1,), torch.int32),
            "gather_lens": warmreg.meta((1,), torch.int32) if key.has_gather_lens else None,
            "block_table": warmreg.meta((1, 2), torch.int32),
            "block_size": 4,
            "use_fnuz": key.use_fnuz,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        gather_lens: torch.Tensor | None,
        block_table: torch.Tensor,
        *,
        block_size: int,
        offset: int = 0,
        use_fnuz: bool = False,
        max_gather_len: int | None = None,
    ) -> warmreg.LaunchSpec[V41RocmGatherKey]:
        """Gather every request's rows into ``out[b, offset : offset + glen]``; returns ``out``.

        :param out: bf16 ``[num_reqs, M, 512]`` with unit column stride; rows ``offset + glen`` must fit in ``M``.
        :param k_cache: uint8 ``[num_blocks, >= block_size, 584]`` pages (token records, then scales; any page stride).
        :param seq_lens: int32 ``[num_reqs]``: each request's (compressed) length.
        :param gather_lens: int32 ``[num_reqs]`` (the last ``glen`` positions), or None for whole lengths.
        :param block_table: int32 ``[>= num_reqs, width]`` with unit column stride (any row stride).
        :param block_size: tokens a page.
        :param offset: the first workspace row written.
        :param use_fnuz: the cache holds e4m3fnuz bytes (the SWA cache on gfx942).
        :param max_gather_len: a bound on every ``glen`` (vLLM passes it for the compressed cache), or None: the grid
            then covers ``out``'s rows past ``offset``.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout.
        """
        _check(self.name, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, max_gather_len)
        key = self.dispatch(out=out, gather_lens=gather_lens, use_fnuz=use_fnuz)
        reqs, free = seq_lens.shape[0], out.shape[1] - offset
        rows = free if max_gather_len is None else min(free, max_gather_len)
        kwargs = dict(
            out_ptr=out, out_stride0=out.stride(0), out_stride1=out.stride(1), cache_ptr=k_cache,
            page_stride=k_cache.stride(0), block_size=block_size, seq_lens_ptr=seq_lens,
            gather_lens_ptr=gather_lens, table_ptr=block_table, table_stride=block_table.stride(0), offset=offset,
            HAS_GATHER_LENS=key.has_gather_lens, USE_FNUZ=key.use_fnuz, TILE=key.tile,
        )  # fmt: skip
        grid = (triton.cdiv(rows, key.tile), reqs) if reqs and rows > 0 else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)


def _check(
    name: str, out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, gather_lens: torch.Tensor | None,
    block_table: torch.Tensor, block_size: int, offset: int, max_gather_len: int | None,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's gather passes it."""
    if out.dtype != torch.bfloat16 or out.ndim != 3 or out.shape[2] != HEAD_DIM or out.stride(2) != 1:
        raise warmreg.LaunchError(
            name, f"out must be bf16 [reqs, M, 512] with unit column stride (got {out.dtype} {tuple(out.shape)})"
        )
    if k_cache.dtype != torch.uint8 or k_cache.ndim != 3 or k_cache.shape[2] != RECORD_BYTES or (
        k_cache.shape[1] > 1 and k_cache.stride(1) != RECORD_BYTES
    ) or k_cache.stride(2) != 1:  # fmt: skip
        raise warmreg.LaunchError(
            name,
            f"k_cache must be uint8 [blocks, block_size, {RECORD_BYTES}] pages with contiguous records (got "
            f"{k_cache.dtype} {tuple(k_cache.shape)}, stride {k_cache.stride()})",
        )
    reqs = out.shape[0]
    for arg, t in (("seq_lens", seq_lens), ("gather_lens", gather_lens)):
        if t is None:
            continue
        if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] != reqs or (reqs > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous int32 [{reqs}] (out's requests; got {t.dtype} {tuple(t.shape)})"
            )
    bt = block_table
    if bt.dtype != torch.int32 or bt.ndim != 2 or bt.shape[0] < reqs or (bt.shape[1] > 1 and bt.stride(1) != 1):
        raise warmreg.LaunchError(
            name,
            f"block_table must be int32 [>= {reqs}, width] with unit column stride (got {bt.dtype} {tuple(bt.shape)})",
        )
    if not 0 <= offset <= out.shape[1] or not 1 <= block_size <= k_cache.shape[1]:
        raise warmreg.LaunchError(
            name,
            f"need offset ({offset}) in 0..{out.shape[1]} (out's rows) and block_size ({block_size}) in "
            f"1..{k_cache.shape[1]} (k_cache's records a page)",
        )
    if max_gather_len is not None and max_gather_len < 0:
        raise warmreg.LaunchError(name, f"max_gather_len must be >= 0 (got {max_gather_len})")
    if reqs > 65535:
        raise warmreg.LaunchError(name, f"out's {reqs} requests exceed the grid's 65535 limit on axis 1")


def v41_rocm_gather_k_reference(
    out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, gather_lens: torch.Tensor | None,
    block_table: torch.Tensor, *, block_size: int, offset: int = 0, use_fnuz: bool = False,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`V41RocmGatherKCache`: a gathered copy of ``out`` (the math is DeepSeek-V4's
    ``fp8_ds_mla`` gather's, :func:`.cache.dequant_gather_k_reference`, read off the flat pages)."""
    return dequant_gather_k_reference(
        out.clone(), k_cache.flatten(1), seq_lens, block_table, block_size=block_size, offset=offset, gather_lens=gather_lens,
        use_fnuz=use_fnuz,
    )  # fmt: skip


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather for V4.1 on ROCm where prefill attends in-tree (not aiter's sparse MLA): the SWA cache's
    gather for every layer, and the compressed cache's where a layer has ratio 1 or 2 (see the module docstring)."""
    if not model.v41:
        return
    on = warmreg.is_rocm if not aiter_sparse_mla(platform) else False
    registry.add(V41RocmGatherKCache(swa=True), when=on)
    if any(r > 0 for r in model.ratios):
        registry.add(V41RocmGatherKCache(swa=False), when=on)
