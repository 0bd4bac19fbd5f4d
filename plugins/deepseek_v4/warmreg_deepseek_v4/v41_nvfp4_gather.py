"""DeepSeek-V4.1's gather of NVFP4 compressed-cache records into a bf16 prefill workspace (vLLM 0.34
``models/deepseek_v41/common/ops/cache_utils.py``: ``_dequantize_and_gather_k_nvfp4_kernel``, launched by
``dequantize_and_gather_k_cache_triton`` from ``dequantize_and_gather_k_cache``, which takes it for every 288-byte
record: the CuTeDSL gather reads only the FP8 ones).

A 288-byte record (FlashMLA's ``ModelType::V41_FP4``) holds a token's 512 values as e2m1 nibbles, two a byte (element
``2k`` in the low nibble of byte ``k``, ``2k + 1`` in the high one), then 32 e4m3 scales, one per 16 values. For request
``b`` and gather row ``i < glen`` (``glen = gather_lens[b]``, or ``seq_lens[b]`` when ``gather_lens`` is None)::

    pos = seq_lens[b] - glen + i;  page = block_table[b, pos // block_size];  j = pos % block_size
    r = k_cache bytes at page * k_cache.stride(0) + j * 288              (k_cache [num_blocks, >= block_size, 288])
    out[b, offset + i, e] = bf16(e2m1(nibble e of r) * e4m3(r[256 + e // 16]))          e < 512

with ``e2m1`` the FP4 value of a nibble (sign bit 3; exponent bits 2:1, bias 1; mantissa bit 0: 0, 0.5, 1, 1.5, 2, 3,
4, 6 and their negatives). The product of a 2-bit and a 4-bit significand is exact in bf16, so the result does not
depend on rounding. Rows ``i >= glen`` and everything else of ``out`` are untouched.

``out`` is the caller's bf16 workspace ``[num_reqs, M, 512]`` (unit column stride, any row and request strides: a
column slice of mega attention's retained workspace), ``k_cache`` uint8 pages ``[num_blocks, >= block_size, 288]`` (any
page stride, contiguous records), ``block_table`` int32 ``[num_reqs, width]`` with unit column stride, ``seq_lens``
(and ``gather_lens``) int32 ``[num_reqs]``.

vLLM runs ``(num_reqs, workers)`` programs looping over 8-row tiles, its page stride, block size and table width
constexprs. Here the grid is ``(cdiv(M - offset, 8), num_reqs)``, one 8-row tile a program (no loop with a runtime
bound), and those sizes and every stride are unspecialized runtime integers: one binary serves every layer ratio,
page layout and ``max_model_len``.

Where it runs: V4.1 prefills on CUDA whose compressed cache stores NVFP4 records (:func:`._v41.compressed_record`
``"nvfp4"``: ``nvfp4_ds_mla`` on the SM100 family, what ``auto`` / ``fp8`` become under ``FLASHMLA_MEGA_ATTN_DSV41``),
every compressed layer of every prefill chunk: FlashMLA's ``DeepseekV41FlashMLASparseAttention._forward_prefill`` and
mega attention's ``_forward_prefill_mega``, with ``gather_lens=None``, ``offset=0`` and ``block_size`` the kernel block
over the layer's ratio.

Key: whether ``gather_lens`` is given, the tile, the warps, and whether ``out`` is 16-byte aligned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41 import compressed_record
from .model import DSV4

__all__ = ["NVFP4_RECORD_BYTES", "Nvfp4GatherKCache", "Nvfp4GatherKey", "nvfp4_gather_reference", "register"]

#: Bytes of an NVFP4 record: 256 bytes of nibbles, 32 e4m3 scales.
NVFP4_RECORD_BYTES = 288
_DIM, _GROUP, _TILE, _NUM_WARPS = 512, 16, 8, 2
_INTS = ["out_stride0", "out_stride1", "page_stride", "block_size", "table_stride", "offset"]


@triton.jit(do_not_specialize=_INTS)
def _nvfp4_gather_kernel(
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
    record = cache_ptr + page.to(tl.int64) * page_stride + (pos % block_size).to(tl.int64) * 288
    e = tl.arange(0, 512)
    where = record[:, None] + e[None, :] // 2
    byte = tl.load(where, mask=valid[:, None], other=0).to(tl.int32)
    nibble = tl.where((e % 2 == 0)[None, :], byte & 15, byte >> 4)
    bits = tl.load(record[:, None] + 256 + e[None, :] // 16, mask=valid[:, None], other=0)
    scale = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exponent = (nibble >> 1) & 3
    half = (nibble & 1).to(tl.float32) * 0.5
    step = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
    magnitude = tl.where(exponent == 0, half, (1.0 + half) * step)
    value = tl.where(nibble >= 8, -magnitude, magnitude) * scale
    dst = out_ptr + req.to(tl.int64) * out_stride0 + (offset + rows).to(tl.int64)[:, None] * out_stride1 + e[None, :]
    tl.store(dst, value.to(tl.bfloat16), mask=valid[:, None])


@attrs.frozen(kw_only=True)
class Nvfp4GatherKey(warmreg.CompileKey):
    """What changes the binary of the NVFP4 gather: the gather lens' presence, the tile, the warps, ``out``'s
    alignment."""

    has_gather_lens: bool
    out_aligned: bool
    tile: int
    num_warps: int


class Nvfp4GatherKCache(warmreg.TritonKernel[Nvfp4GatherKey]):
    """Dequantize NVFP4 compressed-cache records into a bf16 workspace (the module docstring has the math). The
    workspace is the caller's (a required ``out``, written in place; only the gathered rows)."""

    name = "deepseek_v4.v41_nvfp4_gather_k_cache"
    key_type = Nvfp4GatherKey
    jit = _nvfp4_gather_kernel

    def dispatch(self, *, out: torch.Tensor, gather_lens: torch.Tensor | None) -> Nvfp4GatherKey:
        return Nvfp4GatherKey(
            has_gather_lens=gather_lens is not None, out_aligned=warmreg.is_aligned(out), tile=_TILE,
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"out": [warmreg.meta((1, 1, _DIM), torch.bfloat16)], "gather_lens": [None]}

    def warmup_inputs(self, key: Nvfp4GatherKey) -> Mapping[str, Any]:
        wide = warmreg.meta((1, 2, _DIM + 8), torch.bfloat16)  # an unaligned out: a view one value in
        return {
            "out": wide[:, :, :_DIM] if key.out_aligned else wide[:, :, 1 : _DIM + 1],
            "k_cache": warmreg.meta((2, 4, NVFP4_RECORD_BYTES), torch.uint8),
            "seq_lens": warmreg.meta((1,), torch.int32),
            "gather_lens": warmreg.meta((1,), torch.int32) if key.has_gather_lens else None,
            "block_table": warmreg.meta((1, 2), torch.int32),
            "block_size": 4,
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
    ) -> warmreg.LaunchSpec[Nvfp4GatherKey]:
        """Gather every request's rows into ``out[b, offset : offset + glen]``; returns ``out``.

        :param out: bf16 ``[num_reqs, M, 512]`` with unit column stride; rows ``offset + glen`` must fit in ``M``.
        :param k_cache: uint8 ``[num_blocks, >= block_size, 288]`` (records contiguous; any page stride).
        :param seq_lens: int32 ``[num_reqs]``, contiguous: each request's compressed length.
        :param gather_lens: int32 ``[num_reqs]`` (the last ``glen`` positions), or None for whole lengths.
        :param block_table: int32 ``[num_reqs, width]`` with unit column stride (any row stride).
        :param block_size: tokens a page (vLLM's kernel block over the layer's ratio).
        :param offset: the first workspace row written.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout.
        """
        _check(self.name, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
        key = self.dispatch(out=out, gather_lens=gather_lens)
        reqs, free = seq_lens.shape[0], out.shape[1] - offset
        kwargs = dict(
            out_ptr=out, out_stride0=out.stride(0), out_stride1=out.stride(1), cache_ptr=k_cache,
            page_stride=k_cache.stride(0), block_size=block_size, seq_lens_ptr=seq_lens,
            gather_lens_ptr=gather_lens, table_ptr=block_table, table_stride=block_table.stride(0), offset=offset,
            HAS_GATHER_LENS=key.has_gather_lens, TILE=key.tile,
        )  # fmt: skip
        grid = (triton.cdiv(free, key.tile), reqs) if reqs and free > 0 else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)


def _check(
    name: str, out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, gather_lens: torch.Tensor | None,
    block_table: torch.Tensor, block_size: int, offset: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's gather passes it."""
    if out.dtype != torch.bfloat16 or out.ndim != 3 or out.shape[2] != _DIM or out.stride(2) != 1:
        raise warmreg.LaunchError(
            name, f"out must be bf16 [reqs, M, 512] with unit column stride (got {out.dtype} {tuple(out.shape)})"
        )
    if (
        k_cache.dtype != torch.uint8 or k_cache.ndim != 3 or k_cache.shape[2] != NVFP4_RECORD_BYTES
        or k_cache.stride(2) != 1 or k_cache.stride(1) != NVFP4_RECORD_BYTES
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name,
            f"k_cache must be uint8 [blocks, block_size, 288] with contiguous records (got {k_cache.dtype} "
            f"{tuple(k_cache.shape)}, stride {k_cache.stride()})",
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


#: e2m1's values by nibble (sign in bit 3).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def nvfp4_gather_reference(
    out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, gather_lens: torch.Tensor | None,
    block_table: torch.Tensor, *, block_size: int, offset: int = 0,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`Nvfp4GatherKCache`: a gathered copy of ``out``."""
    out, table = out.clone(), torch.tensor(_E2M1, dtype=torch.float32)
    bs = block_size
    for b, seq in enumerate(seq_lens.tolist()):
        glen = seq if gather_lens is None else int(gather_lens[b])
        for i in range(glen):
            pos = seq - glen + i
            record = k_cache[int(block_table[b, pos // bs]), pos % bs].long()
            nibbles = torch.stack([record[:256] & 15, record[:256] >> 4], 1).flatten()
            scales = record[256:].to(torch.uint8).view(torch.float8_e4m3fn).float().repeat_interleave(_GROUP)
            out[b, offset + i] = (table[nibbles] * scales).to(torch.bfloat16)
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather for a V4.1 deployment on CUDA with compressed layers whose cache stores NVFP4 records
    (every prefill chunk of FlashMLA's split-KV path and of mega attention gathers them).

    :raises warmreg.ConfigError: as :func:`._v41.compressed_record`, on a CUDA target.
    """
    compressed = model.v41 and any(r > 0 for r in model.ratios)
    nvfp4 = compressed and platform.is_cuda and compressed_record(config, model, platform) == "nvfp4"
    registry.add(Nvfp4GatherKCache(), when=warmreg.is_cuda if nvfp4 else False)
