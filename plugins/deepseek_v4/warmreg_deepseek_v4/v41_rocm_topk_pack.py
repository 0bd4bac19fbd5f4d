"""DeepSeek-V4.1 ROCm decode on gfx942 with ``--monokernel``: the indexer's top-k as a ragged stream of cache slots in
ONE launch (vLLM 0.34 ``models/deepseek_v41/amd/ops/topk_pack.py``: ``pack`` -> ``launch`` -> ``_topk_pack_kernel``).

The same three tensors as the two-launch path (:mod:`.rocm_decode_topk`: count, cumsum, pack) for decode token ``t``
(request ``r = token_to_req[t]``), its top-k row ``topk[t, :K]`` of local compressed positions and the compressed block
size ``B``::

    lens[t]   = is_valid[t] ? #{j < K : topk[t, j] >= 0} : 0;        indptr = [0, cumsum(lens)]
    out[indptr[t] + j] = topk[t, j] >= 0 ? block_table[r, topk[t, j] // B] * B + topk[t, j] % B : -1   (j < lens[t])

One program holds the whole batch as a ``ROWS x BLOCK`` int32 tile (``ROWS = next_pow2(T)``, ``T <= 16``; ``BLOCK =
next_pow2(K)``), 8 warps, as vLLM's ``launch``. Only ``out[:indptr[T]]`` is written.

Where it runs: V4.1's ``_decode_topk_ragged`` (``amd/rocm.py``) of every compressed layer (ratio 1 or 2; the index
source computes it once a step for each ratio below it) calls ``compute_global_topk_ragged_indices_and_indptr``, which
takes this launch when ``ops.enabled()`` (``--monokernel`` on gfx942: ``kernel_config.monokernel``, warmreg's
``serving.monokernel``) and the batch has ``0 < T <= 16`` int32 rows with unit column stride and a validity vector of
exactly ``T``; any other batch takes the two-launch path.

Key: the tile (``ROWS``, ``BLOCK``) and the warps. ``T``, ``K``, ``B`` and the strides are runtime ints
(``do_not_specialize``) and no pointer is specialized on alignment (views of persistent buffers). Every buffer is far
below 2 GB (the same ``tt.pointer_range = 32`` for every launch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table, out_parts
from ._v41_rocm import compressed_layers, max_decode_tokens, monokernel
from .model import DSV4

__all__ = ["MAX_ROWS", "V41RocmTopkPack", "V41RocmTopkPackKey", "register"]

#: The most decode tokens the one-launch pack takes (vLLM's ``MAX_ROWS``).
MAX_ROWS = 16
_NUM_WARPS = 8  # vLLM's launch
_POINTERS = ["ragged_ptr", "indptr_ptr", "lens_ptr", "topk_ptr", "valid_ptr", "token_to_req_ptr", "block_table_ptr"]


@triton.jit(
    do_not_specialize=["topk_stride", "block_table_stride", "block_size", "num_tokens", "topk"],
    do_not_specialize_on_alignment=_POINTERS,
)
def _topk_pack_kernel(
    ragged_ptr,
    indptr_ptr,
    lens_ptr,
    topk_ptr,
    topk_stride,
    valid_ptr,
    token_to_req_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    num_tokens,
    topk,
    ROWS: tl.constexpr,  # next_pow2(T): the batch's rows in one tile
    BLOCK: tl.constexpr,  # next_pow2(K): a whole top-k row
):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live_row = rows < num_tokens
    live_col = cols < topk
    local = tl.load(
        topk_ptr + rows[:, None].to(tl.int64) * topk_stride + cols[None, :],
        mask=live_row[:, None] & live_col[None, :],
        other=-1,
    )
    valid = tl.load(valid_ptr + rows, mask=live_row, other=0) != 0
    req = tl.load(token_to_req_ptr + rows, mask=live_row, other=0).to(tl.int64)
    lens = tl.where(valid, tl.sum((local >= 0).to(tl.int32), axis=1), 0)
    ends = tl.cumsum(lens, axis=0)
    tl.store(lens_ptr + rows, lens, mask=live_row)
    tl.store(indptr_ptr, 0)
    tl.store(indptr_ptr + 1 + rows, ends, mask=live_row)
    take = live_row[:, None] & live_col[None, :] & (cols[None, :] < lens[:, None])
    hit = take & (local >= 0)
    page = tl.load(block_table_ptr + req[:, None] * block_table_stride + local // block_size, mask=hit, other=0)
    slot = tl.where(hit, page * block_size + local % block_size, -1)
    tl.store(ragged_ptr + (ends - lens)[:, None] + cols[None, :], slot, mask=take)


@attrs.frozen(kw_only=True)
class V41RocmTopkPackKey(warmreg.CompileKey):
    """What changes the binary: the batch tile (rows, columns) and the warps."""

    rows: int
    block: int
    num_warps: int


def _check(name: str, topk: torch.Tensor, valid: torch.Tensor, t2r: torch.Tensor, table: torch.Tensor) -> None:
    if topk.dtype != torch.int32 or topk.ndim != 2 or (topk.shape[1] > 1 and topk.stride(1) != 1):
        raise warmreg.LaunchError(name, f"topk_indices must be int32 [T, K] with contiguous rows (got {topk.dtype} "
                                  f"{tuple(topk.shape)}, strides {topk.stride()})")  # fmt: skip
    tokens = topk.shape[0]
    if not 0 < tokens <= MAX_ROWS:
        raise warmreg.LaunchError(name, f"topk_indices must have 1..{MAX_ROWS} rows (got {tokens})",
                                  fix="pack larger batches with rocm_decode_topk.rocm_global_topk_ragged")  # fmt: skip
    for what, t, dtype in (("is_valid_token", valid, torch.bool), ("token_to_req_indices", t2r, torch.int32)):
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < tokens or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{what} must be a contiguous {dtype} [>= {tokens}] tensor (got {t.dtype} {tuple(t.shape)})"
            )
    check_int32_table(name, "block_table", table, 0)


class V41RocmTopkPack(warmreg.TritonKernel[V41RocmTopkPackKey]):
    """The decode top-k of up to 16 tokens as ragged cache slots, lengths and indptr in one launch; see the module
    docstring."""

    name = "deepseek_v4.v41_rocm_topk_pack"
    key_type = V41RocmTopkPackKey
    jit = _topk_pack_kernel

    def __init__(self, topk: int = 512, max_tokens: int = MAX_ROWS) -> None:
        """:param topk: the top-k width (``index_topk``); ``max_tokens``: the most decode tokens a step takes here."""
        self.topk, self.max_tokens = topk, max_tokens

    def dispatch(self, *, topk_indices: torch.Tensor) -> V41RocmTopkPackKey:
        tokens, topk = topk_indices.shape
        return V41RocmTopkPackKey(
            rows=triton.next_power_of_2(tokens), block=triton.next_power_of_2(topk), num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = range(1, min(self.max_tokens, MAX_ROWS) + 1)
        return {"topk_indices": [warmreg.meta((t, self.topk), torch.int32) for t in tokens]}

    def warmup_inputs(self, key: V41RocmTopkPackKey) -> Mapping[str, Any]:
        return {
            "topk_indices": warmreg.meta((key.rows, key.block), torch.int32),
            "token_to_req_indices": warmreg.meta((key.rows,), torch.int32),
            "block_table": warmreg.meta((key.rows, 16), torch.int32),
            "block_size": 128,
            "is_valid_token": warmreg.meta((key.rows,), torch.bool),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        is_valid_token: torch.Tensor,
        *,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[V41RocmTopkPackKey]:
        """``(ragged [T * K], indptr [T + 1], lens [T])`` int32, fresh or ``out``; only ``ragged[:indptr[T]]`` is
        written (vLLM's ``launch``).

        :param topk_indices: int32 ``[T, K]`` local top-k rows (``1 <= T <= 16``), contiguous within a row.
        :param token_to_req_indices: int32 ``[>= T]`` (contiguous): each token's row of ``block_table``.
        :param block_table: int32 ``[R, W]`` with contiguous rows; ``block_size`` its compressed tokens a page (>= 1).
        :param is_valid_token: bool ``[>= T]`` (contiguous): whether each token has a slot.
        :param out: the three buffers to write instead of fresh ones, each exactly as the fresh one.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, more than 16 tokens, a block size
            below 1, or an ``out`` unlike the fresh buffers.
        """
        _check(self.name, topk_indices, is_valid_token, token_to_req_indices, block_table)
        if block_size < 1:
            raise warmreg.LaunchError(self.name, f"block_size must be >= 1 (got {block_size})")
        tokens, topk = topk_indices.shape
        dev = topk_indices.device
        parts = out_parts(self.name, out, 3)
        ragged = warmreg.output(self.name, "out[0]", parts[0], (tokens * topk,), torch.int32, dev)
        indptr = warmreg.output(self.name, "out[1]", parts[1], (tokens + 1,), torch.int32, dev)
        lens = warmreg.output(self.name, "out[2]", parts[2], (tokens,), torch.int32, dev)
        key = self.dispatch(topk_indices=topk_indices)
        kwargs = dict(
            ragged_ptr=ragged, indptr_ptr=indptr, lens_ptr=lens, topk_ptr=topk_indices,
            topk_stride=topk_indices.stride(0), valid_ptr=is_valid_token, token_to_req_ptr=token_to_req_indices,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_size=block_size,
            num_tokens=tokens, topk=topk, ROWS=key.rows, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,), kwargs, (ragged, indptr, lens))


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the one-launch pack on gfx942 with ``--monokernel`` for a V4.1 model with compressed layers, at the
    row tiles of decode steps of up to :func:`._v41_rocm.max_decode_tokens` tokens.

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel`.
    """
    on = compressed_layers(model) and monokernel(config, platform)
    kernel = V41RocmTopkPack(topk=model.index_topk, max_tokens=max_decode_tokens(config) if on else 1)
    registry.add(kernel, when=warmreg.rocm_arch_in("gfx942") if on else False)
