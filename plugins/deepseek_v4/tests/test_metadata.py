"""DeepSeek-V4 metadata kernels: the sparse-SWA prefill metadata exact against its reference; the plan of it and of the
shared index-metadata ops (``warmreg.ops``, tested in ``tests/test_mla_index_metadata.py``) and its warm coverage of
runtime batches."""

from __future__ import annotations

import json
from collections.abc import Iterator
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
from warmreg_deepseek_v4.swa_prefill_metadata import SparseSWAPrefillMetadata, sparse_swa_prefill_metadata_reference

import warmreg
from warmreg.ops import (
    BlockTableSlotMapping,
    CompressedSlotMapping,
    IndexerPrefillChunkMetadata,
    PrepareUniformDecode,
    block_table_width,
)
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

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


def test_out() -> None:
    """check_out: the caller's buffers come back fully written, wrong ones are refused, nothing is allocated."""
    check_out(_swa_prefill_metadata_call, tuple_error=r"out must be a tuple of \d buffers")

