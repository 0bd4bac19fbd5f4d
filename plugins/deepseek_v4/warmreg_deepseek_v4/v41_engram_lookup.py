"""DeepSeek-V4.1's engram table lookup into BF16 rows (vLLM 0.34 ``models/deepseek_v41/common/engram.py``:
``ParallelEngramEmbedding.lookup`` / ``_engram_lookup_kernel``, its ``PACKED`` off, ``PEER_ROWS`` 0 branch).

A rank owns ``P`` consecutive hash heads ``[h0, h0 + P)`` of ``H`` (tensor parallelism) and the table rows
``[vs, ve)`` they address: FP8 E4M3 ``weight[ve - vs, D]`` with one ue8m0 scale byte per ``B = 32`` values
(``scales[ve - vs, D / B]``). For output row ``i < T * P`` (token ``i // P``, head ``h = h0 + i % P``)::

    idx   = ids[i // P, h]                          (h < H; otherwise the row is not owned)
    owned = h < H and vs <= idx < ve
    out[i, d] = owned ? bf16(float(weight[idx - vs, d]) * 2^(scales[idx - vs, d / B] - 127)) : 0

so a padded head (``h >= H``) writes zeros for the all-gather. The ue8m0 byte is the fp32 exponent field, so the
scale is ``bitcast<f32>(byte << 23)`` (byte 0 gives 0). ``SORTED`` (a runtime flag, as on CUDA) instead reads
``ids[i]`` as a row relative to ``vs`` in table order (``-1`` padding) and writes ``out[dst[i]]``: vLLM sorts large
lookups of small-page host tables so that rows on one page share a TLB entry. ``out`` is a contiguous bf16
``[T, P, D]`` (the staging rows). Persistent grid: ``min(cdiv(T * P, 16), max_programs)`` programs stride over
tiles of 16 rows (vLLM caps it at the SM count, half of it in the background stream).

Where it runs: every V4.1 CUDA step with engram layers, once per engram layer: ``Engram.prepare_embeddings`` ->
``ParallelEngramEmbedding.lookup`` on the layer's int32 hash columns (``gathered_hashes[:, layer]``, a strided
view of the hash op's output), into its bf16 ``staged_rows`` (inline, or on the prefetch stream under vLLM's
default CPU offload: the table is pinned host memory read through UVA). ``SORTED`` only on sm_10x with
small-page host tables from 36,864 rows. The packed-FP8 output (``EngramBatch``, DP-sharded tables) and peer tables
(``PEER_ROWS``) need an engram data-parallel group, which warmreg has no setting for: not planned, not built here.

Key: ``D``, ``B``, the row tile, the dtypes and the warps. Unlike vLLM's kernel, which takes the rank's head range,
head counts and the output stride as constexprs (one binary per tensor-parallel rank), they are runtime integers
here, not specialized, as are the id strides, table bounds and sizes; no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_engram import EngramLayout
from .model import DSV4

__all__ = ["BLOCK_R", "QUANT_BLOCK", "EngramLookup", "EngramLookupKey", "engram_lookup_reference", "register"]

#: Rows a tile (vLLM's ``BLOCK_R``).
BLOCK_R = 16
#: Values a ue8m0 scale covers (vLLM's ``block_size``).
QUANT_BLOCK = 32
_NUM_WARPS = 4
_INTS = [
    "vocab_start", "vocab_end", "num_rows", "ids_stride_t", "ids_stride_h", "head_start", "local_heads",
    "total_heads", "num_programs", "sorted_",
]  # fmt: skip
_PTRS = ["weight_ptr", "scales_ptr", "ids_ptr", "dst_ptr", "out_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _engram_lookup_kernel(
    weight_ptr,  # [ve - vs, D] fp8 e4m3, contiguous
    scales_ptr,  # [ve - vs, D // QB] uint8 ue8m0, contiguous
    ids_ptr,  # [T, H] int32 (strided) or, sorted, [T * P] relative rows
    dst_ptr,  # sorted: [T * P] int32 output rows
    out_ptr,  # [T * P, D] bf16
    vocab_start,
    vocab_end,
    num_rows,
    ids_stride_t,
    ids_stride_h,
    head_start,
    local_heads,
    total_heads,
    num_programs,  # programs launched: the persistent stride
    sorted_,  # 1: ids are sorted relative rows and dst their output rows
    D: tl.constexpr,  # head_dim: the row is one tile
    QB: tl.constexpr,  # values a scale byte
    BLOCK_R: tl.constexpr,  # rows a tile
):
    cols = tl.arange(0, D)
    for base in tl.range(tl.program_id(0) * BLOCK_R, num_rows, num_programs * BLOCK_R):
        rows = base + tl.arange(0, BLOCK_R)
        live = rows < num_rows
        if sorted_ != 0:
            local = tl.load(ids_ptr + rows, mask=live, other=-1).to(tl.int64)
            dst = tl.load(dst_ptr + rows, mask=live, other=0).to(tl.int64)
            owned = live & (local >= 0) & (local < vocab_end - vocab_start)
        else:
            head = head_start + rows % local_heads
            token = (rows // local_heads).to(tl.int64)
            has_head = live & (head < total_heads)
            idx = tl.load(ids_ptr + token * ids_stride_t + head * ids_stride_h, mask=has_head, other=-1).to(tl.int64)
            dst = rows.to(tl.int64)
            owned = has_head & (idx >= vocab_start) & (idx < vocab_end)
            local = idx - vocab_start
        local = tl.where(owned, local, 0)
        values = tl.load(weight_ptr + local[:, None] * D + cols[None, :], mask=owned[:, None], other=0.0)
        scale = tl.load(scales_ptr + local[:, None] * (D // QB) + (cols // QB)[None, :], mask=owned[:, None], other=0)
        scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        result = (values.to(tl.float32) * scale).to(tl.bfloat16)
        tl.store(out_ptr + dst[:, None] * D + cols[None, :], result, mask=live[:, None])


@attrs.frozen(kw_only=True)
class EngramLookupKey(warmreg.CompileKey):
    """What changes the binary of the lookup: the row width, the scale block, the tile, the dtypes, the warps."""

    dim: int
    quant_block: int
    block_r: int
    weight_dtype: str
    ids_dtype: str
    num_warps: int


class EngramLookup(warmreg.TritonKernel[EngramLookupKey]):
    """A rank's engram rows of each token, dequantized to bf16 (the module docstring has the math).

    :param layout: the checkpoint's engram layout (domains only; no rank's head range is in the key).
    """

    name = "deepseek_v4.v41_engram_lookup"
    key_type = EngramLookupKey
    jit = _engram_lookup_kernel

    def __init__(self, *, layout: EngramLayout) -> None:
        self.layout = layout

    def dispatch(self, *, indices: torch.Tensor, weight: torch.Tensor) -> EngramLookupKey:
        return EngramLookupKey(
            dim=weight.shape[1], quant_block=QUANT_BLOCK, block_r=BLOCK_R, weight_dtype=warmreg.dtype_name(weight.dtype),
            ids_dtype=warmreg.dtype_name(indices.dtype), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        d = self.layout.head_dim
        return {
            "indices": [warmreg.meta((1, self.layout.n_hash_cols), torch.int32)],  # no size is in the key
            "weight": [warmreg.meta((1, d), torch.float8_e4m3fn)],
        }

    def warmup_inputs(self, key: EngramLookupKey) -> Mapping[str, Any]:
        d = key.dim
        return {
            "indices": warmreg.meta((1, 1), getattr(torch, key.ids_dtype)),
            "out": warmreg.meta((1, 1, d), torch.bfloat16),
            "weight": warmreg.meta((1, d), getattr(torch, key.weight_dtype)),
            "scales": warmreg.meta((1, d // key.quant_block), torch.uint8),
            "vocab_start": 0,
            "head_start": 0,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        indices: torch.Tensor,
        out: torch.Tensor,
        *,
        weight: torch.Tensor,
        scales: torch.Tensor,
        vocab_start: int,
        head_start: int,
        sorted_dst: torch.Tensor | None = None,
        total_heads: int | None = None,
        max_programs: int | None = None,
    ) -> warmreg.LaunchSpec[EngramLookupKey]:
        """Fill ``out`` (``[T, P, D]`` bf16, contiguous) with this rank's rows; vLLM's ``lookup(indices, out)``,
        the module's table and shard as keywords. Rows ``vs = vocab_start`` .. ``vs + weight.shape[0]`` are owned.

        :param indices: int32 ``[T, H]``, any strides; or, with ``sorted_dst``, int32 ``[T * P]`` contiguous rows
            relative to ``vocab_start`` (``-1`` padding), sorted.
        :param out: bf16 contiguous ``[T, P, D]``; ``P`` is the heads a rank.
        :param weight: FP8 E4M3 contiguous ``[rows, D]``, ``D`` a power of two and a multiple of 32.
        :param scales: uint8 contiguous ``[rows, D / 32]`` ue8m0 exponents.
        :param vocab_start: the first owned row's table index.
        :param head_start: this rank's first head.
        :param sorted_dst: int32 ``[T * P]`` output rows of the sorted ``indices`` (the SORTED path), or None.
        :param total_heads: ``H`` (default ``indices.shape[1]``; required with ``sorted_dst``, where it is unused).
        :param max_programs: the persistent grid's cap (vLLM: the SM count, half of it in the background).
        :raises warmreg.LaunchError: naming the argument whose shape, dtype or layout does not fit.
        """
        self._check(indices, out, weight, scales, sorted_dst)
        key = self.dispatch(indices=indices, weight=weight)
        rows = out.shape[0] * out.shape[1]
        tiles = triton.cdiv(rows, key.block_r)
        grid = min(tiles, max_programs) if max_programs else tiles
        stride_t, stride_h = (indices.stride() + (0,))[:2] if sorted_dst is None else (0, 0)
        heads = total_heads if total_heads is not None else (indices.shape[1] if indices.ndim == 2 else 0)
        kwargs = dict(
            weight_ptr=weight, scales_ptr=scales, ids_ptr=indices,
            dst_ptr=sorted_dst if sorted_dst is not None else indices, out_ptr=out, vocab_start=vocab_start,
            vocab_end=vocab_start + weight.shape[0], num_rows=rows, ids_stride_t=stride_t, ids_stride_h=stride_h,
            head_start=head_start, local_heads=out.shape[1], total_heads=heads, num_programs=grid,
            sorted_=int(sorted_dst is not None), D=key.dim, QB=key.quant_block, BLOCK_R=key.block_r,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (grid,) if rows else None, kwargs, out)

    def _check(
        self, indices: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
        sorted_dst: torch.Tensor | None,
    ) -> None:  # fmt: skip
        if weight.ndim != 2 or weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"weight must be float8_e4m3fn contiguous [rows, D] (got {weight.dtype})"
            )
        rows, d = weight.shape
        if d < QUANT_BLOCK or d & (d - 1):
            raise warmreg.LaunchError(self.name, f"weight's D must be a power of two >= {QUANT_BLOCK} (got {d})")
        if scales.shape != (rows, d // QUANT_BLOCK) or scales.dtype != torch.uint8 or not scales.is_contiguous():
            raise warmreg.LaunchError(
                self.name,
                f"scales must be uint8 contiguous [{rows}, {d // QUANT_BLOCK}] (got {scales.dtype} {tuple(scales.shape)})",
            )
        if out.ndim != 3 or out.shape[2] != d or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"out must be bf16 contiguous [T, P, {d}] (got {out.dtype} {tuple(out.shape)})"
            )
        if sorted_dst is None:
            if indices.ndim != 2 or indices.dtype != torch.int32 or indices.shape[0] != out.shape[0]:
                raise warmreg.LaunchError(
                    self.name,
                    f"indices must be int32 [T = {out.shape[0]}, H] (got {indices.dtype} {tuple(indices.shape)})",
                )
            return
        n = out.shape[0] * out.shape[1]
        for name, t in (("indices", indices), ("sorted_dst", sorted_dst)):
            if t.shape != (n,) or t.dtype != torch.int32 or not t.is_contiguous():
                raise warmreg.LaunchError(
                    self.name, f"sorted {name} must be int32 contiguous [{n}] (got {t.dtype} {tuple(t.shape)})"
                )


def engram_lookup_reference(
    indices: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, vocab_start: int, head_start: int,
    local_heads: int,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramLookup`, unsorted: the bf16 ``[T, P, D]`` rows (the module docstring)."""
    t, total = indices.shape
    d = weight.shape[1]
    heads = torch.arange(head_start, head_start + local_heads)
    idx = torch.full((t, local_heads), -1, dtype=torch.long)
    idx[:, heads < total] = indices[:, heads[heads < total]].long()
    local = idx - vocab_start
    owned = (local >= 0) & (local < weight.shape[0])
    local = torch.where(owned, local, 0)
    exponent = scales[local].long().repeat_interleave(QUANT_BLOCK, -1) - 127
    rows = weight[local].float() * torch.pow(2.0, exponent.float())
    rows = torch.where(scales[local].repeat_interleave(QUANT_BLOCK, -1) == 0, 0.0, rows)
    return torch.where(owned[..., None], rows, 0.0).to(torch.bfloat16).reshape(t, local_heads, d)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the lookup for a V4.1 deployment with engram layers, on CUDA (every engram layer, every step; one
    key for every tensor-parallel rank)."""
    if model.engram is None:
        return
    kernel = EngramLookup(layout=model.engram)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 else False)
