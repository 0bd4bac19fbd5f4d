"""DeepSeek-V4.1's zero-padded, chunk-interleaved query of mega attention (vLLM 0.34
``models/deepseek_v41/attention.py``: ``_pad_interleaved_q`` / ``_pad_interleaved_q_kernel``).

FlashMLA's mega-attention kernel reads Q with its 512 head dims cut into 16-element chunks, each chunk holding the
``H`` live heads' 16 values, then ``HP - H`` zero heads (``common/ops/fused_layout.py: Q_CHUNK``; the permuted
``wq_b`` already writes the live part in that order). Viewing ``q`` ``[N, H, D]`` as rows of ``16 H`` elements
(``N * D / 16`` rows) and ``out`` ``[N, HP, D]`` as rows of ``16 HP``::

    out_row[r, c] = q_row[r, c]      for c < 16 H          (a bit copy)
    out_row[r, c] = +0.0             for 16 H <= c < 16 HP

Both tensors are contiguous and of one dtype (the model's); ``16 H`` and ``16 (HP - H)`` are powers of two. Grid
``(cdiv(rows, 4),)``: four rows a program, four warps, as in vLLM.

Where it runs: CUDA SM10x with ``FLASHMLA_MEGA_ATTN_DSV41`` (the one attention class whose
``accepts_unnormed_unroped_query`` is True), on layers with 32 local heads padded to 64 (``_pads_q_by_copy``: a
64-head model at TP 2) when ``max_num_batched_tokens >= 2048``; ``_fused_qnorm_rope_kv_insert`` then pads by copy
on eager steps of at least 2048 tokens, and leaves the pad to the fused KV insert otherwise.

Key: the live and pad widths, the row tile, the dtype and the warps. ``rows`` is specialized as vLLM's kernel
specializes it: ``N * 32`` is always a multiple of 16, so one binary serves every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from .model import DSV4

__all__ = ["PadInterleavedQ", "PadInterleavedQKey", "pad_interleaved_q_reference", "register"]

#: Head dims a chunk of the interleaved layout (``fused_layout.Q_CHUNK``).
Q_CHUNK = 16
#: Steps from this many tokens pad by copy (``_Q_PAD_COPY_MIN_TOKENS``).
MIN_TOKENS = 2048
_BLOCK_ROWS = 4
_NUM_WARPS = 4


@triton.jit
def _pad_interleaved_q_kernel(
    q_ptr,  # [rows, LIVE]
    out_ptr,  # [rows, LIVE + PAD]
    rows,
    LIVE: tl.constexpr,  # 16 * live heads: the copied part of a row (a power of two)
    PAD: tl.constexpr,  # 16 * padding heads: the zeroed tail of a row (a power of two)
    BLOCK_ROWS: tl.constexpr,  # rows a program
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    keep = (r < rows)[:, None]
    live = tl.arange(0, LIVE)[None, :]
    values = tl.load(q_ptr + r[:, None] * LIVE + live, mask=keep)
    dst = out_ptr + r[:, None] * (LIVE + PAD)
    tl.store(dst + live, values, mask=keep)
    zeros = tl.zeros([BLOCK_ROWS, PAD], dtype=values.dtype)
    tl.store(dst + LIVE + tl.arange(0, PAD)[None, :], zeros, mask=keep)


@attrs.frozen(kw_only=True)
class PadInterleavedQKey(warmreg.CompileKey):
    """What changes the binary of the pad: the row widths, the row tile, the dtype, ``rows``' class, the warps."""

    live: int
    pad: int
    block_rows: int
    dtype: str
    rows: warmreg.IntClass
    num_warps: int


class PadInterleavedQ(warmreg.TritonKernel[PadInterleavedQKey]):
    """The zero-padded interleaved query (the module docstring has the layout).

    :param live_heads: local heads (domains only).
    :param padded_heads: the attention kernel's head count (domains only).
    :param head_dim: 512 (domains only).
    :param dtype: the model dtype (domains only).
    :param tokens: the step token counts that pad by copy (domains only).
    """

    name = "deepseek_v4.v41_pad_interleaved_q"
    key_type = PadInterleavedQKey
    jit = _pad_interleaved_q_kernel

    def __init__(self, *, live_heads: int, padded_heads: int, head_dim: int, dtype: str, tokens: Iterable[int]) -> None:
        self.live_heads, self.padded_heads, self.head_dim, self.dtype = live_heads, padded_heads, head_dim, dtype
        self.tokens = tuple(tokens)

    def dispatch(self, *, q: torch.Tensor, out: torch.Tensor) -> PadInterleavedQKey:
        n, live_heads, head_dim = q.shape
        return PadInterleavedQKey(
            live=live_heads * Q_CHUNK, pad=(out.shape[1] - live_heads) * Q_CHUNK, block_rows=_BLOCK_ROWS,
            dtype=warmreg.dtype_name(q.dtype), rows=warmreg.int_class(n * (head_dim // Q_CHUNK)), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        return {
            "q": [warmreg.meta((n, self.live_heads, self.head_dim), dtype) for n in self.tokens],
            "out": [warmreg.meta((1, self.padded_heads, self.head_dim), dtype)],
        }

    def warmup_inputs(self, key: PadInterleavedQKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        rows = warmreg.int_class_rep(key.rows)
        tokens = max(1, rows // (self.head_dim // Q_CHUNK))
        live, padded = key.live // Q_CHUNK, (key.live + key.pad) // Q_CHUNK
        return {
            "q": warmreg.meta((tokens, live, self.head_dim), dtype),
            "out": warmreg.meta((tokens, padded, self.head_dim), dtype),
        }

    @warmreg.kernel_launcher
    def __call__(self, q: torch.Tensor, out: torch.Tensor) -> warmreg.LaunchSpec[PadInterleavedQKey]:
        """Write ``q`` ``[N, H, D]`` into ``out`` ``[N, HP, D]`` in the interleaved layout; returns ``out``.

        :raises warmreg.LaunchError: for tensors that are not contiguous, 16-byte aligned and of one dtype, shapes
            that disagree, ``D`` not a multiple of 16, or chunk widths ``16 H``, ``16 (HP - H)`` not powers of two.
        """
        _check(self.name, q, out)
        key = self.dispatch(q=q, out=out)
        rows = q.shape[0] * (q.shape[2] // Q_CHUNK)
        kwargs = dict(q_ptr=q, out_ptr=out, rows=rows, LIVE=key.live, PAD=key.pad, BLOCK_ROWS=key.block_rows)
        return warmreg.LaunchSpec(key, (triton.cdiv(rows, key.block_rows),) if rows else None, kwargs, out)


def _check(name: str, q: torch.Tensor, out: torch.Tensor) -> None:
    """Raise :class:`warmreg.LaunchError` naming the argument vLLM's asserts (and the interleaved layout) refuse."""
    for arg, t in (("q", q), ("out", out)):
        if t.ndim != 3 or not t.is_contiguous() or t.data_ptr() % 16:
            raise warmreg.LaunchError(
                name, f"{arg} must be a contiguous, 16-byte aligned [N, heads, D] tensor (got {tuple(t.shape)}, "
                f"stride {t.stride()})",
            )  # fmt: skip
    n, live, dim = q.shape
    if out.shape[0] != n or out.shape[2] != dim or out.dtype != q.dtype or out.shape[1] <= live or dim % Q_CHUNK:
        raise warmreg.LaunchError(
            name, f"out must be {q.dtype} [N={n}, HP > {live}, D={dim}] with D a multiple of 16 (got {out.dtype} "
            f"{tuple(out.shape)})",
        )  # fmt: skip
    pad = out.shape[1] - live
    if (live * Q_CHUNK) & (live * Q_CHUNK - 1) or (pad * Q_CHUNK) & (pad * Q_CHUNK - 1):
        raise warmreg.LaunchError(name, f"16 * heads ({live}) and 16 * padding heads ({pad}) must be powers of two")


def pad_interleaved_q_reference(q: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """PyTorch reference of :class:`PadInterleavedQ`: ``[N, padded_heads, D]``, each 16-dim chunk row the live
    values then zeros."""
    n, live, dim = q.shape
    rows = q.reshape(n * dim // Q_CHUNK, live * Q_CHUNK)
    pad = rows.new_zeros((rows.shape[0], (padded_heads - live) * Q_CHUNK))
    return torch.cat([rows, pad], dim=1).reshape(n, padded_heads, dim)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the pad where vLLM sets ``_pads_q_by_copy`` (see the module docstring): mega attention on CUDA, 32
    local heads padded to 64, ``serving.max_num_batched_tokens`` >= 2048; domains: the step sizes from 2048 up.

    :raises warmreg.ConfigError: for a missing ``serving.max_num_batched_tokens`` or an unknown backend.
    """
    from .v41 import attention_kind, padded_heads, tensor_parallel_size  # v41 imports this module

    if not platform.is_cuda or not model.v41:
        return
    kind = attention_kind(config, model, platform)
    local = model.num_attention_heads // tensor_parallel_size(config)
    max_tokens = serving_int(config, "max_num_batched_tokens")
    used = kind == "mega" and local == 32 and padded_heads(kind, local) == 64 and max_tokens >= MIN_TOKENS
    kernel = PadInterleavedQ(
        live_heads=local, padded_heads=padded_heads(kind, local), head_dim=model.head_dim, dtype=model.dtype,
        tokens=sorted({MIN_TOKENS, max(MIN_TOKENS, max_tokens)}),
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda if used else False)
