"""DeepSeek-V4 C4 global top-k indices and lens (vLLM 0.33 ``models/common/ops/cache_utils.py``:
``ComputeGlobalTopkIndicesAndLensKernel``).

Used by C4 decode and FlashInfer C4 prefill: the indexer's local top-k of token ``t`` becomes global
slots of the request's compressed block table::

    out[t, j] = l >= 0 ? block_table[token_to_req[t], l // bs] * bs + l % bs : -1     (l = topk[t, j])
    lens[t]   = is_valid_token[t] ? #{j : topk[t, j] >= 0} : 0

Pointers the kernel reads one scalar at a time (or gathers through) are declared
``do_not_specialize_on_alignment``: alignment buys nothing there, and offset views (a chunk's slice of
``token_to_req``) then need no second binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32, out_parts
from ._metadata_common import TILE
from ._serving import max_model_len
from .backends import SPARSE_BACKENDS, attention_backend, compressed_block_size
from .model import DSV4, PLUGIN, SPARSE_BLOCK_SIZE

__all__ = ["GlobalTopkIndices", "GlobalTopkIndicesKey", "global_topk_indices_reference", "register"]


@triton.jit(do_not_specialize_on_alignment=["token_to_req_ptr", "block_table_ptr", "is_valid_token_ptr"])
def _global_topk_indices_kernel(
    topk_ptr,
    token_to_req_ptr,
    block_table_ptr,
    is_valid_token_ptr,
    out_ptr,
    lens_ptr,
    TOPK: tl.constexpr,  # row length of topk and out (index_topk): fixed per model
    TOPK_STRIDE: tl.constexpr,  # row stride of topk (the indexer buffer's width)
    BLOCK_TABLE_STRIDE: tl.constexpr,  # block-table row width: fixed per deployment (max_model_len)
    BLOCK_SIZE: tl.constexpr,  # compressed tokens per page (64 for C4)
    TRITON_BLOCK_SIZE: tl.constexpr,  # column tile
):
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(token_to_req_ptr + t).to(tl.int64)
    count = tl.zeros((), dtype=tl.int32)
    for j0 in range(0, TOPK, TRITON_BLOCK_SIZE):
        j = j0 + tl.arange(0, TRITON_BLOCK_SIZE)
        local = tl.load(topk_ptr + t * TOPK_STRIDE + j, mask=j < TOPK, other=-1)
        ok = local >= 0
        page = tl.load(block_table_ptr + req * BLOCK_TABLE_STRIDE + local // BLOCK_SIZE, mask=ok, other=0)
        tl.store(out_ptr + t * TOPK + j, tl.where(ok, page * BLOCK_SIZE + local % BLOCK_SIZE, -1), mask=j < TOPK)
        count += tl.sum(ok.to(tl.int32), axis=0)
    valid = tl.load(is_valid_token_ptr + t)
    tl.store(lens_ptr + t, tl.where(valid, count, 0))


@attrs.frozen(kw_only=True)
class GlobalTopkIndicesKey(warmreg.CompileKey):
    """What changes the binary of the global top-k kernel: every size is a constexpr."""

    topk: int
    topk_stride: int
    block_table_stride: int
    block_size: int
    triton_block_size: int
    topk_aligned: bool  # topk rows are loaded as vectors; a prefill slice of the buffer is an offset view
    num_warps: int


class GlobalTopkIndices(warmreg.TritonKernel[GlobalTopkIndicesKey]):
    """C4 local top-k indices to global compressed-cache slots, plus per-token lens (see the module docstring).

    The output is a contiguous ``[T, topk]`` (row stride ``topk``), fresh or the caller's ``out=``, so
    only the input's stride is a key field.
    """

    name = "deepseek_v4.global_topk_indices"
    key_type = GlobalTopkIndicesKey
    jit = _global_topk_indices_kernel

    def dispatch(
        self, *, topk_indices: torch.Tensor, block_table: torch.Tensor, block_size: int
    ) -> GlobalTopkIndicesKey:
        return GlobalTopkIndicesKey(
            topk=topk_indices.shape[-1],
            topk_stride=topk_indices.stride(0),
            block_table_stride=block_table.stride(0),
            block_size=block_size,
            triton_block_size=TILE,
            topk_aligned=warmreg.is_aligned(topk_indices),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        tokens = warmreg.token_counts(config, plugin=PLUGIN)
        # The indexer's persistent [max_num_batched_tokens, index_topk] buffer: decode rows are the
        # prefix [:nd]; FlashInfer's C4 prefill reads the rows [nd:T] (an offset view).
        buffer = warmreg.meta((tokens[-1] + 3, model.index_topk), torch.int32)
        views = [buffer[:t] for t in tokens] + [buffer[nd : nd + t] for nd in (1, 2, 3) for t in tokens]
        width = triton.cdiv(max_model_len(config), SPARSE_BLOCK_SIZE)
        max_reqs = config.get("serving.max_num_seqs", int, plugin=PLUGIN, default=1)
        return {
            "topk_indices": views,
            "block_table": [warmreg.meta((max_reqs, width), torch.int32)],
            "block_size": [compressed_block_size(config, 4)],
        }

    def warmup_inputs(self, key: GlobalTopkIndicesKey) -> Mapping[str, Any]:
        offset = 0 if key.topk_aligned else 1
        return {
            "topk_indices": warmreg.meta((1, key.topk), torch.int32, stride=(key.topk_stride, 1), offset=offset),
            "token_to_req": warmreg.meta((1,), torch.int32),
            "block_table": warmreg.meta((1, key.block_table_stride), torch.int32),
            "is_valid_token": warmreg.meta((1,), torch.bool),
            "block_size": key.block_size,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        token_to_req: torch.Tensor,
        block_table: torch.Tensor,
        is_valid_token: torch.Tensor,
        *,
        block_size: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[GlobalTopkIndicesKey]:
        """Map local top-k indices to global slots; returns ``(global_topk [T, topk], lens [T])`` int32 (fresh, or
        ``out``).

        :param topk_indices: int32 ``[T, topk]`` local compressed indices (``-1`` = none), contiguous rows.
        :param token_to_req: int32 ``[>= T]``.
        :param block_table: int32 ``[reqs, max_blocks]`` of the compressed cache, contiguous rows.
        :param is_valid_token: bool ``[>= T]``; an invalid token gets ``lens = 0``.
        :param block_size: compressed tokens per page (64 for C4).
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[T, topk]`` and ``[T]``,
            contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        check_int32(self.name, topk_indices=topk_indices, token_to_req=token_to_req, block_table=block_table)
        if topk_indices.ndim != 2 or topk_indices.stride(1) != 1 or block_table.ndim != 2 or block_table.stride(1) != 1:
            raise warmreg.LaunchError(self.name, "topk_indices and block_table must be 2-D with contiguous rows")
        T = topk_indices.shape[0]
        if is_valid_token.dtype != torch.bool or token_to_req.shape[0] < T or is_valid_token.shape[0] < T:
            raise warmreg.LaunchError(
                self.name, f"token_to_req (int32) and is_valid_token (bool) must cover T={T} tokens"
            )
        if block_size < 1:
            raise warmreg.LaunchError(self.name, f"block_size={block_size} must be >= 1")
        key = self.dispatch(topk_indices=topk_indices, block_table=block_table, block_size=block_size)
        out_rows, out_lens = out_parts(self.name, out, 2)
        device = topk_indices.device
        indices = warmreg.output(self.name, "out[0]", out_rows, tuple(topk_indices.shape), torch.int32, device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (T,), torch.int32, device)
        kwargs = dict(
            topk_ptr=topk_indices, token_to_req_ptr=token_to_req, block_table_ptr=block_table,
            is_valid_token_ptr=is_valid_token, out_ptr=indices, lens_ptr=lens, TOPK=key.topk, TOPK_STRIDE=key.topk_stride,
            BLOCK_TABLE_STRIDE=key.block_table_stride, BLOCK_SIZE=key.block_size, TRITON_BLOCK_SIZE=key.triton_block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, (indices, lens))


def global_topk_indices_reference(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    is_valid_token: torch.Tensor,
    *,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`GlobalTopkIndices`: ``(global_topk [T, topk], lens [T])`` int32."""
    T = topk_indices.shape[0]
    local = topk_indices.long()
    ok = local >= 0
    req = token_to_req[:T].long()
    pages = block_table.long()[req[:, None], torch.where(ok, local // block_size, 0)]
    out = torch.where(ok, pages * block_size + local % block_size, -1).to(torch.int32)
    lens = torch.where(is_valid_token[:T], ok.sum(dim=1), 0).to(torch.int32)
    return out, lens


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the global top-k kernel: CUDA, a DeepSeek-V4 sparse backend, C4 layers present.

    It serves C4 only: C128 decode reads the C128A metadata's global slots directly, and C128 prefill
    goes through the combine (FlashMLA) or FlashInfer index kernels, so vLLM's extra C128 warmup widths
    are not needed.
    """
    sparse = attention_backend(config) in SPARSE_BACKENDS
    registry.add(GlobalTopkIndices(), when=warmreg.is_cuda if sparse and model.has_c4 else False)
