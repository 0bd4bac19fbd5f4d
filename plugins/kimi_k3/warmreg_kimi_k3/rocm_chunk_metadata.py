"""ROCm's KDA metadata builder: the chunked prefill's chunk indices and offsets, built on the device.

This is ``vllm/models/kimi_k3/amd/kda_metadata.py: _chunk_metadata_kernel``, launched by
``prepare_chunk_metadata_device`` from ``KimiK3ROCmKDAMetadataBuilder._build_chunk_metadata``, which the shared
``GDNAttentionMetadataBuilder.build`` (``vllm/v1/attention/backends/gdn_attn.py``) calls on every step with prefill
requests unless its GDN prefill backend is FlashInfer or aiter's FlyDSL. On ROCm that backend is ``"triton"`` for
Kimi-K3 (``_resolve_gdn_prefill_backend``: FlyDSL wants ``linear_key_head_dim == linear_value_head_dim == 128``, which
Kimi's text config does not have, and ``additional_config.gdn_prefill_backend`` is not a warmreg setting), so every
ROCm deployment with KDA layers launches it, whatever its KDA prefill backend. (CUDA's builder builds the same
metadata on the host: :func:`warmreg_kimi_k3.kda_chunk_base.chunk_metadata`.)

Math, over the ``N`` prefill sequences of ``cu_seqlens`` (``[N + 1]``, the prefill rows' query start offsets) with
chunk size ``BT`` (FLA's 64): ``nt[j] = cdiv(cu_seqlens[j + 1] - cu_seqlens[j], BT)`` chunks of sequence ``j``,
then one program per sequence ``i``::

    base = sum(nt[j] for j < i)
    chunk_offsets[i] = base;  chunk_offsets[N] = sum(nt)           # int64
    chunk_indices[base + t] = (i, t)   for t < nt[i]               # [sum(nt), 2], the dtype of cu_seqlens

Every program loads the whole of ``cu_seqlens`` into a ``BLOCK_N = max(128, next_pow2(N + 1))`` tile (the key
varies with the step's prefill count, as vLLM's does), and writes its chunk rows ``BLOCK_T = 256`` at a time. The
chunk count (the output's length) is read from the host copy ``cu_seqlens_cpu``, as vLLM does: no device sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kda_layout
from .model import PLUGIN, KimiK3

__all__ = [
    "BLOCK_T", "CHUNK_SIZE", "MIN_BLOCK_N", "ROCmChunkMetadata", "ROCmChunkMetadataKey", "block_n",
    "rocm_chunk_metadata_reference", "register",
]  # fmt: skip

#: FLA's chunk size (``FLA_CHUNK_SIZE``).
CHUNK_SIZE = 64
#: Chunk rows a program writes at a time (vLLM's ``_BLOCK_T``).
BLOCK_T = 256
#: The smallest sequence tile (vLLM's ``_MIN_BLOCK_N``).
MIN_BLOCK_N = 128


def block_n(num_seqs: int) -> int:
    """vLLM's ``BLOCK_N`` for ``num_seqs`` prefill sequences: ``max(128, next_pow2(num_seqs + 1))``."""
    return max(MIN_BLOCK_N, warmreg.next_pow2(num_seqs + 1))


@triton.jit(do_not_specialize=["num_seqs"])
def _rocm_chunk_metadata_kernel(
    cu_seqlens_ptr,  # [N + 1]
    chunk_indices_ptr,  # [sum(nt), 2], the dtype of cu_seqlens
    chunk_offsets_ptr,  # [N + 1] int64
    num_seqs,  # N
    BT: tl.constexpr,  # chunk size
    BLOCK_N: tl.constexpr,  # the sequence tile: > N
    BLOCK_T: tl.constexpr,  # chunk rows a store
):
    i_n = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    is_seq = offs_n < num_seqs
    bos = tl.load(cu_seqlens_ptr + offs_n, mask=is_seq, other=0).to(tl.int32)
    eos = tl.load(cu_seqlens_ptr + offs_n + 1, mask=is_seq, other=0).to(tl.int32)
    nt = tl.where(is_seq, tl.cdiv(eos - bos, BT), 0)
    base = tl.sum(tl.where(offs_n < i_n, nt, 0))
    num_chunks = tl.sum(tl.where(offs_n == i_n, nt, 0))
    tl.store(chunk_offsets_ptr + i_n, base)
    if i_n == 0:
        tl.store(chunk_offsets_ptr + num_seqs, tl.sum(nt))
    for t0 in range(0, num_chunks, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < num_chunks
        row = (base + offs_t) * 2
        tl.store(chunk_indices_ptr + row, tl.full([BLOCK_T], i_n, tl.int32), mask=mask_t)
        tl.store(chunk_indices_ptr + row + 1, offs_t.to(tl.int32), mask=mask_t)


@attrs.frozen(kw_only=True)
class ROCmChunkMetadataKey(warmreg.CompileKey):
    """What changes the binary: the index dtype and the tiles (``block_n`` follows the step's prefill count)."""

    index_dtype: str  # cu_seqlens and chunk_indices
    chunk_size: int
    block_n: int
    block_t: int
    num_warps: int


class ROCmChunkMetadata(warmreg.TritonKernel[ROCmChunkMetadataKey]):
    """The chunked prefill's ``(chunk_indices, chunk_offsets)`` (the module docstring has the math).

    :param max_prefills: the most prefill sequences of a step (domains only).
    """

    name = "kimi_k3.rocm_chunk_metadata"
    key_type = ROCmChunkMetadataKey
    jit = _rocm_chunk_metadata_kernel

    def __init__(self, *, max_prefills: int) -> None:
        self.max_prefills = max_prefills

    def dispatch(self, *, cu_seqlens: torch.Tensor) -> ROCmChunkMetadataKey:
        return ROCmChunkMetadataKey(
            index_dtype=warmreg.dtype_name(cu_seqlens.dtype),
            chunk_size=CHUNK_SIZE,
            block_n=block_n(cu_seqlens.shape[0] - 1),
            block_t=BLOCK_T,
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # one prefill count per BLOCK_N tile: b - 1 sequences take tile b (the first, 128, takes 1 .. 127)
        counts, tile = [], MIN_BLOCK_N
        while tile <= block_n(self.max_prefills):
            counts.append(min(self.max_prefills, tile - 1))
            tile *= 2
        return {"cu_seqlens": [warmreg.meta((n + 1,), torch.int32) for n in counts]}

    def warmup_inputs(self, key: ROCmChunkMetadataKey) -> Mapping[str, Any]:
        n, dtype = key.block_n - 1, getattr(torch, key.index_dtype)  # next_pow2(block_n) == block_n
        return {"cu_seqlens": warmreg.meta((n + 1,), dtype), "cu_seqlens_cpu": torch.arange(n + 1, dtype=dtype)}

    @warmreg.kernel_launcher
    def __call__(
        self,
        cu_seqlens: torch.Tensor,
        cu_seqlens_cpu: torch.Tensor,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[ROCmChunkMetadataKey]:
        """``(chunk_indices [C, 2], chunk_offsets [N + 1] int64)`` of the ``N`` sequences of ``cu_seqlens``
        (vLLM's ``prepare_chunk_metadata_device(cu_seqlens, cu_seqlens_cpu, 64)``).

        :param cu_seqlens: int32 or int64 ``[N + 1]`` on the device, contiguous: the prefill rows' start offsets.
        :param cu_seqlens_cpu: its host copy, from which the chunk count ``C`` is read.
        :param out: preallocated ``(chunk_indices, chunk_offsets)``, contiguous, of the outputs' shapes and dtypes.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take, or a wrong ``out``.
        """
        self._check(cu_seqlens, cu_seqlens_cpu)
        key = self.dispatch(cu_seqlens=cu_seqlens)
        n = cu_seqlens.shape[0] - 1
        lens = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
        chunks = int(((lens + CHUNK_SIZE - 1) // CHUNK_SIZE).sum())
        if out is not None and (not isinstance(out, tuple | list) or len(out) != 2):
            raise warmreg.LaunchError(
                self.name, f"out must be a tuple of 2 buffers (chunk_indices, chunk_offsets), got {type(out).__name__}"
            )
        dev = cu_seqlens.device
        indices = warmreg.output(
            self.name, "out[0]", None if out is None else out[0], (chunks, 2), cu_seqlens.dtype, dev
        )
        offsets = warmreg.output(self.name, "out[1]", None if out is None else out[1], (n + 1,), torch.int64, dev)
        kwargs = dict(
            cu_seqlens_ptr=cu_seqlens, chunk_indices_ptr=indices, chunk_offsets_ptr=offsets, num_seqs=n,
            BT=key.chunk_size, BLOCK_N=key.block_n, BLOCK_T=key.block_t,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n,) if n else None, kwargs, (indices, offsets))

    def _check(self, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor) -> None:
        ints = (torch.int32, torch.int64)
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in ints:
            raise warmreg.LaunchError(
                self.name, f"cu_seqlens must be a 1-D int32 or int64 [N + 1] (got {cu_seqlens.dtype} "
                f"{tuple(cu_seqlens.shape)})",
            )  # fmt: skip
        if cu_seqlens.stride(0) != 1:
            raise warmreg.LaunchError(self.name, f"cu_seqlens must be contiguous (got stride {cu_seqlens.stride(0)})")
        if cu_seqlens_cpu.shape != cu_seqlens.shape or cu_seqlens_cpu.device.type != "cpu":
            raise warmreg.LaunchError(
                self.name, f"cu_seqlens_cpu must be the host copy of cu_seqlens, {tuple(cu_seqlens.shape)} on the "
                f"CPU (got {tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device})",
            )  # fmt: skip


def rocm_chunk_metadata_reference(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`ROCmChunkMetadata` (FLA's ``prepare_chunk_indices`` / ``prepare_chunk_offsets``
    layout): ``(chunk_indices, chunk_offsets)``."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    nt = (lens + CHUNK_SIZE - 1) // CHUNK_SIZE
    offsets = torch.cat([nt.new_zeros(1), nt.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(nt.numel(), device=cu_seqlens.device), nt)
    within = torch.arange(int(nt.sum()), device=cu_seqlens.device) - offsets[:-1].repeat_interleave(nt)
    return torch.stack([seq, within], 1).to(cu_seqlens.dtype), offsets


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the chunk metadata on ROCm when there are KDA layers (every ROCm KDA prefill backend: the builder
    builds it for any).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a missing ``serving.max_num_seqs`` /
        ``serving.max_num_batched_tokens``.
    """
    if kda_layout(m, config) is None:
        return
    prefills = min(
        config.get("serving.max_num_seqs", int, plugin=PLUGIN),
        config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN),
    )
    registry.add(ROCmChunkMetadata(max_prefills=prefills), when=warmreg.is_rocm)
