"""DeepSeek-V4 FlashMLA sparse prefill: the combine of top-k and SWA indices (vLLM 0.33
``models/common/ops/cache_utils.py``: ``combine_topk_swa_indices``).

For one chunk of prefill requests, the dequant-gather workspace holds ``M`` rows per request ``b``:
its compressed entries in rows ``[0, N)`` and its last ``gather_lens[b]`` tokens from row ``N``. For
query token ``t`` of request ``b`` (``pos = seq - qlen + i``, ``gather_start = seq - gather_lens[b]``)::

    topk_len  = min((pos + 1) // COMPRESS_RATIO, TOP_K)
    left_add  = max(left_visible[t] - (W - 1), 0);   right = right_visible[t]       (image spans; else 0)
    swa_start = max(pos - (W - 1) - left_add, gather_start);   swa_len = pos + right - swa_start + 1
    out[t, j]            = topk[t, j] >= 0 ? topk[t, j] + M*b : -1                  for j < topk_len
    out[t, topk_len + s] = M*b + N + (swa_start - gather_start) + s                 for s < swa_len
    out[t, rest] = -1;   lens[t] = topk_len + swa_len         (row width round_up(TOP_K + W + image_width, 128))

A vision model widens every row by ``image_width`` (``vision_max_n_token``); the visibility counts of a
batch with image spans (``_compute_image_visibility_kernel``'s, chunk-local token index) open the window
bidirectionally. An image span is prefilled whole, in one chunk, so ``pos - left >= prefix`` and the window
never starts before the gathered rows.

Where this differs from vLLM 0.33's DeepSeek-V4 kernel, on inputs DeepSeek-V4 never produces, it follows
vLLM's own DeepSeek-V4.1 copy (``models/deepseek_v41/common/ops/cache_utils.py``): a -1 inside ``topk_len``
stays -1 (V4: ``M*b - 1``, a row of the previous request), and with SWA bounded replay (V4.1 only: a
DeepSeek-V4 ``replay_start`` is always 0, so ``gather_start <= max(pos - (W - 1), 0)``) the window starts at
the first gathered row (V4: rows before it, which the dequant-gather never wrote). Equal outputs everywhere
else (``tests/engines/test_vllm_kernels.py``, and the H200 comparison on identical inputs).

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
from ._serving import max_model_len
from .backends import FLASHMLA_SPARSE, attention_backend, c128_widths
from .model import DSV4

__all__ = ["CombineTopkSwaIndices", "CombineTopkSwaIndicesKey", "combine_topk_swa_indices_reference", "register"]


@triton.jit(
    do_not_specialize=["topk_stride", "out_stride", "M", "N"],
    do_not_specialize_on_alignment=[
        "topk_ptr", "query_start_loc_ptr", "seq_lens_ptr", "gather_lens_ptr", "left_visible_ptr",
        "right_visible_ptr", "out_ptr", "lens_ptr",
    ],
)  # fmt: skip
def _combine_topk_swa_indices_kernel(
    topk_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    left_visible_ptr,
    right_visible_ptr,
    out_ptr,
    lens_ptr,
    topk_stride,
    out_stride,
    M,
    N,
    TOP_K: tl.constexpr,  # compressed top-k columns (index_topk, the C128 width W, or 0 for SWA-only)
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio (1 for SWA-only): causal compressed count
    WINDOW_SIZE: tl.constexpr,  # the sliding window: a model constant
    HAS_IMAGE: tl.constexpr,  # the batch has image spans: read the visibility counts (else None)
    WIDTH: tl.constexpr,  # row width round_up(TOP_K + WINDOW_SIZE + image_width, 128)
    TILE: tl.constexpr,  # columns one loop step writes: min(next_pow2(WIDTH), _MAX_TILE)
):
    b = tl.program_id(0)
    base_q = tl.load(query_start_loc_ptr)
    q0 = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - q0
    seq = tl.load(seq_lens_ptr + b)
    gather_start = seq - tl.load(gather_lens_ptr + b)
    base = b.to(tl.int64) * M
    c = tl.arange(0, TILE)
    i = tl.program_id(1)
    while i < qlen:  # workers stride over the request's tokens
        t = (q0 - base_q + i).to(tl.int64)
        pos = seq - qlen + i
        topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
        if HAS_IMAGE:
            left_add = tl.maximum(tl.load(left_visible_ptr + t) - (WINDOW_SIZE - 1), 0)
            right = tl.load(right_visible_ptr + t)
        else:
            left_add = 0
            right = 0
        swa_start = tl.maximum(pos - (WINDOW_SIZE - 1) - left_add, gather_start)
        swa_len = pos + right - swa_start + 1
        for c0 in range(0, WIDTH, TILE):
            col = c0 + c
            vals = tl.full((TILE,), -1, tl.int64)
            if TOP_K > 0:
                local = tl.load(topk_ptr + t * topk_stride + col, mask=col < topk_len, other=-1)
                vals = tl.where(local >= 0, local + base, -1)
            s = col - topk_len
            vals = tl.where((s >= 0) & (s < swa_len), base + N + (swa_start - gather_start) + s, vals)
            tl.store(out_ptr + t * out_stride + col, vals.to(tl.int32), mask=col < WIDTH)
        tl.store(lens_ptr + t, (topk_len + swa_len).to(tl.int32))
        i += tl.num_programs(1)


@attrs.frozen(kw_only=True)
class CombineTopkSwaIndicesKey(warmreg.CompileKey):
    """What changes the binary of the prefill combine: every size is a constexpr."""

    top_k: int
    compress_ratio: int
    window_size: int
    image_width: int  # row widening (a vision model's vision_max_n_token)
    has_image: bool  # visibility counts are read (a batch with image spans)
    width: int
    tile: int
    num_warps: int


#: The widest column tile: a row of a C128 layer at DeepSeek-V4's 1M context is 8,320 columns, which as one tile
#: (16,384 int64 lanes, 128 a thread at 4 warps) took 0.7-0.9 s to compile, the slowest key of the Flash example
#: on the H100 host (Triton 3.8.0, 16 compiles at once); tiles of 1,024 lanes loop over the row instead.
_MAX_TILE = 1024


def _combine_width(top_k: int, window_size: int, image_width: int) -> int:
    return triton.cdiv(top_k + window_size + image_width, 128) * 128


class CombineTopkSwaIndices(warmreg.TritonKernel[CombineTopkSwaIndicesKey]):
    """FlashMLA sparse-prefill indices into the dequant-gather workspace (see the module docstring).

    :param window_size: the sliding window (``sliding_window``).
    :param workers: programs per request on grid axis 1 (grid only, not part of the key).
    """

    name = "deepseek_v4.combine_topk_swa_indices"
    key_type = CombineTopkSwaIndicesKey
    jit = _combine_topk_swa_indices_kernel

    def __init__(self, *, window_size: int, workers: int = 256) -> None:
        self.window_size = window_size
        self.workers = workers

    def dispatch(
        self, *, top_k: int, compress_ratio: int, image_width: int, has_image: bool = False
    ) -> CombineTopkSwaIndicesKey:
        width = _combine_width(top_k, self.window_size, image_width)
        return CombineTopkSwaIndicesKey(
            top_k=top_k,
            compress_ratio=compress_ratio,
            window_size=self.window_size,
            image_width=image_width,
            has_image=has_image,
            width=width,
            tile=min(warmreg.next_pow2(width), _MAX_TILE),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        widths = c128_widths(max_model_len(config)) if model.has_c128 else []
        return {
            "compress_ratio": sorted(set(model.ratios)),
            "top_k": sorted({0, model.index_topk, *widths}),
            # a vision model widens every row; its batches with image spans read the visibility counts
            "image_width": [model.vision_max_n_token],
            "has_image": [False, True] if model.vision_max_n_token else [False],
            "c4_top_k": [model.index_topk],  # the two below are read by when() only
            "c128_widths": [tuple(widths)],
        }

    def when(self, *, compress_ratio: int, top_k: int, c4_top_k: int, c128_widths: tuple[int, ...], **_: Any) -> bool:
        """The layer type fixes the top-k: 0 (SWA-only), ``index_topk`` (C4) or a C128 width."""
        if compress_ratio == 4:
            return top_k == c4_top_k
        if compress_ratio == 128:
            return top_k in c128_widths
        return top_k == 0

    def warmup_inputs(self, key: CombineTopkSwaIndicesKey) -> Mapping[str, Any]:
        visible = warmreg.meta((1,), torch.int32) if key.has_image else None
        return {
            "topk_indices": warmreg.meta((1, key.top_k), torch.int32) if key.top_k else None,
            "query_start_loc": warmreg.meta((2,), torch.int32),
            "seq_lens": warmreg.meta((1,), torch.int32),
            "gather_lens": warmreg.meta((1,), torch.int32),
            "num_tokens": 1,
            "compress_ratio": key.compress_ratio,
            "M": 1,
            "N": 0,
            "image_width": key.image_width,
            "left_visible": visible,
            "right_visible": visible,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor | None,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        gather_lens: torch.Tensor,
        *,
        num_tokens: int,
        compress_ratio: int,
        M: int,
        N: int,
        image_width: int = 0,
        left_visible: torch.Tensor | None = None,
        right_visible: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[CombineTopkSwaIndicesKey]:
        """Indices of a prefill chunk into the gathered workspace; returns
        ``(indices [num_tokens, round_up(top_k + window + image_width, 128)], lens [num_tokens])`` int32 (fresh,
        or ``out``).

        :param topk_indices: int32 ``[>= num_tokens, top_k]`` local compressed indices of the chunk's tokens
            (C4: the indexer's top-k; C128: the C128A ``prefill_local``), or ``None`` for an SWA-only layer.
        :param query_start_loc: int32 ``[n + 1]`` the chunk's slice (not rebased: the kernel subtracts element 0).
        :param seq_lens: int32 ``[n]``; ``gather_lens`` int32 ``[n]`` (from :class:`~.swa_prefill_metadata.SparseSWAPrefillMetadata`).
        :param num_tokens: the chunk's tokens, ``query_start_loc[n] - query_start_loc[0]`` (known on the host).
        :param compress_ratio: the layer's ratio (1 for SWA-only).
        :param M: workspace rows per request; ``N``: rows holding compressed entries before the SWA rows.
        :param image_width: extra row columns for image spans (a vision model's ``vision_max_n_token``; 0 for text).
        :param left_visible: int32 ``[>= num_tokens]`` in-image visibility to the left of each of the chunk's tokens
            (chunk-local index), with ``right_visible``: both for a batch with image spans (needs ``image_width``),
            or neither.
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[num_tokens, width]`` (the
            width above) and ``[num_tokens]``, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("gather_lens", gather_lens)):
            if t.dtype != torch.int32 or t.ndim != 1:
                raise warmreg.LaunchError(self.name, f"{name} must be 1-D int32")
        n = query_start_loc.shape[0] - 1
        if n < 0 or seq_lens.shape[0] < n or gather_lens.shape[0] < n:
            raise warmreg.LaunchError(self.name, "query_start_loc needs n + 1 entries, seq_lens and gather_lens n")
        top_k = 0
        if topk_indices is not None:
            if topk_indices.dtype != torch.int32 or topk_indices.ndim != 2 or topk_indices.stride(1) != 1:
                raise warmreg.LaunchError(self.name, "topk_indices must be 2-D int32 with contiguous rows")
            if topk_indices.shape[0] < num_tokens:
                raise warmreg.LaunchError(
                    self.name, f"topk_indices has {topk_indices.shape[0]} rows for {num_tokens} tokens"
                )
            top_k = topk_indices.shape[1]
        if compress_ratio < 1 or num_tokens < 0 or image_width < 0:
            raise warmreg.LaunchError(self.name, "compress_ratio must be >= 1, num_tokens and image_width >= 0")
        has_image = _check_visibility(self.name, left_visible, right_visible, num_tokens, image_width)
        key = self.dispatch(top_k=top_k, compress_ratio=compress_ratio, image_width=image_width, has_image=has_image)
        device = query_start_loc.device
        out_rows, out_lens = out_parts(self.name, out, 2)
        indices = warmreg.output(self.name, "out[0]", out_rows, (num_tokens, key.width), torch.int32, device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (num_tokens,), torch.int32, device)
        topk = topk_indices if top_k else None  # constexpr None for SWA-only layers (TOP_K == 0)
        kwargs = dict(
            topk_ptr=topk, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens, gather_lens_ptr=gather_lens,
            left_visible_ptr=left_visible if has_image else None, right_visible_ptr=right_visible if has_image else None,
            out_ptr=indices, lens_ptr=lens, topk_stride=topk.stride(0) if topk is not None else 0,
            out_stride=indices.stride(0), M=M, N=N, TOP_K=key.top_k, COMPRESS_RATIO=key.compress_ratio,
            WINDOW_SIZE=key.window_size, HAS_IMAGE=key.has_image, WIDTH=key.width, TILE=key.tile,
        )  # fmt: skip
        grid = (n, self.workers) if n and num_tokens else None
        return warmreg.LaunchSpec(key, grid, kwargs, (indices, lens))


def _check_visibility(
    name: str, left: torch.Tensor | None, right: torch.Tensor | None, num_tokens: int, image_width: int
) -> bool:
    """Whether the launch reads visibility counts: both given, int32 ``[>= num_tokens]``, with ``image_width``."""
    if left is None and right is None:
        return False
    if left is None or right is None or image_width < 1:
        raise warmreg.LaunchError(name, "pass left_visible and right_visible together, with image_width >= 1")
    for t in (left, right):
        if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < num_tokens:
            raise warmreg.LaunchError(name, f"left_visible and right_visible must be int32 [>= {num_tokens}]")
    return True


def combine_topk_swa_indices_reference(
    topk_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    *,
    num_tokens: int,
    compress_ratio: int,
    M: int,
    N: int,
    window_size: int,
    image_width: int = 0,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`CombineTopkSwaIndices` (a loop over requests)."""
    top_k = 0 if topk_indices is None else topk_indices.shape[1]
    width = _combine_width(top_k, window_size, image_width)
    out = torch.full((num_tokens, width), -1, dtype=torch.int64)
    lens = torch.zeros(num_tokens, dtype=torch.int64)
    qsl = query_start_loc.long() - int(query_start_loc[0])
    c = torch.arange(width)
    for b in range(query_start_loc.shape[0] - 1):
        q0, qlen, seq = int(qsl[b]), int(qsl[b + 1] - qsl[b]), int(seq_lens[b])
        gather_start = seq - int(gather_lens[b])
        for i in range(qlen):
            pos, t = seq - qlen + i, q0 + i
            topk_len = min((pos + 1) // compress_ratio, top_k)
            left_add = max(int(left_visible[t]) - (window_size - 1), 0) if left_visible is not None else 0
            right = int(right_visible[t]) if right_visible is not None else 0
            swa_start = max(pos - (window_size - 1) - left_add, gather_start)
            swa_len = pos + right - swa_start + 1
            if topk_len:
                local = topk_indices[t, :topk_len].long()  # type: ignore[index]
                out[t, :topk_len] = torch.where(local >= 0, local + M * b, -1)
            s = c - topk_len
            live = (s >= 0) & (s < swa_len)
            out[t, live] = M * b + N + (swa_start - gather_start) + s[live]
            lens[t] = topk_len + swa_len
    return out.to(torch.int32), lens.to(torch.int32)


# -- registration ----------------------------------------------------------------------------------
def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the prefill combine: CUDA with the FlashMLA sparse backend."""
    registry.add(
        CombineTopkSwaIndices(window_size=model.sliding_window),
        when=warmreg.is_cuda if attention_backend(config) == FLASHMLA_SPARSE else False,
    )
