"""What a DeepSeek-V4 engine keeps and builds for the zero-JIT sweep: caches, buffers and per-step metadata.

:class:`DSV4Engine` is the state half of the sweep driver :class:`~warmreg_deepseek_v4.sweep.DSV4Sweep`. It holds
persistent block tables ``[max_num_seqs, width(max_model_len)]`` of random, valid block ids of caches of a few
hundred pages; ``fp8_ds_mla`` pages of e4m3 bytes, bf16 RoPE parts and UE8M0 scales; FP8 (or MXFP4) indexer pages
at the allocator's page stride; fp32 compressor states; the metadata builders' persistent buffers; and the DSpark
speculator's, and the V2 runner's forward-pass block tables. Once a step it launches the per-step metadata: the
runner's block-table gather, the compressed slot mappings (the sparse-MLA builder's per ratio, and the C4 indexer's
site), the C128A metadata, the decode SWA indices, the sparse-SWA prefill metadata
and the uniform-decode flattening, and it plans the indexer's prefill chunks. A launch that misses or fails is
recorded, and the metadata it should have produced is computed in PyTorch for the kernels downstream; so is metadata
whose kernel the plan lacks where a planned kernel reads it (ROCm's compactions of the decode SWA and C128 rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import warmreg
from warmreg.ops import block_table_width, compressed_slot_mapping_reference
from warmreg.testing.sweep import Batch, Limits, Step, Sweep

from .dspark import DSparkDraft
from .dspark_inputs import DraftInputs
from .fp8_ds_mla import FP8_MAX, NOPE_DIM, ROPE_DIM, SCALE_BYTES, TOKEN_BYTES, page_bytes
from .gather_block_tables import block_table_pointers, gather_block_tables_reference
from .indexer import indexer_page_stride, mxfp4_indexer, token_bytes
from .inv_rope_quant import fp8_checkpoint
from .metadata import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from .model import DSV4, SPARSE_BLOCK_SIZE, SWA_PAGE_SIZE
from .sparse_mla import (
    FLASHINFER_SPARSE,
    attention_backend,
    c128_active_width,
    c128_max_width,
    c128_topk_metadata_reference,
    compressed_block_size,
)
from .swa_indices import decode_swa_indices_reference
from .swa_prefill_metadata import sparse_swa_prefill_metadata_reference

__all__ = [
    "BF16", "CHUNK_META", "COMBINE", "CSLOTS", "DSV4_PREFIX", "F32", "GATHER", "I32", "I64", "KV", "SAVE", "STATE",
    "SWA", "U8", "UNIFORM",
    "DSV4Engine", "DSV4Step", "chunks", "fp8_ds_mla_cache", "rope_cache",
]  # fmt: skip

I32, I64, BF16, F32, U8 = torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.uint8
DSV4_PREFIX = "deepseek_v4."
GATHER, COMBINE, SAVE = (DSV4_PREFIX + n for n in ("dequant_gather_k_cache", "combine_topk_swa_indices", "save_partial_states"))
#: The shared MLA index-metadata ops (``warmreg.ops``) the DeepSeek-V4 plugin plans.
CSLOTS, CHUNK_META, UNIFORM = (
    "warmreg.ops." + n for n in ("compressed_slot_mapping", "indexer_prefill_chunk_metadata", "prepare_uniform_decode")
)
#: KV-cache groups by block size: the SWA cache (64-token pages), the compressed and indexer caches (256 raw
#: tokens a block: their uncompressed slots) and the compressor states of C4 and C128 layers.
SWA, KV, STATE = SWA_PAGE_SIZE, SPARSE_BLOCK_SIZE, {4: C4_STATE_BLOCK_SIZE, 128: C128_STATE_BLOCK_SIZE}


@dataclass(kw_only=True)
class DSV4Step(Step):
    """A DeepSeek-V4 step: the engine's tensors and the per-step metadata its layers share."""

    gather_host: list[int]  # the prefills' sparse-SWA gather lens (the builder's CPU copy)
    cslots: dict[str, torch.Tensor] = field(default_factory=dict)  # call site -> compressed slots, int64 [T]
    gather_lens: torch.Tensor | None = None  # int32 [num_prefills]
    prefill_local: torch.Tensor | None = None  # C128A local indices of the prefill tokens, int32 [T - nd, W]
    topk: torch.Tensor | None = None  # the C4 indexer's local top-k, int32 [T, index_topk]
    swa_decode: tuple[torch.Tensor, torch.Tensor] | None = None  # decode SWA slots [Td, window] and lens [Td]
    c128_decode: tuple[torch.Tensor, torch.Tensor] | None = None  # C128A decode slots [Td, 1, W] and lens [Td]


def chunks(rows: list[int], budget: int) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` of consecutive requests with ``count * max(rows) <= budget`` (one request always fits)."""
    out: list[tuple[int, int]] = []
    start, widest = 0, 0
    for i, r in enumerate(rows):
        if i > start and (i - start + 1) * max(widest, r) > budget:
            out.append((start, i))
            start, widest = i, 0
        widest = max(widest, r)
    if rows:
        out.append((start, len(rows)))
    return out


def fp8_ds_mla_cache(pages: int, block_size: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``fp8_ds_mla`` pages (uint8 ``[pages, page_bytes]``): e4m3 NoPE bytes, bf16 RoPE part, UE8M0 scales near 1."""
    cache = torch.zeros(pages, page_bytes(block_size), dtype=U8, device=dev)
    tokens = cache[:, : block_size * TOKEN_BYTES].view(pages, block_size, TOKEN_BYTES)
    nope = torch.randn(pages, block_size, NOPE_DIM, generator=gen, device=dev).mul_(64)
    tokens[..., :NOPE_DIM] = nope.clamp_(-FP8_MAX[False], FP8_MAX[False]).to(torch.float8_e4m3fn).view(U8)
    tokens[..., NOPE_DIM:] = torch.randn(pages, block_size, ROPE_DIM, generator=gen, device=dev).to(BF16).view(U8)
    scales = cache[:, block_size * TOKEN_BYTES : block_size * (TOKEN_BYTES + SCALE_BYTES)]
    exponents = torch.randint(117, 137, (pages, block_size, SCALE_BYTES - 1), generator=gen, device=dev)
    scales.view(pages, block_size, SCALE_BYTES)[..., :-1] = exponents.to(U8)  # the pad byte stays 0
    return cache


def rope_cache(rows: int, rope_dim: int, theta: float, dev: torch.device) -> torch.Tensor:
    """float32 ``[rows, rope_dim]``: cosines, then sines, of ``p * theta**(-2i / rope_dim)``.

    YaRN's scaling of the compressed layers' cache is left out: it changes the values, not the shapes.
    """
    inv = theta ** (-torch.arange(0, rope_dim, 2, dtype=F32, device=dev) / rope_dim)
    angles = torch.arange(rows, dtype=F32, device=dev)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


class DSV4Engine(Sweep[DSV4Step]):
    """A DeepSeek-V4 engine's persistent state and per-step metadata; :class:`~warmreg_deepseek_v4.sweep.DSV4Sweep`
    adds the layer types."""

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        super().__init__(plan, dev, lim, seed)
        m = self.m = DSV4.from_config(self.cfg)
        self.window = m.sliding_window
        self.tp = int(self.cfg.serving.get("tensor_parallel_size", 1))
        self.flashinfer = attention_backend(self.cfg) == FLASHINFER_SPARSE
        self.quantize = fp8_checkpoint(self.cfg)
        self.ratios = sorted({r for r in m.ratios if r > 1})
        n_main, kinds = int(self.cfg.model["num_hidden_layers"]), {1: "swa", 4: "c4", 128: "c128"}
        main = sorted(set(m.ratios[:n_main]))
        self.layers = [(kinds[r], r) for r in main]
        # The MTP layer follows the main ones in compress_ratios (ratio 0, SWA-only, in both examples): its
        # attention is of a main type when one has its ratio (Flash), else a type of its own (Pro).
        self.mtp_kind = None
        if m.num_nextn_predict_layers > 0:
            mtp_ratio = m.ratios[n_main] if len(m.ratios) > n_main else 1
            self.mtp_kind = kinds[mtp_ratio] if mtp_ratio in main else "mtp"
            self.layers += [("mtp", mtp_ratio)] * (mtp_ratio not in main)
        self._caches()
        self._buffers()
        self._runner_tables()
        self.draft = DSparkDraft.from_config(self.cfg, m) if self.has("prepare_dspark_inputs") else None
        if self.draft is not None:
            self._draft_buffers(self.draft)

    def _draft_buffers(self, d: DSparkDraft) -> None:
        """The DSpark speculator's persistent buffers, sized by the config (their sizes are key fields), and the
        target's request states (last sampled and next prefill tokens, sampling parameters)."""
        srv, dev = self.cfg.serving, self.dev
        self.draft_reqs, self.draft_tokens = int(srv["max_num_seqs"]), int(srv["max_num_batched_tokens"])
        self.draft_buf = DraftInputs.zeros(self.draft_reqs, self.draft_tokens, d.num_tokens, dev)
        reqs, gen = self.draft_reqs, self.gen
        self.req_states = (
            torch.randint(0, 1 << 17, (reqs, 1), generator=gen, device=dev, dtype=I64),  # last sampled
            torch.randint(0, 1 << 17, (1, reqs), generator=gen, device=dev, dtype=I32),  # next prefill tokens
            torch.rand(reqs, generator=gen, device=dev),  # temperature
            torch.randint(0, 1 << 40, (reqs,), generator=gen, device=dev, dtype=I64),  # seeds
        )
        rows = max(self.lim.max_tokens, self.lim.max_seqs * d.num_query_per_req)
        self.draft_swa = (
            torch.zeros(rows, 1, d.index_width, dtype=I32, device=dev),  # decode_swa_indices_noncausal
            torch.zeros(rows, dtype=I32, device=dev),  # decode_swa_lens
        )

    def _caches(self) -> None:
        """Compressed caches' tables, fp8_ds_mla and indexer pages, compressor states, RoPE caches, weights."""
        m, pages, width = self.m, self.lim.num_blocks, block_table_width(self.lim.max_model_len, KV)
        c4 = self.tables[KV] if KV in self.tables else self.block_table(width)  # the slot-mapped group
        self.ctables = {"c4": c4, "c128": self.block_table(width), "indexer": self.block_table(width)}
        self.page = {r: compressed_block_size(self.cfg, r) for r in self.ratios}  # compressed tokens per page
        self.fp8 = {r: fp8_ds_mla_cache(pages, self.page[r], self.gen, self.dev) for r in self.ratios}
        self.fp8[1] = fp8_ds_mla_cache(pages, SWA, self.gen, self.dev)  # ratio 1: the SWA cache
        # FP8: K bytes + a 4-byte scale; MXFP4 (serving.indexer_kv_dtype): packed E2M1 + a UE8M0 byte per 32 dims
        self.fp4 = mxfp4_indexer(self.cfg, m, self.plan.platform)
        per_page, row = compressed_block_size(self.cfg, 4), token_bytes(m.index_head_dim, self.fp4)
        stride = indexer_page_stride(self.cfg, per_page, m.index_head_dim, fp4=self.fp4)
        backing = torch.zeros(pages * stride, dtype=U8, device=self.dev)
        self.index_cache = backing.as_strided((pages, per_page, row), (stride, row, 1))
        # compressor states: head (coff * head_dim; coff 2 for C4's overlapping windows), ratio, state page size
        heads = {
            "c4": (2 * m.head_dim, 4, STATE[4]),
            "index": (2 * m.index_head_dim, 4, STATE[4]),
            "c128": (m.head_dim, 128, STATE[128]),
        }
        self.states = {k: self.randn(pages, page, 2 * h, dtype=F32) for k, (h, _, page) in heads.items()}
        self.ape = {k: self.randn(r, h, dtype=F32, scale=0.1) for k, (h, r, _) in heads.items()}
        rows, model = self.lim.max_seq_len, self.cfg.model
        main = rope_cache(rows, m.qk_rope_head_dim, float(model.get("rope_theta", 10000)), self.dev)
        compress = rope_cache(rows, m.qk_rope_head_dim, float(model.get("compress_rope_theta", 160000)), self.dev)
        self.rope = {1: main, **{r: compress for r in self.ratios}}  # SWA-only layers: plain RoPE
        self.index_norm = self.randn(m.index_head_dim).add_(1)
        self.mtp_w = [self.randn(m.hidden_size, scale=0.1).add_(1) for _ in range(3)]

    def _buffers(self) -> None:
        """The metadata builders' persistent buffers (stable addresses for CUDA graphs)."""
        rows, dev, wmax = self.lim.max_tokens, self.dev, c128_max_width(self.lim.max_model_len)
        self.cbuf = {site: torch.full((rows,), -1, dtype=I64, device=dev) for site in ("c4", "c128", "indexer")}
        self.c128_buf = {
            "global_decode": torch.empty(rows, wmax, dtype=I32, device=dev),
            "decode_lens": torch.empty(rows, dtype=I32, device=dev),
            "prefill_local": torch.empty(rows, wmax, dtype=I32, device=dev),
        }
        self.topk_buf = torch.full((rows, self.m.index_topk), -1, dtype=I32, device=dev)
        self.pooled_k = torch.zeros(rows, self.m.index_head_dim, dtype=BF16, device=dev)  # ROCm MXFP4's workspace
        self.uniform_buf = {
            "decode_seq_lens": torch.empty(rows, dtype=I32, device=dev),
            "expanded_block_table": torch.empty(rows, self.ctables["indexer"].shape[1], dtype=I32, device=dev),
            "decode_lens": torch.empty(rows, dtype=I32, device=dev),
        }

    def _runner_tables(self) -> None:
        """The V2 runner's forward-pass block tables (one per KV-cache group, shaped as its source in
        :attr:`tables`), the address tables of both, and the per-group values the block-table gather reads: row
        stride, block size and sliding-window reach (``SlidingWindowSpec.num_retained_tokens``: the SWA cache's
        ``window - 1``, the C4 compressor states' ``2 * 4 - 1``, the C128 ones' ``128 - 1``; 0 for full attention)."""
        dev, groups = self.dev, self.groups
        self.fwd_tables = [torch.zeros_like(self.tables[bs]) for bs in groups]
        self.table_ptrs = (
            (block_table_pointers([self.tables[bs] for bs in groups]), block_table_pointers(self.fwd_tables))
            if groups
            else None
        )
        self.table_strides = torch.tensor([self.tables[bs].stride(0) for bs in groups], dtype=I64, device=dev)
        self.group_sizes = torch.tensor(groups, dtype=I32, device=dev)
        reach = {SWA: self.window - 1, STATE[4]: 2 * 4 - 1, STATE[128]: 128 - 1}
        self.group_reach = torch.tensor([reach.get(bs, 0) for bs in groups], dtype=I32, device=dev)
        self.dirty_rows = 0  # forward-pass rows the last gather wrote: a smaller batch zeroes them

    def has(self, short: str) -> bool:
        """Whether the plan holds ``deepseek_v4.<short>``."""
        return DSV4_PREFIX + short in self.names

    def k(self, short: str) -> Any:
        """The planned kernel ``deepseek_v4.<short>``."""
        return self.kernel(DSV4_PREFIX + short)

    def layer_types(self) -> list[str]:
        """The layer types with their compress ratios; the MTP layer's where it shares a main type."""
        mtp = {self.mtp_kind: ", and the MTP layer"} if self.mtp_kind != "mtp" else {}
        return [f"{kind} (ratio {r}{mtp.get(kind, '')})" for kind, r in self.layers]

    def indexer_chunks(self, b: Batch) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """The indexer's prefill chunks ``(a, e, query slices)``: requests packed while their compressed K rows fit
        the workspace and the logits (``tokens * rows * 4`` bytes) the budget."""
        out = []
        start, rows, toks = b.num_decodes, 0, 0
        for r in range(b.num_decodes, len(b.qlens)):
            k, q = b.seqs[r] // 4, b.qlens[r]
            over = rows + k > self.lim.workspace_rows or (toks + q) * (rows + k) * 4 > self.lim.logits_bytes
            if r > start and over:
                out.append(self._cut(start, r, toks, rows))
                start, rows, toks = r, 0, 0
            rows, toks = rows + k, toks + q
        if len(b.qlens) > start:
            out.append(self._cut(start, len(b.qlens), toks, rows))
        return out

    def _cut(self, a: int, e: int, toks: int, rows: int) -> tuple[int, int, list[tuple[int, int]]]:
        """A chunk's query slices: all of it, or (one request alone over the logits budget) cuts along M."""
        if toks * rows * 4 <= self.lim.logits_bytes:
            return a, e, [(0, toks)]
        m = max(1, self.lim.logits_bytes // (4 * rows))
        return a, e, [(s, min(s + m, toks)) for s in range(0, toks, m)]

    def step_tensors(self, b: Batch) -> DSV4Step:
        """The step's tensors, and the prefills' sparse-SWA gather lens (what the builder keeps on the host)."""
        nd = b.num_decodes
        gather = [q + min(max(s - q - r, 0), self.window - 1) for s, q, r in zip(b.seqs[nd:], b.qlens[nd:], b.replay[nd:])]
        return DSV4Step.of(b, self.dev, gather_host=gather)

    def gather_block_tables(self, st: DSV4Step) -> None:
        """The V2 runner's gather of the step's block-table rows of every KV-cache group into the forward-pass
        tables (``GPUModelRunner.prepare_attn``): request ``r`` of the batch owns state row ``r``, holds
        ``ceil(seq_len / block_size)`` blocks of a group (at most its width) and has computed ``seq_len - q_len``
        tokens; rows a larger batch wrote before are zeroed (vLLM's ``max(padded, dirty)`` rows)."""
        name = DSV4_PREFIX + "gather_block_tables"
        if name not in self.names or self.table_ptrs is None:
            return
        b, dev = st.batch, self.dev
        reqs = len(b.qlens)
        rows, self.dirty_rows = max(reqs, self.dirty_rows), reqs
        num_blocks = torch.zeros(len(self.groups), self.lim.max_seqs, dtype=I32)
        for g, bs in enumerate(self.groups):
            num_blocks[g, :reqs] = torch.tensor([min(-(-s // bs), self.tables[bs].shape[1]) for s in b.seqs])
        computed = torch.zeros(self.lim.max_seqs, dtype=I32)
        computed[:reqs] = torch.tensor([s - q for s, q in zip(b.seqs, b.qlens)])
        idx, num_blocks, computed = torch.arange(reqs, dtype=I32, device=dev), num_blocks.to(dev), computed.to(dev)
        (key,) = self.plan.kernel(name).keys  # the mask: the deployment's (sliding-window groups, no DCP)
        kw: dict[str, Any] = dict(num_rows=rows, mask_sliding_window=key.mask_sliding_window)  # type: ignore[attr-defined]
        consts = (self.group_reach, self.group_sizes)
        srcs = [self.tables[bs] for bs in self.groups]

        def gather() -> tuple[torch.Tensor, ...]:
            self.kernel(name)(idx, *self.table_ptrs, self.table_strides, num_blocks, computed, *consts, **kw)  # type: ignore[misc]
            return tuple(self.fwd_tables)

        self.launch(
            name,
            f"{len(self.groups)} KV-cache groups, {reqs} requests, {rows} rows",
            gather,
            ref=lambda: gather_block_tables_reference(
                idx, srcs, [t.clone() for t in self.fwd_tables], num_blocks, computed, *consts, **kw
            ),
        )

    def compressed_slots(self, st: DSV4Step) -> None:
        """Compressed slots: the sparse-MLA builder's per ratio (no DCP) and the C4 indexer's (the config's DCP)."""
        if CSLOTS not in self.names or KV not in st.slots:
            return
        dcp = int(self.cfg.serving.get("decode_context_parallel_size", 1) or 1)
        interleave = int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        sites = [(f"c{r}", r, 1, 1) for r in self.ratios] + [("indexer", 4, dcp, interleave)] * (4 in self.ratios)
        for site, ratio, world, inter in sites:
            self._compressed_site(st, site, ratio, world, inter)

    def _compressed_site(self, st: DSV4Step, site: str, ratio: int, world: int, interleave: int) -> None:
        b, uncompressed, bs = st.batch, st.slots[KV], self.page[ratio]
        table, buf = self.ctables[site][: len(b.qlens)], self.cbuf[site]  # the grid is the table's rows

        def torch_cslots() -> torch.Tensor:  # without DCP, which the DeepSeek-V4 indexer rejects
            state = st.positions // ratio
            ok = ((st.positions + 1) % ratio == 0) & (uncompressed != -1)
            slots = table.long()[st.token_to_req.long(), state // bs] * bs + state % bs
            buf[:] = -1
            buf[: b.tokens] = torch.where(ok, slots, -1)
            return buf[: b.tokens]

        kw: dict[str, Any] = dict(
            num_tokens=b.tokens, block_size=bs, compress_ratio=ratio, dcp_world_size=world, cp_interleave=interleave
        )
        st.cslots[site] = self.launch(
            CSLOTS,
            f"{site} site (ratio {ratio})",
            lambda: self.kernel(CSLOTS)(uncompressed, st.qsl, st.seq_lens, table, out=buf, **kw),
            fallback=torch_cslots,
            ref=lambda: compressed_slot_mapping_reference(uncompressed, st.qsl, st.seq_lens, table, **kw),
        )

    def c128a(self, st: DSV4Step) -> None:
        """C128A top-k metadata (decode global slots and lens, prefill local indices) at the step's C128 width;
        computed in PyTorch where the kernel is not planned (ROCm, whose C128 builder compacts the decode rows)."""
        if 128 not in self.ratios:
            return
        b = st.batch
        nd, width = b.decode_tokens, c128_active_width(max(b.seqs), self.lim.max_model_len)
        args = (st.positions, st.token_to_req, self.ctables["c128"][: b.num_decodes], st.slots[KV])
        kw: dict[str, Any] = dict(num_decode_tokens=nd, max_compressed_tokens=width, block_size=self.page[128])

        def torch_meta() -> tuple[torch.Tensor, ...]:
            cpu = (a.cpu() for a in args)  # the reference indexes with host ranges
            return tuple(t.to(self.dev) for t in c128_topk_metadata_reference(*cpu, **kw))

        out = torch_meta() if not self.has("c128a_topk_metadata") else self.launch(
            DSV4_PREFIX + "c128a_topk_metadata",
            f"W={width}",
            lambda: self.k("c128a_topk_metadata")(*args, **kw, **self.c128_buf),
            fallback=torch_meta,
            ref=lambda: c128_topk_metadata_reference(*args, **kw),
        )  # fmt: skip
        st.c128_decode, st.prefill_local = (out[0], out[1]), out[2]

    def decode_swa(self, st: DSV4Step) -> None:
        """The decode tokens' SWA-cache slots and lens (both sparse backends); computed in PyTorch where the kernel is
        not planned (ROCm, whose SWA builder compacts them)."""
        b = st.batch
        if not b.decode_tokens or SWA not in st.slots:
            return
        args = (st.positions, st.token_to_req, st.slots[SWA] >= 0, self.tables[SWA], st.replay)
        kw: dict[str, Any] = dict(num_tokens=b.decode_tokens, window_size=self.window, index_width=self.window, block_size=SWA)

        def torch_swa() -> tuple[torch.Tensor, torch.Tensor]:
            rows, lens = decode_swa_indices_reference(*(a.cpu() for a in args), **kw)
            return rows.to(self.dev), lens.to(self.dev)

        st.swa_decode = torch_swa() if not self.has("decode_swa_indices") else self.launch(
            DSV4_PREFIX + "decode_swa_indices",
            "decode tokens",
            lambda: self.k("decode_swa_indices")(*args, **kw),
            fallback=torch_swa,
            ref=lambda: decode_swa_indices_reference(*args, **kw),
        )  # fmt: skip

    def swa_prefill_metadata(self, st: DSV4Step) -> None:
        """The prefills' sparse-SWA gather lens, which the gathers and the combines read."""
        b = st.batch
        if not b.num_prefills:
            return
        host = torch.tensor(st.gather_host, dtype=I32, device=self.dev)
        if not self.has("sparse_swa_prefill_metadata"):
            st.gather_lens = host
            return
        args = (st.seq_lens, st.qsl, st.replay)
        kw: dict[str, Any] = dict(num_decodes=b.num_decodes, num_prefills=b.num_prefills, window_size=self.window)
        st.gather_lens = self.launch(
            DSV4_PREFIX + "sparse_swa_prefill_metadata",
            f"{b.num_prefills} prefills",
            lambda: self.k("sparse_swa_prefill_metadata")(*args, **kw),
            fallback=lambda: host,
            ref=lambda: sparse_swa_prefill_metadata_reference(*args, **kw),
        )

    def uniform_decode(self, st: DSV4Step) -> None:
        """The C4 indexer's uniform-decode flattening (only when every decode request has D tokens)."""
        b, d = st.batch, st.batch.uniform_decode_len
        if UNIFORM not in self.names or not d or not b.num_decodes:
            return
        seq_lens, table = st.seq_lens[: b.num_decodes], self.ctables["indexer"]
        self.launch(
            UNIFORM,
            f"D={d}",
            lambda: self.kernel(UNIFORM)(seq_lens, table, max_decode_len=d, **self.uniform_buf),
        )

