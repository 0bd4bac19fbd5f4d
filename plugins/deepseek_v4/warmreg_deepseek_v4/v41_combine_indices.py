"""DeepSeek-V4.1's FlashMLA sparse-prefill combine of top-k and SWA indices (vLLM 0.34
``models/deepseek_v41/common/ops/cache_utils.py``: ``combine_topk_swa_indices`` and its
``CombineTopkSwaIndicesKernel.kernel``; launched by ``nvidia/flashmla.py: DeepseekV4FlashMLAAttention._forward_prefill``
and ``nvidia/flash_mla_mega_attn.py: _forward_prefill_mega`` once per prefill chunk, on every layer).

For one chunk of prefill requests the dequant-gather workspace holds ``M`` rows per request ``b``: its compressed
entries in rows ``[0, N)`` and its last ``gather_lens[b]`` tokens from row ``N``. Query token ``t`` of request ``b``
(chunk-local index; ``pos = seq - qlen + i``, ``gather_start = seq - gather_lens[b]``, ``R`` the layer's ratio)::

    topk_len  = R > 0 ? max(min((pos + 1) // R, TOP_K), 0) : 0
    swa_start = max(pos - (W - 1), 0, gather_start);   swa_len = max(pos - swa_start + 1, 0)
    out[t, j]            = 0 <= topk[t, j] < N ? topk[t, j] + M*b : -1          for j < topk_len
    out[t, topk_len + s] = M*b + N + (swa_start - gather_start) + s             for s < swa_len
    out[t, rest] = -1;   lens[t] = topk_len + swa_len             (row width round_up(TOP_K + W, 128))

Unlike DeepSeek-V4's combine (:mod:`.combine_indices`): an out-of-pool candidate (``>= N``) becomes -1 too, both
lengths are clamped at 0 (a warmup batch's ``pos`` may be negative), an SWA-only layer passes ``R = 0`` with
``TOP_K = 0`` (no division), and no image spans widen the rows. vLLM pre-fills the whole output with -1 and writes
the top-k tile (``next_pow2`` of the top-k buffer's width) and the window tile separately; this kernel writes each
row whole in one tile (``next_pow2`` of the row width), which gives the same bytes.

Key: ``TOP_K``, ``R``, ``W``, the row width and its tile (constexprs, as in vLLM). Strides, ``M`` and ``N`` are
``do_not_specialize`` as in vLLM, and no pointer is specialized on alignment (rows sit at runtime strides, and the
chunk slices ``seq_lens[a:b]`` are offset views): one binary a layer type. Grid ``(requests, 256)``, four warps.
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
from .model import DSV4

__all__ = ["V41CombineTopkSwa", "V41CombineTopkSwaKey", "register", "v41_combine_topk_swa_reference"]

_WORKERS = 256  # programs per request on grid axis 1 (vLLM's _COMBINE_TOPK_SWA_NUM_WORKERS)
_ALIGNMENT = 128  # FlashMLA's sparse prefill takes top-k widths in multiples of 128


@triton.jit(
    do_not_specialize=["topk_stride", "out_stride", "M", "N"],
    do_not_specialize_on_alignment=["topk_ptr", "query_start_loc_ptr", "seq_lens_ptr", "gather_lens_ptr", "out_ptr",
                                    "lens_ptr"],
)  # fmt: skip
def _v41_combine_topk_swa_kernel(
    topk_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    out_ptr,
    lens_ptr,
    topk_stride,
    out_stride,
    M,
    N,
    TOP_K: tl.constexpr,  # top-k columns: index_topk, or 0 for an SWA-only layer
    COMPRESS_RATIO: tl.constexpr,  # the layer's ratio: 0 (SWA-only), 1 or 2
    WINDOW_SIZE: tl.constexpr,  # the sliding window: a model constant
    WIDTH: tl.constexpr,  # row width round_up(TOP_K + WINDOW_SIZE, 128)
    BLOCK: tl.constexpr,  # next_pow2(WIDTH): one tile covers a row
):
    b = tl.program_id(0)
    base_q = tl.load(query_start_loc_ptr)
    q0 = tl.load(query_start_loc_ptr + b) - base_q
    qlen = tl.load(query_start_loc_ptr + b + 1) - base_q - q0
    seq = tl.load(seq_lens_ptr + b)
    gather_start = seq - tl.load(gather_lens_ptr + b)
    base = b.to(tl.int64) * M
    c = tl.arange(0, BLOCK)
    i = tl.program_id(1)
    while i < qlen:  # workers stride over the request's tokens
        t = (q0 + i).to(tl.int64)
        pos = seq - qlen + i
        if COMPRESS_RATIO > 0:
            topk_len = tl.maximum(tl.minimum((pos + 1) // COMPRESS_RATIO, TOP_K), 0)
        else:
            topk_len = 0
        swa_start = tl.maximum(tl.maximum(pos - (WINDOW_SIZE - 1), 0), gather_start)
        swa_len = tl.maximum(pos - swa_start + 1, 0)
        vals = tl.full((BLOCK,), -1, tl.int64)
        if TOP_K > 0:
            local = tl.load(topk_ptr + t * topk_stride + c, mask=c < topk_len, other=-1)
            vals = tl.where((local >= 0) & (local < N), local + base, -1)
        s = c - topk_len
        vals = tl.where((s >= 0) & (s < swa_len), base + N + (swa_start - gather_start) + s, vals)
        tl.store(out_ptr + t * out_stride + c, vals.to(tl.int32), mask=c < WIDTH)
        tl.store(lens_ptr + t, (topk_len + swa_len).to(tl.int32))
        i += tl.num_programs(1)


@attrs.frozen(kw_only=True)
class V41CombineTopkSwaKey(warmreg.CompileKey):
    """What changes the binary of V4.1's prefill combine: every size is a constexpr."""

    top_k: int
    compress_ratio: int
    window_size: int
    width: int
    block: int
    num_warps: int


def combine_width(top_k: int, window_size: int) -> int:
    """The combined row width: ``round_up(top_k + window_size, 128)``."""
    return triton.cdiv(top_k + window_size, _ALIGNMENT) * _ALIGNMENT


class V41CombineTopkSwa(warmreg.TritonKernel[V41CombineTopkSwaKey]):
    """V4.1's FlashMLA sparse-prefill indices into the dequant-gather workspace (see the module docstring).

    :param window_size: the sliding window (``sliding_window``).
    :param index_topk: the top-k buffer's width (domains only).
    :param ratios: the compress ratios of the model's layers (domains only).
    """

    name = "deepseek_v4.v41_combine_topk_swa_indices"
    key_type = V41CombineTopkSwaKey
    jit = _v41_combine_topk_swa_kernel

    def __init__(self, *, window_size: int, index_topk: int = 512, ratios: Iterable[int] = (0,)) -> None:
        self.window_size, self.index_topk, self.ratios = window_size, index_topk, tuple(sorted(set(ratios)))

    def dispatch(self, *, top_k: int, compress_ratio: int) -> V41CombineTopkSwaKey:
        width = combine_width(top_k, self.window_size)
        return V41CombineTopkSwaKey(
            top_k=top_k, compress_ratio=compress_ratio, window_size=self.window_size, width=width,
            block=warmreg.next_pow2(width), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # vLLM's call sites: an SWA-only layer passes top_k 0, a compressed one the buffer's width
        return {"compress_ratio": list(self.ratios), "top_k": sorted({0, self.index_topk})}

    def when(self, *, compress_ratio: int, top_k: int, **_: Any) -> bool:
        """A layer's ratio fixes its top-k: 0 for SWA-only layers, ``index_topk`` for compressed ones."""
        return (compress_ratio == 0) == (top_k == 0)

    def warmup_inputs(self, key: V41CombineTopkSwaKey) -> Mapping[str, Any]:
        one = warmreg.meta((1,), torch.int32)
        return {
            "topk_indices": warmreg.meta((1, max(key.top_k, 1)), torch.int32), "query_start_loc": warmreg.meta((2,), torch.int32),
            "seq_lens": one, "gather_lens": one, "top_k": key.top_k, "compress_ratio": key.compress_ratio, "M": 1, "N": 0,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        gather_lens: torch.Tensor,
        *,
        top_k: int,
        compress_ratio: int,
        M: int,
        N: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[V41CombineTopkSwaKey]:
        """Indices of a prefill chunk into the gathered workspace, as ``combine_topk_swa_indices(topk_indices,
        query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, top_k, M, N, out)``; returns
        ``(indices [T, round_up(top_k + window, 128)], lens [T])`` int32 (fresh, or ``out``), ``T`` the rows of
        ``topk_indices``.

        :param topk_indices: int32 ``[T, >= top_k]`` local compressed indices of the chunk's tokens, unit column
            stride (a row slice of the shared top-k buffer; an SWA-only layer passes it too and it is not read).
        :param query_start_loc: int32 ``[n + 1]``: the chunk's slice, not rebased (element 0 is subtracted).
        :param seq_lens: int32 ``[>= n]``; ``gather_lens`` int32 ``[>= n]`` (the SWA rows gathered a request).
        :param top_k: top-k columns (``index_topk``; 0 for an SWA-only layer).
        :param compress_ratio: the layer's ratio (0 for SWA-only, else ``>= 1``).
        :param M: workspace rows a request; ``N``: rows holding compressed entries before the SWA rows.
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[T, width]`` and ``[T]``,
            contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        _check(self.name, topk_indices, query_start_loc, seq_lens, gather_lens, top_k, compress_ratio)
        key = self.dispatch(top_k=top_k, compress_ratio=compress_ratio)
        T, n, device = topk_indices.shape[0], query_start_loc.shape[0] - 1, query_start_loc.device
        out_rows, out_lens = out_parts(self.name, out, 2)
        indices = warmreg.output(self.name, "out[0]", out_rows, (T, key.width), torch.int32, device)
        lens = warmreg.output(self.name, "out[1]", out_lens, (T,), torch.int32, device)
        kwargs = dict(
            topk_ptr=topk_indices, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            gather_lens_ptr=gather_lens, out_ptr=indices, lens_ptr=lens, topk_stride=topk_indices.stride(0),
            out_stride=indices.stride(0), M=M, N=N, TOP_K=key.top_k, COMPRESS_RATIO=key.compress_ratio,
            WINDOW_SIZE=key.window_size, WIDTH=key.width, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n, _WORKERS) if n and T else None, kwargs, (indices, lens))


def _check(
    name: str, topk: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor, gather_lens: torch.Tensor, top_k: int,
    ratio: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's callers pass it."""
    if topk.dtype != torch.int32 or topk.ndim != 2 or (topk.shape[1] > 1 and topk.stride(1) != 1):
        raise warmreg.LaunchError(name, f"topk_indices must be int32 [T, k] with unit column stride (got {topk.dtype} "
                                        f"{tuple(topk.shape)})")  # fmt: skip
    for arg, t in (("query_start_loc", qsl), ("seq_lens", seq_lens), ("gather_lens", gather_lens)):
        if t.dtype != torch.int32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(name, f"{arg} must be contiguous 1-D int32 (got {t.dtype} {tuple(t.shape)})")
    n = qsl.shape[0] - 1
    if n < 0 or seq_lens.shape[0] < n or gather_lens.shape[0] < n:
        raise warmreg.LaunchError(name, "query_start_loc needs n + 1 entries, seq_lens and gather_lens n")
    if top_k < 0 or top_k > topk.shape[1] or ratio < 0 or (ratio == 0) != (top_k == 0):
        raise warmreg.LaunchError(
            name, f"top_k ({top_k}) must be within topk_indices' {topk.shape[1]} columns, and 0 exactly when "
            f"compress_ratio ({ratio}) is 0 (an SWA-only layer)",
        )  # fmt: skip


def v41_combine_topk_swa_reference(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    *,
    window_size: int,
    top_k: int,
    compress_ratio: int,
    M: int,
    N: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`V41CombineTopkSwa` (a loop over requests and tokens)."""
    T = topk_indices.shape[0]
    out = torch.full((T, combine_width(top_k, window_size)), -1, dtype=torch.int64)
    lens = torch.zeros(T, dtype=torch.int64)
    qsl = query_start_loc.long() - int(query_start_loc[0])
    for b in range(query_start_loc.shape[0] - 1):
        q0, qlen, seq = int(qsl[b]), int(qsl[b + 1] - qsl[b]), int(seq_lens[b])
        gather_start = seq - int(gather_lens[b])
        for i in range(qlen):
            pos, t = seq - qlen + i, q0 + i
            topk_len = max(min((pos + 1) // compress_ratio, top_k), 0) if compress_ratio else 0
            swa_start = max(pos - (window_size - 1), 0, gather_start)
            swa_len = max(pos - swa_start + 1, 0)
            local = topk_indices[t, :topk_len].long()
            out[t, :topk_len] = torch.where((local >= 0) & (local < N), local + M * b, -1)
            out[t, topk_len : topk_len + swa_len] = M * b + N + swa_start - gather_start + torch.arange(swa_len)
            lens[t] = topk_len + swa_len
    return out.to(torch.int32), lens.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the combine where V4.1 gathers its prefill KV (``DeepseekV4Attention.__init__`` warms it for the
    same backends): FlashMLA's split-KV attention and its mega attention on CUDA, every layer ratio of the model
    (the MTP layers past ``compress_ratios`` included, as SWA-only).

    :raises warmreg.ConfigError: from :func:`.v41.attention_kind`.
    """
    from .v41 import attention_kind  # v41 imports this module

    if not platform.is_cuda or not model.v41:
        return
    used = attention_kind(config, model, platform) in ("flashmla", "mega")
    kernel = V41CombineTopkSwa(window_size=model.sliding_window, index_topk=model.index_topk, ratios=model.ratios)
    registry.add(kernel, when=warmreg.is_cuda if used else False)
