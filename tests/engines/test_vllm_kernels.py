"""DeepSeek-V4's index and metadata ops, and the core's slot mapping and Q/KV RMSNorm, against vLLM 0.33's own
kernels, on identical engine-shaped inputs, under Triton's interpreter.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere. Each test calls
the engine's Python entry point with the arguments its call site passes (named in the test's docstring) and
warmreg's op on clones of the same seeded tensors, then compares every output and every buffer either side writes,
bitwise. Buffers the engine allocates with ``torch.empty`` / ``torch.empty_like`` are allocated, for the engine's
call, filled with a byte sentinel, and warmreg writes into ``out=`` buffers holding the same sentinel, so a
region one side leaves unwritten and the other writes shows up as a difference.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch

vllm_cache = engine("vllm.models.deepseek_v4.common.ops.cache_utils")
vllm_cache_v41 = engine("vllm.models.deepseek_v41.common.ops.cache_utils")
vllm_sparse_mla = engine("vllm.models.deepseek_v4.sparse_mla")
vllm_compressor = engine("vllm.v1.attention.backends.mla.compressor_utils")
vllm_swa = engine("vllm.v1.attention.backends.mla.sparse_swa")
vllm_indexer = engine("vllm.v1.attention.backends.mla.indexer")
vllm_attn_utils = engine("vllm.v1.attention.backends.utils")
vllm_ops = engine("vllm.v1.attention.ops.common")
vllm_block_table = engine("vllm.v1.worker.block_table")
vllm_block_tables_v2 = engine("vllm.v1.worker.gpu.block_table")
vllm_dflash = engine("vllm.v1.worker.gpu.spec_decode.dflash.speculator")
vllm_input_batch = engine("vllm.v1.worker.gpu.input_batch")
vllm_qk_norm = engine("vllm.models.common.ops.fused_qk_rmsnorm")

from warmreg_deepseek_v4.combine_indices import CombineTopkSwaIndices  # noqa: E402
from warmreg_deepseek_v4.dspark_inputs import DraftInputs, DSparkInputs  # noqa: E402
from warmreg_deepseek_v4.dspark_swa_indices import DSparkSwaIndices  # noqa: E402
from warmreg_deepseek_v4.flashinfer_indices import FlashInferMixedSparseIndices  # noqa: E402
from warmreg_deepseek_v4.global_topk import GlobalTopkIndices  # noqa: E402
from warmreg_deepseek_v4.pack_seq import PackSeq  # noqa: E402
from warmreg_deepseek_v4.sparse_mla import C128ATopkMetadata  # noqa: E402
from warmreg_deepseek_v4.swa_indices import DecodeSwaIndices  # noqa: E402
from warmreg_deepseek_v4.swa_prefill_metadata import SparseSWAPrefillMetadata  # noqa: E402
from warmreg_deepseek_v4.unpack_seq import UnpackSeq  # noqa: E402

from warmreg.ops import (  # noqa: E402
    BlockTableSlotMapping,
    CompressedSlotMapping,
    FusedQKVRMSNorm,
    IndexerPrefillChunkMetadata,
    PrepareUniformDecode,
)

WINDOW = 128  # sliding_window (Flash and Pro)
SWA_PAGE = 64  # DeepseekV4SWACache.block_size
SPARSE_BLOCK = 256  # KV-manager block size of the compressed caches (sparse MLA backends)
MAX_TOKENS = 256  # max_num_batched_tokens of the persistent buffers (small)
MAX_REQS = 8  # max_num_seqs
_BYTE = 0x5A  # sentinel byte: 0x5A5A5A5A as int32, never an index the kernels write


# -- helpers ---------------------------------------------------------------------------------------
def _fill_sentinel(t: torch.Tensor) -> torch.Tensor:
    if t.numel() and t.dtype != torch.bool:
        t.view(torch.uint8).fill_(_BYTE)
    return t


def sentinel(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of the sentinel byte pattern (bool buffers: all True)."""
    t = torch.empty(tuple(shape), dtype=dtype)
    return t.fill_(True) if dtype == torch.bool else _fill_sentinel(t)


@contextlib.contextmanager
def sentinel_allocations() -> Iterator[None]:
    """While the engine's entry runs, its ``torch.empty`` / ``torch.empty_like`` buffers hold the sentinel."""
    empty, empty_like = torch.empty, torch.empty_like
    with (
        mock.patch.object(torch, "empty", lambda *a, **k: _fill_sentinel(empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: _fill_sentinel(empty_like(*a, **k))),
    ):
        yield


def twin(t: Any) -> Any:
    """A copy of a tensor with its strides and storage offset (a view of a copy of its whole storage), so an
    engine-shaped view (a row slice of a persistent buffer, a narrower column view) stays one."""
    if not isinstance(t, torch.Tensor):
        return t
    copy = torch.empty(0, dtype=t.dtype)
    return copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def twins(**tensors: Any) -> dict[str, Any]:
    """:func:`twin` of every tensor argument: each side of a comparison writes into its own copies."""
    return {k: twin(v) for k, v in tensors.items()}


def assert_view(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same values, shape, dtype and strides (a returned view of a persistent buffer)."""
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} != engine's {want.stride()}"
    assert_same(got, want, what)


def block_table(g: torch.Generator, rows: int, width: int, pages: int = 4096) -> torch.Tensor:
    """A persistent block table ``[rows, width]``: distinct non-null pages, 0 (the null block) nowhere else."""
    return (torch.randperm(pages - 1, generator=g)[: rows * width] + 1).view(rows, width).to(torch.int32)


class Batch(SimpleNamespace):
    """A decode-first batch as the runner lays it out, padded for a CUDA graph."""

    query_start_loc: torch.Tensor  # int32 [R + pad_reqs + 1]
    seq_lens: torch.Tensor  # int32 [R + pad_reqs] (0 for pad requests)
    positions: torch.Tensor  # int64 [T_padded]
    token_to_req: torch.Tensor  # int32 [T_padded] (pad tokens: request 0)
    num_tokens: int  # real tokens
    num_reqs: int  # real requests


def make_batch(reqs: Sequence[tuple[int, int]], *, pad_tokens: int = 0, pad_reqs: int = 0) -> Batch:
    """``reqs`` = ``(context, query_len)`` per request, decodes first."""
    qlens = [q for _, q in reqs] + [0] * pad_reqs
    qsl = torch.tensor([0, *np.cumsum(qlens).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in reqs] + [0] * pad_reqs, dtype=torch.int32)
    positions = [c + j for c, q in reqs for j in range(q)] + [0] * pad_tokens
    owner = [r for r, (_, q) in enumerate(reqs) for _ in range(q)] + [0] * pad_tokens
    return Batch(
        query_start_loc=qsl, seq_lens=seq_lens, positions=torch.tensor(positions, dtype=torch.int64),
        token_to_req=torch.tensor(owner, dtype=torch.int32), num_tokens=int(qsl[len(reqs)]), num_reqs=len(reqs),
    )  # fmt: skip


def slots(batch: Batch, bt: torch.Tensor, bs: int) -> torch.Tensor:
    """The group's slot mapping: ``bt[r, p // bs] * bs + p % bs``, PAD (-1) for graph-padding tokens."""
    pos, req = batch.positions, batch.token_to_req.long()
    out = bt.long()[req, pos // bs] * bs + pos % bs
    out[batch.num_tokens :] = -1
    return out


# -- combine_topk_swa_indices (FlashMLA sparse prefill) ----------------------------------------------
def _local_topk(g: torch.Generator, positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """The indexer's top-k rows: a random choice of ``min((pos + 1) // ratio, width)`` of the causal compressed
    entries, then -1 (the C4 indexer's, or ``_fill_short_context_topk_indices``' in another order)."""
    rows = torch.full((positions.shape[0], width), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        n = (p + 1) // ratio
        rows[t, : min(n, width)] = torch.randperm(n, generator=g)[:width].to(torch.int32) if n else rows[t, :0]
    return rows


@pytest.mark.parametrize(
    ("ratio", "image", "deviation"),
    [
        (4, 0, None),  # C4: the indexer's top-k
        (128, 0, None),  # C128A: prefill_local, a [np, W] view of the [max_tokens, Wmax] buffer
        (1, 0, None),  # SWA-only: TOP_K 0
        (4, 256, None),  # a vision model's widened rows, a batch without image spans
        (4, 256, "visibility"),  # in-image bidirectional visibility, spans wider than the window
        (4, 0, "topk_hole"),  # deliberate: a -1 inside topk_len (V4.1's rule)
        (4, 0, "bounded_replay"),  # deliberate: gathered rows start after the window (V4.1's rule)
    ],
)
def test_combine_topk_swa_indices_equals_vllm(ratio: int, image: int, deviation: str | None) -> None:
    """``combine_topk_swa_indices`` (``models/deepseek_v4/common/ops/cache_utils.py`` →
    ``CombineTopkSwaIndicesKernel``), called as ``DeepseekV4FlashMLA._forward_prefill`` calls it for the second
    chunk of a decode-first batch (offset views of ``query_start_loc``, ``seq_lens``, ``gather_lens`` and the
    top-k rows; the workspace's rows past the chunk untouched).

    Two inputs DeepSeek-V4 never produces, where warmreg keeps vLLM's DeepSeek-V4.1 rule (its
    ``models/deepseek_v41`` copy of the kernel) and the V4 kernel differs: a -1 inside ``topk_len`` stays -1
    (V4: ``M * b - 1``, a row of the previous request), and with SWA bounded replay (V4.1 only; DeepSeek-V4's
    ``replay_start`` is always 0) the window starts no earlier than the gathered rows (V4: workspace rows the
    gather never wrote). Those cases are compared with the V4.1 kernel and must differ from the V4 one."""
    g = seeded(ratio + image)
    decodes = [(300, 2), (40, 1)]
    prefills = [(0, 5), (293, 7), (10, 200), (1000, 9), (5, 4)]
    batch = make_batch(decodes + prefills)
    nd, nd_tok = len(decodes), sum(q for _, q in decodes)
    seq_p = batch.seq_lens[nd:]  # swa_metadata.prefill_seq_lens
    qlen_p = batch.query_start_loc[nd + 1 :] - batch.query_start_loc[nd:-1]
    replay = torch.zeros_like(seq_p)
    if deviation == "bounded_replay":
        replay[1:3] = torch.tensor([250, 5], dtype=torch.int32)  # above pos - (W - 1) for the early tokens
    gather_p = (qlen_p + (seq_p - qlen_p - replay).clamp(min=0).clamp(max=WINDOW - 1)).to(torch.int32)
    num_prefill_tokens = batch.num_tokens - nd_tok
    index_topk = 512
    if ratio == 4:
        topk_buffer = sentinel((MAX_TOKENS, index_topk), torch.int32)  # the indexer's topk_indices_buffer
        topk_buffer[nd_tok : batch.num_tokens] = _local_topk(g, batch.positions[nd_tok:], 4, index_topk)
        if deviation == "topk_hole":
            topk_buffer[nd_tok + 13, 1] = -1  # a token of the chunk's request 1 ...
            topk_buffer[nd_tok + 212, 0] = -1  # ... and of its request 2
        topk_all = topk_buffer[nd_tok:][:num_prefill_tokens]
    elif ratio == 128:
        width, wmax = 128, 256
        prefill_buffer = sentinel((MAX_TOKENS, wmax), torch.int32)  # c128a_prefill_buffer
        j = torch.arange(width)
        n = ((batch.positions[nd_tok : batch.num_tokens] + 1) // 128).clamp(max=width)
        prefill_buffer[:num_prefill_tokens, :width] = torch.where(j < n[:, None], j, -1).to(torch.int32)
        topk_all = prefill_buffer[:num_prefill_tokens, :width]
    else:
        topk_all = sentinel((MAX_TOKENS, index_topk), torch.int32)[nd_tok:]  # unused for SWA-only layers
    top_k = 0 if ratio == 1 else topk_all.shape[-1]
    left = right = None
    if deviation == "visibility":  # _compute_image_visibility_kernel's output, [T] by absolute token
        left = torch.zeros(batch.num_tokens, dtype=torch.int32)
        right = torch.zeros(batch.num_tokens, dtype=torch.int32)
        spans = [(nd_tok + 5, 293, 294, 298), (nd_tok + 12, 10, 20, 199)]  # (first token, context, span)
        for t0, context, lo, hi in spans:  # spans are prefilled whole, inside one query
            pos = torch.arange(lo, hi + 1)
            tok = t0 + pos - context
            left[tok] = (pos - lo).clamp(max=image - 1).to(torch.int32)
            right[tok] = (hi - pos).clamp(max=image).to(torch.int32)
    # the chunk plan: one chunk of prefills [1, 4)
    cs, ce = 1, 4
    compressed = seq_p // ratio if ratio > 1 else torch.zeros_like(seq_p)
    chunk_n = int(compressed[cs:ce].max())
    chunk_m = chunk_n + int(gather_p[cs:ce].max())
    qsl_cpu = batch.query_start_loc
    q0, q1 = int(qsl_cpu[nd + cs] - qsl_cpu[nd]), int(qsl_cpu[nd + ce] - qsl_cpu[nd])
    combined_width = -(-(top_k + WINDOW + image) // 128) * 128
    args: dict[str, Any] = {
        "topk": topk_all[q0:q1],
        "qsl": batch.query_start_loc[nd + cs : nd + ce + 1],
        "seq_lens": seq_p[cs:ce],
        "gather_lens": gather_p[cs:ce],
        "indices": sentinel((MAX_TOKENS, combined_width), torch.int32),  # the workspace
        "lens": sentinel((MAX_TOKENS,), torch.int32),
        "left": left[nd_tok + q0 : nd_tok + q1] if left is not None else None,
        "right": right[nd_tok + q0 : nd_tok + q1] if right is not None else None,
    }
    theirs, ours = twins(**args), twins(**args)
    nq = q1 - q0

    def vllm_call(module: Any, a: dict[str, Any]) -> None:
        extra = {} if module is vllm_cache_v41 else dict(left_visible=a["left"], right_visible=a["right"],
                                                          max_image_tokens=image)  # fmt: skip
        module.combine_topk_swa_indices(
            a["topk"], a["qsl"], a["seq_lens"], a["gather_lens"], WINDOW, ratio, top_k, chunk_m, chunk_n,
            out=(a["indices"][:nq], a["lens"][:nq]), **extra,
        )  # fmt: skip

    vllm_call(vllm_cache, theirs)
    CombineTopkSwaIndices(window_size=WINDOW)(
        ours["topk"] if ratio > 1 else None, ours["qsl"], ours["seq_lens"], ours["gather_lens"], num_tokens=nq,
        compress_ratio=ratio, M=chunk_m, N=chunk_n, image_width=image, left_visible=ours["left"],
        right_visible=ours["right"], out=(ours["indices"][:nq], ours["lens"][:nq]),
    )  # fmt: skip
    if deviation in ("topk_hole", "bounded_replay"):
        v41 = twins(**args)
        vllm_call(vllm_cache_v41, v41)
        assert_same(ours["indices"], v41["indices"], "combined indices (against V4.1)")
        assert_same(ours["lens"], v41["lens"], "combined lens (against V4.1)")
        assert not torch.equal(ours["indices"], theirs["indices"]), "the V4 kernel no longer differs here"
        return
    assert_same(ours["indices"], theirs["indices"], "combined indices (workspace)")
    assert_same(ours["lens"], theirs["lens"], "combined lens (workspace)")


# -- compressed slot mapping ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("site", "ratio", "dcp_world", "empty"),
    [
        ("mla", 4, 1, False),
        ("mla", 128, 1, False),
        ("indexer", 4, 1, False),
        ("indexer", 4, 2, False),
        ("mla", 4, 1, True),  # a step of graph padding only (no real token)
    ],
)
def test_compressed_slot_mapping_equals_vllm(site: str, ratio: int, dcp_world: int, empty: bool) -> None:
    """``get_compressed_slot_mapping`` (``v1/attention/backends/mla/compressor_utils.py`` →
    ``CompressedSlotMappingKernel``) at its two DeepSeek-V4 call sites: the sparse-MLA builder
    (``DeepseekV4SparseMLAMetadataBuilder.build``: the clamped table, no DCP arguments) and the C4 indexer builder
    (the configured DCP world and uncompressed interleave; a DCP case although DeepSeek-V4 rejects DCP, since
    the kernel serves it). Graph-padded tokens and requests, PAD slots inside a request (replayed tokens, another
    DCP rank's tokens), a persistent ``out`` buffer (vLLM fills all of it with -1 first)."""
    g = seeded(ratio * 10 + dcp_world)
    real = [] if empty else [(300, 2), (7, 1), (0, 9), (253, 6), (1020, 12)]
    batch = make_batch(real, pad_tokens=3, pad_reqs=2)
    reqs = batch.num_reqs + 2
    width = 17  # cdiv(max_model_len=4352, 256): the compressed group's persistent row width
    table = block_table(g, MAX_REQS, width)
    table[1, 5:] = -1  # a stale row tail: the builder clamps the table in place before the call
    slot = slots(batch, table.clamp(min=0), SPARSE_BLOCK)
    if not empty:
        slot[14] = -1  # a PAD slot inside a request
    interleave = 8 if dcp_world > 1 else 1
    if dcp_world > 1:  # this rank (1) owns the chunks of `interleave` tokens dealt to it
        rank = 1
        slot[((batch.positions // interleave) % dcp_world) != rank] = -1
    args: dict[str, Any] = {
        "slot_mapping": slot,
        "query_start_loc": batch.query_start_loc,
        "seq_lens": batch.seq_lens,
        "block_table": table[:reqs],
        "out": sentinel((MAX_TOKENS,), torch.int64),  # compressed_slot_mapping_buffer
    }
    theirs, ours = twins(**args), twins(**args)
    num_states = SPARSE_BLOCK // ratio
    extra = {} if site == "mla" else dict(dcp_world_size=dcp_world, cp_interleave=interleave)
    want = vllm_compressor.get_compressed_slot_mapping(
        batch.num_tokens, theirs["slot_mapping"], theirs["query_start_loc"], theirs["seq_lens"],
        theirs["block_table"].clamp_(min=0), num_states, ratio, out=theirs["out"], **extra,
    )  # fmt: skip
    got = CompressedSlotMapping(compress_ratios=(ratio,))(
        ours["slot_mapping"], ours["query_start_loc"], ours["seq_lens"], ours["block_table"].clamp_(min=0),
        num_tokens=batch.num_tokens, block_size=num_states, compress_ratio=ratio, out=ours["out"], **extra,
    )  # fmt: skip
    assert_view(got, want, "compressed slot mapping")
    assert_same(ours["out"], theirs["out"], "compressed_slot_mapping_buffer")
    assert_same(ours["block_table"], theirs["block_table"], "block table (clamped in place)")


# -- prepare_dflash_inputs (DSpark draft step) -------------------------------------------------------
@pytest.mark.parametrize(
    ("targets", "rejected", "sampled", "cp"),
    [
        ([6, 6, 1], [5, 0, 0], [1, 1, 1], (1, 0, 1)),  # verify rows (1 + N), all drafts rejected, a decode row
        ([70, 6], [0, 2], [0, 1], (1, 0, 1)),  # a chunked-prefill splice (num_sampled 0), BLOCK_SIZE 128
        ([6, 3, 6], [1, 0, 5], [1, 1, 1], (2, 1, 4)),  # DCP rank 1 of 2, interleave 4
    ],
)
def test_prepare_dspark_inputs_equals_vllm(
    targets: list[int], rejected: list[int], sampled: list[int], cp: tuple[int, int, int]
) -> None:
    """``prepare_dflash_inputs`` (``v1/worker/gpu/spec_decode/dflash/speculator.py`` →
    ``_prepare_dflash_inputs_kernel``, a plain ``@triton.jit``), called as ``DFlashSpeculator.propose`` calls it for
    DSpark (``sample_from_anchor=True``, ``Nq = N = 5``) with the runner's persistent buffers: every buffer either
    side writes is compared in full, the graph-padding tails included. The SWA group's table holds a null block
    (0) and a row near ``max_model_len`` clamps positions; the request-state indices are permuted."""
    g = seeded(sum(targets) + cp[0])
    n_spec, nq, noise, bs = 5, 5, 128799, SWA_PAGE
    cp_size, cp_rank, cp_interleave = cp
    max_model_len = 640
    num_reqs = len(targets)
    contexts = [37, 632, 200][:num_reqs]  # request 1's queries reach max_model_len
    qsl = torch.tensor([0, *np.cumsum(targets).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(contexts, targets)]).to(torch.int64)
    table = block_table(g, MAX_REQS, 16)
    table[0, 0] = 0  # the null block: a sliding-window block freed behind the window
    states = torch.tensor([5, 2, 7][:num_reqs], dtype=torch.int64)  # input_batch.idx_mapping
    buffers = vllm_input_batch.InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
    for t in (buffers.input_ids, buffers.positions, buffers.query_start_loc, buffers.seq_lens):
        t.copy_(sentinel(t.shape, t.dtype))  # stale values of an earlier step
    samples = MAX_REQS * n_spec
    outs: dict[str, Any] = {
        "input_ids": buffers.input_ids, "positions": buffers.positions, "is_padding": buffers.is_padding,
        "query_start_loc": buffers.query_start_loc, "seq_lens": buffers.seq_lens,
        "query_slot_mapping": sentinel((MAX_TOKENS,), torch.int64),  # block_tables.slot_mappings[gid]
        "context_positions": sentinel((MAX_TOKENS,), torch.int64),
        "context_slot_mapping": sentinel((MAX_TOKENS,), torch.int64),
        "sample_indices": sentinel((samples,), torch.int64), "sample_pos": sentinel((samples,), torch.int64),
        "sample_idx_mapping": sentinel((samples,), torch.int64),
        "temperature": sentinel((MAX_REQS,), torch.float32), "seeds": sentinel((MAX_REQS,), torch.int64),
    }  # fmt: skip
    ins: dict[str, Any] = {
        "target_positions": positions, "target_qsl": qsl, "idx_mapping": states,
        "num_sampled": torch.tensor(sampled, dtype=torch.int32),
        "num_rejected": torch.tensor(rejected, dtype=torch.int32),
        "last_sampled": torch.randint(0, 129280, (MAX_REQS, 1), generator=g),  # req_states.last_sampled_tokens
        "next_prefill_tokens": torch.randint(0, 129280, (2, MAX_REQS), generator=g).to(torch.int32),
        "input_temperature": torch.rand(MAX_REQS, generator=g),  # sampling_states.temperature
        "input_seeds": torch.randint(0, 2**40, (MAX_REQS,), generator=g),
        "block_table": table,
    }  # fmt: skip
    theirs, ours = twins(**outs, **ins), twins(**outs, **ins)
    batch = SimpleNamespace(
        num_reqs=num_reqs, num_scheduled_tokens=np.array(targets, dtype=np.int32),
        positions=theirs["target_positions"], query_start_loc=theirs["target_qsl"], idx_mapping=theirs["idx_mapping"],
    )  # fmt: skip
    their_buffers = SimpleNamespace(**{k: theirs[k] for k in ("input_ids", "positions", "is_padding",
                                                               "query_start_loc", "seq_lens")})  # fmt: skip
    vllm_dflash.prepare_dflash_inputs(
        their_buffers, theirs["query_slot_mapping"], theirs["context_positions"], theirs["context_slot_mapping"],
        theirs["sample_indices"], theirs["sample_pos"], theirs["sample_idx_mapping"], theirs["temperature"],
        theirs["seeds"], batch, theirs["num_sampled"], theirs["num_rejected"], theirs["last_sampled"],
        theirs["next_prefill_tokens"], theirs["input_temperature"], theirs["input_seeds"], theirs["block_table"], bs, cp_rank, cp_size,
        cp_interleave, noise, nq, n_spec, MAX_REQS, MAX_TOKENS, max_model_len, True, num_reqs,
    )  # fmt: skip
    out = DraftInputs(*(ours[k] for k in outs))
    DSparkInputs()(
        ours["target_positions"], ours["target_qsl"], ours["idx_mapping"], ours["last_sampled"],
        ours["next_prefill_tokens"], ours["num_sampled"], ours["num_rejected"], ours["input_temperature"],
        ours["input_seeds"],
        ours["block_table"], num_reqs=num_reqs, max_query_len=max(targets), block_size=bs,
        parallel_drafting_token_id=noise, num_query_per_req=nq, num_speculative_steps=n_spec, max_num_reqs=MAX_REQS,
        max_num_tokens=MAX_TOKENS, max_model_len=max_model_len, cp_rank=cp_rank, cp_size=cp_size,
        cp_interleave=cp_interleave, sample_from_anchor=True, out=out,
    )  # fmt: skip
    for name in (*outs, "input_temperature", "input_seeds"):
        assert_same(ours[name], theirs[name], name)


# -- DSpark non-causal SWA indices --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("contexts", "qlen", "n_spec"),
    [
        ([0, 1, 127, 128, 129, 300], 5, 5),  # DSpark-Flash: Nq = N = 5, W = 192; windows starting at 0 and across pages
        ([200, 64], 65, 64),  # 1 + N query tokens with (window + N) % 64 == 0: lens 193 > W = 192
    ],
)
def test_dspark_noncausal_swa_indices_equals_vllm(contexts: list[int], qlen: int, n_spec: int) -> None:
    """``ComputeDSparkNoncausalSWAIndicesKernel`` (``v1/attention/backends/mla/sparse_swa.py``), called as
    ``DeepseekSparseSWAMetadataBuilder.build`` calls it for a draft batch built with ``causal=False``: the persistent
    ``decode_swa_indices_noncausal [max_tokens, 1, W]`` buffer and ``decode_swa_lens`` (zeroed past the decode
    tokens first), a wider persistent SWA table, invalid tokens inside a request and graph-padding tokens."""
    g = seeded(qlen)
    batch = make_batch([(c, qlen) for c in contexts], pad_tokens=3, pad_reqs=1)
    width = vllm_compressor.get_dspark_swa_index_width(WINDOW, n_spec)
    table = block_table(g, MAX_REQS, 20)
    valid = slots(batch, table, SWA_PAGE) >= 0
    valid[qlen + 2] = False  # a token of request 1 whose slot is PAD
    nd = batch.positions.shape[0]
    lens = sentinel((MAX_TOKENS,), torch.int32)
    lens[nd:] = 0  # build() zeroes decode_swa_lens past the decode tokens before the launch
    args: dict[str, Any] = {
        "indices": sentinel((MAX_TOKENS, 1, width), torch.int32), "lens": lens,
        "qsl": batch.query_start_loc, "seq_lens": batch.seq_lens, "token_to_req": batch.token_to_req,
        "valid": valid, "table": table[: batch.num_reqs + 1],
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    vllm_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL(
        theirs["indices"], theirs["lens"], WINDOW, width, theirs["qsl"], theirs["seq_lens"], theirs["token_to_req"],
        theirs["valid"], theirs["table"], SWA_PAGE, num_tokens=nd, token_offset=0,
    )  # fmt: skip
    DSparkSwaIndices()(
        ours["qsl"], ours["seq_lens"], ours["token_to_req"], ours["valid"], ours["table"], num_tokens=nd,
        window_size=WINDOW, index_width=width, block_size=SWA_PAGE, out=(ours["indices"], ours["lens"]),
    )  # fmt: skip
    assert_same(ours["indices"], theirs["indices"], "decode_swa_indices_noncausal")
    assert_same(ours["lens"], theirs["lens"], "decode_swa_lens")


# -- FlashInfer mixed sparse indices -----------------------------------------------------------------
def _decode_swa_rows(batch: Batch, table: torch.Tensor, nd_tok: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SWA builder's causal ``decode_swa_indices`` / ``decode_swa_lens`` of the decode tokens (vLLM's kernel)."""
    indices, lens = torch.zeros(MAX_TOKENS, 1, width, dtype=torch.int32), torch.zeros(MAX_TOKENS, dtype=torch.int32)
    valid = slots(batch, table, SWA_PAGE) >= 0
    if nd_tok:
        vllm_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
            indices, lens, WINDOW, width, lens, lens, batch.query_start_loc, batch.seq_lens, batch.token_to_req,
            valid, table, SWA_PAGE, torch.zeros(MAX_REQS + 1, dtype=torch.int32), num_tokens=nd_tok, token_offset=0,
        )  # fmt: skip
    return indices[:nd_tok].reshape(nd_tok, width), valid


@pytest.mark.parametrize(
    ("ratio", "mix", "variant"),
    [
        (1, "mixed", None),  # SWA-only: the SWA table serves as the compressed one
        (4, "mixed", None),  # C4: local decode top-k through the table, prefill top-k
        (4, "decode", None),  # C4 without prefill: TOP_K 0, a 0-row prefill view of the same width
        (128, "mixed", None),  # C128A: global decode slots with lens, prefill_local rows of stride Wmax
        (128, "prefill", None),  # C128A without decode rows
        (4, "mixed", "packed"),  # packed pages: span != page size; graph-padded output rows (num_rows)
        (4, "mixed", "image"),  # vision: widened SWA region, in-image visibility of prefill tokens
        (1, "decode", "dspark"),  # DSpark's non-causal draft rows (SWA-only draft layers)
    ],
)
def test_flashinfer_mixed_sparse_indices_equals_vllm(ratio: int, mix: str, variant: str | None) -> None:
    """``build_flashinfer_mixed_sparse_indices`` (``models/deepseek_v4/common/ops/cache_utils.py`` →
    ``BuildFlashinferMixedSparseIndicesKernel``), called as ``DeepseekV4FlashInferSparse._build_sparse_index_metadata``
    calls it for each layer type (the SWA builder's decode rows, the indexer's / C128A metadata's compressed
    indices, the persistent tables). vLLM allocates both outputs with ``torch.empty`` (``num_rows`` rows, the ones
    past the real tokens left unset); warmreg writes into sentinel buffers of that size."""
    g = seeded(ratio + len(mix) + len(variant or ""))
    decodes = [(300, 2), (40, 2), (1000, 1)] if mix != "prefill" else []
    prefills = [(0, 5), (293, 7), (70, 4)] if mix != "decode" else []
    if variant == "dspark":
        decodes = [(0, 5), (129, 5), (300, 5)]
    batch = make_batch(decodes + prefills, pad_tokens=0)
    nd, nd_tok, T = len(decodes), sum(q for _, q in decodes), batch.num_tokens
    swa_table = block_table(g, MAX_REQS, 20)
    if variant == "dspark":
        width = vllm_compressor.get_dspark_swa_index_width(WINDOW, 5)
        rows = torch.zeros(MAX_TOKENS, 1, width, dtype=torch.int32)
        valid = slots(batch, swa_table, SWA_PAGE) >= 0
        vllm_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL(
            rows, torch.zeros(MAX_TOKENS, dtype=torch.int32), WINDOW, width, batch.query_start_loc, batch.seq_lens,
            batch.token_to_req, valid, swa_table, SWA_PAGE, num_tokens=nd_tok, token_offset=0,
        )  # fmt: skip
        decode_swa = rows[:nd_tok].reshape(nd_tok, width)
    else:
        decode_swa, valid = _decode_swa_rows(batch, swa_table, nd_tok, WINDOW)
    index_topk, wmax, c128_width = 512, 256, 128
    topk_buffer = sentinel((MAX_TOKENS, index_topk), torch.int32)
    topk_buffer[:T] = _local_topk(g, batch.positions, 4, index_topk)
    decode_lens = decode_valid = None
    if ratio == 1:
        cbt, cbs = None, SWA_PAGE
        decode_comp, prefill_topk, top_k = None, topk_buffer[nd_tok:T, :0], 0
    elif ratio == 4:
        cbt, cbs = block_table(g, MAX_REQS, 17)[: nd + len(prefills)], SPARSE_BLOCK // 4
        prefill_topk = topk_buffer[nd_tok:T] if T > nd_tok else topk_buffer[:0, :0]
        top_k = prefill_topk.shape[-1]
        decode_valid = valid[:nd_tok]
        decode_comp = topk_buffer[:nd_tok] if nd_tok else prefill_topk[:0]
    else:
        cbt, cbs = block_table(g, MAX_REQS, 80)[: nd + len(prefills)], SPARSE_BLOCK // 128
        global_decode, lens_buf, prefill_buf = (sentinel((MAX_TOKENS, wmax), torch.int32),
                                                sentinel((MAX_TOKENS,), torch.int32),
                                                sentinel((MAX_TOKENS, wmax), torch.int32))  # fmt: skip
        gd, dl, pl = vllm_sparse_mla.build_c128a_topk_metadata(
            batch.positions[:T], 128, nd_tok, batch.token_to_req, cbt[:nd], cbs, slots(batch, swa_table, SWA_PAGE),
            global_decode, lens_buf, prefill_buf, max_compressed_tokens=c128_width,
        )  # fmt: skip
        prefill_topk = pl if T > nd_tok else decode_swa[:0, :0]
        top_k = prefill_topk.shape[-1]
        if nd_tok:
            decode_comp, decode_lens = gd.view(nd_tok, 1, -1).view(nd_tok, -1), dl
            if T == nd_tok:
                prefill_topk = decode_comp[:0, :0]
        else:
            decode_comp, decode_lens = prefill_topk[:0], batch.seq_lens[:0]
    swa_span = comp_span = None
    num_rows = None
    if variant == "packed":
        swa_span, comp_span, num_rows = SWA_PAGE + 9, cbs + 3, T + 5
    left = right = None
    image = 0
    if variant == "image":
        image = 256
        left = torch.zeros(MAX_TOKENS, dtype=torch.int32)
        right = torch.zeros(MAX_TOKENS, dtype=torch.int32)
        t0 = nd_tok + 5  # request (293, 7): a span over its positions 294..299
        left[t0 + 1 : t0 + 7] = torch.arange(6, dtype=torch.int32)
        right[t0 + 1 : t0 + 7] = torch.arange(5, -1, -1, dtype=torch.int32)
        left, right = left[:T], right[:T]
    args: dict[str, Any] = {
        "decode_swa": decode_swa, "decode_comp": decode_comp, "decode_lens": decode_lens, "decode_valid": decode_valid,
        "prefill_topk": prefill_topk[: T - nd_tok], "qsl": batch.query_start_loc, "seq_lens": batch.seq_lens,
        "token_to_req": batch.token_to_req[:T], "swa_table": swa_table[: nd + len(prefills)], "cbt": cbt,
        "left": left, "right": right,
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    with sentinel_allocations():
        want_idx, want_lens = vllm_cache.build_flashinfer_mixed_sparse_indices(
            theirs["decode_swa"], theirs["decode_comp"], theirs["decode_lens"], theirs["prefill_topk"], theirs["qsl"],
            theirs["seq_lens"], theirs["token_to_req"], theirs["swa_table"], SWA_PAGE, theirs["cbt"], cbs, WINDOW,
            ratio, top_k, decode_compressed_indices_are_local=ratio == 4, decode_is_valid_token=theirs["decode_valid"],
            swa_block_span=swa_span, compressed_block_span=comp_span, prefill_left_visible=theirs["left"],
            prefill_right_visible=theirs["right"], max_image_tokens=image, num_rows=num_rows,
        )  # fmt: skip
    out = (sentinel(want_idx.shape, torch.int32), sentinel(want_lens.shape, torch.int32))
    FlashInferMixedSparseIndices(window_size=WINDOW)(
        ours["decode_swa"], ours["decode_comp"] if ratio > 1 else None, ours["decode_lens"], ours["decode_valid"],
        ours["prefill_topk"] if top_k else None, ours["token_to_req"], ours["seq_lens"], ours["qsl"],
        ours["swa_table"], ours["cbt"], num_tokens=T, num_decode_tokens=nd_tok, compress_ratio=ratio, top_k=top_k,
        swa_block_size=SWA_PAGE, compressed_block_size=cbs, swa_span=swa_span, compressed_span=comp_span,
        image_width=image, left_visible=ours["left"], right_visible=ours["right"], out=out,
    )  # fmt: skip
    assert_same(out[0], want_idx, "sparse_indices")
    assert_same(out[1], want_lens, "sparse_topk_lens")


# -- global top-k indices (C4 decode; FlashInfer SM120 prefill) -----------------------------------------
@pytest.mark.parametrize("site", ["decode", "prefill", "prefill_c128"])
def test_global_topk_indices_equals_vllm(site: str) -> None:
    """``compute_global_topk_indices_and_lens`` (``models/deepseek_v4/common/ops/cache_utils.py`` →
    ``ComputeGlobalTopkIndicesAndLensKernel``), called as ``DeepseekV4FlashMLA._forward_decode`` calls it (the
    indexer buffer's decode rows, the decode requests' table rows) and as the FlashInfer SM120 prefill calls it
    (an offset view of the buffer, offset views of ``token_to_req`` / ``is_valid_token``; for C128 the C128A
    ``prefill_local`` rows, a ``[np, W]`` view of row stride ``Wmax``). Outputs: vLLM's ``torch.empty_like`` /
    ``torch.empty``, here filled with the sentinel."""
    g = seeded(len(site))
    batch = make_batch([(300, 2), (40, 2), (1000, 1), (0, 5), (293, 7)], pad_tokens=2)
    nd, nd_tok, T = 3, 5, batch.num_tokens
    table = block_table(g, MAX_REQS, 17)
    valid = slots(batch, table, SPARSE_BLOCK) >= 0
    valid[1] = False  # a decode token whose slot is PAD
    valid[nd_tok + 2] = False
    if site == "prefill_c128":
        buffer = sentinel((MAX_TOKENS, 256), torch.int32)
        j = torch.arange(128)
        buffer[: T - nd_tok, :128] = torch.where(j < ((batch.positions[nd_tok:T] + 1) // 128)[:, None], j, -1)
        topk, bs = buffer[: T - nd_tok, :128], SPARSE_BLOCK // 128
    else:
        buffer = sentinel((MAX_TOKENS, 512), torch.int32)  # topk_indices_buffer
        buffer[: T + 2] = _local_topk(g, batch.positions, 4, 512)
        topk, bs = (buffer[:nd_tok] if site == "decode" else buffer[nd_tok:T]), SPARSE_BLOCK // 4
    rows = slice(0, nd_tok) if site == "decode" else slice(nd_tok, T)
    args: dict[str, Any] = {
        "topk": topk, "token_to_req": batch.token_to_req if site == "decode" else batch.token_to_req[rows],
        "table": table[:nd] if site == "decode" else table, "valid": valid[rows],
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    with sentinel_allocations():
        want = vllm_cache.compute_global_topk_indices_and_lens(
            theirs["topk"], theirs["token_to_req"], theirs["table"], bs, theirs["valid"]
        )
    out = (sentinel(want[0].shape, torch.int32), sentinel(want[1].shape, torch.int32))
    got = GlobalTopkIndices()(ours["topk"], ours["token_to_req"], ours["table"], ours["valid"], block_size=bs, out=out)
    assert_view(got[0], want[0], "global top-k indices")
    assert_view(got[1], want[1], "top-k lens")


# -- indexer prefill chunk metadata -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ratio", "chunk", "query_slice", "dcp"),
    [
        (4, (1, 4), (0, 10**9), (1, 0, 1)),  # a chunk of three prefills (seq_lens an offset view), the whole query
        (4, (2, 3), (3, 11), (1, 0, 1)),  # one request cut along M: a sub-slice of its query rows
        (4, (1, 4), (0, 10**9), (2, 1, 2)),  # DCP rank 1 of 2, interleave 2 compressed rows (DSv4 rejects DCP)
        (1, (0, 2), (0, 10**9), (1, 0, 1)),  # ratio 1 (the kernel's V3.2 case; a DSv4 warmup ratio)
    ],
)
def test_indexer_prefill_chunk_metadata_equals_vllm(
    ratio: int, chunk: tuple[int, int], query_slice: tuple[int, int], dcp: tuple[int, int, int]
) -> None:
    """``build_prefill_chunk_metadata`` (``v1/attention/backends/mla/indexer.py`` →
    ``BuildPrefillChunkMetadataKernel``), called as the indexer builder calls it for one chunk of the prefills
    (``seq_lens`` / ``seq_lens // cr`` of the whole batch, the chunk's request range and query slice). warmreg's
    op takes what the wrapper computes in torch (the rebased ``query_start_loc``, the cumulative compressed lens,
    under DCP this rank's local cumulative lens from ``get_dcp_local_seq_lens``); its three outputs are compared
    with the wrapper's ``torch.empty`` ones."""
    world, rank, interleave = dcp
    batch = make_batch([(0, 5), (293, 7), (70, 14), (1000, 9), (5, 4)])
    seq_lens = batch.seq_lens
    compressed = seq_lens // ratio if ratio > 1 else seq_lens
    start, end = chunk
    qsl_cpu = batch.query_start_loc
    total_q = int(qsl_cpu[end] - qsl_cpu[start])
    qs0, qs1 = min(query_slice[0], total_q), min(query_slice[1], total_q)
    theirs = twins(qsl=batch.query_start_loc, seq_lens=seq_lens, compressed=compressed)
    with sentinel_allocations():
        meta = vllm_indexer.build_prefill_chunk_metadata(
            start, end, theirs["qsl"], qsl_cpu, theirs["seq_lens"], theirs["compressed"], compressed, torch.zeros(8, 4),
            ratio, query_slice=slice(*query_slice), dcp_rank=rank, dcp_world_size=world,
            cp_kv_cache_interleave_size=interleave,
        )  # fmt: skip
    cu = torch.zeros(end - start + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(compressed[start:end], 0)
    row_start = cu
    if world > 1:
        local = vllm_attn_utils.get_dcp_local_seq_lens(compressed[start:end], world, None, interleave)[:, rank]
        row_start = torch.zeros_like(cu)
        row_start[1:] = torch.cumsum(local, 0)
    ours = twins(qsl=batch.query_start_loc, seq_lens=seq_lens)
    total = int(cu[-1])
    out = (sentinel((total,), torch.int32), sentinel((qs1 - qs0,), torch.int32), sentinel((qs1 - qs0,), torch.int32))
    IndexerPrefillChunkMetadata()(
        ours["qsl"][start : end + 1] - ours["qsl"][start], ours["seq_lens"][start:end], cu, row_start,
        num_compressed_rows=total, query_slice_start=qs0, query_slice_stop=qs1, compress_ratio=ratio,
        dcp_rank=rank, dcp_world=world, dcp_interleave=interleave, out=out,
    )  # fmt: skip
    assert_same(out[0], meta.token_to_seq, "token_to_seq")
    assert_same(out[1], meta.cu_seqlen_ks, "cu_seqlen_ks")
    assert_same(out[2], meta.cu_seqlen_ke, "cu_seqlen_ke")
    assert_same(row_start, meta.local_cu_seq_lens, "row starts (the wrapper's torch)")


# -- pack / unpack (the C4 indexer's padded decode path) -------------------------------------------------
_FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("lengths", "rows", "dtype", "pad"),
    [
        ([2, 1, 2], (4, 128), _FP8, float("-inf")),  # FP8 indexer Q [Td, H, D] (4 heads here), MTP 1 mixed lengths
        ([65, 1, 0], (4, 25), _FP8, float("-inf")),  # Lmax 65 crosses a 64-row tile; D = 100; a 0-length row
        ([2, 1, 2], (64,), torch.uint8, 0),  # FP4 packed values, uint8 pad 0
        ([1, 2], (3,), torch.int32, 0),  # FP4 scales: int32 with the float pad 0 (not warmed by vLLM)
    ],
)
def test_pack_seq_equals_vllm(lengths: list[int], rows: tuple[int, ...], dtype: torch.dtype, pad: float) -> None:
    """``pack_seq_triton`` (``v1/attention/ops/common.py`` → ``PackSeqTritonKernel``), called as
    ``sparse_attn_indexer`` calls it on its padded decode path (``q_quant[:Td]``, ``decode_lens``; the pad -inf for
    FP8, 0 for the FP4 tensors), with rows of ``x`` past ``sum(lengths)`` (the buffer's prefill rows). vLLM's
    ``torch.empty`` output holds the sentinel; every slot is written (the -inf pad into e4m3fn included)."""
    g = seeded(sum(lengths))
    n = sum(lengths) + 3
    if dtype == _FP8:
        x = (torch.randn(n, *rows, generator=g) * 50).to(_FP8)
    elif dtype == torch.uint8:
        x = torch.randint(0, 256, (n, *rows), generator=g).to(torch.uint8)
    else:
        x = torch.randint(-(2**31), 2**31 - 1, (n, *rows), generator=g).to(torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    theirs, ours = twins(x=x, lens=lens), twins(x=x, lens=lens)
    nd = sum(lengths)
    with sentinel_allocations():
        want = vllm_ops.pack_seq_triton(theirs["x"][:nd], theirs["lens"], pad_value=pad)
    out = sentinel(want.shape, dtype)
    got = PackSeq()(ours["x"][:nd], ours["lens"], pad_value=pad, out=out)
    assert got is out
    assert_view(got, want, "packed")


@pytest.mark.parametrize(
    ("lengths", "width"),
    [([2, 1, 2], 512), ([65, 1, 0], 100), ([1], 64)],  # index_topk 512; D not a multiple of 64; one request
)
def test_unpack_seq_equals_vllm(lengths: list[int], width: int) -> None:
    """``unpack_seq_triton`` (``v1/attention/ops/common.py`` → ``UnpackSeqTritonKernel``), called as
    ``sparse_attn_indexer`` calls it on the top-k of the padded decode rows (``topk_indices.reshape(B, -1, topk)``,
    int32); vLLM's ``torch.empty`` output holds the sentinel."""
    g = seeded(width)
    b, lmax = len(lengths), max(lengths)
    packed = torch.randint(-1, 4096, (b * lmax, width), generator=g).to(torch.int32).reshape(b, -1, width)
    lens = torch.tensor(lengths, dtype=torch.int32)
    theirs, ours = twins(p=packed, lens=lens), twins(p=packed, lens=lens)
    with sentinel_allocations():
        want = vllm_ops.unpack_seq_triton(theirs["p"], theirs["lens"])
    out = sentinel(want.shape, torch.int32)
    got = UnpackSeq()(ours["p"], ours["lens"], out=out)
    assert_view(got, want, "unpacked")


# -- C128A top-k metadata ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("decodes", "prefills"), [(3, 2), (0, 3), (3, 0), (0, 0)])
def test_c128a_topk_metadata_equals_vllm(decodes: int, prefills: int) -> None:
    """``build_c128a_topk_metadata`` (``models/deepseek_v4/sparse_mla.py`` → ``BuildC128ATopkMetadataKernel``),
    called as ``DeepseekV4SparseMLAMetadataBuilder._build_c128a_metadata`` calls it: the persistent
    ``[max_tokens, Wmax]`` buffers (``Wmax`` 256 > the step's width 128), the decode requests' clamped table rows,
    a decode token with a PAD slot, positions past ``W * 128`` (counts clamped to ``W``). Every buffer is compared
    in full, and the returned views (shape and strides)."""
    g = seeded(decodes * 10 + prefills)
    reqs = [(20000, 2), (300, 1), (127, 1)][:decodes] + [(0, 5), (255, 9), (17000, 3)][:prefills]
    batch = make_batch(reqs, pad_tokens=2)
    nd_tok = sum(q for _, q in reqs[:decodes])
    table = block_table(g, MAX_REQS, 200)
    slot = slots(batch, table, SPARSE_BLOCK)
    if nd_tok:
        slot[1] = -1
    wmax, width, T = 256, 128, batch.num_tokens
    args: dict[str, Any] = {
        "positions": batch.positions, "token_to_req": batch.token_to_req, "table": table[:decodes],
        "slot": slot, "gd": sentinel((MAX_TOKENS, wmax), torch.int32), "dl": sentinel((MAX_TOKENS,), torch.int32),
        "pl": sentinel((MAX_TOKENS, wmax), torch.int32),
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    want = vllm_sparse_mla.build_c128a_topk_metadata(
        theirs["positions"][:T], 128, nd_tok, theirs["token_to_req"], theirs["table"], 2, theirs["slot"],
        theirs["gd"], theirs["dl"], theirs["pl"], max_compressed_tokens=width,
    )  # fmt: skip
    got = C128ATopkMetadata()(
        ours["positions"][:T], ours["token_to_req"], ours["table"], ours["slot"], num_decode_tokens=nd_tok,
        max_compressed_tokens=width, block_size=2, out=(ours["gd"], ours["dl"], ours["pl"]),
    )  # fmt: skip
    check = assert_view if nd_tok else assert_same  # the builder views the decode rows only when there are some
    check(got[0], want[0].view(nd_tok, 1, width), "global decode (as the builder views it)")
    assert_view(got[1], want[1], "decode lens")
    assert_view(got[2], want[2], "prefill local")
    for name in ("gd", "dl", "pl"):
        assert_same(ours[name], theirs[name], f"persistent buffer {name}")


# -- decode (and prefill) SWA indices ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rows", "replay"), [("decode", False), ("decode", True), ("prefill", False), ("image", False)]
)
def test_decode_swa_indices_equals_vllm(rows: str, replay: bool) -> None:
    """``ComputeSWAIndicesAndLensKernel`` (``v1/attention/backends/mla/sparse_swa.py``), called as
    ``DeepseekSparseSWAMetadataBuilder.build`` calls it: for the decode rows (the persistent
    ``decode_swa_indices [max_tokens, 1, W]``, MTP rows of 2 tokens, padded tokens, ``no_replay_start`` or a
    replay start) and for the prefill rows (``token_offset = num_decode_tokens``, ``index_width = W + image``, with
    the in-image visibility of a vision batch). vLLM derives each position from ``seq_lens`` and
    ``query_start_loc``; warmreg reads ``positions``, the runner's (``seq_len - qlen + i`` for every real token)."""
    g = seeded(len(rows) + replay)
    decodes = [(300, 2), (40, 2), (1000, 1), (5, 2)]
    prefills = [(0, 5), (293, 7), (10, 150)]
    batch = make_batch(decodes + prefills, pad_tokens=3, pad_reqs=1)
    nd_tok = sum(q for _, q in decodes)
    table = block_table(g, MAX_REQS, 20)
    valid = slots(batch, table, SWA_PAGE) >= 0
    valid[2] = False  # a decode token whose slot is PAD
    replay_start = torch.zeros(MAX_REQS + 1, dtype=torch.int32)  # the builder's no_replay_start
    if replay:
        replay_start[:4] = torch.tensor([250, 0, 990, 5], dtype=torch.int32)
    image = 256 if rows == "image" else 0
    width = WINDOW + image
    left = right = None
    if rows == "image":  # a span over positions 20..159 of request (10, 150): wider than the window
        left = torch.zeros(batch.positions.shape[0], dtype=torch.int32)
        right = torch.zeros_like(left)
        pos = torch.arange(20, 160)
        tok = nd_tok + 12 + pos - 10
        left[tok] = (pos - 20).clamp(max=image - 1).to(torch.int32)
        right[tok] = (159 - pos).clamp(max=image).to(torch.int32)
    if rows == "decode":
        n, offset = nd_tok + 3, 0  # with the graph's padding tokens (their slots are PAD)
        indices, lens = sentinel((MAX_TOKENS, 1, width), torch.int32), sentinel((MAX_TOKENS,), torch.int32)
        out_i, out_l = indices, lens
    else:
        n, offset = batch.num_tokens - nd_tok, nd_tok
        indices, lens = sentinel((MAX_TOKENS, 1, width), torch.int32), sentinel((MAX_TOKENS,), torch.int32)
        out_i, out_l = indices[:n], lens[:n]  # prefill_swa_indices[:num_prefill_tokens]
    args: dict[str, Any] = {
        "indices": out_i, "lens": out_l, "qsl": batch.query_start_loc, "seq_lens": batch.seq_lens,
        "token_to_req": batch.token_to_req, "valid": valid, "table": table[: batch.num_reqs + 1],
        "replay": replay_start, "positions": batch.positions, "left": left, "right": right,
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    vllm_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
        theirs["indices"], theirs["lens"], WINDOW, width,
        theirs["left"] if image else theirs["lens"], theirs["right"] if image else theirs["lens"],
        theirs["qsl"], theirs["seq_lens"], theirs["token_to_req"], theirs["valid"], theirs["table"], SWA_PAGE,
        theirs["replay"], num_tokens=n, token_offset=offset, has_image=bool(image),
    )  # fmt: skip
    DecodeSwaIndices()(
        ours["positions"], ours["token_to_req"], ours["valid"], ours["table"], ours["replay"], num_tokens=n,
        window_size=WINDOW, index_width=width, block_size=SWA_PAGE, token_offset=offset, left_visible=ours["left"],
        right_visible=ours["right"], out=(ours["indices"].view(-1, width)[:n], ours["lens"][:n]),
    )  # fmt: skip
    assert_same(ours["indices"], theirs["indices"], "swa indices (persistent buffer)")
    assert_same(ours["lens"], theirs["lens"], "swa lens (persistent buffer)")


# -- sparse-SWA prefill metadata -----------------------------------------------------------------------------
@pytest.mark.parametrize(("decodes", "prefills", "replay"), [(2, 1, False), (1, 3, False), (0, 5, True), (3, 2, True)])
def test_sparse_swa_prefill_metadata_equals_vllm(decodes: int, prefills: int, replay: bool) -> None:
    """``ComputePrefillMetadataKernel`` (``v1/attention/backends/mla/sparse_swa.py``), called as
    ``DeepseekSparseSWAMetadataBuilder._build_deepseek_v4_metadata`` calls it (``gather_lens`` a fresh
    ``torch.empty``; ``replay_start`` the ``no_replay_start`` zeros of ``max_num_seqs + 1`` or a replay start),
    1, 3 and 5 prefills (non-powers of two: clamped lanes)."""
    reqs = [(300, 2), (40, 1), (7, 2)][:decodes] + [(0, 5), (293, 7), (1000, 9), (126, 3), (5, 4)][:prefills]
    batch = make_batch(reqs, pad_reqs=2)
    replay_start = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
    if replay:
        replay_start[: len(reqs)] = torch.tensor([0, 250, 5, 990, 100][: len(reqs)], dtype=torch.int32)
    args = {"seq_lens": batch.seq_lens, "qsl": batch.query_start_loc, "replay": replay_start,
            "out": sentinel((prefills,), torch.int32)}  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    vllm_swa._COMPUTE_PREFILL_METADATA_KERNEL(
        theirs["out"], theirs["seq_lens"], theirs["qsl"], theirs["replay"], prefills, decodes, WINDOW
    )
    SparseSWAPrefillMetadata()(
        ours["seq_lens"], ours["qsl"], ours["replay"], num_decodes=decodes, num_prefills=prefills,
        window_size=WINDOW, out=ours["out"],
    )  # fmt: skip
    assert_same(ours["out"], theirs["out"], "prefill gather_lens")


# -- uniform decode flattening ----------------------------------------------------------------------------
@pytest.mark.parametrize(("decode_len", "seq_lens"), [(1, [300, 7, 1]), (2, [300, 7, 0, 0]), (3, [129, 2, 64])])
def test_prepare_uniform_decode_equals_vllm(decode_len: int, seq_lens: list[int]) -> None:
    """``PrepareUniformDecodeKernel`` (``v1/attention/backends/mla/indexer.py``), called as the indexer builder's
    ``_prepare_decode_tensors`` calls it on a uniform decode batch: the decode requests' ``seq_lens`` (0 for
    padding requests: clamped to 0, not negative) and table rows, the persistent ``decode_seq_lens_buffer``,
    ``expanded_block_table_buffer [max_tokens, W]`` and ``decode_lens_buffer``, compared in full."""
    g = seeded(decode_len)
    width = 17  # the indexer group's row width cdiv(max_model_len, 256)
    table = block_table(g, MAX_REQS, width)
    nd = len(seq_lens)
    args = {
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32), "table": table[:nd],
        "dsl": sentinel((MAX_TOKENS,), torch.int32), "ebt": sentinel((MAX_TOKENS, width), torch.int32),
        "dl": sentinel((MAX_TOKENS,), torch.int32),
    }  # fmt: skip
    theirs, ours = twins(**args), twins(**args)
    tokens = nd * decode_len
    vllm_indexer._PREPARE_UNIFORM_DECODE_KERNEL(
        theirs["seq_lens"], theirs["dsl"], theirs["table"], theirs["ebt"], theirs["dl"], tokens, decode_len
    )
    PrepareUniformDecode()(
        ours["seq_lens"], ours["table"], max_decode_len=decode_len, out=(ours["dsl"], ours["ebt"], ours["dl"])
    )
    for name in ("dsl", "ebt", "dl"):
        assert_same(ours[name], theirs[name], name)


# -- the core's block-table slot mapping --------------------------------------------------------------------
GROUP_BLOCK_SIZES = (64, 256, 4, 8)  # DeepSeek-V4's groups: SWA, compressed caches and indexer, C4 / C128 states


def _v2_block_tables(tables: list[torch.Tensor], cp: tuple[int, int, int]) -> Any:
    """The V2 runner's ``BlockTables`` holding ``tables`` (its constructor needs a GPU: the fields
    ``compute_slot_mappings`` reads are set as ``__init__`` / ``init_block_table_layout_tensors`` set them)."""
    world, rank, interleave = cp
    bt = object.__new__(vllm_block_tables_v2.BlockTables)
    bt.device, bt.num_kv_cache_groups, bt.block_sizes = torch.device("cpu"), len(tables), list(GROUP_BLOCK_SIZES)
    bt.cp_size, bt.cp_rank, bt.cp_interleave = world, rank, interleave
    bt.slot_mappings = sentinel((len(tables), MAX_TOKENS), torch.int64)
    bt.warmreg_tables = tables  # keeps the tables alive: the kernel reads them through raw addresses
    bt.block_table_ptrs = bt._make_ptr_tensor(tables)
    bt.block_table_strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64)
    bt.block_sizes_tensor = torch.tensor(GROUP_BLOCK_SIZES, dtype=torch.int32)
    bt.slot_mapping_enabled = torch.ones(len(tables), dtype=torch.bool)
    bt.dcp_sharded = torch.ones(len(tables), dtype=torch.bool)
    return bt


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize(
    ("dcp", "empty"),
    [((1, 0, 1), False), ((2, 1, 4), False), ((1, 0, 1), True)],  # DCP rank 1 of 2; no token
)
def test_block_table_slot_mapping_equals_vllm(runner: str, dcp: tuple[int, int, int], empty: bool) -> None:
    """The slot mapping of each DeepSeek-V4 KV-cache group, against both of vLLM 0.33's model runners.

    ``v1``: ``BlockTable.compute_slot_mapping`` (``v1/worker/block_table.py`` → ``ComputeSlotMappingKernel``),
    called as ``GPUModelRunner._prepare_inputs`` calls it, on a real ``BlockTable`` per group (its persistent
    ``[max_num_reqs, W]`` table, ``W`` rounded to cover a multiple of 128 tokens, and ``slot_mapping
    [max_num_batched_tokens]``, the tail past T set to -1); DCP set on the table as the DCP group would.

    ``v2`` (the default runner for DeepSeek-V4 in 0.33; DSpark needs it): ``BlockTables.compute_slot_mappings``
    (``v1/worker/gpu/block_table.py`` → ``_compute_slot_mappings_kernel``, a plain ``@triton.jit`` over all groups
    in one launch, rows read through ``idx_mapping``), compared per group with warmreg's op on the gathered input
    table (``input_block_tables``: row ``i`` = request state ``idx_mapping[i]``). Same slots and tail; a different
    kernel, so warming warmreg's op warms nothing the V2 runner launches."""
    world, rank, interleave = dcp
    g = seeded(world + len(runner))
    max_model_len = 2048
    batch = make_batch([] if empty else [(1000, 1), (62, 3), (0, 17), (255, 9), (1900, 13)])
    qsl = batch.query_start_loc[: batch.num_reqs + 1]
    positions = batch.positions[: batch.num_tokens]
    widths = [vllm_block_table.get_block_table_width(-(-max_model_len // (bs * world)), bs) for bs in GROUP_BLOCK_SIZES]
    tables = [block_table(g, MAX_REQS, w, pages=MAX_REQS * w + 1) for w in widths]
    states = torch.tensor([3, 0, 6, 1, 4][: batch.num_reqs], dtype=torch.int32)  # idx_mapping (V2): row -> state
    if runner == "v2":
        v2 = _v2_block_tables([twin(t) for t in tables], dcp)
        ours = sentinel((len(tables), MAX_TOKENS), torch.int64)
        vllm_block_tables_v2.BlockTables.compute_slot_mappings(v2, states, twin(qsl), twin(positions), MAX_TOKENS)
        theirs = v2.slot_mappings
    else:
        ours, theirs = sentinel((len(tables), MAX_TOKENS), torch.int64), []
        for bs, w, table in zip(GROUP_BLOCK_SIZES, widths, tables):
            bt = vllm_block_table.BlockTable(bs, MAX_REQS, w, MAX_TOKENS, False, torch.device("cpu"), interleave)
            bt.dcp_world_size, bt.dcp_rank = world, rank
            bt.block_table.cpu.copy_(table)
            bt.commit_block_table(MAX_REQS)
            bt.slot_mapping.gpu.copy_(sentinel((MAX_TOKENS,), torch.int64))  # stale slots of an earlier step
            bt.compute_slot_mapping(batch.num_reqs, twin(qsl), twin(positions))
            theirs.append(bt.slot_mapping.gpu)
        theirs = torch.stack(theirs)
    for i, (bs, table) in enumerate(zip(GROUP_BLOCK_SIZES, tables)):
        rows = table[states.long()] if runner == "v2" else table  # V2 reads the gathered input table
        slot_mapping = ours[i]
        got = BlockTableSlotMapping(block_sizes=(bs,), max_model_len=max_model_len)(
            twin(qsl), twin(positions), rows, slot_mapping, block_size=bs, dcp_world=world, dcp_rank=rank,
            interleave=interleave,
        )  # fmt: skip
        assert got is slot_mapping
        assert_same(slot_mapping, theirs[i], f"slot_mapping of the block-size-{bs} group (persistent buffer)")


# -- the core's fused Q/KV RMSNorm ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("q_size", "kv_size", "row", "tokens", "eps"),
    [
        (1024, 512, 1536, 3, 1e-6),  # DeepSeek-V4-Flash: views of the fused qkv_a projection
        (1536, 512, 2048, 2, 1e-6),  # DeepSeek-V4-Pro (BLOCK 2048: 8 warps)
        (1536, 512, 2112 + 2 * 128, 3, 1e-5),  # Kimi-K3: RoPE columns and an output gate between/after
        (1024, 512, 1536, 0, 1e-6),  # an empty batch: no launch
    ],
)
def test_fused_qkv_rmsnorm_equals_vllm(q_size: int, kv_size: int, row: int, tokens: int, eps: float) -> None:
    """``fused_q_kv_rmsnorm`` (``models/common/ops/fused_qk_rmsnorm.py`` → ``FusedQKVRMSNormKernel``), called as
    DeepSeek-V4's ``_split_qkv_and_norm`` calls it, on strided views of one bf16 projection; both outputs bitwise
    equal (one fp32 RMSNorm recipe, one cast at the store)."""
    g = seeded(q_size + row + tokens)
    proj = (torch.randn(tokens, row, generator=g) * 3).bfloat16()
    q_w = (torch.rand(q_size, generator=g) + 0.5).bfloat16()
    kv_w = (torch.rand(kv_size, generator=g) + 0.5).bfloat16()
    qr, kv = proj[:, :q_size], proj[:, q_size : q_size + kv_size]
    with sentinel_allocations():
        want = vllm_qk_norm.fused_q_kv_rmsnorm(qr, kv, q_w, kv_w, eps)
    out = (sentinel((tokens, q_size), torch.bfloat16), sentinel((tokens, kv_size), torch.bfloat16))
    got = FusedQKVRMSNorm(q_size=q_size, kv_size=kv_size, proj_width=row)(
        qr, kv, q_w, kv_w, eps, launch_pdl=False, out=out
    )
    assert_view(got[0], want[0], "q")
    assert_view(got[1], want[1], "kv")
