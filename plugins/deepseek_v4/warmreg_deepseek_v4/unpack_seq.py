"""Unpack a padded batch back into ragged rows (vLLM 0.33 ``v1/attention/ops/common.py``: ``unpack_seq_triton``,
the ``UnpackSeqTritonKernel`` that ``SparseAttnIndexer`` registers), the inverse of
:mod:`~warmreg_deepseek_v4.pack_seq` on the C4 indexer's padded decode path.

After the top-k ran on the ``B * next_n`` rows of the packed Q, the indexer unpacks
``topk_indices.reshape(B, next_n, index_topk)`` (int32) by the decode lengths into ``[Td, index_topk]`` and copies
it into ``topk_indices_buffer[:Td, :index_topk]``.

Grid ``(B, cdiv(Lmax, BLOCK_T), cdiv(D, BLOCK_D))``, ``start_b = lengths[0] + ... + lengths[b - 1]``::

    out[start_b + t, d] = packed[b, t, d]    for t < min(lengths[b], Lmax), d < D

Addressing is row-major contiguous (no strides). Registered with the pack, where
:func:`~warmreg_deepseek_v4.pack_seq.padded_decode` holds, on
:data:`~warmreg_deepseek_v4.pack_seq.padded_decode_platforms` (CUDA below SM100, ROCm FP8 indexer, XPU);
the engine's unpack has no FP4 variant.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dspark import num_speculative_tokens
from .model import DSV4, PLUGIN
from .pack_seq import TILE_D, TILE_T, padded_decode, padded_decode_platforms, ragged_tile

__all__ = ["UnpackSeq", "UnpackSeqKey", "register", "unpack_seq_reference"]


@triton.jit(do_not_specialize=["B", "Lmax", "D"], do_not_specialize_on_alignment=["lengths_ptr"])
def _unpack_seq_kernel(
    packed_ptr,
    out_ptr,
    lengths_ptr,
    B,
    Lmax,
    D,
    BLOCK_T: tl.constexpr,  # rows per program (64)
    BLOCK_D: tl.constexpr,  # columns per program (64)
):
    pid_b, off_t, off_d, out_start, seq_len = ragged_tile(lengths_ptr, BLOCK_T, BLOCK_D)
    valid = (off_t < seq_len) & (off_t < Lmax)
    mask = valid[:, None] & (off_d[None, :] < D)
    vals = tl.load(packed_ptr + (pid_b * Lmax + off_t)[:, None] * D + off_d[None, :], mask=mask)
    tl.store(out_ptr + (out_start + off_t)[:, None] * D + off_d[None, :], vals, mask=mask)


@attrs.frozen(kw_only=True)
class UnpackSeqKey(warmreg.CompileKey):
    """What changes the binary of the ragged unpack: B, Lmax and D are not specialized."""

    dtype: str  # packed and out (int32 top-k indices)
    block_t: int
    block_d: int
    packed_aligned: bool  # loaded as tiles; the top-k output is a fresh tensor (aligned)
    num_warps: int
    num_stages: int


class UnpackSeq(warmreg.TritonKernel[UnpackSeqKey]):
    """Unpack ``packed [B, Lmax, D]`` into ``[sum(lengths), D]`` (see the module docstring).

    :param topk: ``index_topk``, the packed rows' width (domains only).
    """

    name = "deepseek_v4.unpack_seq"
    key_type = UnpackSeqKey
    jit = _unpack_seq_kernel

    def __init__(self, *, topk: int = 512) -> None:
        self.topk = topk

    def dispatch(self, *, packed: torch.Tensor) -> UnpackSeqKey:
        return UnpackSeqKey(
            dtype=warmreg.dtype_name(packed.dtype),
            block_t=TILE_T,
            block_d=TILE_D,
            packed_aligned=warmreg.is_aligned(packed),
            num_warps=4,
            num_stages=2,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        next_n = 1 + num_speculative_tokens(config)
        reqs = warmreg.token_counts(config, plugin=PLUGIN, field="max_num_seqs")
        # the top-k of the B * next_n packed rows, a fresh int32 [B * next_n, index_topk] seen as [B, next_n, topk]
        return {"packed": [warmreg.meta((b, next_n, self.topk), torch.int32) for b in reqs if b]}

    def warmup_inputs(self, key: UnpackSeqKey) -> Mapping[str, Any]:
        return {
            "packed": warmreg.meta(
                (1, 2, key.block_d), getattr(torch, key.dtype), offset=0 if key.packed_aligned else 1
            ),
            "lengths": warmreg.meta((1,), torch.int32),
            "lengths_host": [2],
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        packed: torch.Tensor,
        lengths: torch.Tensor,
        *,
        lengths_host: list[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[UnpackSeqKey]:
        """Unpack ``packed`` by ``lengths``; returns ``[sum(lengths), *packed.shape[2:]]`` (fresh, or ``out``).

        :param packed: ``[B, Lmax, ...]``, contiguous (trailing dims flattened into ``D``).
        :param lengths: int32 ``[B]``, contiguous, each in ``[0, Lmax]``.
        :param lengths_host: ``lengths`` as host ints if the caller has them (else read from the device: the
            output's row count is a host value, as in the engine's wrapper).
        :param out: the output to write instead of a fresh one: exactly ``[sum(lengths), *packed.shape[2:]]`` of
            ``packed``'s dtype, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for a non-contiguous or rank < 2 ``packed``, bad ``lengths``, or an ``out``
            unlike the fresh output.
        """
        if packed.ndim < 2 or not packed.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"packed must be a contiguous [B, Lmax, ...] tensor (got {tuple(packed.shape)})"
            )
        b, lmax = packed.shape[0], packed.shape[1]
        if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b,) or (b > 1 and lengths.stride(0) != 1):
            raise warmreg.LaunchError(
                self.name,
                f"lengths must be a contiguous int32 [{b}] tensor (got {lengths.dtype} {tuple(lengths.shape)})",
            )
        host = [int(n) for n in (lengths.tolist() if lengths_host is None else lengths_host)]
        if len(host) != b or any(n < 0 or n > lmax for n in host):
            raise warmreg.LaunchError(self.name, f"lengths {host} must be {b} counts in [0, Lmax={lmax}]")
        key = self.dispatch(packed=packed)
        d = packed.shape[2:].numel()
        out = warmreg.output(self.name, "out", out, (sum(host), *packed.shape[2:]), packed.dtype, packed.device)
        kwargs = dict(
            packed_ptr=packed, out_ptr=out, lengths_ptr=lengths, B=b, Lmax=lmax, D=d,
            BLOCK_T=key.block_t, BLOCK_D=key.block_d,
        )  # fmt: skip
        grid = (b, (lmax + key.block_t - 1) // key.block_t, (d + key.block_d - 1) // key.block_d)
        return warmreg.LaunchSpec(key, grid if out.shape[0] and d else None, kwargs, out)


def unpack_seq_reference(packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`UnpackSeq`: the first ``lengths[b]`` rows of each ``packed[b]``, in order."""
    rows = [packed[b, :n] for b, n in enumerate(int(n) for n in lengths.tolist())]
    return torch.cat(rows) if rows else packed.new_empty((0, *packed.shape[2:]))


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the unpack of the C4 indexer's padded decode, where the pack is registered."""
    registry.add(
        UnpackSeq(topk=model.index_topk), when=padded_decode_platforms if padded_decode(model, config, platform) else False
    )
