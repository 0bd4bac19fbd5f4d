"""DeepSeek-V4 attention metadata kernels: index arithmetic run once per step (specs sections 12, 17-20).

- :class:`SparseSWAPrefillMetadata` (section 12): rows each prefill gathers for sparse-SWA attention.
- :class:`IndexerPrefillChunkMetadata` (section 17): K windows of the C4 indexer's prefill logits.
- :class:`PrepareUniformDecode` (section 18): flattens a uniform multi-token decode into 1-token rows.
- :class:`CompressedSlotMapping` (sections 2, 20): cache slots of the compressed (C4/C128) states.

:func:`register` also declares the shared block-table slot mapping (section 19) once per DSv4
KV-cache group. Every output is integer metadata, so tests compare with ``torch.equal``.

Pointers that are not key fields are excluded from Triton's 16-byte alignment specialization
(``do_not_specialize_on_alignment``): these kernels move a few integers per row and gain nothing from
vector loads, and then no caller's view can produce an unwarmed binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg
from warmreg.ops import BlockTableSlotMapping, block_table_width

from .model import DSV4, PLUGIN, SPARSE_BLOCK_SIZE, SWA_PAGE_SIZE

__all__ = [
    "C4_STATE_BLOCK_SIZE",
    "C128_STATE_BLOCK_SIZE",
    "CompressedSlotMapping",
    "CompressedSlotMappingKey",
    "IndexerPrefillChunkMetadata",
    "PrefillChunkMetadataKey",
    "PrepareUniformDecode",
    "SWAPrefillMetadataKey",
    "SparseSWAPrefillMetadata",
    "UniformDecodeKey",
    "compressed_slot_mapping_reference",
    "indexer_prefill_chunk_metadata_reference",
    "prepare_uniform_decode_reference",
    "register",
    "sparse_swa_prefill_metadata_reference",
]

#: Block sizes of the compressor-state KV-cache groups (specs section 2: page_bs 4 for C4, 8 for C128).
C4_STATE_BLOCK_SIZE = 4
C128_STATE_BLOCK_SIZE = 8
_TILE = 1024  # rows per loop iteration (sections 17-20)
_I32 = torch.int32


def _check_int32(kernel: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != _I32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                kernel, f"{name} must be a contiguous 1-D int32 tensor (got {t.dtype} {tuple(t.shape)})"
            )


def _check_table(kernel: str, name: str, table: torch.Tensor, rows: int) -> None:
    if table.ndim != 2 or table.dtype != _I32 or (table.shape[1] > 1 and table.stride(1) != 1) or table.shape[0] < rows:
        raise warmreg.LaunchError(
            kernel, f"{name} must be int32 [>= {rows}, W] with contiguous rows (got {tuple(table.shape)})"
        )


def _serving(config: warmreg.WarmConfig, field: str, default: int | None = None) -> int:
    if default is None:
        return config.get(f"serving.{field}", int, plugin=PLUGIN)
    return config.get(f"serving.{field}", int, plugin=PLUGIN, default=default)


# -- section 12: sparse-SWA prefill metadata ------------------------------------------------------


@triton.jit(
    do_not_specialize=["num_decodes", "num_prefills", "window_size"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "query_start_loc_ptr", "replay_start_ptr", "gather_lens_ptr"],
)
def _sparse_swa_prefill_metadata_kernel(
    seq_lens_ptr,
    query_start_loc_ptr,
    replay_start_ptr,
    gather_lens_ptr,
    num_decodes,
    num_prefills,
    window_size,
    BLOCK_SIZE: tl.constexpr,  # next_pow2(num_prefills): one program covers every prefill
):
    offs = tl.arange(0, BLOCK_SIZE)
    req = num_decodes + tl.minimum(offs, num_prefills - 1)  # clamped, not masked (SM12x workaround)
    qlen = tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req)
    prefix = tl.load(seq_lens_ptr + req) - qlen
    visible = tl.maximum(prefix - tl.load(replay_start_ptr + req), 0)
    tl.store(gather_lens_ptr + offs, qlen + tl.minimum(visible, window_size - 1), mask=offs < num_prefills)


@attrs.frozen(kw_only=True)
class SWAPrefillMetadataKey(warmreg.CompileKey):
    """What changes the binary of the sparse-SWA prefill metadata."""

    block_size: int  # next_pow2(num_prefills)
    num_warps: int


class SparseSWAPrefillMetadata(warmreg.TritonKernel[SWAPrefillMetadataKey]):
    """``gather_lens`` of the prefills of a decode-first batch (section 12). For prefill ``i``,
    request ``r = num_decodes + i``::

        qlen = qsl[r+1] - qsl[r];  prefix = seq_lens[r] - qlen
        gather_lens[i] = qlen + min(max(prefix - replay_start[r], 0), window_size - 1)

    Warm space: one binary per power of two up to ``min(max_num_seqs, max_num_batched_tokens)``.
    """

    name = "deepseek_v4.sparse_swa_prefill_metadata"
    key_type = SWAPrefillMetadataKey
    jit = _sparse_swa_prefill_metadata_kernel

    def dispatch(self, *, num_prefills: int) -> SWAPrefillMetadataKey:
        return SWAPrefillMetadataKey(block_size=warmreg.next_pow2(num_prefills), num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        top = min(_serving(config, "max_num_seqs"), _serving(config, "max_num_batched_tokens"))
        return {"num_prefills": range(1, top + 1)}

    def warmup_inputs(self, key: SWAPrefillMetadataKey) -> Mapping[str, Any]:
        n = key.block_size
        return {
            "seq_lens": warmreg.meta((n,), _I32),
            "query_start_loc": warmreg.meta((n + 1,), _I32),
            "replay_start": warmreg.meta((n,), _I32),
            "num_decodes": 0,
            "num_prefills": n,
            "window_size": 128,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        replay_start: torch.Tensor | None = None,
        *,
        num_decodes: int,
        num_prefills: int,
        window_size: int,
    ) -> warmreg.LaunchSpec[SWAPrefillMetadataKey]:
        """Returns ``gather_lens``, int32 ``[num_prefills]``.

        :param seq_lens: int32 ``[>= num_reqs]``, context plus this step's tokens.
        :param query_start_loc: int32 ``[>= num_reqs + 1]``.
        :param replay_start: int32 ``[>= num_reqs]`` first position SWA may replay, or ``None`` (zeros).
        :raises LaunchError: for wrong dtypes or tensors shorter than ``num_decodes + num_prefills``.
        """
        num_reqs = num_decodes + num_prefills
        if replay_start is None:
            replay_start = seq_lens.new_zeros(num_reqs)
        _check_int32(self.name, seq_lens=seq_lens, query_start_loc=query_start_loc, replay_start=replay_start)
        if min(num_decodes, num_prefills) < 0 or window_size < 1:
            raise warmreg.LaunchError(self.name, f"bad counts {num_decodes}/{num_prefills} or window {window_size}")
        if min(seq_lens.shape[0], replay_start.shape[0], query_start_loc.shape[0] - 1) < num_reqs:
            raise warmreg.LaunchError(
                self.name, f"seq_lens, replay_start or query_start_loc hold fewer than {num_reqs} requests"
            )
        key = self.dispatch(num_prefills=num_prefills)
        gather_lens = seq_lens.new_empty(num_prefills)
        kwargs = dict(
            seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc, replay_start_ptr=replay_start,
            gather_lens_ptr=gather_lens, num_decodes=num_decodes, num_prefills=num_prefills,
            window_size=window_size, BLOCK_SIZE=key.block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,) if num_prefills else None, kwargs, gather_lens)


def sparse_swa_prefill_metadata_reference(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    replay_start: torch.Tensor | None,
    *,
    num_decodes: int,
    num_prefills: int,
    window_size: int,
) -> torch.Tensor:
    """PyTorch reference of :class:`SparseSWAPrefillMetadata`."""
    reqs = slice(num_decodes, num_decodes + num_prefills)
    qlen = query_start_loc[num_decodes + 1 : num_decodes + num_prefills + 1] - query_start_loc[reqs]
    replay = torch.zeros_like(qlen) if replay_start is None else replay_start[reqs]
    visible = (seq_lens[reqs] - qlen - replay).clamp(min=0)
    return (qlen + visible.clamp(max=window_size - 1)).to(_I32)


# -- section 17: indexer prefill chunk metadata ---------------------------------------------------


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


#: Representatives of the integer classes that keep ``0 <= start < stop`` and ``rank < world``.
_LOW = {"div16": 0, "one": 1, "other": 3}
_HIGH = {"one": 1, "other": 17, "div16": 32}


def _rep(cls: warmreg.IntClass, table: Mapping[str, int]) -> int:
    return table.get(cls, warmreg.int_class_rep(cls))


class IndexerPrefillChunkMetadata(warmreg.TritonKernel[PrefillChunkMetadataKey]):
    """K windows of one prefill chunk's queries for the indexer logits (section 17). Request ``b``
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
            tile=_TILE,
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
        tokens = _serving(config, "max_num_batched_tokens")
        return {
            "uncompressed_seq_lens": [warmreg.meta((1,), _I32, offset=o) for o in (0, 1)],
            "cu_compressed_seq_lens": [warmreg.meta((2,), _I32, offset=o) for o in (0, 1)],
            "query_slice_start": [v for v in (0, 1, 2, 16, 17) if v < tokens],
            "query_slice_stop": [v for v in (1, 2, 16, 17, 32, 33) if v <= tokens],
            "compress_ratio": self.compress_ratios,
            "dcp_rank": [0],
            "dcp_world": [1],
            "dcp_interleave": [_serving(config, "cp_kv_cache_interleave_size", 1)],
        }

    def when(self, *, query_slice_start: int, query_slice_stop: int, **_: Any) -> bool:
        return query_slice_start < query_slice_stop

    def warmup_inputs(self, key: PrefillChunkMetadataKey) -> Mapping[str, Any]:
        return {
            "query_start_loc": warmreg.meta((2,), _I32),
            "uncompressed_seq_lens": warmreg.meta((1,), _I32, offset=0 if key.seq_lens_aligned else 1),
            "cu_compressed_seq_lens": warmreg.meta((2,), _I32, offset=0 if key.cu_compressed_aligned else 1),
            "num_compressed_rows": 16,
            "query_slice_start": _rep(key.query_slice_start, _LOW),
            "query_slice_stop": _rep(key.query_slice_stop, _HIGH),
            "compress_ratio": key.compress_ratio,
            "dcp_rank": _rep(key.dcp_rank, _LOW),
            "dcp_world": _rep(key.dcp_world, _HIGH),
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
    ) -> warmreg.LaunchSpec[PrefillChunkMetadataKey]:
        """Returns fresh int32 ``(token_to_seq [num_compressed_rows], cu_seqlen_ks, cu_seqlen_ke
        [query_slice_stop - query_slice_start])``.

        :param query_start_loc: int32 ``[n + 1]``, the chunk's offsets rebased to 0.
        :param uncompressed_seq_lens: int32 ``[n]`` (context plus this step's tokens).
        :param cu_compressed_seq_lens: int32 ``[n + 1]``, start row of each request in the K workspace.
        :param row_start_cu: int32 ``[n]`` base of ``ks``/``ke``; ``None``: ``cu_compressed_seq_lens``.
        :param num_compressed_rows: ``cu_compressed_seq_lens[n]``, known on the host.
        :param dcp_interleave: in compressed rows.
        :raises LaunchError: for wrong dtypes or lengths, an empty or negative slice, or bad DCP values.
        """
        if row_start_cu is None:
            row_start_cu = cu_compressed_seq_lens
        tensors = dict(query_start_loc=query_start_loc, uncompressed_seq_lens=uncompressed_seq_lens)
        _check_int32(self.name, **tensors, cu_compressed_seq_lens=cu_compressed_seq_lens, row_start_cu=row_start_cu)
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
        token_to_seq = query_start_loc.new_empty(num_compressed_rows)
        ks = query_start_loc.new_empty(max(query_slice_stop - query_slice_start, 0))
        ke = torch.empty_like(ks)
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


# -- section 18: uniform decode flattening --------------------------------------------------------


@triton.jit(
    do_not_specialize_on_alignment=[
        "seq_lens_ptr", "block_table_ptr", "decode_seq_lens_ptr", "expanded_block_table_ptr", "decode_lens_ptr"
    ]
)  # fmt: skip
def _prepare_uniform_decode_kernel(
    seq_lens_ptr,
    block_table_ptr,
    decode_seq_lens_ptr,
    expanded_block_table_ptr,
    decode_lens_ptr,
    block_table_stride,
    expanded_bt_stride,
    max_decode_len,
    TILE: tl.constexpr,  # table columns per loop iteration
):
    i = tl.program_id(0)
    req = i // max_decode_len
    j = i % max_decode_len
    seq_len = tl.load(seq_lens_ptr + req)
    tl.store(decode_seq_lens_ptr + i, tl.maximum(seq_len - max_decode_len + j + 1, 0))
    src = block_table_ptr + req.to(tl.int64) * block_table_stride
    dst = expanded_block_table_ptr + i.to(tl.int64) * expanded_bt_stride
    for c0 in range(0, expanded_bt_stride, TILE):
        c = c0 + tl.arange(0, TILE)
        tl.store(dst + c, tl.load(src + c, mask=c < expanded_bt_stride), mask=c < expanded_bt_stride)
    tl.store(decode_lens_ptr + i, 1)


@attrs.frozen(kw_only=True)
class UniformDecodeKey(warmreg.CompileKey):
    """What changes the binary of the uniform decode flattening."""

    tile: int
    block_table_stride: warmreg.IntClass
    expanded_bt_stride: warmreg.IntClass
    max_decode_len: warmreg.IntClass
    num_warps: int


class PrepareUniformDecode(warmreg.TritonKernel[UniformDecodeKey]):
    """Flattens a uniform decode batch (every request has ``D`` tokens) into one row per token for
    the indexer's decode logits (section 18). Token ``i`` of request ``r = i // D``, ``j = i % D``::

        decode_seq_lens[i] = max(seq_lens[r] - D + j + 1, 0)
        expanded_block_table[i, :EW] = block_table[r, :EW];  decode_lens[i] = 1

    ``EW`` is the expanded table's row width. DSv4 warm space: both strides are the indexer group's
    table width (``block_table_width(max_model_len, 256)``), and ``D`` ranges over
    ``1 .. 1 + num_speculative_tokens`` (a decode request carries 1 to 1 + k tokens; ``D = 1``
    happens in a step where no request has drafts). Only that class, not the full {1, 2, 16}^3 set.
    """

    name = "deepseek_v4.prepare_uniform_decode"
    key_type = UniformDecodeKey
    jit = _prepare_uniform_decode_kernel

    def __init__(self, *, cache_block_size: int = SPARSE_BLOCK_SIZE) -> None:
        self.cache_block_size = cache_block_size

    def dispatch(
        self, *, block_table: torch.Tensor, expanded_block_table: torch.Tensor, max_decode_len: int
    ) -> UniformDecodeKey:
        return UniformDecodeKey(
            tile=_TILE,
            block_table_stride=warmreg.int_class(block_table.stride(0)),
            expanded_bt_stride=warmreg.int_class(expanded_block_table.stride(0)),
            max_decode_len=warmreg.int_class(max_decode_len),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        width = block_table_width(_serving(config, "max_model_len"), self.cache_block_size)
        return {
            "block_table": [warmreg.meta((1, width), _I32)],
            "expanded_block_table": [warmreg.meta((1, width), _I32)],
            "max_decode_len": range(1, _serving(config, "num_speculative_tokens", 0) + 2),
        }

    def warmup_inputs(self, key: UniformDecodeKey) -> Mapping[str, Any]:
        width = warmreg.int_class_rep(key.expanded_bt_stride)
        return {
            "seq_lens": warmreg.meta((2,), _I32),
            "block_table": warmreg.meta((2, width), _I32, stride=(warmreg.int_class_rep(key.block_table_stride), 1)),
            "expanded_block_table": warmreg.meta((64, width), _I32),
            "max_decode_len": warmreg.int_class_rep(key.max_decode_len),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        max_decode_len: int,
        decode_seq_lens: torch.Tensor | None = None,
        expanded_block_table: torch.Tensor | None = None,
        decode_lens: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[UniformDecodeKey]:
        """Fill rows ``[0, num_decodes * D)`` of the outputs; returns ``(decode_seq_lens,
        expanded_block_table, decode_lens)`` (the given persistent buffers, or fresh ones of that many rows).

        :param seq_lens: int32 ``[num_decodes]``.
        :param block_table: int32 ``[>= num_decodes, >= EW]`` with contiguous rows.
        :param max_decode_len: ``D``, the tokens of every decode request.
        :raises LaunchError: for wrong dtypes, short buffers, or an expanded table narrower rows than its stride.
        """
        _check_int32(self.name, seq_lens=seq_lens)
        num_decodes = seq_lens.shape[0]
        _check_table(self.name, "block_table", block_table, num_decodes)
        if max_decode_len < 1:
            raise warmreg.LaunchError(self.name, f"max_decode_len must be >= 1 (got {max_decode_len})")
        num_tokens = num_decodes * max_decode_len
        if expanded_block_table is None:
            expanded_block_table = block_table.new_empty((num_tokens, block_table.shape[1]))
        decode_seq_lens = seq_lens.new_empty(num_tokens) if decode_seq_lens is None else decode_seq_lens
        decode_lens = seq_lens.new_empty(num_tokens) if decode_lens is None else decode_lens
        _check_int32(self.name, decode_seq_lens=decode_seq_lens, decode_lens=decode_lens)
        _check_table(self.name, "expanded_block_table", expanded_block_table, num_tokens)
        width = expanded_block_table.shape[1]
        if expanded_block_table.stride(0) != width or block_table.shape[1] < width:
            raise warmreg.LaunchError(
                self.name, "expanded_block_table must be row-contiguous and no wider than block_table"
            )
        if min(decode_seq_lens.shape[0], decode_lens.shape[0]) < num_tokens:
            raise warmreg.LaunchError(self.name, f"decode_seq_lens and decode_lens need {num_tokens} rows")
        key = self.dispatch(
            block_table=block_table, expanded_block_table=expanded_block_table, max_decode_len=max_decode_len
        )
        kwargs = dict(
            seq_lens_ptr=seq_lens, block_table_ptr=block_table, decode_seq_lens_ptr=decode_seq_lens,
            expanded_block_table_ptr=expanded_block_table, decode_lens_ptr=decode_lens,
            block_table_stride=block_table.stride(0), expanded_bt_stride=expanded_block_table.stride(0),
            max_decode_len=max_decode_len, TILE=key.tile,
        )  # fmt: skip
        outputs = (decode_seq_lens, expanded_block_table, decode_lens)
        return warmreg.LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, outputs)


def prepare_uniform_decode_reference(
    seq_lens: torch.Tensor, block_table: torch.Tensor, *, max_decode_len: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`PrepareUniformDecode` (``width``: EW, default the table's)."""
    d = max_decode_len
    j = torch.arange(seq_lens.shape[0] * d) % d
    seq = seq_lens.repeat_interleave(d)
    table = block_table[: seq_lens.shape[0], : block_table.shape[1] if width is None else width]
    decode_seq_lens = (seq - d + j + 1).clamp(min=0).to(_I32)
    return decode_seq_lens, table.repeat_interleave(d, dim=0), torch.ones_like(decode_seq_lens)


# -- sections 2 and 20: compressed slot mapping ---------------------------------------------------


@triton.jit(
    do_not_specialize=["block_table_stride"],
    do_not_specialize_on_alignment=[
        "out_ptr",
        "slot_mapping_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "block_table_ptr",
    ],
)
def _compressed_slot_mapping_kernel(
    out_ptr,
    slot_mapping_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    dcp_world_size,
    cp_interleave,
    COMPRESS_RATIO: tl.constexpr,  # positions per compressed state
    TILE: tl.constexpr,  # tokens per loop iteration
):
    b = tl.program_id(0)
    first = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - first
    context = tl.load(seq_lens_ptr + b) - qlen
    row = block_table_ptr + b.to(tl.int64) * block_table_stride
    for j0 in range(0, qlen, TILE):
        j = j0 + tl.arange(0, TILE)
        mask = j < qlen
        tok = first + j
        pos = context + j
        own = tl.load(slot_mapping_ptr + tok, mask=mask, other=-1)
        valid = mask & ((pos + 1) % COMPRESS_RATIO == 0) & (own != -1)
        local = (pos // (cp_interleave * dcp_world_size)) * cp_interleave + pos % cp_interleave
        state = local // COMPRESS_RATIO
        block = tl.load(row + state // block_size, mask=valid, other=0).to(tl.int64)
        tl.store(out_ptr + tok, tl.where(valid, block * block_size + state % block_size, -1), mask=mask)


@attrs.frozen(kw_only=True)
class CompressedSlotMappingKey(warmreg.CompileKey):
    """What changes the binary of the compressed slot mapping."""

    compress_ratio: int
    tile: int
    block_size: warmreg.IntClass  # compressed states per block (256 // ratio)
    dcp_world_size: warmreg.IntClass
    cp_interleave: warmreg.IntClass
    num_warps: int


def _multiple_in_class(step: int, cls: warmreg.IntClass) -> int:
    """The smallest positive multiple of ``step`` in an integer class (or the class's representative)."""
    return next(
        (v for v in range(step, 64 * step + 1, step) if warmreg.int_class(v) == cls), warmreg.int_class_rep(cls)
    )


class CompressedSlotMapping(warmreg.TritonKernel[CompressedSlotMappingKey]):
    """Cache slots of compressed states (sections 2, 20). Token ``t = qsl[b] + j`` at position
    ``p = seq_lens[b] - qlen + j`` writes state ``k`` only when it closes it::

        lp = (p // (I * Wd)) * I + p % I;  k = lp // CR          # rank-local; lp = p when Wd == 1
        out[t] = bt[b, k // bs] * bs + k % bs  if (p + 1) % CR == 0 and slot_mapping[t] != -1  else -1

    The launcher first fills the whole ``out`` buffer with -1.

    :param compress_ratios: the ratios this call site serves.
    :param dcp_world_size: the DCP world this call site passes.
    :param cp_interleave: the (uncompressed) interleave this call site passes.
    :param cache_block_size: the compressed caches' KV-manager block size; ``block_size = it // ratio``.
    """

    name = "deepseek_v4.compressed_slot_mapping"
    key_type = CompressedSlotMappingKey
    jit = _compressed_slot_mapping_kernel

    def __init__(
        self,
        *,
        compress_ratios: Sequence[int],
        dcp_world_size: int = 1,
        cp_interleave: int = 1,
        cache_block_size: int = SPARSE_BLOCK_SIZE,
    ) -> None:
        self.compress_ratios = tuple(compress_ratios)
        self.dcp_world_size, self.cp_interleave, self.cache_block_size = dcp_world_size, cp_interleave, cache_block_size

    def dispatch(
        self, *, compress_ratio: int, block_size: int, dcp_world_size: int, cp_interleave: int
    ) -> CompressedSlotMappingKey:
        return CompressedSlotMappingKey(
            compress_ratio=compress_ratio,
            tile=_TILE,
            block_size=warmreg.int_class(block_size),
            dcp_world_size=warmreg.int_class(dcp_world_size),
            cp_interleave=warmreg.int_class(cp_interleave),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "compress_ratio": self.compress_ratios,
            "block_size": sorted({self.cache_block_size // r for r in self.compress_ratios}),
            "dcp_world_size": [self.dcp_world_size],
            "cp_interleave": [self.cp_interleave],
        }

    def when(self, *, compress_ratio: int, block_size: int, **_: Any) -> bool:
        return block_size == self.cache_block_size // compress_ratio

    def warmup_inputs(self, key: CompressedSlotMappingKey) -> Mapping[str, Any]:
        world = _rep(key.dcp_world_size, _HIGH)
        interleave = warmreg.int_class_rep(key.cp_interleave)
        return {
            "slot_mapping": warmreg.meta((16,), torch.int64),
            "query_start_loc": warmreg.meta((2,), _I32),
            "seq_lens": warmreg.meta((1,), _I32),
            "block_table": warmreg.meta((1, 4), _I32),
            "num_tokens": 16,
            "block_size": warmreg.int_class_rep(key.block_size),
            "compress_ratio": key.compress_ratio,
            "dcp_world_size": world,
            "cp_interleave": interleave if world == 1 else _multiple_in_class(key.compress_ratio, key.cp_interleave),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        num_tokens: int,
        block_size: int,
        compress_ratio: int,
        dcp_world_size: int = 1,
        cp_interleave: int = 1,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[CompressedSlotMappingKey]:
        """Returns ``out[:num_tokens]`` (int64); the rest of a persistent ``out`` is set to -1.

        :param slot_mapping: int64 ``[>= num_tokens]``, the group's uncompressed slots (PAD flags).
        :param query_start_loc: int32 ``[R + 1]``; ``seq_lens``: int32 ``[R]``.
        :param block_table: int32 ``[R, W]`` of the compressed group; ``R`` is the grid.
        :param block_size: compressed states per block (``256 // compress_ratio`` for DSv4).
        :param out: persistent int64 buffer ``[>= num_tokens]``, or ``None`` for a fresh one.
        :raises LaunchError: for wrong dtypes or lengths, or a DCP interleave not a multiple of the ratio.
        """
        rows = block_table.shape[0] if block_table.ndim == 2 else 0
        _check_table(self.name, "block_table", block_table, rows)
        _check_int32(self.name, query_start_loc=query_start_loc, seq_lens=seq_lens)
        if query_start_loc.shape[0] < rows + 1 or seq_lens.shape[0] < rows:
            raise warmreg.LaunchError(self.name, f"query_start_loc and seq_lens must cover the table's {rows} rows")
        if slot_mapping.dtype != torch.int64 or slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
            raise warmreg.LaunchError(self.name, f"slot_mapping must be int64 [>= {num_tokens}]")
        if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
            raise warmreg.LaunchError(self.name, "slot_mapping must be contiguous")
        if min(block_size, compress_ratio, dcp_world_size, cp_interleave) < 1:
            raise warmreg.LaunchError(
                self.name, "block_size, compress_ratio, dcp_world_size and cp_interleave must be >= 1"
            )
        if dcp_world_size > 1 and cp_interleave % compress_ratio:
            raise warmreg.LaunchError(
                self.name, f"under DCP the interleave {cp_interleave} must be a multiple of {compress_ratio}"
            )
        if out is None:
            out = torch.empty(num_tokens, dtype=torch.int64, device=slot_mapping.device)
        if (
            out.dtype != torch.int64
            or out.ndim != 1
            or out.shape[0] < num_tokens
            or (out.shape[0] > 1 and out.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"out must be a contiguous int64 buffer of >= {num_tokens} slots")
        out.fill_(-1)
        key = self.dispatch(
            compress_ratio=compress_ratio,
            block_size=block_size,
            dcp_world_size=dcp_world_size,
            cp_interleave=cp_interleave,
        )
        kwargs = dict(
            out_ptr=out, slot_mapping_ptr=slot_mapping, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
            block_table_ptr=block_table, block_table_stride=block_table.stride(0), block_size=block_size,
            dcp_world_size=dcp_world_size, cp_interleave=cp_interleave, COMPRESS_RATIO=key.compress_ratio, TILE=key.tile,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,) if rows else None, kwargs, out[:num_tokens])


def compressed_slot_mapping_reference(
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    compress_ratio: int,
    dcp_world_size: int = 1,
    cp_interleave: int = 1,
) -> torch.Tensor:
    """PyTorch reference of :class:`CompressedSlotMapping`."""
    out = torch.full((num_tokens,), -1, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        qlen = qsl[b + 1] - qsl[b]
        tok = torch.arange(qsl[b], qsl[b + 1])
        pos = int(seq_lens[b]) - qlen + torch.arange(qlen)
        valid = ((pos + 1) % compress_ratio == 0) & (slot_mapping[tok] != -1)
        local = (pos // (cp_interleave * dcp_world_size)) * cp_interleave + pos % cp_interleave
        state = local[valid] // compress_ratio
        out[tok[valid]] = block_table[b].long()[state // block_size] * block_size + state % block_size
    return out


# -- registration ---------------------------------------------------------------------------------


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Declare the metadata kernels of a DeepSeek-V4 deployment and the shared slot mapping (section 19)
    once per KV-cache group: 64 (SWA), 256 (compressed and indexer caches), 4 and 8 (compressor states).

    :raises warmreg.ConfigError: for a KV-manager block size other than 256 or DCP with C4 layers
        (neither is supported by the DSv4 backends).
    """
    cache_block = config.get("serving.block_size", int, plugin=PLUGIN, default=SPARSE_BLOCK_SIZE)
    if cache_block != SPARSE_BLOCK_SIZE:
        raise warmreg.ConfigError(
            "serving.block_size",
            f"must be {SPARSE_BLOCK_SIZE} for the DeepSeek-V4 sparse backends (got {cache_block})",
            plugin=PLUGIN,
        )
    dcp = _serving(config, "decode_context_parallel_size", 1)
    interleave = _serving(config, "cp_kv_cache_interleave_size", 1)
    if dcp > 1 and model.has_c4:
        raise warmreg.ConfigError(
            "serving.decode_context_parallel_size",
            "must be 1: the DeepSeek-V4 C4 indexer does not support DCP",
            plugin=PLUGIN,
        )
    compressed = model.has_c4 or model.has_c128
    groups = (
        (SWA_PAGE_SIZE, True),
        (cache_block, compressed),
        (C4_STATE_BLOCK_SIZE, model.has_c4),
        (C128_STATE_BLOCK_SIZE, model.has_c128),
    )
    for block_size, used in groups:
        if used:  # built only when used: under DCP, from_config checks the interleave against the size
            registry.add(BlockTableSlotMapping.from_config(config, block_sizes=(block_size,), plugin=PLUGIN))
    registry.add(SparseSWAPrefillMetadata())
    # The C4 indexer: prefill chunks always; uniform decode flattening unless the varlen DeepGEMM
    # path serves decode (SM100 with DeepGEMM).
    registry.add(IndexerPrefillChunkMetadata(compress_ratios=(4,)), when=model.has_c4)
    native_varlen = warmreg.sm_at_least(100) & warmreg.has_feature("deepgemm")
    registry.add(PrepareUniformDecode(cache_block_size=cache_block), when=~native_varlen if model.has_c4 else False)
    # Compressed slots: the sparse-MLA builder (every compressed ratio, no DCP arguments) and the
    # C4 indexer builder (the configured DCP world and interleave).
    ratios = tuple(r for r in sorted(set(model.ratios)) if r > 1)
    registry.add(CompressedSlotMapping(compress_ratios=ratios, cache_block_size=cache_block), when=compressed)
    indexer_site = CompressedSlotMapping(
        compress_ratios=(4,), dcp_world_size=dcp, cp_interleave=interleave, cache_block_size=cache_block
    )
    registry.add(indexer_site, when=model.has_c4)
