"""Indexer prefill chunk metadata: the K windows of a sparse-MLA indexer's prefill logits.

vLLM 0.34 ``v1/attention/backends/mla/indexer.py``: ``build_prefill_chunk_metadata`` →
``BuildPrefillChunkMetadataKernel``, run by ``DeepseekV32IndexerMetadataBuilder`` for DeepSeek-V4's C4 indexer and
Kimi-K3.1's DSA indexer.

The op is vLLM's kernel without ``positions`` (``positions_ptr`` is set only on the shard-Q prefill path, which
prefill context parallelism selects).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from ..contract.config import WarmConfig
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta, output
from ..values.errors import LaunchError
from ..values.key import CompileKey, IntClass, int_class, int_class_rep, is_aligned
from ..values.platform import Platform
from ._index_checks import HIGH_REPS, LOW_REPS, TILE, check_int32_vector, int_rep, out_parts

__all__ = ["IndexerPrefillChunkMetadata", "PrefillChunkMetadataKey", "indexer_prefill_chunk_metadata_reference"]

_I32 = torch.int32


@triton.jit(
    do_not_specialize_on_alignment=[
        "query_start_loc_ptr", "row_start_cu_ptr", "token_to_seq_ptr", "cu_seqlen_ks_ptr", "cu_seqlen_ke_ptr"
    ]
)  # fmt: skip
def _indexer_prefill_chunk_metadata_kernel(
    query_start_loc_ptr,
    seq_lens_ptr,
    cu_compressed_ptr,
    row_start_cu_ptr,
    token_to_seq_ptr,
    cu_seqlen_ks_ptr,
    cu_seqlen_ke_ptr,
    query_slice_start,
    query_slice_stop,
    dcp_rank,
    dcp_world,
    dcp_interleave,
    COMPRESS_RATIO: tl.constexpr,  # uncompressed tokens per compressed K row
    TILE: tl.constexpr,  # rows per loop iteration
):
    b = tl.program_id(0)
    first = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - first
    row0 = tl.load(cu_compressed_ptr + b)
    clen = tl.load(cu_compressed_ptr + b + 1) - row0
    base_row = tl.load(row_start_cu_ptr + b)
    context = tl.load(seq_lens_ptr + b) - qlen
    for j0 in range(0, qlen, TILE):
        j = j0 + tl.arange(0, TILE)
        tok = first + j
        mask = (j < qlen) & (tok >= query_slice_start) & (tok < query_slice_stop)
        rows = (context + 1 + j) // COMPRESS_RATIO  # causal count of compressed K rows for query j
        if dcp_world > 1:  # this rank's share of those rows (a specialized 1 folds the branch away)
            base = (rows // dcp_interleave // dcp_world) * dcp_interleave
            rows = base + tl.minimum(tl.maximum(rows - base * dcp_world - dcp_rank * dcp_interleave, 0), dcp_interleave)
        tl.store(cu_seqlen_ks_ptr + tok - query_slice_start, tl.zeros_like(j) + base_row, mask=mask)
        tl.store(cu_seqlen_ke_ptr + tok - query_slice_start, base_row + rows, mask=mask)
    for k0 in range(0, clen, TILE):
        k = k0 + tl.arange(0, TILE)
        tl.store(token_to_seq_ptr + row0 + k, tl.zeros_like(k) + b, mask=k < clen)


@attrs.frozen(kw_only=True)
class PrefillChunkMetadataKey(CompileKey):
    """What changes the binary of the indexer prefill chunk metadata."""

    compress_ratio: int
    tile: int
    query_slice_start: IntClass
    query_slice_stop: IntClass
    dcp_rank: IntClass
    dcp_world: IntClass
    dcp_interleave: IntClass
    seq_lens_aligned: bool  # seq_lens[start:end] of the chunk: an offset view
    cu_compressed_aligned: bool  # a row of a packed buffer under PCP+DCP
    num_warps: int


class IndexerPrefillChunkMetadata(TritonKernel[PrefillChunkMetadataKey]):
    """K windows of one prefill chunk's queries for the indexer logits. Request ``b``
    of the chunk, query ``j`` at chunk token ``a = qsl[b] + j`` inside the slice ``[qs0, qs1)``::

        L = (seq_lens[b] - qlen + 1 + j) // CR              # then localized to the DCP rank
        ks[a - qs0] = row_start_cu[b];  ke[a - qs0] = row_start_cu[b] + L
        token_to_seq[cu[b] : cu[b+1]] = b

    The warm space: every rank of the declared DCP world (``DeepseekV32IndexerMetadataBuilder`` passes its rank and
    world; DeepSeek-V4 rejects DCP, so its world is 1), the configured ``serving.cp_kv_cache_interleave_size``,
    every slice-bound class pair with ``start < stop`` (M sub-slices start anywhere) and both alignments of the two
    pointers that may be offset views: 28 keys per ratio and rank class when ``serving.max_num_batched_tokens >= 33``.

    :param compress_ratios: the ratios whose indexers this deployment runs (DeepSeek-V4's C4 indexer: 4;
        Kimi-K3.1's DSA indexer: 1).
    :param dcp_world: the decode-context-parallel world the builder passes (1 = off).
    :param plugin: the registering plugin, named in config errors.
    """

    name = "warmreg.ops.indexer_prefill_chunk_metadata"
    key_type = PrefillChunkMetadataKey
    jit = _indexer_prefill_chunk_metadata_kernel

    def __init__(self, *, compress_ratios: Sequence[int] = (4,), dcp_world: int = 1, plugin: str = "warmreg") -> None:
        self.compress_ratios, self.dcp_world, self.plugin = tuple(compress_ratios), dcp_world, plugin

    def dispatch(
        self,
        *,
        uncompressed_seq_lens: torch.Tensor,
        cu_compressed_seq_lens: torch.Tensor,
        query_slice_start: int,
        query_slice_stop: int,
        compress_ratio: int,
        dcp_rank: int,
        dcp_world: int,
        dcp_interleave: int,
    ) -> PrefillChunkMetadataKey:
        return PrefillChunkMetadataKey(
            compress_ratio=compress_ratio,
            tile=TILE,
            query_slice_start=int_class(query_slice_start),
            query_slice_stop=int_class(query_slice_stop),
            dcp_rank=int_class(dcp_rank),
            dcp_world=int_class(dcp_world),
            dcp_interleave=int_class(dcp_interleave),
            seq_lens_aligned=is_aligned(uncompressed_seq_lens),
            cu_compressed_aligned=is_aligned(cu_compressed_seq_lens),
            num_warps=4,
        )

    def domains(self, config: WarmConfig, platform: Platform) -> Mapping[str, Iterable[Any]]:
        tokens = config.get("serving.max_num_batched_tokens", int, plugin=self.plugin)
        interleave = config.get("serving.cp_kv_cache_interleave_size", int, plugin=self.plugin, default=1)
        return {
            "uncompressed_seq_lens": [meta((1,), _I32, offset=o) for o in (0, 1)],
            "cu_compressed_seq_lens": [meta((2,), _I32, offset=o) for o in (0, 1)],
            "query_slice_start": [v for v in (0, 1, 2, 16, 17) if v < tokens],
            "query_slice_stop": [v for v in (1, 2, 16, 17, 32, 33) if v <= tokens],
            "compress_ratio": self.compress_ratios,
            "dcp_rank": range(self.dcp_world),
            "dcp_world": [self.dcp_world],
            "dcp_interleave": [interleave],
        }

    def when(self, *, query_slice_start: int, query_slice_stop: int, **_: Any) -> bool:
        return query_slice_start < query_slice_stop

    def warmup_inputs(self, key: PrefillChunkMetadataKey) -> Mapping[str, Any]:
        return {
            "query_start_loc": meta((2,), _I32),
            "uncompressed_seq_lens": meta((1,), _I32, offset=0 if key.seq_lens_aligned else 1),
            "cu_compressed_seq_lens": meta((2,), _I32, offset=0 if key.cu_compressed_aligned else 1),
            "num_compressed_rows": 16,
            "query_slice_start": int_rep(key.query_slice_start, LOW_REPS),
            "query_slice_stop": int_rep(key.query_slice_stop, HIGH_REPS),
            "compress_ratio": key.compress_ratio,
            "dcp_rank": int_rep(key.dcp_rank, LOW_REPS),
            "dcp_world": int_rep(key.dcp_world, HIGH_REPS),
            "dcp_interleave": int_class_rep(key.dcp_interleave),
        }

    @kernel_launcher
    def __call__(
        self,
        query_start_loc: torch.Tensor,
        uncompressed_seq_lens: torch.Tensor,
        cu_compressed_seq_lens: torch.Tensor,
        row_start_cu: torch.Tensor | None = None,
        *,
        num_compressed_rows: int,
        query_slice_start: int = 0,
        query_slice_stop: int,
        compress_ratio: int,
        dcp_rank: int = 0,
        dcp_world: int = 1,
        dcp_interleave: int = 1,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> LaunchSpec[PrefillChunkMetadataKey]:
        """Returns int32 ``(token_to_seq [num_compressed_rows], cu_seqlen_ks, cu_seqlen_ke
        [query_slice_stop - query_slice_start])`` (fresh, or ``out``).

        :param query_start_loc: int32 ``[n + 1]``, the chunk's offsets rebased to 0.
        :param uncompressed_seq_lens: int32 ``[n]`` (context plus this step's tokens).
        :param cu_compressed_seq_lens: int32 ``[n + 1]``, start row of each request in the K workspace.
        :param row_start_cu: int32 ``[n]`` base of ``ks``/``ke``; ``None``: ``cu_compressed_seq_lens``.
        :param num_compressed_rows: ``cu_compressed_seq_lens[n]``, known on the host.
        :param dcp_interleave: in compressed rows.
        :param out: the three outputs to write instead of fresh ones: exactly int32 ``[num_compressed_rows]`` and
            twice ``[query_slice_stop - query_slice_start]``, contiguous, 16-byte aligned.
        :raises LaunchError: for wrong dtypes or lengths, an empty or negative slice, bad DCP values, or an
            ``out`` unlike the fresh outputs.
        """
        if row_start_cu is None:
            row_start_cu = cu_compressed_seq_lens
        tensors = dict(query_start_loc=query_start_loc, uncompressed_seq_lens=uncompressed_seq_lens, row_start_cu=row_start_cu)
        check_int32_vector(self.name, **tensors, cu_compressed_seq_lens=cu_compressed_seq_lens)
        n = query_start_loc.shape[0] - 1
        if n < 0 or min(uncompressed_seq_lens.shape[0], row_start_cu.shape[0], cu_compressed_seq_lens.shape[0] - 1) < n:
            raise LaunchError(self.name, "the per-request tensors must cover the chunk's requests")
        if n and not 0 <= query_slice_start < query_slice_stop:
            raise LaunchError(self.name, f"query slice [{query_slice_start}, {query_slice_stop}) is empty")
        if compress_ratio < 1 or dcp_interleave < 1 or not 0 <= dcp_rank < dcp_world or num_compressed_rows < 0:
            raise LaunchError(self.name, f"bad compress_ratio {compress_ratio} or DCP {dcp_rank}/{dcp_world}/{dcp_interleave}")
        key = self.dispatch(
            uncompressed_seq_lens=uncompressed_seq_lens, cu_compressed_seq_lens=cu_compressed_seq_lens,
            query_slice_start=query_slice_start, query_slice_stop=query_slice_stop, compress_ratio=compress_ratio,
            dcp_rank=dcp_rank, dcp_world=dcp_world, dcp_interleave=dcp_interleave,
        )  # fmt: skip
        out_seq, out_ks, out_ke = out_parts(self.name, out, 3)
        rows, device = (max(query_slice_stop - query_slice_start, 0),), query_start_loc.device
        token_to_seq = output(self.name, "out[0]", out_seq, (num_compressed_rows,), _I32, device)
        ks = output(self.name, "out[1]", out_ks, rows, _I32, device)
        ke = output(self.name, "out[2]", out_ke, rows, _I32, device)
        kwargs = dict(
            query_start_loc_ptr=query_start_loc, seq_lens_ptr=uncompressed_seq_lens,
            cu_compressed_ptr=cu_compressed_seq_lens, row_start_cu_ptr=row_start_cu, token_to_seq_ptr=token_to_seq,
            cu_seqlen_ks_ptr=ks, cu_seqlen_ke_ptr=ke, query_slice_start=query_slice_start,
            query_slice_stop=query_slice_stop, dcp_rank=dcp_rank, dcp_world=dcp_world, dcp_interleave=dcp_interleave,
            COMPRESS_RATIO=key.compress_ratio, TILE=key.tile,
        )  # fmt: skip
        return LaunchSpec(key, (n,) if n else None, kwargs, (token_to_seq, ks, ke))


def indexer_prefill_chunk_metadata_reference(
    query_start_loc: torch.Tensor,
    uncompressed_seq_lens: torch.Tensor,
    cu_compressed_seq_lens: torch.Tensor,
    row_start_cu: torch.Tensor | None = None,
    *,
    num_compressed_rows: int,
    query_slice_start: int = 0,
    query_slice_stop: int,
    compress_ratio: int,
    dcp_rank: int = 0,
    dcp_world: int = 1,
    dcp_interleave: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`IndexerPrefillChunkMetadata` (rows no request covers stay 0)."""
    rs = (cu_compressed_seq_lens if row_start_cu is None else row_start_cu).tolist()
    qsl, cu, seq = query_start_loc.tolist(), cu_compressed_seq_lens.tolist(), uncompressed_seq_lens.tolist()
    token_to_seq = torch.zeros(num_compressed_rows, dtype=_I32)
    ks = torch.zeros(query_slice_stop - query_slice_start, dtype=_I32)
    ke = torch.zeros_like(ks)
    i, w = dcp_interleave, dcp_world
    for b in range(len(qsl) - 1):
        qlen = qsl[b + 1] - qsl[b]
        for j in range(qlen):
            a = qsl[b] + j
            if query_slice_start <= a < query_slice_stop:
                rows = (seq[b] - qlen + 1 + j) // compress_ratio
                if w > 1:
                    base = (rows // i // w) * i
                    rows = base + min(max(rows - base * w - dcp_rank * i, 0), i)
                ks[a - query_slice_start], ke[a - query_slice_start] = rs[b], rs[b] + rows
        token_to_seq[cu[b] : cu[b + 1]] = b
    return token_to_seq, ks, ke
