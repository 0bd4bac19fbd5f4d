"""ROCm DeepSeek-V4 in-tree sparse prefill: the combine of top-k and SWA indices (vLLM 0.34
``models/deepseek_v4/amd/rocm.py``: ``combine_topk_swa_indices``, ROCm's own copy, ``_combine_topk_swa_indices_kernel``).

As :mod:`.combine_indices` (CUDA's FlashMLA copy), rows index the bf16 gather workspace (``M`` rows a request: ``N``
compressed rows, then the gathered SWA tokens). ROCm's copy differs in its math, so it is its own op. For token ``t``
of request ``b`` (``pos = seq - qlen + i``, ``gather_start = seq - gather_lens[b]``, window ``W``, ``S = W + image``)::

    topk_len  = min((pos + 1) // R, TOP_K)
    left_add  = max(left_visible[t] - (W - 1), 0);   right = right_visible[t]          (image spans; else 0)
    swa_start = max(pos - (W - 1) - left_add, 0, gather_start);  swa_len = max(min(pos + right + 1, seq) - swa_start, 0)
    out[t, j]            = 0 <= l < N ? l + M*b : -1,  l = topk[t, j < TOPK_WIDTH ? j : 0]      for j < topk_len
    out[t, topk_len + s] = M*b + N + (swa_start - gather_start) + s                         for s < min(swa_len, S)
    out[t, rest] = -1;   lens[t] = topk_len + swa_len                    (row width round_up(TOP_K + S, 128))

(CUDA's keeps top-k entries past ``N``, does not clamp the window at ``seq`` nor the stores at ``S``.) vLLM fills the
rows with -1 first and stores the live entries; this kernel writes every column of a row, in tiles of
``min(next_pow2(width), 1024)``. Grid ``(requests, 128)``: the workers of a request stride over its tokens, as in vLLM.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_prefill`` of every layer on every ROCm prefill chunk unless
prefill takes aiter's sparse MLA (:func:`._rocm_attention.aiter_sparse_mla_prefill`): SWA-only layers with
``TOP_K = 0`` (vLLM passes the indexer buffer's rows anyway; they are never read), C4 layers with ``index_topk``,
C128 layers with the step's C128 width (``prefill_local``).

Key: ``TOP_K``, ``R``, ``W``, ``S``, the top-k row width (0 when ``TOP_K`` is 0), the image flag, the row width and the
column tile (constexprs, as in vLLM) and the warps. ``M``, ``N`` and the strides are runtime ints (``do_not_specialize``; vLLM
specializes ``M`` and ``N``) and no input pointer is specialized on alignment (chunk slices); outputs are fresh or
checked aligned buffers. Every buffer is far below 2 GB.
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
from ._rocm_attention import aiter_sparse_mla_prefill
from ._serving import max_model_len
from .backends import c128_widths
from .combine_indices import _check_visibility
from .model import DSV4

__all__ = [
    "RocmCombineTopkSwaIndices",
    "RocmCombineTopkSwaIndicesKey",
    "register",
    "rocm_combine_topk_swa_indices_reference",
]

_ALIGNMENT = 128  # vLLM's _SPARSE_PREFILL_TOPK_ALIGNMENT
_WORKERS = 128  # vLLM's num_workers (grid only)
_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["out_stride", "topk_stride", "M", "N"],
    do_not_specialize_on_alignment=[
        "topk_ptr", "query_start_loc_ptr", "seq_lens_ptr", "gather_lens_ptr", "left_visible_ptr", "right_visible_ptr",
    ],
)  # fmt: skip
def _rocm_combine_kernel(
    out_ptr,
    out_stride,
    lens_ptr,
    topk_ptr,
    topk_stride,
    query_start_loc_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    left_visible_ptr,
    right_visible_ptr,
    M,
    N,
    TOP_K: tl.constexpr,  # compressed columns (index_topk, a C128 width, or 0 for SWA-only)
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio: causal compressed count
    WINDOW_SIZE: tl.constexpr,  # the sliding window
    SWA_WIDTH: tl.constexpr,  # window + image width: the most SWA columns a row stores
    TOPK_WIDTH: tl.constexpr,  # columns of the top-k rows (a column past it reads column 0, as vLLM's)
    HAS_IMAGE: tl.constexpr,  # read the visibility counts
    WIDTH: tl.constexpr,  # round_up(TOP_K + SWA_WIDTH, 128)
    TILE: tl.constexpr,  # min(next_pow2(WIDTH), 1024): the column tile
):
    b = tl.program_id(0)
    base_q = tl.load(query_start_loc_ptr)
    q0 = tl.load(query_start_loc_ptr + b) - base_q
    qlen = tl.load(query_start_loc_ptr + b + 1) - base_q - q0
    seq = tl.load(seq_lens_ptr + b)
    gather_start = seq - tl.load(gather_lens_ptr + b)
    base = b.to(tl.int64) * M
    i = tl.program_id(1)
    while i < qlen:
        t = (q0 + i).to(tl.int64)
        pos = seq - qlen + i
        topk_len = tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K)
        if HAS_IMAGE:
            left_add = tl.maximum(tl.load(left_visible_ptr + t) - (WINDOW_SIZE - 1), 0)
            right = tl.load(right_visible_ptr + t)
        else:
            left_add = 0
            right = 0
        swa_start = tl.maximum(tl.maximum(pos - (WINDOW_SIZE - 1) - left_add, 0), gather_start)
        swa_len = tl.maximum(tl.minimum(pos + right + 1, seq) - swa_start, 0)
        for c0 in tl.range(0, WIDTH, TILE):
            c = c0 + tl.arange(0, TILE)
            vals = tl.full((TILE,), -1, tl.int64)
            if TOP_K > 0:
                safe = tl.where(c < TOPK_WIDTH, c, 0)
                local = tl.load(topk_ptr + t * topk_stride + safe, mask=c < topk_len, other=-1)
                vals = tl.where((local >= 0) & (local < N), local + base, -1)
            s = c - topk_len
            live = (s >= 0) & (s < swa_len) & (s < SWA_WIDTH)
            vals = tl.where(live, base + N + s + (swa_start - gather_start), vals)
            tl.store(out_ptr + t * out_stride + c, vals.to(tl.int32), mask=c < WIDTH)
        tl.store(lens_ptr + t, (topk_len + swa_len).to(tl.int32))
        i += tl.num_programs(1)


@attrs.frozen(kw_only=True)
class RocmCombineTopkSwaIndicesKey(warmreg.CompileKey):
    """What changes the binary of ROCm's prefill combine: every size is a constexpr."""

    top_k: int
    compress_ratio: int
    window_size: int
    swa_width: int
    topk_width: int  # 0 when top_k is 0 (the rows are never read)
    has_image: bool
    width: int
    tile: int
    num_warps: int


class RocmCombineTopkSwaIndices(warmreg.TritonKernel[RocmCombineTopkSwaIndicesKey]):
    """ROCm's in-tree sparse-prefill indices into the gather workspace (see the module docstring).

    :param window_size: the sliding window (``sliding_window``).
    """

    name = "deepseek_v4.rocm_combine_topk_swa_indices"
    key_type = RocmCombineTopkSwaIndicesKey
    jit = _rocm_combine_kernel

    def __init__(self, *, window_size: int) -> None:
        self.window_size = window_size

    def dispatch(
        self,
        *,
        topk_indices: torch.Tensor,
        topk: int,
        compress_ratio: int,
        max_image_tokens: int,
        left_visible: torch.Tensor | None = None,
    ) -> RocmCombineTopkSwaIndicesKey:
        swa_width = self.window_size + max_image_tokens
        width = triton.cdiv(topk + swa_width, _ALIGNMENT) * _ALIGNMENT
        return RocmCombineTopkSwaIndicesKey(
            top_k=topk, compress_ratio=compress_ratio, window_size=self.window_size, swa_width=swa_width,
            topk_width=topk_indices.shape[1] if topk else 0, has_image=left_visible is not None, width=width,
            tile=min(warmreg.next_pow2(width), 1024), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        widths = tuple(c128_widths(max_model_len(config))) if model.has_c128 else ()
        return {
            "compress_ratio": sorted(set(model.ratios)),
            "topk": sorted({0, model.index_topk, *widths}),
            "topk_indices": [warmreg.meta((1, k), torch.int32) for k in sorted({model.index_topk, *widths})],
            "max_image_tokens": [model.vision_max_n_token],
            # a vision model's batches with image spans read the visibility counts
            "left_visible": [None, warmreg.meta((1,), torch.int32)] if model.vision_max_n_token else [None],
            "c4_top_k": [model.index_topk],  # the two below are read by when() only
            "c128_widths": [widths],
        }

    def when(
        self,
        *,
        compress_ratio: int,
        topk: int,
        topk_indices: torch.Tensor,
        c4_top_k: int,
        c128_widths: tuple[int, ...],
        **_: Any,
    ) -> bool:
        """SWA-only rows are the indexer buffer's (``index_topk`` wide), C4 ``index_topk``, C128 a C128 width."""
        width = topk_indices.shape[1]
        if compress_ratio == 4:
            return topk == width == c4_top_k
        if compress_ratio == 128:
            return topk == width and topk in c128_widths
        return topk == 0 and width == c4_top_k

    def warmup_inputs(self, key: RocmCombineTopkSwaIndicesKey) -> Mapping[str, Any]:
        vector = warmreg.meta((1,), torch.int32)
        visible = vector if key.has_image else None
        return {
            "topk_indices": warmreg.meta((1, key.topk_width or 1), torch.int32), "query_start_loc": warmreg.meta((2,), torch.int32),
            "seq_lens": vector, "gather_lens": vector, "compress_ratio": key.compress_ratio, "topk": key.top_k, "M": 1,
            "N": 0, "max_image_tokens": key.swa_width - key.window_size, "left_visible": visible, "right_visible": visible,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        gather_lens: torch.Tensor,
        *,
        compress_ratio: int,
        topk: int,
        M: int,
        N: int,
        max_image_tokens: int = 0,
        left_visible: torch.Tensor | None = None,
        right_visible: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RocmCombineTopkSwaIndicesKey]:
        """``(indices [T, round_up(topk + window + max_image_tokens, 128)], lens [T])`` int32 (fresh, or ``out``),
        ``T = topk_indices.shape[0]`` (vLLM's arguments, the window from the op).

        :param topk_indices: int32 ``[T, K]`` rows of the chunk's tokens, contiguous (vLLM makes them so); read only
            where ``topk > 0``.
        :param query_start_loc: int32 ``[n + 1]`` the chunk's slice (not rebased); ``seq_lens``, ``gather_lens`` int32
            ``[n]``: the grid has a row a request of ``seq_lens``.
        :param compress_ratio: the layer's ratio (1 for SWA-only); ``topk`` its top-k (0 for SWA-only).
        :param M: workspace rows a request; ``N``: compressed rows before the SWA rows.
        :param max_image_tokens: the SWA rows' widening for image spans (``vision_max_n_token``; 0 for text).
        :param left_visible: int32 ``[>= T]`` visibility counts, with ``right_visible``: both for a batch with image
            spans (needs ``max_image_tokens``), or neither.
        :param out: the two outputs to write instead of fresh ones, exactly as they would be allocated.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("gather_lens", gather_lens)):
            if t.dtype != torch.int32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(self.name, f"{name} must be a contiguous 1-D int32 tensor")
        n = seq_lens.shape[0]
        if query_start_loc.shape[0] < n + 1 or gather_lens.shape[0] < n:
            raise warmreg.LaunchError(self.name, "query_start_loc needs n + 1 entries and gather_lens n for n seq_lens")
        if topk_indices.dtype != torch.int32 or topk_indices.ndim != 2 or not topk_indices.is_contiguous():
            raise warmreg.LaunchError(self.name, "topk_indices must be a contiguous 2-D int32 tensor")
        if compress_ratio < 1 or topk < 0 or max_image_tokens < 0:
            raise warmreg.LaunchError(self.name, "compress_ratio must be >= 1, topk and max_image_tokens >= 0")
        tokens = topk_indices.shape[0]
        has_image = _check_visibility(self.name, left_visible, right_visible, tokens, max_image_tokens)
        key = self.dispatch(topk_indices=topk_indices, topk=topk, compress_ratio=compress_ratio,
                            max_image_tokens=max_image_tokens, left_visible=left_visible if has_image else None)  # fmt: skip
        out_rows, out_lens = out_parts(self.name, out, 2)
        device = topk_indices.device
        indices = warmreg.output(self.name, "out[0]", out_rows, (tokens, key.width), torch.int32, device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (tokens,), torch.int32, device)
        kwargs = dict(
            out_ptr=indices, out_stride=indices.stride(0), lens_ptr=lens, topk_ptr=topk_indices if topk else None,
            topk_stride=topk_indices.stride(0) if topk else 0, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            gather_lens_ptr=gather_lens, left_visible_ptr=left_visible if has_image else None,
            right_visible_ptr=right_visible if has_image else None, M=M, N=N, TOP_K=key.top_k,
            COMPRESS_RATIO=key.compress_ratio, WINDOW_SIZE=key.window_size, SWA_WIDTH=key.swa_width,
            TOPK_WIDTH=key.topk_width, HAS_IMAGE=key.has_image, WIDTH=key.width, TILE=key.tile,
        )  # fmt: skip
        grid = (n, _WORKERS) if n and tokens else None
        return warmreg.LaunchSpec(key, grid, kwargs, (indices, lens))


def rocm_combine_topk_swa_indices_reference(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    *,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    max_image_tokens: int = 0,
    left_visible: torch.Tensor | None = None,
    right_visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmCombineTopkSwaIndices` (a loop over tokens)."""
    swa_width = window_size + max_image_tokens
    width = triton.cdiv(topk + swa_width, _ALIGNMENT) * _ALIGNMENT
    tokens, topk_width = topk_indices.shape
    out = torch.full((tokens, width), -1, dtype=torch.int64)
    lens = torch.zeros(tokens, dtype=torch.int64)
    qsl = query_start_loc.long() - int(query_start_loc[0])
    for b in range(seq_lens.shape[0]):
        q0, qlen, seq = int(qsl[b]), int(qsl[b + 1] - qsl[b]), int(seq_lens[b])
        gather_start = seq - int(gather_lens[b])
        for i in range(qlen):
            pos, t = seq - qlen + i, q0 + i
            topk_len = min((pos + 1) // compress_ratio, topk)
            left_add = max(int(left_visible[t]) - (window_size - 1), 0) if left_visible is not None else 0
            right = int(right_visible[t]) if right_visible is not None else 0
            swa_start = max(pos - (window_size - 1) - left_add, 0, gather_start)
            swa_len = max(min(pos + right + 1, seq) - swa_start, 0)
            for j in range(topk_len):
                local = int(topk_indices[t, j if j < topk_width else 0])
                out[t, j] = local + M * b if 0 <= local < N else -1
            for s in range(min(swa_len, swa_width)):
                out[t, topk_len + s] = M * b + N + (swa_start - gather_start) + s
            lens[t] = topk_len + swa_len
    return out.to(torch.int32), lens.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the combine on ROCm unless prefill takes aiter's sparse MLA (see the module docstring)."""
    on = not aiter_sparse_mla_prefill(config, model, platform)
    registry.add(RocmCombineTopkSwaIndices(window_size=model.sliding_window), when=warmreg.is_rocm if on else False)
