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
with DCP the MLA decode's combine correction after the Q/KV norm (:mod:`warmreg_kimi_k3.sweep_dcp`). The KDA layers'
steps (convolutions, packed decode, recurrent step, chunked prefill) are :mod:`warmreg_kimi_k3.sweep_kda`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import warmreg
from warmreg.ops import block_table_width
from warmreg.testing.sweep import NORM, Batch, Limits, Step, Sweep

from ._sweep_dsa_metadata import DSA_METADATA, DSAMetadataStep
from .attn_res import attn_res_reference
from .causal_conv1d import projection_row_stride
from .dsa_k_insert import dsa_k_insert_reference, mx_scale_default
from .dsa_prologue import dsa_prologue_reference, mla_entry_bytes
from .dsa_q_quant import dsa_q_quant_reference
from .gated_rmsnorm import gated_rmsnorm_reference, projection_width
from .gather_initial_states import gather_initial_states_reference
from .kda import KDARecurrent
from .kda_spec_metadata import stage_spec_decode_metadata_reference
from .kda_state_indices import aligned_state_indices_reference
from .num_accepted import scatter_num_accepted_reference
from .plugin import MODEL_TYPES
from .sweep_dcp import DCP_A2A_COMBINE, DCP_A2A_PACK, DCP_CORRECT, dcp_a2a_step, dcp_correct_step
from .sweep_kda import CONV, CONV_UPDATE, KDA, KDA_CHUNK, KDA_PACKED, chunk_step, conv_step, recurrent_step
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
ATTN_RES = "kimi_k3.attn_res"
KDA_NORM, KDA_GATHER = "kimi_k3.gated_rmsnorm", "kimi_k3.gather_initial_states"
KDA_ALIGNED, KDA_STAGE = "kimi_k3.aligned_state_indices", "kimi_k3.stage_spec_decode_metadata"
RUNNER = "kimi_k3.scatter_num_accepted"
DSA_PROLOGUE, DSA_K_INSERT = "kimi_k3.dsa_fused_prologue", "kimi_k3.dsa_k_norm_quant_insert"
DSA_Q_QUANT = "kimi_k3.dsa_q_quant_fold_weights"


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
                recurrent_step(self, st)
            elif kind == "conv":
                conv_step(self, st)
            elif kind == "kda_chunk":
                chunk_step(self, st)
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
