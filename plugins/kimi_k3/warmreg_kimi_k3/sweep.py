"""The Kimi-K3 sweep driver: a step of the MLA, KDA and attention-residual layer types, launched like vLLM's forward.

Found by ``benchmarks/sweep.py`` through the ``warmreg.sweep`` entry point; the registration module never
imports it. Once a step: the MLA group's block-table slot mapping (64-token pages), the KDA metadata builder's
aligned state indices and, on decode-only steps under speculation, its staging of the metadata into graph buffers
padded past the step's requests. Then ONE launch per layer TYPE: the MLA layers' Q/KV RMSNorm (over either
registered projection width); the KDA layers' short convolutions (the prefill conv1d of q, k and v, column slices
of the packed projection, when the step has prefills; the conv update of the speculative decode rows, varlen with
accepted counts; the plain-decode update on decode steps of one-token rows where the plan holds it, followed by the
packed KDA decode step on its output), the initial-state gather of the prefill requests, the speculative recurrent
step over the decode requests (vLLM's convention: q, k, v column views of the conv update's output,
``[N, 1 + spec]`` state indices with accepted counts, a null slot now and then), the six stages of the chunked KDA
prefill over the prefill requests (initial states mixed) where vLLM's prefill backend is Triton, and the gated
RMSNorm of the output over every token (the gate a column view of the fused projection, at its usual width or the
overlap path's); and every distinct call site of the attention residuals. Last, the model runner's scatter of the
step's accepted counts into its persistent buffer. Where the plan holds them: first the vision tower's input
normalisation of an image batch (:mod:`warmreg_kimi_k3.sweep_vision`); on ROCm the KDA builder's device chunk
metadata and, with no conv update planned, the plain decodes' packed KDA step (:mod:`warmreg_kimi_k3.sweep_rocm`);
with DCP the MLA decode's combine correction after the Q/KV norm (:mod:`warmreg_kimi_k3.sweep_dcp`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import warmreg
from warmreg.ops import block_table_width
from warmreg.testing.sweep import NORM, Batch, Limits, Step, Sweep

from ._sweep_dsa_metadata import DSA_METADATA, DSAMetadataStep
from .attn_res import attn_res_reference
from .causal_conv1d import causal_conv1d_reference, conv1d_chunks, projection_row_stride
from .causal_conv1d_update import causal_conv1d_update_reference
from .dsa_k_insert import dsa_k_insert_reference, mx_scale_default
from .dsa_prologue import dsa_prologue_reference, mla_entry_bytes
from .dsa_q_quant import dsa_q_quant_reference
from .gated_rmsnorm import gated_rmsnorm_reference, projection_width
from .gather_initial_states import gather_initial_states_reference
from .kda import KDARecurrent, kda_recurrent_reference
from .kda_chunk import STAGES as KDA_CHUNK_STAGES
from .kda_chunk_base import chunk_metadata
from .kda_chunk_intra import platform_solve_precision
from .kda_chunk_l2norm import l2norm_reference
from .kda_packed_decode import kda_packed_decode_reference
from .kda_spec_metadata import stage_spec_decode_metadata_reference
from .kda_state_indices import aligned_state_indices_reference
from .num_accepted import scatter_num_accepted_reference
from .plugin import MODEL_TYPES
from .sweep_dcp import DCP_A2A_COMBINE, DCP_A2A_PACK, DCP_CORRECT, dcp_a2a_step, dcp_correct_step
from .sweep_rocm import (
    ROCM_CHUNK_METADATA,
    ROCM_RECURRENT,
    rocm_chunk_metadata_step,
    rocm_packed_decode_step,
    rocm_recurrent_step,
)  # fmt: skip
from .sweep_vision import MM_INPUT_NORM, mm_input_norm_step

__all__ = ["KimiSweep"]

I32, F32 = torch.int32, torch.float32
KDA, ATTN_RES = "kimi_k3.kda_recurrent", "kimi_k3.attn_res"
CONV, CONV_UPDATE = "kimi_k3.causal_conv1d", "kimi_k3.causal_conv1d_update"
KDA_NORM, KDA_GATHER = "kimi_k3.gated_rmsnorm", "kimi_k3.gather_initial_states"
KDA_ALIGNED, KDA_STAGE = "kimi_k3.aligned_state_indices", "kimi_k3.stage_spec_decode_metadata"
KDA_PACKED = "kimi_k3.kda_packed_decode"
RUNNER = "kimi_k3.scatter_num_accepted"
DSA_PROLOGUE, DSA_K_INSERT = "kimi_k3.dsa_fused_prologue", "kimi_k3.dsa_k_norm_quant_insert"
DSA_Q_QUANT = "kimi_k3.dsa_q_quant_fold_weights"
#: The chunked KDA prefill's stages, in launch order (l2norm, gate, intra, wu, h, o).
KDA_CHUNK = tuple(stage.name for stage in KDA_CHUNK_STAGES)


class KimiSweep(Sweep[Step]):
    """Kimi-K3: the MLA layers' slot mapping and Q/KV RMSNorm, the KDA layers' recurrent decode step, the DSA
    layers' indexer front-end (FP8 cache), and the attention residuals of the decoder layers (each distinct call
    site of the forward once a step)."""

    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    drives: ClassVar[frozenset[str]] = Sweep.drives | {
        KDA, ATTN_RES, CONV, CONV_UPDATE, KDA_NORM, KDA_GATHER, KDA_ALIGNED, KDA_STAGE, KDA_PACKED, *KDA_CHUNK,
        DSA_PROLOGUE, DSA_K_INSERT, DSA_Q_QUANT, RUNNER, MM_INPUT_NORM, ROCM_CHUNK_METADATA, *DSA_METADATA,
        DCP_CORRECT, DCP_A2A_PACK, DCP_A2A_COMBINE, ROCM_RECURRENT,
    }  # fmt: skip

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        super().__init__(plan, dev, lim, seed)
        text = self.cfg.text
        self.q, self.kv, rope = int(text["q_lora_rank"]), int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"])
        self.eps = float(text.get("rms_norm_eps", 1e-6))
        self.widths = [self.q + self.kv + rope]  # the qkv_a projection: [q_lora | kv_lora | rope]
        if text.get("mla_use_output_gate"):  # ... and the output gate's local heads * v_head_dim when it shares it
            tp = int(self.cfg.serving.get("tensor_parallel_size", 1))
            self.widths.append(self.widths[0] + int(text["num_attention_heads"]) // tp * int(text["v_head_dim"]))
        self.layers = [("mla", 0)] * (NORM in self.names) + [("kda", 0)] * (KDA in self.names)
        self.conv_names = [n for n in (CONV, CONV_UPDATE) if n in self.names]
        if self.conv_names:
            self.layers.append(("conv", 0))
            lay = self.kernel(self.conv_names[0]).layout
            self.conv_layout, self.conv_row = lay, projection_row_stride(lay)
            rows = lay.conv_width - 1 + lay.num_speculative_tokens
            # One KDA layer's conv state in vLLM's default (state_len, dim) layout, as the layer transposes it;
            # line 0 is the null block, so requests take lines 1.. (a line a request).
            packed = self.randn(lim.max_seqs + 1, rows, 3 * lay.projection_size)
            self.conv_state = packed.transpose(1, 2)
            self.conv_weight = self.randn(3 * lay.projection_size, lay.conv_width, dtype=F32, scale=0.5)
        self.layers += [("kda_chunk", 0)] * (KDA_CHUNK[0] in self.names)
        if KDA in self.names or KDA_PACKED in self.names:  # the speculative step's, or the plain decode's, layout
            kda = self.kernel(KDA) if KDA in self.names else KDARecurrent.from_layout(
                self.kernel(KDA_PACKED).layout, max_num_seqs=lim.max_seqs)  # fmt: skip
            self.hkv = (kda.num_heads, kda.head_k_dim, kda.head_v_dim)
            # vLLM's recurrent pool [slots, H, V, K]: a slot per state column of a request (1 + spec), slot 0 the null
            self.pool = self.randn(lim.max_seqs * (1 + lim.spec) + 1, kda.num_heads, kda.head_v_dim, kda.head_k_dim,
                                   dtype=F32, scale=0.1)  # fmt: skip
            # The layer's fp32 parameters (A_log [H], dt_bias [H * K]) and the configured gate lower bound.
            h, dk = kda.num_heads, kda.head_k_dim
            a_log = torch.rand(h, generator=self.gen, device=self.dev).mul_(1.5).add_(0.5).log_()  # exp in [0.5, 2)
            dt_bias = self.randn(h * dk, dtype=F32, scale=0.5) if kda.has_dt_bias else None
            self.gate = (a_log, dt_bias, kda.lower_bound)
            self.raw_dtypes = (kda.gate_dtype, kda.beta_dtype)
        self.kda_tables()
        self.accepted = torch.ones(lim.max_seqs, dtype=I32, device=dev)  # the model runner's accepted counts
        if KDA_CHUNK[0] in self.names:  # the chunked prefill shares the decode step's pool and parameters
            stage = self.kernel(KDA_CHUNK[0])
            self.chunk_hkv = (stage.num_heads, stage.head_dim, stage.head_dim)
            if KDA not in self.names:
                self.pool = self.randn(lim.max_seqs + 1, *self.chunk_hkv, dtype=F32, scale=0.1)
                a_log = torch.rand(stage.num_heads, generator=self.gen, device=self.dev).mul_(1.5).add_(0.5).log_()
                self.gate = (
                    a_log,
                    self.randn(stage.num_heads * stage.head_dim, dtype=F32, scale=0.5),
                    stage.lower_bound,
                )
        if DSA_Q_QUANT in self.names:
            self.layers.append(("dsa", 0))
            self.dsa_state()
        # the DSA indexer builder's metadata and the sparse attention's top-k remap (warmreg.ops), once a step
        self.dsa_metadata = DSAMetadataStep(self) if DSA_METADATA & self.names else None
        if ATTN_RES in self.names:
            self.layers.append(("attn_res", 0))
            ar = self.kernel(ATTN_RES)
            d = ar.hidden_size
            # The engine's persistent buffers, sliced to a step's tokens: the running block sum [T, D] and the
            # residual buffer [T, max_blocks, D]; the layers' norm weights and pseudo-query (one set: pointers).
            self.ar_prefix = self.randn(lim.max_tokens, d)
            self.ar_blocks = self.randn(lim.max_tokens, ar.max_blocks, d)
            self.ar_weights = (self.randn(d, scale=0.1).add_(1), self.randn(d, scale=0.02), self.randn(d).add_(1))

    def kda_tables(self) -> None:
        """The KDA group's persistent block table (one state block per ``block_size`` tokens, plus the drafts'),
        the graph buffers the spec-decode metadata is staged into, and the layer's state pool and norm weight."""
        lim, spec = self.lim, self.lim.spec
        self.kda_bs = int(self.cfg.serving["block_size"])
        self.kda_table = self.block_table(block_table_width(lim.max_model_len, self.kda_bs) + spec)
        rows = lim.max_seqs * (1 + spec)  # the builder's decode_cudagraph_max_bs
        self.staged = (
            torch.zeros(rows, 1 + spec, dtype=I32, device=self.dev),
            torch.zeros(rows + 1, dtype=I32, device=self.dev),
            torch.ones(rows, dtype=I32, device=self.dev),
        )
        if KDA_GATHER in self.names or KDA_NORM in self.names:
            norm = self.kernel(KDA_NORM if KDA_NORM in self.names else KDA_GATHER)
            h, d = norm.num_heads, norm.head_dim
            if KDA not in self.names:
                self.pool = self.randn(lim.max_seqs + 1, h, d, d, dtype=F32, scale=0.1)
            self.o_norm_w = self.randn(d, scale=0.2).add_(1)

    def dsa_state(self) -> None:
        """A DSA layer's norm weights, its caches in 64-token pages (the fp8_ds_mla MLA cache and the FP8 indexer
        cache) and the model-level top-k buffer."""
        lay, pages = self.kernel(DSA_Q_QUANT).layout, self.lim.num_blocks
        self.dsa_lay = lay
        self.dsa_norms = (self.randn(lay.q_lora_rank or 1, scale=0.2).add_(1), self.randn(lay.kv_lora_rank, scale=0.2).add_(1),
                          self.randn(lay.index_head_dim, dtype=F32, scale=0.3).add_(1),
                          self.randn(lay.index_head_dim, dtype=F32, scale=0.1))  # fmt: skip
        self.dsa_mla = torch.zeros(pages, 64, mla_entry_bytes(lay.kv_lora_rank, lay.qk_rope_head_dim),
                                   dtype=torch.uint8, device=self.dev)  # fmt: skip
        self.dsa_index = torch.zeros(pages, 64, lay.index_head_dim + 4, dtype=torch.uint8, device=self.dev)
        self.dsa_topk = torch.empty(self.lim.max_tokens, lay.index_topk, dtype=I32, device=self.dev)

    def dsa(self, st: Step) -> None:
        """One DSA layer's indexer front-end (``KimiK3DSAAttention._fused_attention`` or the indexer's unfused
        forward): the packed projection split into column views, the fused prologue (or the key insert), then the
        query quant on the query projection's column view, with the token's slots folded into the caches' pages."""
        lay, t = self.dsa_lay, st.batch.tokens
        q, kv, r = lay.q_lora_rank or 1, lay.kv_lora_rank, lay.qk_rope_head_dim
        d, h = lay.index_head_dim, lay.index_num_heads
        q_c, kv_c, k_pe, index_k, weights = self.randn(t, q + kv + r + d + h, scale=2.0).split([q, kv, r, d, h], -1)
        slots = st.positions.long() % (self.dsa_index.shape[0] * 64)
        qw, kvw, kw, kb = self.dsa_norms
        if DSA_PROLOGUE in self.names:
            args = (q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, lay.eps, self.dsa_topk, self.dsa_mla, slots,
                    self.dsa_index, slots)  # fmt: skip
            mx = mx_scale_default(None)  # the op's default on this device, as its launch takes it
            self.launch(DSA_PROLOGUE, f"{t} tokens", lambda: self.kernel(DSA_PROLOGUE)(*args),
                        ref=lambda: dsa_prologue_reference(*args, mx_scale=mx), tol=(1e-2, 1.6e-2))  # fmt: skip
        elif DSA_K_INSERT in self.names:
            args2 = (index_k, kw, kb, lay.eps, slots, self.dsa_index, self.dsa_topk, t)

            def written() -> tuple[torch.Tensor, torch.Tensor]:  # the top-k rows and the cache's scale words, exact
                return self.dsa_topk[:t].clone(), self.dsa_index.flatten(1)[:, 64 * d :].contiguous().view(I32)

            def reference() -> tuple[torch.Tensor, torch.Tensor]:
                dsa_k_insert_reference(*args2, mx_scale=mx_scale_default(None))
                return written()

            def insert() -> tuple[torch.Tensor, torch.Tensor]:
                self.kernel(DSA_K_INSERT)(*args2)
                return written()

            self.launch(DSA_K_INSERT, f"{t} tokens", insert, ref=reference)
        index_q = self.randn(t, 64 + h * d, scale=2.0)[:, 64:].view(t, h, d)  # [q | index_q] column view
        scale = d**-0.5 * h**-0.5
        padded = lay.padded_index_num_heads
        # Checked on the folded weights (exact): Triton's interpreter does not round fp32 -> e4m3fn to nearest even,
        # so the CPU's FP8 codes may differ from the reference's (the plugin's tests bound how; vLLM's agree bitwise).
        self.launch(DSA_Q_QUANT, f"{t} tokens, {h} heads",
                    lambda: self.kernel(DSA_Q_QUANT)(index_q, weights, scale, padded)[1],
                    ref=lambda: dsa_q_quant_reference(index_q, weights, scale, padded)[1])  # fmt: skip

    def step_tensors(self, b: Batch) -> Step:
        """The step's tensors (the KDA group's metadata is built in :meth:`run`)."""
        return Step.of(b, self.dev)

    def run(self, st: Step) -> None:
        """The vision tower's input norm, the slot mapping, the KDA metadata, one layer of each type, the initial
        states and the output norm."""
        if MM_INPUT_NORM in self.names:
            mm_input_norm_step(self)
        for bs in self.groups:
            self.slot_mapping(st, bs)
        if self.dsa_metadata is not None:
            self.dsa_metadata.run(st)
        state = self.aligned_state_indices(st)
        if ROCM_CHUNK_METADATA in self.names:
            rocm_chunk_metadata_step(self, st)
        if KDA_PACKED in self.names and not self.conv_names:  # ROCm's plain decode (its conv update is not an op)
            rocm_packed_decode_step(self, st)
        if ROCM_RECURRENT in self.names:
            rocm_recurrent_step(self, st)
        self.stage_spec_metadata(st, state)
        for kind, _ in self.layers:
            if kind == "mla":
                self.qkv_norm(st, kind, self.q, self.kv, self.rng.choice(self.widths), self.eps)
                if DCP_CORRECT in self.names:
                    dcp_correct_step(self, st)
                if DCP_A2A_PACK in self.names:
                    dcp_a2a_step(self, st)
            elif kind == "kda":
                self.kda(st)
            elif kind == "conv":
                self.conv(st)
            elif kind == "kda_chunk":
                self.kda_chunk(st)
            elif kind == "dsa":
                self.dsa(st)
            else:
                self.attn_res(st)
        self.gather_initial_states(st, state)
        self.kda_gated_norm(st)
        self.scatter_num_accepted(st)

    def scatter_num_accepted(self, st: Step) -> None:
        """After sampling, the model runner's accepted counts (``MambaHybridModelState.postprocess_state``): each
        request's ``max(num_sampled, 1)`` into its slot of the persistent int32 buffer; a decode samples 1 to
        ``1 + spec`` tokens, a prefill chunk 0 or 1; ``idx_mapping`` int64."""
        if RUNNER not in self.names:
            return
        b, n = st.batch, len(st.batch.qlens)
        idx = torch.randperm(self.lim.max_seqs, generator=self.gen, device=self.dev)[:n]
        top = torch.tensor([1 + self.lim.spec] * b.num_decodes + [1] * b.num_prefills, device=self.dev)
        sampled = (torch.rand(n, generator=self.gen, device=self.dev) * (top + 1)).to(I32).clamp_(max=top)
        sampled[: b.num_decodes].clamp_(min=1)
        args = (idx, sampled, self.accepted)
        self.launch(
            RUNNER,
            f"{n} requests",
            lambda: self.kernel(RUNNER)(*args),
            ref=lambda: scatter_num_accepted_reference(*args),
        )

    def aligned_state_indices(self, st: Step) -> torch.Tensor:
        """The V1 builder's align-mode state slots ``[R, 1 + spec]``: each request's block of its last token on."""
        b, slots = st.batch, 1 + self.lim.spec
        table = self.kda_table[: len(b.qlens)]

        def torch_indices() -> torch.Tensor:
            return aligned_state_indices_reference(table, st.seq_lens, block_size=self.kda_bs, num_state_slots=slots)

        if KDA_ALIGNED not in self.names:
            return torch_indices()
        return self.launch(
            KDA_ALIGNED,
            f"{len(b.qlens)} requests, block size {self.kda_bs}",
            lambda: self.kernel(KDA_ALIGNED)(table, st.seq_lens, block_size=self.kda_bs, num_state_slots=slots),
            fallback=torch_indices,
            ref=torch_indices,
        )

    def stage_spec_metadata(self, st: Step, state: torch.Tensor) -> None:
        """A decode-only speculative step: its requests' metadata into the graph buffers, padded to a captured
        batch size (the next power of two, within the buffers)."""
        b = st.batch
        if KDA_STAGE not in self.names or b.num_prefills or not b.num_decodes:
            return
        n, rows = b.num_decodes, self.staged[0].shape[0]
        padded = min(rows, warmreg.next_pow2(n))
        accepted = torch.randint(1, 2 + self.lim.spec, (n,), generator=self.gen, device=self.dev, dtype=I32)
        staged = (self.staged[0][:padded], self.staged[1][: padded + 1], self.staged[2][:padded])
        args = (state[:n], st.qsl[: n + 1], accepted, *staged)
        self.launch(
            KDA_STAGE,
            f"{n} speculative decodes padded to {padded}",
            lambda: self.kernel(KDA_STAGE)(*args, num_spec_decodes=n),
            ref=lambda: stage_spec_decode_metadata_reference(*args, num_spec_decodes=n),
        )

    def gather_initial_states(self, st: Step, state: torch.Tensor) -> None:
        """The prefill requests' initial states: their slots are column 0 of their aligned state indices, and
        a request has one when it has computed tokens before this chunk."""
        b = st.batch
        if KDA_GATHER not in self.names or not b.num_prefills:
            return
        nd = b.num_decodes
        slots = state[nd:, 0] % self.pool.shape[0]  # the sweep's random table ids, folded into the pool
        has = torch.tensor([s > q for s, q in zip(b.seqs[nd:], b.qlens[nd:])], device=self.dev)
        args = (self.pool, slots, has)
        self.launch(
            KDA_GATHER,
            f"{b.num_prefills} prefill requests",
            lambda: self.kernel(KDA_GATHER)(*args),
            ref=lambda: gather_initial_states_reference(*args),
        )

    def kda_gated_norm(self, st: Step) -> None:
        """The KDA output's gated RMSNorm over every token; the gate a column view of the fused projection."""
        if KDA_NORM not in self.names:
            return
        norm, t = self.kernel(KDA_NORM), st.batch.tokens
        h, d = norm.num_heads, norm.head_dim
        width = self.rng.choice((projection_width(h, d), 4 * h * d))  # the usual projection, the overlap path's
        g = self.randn(t, width, scale=2.0)[:, 3 * h * d : 4 * h * d].view(t, h, d)
        args = (self.randn(1, t, h, d, scale=3.0), g, self.o_norm_w)
        self.launch(
            KDA_NORM,
            f"{t} tokens, projection width {width}",
            lambda: norm(*args),
            ref=lambda: gated_rmsnorm_reference(*args),
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 output, fp32 sums in different orders
        )

    def attn_res(self, st: Step) -> None:
        """Every distinct call site of the forward (before attention with its block writes, before the MLP, the
        model output), sorted by block count, on the step's tokens; the sublayer outputs are random deltas."""
        ar, t = self.kernel(ATTN_RES), st.batch.tokens
        norm_w, qk_w, out_w = self.ar_weights
        prefix, blocks = self.ar_prefix[:t], self.ar_blocks[:t]
        for site in ar.call_sites:
            args: dict[str, Any] = dict(
                prefix=prefix, delta=self.randn(t, ar.hidden_size, scale=0.1) if site.has_delta else None,
                blocks=blocks, norm_weight=norm_w, qk_weight=qk_w,
                num_blocks=site.num_blocks, block_write_idx=site.block_write_idx, eps=ar.eps,
                output_norm_weight=out_w if site.apply_output_norm else None,
                output_norm_eps=ar.output_norm_eps if site.apply_output_norm else None,
            )  # fmt: skip
            what = f"{site.num_blocks} blocks, write {site.block_write_idx}, norm {site.apply_output_norm}"
            self.attn_res_site(ar, what, args)

    def attn_res_site(self, ar: Any, what: str, args: dict[str, Any]) -> None:
        """One ``attn_res`` launch; the reference runs on copies first, then the launch updates the buffers."""
        self.launch(
            ATTN_RES,
            what,
            lambda: ar(**args),
            ref=lambda: attn_res_reference(**args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 output from fp32 sums in different orders
        )

    def conv(self, st: Step) -> None:
        """The KDA layer's short convolutions on the step's packed projection ``[T, row]`` (vLLM's ``_forward``):
        the speculative rows (the decode requests, first) through the varlen update, the prefills through three
        prefill conv1d launches (q, k, v); a decode step of one-token rows through the plain-decode update when
        the plan holds it (vLLM's builder then classifies them as decodes)."""
        b, lay = st.batch, self.conv_layout
        p, spec, t = lay.projection_size, lay.num_speculative_tokens, b.tokens
        proj = self.randn(t, self.conv_row)
        perm = torch.randperm(self.conv_state.shape[0] - 1, generator=self.gen, device=self.dev)
        lines = perm[: len(b.qlens)].add_(1).to(I32)
        one_token = b.num_prefills == 0 and all(q == 1 for q in b.qlens)
        upd = self.kernel(CONV_UPDATE) if CONV_UPDATE in self.names else None
        if upd is not None and upd.plain_decode and one_token and (not spec or self.rng.random() >= 0.5):
            width = self.rng.choice([self.conv_row, 4 * p] if upd.overlap_rows else [self.conv_row])
            x = self.randn(t, width)[:, : 3 * p]
            stride = self.rng.choice(sorted({1, 1 + spec}))
            indices = self._conv_lines(lines, stride)
            conv_out = self._conv_update(f"{t} plain decode rows", x, indices)
            if KDA_PACKED in self.names:
                self.kda_packed_decode(proj, width, None if conv_out is None else conv_out[0], indices)
        elif upd is not None and spec and b.num_decodes:
            n, d = b.num_decodes, b.decode_tokens
            x = proj[:d, : 3 * p] if self.rng.random() < 0.5 else proj[:d, : 3 * p].contiguous()  # slice or gathered
            qsl = st.qsl[: n + 1].to(I32)
            accepted = torch.tensor([self.rng.randint(1, 1 + spec) for _ in range(n)], dtype=I32, device=self.dev)
            spec_args = {"num_accepted_tokens": accepted, "query_start_loc": qsl}
            self._conv_update(f"{n} speculative rows", x, self._conv_lines(lines[:n], 1 + spec), 1 + spec, spec_args)
        if b.num_prefills and CONV in self.names:
            start = b.decode_tokens if spec else 0  # without speculation the decodes are prefill rows of one token
            first = b.num_decodes if spec else 0
            rows = proj[start:]
            if spec and self.rng.random() < 0.5:
                rows = rows[:, : 3 * p].contiguous()  # a mixed batch's gathered non-speculative rows (index_select)
            qsl = (st.qsl[first:] - st.qsl[first]).to(I32)
            stride = 1 if spec and b.num_decodes else 1 + spec  # gathered rows, or block_table[:, 0]
            indices = self._conv_lines(lines[first:], stride)
            init = torch.rand(len(b.qlens) - first, generator=self.gen, device=self.dev) < 0.7
            chunks = conv1d_chunks(qsl.cpu(), device=self.dev)
            for c, name in enumerate("qkv"):
                cols = slice(c * p, (c + 1) * p)
                args = (rows[:, cols], self.conv_weight[cols], None, self.conv_state[:, cols], qsl, indices, init)
                self._conv_prefill(f"{b.num_prefills} prefills, {name}", args, chunks)

    def _conv_prefill(self, what: str, args: tuple[Any, ...], chunks: Any) -> None:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            return self.kernel(CONV)(*args, chunks=chunks), args[3]  # the output and the updated state slice

        # The plugin's tests: fp32 sums in one order, one bf16 step apart (the interpreter truncates).
        self.launch(CONV, what, run, ref=lambda: causal_conv1d_reference(*args), tol=(1e-6, 2**-7))

    def _conv_lines(self, lines: torch.Tensor, stride: int) -> torch.Tensor:
        """Cache lines as ``block_table[:, 0]`` of a table ``stride`` wide (a gathered copy when 1)."""
        table = torch.zeros((lines.shape[0], stride), dtype=I32, device=self.dev)
        table[:, 0] = lines
        return table[:, 0]

    def _conv_update(
        self, what: str, x: torch.Tensor, indices: torch.Tensor, max_len: int = -1, spec: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One conv update launch; returns ``(output, conv_state)``, or None on a miss or a failure."""
        kw = spec or {}
        args = (x, self.conv_state, self.conv_weight, None)
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            out = self.kernel(CONV_UPDATE)(*args, conv_state_indices=indices, max_query_len=max_len, **kw)
            return out, self.conv_state

        return self.launch(  # type: ignore[no-any-return]
            CONV_UPDATE,
            what,
            run,
            ref=lambda: causal_conv1d_update_reference(*args, indices, **kw),
            tol=(1e-6, 2**-7),
        )

    def kda_packed_decode(
        self, proj: torch.Tensor, width: int, conv_out: torch.Tensor | None, indices: torch.Tensor
    ) -> None:
        """vLLM's plain-decode step after the conv update (``kda.py: _forward``, pure non-speculative decode): the
        packed decode on the conv's output (its ``empty_like``: ``[B, 3P]`` rows, or for a batch of one the
        projection's row stride, plain or the overlap path's ``4P``), the gate projection's rows, beta a column of
        the projection, the state indices of the conv update (now and then a padded slot 0: zeros out)."""
        lay, (h, dk, _) = self.conv_layout, self.hkv
        p, t = lay.projection_size, indices.shape[0]
        mixed = self.randn(t, 3 * p) if conv_out is None else conv_out
        if t == 1:
            row = self.randn(1, width)
            row[:, : 3 * p] = mixed
            mixed = row[:, : 3 * p]
        raw_g = self.randn(1, t, h, dk, dtype=self.raw_dtypes[0])
        raw_beta = proj[:t, 4 * p + dk : 4 * p + dk + h].unsqueeze(0)
        slots = indices.clone()
        if self.rng.random() < 0.1:
            slots[-1] = 0  # CUDA-graph padding: the null slot
        a_log, dt_bias, bound = self.gate
        bias = dt_bias if dt_bias is not None else torch.zeros(h * dk, dtype=F32, device=self.dev)
        args = (mixed, raw_g, raw_beta, a_log, bias, bound, self.pool, slots)
        self.launch(
            KDA_PACKED,
            f"{t} plain decode rows",
            lambda: self.kernel(KDA_PACKED)(*args),
            ref=lambda: kda_packed_decode_reference(*args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
        )

    def kda(self, st: Step) -> None:
        """vLLM's speculative-decode step over the decode requests (``kda.py: _forward``; the kernel is planned only
        under speculation): q, k, v rearranged column slices of the conv update's ``[T, 3P]`` output (for one token
        the projection row it keeps), the gate projection's rows, beta a column of the packed projection, the
        ``[N, 1 + spec]`` state indices a view of a wider table (now and then a padded request on the null slot 0,
        or a column 0: no write), accepted counts ``1 .. 1 + spec``, ``out`` a view of core_attn_out or none."""
        b, kda = st.batch, self.kernel(KDA)
        if not b.num_decodes:
            return
        (h, dk, dv), t, n, cols = self.hkv, b.decode_tokens, b.num_decodes, 1 + self.lim.spec
        width = h * (2 * dk + dv)
        conv = self.randn(t, self.rng.choice(kda.projection_rows) if t == 1 and kda.projection_rows else width)
        q, k, v = (conv[:, c : c + h * w].view(1, t, h, w) for c, w in ((0, dk), (h * dk, dk), (2 * h * dk, dv)))
        raw_g = self.randn(1, t, h, dk, dtype=self.raw_dtypes[0])  # the raw projections: gate and beta in the kernel
        row = max(width + h, *kda.projection_rows)
        raw_beta = self.randn(t, row, dtype=self.raw_dtypes[1], scale=2.0)[:, row - h :].unsqueeze(0)
        table = torch.zeros(n, cols + 2, dtype=I32, device=self.dev)
        slots = torch.randperm(self.pool.shape[0] - 1, generator=self.gen, device=self.dev)[: n * cols].add(1)
        table[:, :cols] = slots.view(n, cols)  # distinct slots: no two tokens write one
        if self.rng.random() < 0.2:
            table[self.rng.randrange(n), self.rng.randrange(cols)] = 0  # the null slot in some column: no state there
        accepted = torch.randint(1, cols + 1, (n,), generator=self.gen, device=self.dev, dtype=I32)
        out = torch.empty(1, t + 1, h, dv, dtype=q.dtype, device=self.dev)[:, :t] if self.rng.random() < 0.5 else None
        args = (q, k, v, raw_g, raw_beta, *self.gate, self.pool, st.qsl[: n + 1], table[:, :cols], accepted)
        self.launch(
            KDA,
            f"{n} speculative sequences, {t} tokens",
            lambda: kda(*args, out=out),
            ref=lambda: kda_recurrent_reference(*args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
        )

    def kda_chunk(self, st: Step) -> None:
        """The chunked KDA prefill over the step's prefill requests, stage by stage as
        ``warmreg_kimi_k3.kda_chunk.chunk_kda_prefill`` chains them, between the layer's gather of the initial
        states from the pool (mixed: zeros without one) and its scatter of the final states back. On the CPU
        only the L2 norm is checked against its reference: Triton 3.8.0's interpreter multiplies bf16 ``tl.dot``
        operands as raw bits, so the bf16 chain is checked by the plugin's GPU test instead."""
        b = st.batch
        if not b.num_prefills:
            return
        (h, dk, dv), nd = self.chunk_hkv, b.num_decodes
        t = b.tokens - b.decode_tokens
        q, k, v = self.randn(t, h, dk), self.randn(t, h, dk), self.randn(t, h, dv)
        raw_g, raw_beta = self.randn(t, h, dk), self.randn(t, h, scale=2.0)
        cu = (st.qsl[nd:] - st.qsl[nd]).contiguous()
        n = b.num_prefills
        slots = torch.randperm(self.pool.shape[0] - 1, generator=self.gen, device=self.dev)[:n].add_(1).to(I32)
        has_state = torch.rand(n, generator=self.gen, device=self.dev) < 0.5  # continuing chunked prefills
        initial_state = gather_initial_states_reference(self.pool, slots, has_state)  # [N, H, V, K], as vLLM's
        l2, gate, intra, wu, hs, out = (self.kernel(name) for name in KDA_CHUNK)
        what = f"{n} prefill sequences, {t} tokens"
        chunks, offsets = chunk_metadata(cu)
        qn = self.launch(KDA_CHUNK[0], what, lambda: l2(q), ref=lambda: l2norm_reference(q), tol=(1e-2, 1.6e-2))
        kn = self.launch(KDA_CHUNK[0], what, lambda: l2(k))
        gb = self.launch(
            KDA_CHUNK[1], what, lambda: gate(raw_g, raw_beta, self.gate[0], self.gate[1], self.gate[2], cu, chunks)
        )
        if qn is None or kn is None or gb is None:
            return
        g, beta = gb
        solve = platform_solve_precision(self.plan.platform)  # the planned target's (vLLM: tf32 on sm >= 80)
        aa = self.launch(
            KDA_CHUNK[2],
            what,
            lambda: intra(qn, kn, g, beta, cu, chunks, safe_gate=self.gate[2] is not None, solve_precision=solve),
        )
        wuk = self.launch(KDA_CHUNK[3], what, lambda: wu(kn, v, beta, aa[1], g, cu, chunks)) if aa is not None else None
        if wuk is None:
            return
        hv = self.launch(
            KDA_CHUNK[4], what, lambda: hs(wuk[2], wuk[0], wuk[1], g, cu, offsets, initial_state, chunks.shape[0])
        )
        if hv is None:
            return
        self.pool[slots] = hv[2]  # the layer's scatter: recurrent_state[indices] = final_state
        self.launch(KDA_CHUNK[5], what, lambda: out(qn, hv[1], g, hv[0], aa[0], cu, chunks, out=v))
