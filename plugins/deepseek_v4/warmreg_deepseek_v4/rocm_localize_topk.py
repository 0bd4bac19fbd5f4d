"""ROCm C4 indexer prefill with aiter's top-k: the chunk's top-k made row-local (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_localize_aiter_prefill_topk``, launched by
``_launch_aiter_top_k_per_row_prefill`` right after aiter's ``top_k_per_row_prefill``).

aiter's prefill top-k returns column indices into the chunk's logits, whose row ``i`` covers the chunk's gathered
keys from ``row_starts[i]`` (``cu_seqlen_ks``). The indexer's consumers want positions local to the request, so, in
place, for row ``i < n`` and column ``j < K``::

    indices[i, j] = indices[i, j] < 0 ? indices[i, j] : indices[i, j] - row_starts[i]

Grid ``(n, cdiv(K, 256))``, a program a 256-column tile of a row, as in vLLM.

Where it runs: ``rocm_aiter_sparse_attn_indexer``'s prefill (the FP8 indexer: ``SparseAttnIndexer.forward_hip``),
every chunk of every C4 layer, when ``rocm_aiter_ops.is_indexer_top_k_supported(is_prefill=True, compress_ratio=4)``
holds: aiter enabled on gfx950 (``is_indexer_top_k_enabled``; the target ``rocm:gfx950+aiter``), for any chunk (a
ratio above 1 has no prefill size gate). With ``serving.indexer_kv_dtype`` ``mxfp4`` (``auto`` there) the indexer is
``DeepseekV4RocmMxfp4Indexer`` on aiter's paged MXFP4 kernels, which never localizes: so only the FP8 indexer on
``rocm:gfx950+aiter`` plans it. The rows are ``topk_indices_buffer[a:b, :index_topk]``.

Key: the tile (256, vLLM's constexpr) and the warps; ``K`` and the row stride are runtime ints (``do_not_specialize``)
and no pointer is specialized on alignment (row slices of the persistent buffer). Buffers are far below 2 GB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import mxfp4_indexer
from .model import DSV4

__all__ = ["RocmLocalizeTopk", "RocmLocalizeTopkKey", "localize_topk_reference", "register"]

_TILE = 256
_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["indices_stride", "num_topk"], do_not_specialize_on_alignment=["indices_ptr", "row_starts_ptr"]
)
def _localize_topk_kernel(
    indices_ptr,
    row_starts_ptr,
    indices_stride,
    num_topk,
    TILE: tl.constexpr,  # columns a program (grid axis 1 is cdiv(K, TILE))
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    ptrs = indices_ptr + row * indices_stride + cols
    indices = tl.load(ptrs, mask=cols < num_topk)
    start = tl.load(row_starts_ptr + row)
    tl.store(ptrs, tl.where(indices < 0, indices, indices - start), mask=cols < num_topk)


@attrs.frozen(kw_only=True)
class RocmLocalizeTopkKey(warmreg.CompileKey):
    """What changes the binary of the localization: the column tile and the warps."""

    tile: int
    num_warps: int


class RocmLocalizeTopk(warmreg.TritonKernel[RocmLocalizeTopkKey]):
    """Subtract each row's start from its non-negative top-k entries, in place; see the module docstring."""

    name = "deepseek_v4.rocm_localize_topk"
    key_type = RocmLocalizeTopkKey
    jit = _localize_topk_kernel

    def dispatch(self) -> RocmLocalizeTopkKey:
        return RocmLocalizeTopkKey(tile=_TILE, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {}

    def warmup_inputs(self, key: RocmLocalizeTopkKey) -> Mapping[str, Any]:
        return {"indices": warmreg.meta((1, 512), torch.int32), "row_starts": warmreg.meta((1,), torch.int32)}

    @warmreg.kernel_launcher
    def __call__(self, indices: torch.Tensor, row_starts: torch.Tensor) -> warmreg.LaunchSpec[RocmLocalizeTopkKey]:
        """Localize ``indices`` in place; returns it.

        :param indices: int32 ``[n, K]`` top-k rows, contiguous within a row (any row stride).
        :param row_starts: int32 ``[>= n]`` (contiguous): each row's first key in the chunk (``cu_seqlen_ks``).
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts.
        """
        if indices.dtype != torch.int32 or indices.ndim != 2 or (indices.shape[1] > 1 and indices.stride(1) != 1):
            raise warmreg.LaunchError(self.name, f"indices must be int32 [n, K] with contiguous rows (got {indices.dtype} "
                                      f"{tuple(indices.shape)}, strides {indices.stride()})")  # fmt: skip
        rows, topk = indices.shape
        if (
            row_starts.dtype != torch.int32
            or row_starts.ndim != 1
            or row_starts.shape[0] < rows
            or (row_starts.shape[0] > 1 and row_starts.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"row_starts must be a contiguous int32 [>= {rows}] tensor (got "
                                      f"{row_starts.dtype} {tuple(row_starts.shape)})")  # fmt: skip
        key = self.dispatch()
        kwargs = dict(
            indices_ptr=indices,
            row_starts_ptr=row_starts,
            indices_stride=indices.stride(0),
            num_topk=topk,
            TILE=key.tile,
        )
        grid = (rows, triton.cdiv(topk, key.tile)) if rows and topk else None
        return warmreg.LaunchSpec(key, grid, kwargs, indices)


def localize_topk_reference(indices: torch.Tensor, row_starts: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`RocmLocalizeTopk` (out of place): int32 ``[n, K]``."""
    starts = row_starts[: indices.shape[0]].long()[:, None]
    return torch.where(indices < 0, indices.long(), indices.long() - starts).to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the localization on ``rocm:gfx950+aiter`` for a model with C4 layers on the FP8 indexer."""
    on = model.has_c4 and not (platform.is_rocm and mxfp4_indexer(config, model, platform))
    registry.add(
        RocmLocalizeTopk(), when=warmreg.rocm_arch_in("gfx950") & warmreg.has_feature("aiter") if on else False
    )
