"""Uniform decode flattening: a uniform multi-token decode batch as one-token rows for a sparse-MLA indexer.

vLLM 0.34 ``v1/attention/backends/mla/indexer.py``: ``PrepareUniformDecodeKernel``, run by
``DeepseekV32IndexerMetadataBuilder._prepare_decode_tensors`` for the decode logits of DeepSeek-V4's C4 indexer and
Kimi-K3.1's DSA indexer when decode is flattened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from ..contract.config import WarmConfig
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta
from ..values.errors import LaunchError
from ..values.key import CompileKey, IntClass, int_class, int_class_rep
from ..values.platform import Platform
from ._index_checks import TILE, check_int32_table, check_int32_vector, out_for_buffers

__all__ = ["PrepareUniformDecode", "UniformDecodeKey", "prepare_uniform_decode_reference"]

_I32 = torch.int32


@triton.jit(
    do_not_specialize_on_alignment=[
        "seq_lens_ptr", "block_table_ptr", "decode_seq_lens_ptr", "expanded_block_table_ptr", "decode_lens_ptr"
    ]
)  # fmt: skip
def _prepare_uniform_decode_kernel(
    seq_lens_ptr,
    block_table_ptr,
    decode_seq_lens_ptr,
    expanded_block_table_ptr,
    decode_lens_ptr,
    block_table_stride,
    expanded_bt_stride,
    max_decode_len,
    TILE: tl.constexpr,  # table columns per loop iteration
):
    i = tl.program_id(0)
    req = i // max_decode_len
    j = i % max_decode_len
    seq_len = tl.load(seq_lens_ptr + req)
    tl.store(decode_seq_lens_ptr + i, tl.maximum(seq_len - max_decode_len + j + 1, 0))
    src = block_table_ptr + req.to(tl.int64) * block_table_stride
    dst = expanded_block_table_ptr + i.to(tl.int64) * expanded_bt_stride
    for c0 in range(0, expanded_bt_stride, TILE):
        c = c0 + tl.arange(0, TILE)
        tl.store(dst + c, tl.load(src + c, mask=c < expanded_bt_stride), mask=c < expanded_bt_stride)
    tl.store(decode_lens_ptr + i, 1)


@attrs.frozen(kw_only=True)
class UniformDecodeKey(CompileKey):
    """What changes the binary of the uniform decode flattening."""

    tile: int
    block_table_stride: IntClass
    expanded_bt_stride: IntClass
    max_decode_len: IntClass
    num_warps: int


class PrepareUniformDecode(TritonKernel[UniformDecodeKey]):
    """Flattens a uniform decode batch (every request has ``D`` tokens) into one row per token for
    the indexer's decode logits. Token ``i`` of request ``r = i // D``, ``j = i % D``::

        decode_seq_lens[i] = max(seq_lens[r] - D + j + 1, 0)
        expanded_block_table[i, :EW] = block_table[r, :EW];  decode_lens[i] = 1

    ``EW`` is the expanded table's row width. The warm space: both strides are the indexer group's
    block-table width (vLLM's builder sizes its expanded table like the group's table), and ``D`` ranges over
    ``1 .. max_decode_len`` (a decode request carries 1 to ``1 + num_speculative_tokens`` tokens; ``D = 1``
    happens in a step where no request has drafts). Only that class, not the full {1, 2, 16}^3 set.

    :param table_width: the indexer group's block-table row width (DeepSeek-V4:
        ``block_table_width(max_model_len, 256)``; Kimi-K3.1: the kernel-page table's width).
    :param max_decode_len: ``1 + num_speculative_tokens``, the most tokens of one decode request.
    """

    name = "warmreg.ops.prepare_uniform_decode"
    key_type = UniformDecodeKey
    jit = _prepare_uniform_decode_kernel

    def __init__(self, *, table_width: int = 1, max_decode_len: int = 1) -> None:
        self.table_width, self.max_decode_len = table_width, max_decode_len

    def dispatch(
        self, *, block_table: torch.Tensor, expanded_block_table: torch.Tensor, max_decode_len: int
    ) -> UniformDecodeKey:
        return UniformDecodeKey(
            tile=TILE,
            block_table_stride=int_class(block_table.stride(0)),
            expanded_bt_stride=int_class(expanded_block_table.stride(0)),
            max_decode_len=int_class(max_decode_len),
            num_warps=4,
        )

    def domains(self, config: WarmConfig, platform: Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "block_table": [meta((1, self.table_width), _I32)],
            "expanded_block_table": [meta((1, self.table_width), _I32)],
            "max_decode_len": range(1, self.max_decode_len + 1),
        }

    def warmup_inputs(self, key: UniformDecodeKey) -> Mapping[str, Any]:
        width = int_class_rep(key.expanded_bt_stride)
        return {
            "seq_lens": meta((2,), _I32),
            "block_table": meta((2, width), _I32, stride=(int_class_rep(key.block_table_stride), 1)),
            "expanded_block_table": meta((64, width), _I32),
            "max_decode_len": int_class_rep(key.max_decode_len),
        }

    @kernel_launcher
    def __call__(
        self,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        max_decode_len: int,
        decode_seq_lens: torch.Tensor | None = None,
        expanded_block_table: torch.Tensor | None = None,
        decode_lens: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> LaunchSpec[UniformDecodeKey]:
        """Fill rows ``[0, num_decodes * D)`` of the outputs; returns ``(decode_seq_lens,
        expanded_block_table, decode_lens)`` (the given persistent buffers, or fresh ones of that many rows).

        :param seq_lens: int32 ``[num_decodes]``.
        :param block_table: int32 ``[>= num_decodes, >= EW]`` with contiguous rows.
        :param max_decode_len: ``D``, the tokens of every decode request.
        :param decode_seq_lens: optional persistent int32 ``[>= num_decodes * D]`` buffer, likewise
            ``decode_lens``; ``expanded_block_table`` int32 ``[>= num_decodes * D, EW]``, row-contiguous, ``EW`` at
            most the table's width. Rows past ``num_decodes * D`` are untouched; fresh ones when omitted.
        :param out: the three persistent buffers as one tuple in the order returned, instead of the keywords.
        :raises LaunchError: for wrong dtypes, short buffers, an expanded table narrower rows than its stride, or
            ``out`` given with a keyword.
        """
        if out is not None:
            decode_seq_lens, expanded_block_table, decode_lens = out_for_buffers(
                self.name, out, decode_seq_lens=decode_seq_lens, expanded_block_table=expanded_block_table,
                decode_lens=decode_lens,
            )  # fmt: skip
        check_int32_vector(self.name, seq_lens=seq_lens)
        num_decodes = seq_lens.shape[0]
        check_int32_table(self.name, "block_table", block_table, num_decodes)
        if max_decode_len < 1:
            raise LaunchError(self.name, f"max_decode_len must be >= 1 (got {max_decode_len})")
        num_tokens = num_decodes * max_decode_len
        if expanded_block_table is None:
            expanded_block_table = block_table.new_empty((num_tokens, block_table.shape[1]))
        decode_seq_lens = seq_lens.new_empty(num_tokens) if decode_seq_lens is None else decode_seq_lens
        decode_lens = seq_lens.new_empty(num_tokens) if decode_lens is None else decode_lens
        check_int32_vector(self.name, decode_seq_lens=decode_seq_lens, decode_lens=decode_lens)
        check_int32_table(self.name, "expanded_block_table", expanded_block_table, num_tokens)
        width = expanded_block_table.shape[1]
        if expanded_block_table.stride(0) != width or block_table.shape[1] < width:
            raise LaunchError(self.name, "expanded_block_table must be row-contiguous and no wider than block_table")
        if min(decode_seq_lens.shape[0], decode_lens.shape[0]) < num_tokens:
            raise LaunchError(self.name, f"decode_seq_lens and decode_lens need {num_tokens} rows")
        key = self.dispatch(
            block_table=block_table, expanded_block_table=expanded_block_table, max_decode_len=max_decode_len
        )
        kwargs = dict(
            seq_lens_ptr=seq_lens, block_table_ptr=block_table, decode_seq_lens_ptr=decode_seq_lens,
            expanded_block_table_ptr=expanded_block_table, decode_lens_ptr=decode_lens,
            block_table_stride=block_table.stride(0), expanded_bt_stride=expanded_block_table.stride(0),
            max_decode_len=max_decode_len, TILE=key.tile,
        )  # fmt: skip
        outputs = (decode_seq_lens, expanded_block_table, decode_lens)
        return LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, outputs)


def prepare_uniform_decode_reference(
    seq_lens: torch.Tensor, block_table: torch.Tensor, *, max_decode_len: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`PrepareUniformDecode` (``width``: EW, default the table's)."""
    d = max_decode_len
    j = torch.arange(seq_lens.shape[0] * d) % d
    seq = seq_lens.repeat_interleave(d)
    table = block_table[: seq_lens.shape[0], : block_table.shape[1] if width is None else width]
    decode_seq_lens = (seq - d + j + 1).clamp(min=0).to(_I32)
    return decode_seq_lens, table.repeat_interleave(d, dim=0), torch.ones_like(decode_seq_lens)
