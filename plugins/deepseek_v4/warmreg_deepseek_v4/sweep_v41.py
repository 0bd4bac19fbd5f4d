"""The DeepSeek-V4.1 sweep driver: a step's layer types, launched like vLLM 0.34's V4.1 CUDA forward
(``models/deepseek_v41/attention.py``, ``compressor.py``, ``nvidia/``).

:class:`~warmreg_deepseek_v4.sweep.DSV4Sweep` serves both model types and builds this class for a ``deepseek_v41``
plan. Once a step: the mHC expand of the embedding into ``hc_mult`` streams, the engram layers' look-back gather,
hash, lookups and gates (:mod:`._sweep_v41_engram`), the V2 runner's block-table gather of its KV-cache groups
(the sliding-window cache's 32-token blocks, the compressed and indexer caches' 256) and its SWA bounded-replay
padding of their slots (:mod:`._sweep_v41_runner`), the compressor ring's slot mapping, the compressed slot mappings
(V4.1's sparse-MLA builder for the ratio-2 kv sources, the indexer builder for the index sources at the indexer's
kernel block), the decode SWA indices, the sparse-SWA prefill metadata and the indexer's uniform-decode flattening.
Then ONE launch per layer TYPE: V4.1's layers differ by ratio (0, 1, 2) and by whether they own a compressor (``kv_source_layer_ids``) and an indexer
(``index_source_layer_ids``); a consumer layer reuses its source's caches and top-k. Each type: its Q/KV norm (the
shared RMSNorm, or the fused norm + MXFP8 query quant on SM100), a kv source's compressor (save + pool + RMSNorm into
the latent, then the RoPE + record insert into the compressed cache), an index source's indexer (the key store of a
source that owns its keys; on a short-context step the fill of every candidate as its top-k, else random causal
local indices; its Q RoPE + FP8 quant on every step, as the V4 driver runs it, so that the CPU test's short contexts
launch it too; on sm_10x the upcast of its BF16 logits, :mod:`._sweep_v41_upcast`, likewise; the prefill-chunk
metadata), a compressed type's global top-k of the decode tokens (over the kernel
block table at the deployment's full width: its stride is a key field), FlashMLA's prefill combine of the top-k and
SWA rows (the prefills as one chunk), and the inverse RoPE of the live heads of the padded attention output.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import warmreg
from warmreg.ops import block_table_width, compressed_slot_mapping_reference
from warmreg.testing.sweep import Batch, Limits, Sweep

from ._sweep_v41_engram import drive_engram
from ._sweep_v41_markov import drive_markov
from ._sweep_v41_replay import drive_replay_gather
from ._sweep_v41_rocm import drive_rocm41
from ._sweep_v41_runner import drive_replay_pad
from ._sweep_v41_upcast import UPCAST, drive_upcast
from ._v41 import index_ratios, indexer_block_size, ring_capacity
from .dspark import DSparkDraft
from .fp8_ds_mla import HEAD_DIM
from .gather_block_tables import block_table_pointers
from .global_topk import global_topk_indices_reference
from .model import DSV4
from .short_context_topk import short_context_topk_reference
from .swa_indices import decode_swa_indices_reference
from .sweep import DSV4Sweep
from .sweep_inputs import BF16, CHUNK_META, CSLOTS, DSV4_PREFIX, F32, I32, I64, KV, U8, DSV4Step, rope_cache
from .v41 import attention_kind, padded_heads, tensor_parallel_size
from .v41_combine_indices import v41_combine_topk_swa_reference
from .v41_global_topk import block_table_width as kernel_table_width
from .v41_global_topk import kernel_block_size
from .v41_hc_collapse import hc_collapse_reference
from .v41_hc_expand import hc_expand_reference
from .v41_indexer_k_store import row_bytes
from .v41_ring_slots import ring_slot_mapping_reference

__all__ = ["DSV41Sweep"]

#: V4.1's sliding-window cache block (``DeepseekV4SWACache(block_size=32)`` in ``DeepseekV4Attention.__init__``).
SWA41 = 32
#: The packed records' bytes a token, by :func:`._v41.compressed_record` (plain rows are 512 wide).
_RECORD_BYTES = {"fp8_ds_mla": 584, "mxfp8": 528, "nvfp4": 288}


class DSV41Sweep(DSV4Sweep):
    """DeepSeek-V4.1: per-step metadata, then each layer type (ratio, kv source, index source) the config has."""

    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v41",)

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        Sweep.__init__(self, plan, dev, lim, seed)  # V4's engine state (DSV4Engine.__init__) does not apply
        m = self.m = DSV4.from_config(self.cfg)
        self.window, self.tp, self.flashinfer, self.draft = (
            m.sliding_window,
            tensor_parallel_size(self.cfg),
            False,
            None,
        )
        # the CUDA attention class; V4.1's ROCm model has one (DeepseekV41ROCMAiterMLAAttention, unpadded heads)
        self.kind = attention_kind(self.cfg, m, self.plan.platform) if self.plan.platform.is_cuda else "rocm"
        self.index_ratios, self.ratios = index_ratios(m), list(m.v41_compressed_ratios)
        types = {
            (m.ratios[i], i in m.kv_source_layer_ids and i < m.num_hidden_layers and m.ratios[i] > 0,
             i in m.index_source_layer_ids and i < m.num_hidden_layers and m.ratios[i] > 0)
            for i in range(len(m.ratios))
        }  # fmt: skip
        self.types = sorted(types)
        self.layers = [(self._type_name(t), t[0]) for t in self.types]
        self.groups = [SWA41, KV]
        width = {bs: block_table_width(lim.max_model_len, bs) for bs in self.groups}
        self.tables = {bs: self.block_table(width[bs]) for bs in self.groups}
        self.index_bs = indexer_block_size(self.plan.platform)
        self.ctables = {"indexer": self.block_table(block_table_width(lim.max_model_len, self.index_bs))}
        self._buffers()
        self._caches()
        self._runner_tables41()
        self.draft = DSparkDraft.from_config(self.cfg, m) if self.has("prepare_dspark_inputs") else None
        if self.draft is not None:  # a DSpark draft: the speculator's buffers (V4's, over 32-token SWA pages)
            self._draft_buffers(self.draft)

    @staticmethod
    def _type_name(t: tuple[int, bool, bool]) -> str:
        ratio, kv, index = t
        return "swa" if not ratio else f"c{ratio}" + " kv-source" * kv + " index-source" * index

    def layer_types(self) -> list[str]:
        """The layer types: ratio, and whether the type owns the compressor and the indexer."""
        return [name for name, _ in self.layers]

    def _buffers(self) -> None:
        rows, dev = self.lim.max_tokens, self.dev
        self.cbuf = {site: torch.full((rows,), -1, dtype=I64, device=dev) for site in ("mla", "indexer")}
        self.topk_buf = torch.full((rows, self.m.index_topk), -1, dtype=I32, device=dev)
        self.ring_buf = torch.full((rows,), -1, dtype=I64, device=dev)
        self.uniform_buf = {
            "decode_seq_lens": torch.empty(rows, dtype=I32, device=dev),
            "expanded_block_table": torch.empty(rows, self.ctables["indexer"].shape[1], dtype=I32, device=dev),
            "decode_lens": torch.empty(rows, dtype=I32, device=dev),
        }

    def _caches(self) -> None:
        """The compressor's fp32 ring (one block a request, block 0 the null block), the compressed cache of the
        deployment's record at ``256 // ratio`` states a block, the RoPE cache and the norm weights."""
        m, pages, dev = self.m, self.lim.num_blocks, self.dev
        self.capacity = ring_capacity(self.cfg)
        shape = (self.lim.max_seqs, 1)
        self.ring_table = torch.randint(1, pages, shape, generator=self.gen, device=dev, dtype=I32)
        self.ring = self.randn(pages, self.capacity, 2 * HEAD_DIM, dtype=F32)  # kv and score rows
        self.page = {r: KV // r for r in self.ratios}
        keys = self.plan.kernel(DSV4_PREFIX + "v41_rope_insert").keys if self.has("v41_rope_insert") else ()
        # one record a deployment, a key a compressed ratio
        self.record = getattr(keys[0], "record", "fp8_ds_mla") if keys else "fp8_ds_mla"
        self.ccache = {}
        for r in self.ratios:
            if self.record in _RECORD_BYTES:
                w = _RECORD_BYTES[self.record]
                stride = -(-self.page[r] * w // 576) * 576  # the pages' alignment padding
                backing = torch.zeros(pages * stride, dtype=U8, device=dev)
                self.ccache[r] = backing.as_strided((pages, self.page[r], w), (stride, w, 1))
            else:
                dtype = torch.float8_e4m3fn if self.record == "fp8" else BF16
                self.ccache[r] = torch.zeros(pages, self.page[r], HEAD_DIM, dtype=dtype, device=dev)
        self.fp8_scale = torch.ones(1, dtype=F32, device=dev)
        self.rope41 = rope_cache(self.lim.max_seq_len, m.qk_rope_head_dim, 160000.0, dev)
        self.kv_norm_w = self.randn(HEAD_DIM, scale=0.1).add_(1)
        # the indexer's K cache (FP8 rows + scale, at the indexer's kernel blocks) and its k_norm weight
        row, per_page = row_bytes(m.index_head_dim, False), {r: self.index_bs // r for r in self.index_ratios if r}
        self.kcache = {r: torch.zeros(pages, n, row, dtype=U8, device=dev) for r, n in per_page.items()}
        self.k_norm_w = self.randn(m.index_head_dim, scale=0.1).add_(1)
        # the global top-k reads the compressed cache's kernel block table at the deployment's full width
        if self.has("global_topk_indices"):
            kernel = kernel_block_size(self.cfg, self.kind, self.plan.platform)
            width = kernel_table_width(self.cfg, kernel)
            self.gtable = torch.randint(0, pages, (self.lim.max_seqs, width), generator=self.gen, device=dev, dtype=I32)
            self.gblock = {r: kernel // r for r in self.ratios}
        self.qkv_w = (self.randn(m.q_lora_rank).add_(1), self.randn(HEAD_DIM).add_(1))

    def _runner_tables41(self) -> None:
        """The V2 runner's forward-pass tables of the two groups; the SWA group reaches ``window - 1`` tokens back."""
        dev = self.dev
        self.fwd_tables = [torch.zeros_like(self.tables[bs]) for bs in self.groups]
        self.table_ptrs = (
            block_table_pointers([self.tables[bs] for bs in self.groups]),
            block_table_pointers(self.fwd_tables),
        )
        self.table_strides = torch.tensor([self.tables[bs].stride(0) for bs in self.groups], dtype=I64, device=dev)
        self.group_sizes = torch.tensor(self.groups, dtype=I32, device=dev)
        self.group_reach = torch.tensor([self.window - 1, 0], dtype=I32, device=dev)
        self.dirty_rows = 0

    def step_tensors(self, b: Batch) -> DSV4Step:
        """The step's tensors and block-table slots of both groups and of the indexer's kernel blocks."""
        st = super().step_tensors(b)
        for bs, table in ((SWA41, self.tables[SWA41]), (KV, self.tables[KV]), (self.index_bs, self.ctables["indexer"])):
            st.slots.setdefault(bs, table.long()[st.token_to_req.long(), st.positions // bs] * bs + st.positions % bs)
        return st

    # -- one step ----------------------------------------------------------------------------------------------------
    def run(self, st: DSV4Step) -> None:  # type: ignore[override]
        """The per-step metadata, one layer of each type, then the mHC head collapse; with a DSpark draft its inputs
        and non-causal SWA rows (:meth:`~.sweep.DSV4Sweep.dspark_metadata`; the draft's layers are not driven) and,
        with the fused Markov sampler, its sampling (:mod:`._sweep_v41_markov`)."""
        self.hc_expand(st)
        drive_engram(self, st)  # the look-back, the n-gram hash, then each engram layer's lookup and gate
        self.gather_block_tables(st)
        drive_replay_pad(self, st, SWA41)  # the SWA bounded replay's padding of the cacheable groups' slots
        drive_replay_gather(self, st, SWA41)  # the decoder replay layers' kept rows of the batch
        self.ring_slots(st)
        self.compressed_slots41(st)
        self.decode_swa41(st)
        drive_rocm41(self, st)  # ROCm: the SWA decode metadata and each ratio's decode top-k stream
        self.swa_prefill_metadata(st)
        self.uniform_decode(st)
        for t in self.types:
            self.layer41(st, t)
        self.hc_collapse(st)
        if self.draft is not None:  # a DSpark draft's inputs and non-causal SWA rows (V4's kernels, V4.1's values)
            self.dspark_metadata(st, self.draft, SWA41)
        drive_markov(self, st)  # a DSpark draft's fused Markov sampling, every speculative step

    def hc_expand(self, st: DSV4Step) -> None:
        """The embedding's expand into ``hc_mult`` residual streams (``nvidia/ops/mhc.py``)."""
        if not self.has("v41_hc_expand"):
            return
        x, n = self.randn(st.batch.tokens, self.m.hidden_size), self.m.hc_mult
        self.launch(
            DSV4_PREFIX + "v41_hc_expand", "embedding", lambda: self.k("v41_hc_expand")(x, n),
            ref=lambda: hc_expand_reference(x, n),
        )  # fmt: skip

    def hc_collapse(self, st: DSV4Step) -> None:
        """The last layer's ``hc_mult`` streams collapsed with its FFN pre-mix (``hc_collapse_triton`` of
        ``DeepseekV4Model.forward``): fresh contiguous bf16 streams, fp32 mixes of sigmoid's range."""
        if not self.has("v41_hc_collapse"):
            return
        x, n = self.randn(st.batch.tokens, self.m.hc_mult, self.m.hidden_size), self.m.hc_mult
        pre = torch.rand(st.batch.tokens, n, generator=self.gen, device=self.dev)
        self.launch(
            DSV4_PREFIX + "v41_hc_collapse", "last layer", lambda: self.k("v41_hc_collapse")(x, pre),
            ref=lambda: hc_collapse_reference(x, pre),
        )  # fmt: skip

    def ring_slots(self, st: DSV4Step) -> None:
        """The ratio-2 compressor ring's slots (``CompressorStateCache``'s builder), into the persistent buffer."""
        if not self.has("v41_ring_slot_mapping"):
            return
        T = st.batch.tokens
        args = (self.ring_table, st.token_to_req, st.positions)
        kw: dict[str, Any] = dict(num_actual_tokens=T, num_tokens=T, capacity=self.capacity)
        st.cslots["ring"] = self.launch(
            DSV4_PREFIX + "v41_ring_slot_mapping", f"ring of {self.capacity} rows",
            lambda: self.k("v41_ring_slot_mapping")(*args, **kw, out=self.ring_buf[:T]),
            fallback=lambda: ring_slot_mapping_reference(*args, **kw), ref=lambda: ring_slot_mapping_reference(*args, **kw),
        )  # fmt: skip

    def compressed_slots41(self, st: DSV4Step) -> None:
        """The sparse-MLA builder's slots of the ratio-2 caches (states of 256-token blocks) and the indexer builder's
        (of its kernel blocks, the config's DCP)."""
        if CSLOTS not in self.names:  # not planned for V4.1's ROCm model
            return
        dcp = int(self.cfg.serving.get("decode_context_parallel_size", 1) or 1)
        inter = int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        sites = [("mla", r, KV, self.tables[KV], 1, 1) for r in self.ratios if r > 1]
        sites += [
            ("indexer", r, self.index_bs, self.ctables["indexer"], dcp, inter) for r in self.index_ratios if r > 1
        ]
        for site, ratio, bs, table, world, interleave in sites:
            self._cslot_site(st, site, ratio, bs, table, world, interleave)

    def _cslot_site(
        self, st: DSV4Step, site: str, ratio: int, bs: int, table: torch.Tensor, world: int, interleave: int
    ) -> None:
        b = st.batch
        kw: dict[str, Any] = dict(
            num_tokens=b.tokens, block_size=bs // ratio, compress_ratio=ratio, dcp_world_size=world,
            cp_interleave=interleave,
        )  # fmt: skip
        args = (st.slots[bs], st.qsl, st.seq_lens, table[: len(b.qlens)])
        st.cslots[site] = self.launch(
            CSLOTS, f"V4.1 {site} site (ratio {ratio})",
            lambda: self.kernel(CSLOTS)(*args, out=self.cbuf[site], **kw)[: b.tokens],
            fallback=lambda: compressed_slot_mapping_reference(*args, **kw)[: b.tokens],
            ref=lambda: compressed_slot_mapping_reference(*args, **kw)[: b.tokens],
        )  # fmt: skip

    def decode_swa41(self, st: DSV4Step) -> None:
        """The decode tokens' sliding-window slots and lens over V4.1's 32-token SWA blocks."""
        b = st.batch
        if not self.has("decode_swa_indices") or not b.decode_tokens:
            return
        args = (st.positions, st.token_to_req, st.slots[SWA41] >= 0, self.tables[SWA41], st.replay)
        kw: dict[str, Any] = dict(
            num_tokens=b.decode_tokens, window_size=self.window, index_width=self.window, block_size=SWA41
        )
        self.launch(
            DSV4_PREFIX + "decode_swa_indices", "decode tokens", lambda: self.k("decode_swa_indices")(*args, **kw),
            ref=lambda: decode_swa_indices_reference(*args, **kw),
        )  # fmt: skip

    # -- one layer type ----------------------------------------------------------------------------------------------
    def layer41(self, st: DSV4Step, t: tuple[int, bool, bool]) -> None:
        """One layer of a type: Q/KV norm, compressor (kv source), indexer (index source), inverse RoPE."""
        m, T, (ratio, kv_source, index_source) = self.m, st.batch.tokens, t
        name = self._type_name(t)
        if self.has("v41_q_kv_norm_quant"):
            proj = self.randn(T, m.q_lora_rank + HEAD_DIM, scale=2.0)
            args = (proj[:, : m.q_lora_rank], proj[:, m.q_lora_rank :], *self.qkv_w, m.rms_norm_eps)
            self.launch(
                DSV4_PREFIX + "v41_q_kv_norm_quant", f"{name} layer", lambda: self.k("v41_q_kv_norm_quant")(*args)
            )
        else:
            self.qkv_norm(st, name, m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps)
        if kv_source:
            self.compressor(st, ratio, name)
        if index_source:
            if kv_source:
                self.k_store(st, ratio, name)
            self.indexer41(st, ratio, name)
        if ratio and self.has("global_topk_indices") and st.batch.decode_tokens:
            self.global_topk41(st, ratio, name)
        if self.has("v41_combine_topk_swa_indices") and st.batch.num_prefills and st.gather_lens is not None:
            self.combine41(st, ratio, name)
        if self.has("inv_rope_fp8_quant"):
            local = m.num_attention_heads // self.tp
            attn_out = self.randn(T, padded_heads(self.kind, local), m.head_dim, scale=3)
            inv = (attn_out[:, :local], st.positions, self.rope41, m.o_groups // self.tp)
            (key,) = self.plan.kernel(DSV4_PREFIX + "inv_rope_fp8_quant").keys  # quantize: the wo_a weight's
            self.launch(
                DSV4_PREFIX + "inv_rope_fp8_quant", f"{name} layer",
                lambda: self.k("inv_rope_fp8_quant")(*inv, quantize=key.quantize),  # type: ignore[attr-defined]
            )  # fmt: skip

    def compressor(self, st: DSV4Step, ratio: int, name: str) -> None:
        """A kv source's compressor: ring save + pool + RMSNorm into the latent, then the record insert of the
        group-closing tokens (``DeepseekCompressor.forward`` and ``insert_cache``)."""
        T = st.batch.tokens
        slots = st.cslots.get("ring") if ratio == 2 else st.slots[KV]
        if slots is None or not self.has("v41_save_compress_norm"):
            return
        kv_score = self.randn(T, HEAD_DIM * ratio, dtype=F32)
        args = (kv_score, st.positions, self.ring, slots, st.qsl, st.token_to_req, self.kv_norm_w)
        kw: dict[str, Any] = dict(eps=self.m.rms_norm_eps, compress_ratio=ratio)

        latent: list[torch.Tensor] = []

        def ours() -> tuple[None, torch.Tensor]:
            latent.append(self.k("v41_save_compress_norm")(*args, **kw))
            return None, self.ring

        def reference() -> tuple[None, torch.Tensor]:  # the ring rows, bitwise (the latent: the op's own tests)
            from .v41_compress import v41_save_compress_norm_reference

            ring = self.ring.clone()
            out = torch.zeros(T, HEAD_DIM, dtype=BF16, device=self.dev)
            v41_save_compress_norm_reference(*args[:2], ring, *args[3:], **kw, latent=out)
            return None, ring

        self.launch(DSV4_PREFIX + "v41_save_compress_norm", f"{name} compressor", ours, ref=reference, tol=(0.0, 0.0))
        cslots = st.cslots.get("mla") if ratio == 2 else st.slots[KV]
        if not latent or cslots is None or not self.has("v41_rope_insert"):
            return
        fp8 = {"fp8_scale": self.fp8_scale} if self.record == "fp8" else {}
        ins = (latent[0], st.positions, self.rope41, self.ccache[ratio], cslots)
        self.launch(
            DSV4_PREFIX + "v41_rope_insert", f"{name} compressed cache ({self.record})",
            lambda: self.k("v41_rope_insert")(*ins, compress_ratio=ratio, **fp8),
        )  # fmt: skip

    def k_store(self, st: DSV4Step, ratio: int, name: str) -> None:
        """The indexer keys of a kv source that owns them: ``k_norm(wk(latent))`` RoPE'd and FP8-stored at the
        indexer's compressed slots (``DeepseekV4Indexer._produce_k``). Not checked here: the interpreter truncates
        to bf16 where the reference rounds (the op's own tests and vLLM's compare them)."""
        slots = st.cslots.get("indexer") if ratio > 1 else st.slots[self.index_bs]
        if not self.has("v41_indexer_k_store") or slots is None:
            return
        (key,) = [k for k in self.plan.kernel(DSV4_PREFIX + "v41_indexer_k_store").keys if k.compress_ratio == ratio]  # type: ignore[attr-defined]
        k_pre = self.randn(st.batch.tokens, self.m.index_head_dim, scale=2)
        args = (k_pre, st.positions, self.rope41, self.k_norm_w, self.m.rms_norm_eps, self.kcache[ratio], slots)
        kw: dict[str, Any] = dict(compress_ratio=ratio, use_fp4_cache=False, mx_scale=key.mx_scale)  # type: ignore[attr-defined]
        self.launch(
            DSV4_PREFIX + "v41_indexer_k_store",
            f"{name} indexer keys",
            lambda: self.k("v41_indexer_k_store")(*args, **kw),
        )

    def global_topk41(self, st: DSV4Step, ratio: int, name: str) -> None:
        """The decode tokens' local top-k mapped to the compressed cache's slots (FlashMLA's decode)."""
        nd = st.batch.decode_tokens
        args = (self.topk_buf[:nd], st.token_to_req, self.gtable, st.slots[KV] >= 0)
        bs = self.gblock[ratio]
        self.launch(
            DSV4_PREFIX + "global_topk_indices", f"{name} decode",
            lambda: self.k("global_topk_indices")(*args, block_size=bs),
            ref=lambda: global_topk_indices_reference(*args, block_size=bs),
        )  # fmt: skip

    def combine41(self, st: DSV4Step, ratio: int, name: str) -> None:
        """FlashMLA's prefill (and ROCm's in-tree one, with its compaction and sparse attention): the prefills as one
        chunk, the compressed rows ``[0, N)`` then the SWA rows."""
        b, a = st.batch, st.batch.num_decodes
        e, gather = len(b.qlens), st.gather_host
        n = max(s // ratio for s in b.seqs[a:e]) if ratio else 0
        t0 = b.decode_tokens
        lens = st.gather_lens
        if lens is None:
            return
        args = (self.topk_buf[t0 : b.tokens], st.qsl[a : e + 1], st.seq_lens[a:e], lens)
        kw: dict[str, Any] = dict(top_k=self.m.index_topk if ratio else 0, compress_ratio=ratio, M=n + max(gather), N=n)
        out = self.launch(
            DSV4_PREFIX + "v41_combine_topk_swa_indices", f"{name} prefill, M={kw['M']}, N={n}",
            lambda: self.k("v41_combine_topk_swa_indices")(*args, **kw),
            ref=lambda: v41_combine_topk_swa_reference(*args, **kw, window_size=self.window),
        )  # fmt: skip
        if out is not None and self.plan.platform.is_rocm:  # ROCm's in-tree prefill: rocm_sparse_attn_prefill
            stream = self.ragged(f"{name} prefill, combined rows", out[0], out[1], num_rows=(e - a) * kw["M"])
            if stream is not None:
                self._sparse_prefill(f"{name} prefill", b.tokens - t0, (e - a) * kw["M"], stream)

    def indexer41(self, st: DSV4Step, ratio: int, name: str) -> None:
        """An index source's indexer: the short-context fill, its Q RoPE + FP8 quant, the prefill-chunk metadata."""
        b, T, k = st.batch, st.batch.tokens, self.m.index_topk
        if self.has("fill_short_context_topk") and max(b.seqs) // ratio <= k:
            kw: dict[str, Any] = dict(num_tokens=T, topk=k, compress_ratio=ratio)
            self.launch(
                DSV4_PREFIX + "fill_short_context_topk", f"{name}, max_seq_len {max(b.seqs)}",
                lambda: self.k("fill_short_context_topk")(st.positions, **kw, out=self.topk_buf[:T]),
                ref=lambda: short_context_topk_reference(st.positions, **kw),
            )  # fmt: skip
        else:  # what the indexer's top-k writes: min((pos + 1) // ratio, topk) random causal local indices, then -1
            n = (st.positions + 1) // ratio
            vals = (torch.rand(T, k, generator=self.gen, device=self.dev) * n[:, None]).long()
            live = torch.arange(k, device=self.dev)[None, :] < n.clamp(max=k)[:, None]
            self.topk_buf[:T].copy_(torch.where(live, vals, -1))
        if self.has("indexer_q_rope_quant"):
            h, d = self.m.index_n_heads, self.m.index_head_dim
            args = (st.positions, self.randn(T, h, d, scale=2), self.rope41, self.randn(T, h), d**-0.5, h**-0.5)
            self.launch(DSV4_PREFIX + "indexer_q_rope_quant", name, lambda: self.k("indexer_q_rope_quant")(*args))
        if UPCAST in self.names:
            drive_upcast(self, st, ratio, name)
        if CHUNK_META in self.names and b.num_prefills:
            self._chunk41(st, ratio, name)

    def _chunk41(self, st: DSV4Step, ratio: int, name: str) -> None:
        """The prefill requests as one indexer chunk (the CPU sizes fit its workspace), all queries in one slice."""
        b, a = st.batch, st.batch.num_decodes
        e = len(b.qlens)
        qsl = st.qsl[a : e + 1] - st.qsl[a]
        compressed = [0] + [s // ratio for s in b.seqs[a:e]]
        cu = torch.tensor(compressed, dtype=I64).cumsum(0).to(I32).to(self.dev)
        toks = sum(b.qlens[a:e])
        kw: dict[str, Any] = dict(
            num_compressed_rows=sum(compressed), query_slice_start=0, query_slice_stop=toks, compress_ratio=ratio,
            dcp_interleave=int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1),
        )  # fmt: skip
        self.launch(
            CHUNK_META, f"{name}, requests [{a}, {e})",
            lambda: self.kernel(CHUNK_META)(qsl, st.seq_lens[a:e], cu, **kw),
        )  # fmt: skip
