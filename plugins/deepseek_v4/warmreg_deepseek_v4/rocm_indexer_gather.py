"""ROCm C4 indexer prefill: gather a chunk's compressed K rows and their scales out of the paged FP8 indexer cache
(vLLM 0.34 ``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``cp_gather_indexer_k_quant_cache_triton``, which launches
``_cp_gather_indexer_quant_cache_kernel``, or ``_cp_gather_indexer_quant_cache_gfx950_kernel`` on gfx950).

The cache is uint8 ``[num_blocks, B, D + 4]`` with page stride ``S`` (a view of the KV manager's pages); each page is
block-flat (vLLM's ``NORMAL`` layout, the C4A one): ``B * D`` FP8 bytes (token ``j`` at ``j * D``) then ``B`` fp32
scales. For gathered row ``t < N`` (``r = token_to_seq[t]``, its request in the chunk) and ``i = t - cu[r]``::

    valid token  = 0 <= r < R  and  cu[r] <= t < cu[r + 1]           (else nothing is written for t)
    valid block  = i // B < W  and  0 <= p < num_blocks,  p = block_table[r, i // B]
    k_scale[t]   = valid block ? scale of token i % B of page p : 0.0
    k_fp8[t, :]  = the D bytes of token i % B of page p              (only for a valid block; else untouched)

with ``R = len(cu) - 1``, ``W`` the block table's width. Bytes and scale bits are copied, never converted: the op
takes either FP8 flavour (e4m3fnuz on gfx942, e4m3fn on gfx950) and writes the same bytes as vLLM. A program a
gathered row (grid ``(N,)``), as in vLLM; vLLM's gfx950 variant differs only in taking ``W`` and ``num_blocks`` as
constexprs and not checking ``t < N`` (the grid is ``N``): one kernel reproduces both.

Where it runs: ``rocm_aiter_sparse_attn_indexer``'s prefill (``SparseAttnIndexer.forward_hip``: the FP8 indexer, on
ROCm with aiter enabled or on gfx950), every chunk of every C4 layer, into the workspace's ``k_fp8[:total]`` and
``k_scale[:total]`` (uint8 ``[total, 4]``) with the chunk's ``block_table``, ``cu_seq_lens`` and ``token_to_seq``;
DeepSeek-V4's indexer passes ``cache_layout="NORMAL"`` (``_indexer_k_is_c4a_block_flat(4)``). vLLM's ``SHUFFLE``
layout (16x16 tiles: the ratio-1/2 caches of DeepSeek-V3.2) is not reproduced. With the MXFP4 indexer (``auto`` on
gfx950 with aiter) aiter's paged kernels read the cache instead.

Key: the head dim, the warps (Triton's default, 4) and which tensors' storage lies past 2 GB: Triton's AMD backend
gives a pointer whose storage is at most ``2**31 - 1`` bytes ``tt.pointer_range = 32`` (32-bit buffer offsets), even
under ``do_not_specialize_on_alignment``. The cache is a view of the KV pool (past 2 GB, or not on a small pool) and
``k_fp8``/``k_scale`` views of vLLM's one workspace buffer (of a size warmreg cannot see): the domains give both
variants of each (the workspace's two together), 4 keys; the chunk metadata's buffers are small. Every size and stride
is a runtime int (``do_not_specialize``) and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table, check_int32_vector
from ._serving import mxfp4_indexer
from .model import DSV4

__all__ = [
    "POINTER_RANGE_BYTES", "RocmIndexerKGather", "RocmIndexerKGatherKey", "indexer_k_gather_reference", "meta_past_2gb",
    "over_2gb_names", "register",
]  # fmt: skip

_NUM_WARPS = 4
_SCALE_BYTES = 4
_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@triton.jit(
    do_not_specialize=[
        "value_stride", "scale_stride", "block_size", "block_table_stride", "block_table_width", "num_batches",
        "num_blocks",
    ],
    do_not_specialize_on_alignment=[
        "values_ptr", "scales_ptr", "k_ptr", "k_scale_ptr", "block_table_ptr", "cu_seq_lens_ptr", "token_to_seq_ptr"
    ],
)  # fmt: skip
def _indexer_k_gather_kernel(
    values_ptr,  # uint8: page p's K bytes from p * value_stride
    scales_ptr,  # int32 (fp32 bits): page p's scales from p * scale_stride
    k_ptr,  # uint8 [N, HEAD_DIM]
    k_scale_ptr,  # int32 [N]
    block_table_ptr,
    cu_seq_lens_ptr,
    token_to_seq_ptr,
    value_stride,
    scale_stride,
    block_size,
    block_table_stride,
    block_table_width,
    num_batches,
    num_blocks,
    HEAD_DIM: tl.constexpr,  # bytes a K row (one tl.arange)
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.load(token_to_seq_ptr + t)
    valid_batch = (r >= 0) & (r < num_batches)
    safe_r = tl.where(valid_batch, r, 0).to(tl.int64)
    start = tl.load(cu_seq_lens_ptr + safe_r, mask=valid_batch, other=0)
    end = tl.load(cu_seq_lens_ptr + safe_r + 1, mask=valid_batch, other=0)
    if valid_batch & (t >= start) & (t < end):
        i = t - start
        logical = i // block_size
        in_table = logical < block_table_width
        page = tl.load(block_table_ptr + safe_r * block_table_stride + tl.where(in_table, logical, 0), mask=in_table,
                       other=-1).to(tl.int64)  # fmt: skip
        valid_block = in_table & (page >= 0) & (page < num_blocks)
        safe_page = tl.where(valid_block, page, 0)
        j = tl.where(valid_block, i % block_size, 0)
        bits = tl.load(scales_ptr + safe_page * scale_stride + j, mask=valid_block, other=0)
        tl.store(k_scale_ptr + t, bits)
        if valid_block:
            d = tl.arange(0, HEAD_DIM)
            row = tl.load(values_ptr + safe_page * value_stride + j * HEAD_DIM + d)
            tl.store(k_ptr + t * HEAD_DIM + d, row)


#: Storage sizes above this lose ROCm's ``tt.pointer_range = 32`` specialization (Triton's ``is_within_2gb``), which
#: ``do_not_specialize_on_alignment`` does not turn off.
POINTER_RANGE_BYTES = 2**31 - 1


def over_2gb_names(**tensors: torch.Tensor) -> tuple[str, ...]:
    """The names of the tensors whose storage (``untyped_storage()``, not the view) exceeds 2**31 - 1 bytes, in the
    given order: the pointers Triton's AMD backend does not give ``tt.pointer_range = 32`` (part of a binary's key)."""
    return tuple(n for n, t in tensors.items() if t.untyped_storage().nbytes() > POINTER_RANGE_BYTES)


def meta_past_2gb(shape: tuple[int, ...], dtype: torch.dtype, big: bool) -> torch.Tensor:
    """A meta tensor of ``shape``, its storage past 2 GB when ``big`` (an offset of 2**31 bytes: still aligned)."""
    return warmreg.meta(shape, dtype, offset=2**31 // dtype.itemsize if big else 0)


@attrs.frozen(kw_only=True)
class RocmIndexerKGatherKey(warmreg.CompileKey):
    """What changes the binary of the gather: the K row's bytes, the warps, and which tensors' storage is past 2 GB
    (ROCm's 32-bit buffer offsets: :func:`over_2gb_names`)."""

    head_dim: int
    num_warps: int
    over_2gb: tuple[str, ...]


def _fp8_rows(name: str, k_fp8: torch.Tensor) -> None:
    if k_fp8.ndim != 2 or k_fp8.dtype not in _BYTE_DTYPES or not k_fp8.is_contiguous():
        raise warmreg.LaunchError(name, f"k_fp8 must be a contiguous 1-byte (FP8 or uint8) [N, D] tensor (got "
                                  f"{k_fp8.dtype} {tuple(k_fp8.shape)}, strides {k_fp8.stride()})")  # fmt: skip


class RocmIndexerKGather(warmreg.TritonKernel[RocmIndexerKGatherKey]):
    """Copy each gathered row's FP8 K bytes and fp32 scale out of the paged indexer cache; see the module docstring."""

    name = "deepseek_v4.rocm_indexer_k_gather"
    key_type = RocmIndexerKGatherKey
    jit = _indexer_k_gather_kernel

    def __init__(self, *, head_dim: int = 128) -> None:
        self.head_dim = head_dim

    def dispatch(
        self,
        *,
        k_cache: torch.Tensor,
        k_fp8: torch.Tensor,
        k_scale: torch.Tensor,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        token_to_seq: torch.Tensor,
    ) -> RocmIndexerKGatherKey:
        big = over_2gb_names(
            k_cache=k_cache, k_fp8=k_fp8, k_scale=k_scale, block_table=block_table, cu_seq_lens=cu_seq_lens,
            token_to_seq=token_to_seq,
        )  # fmt: skip
        return RocmIndexerKGatherKey(head_dim=k_fp8.shape[-1], num_warps=_NUM_WARPS, over_2gb=big)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        d = self.head_dim
        both = (False, True)
        return {
            # a view of the KV pool: at or below 2 GB (a small pool) or above it (usually)
            "k_cache": [meta_past_2gb((2, 64, d + _SCALE_BYTES), torch.uint8, big) for big in both],
            # views of vLLM's one workspace buffer, whose size warmreg cannot see: both, together (``when``)
            "k_fp8": [meta_past_2gb((1, d), torch.uint8, big) for big in both],
            "k_scale": [meta_past_2gb((1, _SCALE_BYTES), torch.uint8, big) for big in both],
            # the chunk metadata's small persistent buffers
            "block_table": [warmreg.meta((1, 4), torch.int32)],
            "cu_seq_lens": [warmreg.meta((2,), torch.int32)],
            "token_to_seq": [warmreg.meta((1,), torch.int32)],
        }

    def when(self, **point: Any) -> bool:
        """The two workspace views share one storage: both past 2 GB or neither."""
        return bool(over_2gb_names(k_fp8=point["k_fp8"])) == bool(over_2gb_names(k_scale=point["k_scale"]))

    def warmup_inputs(self, key: RocmIndexerKGatherKey) -> Mapping[str, Any]:
        d, bs = key.head_dim, 64

        def big(name: str) -> bool:
            return name in key.over_2gb

        return {
            "k_cache": meta_past_2gb((2, bs, d + _SCALE_BYTES), torch.uint8, big("k_cache")),
            "k_fp8": meta_past_2gb((1, d), torch.uint8, big("k_fp8")),
            "k_scale": meta_past_2gb((1, _SCALE_BYTES), torch.uint8, big("k_scale")),
            "block_table": meta_past_2gb((1, 4), torch.int32, big("block_table")),
            "cu_seq_lens": meta_past_2gb((2,), torch.int32, big("cu_seq_lens")),
            "token_to_seq": meta_past_2gb((1,), torch.int32, big("token_to_seq")),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        k_cache: torch.Tensor,
        k_fp8: torch.Tensor,
        k_scale: torch.Tensor,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        token_to_seq: torch.Tensor,
    ) -> warmreg.LaunchSpec[RocmIndexerKGatherKey]:
        """Write ``k_fp8`` and ``k_scale`` (the caller's workspace, as vLLM's ``k_fp8``/``k_fp8_scale``); returns them.

        :param k_cache: uint8 ``[num_blocks, B, D + 4]`` indexer cache whose pages are block-flat: the last two dims
            contiguous, a page stride that is a multiple of 4.
        :param k_fp8: contiguous 1-byte (FP8 or uint8) ``[N, D]``: row ``t`` gets gathered row ``t``'s bytes.
        :param k_scale: contiguous ``[N, 4]`` uint8 (or ``[N]`` float32): row ``t`` gets its scale's bits.
        :param block_table: int32 ``[R', W]`` with contiguous rows: the chunk's requests' pages.
        :param cu_seq_lens: contiguous int32 ``[R + 1]``: the requests' first gathered rows (``R <= R'``).
        :param token_to_seq: contiguous int32 ``[>= N]``: each gathered row's request.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts.
        """
        _fp8_rows(self.name, k_fp8)
        n, d = k_fp8.shape
        if (
            k_cache.dtype != torch.uint8 or k_cache.ndim != 3 or k_cache.shape[2] != d + _SCALE_BYTES
            or k_cache.stride(2) != 1 or k_cache.stride(1) != d + _SCALE_BYTES or k_cache.stride(0) % _SCALE_BYTES
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"k_cache must be uint8 [num_blocks, B, {d + _SCALE_BYTES}] with "
                                      f"contiguous pages and a page stride a multiple of 4 (got {k_cache.dtype} "
                                      f"{tuple(k_cache.shape)}, strides {k_cache.stride()})")  # fmt: skip
        if k_scale.element_size() * k_scale.numel() != _SCALE_BYTES * n or not k_scale.is_contiguous() or (
            k_scale.shape[0] != n
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"k_scale must be contiguous [{n}, 4] uint8 or [{n}] float32 (got "
                                      f"{k_scale.dtype} {tuple(k_scale.shape)})")  # fmt: skip
        check_int32_table(self.name, "block_table", block_table, 0)
        check_int32_vector(self.name, cu_seq_lens=cu_seq_lens, token_to_seq=token_to_seq)
        if cu_seq_lens.shape[0] < 1 or token_to_seq.shape[0] < n:
            raise warmreg.LaunchError(self.name, f"cu_seq_lens needs >= 1 entry and token_to_seq >= {n} (got "
                                      f"{cu_seq_lens.shape[0]} and {token_to_seq.shape[0]})")  # fmt: skip
        num_blocks, bs = k_cache.shape[0], k_cache.shape[1]
        flat = k_cache.view(num_blocks, -1) if num_blocks else k_cache.reshape(0, bs * (d + _SCALE_BYTES))
        values, scales = flat[:, : bs * d], flat[:, bs * d :].view(torch.int32)
        key = self.dispatch(
            k_cache=k_cache, k_fp8=k_fp8, k_scale=k_scale, block_table=block_table, cu_seq_lens=cu_seq_lens,
            token_to_seq=token_to_seq,
        )  # fmt: skip
        kwargs = dict(
            values_ptr=values, scales_ptr=scales, k_ptr=k_fp8.view(torch.uint8),
            k_scale_ptr=k_scale.view(torch.uint8).view(-1).view(torch.int32), block_table_ptr=block_table,
            cu_seq_lens_ptr=cu_seq_lens, token_to_seq_ptr=token_to_seq, value_stride=values.stride(0),
            scale_stride=scales.stride(0), block_size=bs, block_table_stride=block_table.stride(0),
            block_table_width=block_table.shape[1], num_batches=cu_seq_lens.shape[0] - 1, num_blocks=num_blocks,
            HEAD_DIM=key.head_dim,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n,) if n else None, kwargs, (k_fp8, k_scale))


def indexer_k_gather_reference(
    k_cache: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmIndexerKGather`: ``(k_fp8, k_scale)`` as uint8 ``[N, D]`` and ``[N, 4]``
    copies of the given buffers with the gathered rows written (the buffers themselves are not touched)."""
    n, d = k_fp8.shape
    num_blocks, bs = k_cache.shape[:2]
    rows, scales = k_fp8.view(torch.uint8).clone(), k_scale.reshape(-1).view(torch.uint8).reshape(n, 4).clone()
    cu, width = cu_seq_lens.long().tolist(), block_table.shape[1]
    for t in range(n):
        r = int(token_to_seq[t])
        if not 0 <= r < len(cu) - 1 or not cu[r] <= t < cu[r + 1]:
            continue
        i = t - cu[r]
        page = int(block_table[r, i // bs]) if i // bs < width else -1
        if not 0 <= page < num_blocks:
            scales[t] = 0
            continue
        j = i % bs
        flat = k_cache[page].reshape(-1)
        rows[t] = flat[j * d : (j + 1) * d]
        scales[t] = flat[bs * d + 4 * j : bs * d + 4 * j + 4]
    return rows, scales


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather on ROCm with aiter or on gfx950 (``forward_hip``'s condition) for a model with C4 layers on
    the FP8 indexer."""
    on = model.has_c4 and not (platform.is_rocm and mxfp4_indexer(config, model, platform))
    where = warmreg.is_rocm & (warmreg.has_feature("aiter") | warmreg.rocm_arch_in("gfx950"))
    registry.add(RocmIndexerKGather(head_dim=model.index_head_dim), when=where if on else False)
