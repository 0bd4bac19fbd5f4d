"""The ROCm half of the DeepSeek-V4 sweep driver: what vLLM 0.34's ROCm forward launches beyond the shared metadata
and layers (``models/deepseek_v4/amd/rocm.py``: ``DeepseekV4ROCMAiterMLAAttention`` and its two metadata builders;
``v1/attention/ops/rocm_aiter_mla_sparse.py``).

ROCm's sparse attention reads its KV indices as ragged streams: vLLM's ``build_ragged_indices_from_dense`` is a count
(which also zeroes ``indptr[0]``), a ``torch.cumsum`` and a compaction (:mod:`.rocm_ragged`). Once a step the metadata
builders compact: the SWA builder its decode tokens' SWA rows (``sliding_window`` wide; the DSpark draft's non-causal
rows are the index width wide) and, when prefill takes aiter's sparse MLA (:mod:`._rocm_attention`), its prefill
tokens' paged SWA rows (``window + vision_max_n_token`` wide, from the SWA kernel at the prefill offset); the C128
builder its decode tokens' global top-k rows (the step's C128 width). Then, per layer type, as
``forward_mqa`` runs prefill before decode:

* prefill on the in-tree path, every layer type, chunk by chunk after the dequant-gathers (``_forward_prefill``): ROCm's
  own combine of the top-k and SWA rows (:mod:`.rocm_combine_indices`; SWA-only layers pass the indexer buffer's rows
  with ``top_k`` 0, C4 the indexer's top-k, C128 the C128A prefill rows), compacted within the chunk's workspace rows,
  then the sparse prefill over the workspace (``rocm_sparse_attn_prefill``, :mod:`.rocm_sparse_attn_prefill`);
* prefill on aiter's sparse MLA, C4 and C128 layers (``_forward_prefill_aiter``): the top-k rows as global slots of
  the compressed cache (:mod:`.rocm_prefill_topk`), compacted within the cache's rows;
* decode, C4 layers (``_forward_decode``): the top-k lens, the cumsum and the ragged pack of the indexer's decode rows
  as cache slots (:mod:`.rocm_decode_topk`);
* the C4 indexer on the FP8 cache with aiter's prefill top-k (``rocm_aiter_sparse_attn_indexer``), each prefill chunk:
  aiter's top-k returns columns of the chunk's logits, which the localization makes request-local again
  (:mod:`.rocm_localize_topk`). The driver writes ``local + cu_seqlen_ks`` (the chunk metadata's ``ks``) into the
  top-k rows, as aiter leaves them, and the op must give the local rows back. Before it, each chunk's gather of its
  requests' compressed K rows out of the indexer cache; on decode, the indexer's paged logits
  (:mod:`._sweep_rocm_indexer`).
* decode, every layer type: the sparse decode (split-KV partials, then the reduce that rotates the rows back) over the
  decode streams (:mod:`._sweep_rocm_decode`);
* every layer type after its attention, on a step with prefill rows: the inverse RoPE of the in-tree prefill's rows,
  in place (:mod:`.rocm_inverse_rope`; the decode reduce rotated the decode rows).

The decode SWA rows and the C128 rows come from the per-step metadata of
:class:`~warmreg_deepseek_v4.sweep_inputs.DSV4Engine`, which computes them in PyTorch where their kernels are not
planned (ROCm); the prefill SWA rows likewise. Every launch's first one is checked against its op's PyTorch reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
import triton

from ._interpreter_dot import bf16_dot_by_value
from ._rocm_attention import aiter_sparse_mla_prefill
from ._sweep_rocm_decode import DECODE_DRIVES, decode_attention, decode_rotates
from ._sweep_rocm_indexer import INDEXER_DRIVES, RocmIndexerLaunches
from .rocm_combine_indices import rocm_combine_topk_swa_indices_reference
from .rocm_decode_topk import global_topk_ragged_reference
from .rocm_inverse_rope import rocm_inverse_rope_reference
from .rocm_localize_topk import localize_topk_reference
from .rocm_prefill_topk import prefill_topk_slots_reference
from .rocm_ragged import ragged_from_dense_reference
from .rocm_sparse_attn_prefill import rocm_sparse_attn_prefill_reference
from .swa_indices import decode_swa_indices_reference
from .sweep_inputs import DSV4_PREFIX, F32, I32, SWA, DSV4Step

__all__ = ["ROCM_DRIVES", "DSV4RocmLaunches"]

COUNT, COMPACT, LENS, PACK, RCOMBINE, TOPK_SLOTS, LOCALIZE = (
    DSV4_PREFIX + n
    for n in (
        "rocm_ragged_count", "rocm_ragged_compact", "rocm_topk_lens", "rocm_pack_topk_ragged",
        "rocm_combine_topk_swa_indices", "rocm_prefill_topk_slots", "rocm_localize_topk",
    )
)  # fmt: skip
INV_ROPE = DSV4_PREFIX + "rocm_inverse_rope"
PREFILL_ATTN = DSV4_PREFIX + "rocm_sparse_attn_prefill"
#: The ROCm kernels :class:`DSV4RocmLaunches` launches (the driver's ``drives`` holds them).
ROCM_DRIVES = (
    INDEXER_DRIVES
    | DECODE_DRIVES
    | {COUNT, COMPACT, LENS, PACK, RCOMBINE, TOPK_SLOTS, LOCALIZE, INV_ROPE, PREFILL_ATTN}
)


def _host(fn: Callable[..., Any], *args: Any, dev: torch.device, **kw: Any) -> tuple[torch.Tensor, ...]:
    """``fn`` (a reference, which indexes with host ranges) on host copies of ``args``, its outputs back on ``dev``."""
    out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), **kw)
    return tuple(t.to(dev) for t in out)


class DSV4RocmLaunches(RocmIndexerLaunches):
    """DeepSeek-V4's engine and ROCm's launches (see the module docstring), each a no-op where its kernel is not
    planned; :class:`~warmreg_deepseek_v4.sweep.DSV4Sweep` calls them where vLLM's ROCm forward runs them."""

    @cached_property
    def rocm_aiter_prefill(self) -> bool:
        """Whether prefill takes aiter's sparse MLA (and reads the caches in place: no combine)."""
        return aiter_sparse_mla_prefill(self.cfg, self.m, self.plan.platform)

    def ragged(
        self, what: str, indices: torch.Tensor, lengths: torch.Tensor, num_rows: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """vLLM's ``build_ragged_indices_from_dense`` on dense rows: the count (checked with ``indptr[0]``, which it
        writes into an uninitialized buffer), the cumsum, the compaction (checked on the written ``flat[:indptr[n]]``).
        Returns the stream and ``indptr`` (None where the compaction is not planned or the rows are empty)."""
        if not self.has("rocm_ragged_count"):
            return None
        indices, lengths = indices.reshape(indices.shape[0], -1), lengths.to(I32).reshape(-1).contiguous()
        n, width = indices.shape
        if not n or not width:
            return None
        indptr = torch.full((n + 1,), -1, dtype=I32, device=self.dev)

        def want() -> tuple[torch.Tensor, ...]:
            return _host(ragged_from_dense_reference, indices, lengths, num_rows, dev=self.dev)

        def torch_counts() -> tuple[torch.Tensor, torch.Tensor]:
            indptr[0] = 0
            return want()[1].diff(), indptr[:1]

        counts, _ = self.launch(
            COUNT,
            f"{what}, {n} x {width}",
            lambda: (self.k("rocm_ragged_count")(indices, lengths, indptr, num_rows=num_rows), indptr[:1]),
            fallback=torch_counts,
            ref=lambda: (want()[1].diff(), torch.zeros(1, dtype=I32)),
        )
        torch.cumsum(counts, dim=0, out=indptr[1:])
        flat, total = torch.empty(n * width, dtype=I32, device=self.dev), int(indptr[-1])
        self.launch(
            COMPACT,
            f"{what}, {n} x {width}",
            lambda: self.k("rocm_ragged_compact")(indices, lengths, indptr, out=flat, num_rows=num_rows)[:total],
            ref=lambda: want()[0],
        )
        return flat, indptr

    def rocm_metadata(self, st: DSV4Step) -> None:
        """The metadata builders' compactions of a step: the SWA builder's decode rows and (aiter's prefill) prefill
        rows, the C128 builder's decode top-k rows."""
        b = st.batch
        self.decode_streams: dict[str, Any] = {"step": st}  # for the layers' decode (_sweep_rocm_decode)
        if not self.has("rocm_ragged_count"):
            return
        if st.swa_decode is not None:
            self.decode_streams["swa"] = self.ragged("SWA builder, decode rows", *st.swa_decode)
        if st.c128_decode is not None and b.decode_tokens:
            self.decode_streams["c128"] = self.ragged("C128 builder, decode top-k rows", *st.c128_decode)
        if self.rocm_aiter_prefill and b.num_prefills and SWA in st.slots:
            nd, image = b.decode_tokens, self.m.vision_max_n_token
            args = (st.positions, st.token_to_req, st.slots[SWA] >= 0, self.tables[SWA], st.replay)
            kw: dict[str, Any] = dict(
                num_tokens=b.tokens - nd, window_size=self.window, index_width=self.window + image, block_size=SWA,
                token_offset=nd,
            )  # fmt: skip
            rows, lens = _host(decode_swa_indices_reference, *args, dev=self.dev, **kw)  # no kernel planned on ROCm
            self.ragged("SWA builder, prefill rows", rows, lens)

    def rocm_swa_rows(self, what: str, swa: tuple[torch.Tensor, torch.Tensor] | None, tokens: int) -> None:
        """The SWA builder's compaction of ``tokens`` decode rows it built (``swa``: the indices and lens)."""
        if swa is not None:
            self.ragged(f"SWA builder, {what} rows", swa[0][:tokens], swa[1][:tokens])

    def rocm_attention(self, st: DSV4Step, ratio: int) -> None:
        """A layer type's ROCm attention work: aiter's prefill top-k slots, the C4 decode top-k stream, the sparse
        decode over the decode streams (:mod:`._sweep_rocm_decode`), then the standalone inverse RoPE of the rows no
        attention kernel rotated."""
        self.rocm_compress_two_stage(st, ratio)  # C128: the prefill rows' two-stage compressor, then
        self.rocm_compress_insert(st, ratio)  # the compressor's insert, ahead of the attention
        if self.rocm_aiter_prefill and ratio > 1 and st.batch.num_prefills:
            self._prefill_topk_slots(st, ratio)
        streams: dict[str, Any] = getattr(self, "decode_streams", {})  # rocm_metadata's, for this step's layers
        if ratio == 4:
            streams["c4"] = self._decode_topk(st)
        decode_attention(self, st, ratio, streams)
        self._inverse_rope(st, ratio)

    def _inverse_rope(self, st: DSV4Step, ratio: int) -> None:
        """``forward_mqa``'s ``rocm_inverse_rope_rows_(output[rotated:end, :n_local_heads], positions[rotated:end],
        ...)``: the decode reduce rotated the decode rows, so the in-tree prefill's rows ``[decode_tokens, T)`` are
        left (none: no launch, as vLLM's early return); on gfx1250 and RDNA decode rotates nothing, so every row
        (:func:`._sweep_rocm_decode.decode_rotates`)."""
        b, m = st.batch, self.m
        first = b.decode_tokens if decode_rotates(self.plan.platform) else 0
        if not self.has("rocm_inverse_rope") or b.tokens <= first:
            return
        output = self.randn(b.tokens, m.num_attention_heads // self.tp, m.head_dim, scale=3)
        rows, pos, cache = output[first:], st.positions[first:], self.rope[ratio]
        want = rocm_inverse_rope_reference(rows, pos, cache, rope_head_dim=m.qk_rope_head_dim)
        self.launch(
            INV_ROPE,
            f"c{ratio} layer, {b.tokens - first} rows from {first}",
            lambda: self.k("rocm_inverse_rope")(rows, pos, cache, rope_head_dim=m.qk_rope_head_dim, inplace=True),
            ref=lambda: want,
        )

    def _prefill_topk_slots(self, st: DSV4Step, ratio: int) -> None:
        """``build_prefill_topk_ragged_indices``: the prefill rows as compressed-cache slots, then compacted within the
        cache's rows (``kv_cache.shape[0] * shape[1]``: pages of ``256 // ratio`` compressed tokens)."""
        b, nd = st.batch, st.batch.decode_tokens
        topk = st.topk[nd:] if ratio == 4 and st.topk is not None else st.prefill_local if ratio == 128 else None
        if not self.has("rocm_prefill_topk_slots") or topk is None or SWA not in st.slots:
            return
        args = (
            topk,
            st.token_to_req,
            st.qsl,
            st.seq_lens,
            st.slots[SWA] >= 0,
            self.ctables[f"c{ratio}"][: len(b.qlens)],
        )
        kw: dict[str, Any] = dict(
            block_size=self.page[ratio], compress_ratio=ratio, num_compressed=triton.cdiv(self.lim.max_model_len, ratio),
            token_offset=nd,
        )  # fmt: skip
        out = self.launch(
            TOPK_SLOTS,
            f"c{ratio} layer, {b.tokens - nd} prefill tokens x {topk.shape[1]}",
            lambda: self.k("rocm_prefill_topk_slots")(*args, **kw),
            fallback=lambda: _host(prefill_topk_slots_reference, *args, dev=self.dev, **kw),
            ref=lambda: prefill_topk_slots_reference(*args, **kw),
        )
        self.ragged(
            f"c{ratio} layer, prefill top-k slots", out[0], out[1], num_rows=self.lim.num_blocks * self.page[ratio]
        )

    def _decode_topk(self, st: DSV4Step) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``compute_global_topk_ragged_indices_and_indptr`` on the indexer's decode rows, the SWA metadata's
        ``token_to_req_indices`` and ``is_valid_token`` and the C4 layer's block table of the decode requests.
        Returns the packed stream and its indptr (the C4 layers' decode reads them)."""
        b, nd = st.batch, st.batch.decode_tokens
        if not self.has("rocm_topk_lens") or not nd or st.topk is None or SWA not in st.slots:
            return None
        topk, valid = st.topk[:nd].reshape(nd, -1).contiguous(), (st.slots[SWA] >= 0)[:nd]
        table, bs = self.ctables["c4"][: b.num_decodes], self.page[4]

        def want() -> tuple[torch.Tensor, ...]:
            return _host(global_topk_ragged_reference, topk, st.token_to_req, table, bs, valid, dev=self.dev)

        what = f"c4 layer, {nd} decode tokens"
        lens = self.launch(
            LENS, what, lambda: self.k("rocm_topk_lens")(topk, valid), fallback=lambda: want()[2], ref=lambda: want()[2]
        )
        indptr = torch.zeros(nd + 1, dtype=I32, device=self.dev)
        torch.cumsum(lens, dim=0, out=indptr[1:])
        flat, total = torch.empty(topk.numel(), dtype=I32, device=self.dev), int(indptr[-1])

        def pack() -> torch.Tensor:  # the written prefix of the stream
            self.k("rocm_pack_topk_ragged")(topk, indptr, st.token_to_req, table, block_size=bs, out=flat)
            return flat[:total]

        self.launch(PACK, what, pack, ref=lambda: want()[0])
        return flat, indptr

    def rocm_combine(
        self, st: DSV4Step, where: str, ratio: int, a: int, e: int, nm: tuple[int, int], lens: torch.Tensor
    ) -> None:
        """The in-tree prefill of a chunk (requests ``[a, e)``, ``M`` workspace rows a request, ``N`` compressed):
        ROCm's combine, then the compaction within the chunk's ``(e - a) * M`` workspace rows."""
        if not self.has("rocm_combine_topk_swa_indices"):
            return
        b, (n, m) = st.batch, nm
        t0, t1, nd = sum(b.qlens[:a]), sum(b.qlens[:e]), b.decode_tokens
        rows = {1: self.topk_buf, 4: st.topk, 128: st.prefill_local}[ratio]  # SWA-only: the buffer's, never read
        if rows is None:
            return
        shift = nd if ratio == 128 else 0  # C128A's prefill rows start after the decode tokens
        topk = rows[t0 - shift : t1 - shift].reshape(t1 - t0, -1).contiguous()  # as vLLM's wrapper makes them
        args = (topk, st.qsl[a : e + 1], st.seq_lens[a:e], lens)
        kw: dict[str, Any] = dict(
            compress_ratio=ratio, topk=topk.shape[1] if ratio > 1 else 0, M=m, N=n,
            max_image_tokens=self.m.vision_max_n_token,
        )  # fmt: skip
        out = self.launch(
            RCOMBINE,
            f"{where} (ROCm)",
            lambda: self.k("rocm_combine_topk_swa_indices")(*args, **kw),
            fallback=lambda: _host(
                rocm_combine_topk_swa_indices_reference, *args, dev=self.dev, window_size=self.window, **kw
            ),
            ref=lambda: rocm_combine_topk_swa_indices_reference(*args, window_size=self.window, **kw),
        )
        stream = self.ragged(f"{where}, combined rows", out[0], out[1], num_rows=(e - a) * m)
        if stream is not None:
            self._sparse_prefill(where, t1 - t0, (e - a) * m, stream)

    def _sparse_prefill(self, where: str, tokens: int, rows: int, stream: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``rocm_sparse_attn_prefill`` of the chunk's ``tokens`` queries over its ``rows`` workspace rows (random
        bf16 queries, workspace and fp32 sinks: the op reads only their values), on the compacted combined rows. On
        the CPU the interpreter multiplies bf16 dot operands by value (:mod:`._interpreter_dot`)."""
        if not self.has("rocm_sparse_attn_prefill"):
            return
        m = self.m
        heads = m.num_attention_heads // self.tp
        q, kv = self.randn(tokens, heads, m.head_dim), self.randn(rows, m.head_dim)
        sink, scale = self.randn(heads, dtype=F32), m.head_dim**-0.5
        args = (q, kv, stream[0], stream[1], sink)

        def run() -> torch.Tensor:
            with contextlib.nullcontext() if self.cuda else bf16_dot_by_value():
                return self.k("rocm_sparse_attn_prefill")(*args, scale=scale)

        self.launch(
            PREFILL_ATTN,
            f"{where}, {tokens} queries x {heads} heads",
            run,
            ref=lambda: rocm_sparse_attn_prefill_reference(*(t.cpu() for t in args), scale=scale),
            tol=(2e-2, 2**-6),  # the op's tests: bf16 probabilities in the second dot, fp32 sums in another order
        )

    def rocm_localize(self, st: DSV4Step, t0: int, t1: int, row_starts: torch.Tensor | None) -> None:
        """Aiter's prefill top-k of an indexer chunk's query slice (tokens ``[t0, t1)``) localized in place: the rows
        hold ``local + row_starts`` (the logits' columns aiter returns) before, the local indices after."""
        if not self.has("rocm_localize_topk") or st.topk is None or row_starts is None or t1 <= t0:
            return
        rows = st.topk[t0:t1, : self.m.index_topk]
        local = rows.clone()
        rows.copy_(torch.where(local >= 0, local + row_starts[:, None], local))
        self.launch(
            LOCALIZE,
            f"c4 indexer, chunk tokens [{t0}, {t1})",
            lambda: self.k("rocm_localize_topk")(rows, row_starts),
            fallback=lambda: rows.copy_(local),
            ref=lambda: localize_topk_reference(rows, row_starts),
        )
