"""DeepSeek-V4 metadata kernels: exact against their references, warm coverage of runtime batches."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import (
    DSV4,
    compressed_slot_mapping,
    indexer_chunk_metadata,
    slot_mapping,
    swa_prefill_metadata,
    uniform_decode,
)
from warmreg_deepseek_v4.compressed_slot_mapping import CompressedSlotMapping, compressed_slot_mapping_reference
from warmreg_deepseek_v4.indexer_chunk_metadata import (
    IndexerPrefillChunkMetadata,
    indexer_prefill_chunk_metadata_reference,
)
from warmreg_deepseek_v4.swa_prefill_metadata import SparseSWAPrefillMetadata, sparse_swa_prefill_metadata_reference
from warmreg_deepseek_v4.uniform_decode import PrepareUniformDecode, prepare_uniform_decode_reference

import warmreg
from warmreg.ops import BlockTableSlotMapping, block_table_width
from warmreg.testing import (
    OpCall,
    assert_allocates_nothing,
    assert_out_is_the_buffer_keywords,
    assert_warmup_inputs_reproduce,
    check_out,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FLASH, PRO = EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"
I32 = torch.int32
SWA_PREFILL, CHUNK = SparseSWAPrefillMetadata.name, IndexerPrefillChunkMetadata.name
UNIFORM, COMPRESSED, SLOTS = PrepareUniformDecode.name, CompressedSlotMapping.name, BlockTableSlotMapping.name
#: The metadata op modules, in the plugin's order (slot_mapping first: it refuses bad block sizes and DCP).
MODULES = (slot_mapping, swa_prefill_metadata, indexer_chunk_metadata, uniform_decode, compressed_slot_mapping)


class _Plugin:
    """Registers the metadata modules' kernels, optionally only those named."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    @warmreg.hookimpl
    def warmreg_register_kernels(
        self, registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        names = self.names

        class Only:
            def add(self, kernel: warmreg.TritonKernel[Any], *, when: Any = True) -> None:
                if not names or kernel.name in names:
                    registry.add(kernel, when=when)

        model = DSV4.from_config(config)
        for module in MODULES:
            module.register(Only(), model, config, platform)  # type: ignore[arg-type]


def _plan(config: Any, target: str = "cuda:90") -> warmreg.Plan:
    return warmreg.plan(config, target=target, plugins=[_Plugin()], entry_points=False)


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


# -- sparse-SWA prefill metadata ------------------------------------------------------------------


@pytest.mark.parametrize(("decodes", "prefills"), [(4, 0), (0, 5), (3, 1), (6, 3)])
@pytest.mark.parametrize("replay", [False, True])
def test_swa_prefill_metadata_matches_reference(decodes: int, prefills: int, replay: bool) -> None:
    gen = torch.Generator().manual_seed(decodes * 10 + prefills)
    qsl, seq_lens = _batch(gen, decodes=decodes, prefills=prefills, max_model_len=40)
    replay_start = _rand(gen, (decodes + prefills,), 40) if replay else None
    kw = dict(num_decodes=decodes, num_prefills=prefills, window_size=8)
    got = SparseSWAPrefillMetadata()(seq_lens, qsl, replay_start, **kw)
    assert got.shape == (prefills,) and torch.equal(
        got, sparse_swa_prefill_metadata_reference(seq_lens, qsl, replay_start, **kw)
    )


def test_swa_prefill_metadata_single_token_and_padded_buffers() -> None:
    # T = 1: one prefill of one token; the inputs are longer persistent buffers (graph padding).
    qsl = torch.tensor([0, 1, 0, 0], dtype=I32)
    seq_lens = torch.tensor([300, 0, 0], dtype=I32)  # context 299: the window caps it
    got = SparseSWAPrefillMetadata()(seq_lens, qsl, num_decodes=0, num_prefills=1, window_size=128)
    assert got.tolist() == [1 + 127]
    with pytest.raises(warmreg.LaunchError, match="fewer than 4"):
        SparseSWAPrefillMetadata()(seq_lens, qsl, num_decodes=1, num_prefills=3, window_size=128)


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
    args = dict(num_compressed_rows=1250, query_slice_start=17, query_slice_stop=29, compress_ratio=4)
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
    # T = 0: no rows, no launch, a persistent buffer still reset to -1.
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


# -- registration and warm coverage ---------------------------------------------------------------


@pytest.mark.parametrize(("example", "counts"), [(FLASH, (4, 9, 28, 2, 2)), (PRO, (4, 8, 28, 2, 2))])
def test_plan_key_counts(example: Path, counts: tuple[int, ...]) -> None:
    plan = _plan(example)
    assert tuple(len(plan.kernel(n).keys) for n in (SLOTS, SWA_PREFILL, CHUNK, UNIFORM, COMPRESSED)) == counts


def _runtime_steps(config: warmreg.WarmConfig, gen: torch.Generator) -> Iterator[dict[str, int]]:
    """Realistic step shapes: decode-first batches within max_num_seqs and max_num_batched_tokens."""
    seqs, tokens = config.serving["max_num_seqs"], config.serving["max_num_batched_tokens"]
    d = 1 + config.serving.get("num_speculative_tokens", 0)
    for _ in range(40):
        decodes = int(torch.randint(0, seqs + 1, (), generator=gen))
        prefills = int(torch.randint(0, seqs - decodes + 1, (), generator=gen))
        prefill_tokens = int(torch.randint(prefills, max(prefills, tokens - decodes * d) + 1, (), generator=gen))
        yield dict(decodes=decodes, prefills=prefills, prefill_tokens=prefill_tokens, d=d)
    yield dict(decodes=0, prefills=min(seqs, tokens), prefill_tokens=tokens, d=d)  # the largest prefill batch
    yield dict(decodes=seqs, prefills=0, prefill_tokens=0, d=d)  # a full decode batch


@pytest.mark.parametrize("example", [FLASH, PRO])
def test_plan_covers_runtime_batches(example: Path) -> None:
    config = warmreg.WarmConfig.load(example)
    plan, gen = _plan(config), torch.Generator().manual_seed(1)
    keys = {name: set(plan.kernel(name).keys) for name in (SLOTS, SWA_PREFILL, CHUNK, UNIFORM, COMPRESSED)}
    kernels = {name: plan.kernel(name).kernel for name in keys}
    seqs, tokens, max_len = (config.serving[f] for f in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    model = DSV4.from_config(config)
    persistent_seq_lens = warmreg.meta((seqs,), I32)
    indexer_width = block_table_width(max_len, 256)
    # Slot mapping: each group's persistent table, sliced to the step's requests.
    for bs in (64, 256, 4, 8):
        table = warmreg.meta((seqs, block_table_width(max_len, bs)), I32)
        for rows in (1, 3, seqs):
            key = kernels[SLOTS].dispatch(
                block_size=bs, block_table=table[:rows], dcp_world=1, dcp_rank=0, interleave=1
            )
            assert key in keys[SLOTS]
    for step in _runtime_steps(config, gen):
        if step["prefills"]:
            assert kernels[SWA_PREFILL].dispatch(num_prefills=step["prefills"]) in keys[SWA_PREFILL]
            # Indexer chunks: seq_lens[start:end] of the step (any start), a fresh cumsum, a slice.
            start = step["decodes"] + int(torch.randint(0, step["prefills"], (), generator=gen))
            qs0 = (
                0
                if torch.rand((), generator=gen) < 0.5
                else int(torch.randint(0, step["prefill_tokens"], (), generator=gen))
            )
            qs1 = int(torch.randint(qs0 + 1, step["prefill_tokens"] + 1, (), generator=gen))
            key = kernels[CHUNK].dispatch(
                uncompressed_seq_lens=persistent_seq_lens[start:], cu_compressed_seq_lens=warmreg.meta((3,), I32),
                query_slice_start=qs0, query_slice_stop=qs1, compress_ratio=4, dcp_rank=0, dcp_world=1, dcp_interleave=1,
            )  # fmt: skip
            assert key in keys[CHUNK], key
        if step["decodes"]:
            for d in range(1, step["d"] + 1):  # a uniform batch of d tokens per request
                bt = warmreg.meta((seqs, indexer_width), I32)[: step["decodes"]]
                expanded = warmreg.meta((tokens, indexer_width), I32)
                assert (
                    kernels[UNIFORM].dispatch(block_table=bt, expanded_block_table=expanded, max_decode_len=d)
                    in keys[UNIFORM]
                )
    for cr in sorted({r for r in model.ratios if r > 1}):  # the sparse-MLA builder, then the indexer
        key = kernels[COMPRESSED].dispatch(compress_ratio=cr, block_size=256 // cr, dcp_world_size=1, cp_interleave=1)
        assert key in keys[COMPRESSED]


def test_interleave_adds_the_indexer_binary_of_the_compressed_slot_mapping() -> None:
    plan = _plan(warmreg.WarmConfig.load(FLASH, serving={"cp_kv_cache_interleave_size": 8}))
    keys, kernel = set(plan.kernel(COMPRESSED).keys), plan.kernel(COMPRESSED).kernel
    assert len(keys) == 3  # MLA builder: (4, 1, 1), (128, 1, 1); indexer: (4, 1, 8)
    assert kernel.dispatch(compress_ratio=4, block_size=64, dcp_world_size=1, cp_interleave=8) in keys
    assert kernel.dispatch(compress_ratio=4, block_size=64, dcp_world_size=1, cp_interleave=1) in keys


def test_warmup_inputs_reproduce_every_planned_key() -> None:
    """What warm feeds the launch code gives back each key (the launch itself is checked by warm below)."""
    for kp, key in _plan(FLASH).items():
        assert_warmup_inputs_reproduce(kp.kernel, [key])


def test_registration_follows_model_and_platform() -> None:
    data = json.loads(FLASH.read_text())
    data["model"]["compress_ratios"] = [0 if r == 4 else r for r in data["model"]["compress_ratios"]]
    no_c4 = _plan(data)  # SWA + C128 only: no indexer kernels, no C4 compressor-state group
    names = {k.name for k in no_c4.kernels}
    assert CHUNK not in names and UNIFORM not in names
    assert {k.block_size for k in no_c4.kernel(SLOTS).keys} == {64, 256, 8}  # type: ignore[attr-defined]
    assert {k.compress_ratio for k in no_c4.kernel(COMPRESSED).keys} == {128}  # type: ignore[attr-defined]
    # DCP is possible without C4 layers: each group's slot mapping then gets one binary per rank.
    dcp = _plan(
        warmreg.WarmConfig.load(data, serving={"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4})
    )
    assert len(dcp.kernel(SLOTS).keys) == 3 * 2
    sm100 = _plan(FLASH, target="cuda:100+deepgemm")  # the varlen DeepGEMM path serves decode
    assert UNIFORM not in {k.name for k in sm100.kernels}
    assert UNIFORM in {k.name for k in _plan(FLASH, target="rocm:gfx942").kernels}
    with pytest.raises(warmreg.ConfigError, match="block_size"):
        _plan(warmreg.WarmConfig.load(FLASH, serving={"block_size": 128}))
    with pytest.raises(warmreg.ConfigError, match="decode_context_parallel_size"):
        _plan(warmreg.WarmConfig.load(FLASH, serving={"decode_context_parallel_size": 2}))


def _warm(config: Any, *names: str) -> warmreg.WarmReport:
    report = warmreg.warm(
        config, target="cuda:90", plugins=[_Plugin(*names)], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    return report


def test_warm_prefill_chunk_variants() -> None:
    # 2 batched tokens: slices (0, 1), (0, 2), (1, 2) -> 3 class pairs x 4 alignments, incl. constexpr 1s.
    report = _warm(warmreg.WarmConfig.load(FLASH, serving={"max_num_batched_tokens": 2}), CHUNK)
    assert report.compiled == 12


def test_warm_the_other_metadata_kernels() -> None:
    # 2 sequences: SWA prefill blocks 1 and 2; then 4 slot-mapping groups, 2 uniform decode, 2 compressed.
    report = _warm(warmreg.WarmConfig.load(PRO, serving={"max_num_seqs": 2}), SWA_PREFILL, SLOTS, UNIFORM, COMPRESSED)
    assert report.compiled == 10


# -- out= (the kit's checks) -----------------------------------------------------------------------------------
def _swa_prefill_metadata_call() -> OpCall:
    gen = torch.Generator().manual_seed(3)
    qsl, seq_lens = _batch(gen, decodes=3, prefills=2, max_model_len=40)
    kw = dict(num_decodes=3, num_prefills=2, window_size=8)
    return OpCall(SparseSWAPrefillMetadata(), (seq_lens, qsl, _rand(gen, (5,), 40)), kw)


def _indexer_chunk_metadata_call() -> OpCall:
    chunk = _chunk(torch.Generator().manual_seed(4), 4, 4, max_model_len=60)
    total = int(chunk["query_start_loc"][-1])
    return OpCall(IndexerPrefillChunkMetadata(), (), dict(chunk, compress_ratio=4, query_slice_start=1, query_slice_stop=total - 1))


@pytest.mark.parametrize("build", [_swa_prefill_metadata_call, _indexer_chunk_metadata_call], ids=["swa_prefill", "indexer_chunk"])
def test_out(build: Callable[[], OpCall]) -> None:
    """check_out: the caller's buffers come back fully written, wrong ones are refused, nothing is allocated."""
    check_out(build, tuple_error=r"out must be a tuple of \d buffers")


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
    call = OpCall(CompressedSlotMapping(compress_ratios=(4,)), args, dict(num_tokens=n, block_size=64, compress_ratio=4))
    return call, torch.zeros(n + 4, dtype=torch.int64)


@pytest.mark.parametrize("build", [_uniform_decode_call, _compressed_slot_mapping_call], ids=["uniform_decode", "compressed_slots"])
def test_launch_with_persistent_out_allocates_nothing(build: Callable[[], tuple[OpCall, Any]]) -> None:
    assert_allocates_nothing(*build())


def test_uniform_decode_out_tuple_is_the_buffer_keywords() -> None:
    call, bufs = _uniform_decode_call()
    assert_out_is_the_buffer_keywords(call, bufs, ("decode_seq_lens", "expanded_block_table", "decode_lens"))
