"""The DeepSeek-V4 sweep driver: a step's layer types, launched like vLLM's DeepSeek-V4 forward.

Found by ``benchmarks/sweep.py`` through the ``warmreg.sweep`` entry point; the registration module never
imports it. After the per-step metadata (:class:`~warmreg_deepseek_v4.sweep_inputs.DSV4Engine`), ONE launch per
layer TYPE, not per layer (the layers of a type launch the same keys), each type: Q/KV RMSNorm, its sparse prefill
chunk by chunk (dequant-gather of its compressed cache and of the SWA cache, then the combine), inverse RoPE + FP8
quant. C4 adds its compressor's save, and the indexer (save, compress + insert, Q RoPE + quant, on a short-context
step the fill of every candidate as its top-k, global top-k of the decode tokens (and of the prefill tokens under
FlashInfer), on decode batches of unequal lengths the pack of the FP8 Q and the unpack of the top-k, prefill chunk
metadata, cut along M above the logits budget); C128 adds its compressor's save. The MTP layer's two norms run around the attention type of the MTP layer (SWA-only: with the
SWA-only layers when the model has them, else as a type of its own). With DSpark (``speculative_method``
``dspark``) a draft step follows each target step: its inputs (decode requests rejected some drafts, prefill chunks
sampled a token or none), its non-causal SWA indices over ``Nq`` query tokens a request, and the SWA-only draft
layers' Q/KV RMSNorm and inverse RoPE + quant on those tokens. On ROCm, ROCm's own index work joins in at the points
vLLM's ROCm forward runs it (:mod:`~warmreg_deepseek_v4.sweep_rocm`): the builders' ragged compactions after the
metadata, its combine per prefill chunk, aiter's prefill top-k slots and the C4 decode top-k stream per layer type,
the localization of each indexer chunk's top-k. A driver whose kernel the plan lacks (the combine under Pro's
FlashInfer backend) is skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import warmreg
from warmreg.ops import indexer_prefill_chunk_metadata_reference
from warmreg.testing.sweep import Sweep

from . import _sweep_dspark, _sweep_v41_markov, _sweep_v41_replay
from ._sweep_v41_rocm import ROCM41_DRIVES
from ._sweep_v41_upcast import drive_upcast
from .combine_indices import combine_topk_swa_indices_reference
from .dspark import DSparkDraft, num_speculative_tokens
from .fp8_ds_mla import HEAD_DIM
from .global_topk import global_topk_indices_reference
from .indexer import compress_pool_reference, indexer_q_rope_mxfp4_reference
from .pack_seq import pack_seq_reference
from .short_context_topk import short_context_topk_reference
from .sweep_inputs import (
    BF16,
    CHUNK_META,
    COMBINE,
    CSLOTS,
    DSV4_PREFIX,
    F32,
    GATHER,
    I32,
    I64,
    KV,
    SAVE,
    STATE,
    SWA,
    UNIFORM,
    DSV4Step,
    chunks,
)  # fmt: skip
from .sweep_rocm import ROCM_DRIVES, DSV4RocmLaunches
from .unpack_seq import unpack_seq_reference

__all__ = ["DSV4Sweep"]


class DSV4Sweep(DSV4RocmLaunches):
    """DeepSeek-V4: per-step metadata, then its SWA-only, C4, C128 and MTP layer types (those the config has); on
    ROCm also ROCm's index launches (:class:`~warmreg_deepseek_v4.sweep_rocm.DSV4RocmLaunches`).

    It is the ``warmreg.sweep`` entry point of both model types: a ``deepseek_v41`` plan builds its subclass
    :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` (V4.1's engine state and layer types), so one entry point
    serves the plugin.
    """

    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v4", "deepseek_v41")
    drives: ClassVar[frozenset[str]] = Sweep.drives | {CSLOTS, CHUNK_META, UNIFORM, GATHER, COMBINE, SAVE} | ROCM_DRIVES | ROCM41_DRIVES | _sweep_v41_markov.MARKOV_DRIVES | _sweep_v41_replay.REPLAY_DRIVES | {
        DSV4_PREFIX + n
        for n in (
            "c128a_topk_metadata",
            "compress_pool",
            "decode_swa_indices",
            "dspark_noncausal_swa_indices",
            "fill_short_context_topk",
            "gather_block_tables",
            "global_topk_indices",
            "indexer_kv_compress_insert",
            "indexer_q_rope_mxfp4",
            "indexer_q_rope_quant",
            "indexer_upcast_logits",
            "inv_rope_fp8_quant",
            "mtp_input_rmsnorm",
            "mtp_shared_head_rmsnorm",
            "pack_seq",
            "prepare_dspark_inputs",
            "sparse_swa_prefill_metadata",
            "unpack_seq",
            # DeepSeek-V4.1 (sweep_v41.DSV41Sweep)
            "v41_combine_topk_swa_indices",
            "v41_engram_gate",
            "v41_engram_hash",
            "v41_engram_lookup",
            "v41_gather_lookback",
            "v41_hc_collapse",
            "v41_hc_expand",
            "v41_indexer_k_store",
            "v41_pad_replayed_slots",
            "v41_q_kv_norm_quant",
            "v41_ring_slot_mapping",
            "v41_rope_insert",
            "v41_save_compress_norm",
        )
    }

    def __new__(cls, plan: warmreg.Plan, *args: Any, **kwargs: Any) -> DSV4Sweep:
        """A :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` for a DeepSeek-V4.1 plan, else this class."""
        if cls is DSV4Sweep and plan.config.model_type == "deepseek_v41":
            from .sweep_v41 import DSV41Sweep  # here: it subclasses this class

            return super().__new__(DSV41Sweep)
        return super().__new__(cls)

    @classmethod
    def speculative_tokens(cls, cfg: warmreg.WarmConfig) -> int:
        """Draft tokens a step: ``serving.num_speculative_tokens``, or with DSpark the model's block size."""
        return num_speculative_tokens(cfg)

    def run(self, st: DSV4Step) -> None:
        """The per-step metadata, one layer of each type, then the DSpark draft step where the plan has one."""
        self.gather_block_tables(st)
        for bs in self.groups:
            self.slot_mapping(st, bs)
        self.compressed_slots(st)
        self.c128a(st)
        self.decode_swa(st)
        self.swa_prefill_metadata(st)
        self.uniform_decode(st)
        self.rocm_metadata(st)
        for kind, ratio in self.layers:
            self.layer(st, kind, ratio)
        if self.draft is not None:
            self.dspark_draft(st, self.draft)

    def dspark_draft(self, st: DSV4Step, d: DSparkDraft) -> None:
        """The DSpark draft step after the target step (:func:`._sweep_dspark.draft_step`)."""
        _sweep_dspark.draft_step(self, st, d)

    def dspark_metadata(self, st: DSV4Step, d: DSparkDraft, swa: int) -> tuple[int, list[int]]:
        """A DSpark draft step's inputs and non-causal SWA rows for ``swa``-token pages
        (:func:`._sweep_dspark.draft_metadata`): the request count and the draft batch's sequence lengths."""
        return _sweep_dspark.draft_metadata(self, st, d, swa)

    def layer(self, st: DSV4Step, kind: str, ratio: int) -> None:
        """One layer of a type: Q/KV norm, compressor and indexer, sparse prefill, inverse RoPE; for the type of the
        MTP layer's attention, the MTP input norm before and the shared-head norm after."""
        m, T = self.m, st.batch.tokens
        if kind == self.mtp_kind and self.has("mtp_input_rmsnorm"):
            embeds, residual = self.randn(T, m.hidden_size, scale=3), self.randn(T, m.hc_mult * m.hidden_size, scale=3)
            args = (embeds, st.positions, residual, self.mtp_w[0], self.mtp_w[1], m.rms_norm_eps)
            self.launch(DSV4_PREFIX + "mtp_input_rmsnorm", "mtp layer", lambda: self.k("mtp_input_rmsnorm")(*args))
        self.qkv_norm(st, kind, m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps)
        if ratio > 1:
            self.save_states(st, f"c{ratio}")
        if ratio == 4:
            self.indexer(st)
        self.sparse_prefill(st, kind, ratio)
        self.rocm_attention(st, ratio)
        if self.has("inv_rope_fp8_quant"):
            o = self.randn(T, m.num_attention_heads // self.tp, m.head_dim, scale=3)
            inv_args = (o, st.positions, self.rope[ratio], m.o_groups // self.tp)
            self.launch(
                DSV4_PREFIX + "inv_rope_fp8_quant",
                f"{kind} layer",
                lambda: self.k("inv_rope_fp8_quant")(*inv_args, quantize=self.quantize),
            )
        if kind == self.mtp_kind and self.has("mtp_shared_head_rmsnorm"):
            x = self.randn(T, m.hidden_size, scale=3)
            self.launch(
                DSV4_PREFIX + "mtp_shared_head_rmsnorm",
                "mtp layer",
                lambda: self.k("mtp_shared_head_rmsnorm")(x, self.mtp_w[2], m.rms_norm_eps),
            )

    def save_states(self, st: DSV4Step, state: str) -> None:
        """A compressor's save of ``kv`` and ``score + ape`` (column views of its fp32 projection) into its states."""
        cache, ape = self.states[state], self.ape[state]
        head, page, T = ape.shape[1], cache.shape[1], st.batch.tokens
        if SAVE not in self.names or page not in st.slots:
            return
        kv_score = self.randn(T, 2 * head, dtype=F32)
        args = (kv_score[:, :head], kv_score[:, head:], ape, st.positions, st.slots[page], cache)
        self.launch(SAVE, f"{state} compressor (head {head})", lambda: self.kernel(SAVE)(*args))

    def indexer(self, st: DSV4Step) -> None:
        """The C4 indexer: compressor (save, compress + insert), Q RoPE + quant, logits upcast, top-k, prefill metadata."""
        b, T = st.batch, st.batch.tokens
        self.save_states(st, "index")
        self._index_insert(st)
        self._compress_pool(st)
        self._q_mxfp4(st)
        if self.has("indexer_q_rope_quant"):
            h, d = self.m.index_n_heads, self.m.index_head_dim
            args = (st.positions, self.randn(T, h, d, scale=2), self.rope[4], self.randn(T, h), d**-0.5, h**-0.5)
            q = self.launch(
                DSV4_PREFIX + "indexer_q_rope_quant", "c4 indexer", lambda: self.k("indexer_q_rope_quant")(*args)
            )
            if q is not None:
                self.pack_q(st, q[0])
            self.rocm_indexer_logits(st, q)
        drive_upcast(self, st, 4, "c4 indexer")  # sm_10x: the C4 indexer's BF16 logits, upcast for its top-k
        st.topk = self.local_topk(st)
        self.unpack_topk(st)
        if self.has("global_topk_indices") and KV in st.slots:
            valid = st.slots[KV] >= 0
            spans = [(0, b.decode_tokens, "decode")] + [(b.decode_tokens, T, "FlashInfer prefill")] * self.flashinfer
            for lo, hi, what in spans:
                if hi > lo:
                    self._global_topk(st.topk[lo:hi], st.token_to_req[lo:], valid[lo:], what)
        if CHUNK_META in self.names:
            for a, e, cuts in self.indexer_chunks(b):
                self.rocm_indexer_gather(st, a, e)
                for qs0, qs1 in cuts:  # ROCm's aiter top-k localizes against the slice's K starts
                    ks, t = self._chunk_metadata(st, a, e, qs0, qs1), sum(b.qlens[:a])
                    self.rocm_localize(st, t + qs0, t + qs1, ks)

    def decode_lens(self, st: DSV4Step) -> tuple[list[int], torch.Tensor] | None:
        """The decode lengths (host and device) when they differ: the native decode's padded path, else None."""
        lens = list(st.batch.qlens[: st.batch.num_decodes])
        return (lens, torch.tensor(lens, dtype=I32, device=self.dev)) if len(set(lens)) > 1 else None

    def pack_q(self, st: DSV4Step, q_fp8: torch.Tensor) -> None:
        """The padded decode's pack of the FP8 Q ``q_fp8[:Td]`` (``[Td, H * D]``) into ``[B, Lmax, H, D]``."""
        dec = self.decode_lens(st)
        if dec is None or not self.has("pack_seq"):
            return
        x = q_fp8[: st.batch.decode_tokens].reshape(st.batch.decode_tokens, -1)
        self.launch(
            DSV4_PREFIX + "pack_seq",
            f"decode lens {dec[0]}",
            lambda: self.k("pack_seq")(x, dec[1], lengths_host=dec[0]).view(len(dec[0]), max(dec[0]), *q_fp8.shape[1:]),
        )  # no reference check: the -inf pad has no e4m3fn encoding (the plugin's tests mask those slots)

    def unpack_topk(self, st: DSV4Step) -> None:
        """The padded decode's unpack of the top-k of the ``B * next_n`` packed rows back into the buffer's ``[:Td]``."""
        dec = self.decode_lens(st)
        if dec is None or st.topk is None or not self.has("unpack_seq"):
            return
        nd, next_n = st.batch.decode_tokens, 1 + self.lim.spec
        # what the top-k of the padded rows writes: the decode rows' indices, -1 in the pad rows
        packed = torch.full((len(dec[0]), next_n, self.m.index_topk), -1, dtype=I32, device=self.dev)
        packed[:, : max(dec[0])] = pack_seq_reference(st.topk[:nd], dec[1], pad_value=-1)
        out = self.launch(
            DSV4_PREFIX + "unpack_seq",
            f"decode lens {dec[0]}",
            lambda: self.k("unpack_seq")(packed, dec[1], lengths_host=dec[0]),
            fallback=lambda: unpack_seq_reference(packed, dec[1]),
            ref=lambda: unpack_seq_reference(packed, dec[1]),
        )
        st.topk[:nd].copy_(out)

    def _index_insert(self, st: DSV4Step) -> None:
        """The indexer compressor's fused compress + RMSNorm + RoPE + FP8 quant + insert (of closing windows)."""
        if not self.has("indexer_kv_compress_insert") or STATE[4] not in st.slots or "indexer" not in st.cslots:
            return
        args = (
            self.states["index"], self.tables[STATE[4]], st.token_to_req, st.positions, st.slots[STATE[4]],
            st.cslots["indexer"], self.index_norm, self.rope[4], self.index_cache, self.m.rms_norm_eps,
        )  # fmt: skip
        self.launch(
            DSV4_PREFIX + "indexer_kv_compress_insert",
            "c4 indexer" + " (MXFP4)" * self.fp4,
            lambda: self.k("indexer_kv_compress_insert")(*args, compress_ratio=4, use_fp4_cache=self.fp4),
        )

    def _compress_pool(self, st: DSV4Step) -> None:
        """ROCm's MXFP4 indexer compressor: the pooling of closing windows into the persistent bf16 workspace."""
        if not self.has("compress_pool") or STATE[4] not in st.slots or "indexer" not in st.cslots:
            return
        T = st.batch.tokens
        args = (self.states["index"], st.token_to_req, st.positions, st.cslots["indexer"], self.tables[STATE[4]], STATE[4])
        self.launch(
            DSV4_PREFIX + "compress_pool",
            "c4 indexer (ROCm MXFP4)",
            lambda: self.k("compress_pool")(*args, self.pooled_k[:T]),
            ref=lambda: compress_pool_reference(*args, self.pooled_k[:T].clone()),
        )

    def _q_mxfp4(self, st: DSV4Step) -> None:
        """The C4 indexer's Q RoPE + MXFP4 quant (CUDA SM10x without CuTeDSL); SM10x never pads, so no pack."""
        if not self.has("indexer_q_rope_mxfp4"):
            return
        T, h, d = st.batch.tokens, self.m.index_n_heads, self.m.index_head_dim
        args = (st.positions, self.randn(T, h, d, scale=2), self.rope[4], self.randn(T, h), d**-0.5, h**-0.5)

        def flat(out: Any) -> tuple[torch.Tensor, ...]:
            (packed, scale), w = out
            return packed, scale, w

        self.launch(
            DSV4_PREFIX + "indexer_q_rope_mxfp4",
            "c4 indexer",
            lambda: flat(self.k("indexer_q_rope_mxfp4")(*args)),
            ref=lambda: flat(indexer_q_rope_mxfp4_reference(*args)),
            tol=(0.0, 0.0),  # bit-exact: the same fp32 RoPE, exact E2M1 and UE8M0 on both sides
        )

    def local_topk(self, st: DSV4Step) -> torch.Tensor:
        """What the indexer's top-k writes into its buffer: on a short-context step (``max_seq_len // 4 <=
        index_topk``) vLLM's fill of every candidate, else ``min((pos+1)//4, topk)`` random causal local indices,
        then -1. (vLLM skips the indexer's Q path on a short step; the sweep runs it on every step, so that the
        CPU test's short contexts launch it too.)"""
        T, k = st.batch.tokens, self.m.index_topk
        if self.has("fill_short_context_topk") and max(st.batch.seqs) // 4 <= k:
            return self.launch(  # type: ignore[no-any-return]
                DSV4_PREFIX + "fill_short_context_topk",
                f"max_seq_len {max(st.batch.seqs)}",
                lambda: self.k("fill_short_context_topk")(st.positions, num_tokens=T, topk=k, out=self.topk_buf[:T]),
                fallback=lambda: self.topk_buf[:T].copy_(short_context_topk_reference(st.positions, num_tokens=T, topk=k)),
                ref=lambda: short_context_topk_reference(st.positions, num_tokens=T, topk=k),
            )
        n = (st.positions + 1) // 4
        vals = (torch.rand(T, k, generator=self.gen, device=self.dev) * n[:, None]).long()
        live = torch.arange(k, device=self.dev)[None, :] < n.clamp(max=k)[:, None]
        return self.topk_buf[:T].copy_(torch.where(live, vals, -1))

    def _global_topk(self, topk: torch.Tensor, token_to_req: torch.Tensor, valid: torch.Tensor, what: str) -> None:
        args, bs = (topk, token_to_req, self.ctables["c4"], valid), self.page[4]
        self.launch(
            DSV4_PREFIX + "global_topk_indices",
            what,
            lambda: self.k("global_topk_indices")(*args, block_size=bs),
            ref=lambda: global_topk_indices_reference(*args, block_size=bs),
        )

    def _chunk_metadata(self, st: DSV4Step, a: int, e: int, qs0: int, qs1: int) -> torch.Tensor | None:
        """The metadata of one query slice of an indexer prefill chunk; returns its ``cu_seqlen_ks``."""
        qsl = st.qsl[a : e + 1] - st.qsl[a]  # rebased to the chunk: a fresh tensor
        compressed = [0] + [s // 4 for s in st.batch.seqs[a:e]]
        cu = torch.tensor(compressed, dtype=I64).cumsum(0).to(I32).to(self.dev)
        interleave = int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        kw: dict[str, Any] = dict(
            num_compressed_rows=sum(compressed), query_slice_start=qs0, query_slice_stop=qs1, compress_ratio=4,
            dcp_interleave=interleave,
        )  # fmt: skip
        out = self.launch(
            CHUNK_META,
            f"requests [{a}, {e}), query slice [{qs0}, {qs1})",
            lambda: self.kernel(CHUNK_META)(qsl, st.seq_lens[a:e], cu, **kw),
            fallback=lambda: indexer_prefill_chunk_metadata_reference(qsl.cpu(), st.seq_lens[a:e].cpu(), cu.cpu(), **kw),
        )
        return out[1].to(self.dev) if out is not None else None

    def sparse_prefill(self, st: DSV4Step, kind: str, ratio: int) -> None:
        """Sparse prefill of one layer type, chunk by chunk: gather the compressed entries (rows ``[0, N)``) and the
        SWA rows (from row ``N``) into a bf16 workspace of ``M`` rows per request, then combine the indices."""
        b = st.batch
        if not b.num_prefills or st.gather_lens is None or not ({GATHER, COMBINE} | ROCM_DRIVES) & self.names:
            return
        nd, densest = b.num_decodes, min(self.ratios, default=0)  # the chunks fit the layer type with most rows
        rows = [(s // densest if densest else 0) + g for s, g in zip(b.seqs[nd:], st.gather_host)]
        for a, e in chunks(rows, self.lim.workspace_rows):
            a, e = a + nd, e + nd
            n = max(s // ratio for s in b.seqs[a:e]) if ratio > 1 else 0
            m = n + max(st.gather_host[a - nd : e - nd])
            lens = st.gather_lens[a - nd : e - nd]
            where = f"{kind} layer, requests [{a}, {e}), M={m}, N={n}"
            if GATHER in self.names:
                self._gathers(st, where, ratio, a, e, (n, m), lens)
            if COMBINE in self.names:
                self._combine(st, where, ratio, a, e, (n, m), lens)
            self.rocm_combine(st, where, ratio, a, e, (n, m), lens)

    def _gathers(
        self, st: DSV4Step, where: str, ratio: int, a: int, e: int, nm: tuple[int, int], lens: torch.Tensor
    ) -> None:
        (n, m), gather = nm, self.kernel(GATHER)
        out = torch.empty(e - a, m, HEAD_DIM, dtype=BF16, device=self.dev)  # the chunk's workspace
        if ratio > 1:
            seqs, table, cache = st.seq_lens[a:e] // ratio, self.ctables[f"c{ratio}"][a:e], self.fp8[ratio]
            self.launch(
                GATHER,
                f"{where}, compressed cache",
                lambda: gather(out, cache, seqs, table, block_size=self.page[ratio]),
            )
        args = (out, self.fp8[1], st.seq_lens[a:e], self.tables[SWA][a:e])
        self.launch(GATHER, f"{where}, SWA cache", lambda: gather(*args, block_size=SWA, offset=n, gather_lens=lens))

    def _combine(
        self, st: DSV4Step, where: str, ratio: int, a: int, e: int, nm: tuple[int, int], lens: torch.Tensor
    ) -> None:
        b, (n, m) = st.batch, nm
        t0, t1, nd = sum(b.qlens[:a]), sum(b.qlens[:e]), b.decode_tokens
        topk = {1: None, 4: st.topk, 128: st.prefill_local}[ratio]
        if topk is not None:  # rows of the chunk's tokens (C128A's prefill rows start after the decode tokens)
            shift = nd if ratio == 128 else 0
            topk = topk[t0 - shift : t1 - shift]
        elif ratio > 1:
            return
        args = (topk, st.qsl[a : e + 1], st.seq_lens[a:e], lens)
        kw: dict[str, Any] = dict(num_tokens=t1 - t0, compress_ratio=ratio, M=m, N=n)
        self.launch(
            COMBINE,
            where,
            lambda: self.kernel(COMBINE)(*args, **kw),
            ref=lambda: combine_topk_swa_indices_reference(*args, **kw, window_size=self.window),
        )
