"""DeepSeek-V4 C128A top-k metadata: the compressed-token indices the sparse attention kernels read
for the C128 (HCA) layers (vLLM 0.33 ``models/deepseek_v4/sparse_mla.py``: ``BuildC128ATopkMetadataKernel``).

Every C128 layer attends to every compressed entry, so the "top-k" of token ``t`` is simply all of
them. With ``n = min((positions[t] + 1) // compress_ratio, W)`` and ``bs`` compressed tokens per page::

    decode  (t <  nd):  global_decode[t, j] = j < n ? block_table[token_to_req[t], j // bs] * bs + j % bs : -1
                        decode_lens[t]      = slot_mapping[t] >= 0 ? n : 0
    prefill (t >= nd):  prefill_local[t - nd, j] = j < n ? j : -1                  for j < W

Pointers the kernel reads one scalar at a time (or gathers through) are declared
``do_not_specialize_on_alignment``: alignment buys nothing there, and offset views (a chunk's slice of
``token_to_req``) then need no second binary.

Loops with a runtime bound are ``while`` loops: Triton 3.6.0's interpreter turns ``range(n)`` of a
runtime ``n`` into ``int()`` of a 1-element numpy array, which numpy 2.4 refuses (TypeError), so a
``for`` loop would fail every CPU test. The compiled kernel is the same loop either way.

The attention-backend policy and the C128 widths this module used to hold are in
:mod:`warmreg_deepseek_v4.backends`; the names stay importable from here for older callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32, out_for_buffers
from ._metadata_common import TILE
from ._serving import max_model_len

# The "as" imports re-export names that moved to backends.py: benchmarks/ and examples/ import them from here.
from .backends import FLASHINFER_SPARSE as FLASHINFER_SPARSE
from .backends import FLASHMLA_SPARSE as FLASHMLA_SPARSE
from .backends import SPARSE_BACKENDS, attention_backend, c128_widths, compressed_block_size
from .backends import c128_active_width as c128_active_width
from .backends import c128_max_width as c128_max_width
from .model import DSV4

__all__ = ["C128ATopkMetadata", "C128ATopkMetadataKey", "c128_topk_metadata_reference", "register"]


@triton.jit(
    do_not_specialize=["num_decode_tokens", "global_decode_stride", "prefill_local_stride", "block_table_stride"],
    do_not_specialize_on_alignment=[
        "positions_ptr", "token_to_req_ptr", "block_table_ptr", "slot_mapping_ptr",
        "global_decode_ptr", "decode_lens_ptr", "prefill_local_ptr",
    ],
)  # fmt: skip
def _c128a_topk_metadata_kernel(
    positions_ptr,
    token_to_req_ptr,
    block_table_ptr,
    slot_mapping_ptr,
    global_decode_ptr,
    decode_lens_ptr,
    prefill_local_ptr,
    num_decode_tokens,
    global_decode_stride,
    prefill_local_stride,
    block_table_stride,
    compress_ratio,
    max_compressed_tokens,
    block_size,
    TRITON_BLOCK_SIZE: tl.constexpr,  # column tile: a row of W entries is written in tiles of this size
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    n = tl.minimum((pos + 1) // compress_ratio, max_compressed_tokens).to(tl.int32)
    if t < num_decode_tokens:
        req = tl.load(token_to_req_ptr + t).to(tl.int64)
        bt_row = block_table_ptr + req * block_table_stride
        row = global_decode_ptr + t * global_decode_stride
        j0 = 0
        while j0 < max_compressed_tokens:  # not range(): see the module docstring
            j = j0 + tl.arange(0, TRITON_BLOCK_SIZE)
            live = j < n
            page = tl.load(bt_row + j // block_size, mask=live, other=0)
            tl.store(row + j, tl.where(live, page * block_size + j % block_size, -1), mask=j < max_compressed_tokens)
            j0 += TRITON_BLOCK_SIZE
        valid = tl.load(slot_mapping_ptr + t) >= 0
        tl.store(decode_lens_ptr + t, tl.where(valid, n, 0))
    else:
        row = prefill_local_ptr + (t - num_decode_tokens) * prefill_local_stride
        j0 = 0
        while j0 < max_compressed_tokens:
            j = j0 + tl.arange(0, TRITON_BLOCK_SIZE)
            tl.store(row + j, tl.where(j < n, j, -1), mask=j < max_compressed_tokens)
            j0 += TRITON_BLOCK_SIZE


@attrs.frozen(kw_only=True)
class C128ATopkMetadataKey(warmreg.CompileKey):
    """What changes the binary of the C128A top-k metadata kernel (one key in practice)."""

    triton_block_size: int  # the column tile (constexpr)
    compress_ratio: str  # int_class: 128 -> "div16"
    max_compressed_tokens: str  # int_class of W: a multiple of 128 -> "div16"
    block_size: str  # int_class of compressed tokens per page: 2 -> "other"
    num_warps: int


class C128ATopkMetadata(warmreg.TritonKernel[C128ATopkMetadataKey]):
    """Decode global slots, prefill local indices and decode lens of the C128 layers (see the module docstring).

    The row width ``W`` (``max_compressed_tokens``) is a specialized int, so the 7 widths of a 1M-context
    deployment share one binary; ``num_decode_tokens`` and every stride are ``do_not_specialize``.
    """

    name = "deepseek_v4.c128a_topk_metadata"
    key_type = C128ATopkMetadataKey
    jit = _c128a_topk_metadata_kernel

    def dispatch(self, *, compress_ratio: int, max_compressed_tokens: int, block_size: int) -> C128ATopkMetadataKey:
        return C128ATopkMetadataKey(
            triton_block_size=TILE,
            compress_ratio=warmreg.int_class(compress_ratio),
            max_compressed_tokens=warmreg.int_class(max_compressed_tokens),
            block_size=warmreg.int_class(block_size),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "compress_ratio": [128],
            "max_compressed_tokens": c128_widths(max_model_len(config)),
            "block_size": [compressed_block_size(config, 128)],
        }

    def warmup_inputs(self, key: C128ATopkMetadataKey) -> Mapping[str, Any]:
        return {
            "positions": warmreg.meta((2,), torch.int64),
            "token_to_req": warmreg.meta((2,), torch.int32),
            "block_table": warmreg.meta((1, 1), torch.int32),
            "slot_mapping": warmreg.meta((2,), torch.int64),
            "num_decode_tokens": 1,
            "compress_ratio": warmreg.int_class_rep(key.compress_ratio),
            "max_compressed_tokens": warmreg.int_class_rep(key.max_compressed_tokens),
            "block_size": warmreg.int_class_rep(key.block_size),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        token_to_req: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        num_decode_tokens: int,
        max_compressed_tokens: int,
        block_size: int,
        compress_ratio: int = 128,
        global_decode: torch.Tensor | None = None,
        decode_lens: torch.Tensor | None = None,
        prefill_local: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[C128ATopkMetadataKey]:
        """Build the step's C128 metadata; returns ``(global_decode [nd, 1, W], decode_lens [nd], prefill_local [np, W])``.

        :param positions: int64 ``[T]`` absolute positions, decode tokens first.
        :param token_to_req: int32 ``[>= nd]`` request of each token (read for decode tokens only).
        :param block_table: int32 ``[reqs, max_blocks]`` compressed-cache block table, clamped to ``>= 0``.
        :param slot_mapping: int64 ``[>= nd]`` uncompressed slots; ``-1`` (padding) gives a decode len of 0.
        :param num_decode_tokens: ``nd``; the ``T - nd`` prefill tokens follow.
        :param max_compressed_tokens: the step's width ``W`` (:func:`c128_active_width`).
        :param block_size: compressed tokens per page (``256 // 128 = 2``).
        :param global_decode: optional persistent ``[>= nd, >= W]`` int32 buffer (stable address for
            CUDA graphs); likewise ``decode_lens`` ``[>= nd]`` and ``prefill_local`` ``[>= np, >= W]``.
            Fresh tensors are allocated when omitted. Returned views keep the buffers' row stride.
        :param out: the three persistent buffers as one tuple ``(global_decode, decode_lens, prefill_local)``
            (the order returned), instead of the keywords.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, counts or buffers too small, or ``out`` given with a
            keyword.
        """
        if out is not None:
            global_decode, decode_lens, prefill_local = out_for_buffers(
                self.name, out, global_decode=global_decode, decode_lens=decode_lens, prefill_local=prefill_local
            )
        if positions.ndim != 1 or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
            raise warmreg.LaunchError(self.name, "positions and slot_mapping must be 1-D int64")
        T, nd, W = positions.shape[0], num_decode_tokens, max_compressed_tokens
        check_int32(self.name, token_to_req=token_to_req, block_table=block_table)
        if not 0 <= nd <= T or token_to_req.shape[0] < nd or slot_mapping.shape[0] < nd:
            raise warmreg.LaunchError(
                self.name,
                f"num_decode_tokens={nd} must be in [0, T={T}] with token_to_req and slot_mapping covering it",
            )
        if W < 1 or block_size < 1 or compress_ratio < 1:
            raise warmreg.LaunchError(
                self.name,
                f"max_compressed_tokens={W}, block_size={block_size}, compress_ratio={compress_ratio} must be >= 1",
            )
        if block_table.ndim != 2 or block_table.stride(1) != 1:
            raise warmreg.LaunchError(self.name, "block_table must be 2-D with contiguous rows")
        device = positions.device
        global_decode = _buffer(self.name, "global_decode", global_decode, (nd, W), device)
        prefill_local = _buffer(self.name, "prefill_local", prefill_local, (T - nd, W), device)
        decode_lens = _buffer(self.name, "decode_lens", decode_lens, (nd,), device)
        key = self.dispatch(compress_ratio=compress_ratio, max_compressed_tokens=W, block_size=block_size)
        kwargs = dict(
            positions_ptr=positions, token_to_req_ptr=token_to_req, block_table_ptr=block_table,
            slot_mapping_ptr=slot_mapping, global_decode_ptr=global_decode, decode_lens_ptr=decode_lens,
            prefill_local_ptr=prefill_local, num_decode_tokens=nd, global_decode_stride=global_decode.stride(0),
            prefill_local_stride=prefill_local.stride(0), block_table_stride=block_table.stride(0),
            compress_ratio=compress_ratio, max_compressed_tokens=W, block_size=block_size,
            TRITON_BLOCK_SIZE=key.triton_block_size,
        )  # fmt: skip
        outputs = (global_decode[:nd, :W].unsqueeze(1), decode_lens[:nd], prefill_local[: T - nd, :W])
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, outputs)


def _buffer(
    kernel: str, name: str, buf: torch.Tensor | None, need: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if buf is None:
        return torch.empty(need, dtype=torch.int32, device=device)
    if buf.dtype != torch.int32 or buf.ndim != len(need) or buf.stride(-1) != 1:
        raise warmreg.LaunchError(kernel, f"{name} must be an int32 {len(need)}-D buffer with contiguous rows")
    if any(have < want for have, want in zip(buf.shape, need)):
        raise warmreg.LaunchError(kernel, f"{name} {tuple(buf.shape)} is smaller than the {need} this step needs")
    return buf


def c128_topk_metadata_reference(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_decode_tokens: int,
    max_compressed_tokens: int,
    block_size: int,
    compress_ratio: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`C128ATopkMetadata`: ``(global_decode [nd,1,W], decode_lens [nd], prefill_local [np,W])``."""
    nd, W = num_decode_tokens, max_compressed_tokens
    j = torch.arange(W, dtype=torch.int64)
    n = torch.clamp((positions.long() + 1) // compress_ratio, max=W)
    live = j[None, :] < n[:, None]
    req = token_to_req[:nd].long()
    pages = block_table.long()[req[:, None], torch.where(live[:nd], j // block_size, 0)]
    global_decode = torch.where(live[:nd], pages * block_size + j % block_size, -1).to(torch.int32)
    decode_lens = torch.where(slot_mapping[:nd] >= 0, n[:nd], 0).to(torch.int32)
    prefill_local = torch.where(live[nd:], j, -1).to(torch.int32)
    return global_decode.unsqueeze(1), decode_lens, prefill_local


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the C128A metadata kernel: CUDA, a DeepSeek-V4 sparse backend, C128 layers present."""
    sparse = attention_backend(config) in SPARSE_BACKENDS
    registry.add(C128ATopkMetadata(), when=warmreg.is_cuda if sparse and model.has_c128 else False)
