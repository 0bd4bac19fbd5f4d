"""ROCm DeepSeek-V4 decode, C4 layers: the indexer's top-k as a ragged stream of cache slots (vLLM 0.34
``models/deepseek_v4/amd/rocm.py``: ``compute_global_topk_ragged_indices_and_indptr``, which launches
``_compute_topk_lens_kernel`` then ``_pack_global_topk_ragged_kernel``).

For decode token ``t`` (request ``r = token_to_req[t]``), its top-k row ``topk[t, :K]`` of local compressed positions
(``-1`` padded at the tail), the request's block table and the compressed block size ``B`` (``256 // 4 = 64``)::

    lens[t]   = is_valid[t] ? #{j < K : topk[t, j] >= 0} : 0;       indptr = [0, cumsum(lens)]
    out[indptr[t] + j] = topk[t, j] >= 0 ? block_table[r, topk[t, j] // B] * B + topk[t, j] % B : -1
                                                                    for j < lens[t] (the row's first lens[t] columns)

Two launches and a ``torch.cumsum``, as in vLLM: :class:`RocmTopkLens` (a program a token, 1024-column tiles) and
:class:`RocmPackTopkRagged` (grid ``(T, cdiv(K, 128))``, a program a 128-column tile of a token; tiles past the row's
length return). :func:`rocm_global_topk_ragged` is the whole entry point. Only ``out[:indptr[T]]`` is written.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` of every C4 layer on every ROCm deployment with
decode tokens, before it picks aiter's or the in-tree sparse decode (both read the stream), on
``topk_indices_buffer[:num_decode_tokens]``, the SWA metadata's ``token_to_req_indices`` and ``is_valid_token`` (bool)
and the C4 layer's block table.

Key: the tile constexprs (1024 and 128, vLLM's) and the warps (Triton's default, 4). ``K``, ``B`` and the strides are
runtime ints (``do_not_specialize``) and no pointer is specialized on alignment (views of persistent buffers): one
binary each a deployment. Every buffer is far below 2 GB (the same ``tt.pointer_range = 32`` for every launch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table
from .model import DSV4

__all__ = [
    "RocmPackTopkRagged", "RocmPackTopkRaggedKey", "RocmTopkLens", "RocmTopkLensKey", "global_topk_ragged_reference",
    "register", "rocm_global_topk_ragged",
]  # fmt: skip

_LENS_TILE = 1024  # vLLM's TRITON_BLOCK_SIZE
_PACK_TILE = 128  # vLLM's BLOCK_SIZE (the pack's grid axis 1)
_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["topk_stride", "topk"], do_not_specialize_on_alignment=["lens_ptr", "topk_ptr", "valid_ptr"]
)
def _topk_lens_kernel(
    lens_ptr,
    topk_ptr,
    topk_stride,
    topk,
    valid_ptr,
    TILE: tl.constexpr,  # columns counted a step
):
    t = tl.program_id(0).to(tl.int64)
    count = tl.zeros((), dtype=tl.int32)
    start = 0
    while start < topk:
        cols = start + tl.arange(0, TILE)
        local = tl.load(topk_ptr + t * topk_stride + cols, mask=cols < topk, other=-1)
        count += tl.sum((local >= 0).to(tl.int32), axis=0)
        start += TILE
    tl.store(lens_ptr + t, tl.where(tl.load(valid_ptr + t), count, 0))


@triton.jit(
    do_not_specialize=["topk_stride", "block_table_stride", "block_size", "topk"],
    do_not_specialize_on_alignment=["out_ptr", "indptr_ptr", "topk_ptr", "token_to_req_ptr", "block_table_ptr"],
)
def _pack_topk_ragged_kernel(
    out_ptr,
    indptr_ptr,
    topk_ptr,
    topk_stride,
    token_to_req_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    topk,
    TILE: tl.constexpr,  # columns a program (grid axis 1 is cdiv(topk, TILE))
):
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * TILE
    out_start = tl.load(indptr_ptr + t)
    out_len = tl.load(indptr_ptr + t + 1) - out_start
    if first < out_len:
        cols = first + tl.arange(0, TILE)
        live = (cols < out_len) & (cols < topk)
        local = tl.load(topk_ptr + t * topk_stride + cols, mask=live, other=-1)
        valid = live & (local >= 0)
        req = tl.load(token_to_req_ptr + t).to(tl.int64)
        page = tl.load(block_table_ptr + req * block_table_stride + local // block_size, mask=valid, other=0)
        slot = tl.where(valid, page * block_size + local % block_size, -1)
        tl.store(out_ptr + out_start + cols, slot, mask=live)


@attrs.frozen(kw_only=True)
class RocmTopkLensKey(warmreg.CompileKey):
    """What changes the binary of the count: the column tile and the warps."""

    tile: int
    num_warps: int


@attrs.frozen(kw_only=True)
class RocmPackTopkRaggedKey(warmreg.CompileKey):
    """What changes the binary of the pack: the column tile and the warps."""

    tile: int
    num_warps: int


def _check_topk(name: str, topk_indices: torch.Tensor) -> None:
    if (
        topk_indices.dtype != torch.int32
        or topk_indices.ndim != 2
        or (topk_indices.shape[1] > 1 and topk_indices.stride(1) != 1)
    ):
        raise warmreg.LaunchError(name, f"topk_indices must be int32 [T, K] with contiguous rows (got {topk_indices.dtype} "
                                  f"{tuple(topk_indices.shape)}, strides {topk_indices.stride()})")  # fmt: skip


def _check_vector(name: str, what: str, t: torch.Tensor, size: int, dtype: torch.dtype = torch.int32) -> None:
    if t.dtype != dtype or t.ndim != 1 or t.shape[0] < size or (t.shape[0] > 1 and t.stride(0) != 1):
        raise warmreg.LaunchError(
            name, f"{what} must be a contiguous {dtype} [>= {size}] tensor (got {t.dtype} {tuple(t.shape)})"
        )


class RocmTopkLens(warmreg.TritonKernel[RocmTopkLensKey]):
    """Valid top-k entries of each decode token, 0 for an invalid one; see the module docstring."""

    name = "deepseek_v4.rocm_topk_lens"
    key_type = RocmTopkLensKey
    jit = _topk_lens_kernel

    def dispatch(self) -> RocmTopkLensKey:
        return RocmTopkLensKey(tile=_LENS_TILE, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {}

    def warmup_inputs(self, key: RocmTopkLensKey) -> Mapping[str, Any]:
        return {"topk_indices": warmreg.meta((1, 512), torch.int32), "is_valid_token": warmreg.meta((1,), torch.bool)}

    @warmreg.kernel_launcher
    def __call__(
        self, topk_indices: torch.Tensor, is_valid_token: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[RocmTopkLensKey]:
        """The int32 ``[T]`` lengths (fresh, or ``out``).

        :param topk_indices: int32 ``[T, K]`` local top-k rows, contiguous within a row (any row stride).
        :param is_valid_token: bool ``[>= T]`` (contiguous): whether each token has a slot.
        :param out: the buffer to write instead of a fresh one: exactly int32 ``[T]``, contiguous, aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh one.
        """
        _check_topk(self.name, topk_indices)
        tokens, topk = topk_indices.shape
        _check_vector(self.name, "is_valid_token", is_valid_token, tokens, torch.bool)
        key = self.dispatch()
        lens = warmreg.output(self.name, "out", out, (tokens,), torch.int32, topk_indices.device)
        kwargs = dict(
            lens_ptr=lens, topk_ptr=topk_indices, topk_stride=topk_indices.stride(0), topk=topk,
            valid_ptr=is_valid_token, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (tokens,) if tokens else None, kwargs, lens)


class RocmPackTopkRagged(warmreg.TritonKernel[RocmPackTopkRaggedKey]):
    """Each token's first ``lens`` top-k entries as global cache slots at ``out[indptr[t]:]``; see the module docstring."""

    name = "deepseek_v4.rocm_pack_topk_ragged"
    key_type = RocmPackTopkRaggedKey
    jit = _pack_topk_ragged_kernel

    def dispatch(self) -> RocmPackTopkRaggedKey:
        return RocmPackTopkRaggedKey(tile=_PACK_TILE, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {}

    def warmup_inputs(self, key: RocmPackTopkRaggedKey) -> Mapping[str, Any]:
        return {
            "topk_indices": warmreg.meta((1, 512), torch.int32),
            "indptr": warmreg.meta((2,), torch.int32),
            "token_to_req_indices": warmreg.meta((1,), torch.int32),
            "block_table": warmreg.meta((1, 16), torch.int32),
            "block_size": 64,
            "out": warmreg.meta((512,), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        indptr: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        block_table: torch.Tensor,
        *,
        block_size: int,
        out: torch.Tensor,
    ) -> warmreg.LaunchSpec[RocmPackTopkRaggedKey]:
        """Write the slots of every token into ``out`` (the ragged stream); returns ``out``.

        :param topk_indices: int32 ``[T, K]`` local top-k rows, contiguous within a row.
        :param indptr: int32 ``[>= T + 1]``: each token's start in ``out`` (the lengths' cumsum).
        :param token_to_req_indices: int32 ``[>= T]``: each token's request (row of ``block_table``).
        :param block_table: int32 ``[R, W]`` with contiguous rows (the C4 layer's); ``block_size`` its compressed
            tokens a page (``>= 1``).
        :param out: int32 ``[>= T * K]`` (contiguous): the stream, of which ``out[:indptr[T]]`` is written.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or a block size below 1.
        """
        _check_topk(self.name, topk_indices)
        tokens, topk = topk_indices.shape
        _check_vector(self.name, "indptr", indptr, tokens + 1)
        _check_vector(self.name, "token_to_req_indices", token_to_req_indices, tokens)
        _check_vector(self.name, "out", out, tokens * topk)
        check_int32_table(self.name, "block_table", block_table, 0)
        if block_size < 1:
            raise warmreg.LaunchError(self.name, f"block_size must be >= 1 (got {block_size})")
        key = self.dispatch()
        kwargs = dict(
            out_ptr=out, indptr_ptr=indptr, topk_ptr=topk_indices, topk_stride=topk_indices.stride(0),
            token_to_req_ptr=token_to_req_indices, block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            block_size=block_size, topk=topk, TILE=key.tile,
        )  # fmt: skip
        grid = (tokens, triton.cdiv(topk, key.tile)) if tokens and topk else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)


def rocm_global_topk_ragged(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    *,
    lens_op: RocmTopkLens | None = None,
    pack_op: RocmPackTopkRagged | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drop-in for vLLM's ``compute_global_topk_ragged_indices_and_indptr``: ``(ragged [T * K], indptr [T + 1],
    lens [T])`` int32 (``topk_indices`` reshaped to ``[T, -1]`` and made contiguous, as vLLM does).

    :param lens_op: the count op to launch (a fresh one by default); ``pack_op`` likewise.
    :raises warmreg.LaunchError: as the two ops.
    """
    topk_indices = topk_indices.reshape(topk_indices.shape[0], -1).contiguous()
    tokens, topk = topk_indices.shape
    lens = (lens_op or RocmTopkLens())(topk_indices, is_valid_token)
    indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=topk_indices.device)
    torch.cumsum(lens, dim=0, out=indptr[1:])
    ragged = torch.empty(tokens * topk, dtype=torch.int32, device=topk_indices.device)
    if ragged.numel():
        (pack_op or RocmPackTopkRagged())(
            topk_indices, indptr, token_to_req_indices, block_table, block_size=block_size, out=ragged
        )
    return ragged, indptr, lens


def global_topk_ragged_reference(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``(ragged [indptr[T]], indptr [T + 1], lens [T])`` int32 (the written prefix)."""
    topk = topk_indices.reshape(topk_indices.shape[0], -1).long()
    tokens = topk.shape[0]
    lens = torch.where(is_valid_token[:tokens], (topk >= 0).sum(dim=1), 0)
    indptr = torch.zeros(tokens + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    parts = []
    for t in range(tokens):
        local = topk[t, : int(lens[t])]
        req = int(token_to_req_indices[t])
        pages = block_table[req].long()[torch.where(local >= 0, local // block_size, 0)]
        parts.append(torch.where(local >= 0, pages * block_size + local % block_size, -1))
    ragged = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return ragged.to(torch.int32), indptr.to(torch.int32), lens.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register both kernels on ROCm when the model has C4 layers (every such layer's decode)."""
    for kernel in (RocmTopkLens(), RocmPackTopkRagged()):
        registry.add(kernel, when=warmreg.is_rocm if model.has_c4 else False)
