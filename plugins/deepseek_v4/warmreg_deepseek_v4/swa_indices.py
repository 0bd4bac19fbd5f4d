"""DeepSeek-V4 decode SWA indices and lens (vLLM 0.33 ``_compute_swa_indices_and_lens_kernel``), the
decode input of :mod:`warmreg_deepseek_v4.flashinfer_indices`; the FlashMLA prefill combine of top-k
and SWA indices is in :mod:`warmreg_deepseek_v4.combine_indices`.

For decode token ``t`` (request ``r``, position ``pos``, window ``W``, SWA page size ``bs``,
``replay_start`` the SWA bounded-replay start or 0)::

    left_add = max(left_visible[t] - (W - 1), 0)          right = right_visible[t]     (images; else 0)
    start = max(max(pos - (W - 1) - left_add, 0), replay_start[r])
    len   = is_valid_token[t] ? pos + right + 1 - start : 0
    out[t, c] = valid and c < len ? block_table[r, (start + c) // bs] * bs + (start + c) % bs : -1   for c < index_width

Every pointer is ``do_not_specialize_on_alignment``: rows are addressed through runtime strides, so
alignment could not vectorize anything, and chunk slices (``seq_lens[a:b]``) need no second binary.
Runtime-bound loops are ``while`` loops (see :mod:`warmreg_deepseek_v4.sparse_mla`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import out_parts
from ._metadata_common import TILE
from .backends import SPARSE_BACKENDS, attention_backend
from .model import DSV4, SWA_PAGE_SIZE

__all__ = ["DecodeSwaIndices", "DecodeSwaIndicesKey", "decode_swa_indices_reference", "register"]


@triton.jit(
    do_not_specialize=["swa_indices_stride", "block_table_stride", "token_offset"],
    do_not_specialize_on_alignment=[
        "positions_ptr", "token_to_req_ptr", "is_valid_token_ptr", "block_table_ptr", "replay_start_ptr",
        "left_visible_ptr", "right_visible_ptr", "swa_indices_ptr", "swa_lens_ptr",
    ],
)  # fmt: skip
def _decode_swa_indices_kernel(
    positions_ptr,
    token_to_req_ptr,
    is_valid_token_ptr,
    block_table_ptr,
    replay_start_ptr,
    left_visible_ptr,
    right_visible_ptr,
    swa_indices_ptr,
    swa_lens_ptr,
    swa_indices_stride,
    block_table_stride,
    token_offset,
    window_size,
    index_width,
    block_size,
    HAS_IMAGE: tl.constexpr,  # image spans widen the window: read left/right visibility (else None)
    TRITON_BLOCK_SIZE: tl.constexpr,  # column tile
):
    i = tl.program_id(0).to(tl.int64)
    t = i + token_offset
    req = tl.load(token_to_req_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    if HAS_IMAGE:
        left_add = tl.maximum(tl.load(left_visible_ptr + t).to(tl.int64) - (window_size - 1), 0)
        right = tl.load(right_visible_ptr + t).to(tl.int64)
    else:
        left_add = 0
        right = 0
    start = tl.maximum(tl.maximum(pos - (window_size - 1) - left_add, 0), tl.load(replay_start_ptr + req).to(tl.int64))
    valid = tl.load(is_valid_token_ptr + t)
    length = tl.where(valid, pos + right + 1 - start, 0)
    bt_row = block_table_ptr + req * block_table_stride
    row = swa_indices_ptr + i * swa_indices_stride
    c0 = 0
    while c0 < index_width:
        c = c0 + tl.arange(0, TRITON_BLOCK_SIZE)
        live = c < length
        p = start + c
        page = tl.load(bt_row + p // block_size, mask=live, other=0)
        tl.store(row + c, tl.where(live, page * block_size + p % block_size, -1), mask=c < index_width)
        c0 += TRITON_BLOCK_SIZE
    tl.store(swa_lens_ptr + i, length.to(tl.int32))


@attrs.frozen(kw_only=True)
class DecodeSwaIndicesKey(warmreg.CompileKey):
    """What changes the binary of the decode SWA-indices kernel (one key for text deployments)."""

    window_size: str  # int_class: 128 -> "div16"
    index_width: str  # int_class of the row width (128, or a DSpark width: multiples of 64)
    block_size: str  # int_class of the SWA page size (64)
    has_image: bool
    triton_block_size: int
    num_warps: int


class DecodeSwaIndices(warmreg.TritonKernel[DecodeSwaIndicesKey]):
    """Global SWA-cache slots and lens of decode tokens; the decode input of :class:`~.flashinfer_indices.FlashInferMixedSparseIndices`."""

    name = "deepseek_v4.decode_swa_indices"
    key_type = DecodeSwaIndicesKey
    jit = _decode_swa_indices_kernel

    def dispatch(self, *, window_size: int, index_width: int, block_size: int, has_image: bool) -> DecodeSwaIndicesKey:
        return DecodeSwaIndicesKey(
            window_size=warmreg.int_class(window_size),
            index_width=warmreg.int_class(index_width),
            block_size=warmreg.int_class(block_size),
            has_image=has_image,
            triton_block_size=TILE,
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        return {
            "window_size": [model.sliding_window],
            "index_width": [model.sliding_window],  # causal; DSpark's wider rows are left for later
            "block_size": [SWA_PAGE_SIZE],
            "has_image": [False, True] if model.vision_max_n_token > 0 else [False],
        }

    def warmup_inputs(self, key: DecodeSwaIndicesKey) -> Mapping[str, Any]:
        vis = warmreg.meta((1,), torch.int32) if key.has_image else None
        return {
            "positions": warmreg.meta((1,), torch.int64),
            "token_to_req": warmreg.meta((1,), torch.int32),
            "is_valid_token": warmreg.meta((1,), torch.bool),
            "block_table": warmreg.meta((1, 1), torch.int32),
            "replay_start": warmreg.meta((1,), torch.int32),
            "num_tokens": 1,
            "window_size": warmreg.int_class_rep(key.window_size),
            "index_width": warmreg.int_class_rep(key.index_width),
            "block_size": warmreg.int_class_rep(key.block_size),
            "left_visible": vis,
            "right_visible": vis,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        token_to_req: torch.Tensor,
        is_valid_token: torch.Tensor,
        block_table: torch.Tensor,
        replay_start: torch.Tensor,
        *,
        num_tokens: int,
        window_size: int,
        index_width: int,
        block_size: int,
        token_offset: int = 0,
        left_visible: torch.Tensor | None = None,
        right_visible: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[DecodeSwaIndicesKey]:
        """SWA slots of tokens ``[token_offset, token_offset + num_tokens)``; returns
        ``(swa_indices [num_tokens, index_width], swa_lens [num_tokens])`` int32 (fresh, or ``out``).

        :param positions: int64 ``[T]``; ``token_to_req`` int32 ``[T]``; ``is_valid_token`` bool ``[T]``.
        :param block_table: int32 ``[reqs, max_blocks]`` SWA-cache block table, contiguous rows.
        :param replay_start: int32 ``[reqs]`` first replayed position per request (zeros without replay).
        :param window_size: the sliding window (128); ``index_width`` the row width (``window_size`` when causal).
        :param block_size: SWA page size (64).
        :param left_visible: int32 ``[T]`` image visibility to the left, with ``right_visible``; both or neither.
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[num_tokens, index_width]``
            and ``[num_tokens]``, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        if positions.dtype != torch.int64 or is_valid_token.dtype != torch.bool:
            raise warmreg.LaunchError(self.name, "positions must be int64 and is_valid_token bool")
        if token_to_req.dtype != torch.int32 or replay_start.dtype != torch.int32 or block_table.dtype != torch.int32:
            raise warmreg.LaunchError(self.name, "token_to_req, replay_start and block_table must be int32")
        end = token_offset + num_tokens
        if (
            num_tokens < 0
            or token_offset < 0
            or min(positions.shape[0], token_to_req.shape[0], is_valid_token.shape[0]) < end
        ):
            raise warmreg.LaunchError(
                self.name, f"positions, token_to_req and is_valid_token must cover tokens [{token_offset}, {end})"
            )
        if block_table.ndim != 2 or block_table.stride(1) != 1:
            raise warmreg.LaunchError(self.name, "block_table must be 2-D with contiguous rows")
        if (left_visible is None) != (right_visible is None):
            raise warmreg.LaunchError(self.name, "pass both left_visible and right_visible, or neither")
        if min(window_size, index_width, block_size) < 1:
            raise warmreg.LaunchError(self.name, "window_size, index_width and block_size must be >= 1")
        has_image = left_visible is not None
        key = self.dispatch(
            window_size=window_size, index_width=index_width, block_size=block_size, has_image=has_image
        )
        out_rows, out_lens = out_parts(self.name, out, 2)
        device = positions.device
        indices = warmreg.output(self.name, "out[0]", out_rows, (num_tokens, index_width), torch.int32, device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (num_tokens,), torch.int32, device)
        kwargs = dict(
            positions_ptr=positions, token_to_req_ptr=token_to_req, is_valid_token_ptr=is_valid_token,
            block_table_ptr=block_table, replay_start_ptr=replay_start, left_visible_ptr=left_visible,
            right_visible_ptr=right_visible, swa_indices_ptr=indices, swa_lens_ptr=lens, swa_indices_stride=indices.stride(0),
            block_table_stride=block_table.stride(0), token_offset=token_offset, window_size=window_size,
            index_width=index_width, block_size=block_size, HAS_IMAGE=key.has_image, TRITON_BLOCK_SIZE=key.triton_block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, (indices, lens))


def decode_swa_indices_reference(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    replay_start: torch.Tensor,
    *,
    num_tokens: int,
    window_size: int,
    index_width: int,
    block_size: int,
    token_offset: int = 0,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`DecodeSwaIndices`: ``(swa_indices [n, index_width], swa_lens [n])``."""
    sl = slice(token_offset, token_offset + num_tokens)
    req = token_to_req[sl].long()
    pos = positions[sl].long()
    left_add = (left_visible[sl].long() - (window_size - 1)).clamp(min=0) if left_visible is not None else 0
    right = right_visible[sl].long() if right_visible is not None else 0
    start = torch.maximum((pos - (window_size - 1) - left_add).clamp(min=0), replay_start.long()[req])
    length = torch.where(is_valid_token[sl], pos + right + 1 - start, 0)
    c = torch.arange(index_width)
    live = c[None, :] < length[:, None]
    p = start[:, None] + c[None, :]
    pages = block_table.long()[req[:, None], torch.where(live, p // block_size, 0)]
    out = torch.where(live, pages * block_size + p % block_size, -1)
    return out.to(torch.int32), length.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register decode SWA indices: CUDA with either DeepSeek-V4 sparse backend."""
    backend = attention_backend(config)
    registry.add(DecodeSwaIndices(), when=warmreg.is_cuda if backend in SPARSE_BACKENDS else False)
