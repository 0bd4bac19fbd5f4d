"""Indexer prefill chunk metadata: K windows of the C4 indexer's prefill logits (vLLM 0.33
``v1/attention/backends/mla/indexer.py``: ``BuildPrefillChunkMetadataKernel``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_vector, out_parts
from ._metadata_common import HIGH_REPS, LOW_REPS, TILE, int_rep
from ._serving import serving_int
from ._v41 import index_ratios
from .model import DSV4

__all__ = [
    "IndexerPrefillChunkMetadata",
    "PrefillChunkMetadataKey",
    "indexer_prefill_chunk_metadata_reference",
    "register",
]

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
class PrefillChunkMetadataKey(warmreg.CompileKey):
    """What changes the binary of the indexer prefill chunk metadata."""

    compress_ratio: int
    tile: int
    query_slice_start: warmreg.IntClass
    query_slice_stop: warmreg.IntClass
    dcp_rank: warmreg.IntClass
    dcp_world: warmreg.IntClass
    dcp_interleave: warmreg.IntClass
    seq_lens_aligned: bool  # seq_lens[start:end] of the chunk: an offset view
    cu_compressed_aligned: bool  # a row of a packed buffer under PCP+DCP
    num_warps: int


class IndexerPrefillChunkMetadata(warmreg.TritonKernel[PrefillChunkMetadataKey]):
    """K windows of one prefill chunk's queries for the indexer logits. Request ``b``
    of the chunk, query ``j`` at chunk token ``a = qsl[b] + j`` inside the slice ``[qs0, qs1)``::

        L = (seq_lens[b] - qlen + 1 + j) // CR              # then localized to the DCP rank
        ks[a - qs0] = row_start_cu[b];  ke[a - qs0] = row_start_cu[b] + L
        token_to_seq[cu[b] : cu[b+1]] = b

    DSv4 launches it for the C4 indexer only (CR = 4; the C128 and SWA-only layers own no indexer),
    without DCP (its builder rejects DCP), so only CR = 4, rank 0 / world 1 keys are registered.
    The slice bounds take every class pair with ``start < stop`` (M sub-slices start anywhere), and
    both pointers that may be offset views take both alignments: 28 keys when
    ``max_num_batched_tokens >= 33``.

    :param compress_ratios: the ratios whose indexers this deployment runs.
    """

    name = "deepseek_v4.indexer_prefill_chunk_metadata"
    key_type = PrefillChunkMetadataKey
    jit = _indexer_prefill_chunk_metadata_kernel

    def __init__(self, *, compress_ratios: Sequence[int] = (4,)) -> None:
        self.compress_ratios = tuple(compress_ratios)

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
            query_slice_start=warmreg.int_class(query_slice_start),
            query_slice_stop=warmreg.int_class(query_slice_stop),
            dcp_rank=warmreg.int_class(dcp_rank),
            dcp_world=warmreg.int_class(dcp_world),
            dcp_interleave=warmreg.int_class(dcp_interleave),
            seq_lens_aligned=warmreg.is_aligned(uncompressed_seq_lens),
            cu_compressed_aligned=warmreg.is_aligned(cu_compressed_seq_lens),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = serving_int(config, "max_num_batched_tokens")
        return {
            "uncompressed_seq_lens": [warmreg.meta((1,), _I32, offset=o) for o in (0, 1)],
            "cu_compressed_seq_lens": [warmreg.meta((2,), _I32, offset=o) for o in (0, 1)],
            "query_slice_start": [v for v in (0, 1, 2, 16, 17) if v < tokens],
            "query_slice_stop": [v for v in (1, 2, 16, 17, 32, 33) if v <= tokens],
            "compress_ratio": self.compress_ratios,
            "dcp_rank": [0],
            "dcp_world": [1],
            "dcp_interleave": [serving_int(config, "cp_kv_cache_interleave_size", 1)],
        }

    def when(self, *, query_slice_start: int, query_slice_stop: int, **_: Any) -> bool:
        return query_slice_start < query_slice_stop

    def warmup_inputs(self, key: PrefillChunkMetadataKey) -> Mapping[str, Any]:
        return {
            "query_start_loc": warmreg.meta((2,), _I32),
            "uncompressed_seq_lens": warmreg.meta((1,), _I32, offset=0 if key.seq_lens_aligned else 1),
            "cu_compressed_seq_lens": warmreg.meta((2,), _I32, offset=0 if key.cu_compressed_aligned else 1),
            "num_compressed_rows": 16,
            "query_slice_start": int_rep(key.query_slice_start, LOW_REPS),
            "query_slice_stop": int_rep(key.query_slice_stop, HIGH_REPS),
            "compress_ratio": key.compress_ratio,
            "dcp_rank": int_rep(key.dcp_rank, LOW_REPS),
            "dcp_world": int_rep(key.dcp_world, HIGH_REPS),
            "dcp_interleave": warmreg.int_class_rep(key.dcp_interleave),
        }

    @warmreg.kernel_launcher
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
    ) -> warmreg.LaunchSpec[PrefillChunkMetadataKey]:
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
        tensors = dict(query_start_loc=query_start_loc, uncompressed_seq_lens=uncompressed_seq_lens)
        check_int32_vector(self.name, **tensors, cu_compressed_seq_lens=cu_compressed_seq_lens, row_start_cu=row_start_cu)
        n = query_start_loc.shape[0] - 1
        if n < 0 or min(uncompressed_seq_lens.shape[0], row_start_cu.shape[0], cu_compressed_seq_lens.shape[0] - 1) < n:
            raise warmreg.LaunchError(self.name, "the per-request tensors must cover the chunk's requests")
        if n and not 0 <= query_slice_start < query_slice_stop:
            raise warmreg.LaunchError(self.name, f"query slice [{query_slice_start}, {query_slice_stop}) is empty")
        if compress_ratio < 1 or dcp_interleave < 1 or not 0 <= dcp_rank < dcp_world or num_compressed_rows < 0:
            raise warmreg.LaunchError(
                self.name, f"bad compress_ratio {compress_ratio} or DCP {dcp_rank}/{dcp_world}/{dcp_interleave}"
            )
        key = self.dispatch(
            uncompressed_seq_lens=uncompressed_seq_lens, cu_compressed_seq_lens=cu_compressed_seq_lens,
            query_slice_start=query_slice_start, query_slice_stop=query_slice_stop, compress_ratio=compress_ratio,
            dcp_rank=dcp_rank, dcp_world=dcp_world, dcp_interleave=dcp_interleave,
        )  # fmt: skip
        out_seq, out_ks, out_ke = out_parts(self.name, out, 3)
        rows, device = (max(query_slice_stop - query_slice_start, 0),), query_start_loc.device
        token_to_seq = warmreg.output(self.name, "out[0]", out_seq, (num_compressed_rows,), _I32, device)
        ks = warmreg.output(self.name, "out[1]", out_ks, rows, _I32, device)
        ke = warmreg.output(self.name, "out[2]", out_ke, rows, _I32, device)
        kwargs = dict(
            query_start_loc_ptr=query_start_loc, seq_lens_ptr=uncompressed_seq_lens,
            cu_compressed_ptr=cu_compressed_seq_lens, row_start_cu_ptr=row_start_cu, token_to_seq_ptr=token_to_seq,
            cu_seqlen_ks_ptr=ks, cu_seqlen_ke_ptr=ke, query_slice_start=query_slice_start,
            query_slice_stop=query_slice_stop, dcp_rank=dcp_rank, dcp_world=dcp_world, dcp_interleave=dcp_interleave,
            COMPRESS_RATIO=key.compress_ratio, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n,) if n else None, kwargs, (token_to_seq, ks, ke))


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


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the C4 indexer's prefill chunk metadata when the model has C4 layers (every platform).

    DeepSeek-V4.1 (CUDA): its indexer backends' builder is V4's (``DeepseekV32IndexerMetadataBuilder``), which calls
    ``build_prefill_chunk_metadata`` with its cache's ratio (``tokens_per_state``): each index-source ratio.
    """
    if model.v41:
        ratios = index_ratios(model)
        registry.add(IndexerPrefillChunkMetadata(compress_ratios=ratios), when=warmreg.is_cuda if ratios else False)
        return
    registry.add(IndexerPrefillChunkMetadata(compress_ratios=(4,)), when=model.has_c4)
