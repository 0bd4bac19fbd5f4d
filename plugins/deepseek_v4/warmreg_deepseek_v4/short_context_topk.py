"""The C4 indexer's top-k of a short-context step: every compressed candidate, in order (vLLM 0.34
``models/deepseek_v4/attention.py``: ``fill_short_context_topk_indices``, launched by ``DeepseekV4Indexer.forward``).

When a step's longest sequence has no more compressed C4 entries than the indexer keeps
(``max_seq_len // compress_ratio <= index_topk``), scoring them is pointless: every candidate is selected. vLLM then
skips the indexer's Q projection and logits (the compressor still writes the K cache) and fills the indexer's
persistent top-k buffer directly. For token ``t < T`` at position ``pos[t]``, ratio ``R`` and ``K = index_topk``::

    n = floor((pos[t] + 1) / R)                 # compressed entries the token can see
    out[t, j] = j if j < n else -1              for j < K

Indices are local compressed positions, as the indexer's own top-k writes them (the global top-k op and the
combine map them to cache slots). ``out`` is int32 ``[T, K]`` with row stride ``K``: in vLLM the prefix
``[:T]`` of the ``[max_num_batched_tokens, index_topk]`` buffer every indexer layer shares. Grid ``(T,)``, one
program a token over a power-of-two tile of ``K``, eight warps, as in vLLM.

Where it runs: every C4 (indexer) layer of a step whose ``max_seq_len // 4 <= index_topk``, outside CUDA-graph
capture (``torch.cuda.is_current_stream_capturing()``), so on eager steps: short requests in any deployment.
``DeepseekV4Indexer.forward`` is shared by the CUDA, ROCm (the MXFP4 indexer subclass keeps it) and XPU models;
the CPU model has its own PyTorch fill. So it is registered on every platform when the model has C4 layers.

Key: ``K``, ``R`` and the tile (constexprs, as in vLLM), and the warps. ``T`` is the grid; ``positions`` (contiguous, as
vLLM's kernel reads it) is read one scalar a program (``do_not_specialize_on_alignment``: an offset view needs no
second binary); ``out`` is fresh or
a checked 16-byte aligned buffer, so its alignment is not a key field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41 import index_ratios
from .model import DSV4

__all__ = ["ShortContextTopk", "ShortContextTopkKey", "register", "short_context_topk_reference"]

#: The only ratio with an indexer (``DeepseekV4Attention`` builds one for ``compress_ratio == 4``).
C4 = 4
_NUM_WARPS = 8


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _short_context_topk_kernel(
    positions_ptr,
    out_ptr,  # [T, TOPK], contiguous
    TOPK: tl.constexpr,  # index_topk: a model constant
    COMPRESS_RATIO: tl.constexpr,  # 4: the indexer's ratio
    BLOCK_TOPK: tl.constexpr,  # next_pow2(TOPK): the column tile
):
    t = tl.program_id(0).to(tl.int64)
    visible = (tl.load(positions_ptr + t).to(tl.int64) + 1) // COMPRESS_RATIO
    j = tl.arange(0, BLOCK_TOPK)
    tl.store(out_ptr + t * TOPK + j, tl.where(j < visible, j, -1).to(tl.int32), mask=j < TOPK)


@attrs.frozen(kw_only=True)
class ShortContextTopkKey(warmreg.CompileKey):
    """What changes the binary of the short-context fill: the row width, the ratio and the tile."""

    topk: int
    compress_ratio: int
    block_topk: int
    num_warps: int


class ShortContextTopk(warmreg.TritonKernel[ShortContextTopkKey]):
    """Every visible compressed candidate of each token, then ``-1`` (the module docstring has the math).

    :param topk: the model's ``index_topk`` (domains only).
    :param compress_ratios: the indexers' ratios (domains only): 4 for DeepSeek-V4, the index-source layers' 1 or 2
        for V4.1.
    """

    name = "deepseek_v4.fill_short_context_topk"
    key_type = ShortContextTopkKey
    jit = _short_context_topk_kernel

    def __init__(self, *, topk: int, compress_ratios: tuple[int, ...] = (C4,)) -> None:
        self.topk, self.compress_ratios = topk, compress_ratios

    def dispatch(self, *, topk: int, compress_ratio: int) -> ShortContextTopkKey:
        return ShortContextTopkKey(
            topk=topk, compress_ratio=compress_ratio, block_topk=warmreg.next_pow2(topk), num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"topk": [self.topk], "compress_ratio": self.compress_ratios}

    def warmup_inputs(self, key: ShortContextTopkKey) -> Mapping[str, Any]:
        return {
            "positions": warmreg.meta((1,), torch.int64),
            "num_tokens": 1,
            "topk": key.topk,
            "compress_ratio": key.compress_ratio,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        *,
        num_tokens: int,
        topk: int,
        compress_ratio: int = C4,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[ShortContextTopkKey]:
        """The ``[num_tokens, topk]`` int32 top-k of the first ``num_tokens`` tokens (``out``, or a fresh tensor).

        :param positions: int64 ``[>= num_tokens]``, contiguous (the step's positions, padding included).
        :param num_tokens: the step's tokens (decode + prefill), the grid.
        :param topk: the row width (``index_topk``, ``>= 1``).
        :param compress_ratio: the indexer's ratio (4; ``>= 1``).
        :param out: the buffer to write instead of a fresh one: exactly int32 ``[num_tokens, topk]``, contiguous,
            16-byte aligned (vLLM's ``topk_indices_buffer[:num_tokens]``).
        :raises warmreg.LaunchError: for a positions tensor that is not contiguous int64 covering the tokens, sizes below
            1, or an ``out`` unlike the fresh output.
        """
        if (
            positions.dtype != torch.int64
            or positions.ndim != 1
            or not 0 <= num_tokens <= positions.shape[0]
            or (positions.shape[0] > 1 and positions.stride(0) != 1)
        ):
            raise warmreg.LaunchError(
                self.name,
                f"positions must be a contiguous 1-D int64 tensor of >= num_tokens = {num_tokens} >= 0 entries "
                f"(got {positions.dtype} {tuple(positions.shape)}, stride {positions.stride()})",
            )
        if topk < 1 or compress_ratio < 1:
            raise warmreg.LaunchError(self.name, f"topk ({topk}) and compress_ratio ({compress_ratio}) must be >= 1")
        key = self.dispatch(topk=topk, compress_ratio=compress_ratio)
        out = warmreg.output(self.name, "out", out, (num_tokens, topk), torch.int32, positions.device)
        kwargs = dict(
            positions_ptr=positions, out_ptr=out, TOPK=key.topk, COMPRESS_RATIO=key.compress_ratio,
            BLOCK_TOPK=key.block_topk,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, out)


def short_context_topk_reference(
    positions: torch.Tensor, *, num_tokens: int, topk: int, compress_ratio: int = C4
) -> torch.Tensor:
    """PyTorch reference of :class:`ShortContextTopk`: int32 ``[num_tokens, topk]``."""
    visible = torch.div(positions[:num_tokens].long() + 1, compress_ratio, rounding_mode="floor")
    j = torch.arange(topk, device=positions.device)
    return torch.where(j[None, :] < visible[:, None], j[None, :], -1).to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the fill on every platform when the model has C4 layers (``DeepseekV4Indexer.forward``'s
    short-context branch; see the module docstring). It reads no serving setting.

    DeepSeek-V4.1 launches the same kernel (its ``models/deepseek_v41/attention.py`` imports
    ``fill_short_context_topk_indices`` from V4's) from its own ``DeepseekV4Indexer.forward``, with the same
    arguments and ``COMPRESS_RATIO`` its layer's ratio: on CUDA (this plugin's V4.1 plan) for each ratio of the
    index-source layers (:func:`._v41.index_ratios`).
    """
    if model.v41:
        ratios = index_ratios(model)
        kernel = ShortContextTopk(topk=model.index_topk, compress_ratios=ratios)
        registry.add(kernel, when=warmreg.is_cuda if ratios else False)
        return
    registry.add(ShortContextTopk(topk=model.index_topk), when=model.has_c4)
