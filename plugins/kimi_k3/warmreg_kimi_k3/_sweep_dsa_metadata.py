"""The Kimi-K3 sweep's DSA metadata step (:mod:`.dsa_index_metadata`): once a step, what the DSA indexer's metadata
builder and the sparse MLA attention launch of the shared ``warmreg.ops`` kernels, like vLLM 0.34's forward.

``KimiK3IndexerMetadataBuilder.build`` first maps the step's manager slots onto the indexer's 64-token kernel pages
(the compressed slot mapping at ratio 1, into its persistent buffer); ``DeepseekV32IndexerMetadataBuilder`` then builds
the prefill chunk's K windows (the step's prefill requests as one chunk, every query in one slice) and flattens a
uniform decode batch into one-token rows over the persistent expanded table. The attention converts the indexer's
per-request top-k ids into cache rows of the 64-token pages: the mixed batch without counts, or the separate decode
with counts and the prefill rows into the upconverted workspace, whichever the plan holds.
"""

from __future__ import annotations

from typing import Any

import torch

from warmreg.ops import (
    compressed_slot_mapping_reference,
    indexer_prefill_chunk_metadata_reference,
    prepare_uniform_decode_reference,
    sparse_mla_index_remap_reference,
)
from warmreg.testing.sweep import Step, Sweep

from .backends import kv_block_size
from .dsa_index_metadata import KERNEL_PAGE, dsa_kernel_table_width
from .model import KimiK3

__all__ = ["DSA_METADATA", "DSAMetadataStep"]

I32, I64 = torch.int32, torch.int64
CSLOTS, CHUNK, UNIFORM, REMAP = (
    "warmreg.ops." + n
    for n in ("compressed_slot_mapping", "indexer_prefill_chunk_metadata", "prepare_uniform_decode", "sparse_mla_index_remap")
)
#: The kernels this step drives.
DSA_METADATA = frozenset({CSLOTS, CHUNK, UNIFORM, REMAP})


class DSAMetadataStep:
    """The persistent state of the DSA metadata kernels in one sweep: the kernel-page block table, the builders'
    buffers, and the attention's conversion mode read from the plan."""

    def __init__(self, sw: Sweep[Any]) -> None:
        self.sw, lim, cfg = sw, sw.lim, sw.cfg
        m = KimiK3.from_config(cfg)
        self.manager_block = kv_block_size(m, cfg)
        self.table = sw.block_table(dsa_kernel_table_width(m, cfg))
        self.slot_buf = torch.full((lim.max_tokens,), -1, dtype=I64, device=sw.dev)
        rows = min(lim.max_seqs * (1 + lim.spec), lim.max_tokens)  # the builder's expanded table
        self.uniform_buf = {
            "decode_seq_lens": torch.zeros(lim.max_tokens, dtype=I32, device=sw.dev),
            "expanded_block_table": torch.zeros(rows, self.table.shape[1], dtype=I32, device=sw.dev),
            "decode_lens": torch.zeros(lim.max_tokens, dtype=I32, device=sw.dev),
        }
        self.interleave = int(cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        self.dcp = int(cfg.serving.get("decode_context_parallel_size", 1) or 1)
        keys = list(sw.plan.kernel(REMAP).keys) if REMAP in sw.names else []
        self.separate = any(k.has_prefill for k in keys)  # type: ignore[attr-defined]
        self.topk = keys[0].num_topk if keys else 0  # type: ignore[attr-defined]
        self.steps = 0

    def run(self, st: Step) -> None:
        """The builder's three kernels, then the attention's top-k conversion."""
        sw, b = self.sw, st.batch
        if CSLOTS in sw.names:
            self.compressed_slots(st)
        if CHUNK in sw.names and b.num_prefills:
            self.chunk(st)
        d = b.uniform_decode_len
        if UNIFORM in sw.names and d and b.num_decodes:
            seq_lens, table = st.seq_lens[: b.num_decodes], self.table[: b.num_decodes]
            n = b.num_decodes * d  # the rows written (the builder slices its persistent buffers to them)

            def flatten() -> tuple[torch.Tensor, ...]:
                out = sw.kernel(UNIFORM)(seq_lens, table, max_decode_len=d, **self.uniform_buf)
                return tuple(x[:n] for x in out)

            sw.launch(UNIFORM, f"D={d}", flatten, ref=lambda: prepare_uniform_decode_reference(seq_lens, table, max_decode_len=d))
        if REMAP in sw.names:
            self.remap(st)
        self.steps += 1

    def compressed_slots(self, st: Step) -> None:
        """The indexer builder's kernel-page slots of the step's tokens (ratio 1), from the group's manager slots."""
        sw, t = self.sw, st.batch.tokens
        uncompressed = st.slots.get(self.manager_block)
        if uncompressed is None:  # the group's slot mapping was not launched: its positions, no PAD
            uncompressed = st.positions.clone()
        table = self.table[: len(st.batch.qlens)]
        kw: dict[str, Any] = dict(num_tokens=t, block_size=KERNEL_PAGE, compress_ratio=1, dcp_world_size=self.dcp,
                                  cp_interleave=self.interleave)  # fmt: skip
        sw.launch(CSLOTS, "DSA indexer slots", lambda: sw.kernel(CSLOTS)(uncompressed, st.qsl, st.seq_lens, table,
                  out=self.slot_buf, **kw), ref=lambda: compressed_slot_mapping_reference(
                  uncompressed, st.qsl, st.seq_lens, table, **kw))  # fmt: skip

    def chunk(self, st: Step) -> None:
        """The prefill requests as one indexer chunk (ratio 1: a K row per context token), all queries one slice."""
        sw, b = self.sw, st.batch
        a, e = b.num_decodes, len(b.qlens)
        qsl = st.qsl[a : e + 1] - st.qsl[a]  # rebased to the chunk: a fresh tensor
        cu = torch.tensor([0, *b.seqs[a:e]], dtype=I64).cumsum(0).to(I32).to(sw.dev)
        kw: dict[str, Any] = dict(num_compressed_rows=sum(b.seqs[a:e]), query_slice_start=0,
                                  query_slice_stop=sum(b.qlens[a:e]), compress_ratio=1, dcp_world=self.dcp,
                                  dcp_interleave=self.interleave)  # fmt: skip
        sw.launch(CHUNK, f"requests [{a}, {e})", lambda: sw.kernel(CHUNK)(qsl, st.seq_lens[a:e], cu, **kw),
                  ref=lambda: indexer_prefill_chunk_metadata_reference(qsl, st.seq_lens[a:e], cu, **kw))  # fmt: skip

    def remap(self, st: Step) -> None:
        """The attention's conversion of the step's top-k ids (each token's ids below its sequence length, some -1)."""
        sw, b = self.sw, st.batch
        ctx = st.seq_lens.long()[st.token_to_req.long()]
        ids = (torch.rand(b.tokens, self.topk, generator=sw.gen, device=sw.dev) * ctx[:, None]).to(I32)
        ids[torch.rand(b.tokens, self.topk, generator=sw.gen, device=sw.dev) < 0.25] = -1
        kw: dict[str, Any] = dict(block_size=KERNEL_PAGE)
        if self.separate:
            kw["return_valid_counts"] = True
            if b.num_prefills:  # prefill rows into the workspace: request j of the prefills starts at its cumsum
                prefill = st.token_to_req - b.num_decodes
                kw["prefill_workspace_request_ids"] = torch.where(prefill >= 0, prefill, -1).to(I32)
                starts = torch.tensor([0, *b.seqs[b.num_decodes :]], dtype=I64).cumsum(0)[:-1]
                kw["prefill_workspace_starts"] = starts.to(I32).to(sw.dev)
        elif self.dcp > 1:  # the DCP filter, with counts (use_topk_length) on every other step
            counted = self.steps % 2 == 1
            kw.update(dcp_size=self.dcp, dcp_interleave=self.interleave, return_valid_counts=counted,
                      compact_to_front=counted)  # fmt: skip
        req, table = st.token_to_req, self.table
        sw.launch(REMAP, f"{b.tokens} tokens", lambda: sw.kernel(REMAP)(req, table, ids, **kw),
                  ref=lambda: sparse_mla_index_remap_reference(req, table, ids, **kw))  # fmt: skip
