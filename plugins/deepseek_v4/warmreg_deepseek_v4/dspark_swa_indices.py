"""Non-causal SWA indices and lens of a DSpark draft step (vLLM 0.33 ``v1/attention/backends/mla/sparse_swa.py``:
``ComputeDSparkNoncausalSWAIndicesKernel``, launched by ``DeepseekSparseSWAMetadataBuilder.build`` for the decode
rows when the metadata is built with ``causal=False``, and by ``update_draft_decode_metadata`` on FULL-graph
replays of the draft).

Every query token of a request sees the same row: the ``window`` context tokens before the draft block and the
whole block, later tokens included. For output row ``i`` (token ``t = i + token_offset``, request ``r``,
``qlen = qsl[r + 1] - qsl[r]``, SWA page size ``bs``, row width ``W``)::

    invalid t (slot < 0):  lens[i] = 0;  out[i, :W] = -1              (clears a padded token's stale row)
    start = max(seq_lens[r] - qlen - window, 0);   L = seq_lens[r] - start      (= min(prefix, window) + qlen)
    lens[i] = L                                                        (NOT clamped to W)
    out[i, c] = c < L ? block_table[r, (start + c) // bs] * bs + (start + c) % bs : -1      for c < W

``W`` is ``round_up(window + N, 64)`` (:func:`~.dspark.dspark_swa_index_width`), so ``L <= W`` whenever a request
carries at most ``N`` query tokens; a wider block (``1 + N`` tokens with ``window + N`` a multiple of 64) stores
only ``W`` entries while ``lens`` says ``L``, as the engine's kernel does. There is no replay lower bound (draft
rows sit above any replayed window) and no image visibility.

Key: ``window_size``, ``index_width`` and ``block_size`` are specialized ints (their classes are key fields);
the strides and ``token_offset`` are ``do_not_specialize``. Pointers are not specialized on alignment (see
:mod:`warmreg_deepseek_v4.metadata`). Runtime-bound loops are ``while`` loops (see :mod:`.sparse_mla`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._metadata_common import TILE
from .dspark import DSparkDraft
from .model import DSV4, SWA_PAGE_SIZE

__all__ = ["DSparkSwaIndices", "DSparkSwaIndicesKey", "dspark_swa_indices_reference", "register"]


@triton.jit(
    do_not_specialize=["swa_indices_stride", "block_table_stride", "token_offset"],
    do_not_specialize_on_alignment=[
        "swa_indices_ptr", "swa_lens_ptr", "query_start_loc_ptr", "seq_lens_ptr", "token_to_req_ptr",
        "is_valid_token_ptr", "block_table_ptr",
    ],
)  # fmt: skip
def _dspark_swa_indices_kernel(
    swa_indices_ptr,
    swa_indices_stride,
    swa_lens_ptr,
    window_size,
    index_width,
    query_start_loc_ptr,
    seq_lens_ptr,
    token_to_req_ptr,
    is_valid_token_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    token_offset,
    TRITON_BLOCK_SIZE: tl.constexpr,  # column tile
):
    i = tl.program_id(0).to(tl.int64)
    t = i + token_offset
    row = swa_indices_ptr + i * swa_indices_stride
    valid = tl.load(is_valid_token_ptr + t)
    req = tl.load(token_to_req_ptr + t, mask=valid, other=0).to(tl.int64)
    q0 = tl.load(query_start_loc_ptr + req, mask=valid, other=0)
    qlen = tl.load(query_start_loc_ptr + req + 1, mask=valid, other=0) - q0
    seq = tl.load(seq_lens_ptr + req, mask=valid, other=0)
    start = tl.maximum(seq - qlen - window_size, 0)
    length = tl.where(valid, seq - start, 0)  # an invalid row: lens 0, every column -1
    bt_row = block_table_ptr + req * block_table_stride
    c0 = 0
    while c0 < index_width:
        c = c0 + tl.arange(0, TRITON_BLOCK_SIZE)
        live = c < length
        p = (start + c).to(tl.int64)
        page = tl.load(bt_row + p // block_size, mask=live, other=0)
        tl.store(row + c, tl.where(live, page * block_size + p % block_size, -1), mask=c < index_width)
        c0 += TRITON_BLOCK_SIZE
    tl.store(swa_lens_ptr + i, length.to(tl.int32))


@attrs.frozen(kw_only=True)
class DSparkSwaIndicesKey(warmreg.CompileKey):
    """What changes the binary: the classes of the three specialized ints, the tile, ``num_warps``."""

    window_size: str  # int_class: 128 -> "div16"
    index_width: str  # int_class of W = round_up(window + N, 64): always "div16"
    block_size: str  # int_class of the SWA page size (64)
    triton_block_size: int
    num_warps: int


class DSparkSwaIndices(warmreg.TritonKernel[DSparkSwaIndicesKey]):
    """Non-causal SWA slots and lens of a DSpark draft step's decode tokens (see the module docstring).

    :param window: the sliding window (domains only); :param index_width: the deployment's DSpark row width;
    :param block_size: the SWA page size (domains only): 64 for DeepSeek-V4, 32 for V4.1.
    """

    name = "deepseek_v4.dspark_noncausal_swa_indices"
    key_type = DSparkSwaIndicesKey
    jit = _dspark_swa_indices_kernel

    def __init__(self, *, window: int = 128, index_width: int = 192, block_size: int = SWA_PAGE_SIZE) -> None:
        self.window, self.index_width, self.block_size = window, index_width, block_size

    def dispatch(self, *, window_size: int, index_width: int, block_size: int) -> DSparkSwaIndicesKey:
        return DSparkSwaIndicesKey(
            window_size=warmreg.int_class(window_size),
            index_width=warmreg.int_class(index_width),
            block_size=warmreg.int_class(block_size),
            triton_block_size=TILE,
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"window_size": [self.window], "index_width": [self.index_width], "block_size": [self.block_size]}

    def warmup_inputs(self, key: DSparkSwaIndicesKey) -> Mapping[str, Any]:
        i32 = torch.int32
        return {
            "query_start_loc": warmreg.meta((2,), i32),
            "seq_lens": warmreg.meta((1,), i32),
            "token_to_req": warmreg.meta((1,), i32),
            "is_valid_token": warmreg.meta((1,), torch.bool),
            "block_table": warmreg.meta((1, 1), i32),
            "num_tokens": 1,
            "window_size": warmreg.int_class_rep(key.window_size),
            "index_width": warmreg.int_class_rep(key.index_width),
            "block_size": warmreg.int_class_rep(key.block_size),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        *,
        num_tokens: int,
        window_size: int,
        index_width: int,
        block_size: int,
        token_offset: int = 0,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[DSparkSwaIndicesKey]:
        """Rows of tokens ``[token_offset, token_offset + num_tokens)``; returns ``(swa_indices [n, index_width],
        swa_lens [n])`` int32: fresh, or views of ``out``.

        :param query_start_loc: int32 ``[reqs + 1]``; ``seq_lens`` int32 ``[reqs]`` (the draft batch's, context
            plus block); ``token_to_req`` int32 ``[T]``; ``is_valid_token`` bool ``[T]`` (``slot_mapping >= 0``).
        :param block_table: int32 ``[reqs, *]`` SWA table with contiguous rows (any row stride).
        :param index_width: ``W`` (:func:`~.dspark.dspark_swa_index_width`); ``block_size`` the SWA page (64).
        :param out: optional persistent ``(indices [>= n, 1, W] or [>= n, W], lens [>= n])`` buffers, as the
            builder's ``decode_swa_indices_noncausal`` and ``decode_swa_lens``.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or buffers.
        """
        i32 = torch.int32
        if any(x.dtype != i32 or x.ndim != 1 for x in (query_start_loc, seq_lens, token_to_req)):
            raise warmreg.LaunchError(self.name, "query_start_loc, seq_lens and token_to_req must be 1-D int32")
        if is_valid_token.dtype != torch.bool or is_valid_token.ndim != 1:
            raise warmreg.LaunchError(self.name, "is_valid_token must be 1-D bool (slot_mapping >= 0)")
        end = token_offset + num_tokens
        if num_tokens < 0 or token_offset < 0 or min(token_to_req.shape[0], is_valid_token.shape[0]) < end:
            raise warmreg.LaunchError(
                self.name, f"token_to_req and is_valid_token must cover tokens [{token_offset}, {end})"
            )
        if (
            block_table.dtype != i32
            or block_table.ndim != 2
            or (block_table.shape[1] > 1 and block_table.stride(1) != 1)
        ):
            raise warmreg.LaunchError(self.name, "block_table must be 2-D int32 with contiguous rows")
        if min(window_size, block_size) < 1 or index_width < 1:
            raise warmreg.LaunchError(self.name, "window_size, index_width and block_size must be >= 1")
        key = self.dispatch(window_size=window_size, index_width=index_width, block_size=block_size)
        indices, lens = self._outputs(out, num_tokens, index_width, query_start_loc.device)
        kwargs = dict(
            swa_indices_ptr=indices, swa_indices_stride=indices.stride(0), swa_lens_ptr=lens, window_size=window_size,
            index_width=index_width, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            token_to_req_ptr=token_to_req, is_valid_token_ptr=is_valid_token, block_table_ptr=block_table,
            block_table_stride=block_table.stride(0), block_size=block_size, token_offset=token_offset,
            TRITON_BLOCK_SIZE=key.triton_block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, (indices, lens))

    def _outputs(
        self, out: tuple[torch.Tensor, torch.Tensor] | None, n: int, width: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            return torch.empty((n, width), dtype=torch.int32, device=device), torch.empty(
                (n,), dtype=torch.int32, device=device
            )
        indices, lens = out
        rows = indices.reshape(indices.shape[0], -1) if indices.ndim == 3 and indices.shape[1] == 1 else indices
        if (
            indices.dtype != torch.int32
            or rows.ndim != 2
            or rows.shape[0] < n
            or rows.shape[1] < width
            or rows.stride(1) != 1
        ):
            raise warmreg.LaunchError(
                self.name, f"out indices must be int32 [>= {n}, (1,) >= {width}] with contiguous rows"
            )
        if lens.dtype != torch.int32 or lens.ndim != 1 or lens.shape[0] < n or (n > 1 and lens.stride(0) != 1):
            raise warmreg.LaunchError(self.name, f"out lens must be a contiguous int32 [>= {n}]")
        return rows[:n, :width], lens[:n]


def dspark_swa_indices_reference(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    window_size: int,
    index_width: int,
    block_size: int,
    token_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`DSparkSwaIndices`: ``(swa_indices [n, index_width], swa_lens [n])`` int32."""
    out = torch.full((num_tokens, index_width), -1, dtype=torch.int64)
    lens = torch.zeros(num_tokens, dtype=torch.int64)
    qsl, seqs, bt = query_start_loc.long(), seq_lens.long(), block_table.long()
    for i in range(num_tokens):
        t = i + token_offset
        if not bool(is_valid_token[t]):
            continue
        r = int(token_to_req[t])
        start = max(int(seqs[r]) - int(qsl[r + 1] - qsl[r]) - window_size, 0)
        length = int(seqs[r]) - start
        p = torch.arange(start, start + min(length, index_width))
        out[i, : p.numel()] = bt[r, p // block_size] * block_size + p % block_size
        lens[i] = length
    return out.to(torch.int32), lens.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the non-causal draft SWA indices with DSpark on: every platform, as the SWA metadata builder it
    runs in (CUDA's, and the ROCm and XPU backends', which build on it; DeepSeek-V4.1's ROCm builder,
    ``models/deepseek_v41/amd/rocm.py: DeepseekV41ROCMAiterSparseSWAMetadataBuilder.build``, falls back to it for
    every batch its one-launch ``--monokernel`` build does not take: more than 32 rows, a prefill, or no monokernel).

    :raises warmreg.ConfigError: for an unknown ``speculative_method`` or DSpark fields that do not fit.
    """
    draft = DSparkDraft.from_config(config, model)
    if draft is not None:
        kernel = DSparkSwaIndices(window=draft.window, index_width=draft.index_width, block_size=draft.swa_block_size)
        registry.add(kernel)
