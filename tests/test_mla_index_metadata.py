"""The shared MLA index-metadata ops (``warmreg.ops``): the indexer prefill chunk metadata, the uniform decode
flattening and the compressed slot mapping, exact against their references (integer metadata: ``torch.equal``),
their out= conformance, and their warm space. Their DeepSeek-V4 and Kimi-K3 plans are tested in the plugins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import warmreg
from warmreg.ops import (
    CompressedSlotMapping,
    IndexerPrefillChunkMetadata,
    PrepareUniformDecode,
    block_table_width,
    compressed_slot_mapping_reference,
    indexer_prefill_chunk_metadata_reference,
    prepare_uniform_decode_reference,
)
from warmreg.testing import (
    OpCall,
    assert_allocates_nothing,
    assert_out_is_the_buffer_keywords,
    assert_warmup_inputs_reproduce,
    check_out,
)

I32 = torch.int32


def _batch(
    gen: torch.Generator, *, decodes: int, prefills: int, max_model_len: int, decode_len: int = 2, max_prefill: int = 12
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode-first batch: ``(query_start_loc, seq_lens)``, int32; every third sequence ends at max_model_len."""
    qlens = [int(torch.randint(1, decode_len + 1, (), generator=gen)) for _ in range(decodes)]
    qlens += [int(torch.randint(1, max_prefill + 1, (), generator=gen)) for _ in range(prefills)]
    seq_lens = [
        max_model_len if i % 3 == 0 else int(torch.randint(q, max_model_len + 1, (), generator=gen))
        for i, q in enumerate(qlens)
    ]
    qsl = torch.tensor([0, *qlens], dtype=I32).cumsum(0).to(I32)
    return qsl, torch.tensor(seq_lens, dtype=I32)


def _rand(gen: torch.Generator, shape: tuple[int, ...], high: int = 1000) -> torch.Tensor:
    return torch.randint(0, high, shape, dtype=I32, generator=gen)


# -- indexer prefill chunk metadata ---------------------------------------------------------------


def _chunk(gen: torch.Generator, n: int, cr: int, max_model_len: int) -> dict[str, Any]:
    qsl, seq = _batch(gen, decodes=0, prefills=n, max_model_len=max_model_len)
    buffer = torch.cat([_rand(gen, (1,)), seq])  # seq_lens[1:1+n] of the step: misaligned
    compressed = (seq // cr).cumsum(0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), compressed]).to(I32)
    return dict(
        query_start_loc=qsl,
        uncompressed_seq_lens=buffer[1:],
        cu_compressed_seq_lens=cu,
        num_compressed_rows=int(cu[-1]),
    )


@pytest.mark.parametrize("cr", [1, 4])
@pytest.mark.parametrize(("dcp_world", "dcp_rank", "interleave"), [(1, 0, 1), (2, 1, 2), (3, 0, 1)])
def test_prefill_chunk_metadata_matches_reference(cr: int, dcp_world: int, dcp_rank: int, interleave: int) -> None:
    gen = torch.Generator().manual_seed(cr * 7 + dcp_world)
    chunk = _chunk(gen, 4, cr, max_model_len=60)
    total = int(chunk["query_start_loc"][-1])
    dcp = dict(compress_ratio=cr, dcp_rank=dcp_rank, dcp_world=dcp_world, dcp_interleave=interleave)
    row_start = _rand(gen, (4,))  # a separate base (DCP-local cumsum)
    for qs0, qs1, rows in [(0, total, None), (1, total - 1, row_start), (0, 1, None)]:
        args = dict(chunk, **dcp, query_slice_start=qs0, query_slice_stop=qs1)
        got = IndexerPrefillChunkMetadata()(row_start_cu=rows, **args)
        want = indexer_prefill_chunk_metadata_reference(row_start_cu=rows, **args)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (qs0, qs1)


def test_prefill_chunk_metadata_sub_slice_of_one_long_request() -> None:
    """A request cut along M (qs0 > 0) near max_model_len, compressed rows far past one tile."""
    seq = torch.tensor([0, 5000], dtype=I32)[1:]  # misaligned view
    qsl = torch.tensor([0, 30], dtype=I32)
    cu = torch.tensor([0, 5000 // 4], dtype=I32)
    args: dict[str, Any] = dict(num_compressed_rows=1250, query_slice_start=17, query_slice_stop=29, compress_ratio=4)
    got = IndexerPrefillChunkMetadata()(qsl, seq, cu, **args)
    want = indexer_prefill_chunk_metadata_reference(qsl, seq, cu, **args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[2].tolist()[-1] == (5000 - 30 + 1 + 28) // 4


def test_prefill_chunk_metadata_empty_chunk_and_bad_slice() -> None:
    empty = torch.zeros(1, dtype=I32)
    out = IndexerPrefillChunkMetadata()(
        empty, empty[:0], empty, num_compressed_rows=0, query_slice_stop=0, compress_ratio=4
    )
    assert [t.numel() for t in out] == [0, 0, 0]
    with pytest.raises(warmreg.LaunchError, match="empty"):
        IndexerPrefillChunkMetadata()(
            torch.tensor([0, 2], dtype=I32), torch.tensor([5], dtype=I32), torch.tensor([0, 1], dtype=I32),
            num_compressed_rows=1, query_slice_start=2, query_slice_stop=2, compress_ratio=4,
        )  # fmt: skip


# -- uniform decode flattening --------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3])
def test_uniform_decode_matches_reference(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    seq_lens = torch.tensor([1, 7, 0, 40, 2], dtype=I32)  # 0: a padded request; 1 < d: clamped lengths
    table = _rand(gen, (6, 7))
    got = PrepareUniformDecode()(seq_lens, table, max_decode_len=d)
    want = prepare_uniform_decode_reference(seq_lens, table, max_decode_len=d)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_uniform_decode_into_persistent_buffers() -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens, table = torch.tensor([9, 3], dtype=I32), _rand(gen, (2, 9))
    buffers = dict(
        decode_seq_lens=torch.full((8,), -5, dtype=I32),
        expanded_block_table=torch.full((8, 5), -5, dtype=I32),  # EW = 5 of the table's 9 columns
        decode_lens=torch.full((8,), -5, dtype=I32),
    )
    got = PrepareUniformDecode()(seq_lens, table, max_decode_len=2, **buffers)
    want = prepare_uniform_decode_reference(seq_lens, table, max_decode_len=2, width=5)
    for g, w in zip(got, want):
        assert torch.equal(g[:4], w) and bool((g[4:] == -5).all())  # rows past T_d untouched
    # No decodes: no launch.
    assert PrepareUniformDecode()(seq_lens[:0], table, max_decode_len=2)[0].numel() == 0


# -- compressed slot mapping -----------------------------------------------------------------------


@pytest.mark.parametrize(("cr", "dcp_world", "interleave"), [(4, 1, 1), (128, 1, 1), (4, 2, 8), (4, 1, 4)])
def test_compressed_slot_mapping_matches_reference(cr: int, dcp_world: int, interleave: int) -> None:
    gen = torch.Generator().manual_seed(cr + dcp_world)
    max_model_len, block_size = 600, 256 // cr
    written = 0
    for decodes, prefills in [(5, 0), (0, 3), (4, 3)]:
        qsl, seq_lens = _batch(gen, decodes=decodes, prefills=prefills, max_model_len=max_model_len, max_prefill=300)
        num_tokens = int(qsl[-1])
        slots = torch.randint(0, 10**6, (num_tokens + 3,), generator=gen)
        slots[torch.rand(num_tokens + 3, generator=gen) < 0.2] = -1  # PAD: padding, replay, other DCP ranks
        table = _rand(gen, (decodes + prefills, block_table_width(max_model_len, 256)))
        kw = dict(
            num_tokens=num_tokens,
            block_size=block_size,
            compress_ratio=cr,
            dcp_world_size=dcp_world,
            cp_interleave=interleave,
        )
        out = torch.zeros(num_tokens + 4, dtype=torch.int64)  # persistent: the tail is reset to -1
        got = CompressedSlotMapping(compress_ratios=(cr,))(slots, qsl, seq_lens, table, out=out, **kw)
        assert torch.equal(got, compressed_slot_mapping_reference(slots, qsl, seq_lens, table, **kw))
        assert bool((out[num_tokens:] == -1).all())
        written += int((got >= 0).sum())
    assert written > 0


def test_compressed_slot_mapping_small_batches() -> None:
    kernel = CompressedSlotMapping(compress_ratios=(4,))
    slots, table = torch.arange(8), torch.tensor([[3, 5]], dtype=I32)
    # T = 1: position 7 closes state 1 of block 3 (64 states per block).
    got = kernel(
        slots,
        torch.tensor([0, 1], dtype=I32),
        torch.tensor([8], dtype=I32),
        table,
        num_tokens=1,
        block_size=64,
        compress_ratio=4,
    )
    assert got.tolist() == [3 * 64 + 1]
    # A batch that starts at token 2 of a persistent buffer: the slots before and after it are reset to -1 too.
    out = torch.zeros(5, dtype=torch.int64)
    kernel(slots, torch.tensor([2, 3], dtype=I32), torch.tensor([8], dtype=I32), table, num_tokens=4, block_size=64,
           compress_ratio=4, out=out)  # fmt: skip
    assert out.tolist() == [-1, -1, 3 * 64 + 1, -1, -1]
    # T = 0: no rows; the kernel's last program alone resets a persistent buffer to -1.
    out = torch.zeros(3, dtype=torch.int64)
    kernel(
        slots,
        torch.zeros(1, dtype=I32),
        table[:0, 0],
        table[:0],
        num_tokens=0,
        block_size=64,
        compress_ratio=4,
        out=out,
    )
    assert out.tolist() == [-1, -1, -1]
    with pytest.raises(warmreg.LaunchError, match="multiple of 4"):
        kernel(
            slots,
            table[0],
            table[0, :1],
            table,
            num_tokens=1,
            block_size=64,
            compress_ratio=4,
            dcp_world_size=2,
            cp_interleave=2,
        )


@pytest.mark.gpu
def test_compressed_slot_mapping_compiled_on_the_gpu_matches_reference() -> None:
    """The compiled kernel (not the interpreter): every request row's program and the last program's -1 fill of the
    unowned slots run side by side on the GPU, over batches that start past token 0 of a persistent buffer."""
    gen = torch.Generator().manual_seed(2026)
    dev = torch.device("cuda")
    cases = [(cr, w, i) for cr, w, i in [(4, 1, 1), (128, 1, 1), (4, 2, 8), (4, 1, 4), (1, 1, 1)] for _ in range(5)]
    for cr, dcp_world, interleave in cases:
        block_size = 64 if cr == 1 else 256 // cr
        decodes, prefills = (int(x) for x in torch.randint(0, 40, (2,), generator=gen))
        qsl, seq_lens = _batch(gen, decodes=decodes, prefills=prefills + 1, max_model_len=4096, max_prefill=700)
        lead = int(torch.randint(0, 9, (), generator=gen))  # the batch starts at token `lead` of the buffer
        qsl = qsl + lead
        num_tokens = int(qsl[-1])
        slots = torch.randint(0, 10**6, (num_tokens + 5,), generator=gen)
        slots[torch.rand(num_tokens + 5, generator=gen) < 0.2] = -1
        table = _rand(gen, (decodes + prefills + 1, block_table_width(4096, block_size * cr)))
        kw = dict(num_tokens=num_tokens, block_size=block_size, compress_ratio=cr, dcp_world_size=dcp_world,
                  cp_interleave=interleave)  # fmt: skip
        out = torch.full((num_tokens + 300,), 7, dtype=torch.int64, device=dev)
        kernel = CompressedSlotMapping(compress_ratios=(cr,), cache_block_size=block_size * max(cr, 1))
        got = kernel(slots.to(dev), qsl.to(dev), seq_lens.to(dev), table.to(dev), out=out, **kw)
        want = compressed_slot_mapping_reference(slots, qsl, seq_lens, table, **kw)
        assert got.is_cuda and torch.equal(got.cpu(), want), (cr, dcp_world, interleave, decodes, prefills, lead)
        assert bool((out[num_tokens:] == -1).all()) and bool((out[:lead] == -1).all())


def test_compressed_slot_mapping_ratio_one_is_the_kernel_page_slot() -> None:
    """Ratio 1 (Kimi-K3.1's DSA indexer): every token with a slot gets ``table[b, p // bs] * bs + p % bs`` of its
    kernel-page table; PAD slots stay -1."""
    gen = torch.Generator().manual_seed(11)
    qsl, seq_lens = _batch(gen, decodes=3, prefills=2, max_model_len=500, max_prefill=100)
    n = int(qsl[-1])
    slots = torch.randint(0, 10**6, (n,), generator=gen)
    slots[::5] = -1
    table = _rand(gen, (5, block_table_width(500, 64)))
    kw = dict(num_tokens=n, block_size=64, compress_ratio=1)
    got = CompressedSlotMapping(compress_ratios=(1,), cache_block_size=64)(slots, qsl, seq_lens, table, **kw)
    want = torch.full((n,), -1, dtype=torch.int64)
    for b in range(5):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        for t in range(lo, hi):
            p = int(seq_lens[b]) - (hi - lo) + (t - lo)
            if slots[t] != -1:
                want[t] = int(table[b, p // 64]) * 64 + p % 64
    assert torch.equal(got, want) and torch.equal(
        got, compressed_slot_mapping_reference(slots, qsl, seq_lens, table, **kw)
    )


# -- warm space ------------------------------------------------------------------------------------------------
class _Plugin:
    """Registers the three ops as a deployment with a C4-style indexer and Kimi-style ratio-1 sites would."""

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry, config: warmreg.WarmConfig) -> None:
        registry.add(CompressedSlotMapping(compress_ratios=(1,), cache_block_size=64))
        registry.add(IndexerPrefillChunkMetadata(compress_ratios=(1,), plugin="tests"))
        registry.add(PrepareUniformDecode(table_width=block_table_width(4096, 64) * 3, max_decode_len=3))


def _plan(**serving: int) -> warmreg.Plan:
    config = {
        "model": {"model_type": "tests"},
        "serving": {"max_num_batched_tokens": 64, "max_model_len": 4096, **serving},
    }
    return warmreg.plan(config, target="cuda:90", plugins=[_Plugin()], entry_points=False)


def test_plan_keys_and_warmup_inputs() -> None:
    plan = _plan()
    counts = {k.name: len(k.keys) for k in plan.kernels}
    # chunk: slice-bound class pairs (0,1) (0,2) (0,16) (0,17) (0,32) (0,33) (1,2) ... with start < stop, x 4 alignments
    assert counts == {CompressedSlotMapping.name: 1, IndexerPrefillChunkMetadata.name: 28, PrepareUniformDecode.name: 2}
    for kp, key in plan.items():
        assert_warmup_inputs_reproduce(kp.kernel, [key])
    uniform = plan.kernel(PrepareUniformDecode.name)
    assert {k.max_decode_len for k in uniform.keys} == {"one", "other"}  # type: ignore[attr-defined]


def test_chunk_metadata_reads_its_serving_fields_for_the_registering_plugin() -> None:
    config = {"model": {"model_type": "tests"}, "serving": {"max_model_len": 4096}}
    with pytest.raises(warmreg.ConfigError, match=r"max_num_batched_tokens.*tests"):
        warmreg.plan(config, target="cuda:90", plugins=[_Plugin()], entry_points=False)


# -- out= (the kit's checks) -----------------------------------------------------------------------------------
def _indexer_chunk_metadata_call() -> OpCall:
    chunk = _chunk(torch.Generator().manual_seed(4), 4, 4, max_model_len=60)
    total = int(chunk["query_start_loc"][-1])
    return OpCall(
        IndexerPrefillChunkMetadata(),
        (),
        dict(chunk, compress_ratio=4, query_slice_start=1, query_slice_stop=total - 1),
    )


def test_chunk_metadata_out() -> None:
    """check_out: the caller's buffers come back fully written, wrong ones are refused, nothing is allocated."""
    check_out(_indexer_chunk_metadata_call, tuple_error=r"out must be a tuple of \d buffers")


def _uniform_decode_call() -> tuple[OpCall, tuple[torch.Tensor, ...]]:
    """The uniform-decode preparation with persistent buffers larger than needed (rows past T: tested above)."""
    seq_lens, table = torch.tensor([9, 3], dtype=torch.int32), _rand(torch.Generator().manual_seed(0), (2, 9))
    bufs = tuple(torch.full(shape, -5, dtype=torch.int32) for shape in ((8,), (8, 5), (8,)))
    return OpCall(PrepareUniformDecode(), (seq_lens, table), {"max_decode_len": 2}), bufs


def _compressed_slot_mapping_call() -> tuple[OpCall, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    qsl, seq_lens = _batch(gen, decodes=3, prefills=2, max_model_len=600)
    n = int(qsl[-1])
    args = (torch.randint(0, 10**6, (n,), generator=gen), qsl, seq_lens, _rand(gen, (5, 3)))
    call = OpCall(
        CompressedSlotMapping(compress_ratios=(4,)), args, dict(num_tokens=n, block_size=64, compress_ratio=4)
    )
    return call, torch.zeros(n + 4, dtype=torch.int64)


@pytest.mark.parametrize(
    "build", [_uniform_decode_call, _compressed_slot_mapping_call], ids=["uniform_decode", "compressed_slots"]
)
def test_launch_with_persistent_out_allocates_nothing(build: Callable[[], tuple[OpCall, Any]]) -> None:
    assert_allocates_nothing(*build())


def test_uniform_decode_out_tuple_is_the_buffer_keywords() -> None:
    call, bufs = _uniform_decode_call()
    assert_out_is_the_buffer_keywords(call, bufs, ("decode_seq_lens", "expanded_block_table", "decode_lens"))
