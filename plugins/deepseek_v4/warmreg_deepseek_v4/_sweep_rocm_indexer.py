"""The ROCm FP8 C4 indexer's launches in the DeepSeek-V4 sweep driver (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``rocm_aiter_sparse_attn_indexer``) and ROCm's head-512 compressor
of the attention caches (``models/deepseek_v4/compressor.py``), a base of
:class:`~warmreg_deepseek_v4.sweep_rocm.DSV4RocmLaunches`:

* each compressed layer type, after its compressor's state save: the fused compress + quant + insert of the closing
  windows into the layer type's ``fp8_ds_mla`` cache (:mod:`.rocm_compress_insert`): every token of a C4 layer, the
  leading single-token requests' tokens of a C128 layer (``split_decodes_and_prefills(decode_threshold=1)``; the
  other rows take the two-stage kernels);
* each C128 layer type with prefill rows, ahead of that insert: the two-stage compressor of the rows after the
  leading single-token requests' (:mod:`.rocm_compress_two_stage`): the split pooling into a float32 scratch
  (vLLM's split count for the device's CU count), then the RMSNorm + quant + RoPE + insert of each pooled row;

* each indexer prefill chunk, before its logits: the gather of the chunk's requests' compressed K rows
  (``seq_len // 4`` each) and scales out of the indexer cache into the workspace (:mod:`.rocm_indexer_gather`);
* each step with decode tokens, after the indexer's Q quant: the paged MQA logits of the decode rows
  (:mod:`.rocm_indexer_logits`) as the indexer metadata lays them out on ROCm: natively (``[B, N]`` rows, ``N`` the
  step's longest decode, Q packed where decode lengths differ, lengths ``L - N + 1 + j`` clamped at 0) when
  ``1 + num_speculative_tokens`` is 1 or 2, else flattened (a row a decode token, its request's block-table row).

Each first launch is checked against its op's PyTorch reference.
"""

from __future__ import annotations

import torch

from ._rocm_decode_splits import cu_count
from .rocm_compress_insert import rocm_sparse_compress_insert_reference
from .rocm_compress_two_stage import (
    compress_num_splits,
    rocm_compress_finalize_reference,
    rocm_compress_gather_reference,
)
from .rocm_indexer_gather import indexer_k_gather_reference
from .rocm_indexer_logits import indexer_logits_reference
from .sweep_inputs import DSV4_PREFIX, I32, STATE, DSV4Engine, DSV4Step

__all__ = ["COMPRESS", "FINALIZE", "GATHER_SPLIT", "INDEXER_DRIVES", "K_GATHER", "LOGITS", "RocmIndexerLaunches"]

K_GATHER, LOGITS = DSV4_PREFIX + "rocm_indexer_k_gather", DSV4_PREFIX + "rocm_indexer_logits"
COMPRESS = DSV4_PREFIX + "rocm_sparse_compress_insert"
GATHER_SPLIT, FINALIZE = DSV4_PREFIX + "rocm_compress_gather_split", DSV4_PREFIX + "rocm_compress_finalize"
#: The kernels :class:`RocmIndexerLaunches` launches.
INDEXER_DRIVES = frozenset({K_GATHER, LOGITS, COMPRESS, GATHER_SPLIT, FINALIZE})
_U8 = torch.uint8


class RocmIndexerLaunches(DSV4Engine):
    """The ROCm FP8 indexer's prefill gather and decode logits (see the module docstring), each a no-op where its
    kernel is not planned."""

    def _fp8(self) -> torch.dtype:
        return torch.float8_e4m3fnuz if self.plan.platform.fp8_fnuz else torch.float8_e4m3fn

    def rocm_compress_insert(self, st: DSV4Step, ratio: int) -> None:
        """ROCm's ``compress_norm_rope_store_triton`` (head 512) of a C4 or C128 layer type's compressor."""
        b, site, page = st.batch, f"c{ratio}", STATE.get(ratio, 0)
        if COMPRESS not in self.names or page not in st.slots or site not in st.cslots:
            return
        rows = b.tokens
        if ratio == 128:  # the single-token requests ahead of the others
            lead = next((i for i, q in enumerate(b.qlens) if q > 1), len(b.qlens))
            rows = sum(b.qlens[:lead])
        if not rows:
            return
        pages, bs = self.fp8[ratio], self.page[ratio]
        cache = pages.as_strided((pages.shape[0], bs, 584), (pages.stride(0), 584, 1))
        weight = self.randn(512, scale=0.1).add_(1)
        args = (
            self.states[site], st.token_to_req, st.positions, st.slots[page][:rows], self.tables[page], weight,
            self.rope[ratio], cache, st.cslots[site],
        )  # fmt: skip
        eps, sanitize = self.m.rms_norm_eps, self.plan.platform.arch == "gfx950"
        h = [x.cpu() for x in args]

        def ref() -> torch.Tensor:
            out = rocm_sparse_compress_insert_reference(
                h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], eps, compress_ratio=ratio, sanitize_nans=sanitize
            )
            return out.to(self.dev)

        self.launch(
            COMPRESS,
            f"{site} compressor, {rows} rows",
            lambda: (self.kernel(COMPRESS)(*args, eps, compress_ratio=ratio, sanitize_nans=sanitize), pages)[1],
            ref=ref,
        )

    def rocm_compress_two_stage(self, st: DSV4Step, ratio: int) -> None:
        """ROCm's ``compress_norm_rope_store_two_stage_triton`` of a C128 layer type: its two launches on the rows past
        the leading single-token requests' (``[num_decode_tokens, num_actual)``)."""
        b, site, page = st.batch, f"c{ratio}", STATE.get(ratio, 0)
        if ratio != 128 or GATHER_SPLIT not in self.names or page not in st.slots or site not in st.cslots:
            return
        lead = sum(b.qlens[: next((i for i, q in enumerate(b.qlens) if q > 1), len(b.qlens))])
        rows = b.tokens - lead
        if rows <= 0:
            return
        pages, bs = self.fp8[ratio], self.page[ratio]
        cache = pages.as_strided((pages.shape[0], bs, 584), (pages.stride(0), 584, 1))
        state = (self.states[site], st.token_to_req[lead:], st.positions[lead:], st.slots[page][lead : b.tokens],
                 self.tables[page])  # fmt: skip
        scratch = torch.zeros(rows, 512, dtype=torch.float32, device=self.dev)
        splits = compress_num_splits(rows, cu_count(self.dev))
        self.launch(
            GATHER_SPLIT,
            f"{site} compressor, {rows} prefill rows, {splits} splits",
            lambda: self.kernel(GATHER_SPLIT)(*state, scratch, num_splits=splits),
            ref=lambda: rocm_compress_gather_reference(*(x.cpu() for x in (*state, scratch))).to(self.dev),
            tol=(1e-6, 1e-5),  # fp32 sums in another order
        )
        weight = self.randn(512, scale=0.1).add_(1)
        args = (scratch, st.positions[lead:], st.slots[page][lead : b.tokens], weight, self.rope[ratio], cache,
                st.cslots[site][lead:])  # fmt: skip
        eps, sanitize = self.m.rms_norm_eps, self.plan.platform.arch == "gfx950"

        def ref() -> torch.Tensor:  # runs after the pooling, on the CPU only
            h = [x.cpu() for x in args]
            out = rocm_compress_finalize_reference(
                h[0], h[1], h[2], h[3], h[4], h[5], h[6], eps, sanitize_nans=sanitize
            )
            return out.to(self.dev)

        self.launch(
            FINALIZE,
            f"{site} compressor, {rows} prefill rows",
            lambda: (self.kernel(FINALIZE)(*args, eps, sanitize_nans=sanitize), pages)[1],
            ref=ref,
        )

    def rocm_indexer_gather(self, st: DSV4Step, a: int, e: int) -> None:
        """``cp_gather_indexer_k_quant_cache_triton`` of an indexer prefill chunk (requests ``[a, e)``): their
        compressed K rows (``cu_seq_lens`` and ``token_to_seq`` as the metadata builder makes them) out of the C4
        indexer cache into the workspace's FP8 rows and uint8 ``[total, 4]`` scales."""
        lens = [s // 4 for s in st.batch.seqs[a:e]]
        total = sum(lens)
        if K_GATHER not in self.names or not total:
            return
        cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(I32).to(self.dev)
        seq = torch.repeat_interleave(torch.arange(e - a), torch.tensor(lens)).to(I32).to(self.dev)
        k_fp8 = torch.zeros(total, self.m.index_head_dim, dtype=_U8, device=self.dev).view(self._fp8())
        k_scale = torch.zeros(total, 4, dtype=_U8, device=self.dev)
        args = (self.index_cache, k_fp8, k_scale, self.ctables["indexer"][a:e], cu, seq)
        self.launch(
            K_GATHER,
            f"c4 indexer, requests [{a}, {e}), {total} rows",
            lambda: tuple(t.view(_U8) for t in self.kernel(K_GATHER)(*args)),
            ref=lambda: tuple(t.to(self.dev) for t in indexer_k_gather_reference(*(x.cpu() for x in args))),
        )

    def rocm_indexer_logits(self, st: DSV4Step, q: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """``rocm_fp8_paged_mqa_logits`` of the decode rows: ``q`` the indexer Q quant's ``(q_fp8 [T, H, D],
        weights [T, H])``, the C4 indexer cache and table, the compressed max model len as the logits' width."""
        b = st.batch
        nd, reqs = b.decode_tokens, b.num_decodes
        if LOGITS not in self.names or q is None or not nd:
            return
        q_fp8, weights = q
        heads, dim = q_fp8.shape[1:]
        dec, cseq = list(b.qlens[:reqs]), torch.tensor([s // 4 for s in b.seqs[:reqs]], dtype=torch.int64)
        table = self.ctables["indexer"][:reqs]
        if 1 + self.lim.spec <= 2:  # native: [B, N] rows, packed where the decode lengths differ
            n = max(dec)
            padded = torch.zeros(reqs, n, heads, dim, dtype=_U8, device=self.dev).view(q_fp8.dtype)
            starts = [sum(dec[:r]) for r in range(reqs)]
            for r, (t0, ln) in enumerate(zip(starts, dec)):
                padded[r, :ln] = q_fp8[t0 : t0 + ln]
            lens = (cseq[:, None] - n + 1 + torch.arange(n)).clamp_min(0) if n > 1 else cseq
            rows_q = padded
        else:  # flattened: a row a decode token, the request's table row repeated
            n, reps = 1, torch.tensor(dec)
            lens = torch.repeat_interleave(cseq - reps, reps) + torch.cat([torch.arange(1, d + 1) for d in dec])
            table = torch.repeat_interleave(table, reps.to(self.dev), dim=0)
            rows_q = q_fp8[:nd].reshape(nd, 1, heads, dim)
        rows = rows_q.shape[0] * n
        w = weights[:rows] if weights.shape[0] >= rows else torch.cat([weights, weights.new_zeros(rows, heads)])[:rows]
        out = torch.zeros(rows, self.lim.max_model_len // 4, dtype=torch.float32, device=self.dev)
        args = (rows_q, self.index_cache.unsqueeze(-2), w, lens.to(I32).to(self.dev), table)
        checked = not self.cuda and not self.stats[LOGITS].checks  # launch checks the first launch only
        want = indexer_logits_reference(*[x.cpu() for x in (*args, out)]) if checked else None
        self.launch(
            LOGITS,
            f"c4 indexer decode, {rows_q.shape[0]} x {n} rows",
            lambda: self.kernel(LOGITS)(*args, out=out),
            ref=(lambda: want) if want is not None else None,
            tol=(1e-5 * float(want.abs().amax()) if want is not None and want.numel() else 0.0, 1e-5),  # sum orders
        )
