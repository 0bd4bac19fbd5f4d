"""What the six stages of the chunked KDA prefill share: the chunk sizes, the varlen chunk metadata, and the
base class that holds one deployment's layout and builds the tuning batch.

vLLM 0.33 runs the stages as ``chunk_kda_with_fused_gate`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/
chunk.py``) with ``FLA_CHUNK_SIZE`` 64 and 16-token sub-chunks (``chunk_intra.py: chunk_kda_fwd_intra``, ``BC``).
Each stage is one warmreg op (``kda_chunk_l2norm`` ... ``kda_chunk_o``); ``kda_chunk.chunk_kda_prefill`` chains
them. The stages take vLLM's tensors without their leading batch dim of 1 (``[T, H, *]`` views of vLLM's
``[1, T, H, *]``: the same memory); the states are vLLM's ``[.., H, V, K]`` (K contiguous).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import accumulate, pairwise
from typing import Any, Generic, TypeVar

import torch

import warmreg

from .model import PLUGIN

__all__ = [
    "CHUNK_SIZE",
    "SUB_CHUNK",
    "TUNING_SEQUENCES",
    "TUNING_TOKENS",
    "ChunkStage",
    "chunk_metadata",
    "chunk_rows",
    "meta_chunks",
    "tuning_lengths",
    "tuning_tensor",
]

#: Tokens per chunk (``FLA_CHUNK_SIZE``); every stage's ``BT``.
CHUNK_SIZE = 64
#: Tokens per sub-chunk of the intra-chunk stage (``BC``): the decay products are taken within 16 tokens.
SUB_CHUNK = 16
#: The tuning batch: this many prefill sequences of ``TUNING_TOKENS`` tokens in all (fewer when the
#: deployment batches fewer tokens), unequal so that some chunks are partial.
TUNING_SEQUENCES = 4
TUNING_TOKENS = 4096

_K = TypeVar("_K", bound=warmreg.CompileKey)


def chunk_metadata(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks of a varlen batch, as vLLM's ``prepare_chunk_indices`` / ``prepare_chunk_offsets``
    (``vllm/third_party/flash_linear_attention/ops/index.py``) compute them.

    :param cu_seqlens: int32 ``[N + 1]`` token offsets.
    :returns: ``(chunk_indices, chunk_offsets)``: int32 ``[NT, 2]`` rows ``(sequence, chunk within it)`` for the
        ``NT`` chunks in order, and int32 ``[N + 1]``, the first chunk of each sequence. ``NT`` is read back
        to the host (one synchronisation per prefill, as in vLLM).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = (lens + CHUNK_SIZE - 1) // CHUNK_SIZE
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    total = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), counts, output_size=total)
    within = torch.arange(total, device=lens.device) - offsets[:-1][seq]
    return torch.stack([seq, within], 1).to(torch.int32), offsets.to(torch.int32)


def chunk_rows(cu_seqlens: torch.Tensor) -> Iterator[slice]:
    """The token rows of every chunk of a varlen batch, in order (for the PyTorch references)."""
    for bos, eos in pairwise(cu_seqlens.tolist()):
        for start in range(bos, eos, CHUNK_SIZE):
            yield slice(start, min(start + CHUNK_SIZE, eos))


def tuning_lengths(max_tokens: int) -> list[int]:
    """Sequence lengths of the tuning batch: :data:`TUNING_SEQUENCES` unequal lengths summing to
    ``min(max_tokens, TUNING_TOKENS)`` (one token at least each)."""
    total = max(min(max_tokens, TUNING_TOKENS), TUNING_SEQUENCES)
    weights = [1, 2, 3, 4]  # unequal, so that the sequences end mid-chunk
    lens = [max(1, total * w // sum(weights)) for w in weights]
    lens[-1] += total - sum(lens)
    return lens


def tuning_tensor(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of the tuning batch on ``device``: zeros of ``dtype`` from element ``offset`` of a fresh buffer (1: a
    view off 16-byte alignment, for a key's ``*_aligned=False``), written as bytes. ``partial(tuning_tensor, device)``
    is the ``make`` of a stage's ``_inputs``.

    No stage branches on the values (the batch's metadata is real, built on the host), so zeros time as random
    data does, and the whole batch costs one torch kernel (a byte fill) whatever its dtypes. torch loads each of
    its kernels at its first use in a process (5-80 ms each on an H100); in a warm from a pack the rehearsal is the
    first user of these inputs, and random data (``randn``, a cast, ``normalize``, ``cumsum``) took 0.16 s there
    (H100, Triton 3.6.0).
    """
    flat = torch.zeros((offset + math.prod(shape)) * dtype.itemsize, dtype=torch.uint8, device=device).view(dtype)
    return flat[offset:].view(shape)


class ChunkStage(warmreg.TritonKernel[_K], Generic[_K]):
    """Base of the chunked-prefill stage kernels: one deployment's layout, for :meth:`domains` and
    :meth:`tuning_inputs` only (``dispatch`` reads the tensors alone, so any instance serves any key).

    :param num_heads: KDA heads on one rank.
    :param head_dim: K = V (Kimi-Linear's ``linear_attn_config.head_dim``).
    :param dtype: activation dtype name (q, k, v, the raw gate and beta, every intermediate but g and beta).
    :param has_dt_bias: whether the layers add a ``dt_bias`` to the raw gate.
    :param lower_bound: the gate's lower bound, or None (the softplus gate); only whether it is set is a key.
    :param max_num_batched_tokens: the most tokens of one step (sizes the tuning batch).
    :param plugin: the registering plugin.
    """

    def __init__(
        self,
        *,
        num_heads: int = 1,
        head_dim: int = 128,
        dtype: str = "bfloat16",
        has_dt_bias: bool = True,
        lower_bound: float | None = None,
        max_num_batched_tokens: int = TUNING_TOKENS,
        plugin: str = PLUGIN,
    ) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dtype = getattr(torch, dtype)
        self.has_dt_bias, self.lower_bound = has_dt_bias, lower_bound
        self.max_num_batched_tokens = max_num_batched_tokens
        self.plugin = plugin

    def token_counts(self) -> list[int]:
        """Sample prefill sizes for the domains (no key depends on the token count: every kernel takes it from
        ``cu_seqlens`` or as an unspecialized int): one token and a full step."""
        return sorted({1, self.max_num_batched_tokens})

    def fail(self, problem: str, fix: str | None = None) -> None:
        """Raise the :class:`warmreg.LaunchError` of this stage."""
        raise warmreg.LaunchError(self.name, problem, fix=fix)

    def out_tuple(self, out: Sequence[torch.Tensor], names: tuple[str, ...]) -> Sequence[torch.Tensor]:
        """A caller's ``out=`` of a stage with several outputs: one tensor per output, in the order the stage
        returns them (each is then checked by :func:`warmreg.output`). Call it only when ``out`` is not None.

        :raises warmreg.LaunchError: when ``out`` is not a tuple or list of ``len(names)`` entries.
        """
        if not isinstance(out, tuple | list) or len(out) != len(names):
            self.fail(
                f"out must be a tuple of {len(names)} tensors ({', '.join(names)}), got {type(out).__name__}"
                + (f" of {len(out)}" if isinstance(out, tuple | list) else ""),
                fix=f"pass out=({', '.join(names)}), in the order this stage returns them, or no out",
            )
        return out

    def tuning_batch(self, device: torch.device) -> dict[str, Any]:
        """``cu_seqlens``, ``chunk_indices``, ``chunk_offsets`` and the token count of the tuning batch, built on
        the host and copied to ``device`` (no torch kernel runs there: :func:`tuning_tensor`)."""
        lens = tuning_lengths(self.max_num_batched_tokens)
        cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
        chunks, offsets = chunk_metadata(cu)
        return {"cu_seqlens": cu.to(device), "chunk_indices": chunks.to(device), "chunk_offsets": offsets.to(device),
                "tokens": sum(lens)}  # fmt: skip


def meta_chunks(tokens: int = 1) -> dict[str, torch.Tensor]:
    """Meta ``cu_seqlens`` and ``chunk_indices`` of one sequence of ``tokens`` tokens, for ``warmup_inputs``
    (their sizes never reach a key)."""
    chunks = (tokens + CHUNK_SIZE - 1) // CHUNK_SIZE
    return {"cu_seqlens": warmreg.meta((2,), torch.int32), "chunk_indices": warmreg.meta((chunks, 2), torch.int32)}
