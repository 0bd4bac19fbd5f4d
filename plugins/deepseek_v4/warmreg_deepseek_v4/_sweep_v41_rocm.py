"""The DeepSeek-V4.1 sweep's ROCm launches (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py`` and ``amd/ops``),
called once a step by :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` on a ROCm plan, each launch a no-op where its
kernel is not planned:

* the SWA metadata builder of a decode-only step of 1..32 tokens under ``--monokernel`` (gfx942 / gfx950): the
  one-launch build (:mod:`.v41_rocm_swa_decode_meta`) into the builder's persistent buffers, from the step's SWA slot
  mapping (V4.1's 32-token SWA blocks), ``query_start_loc``, ``seq_lens``, the request map and replay starts; any
  other step with decode tokens: the compaction of the builder's dense decode SWA rows (:mod:`.rocm_ragged`, the rows
  :class:`~.swa_indices.DecodeSwaIndices` computes, here from its reference);
* every compressed ratio's ``_decode_topk_ragged`` (the index source computes it once a step for each ratio): the
  decode tokens' top-k rows (random causal local positions, ``-1`` tails) as cache slots of the compressed cache's
  block table (``256 // ratio`` compressed tokens a block): on gfx942 under ``--monokernel`` a batch of up to 16 tokens
  takes the one-launch pack (:mod:`.v41_rocm_topk_pack`), any other batch DeepSeek-V4's count, cumsum and pack
  (:mod:`.rocm_decode_topk`);
* on gfx942 under ``--monokernel``, each index source ratio's key lists of a decode-only step (the mono decode's
  index layers, :mod:`.v41_rocm_keylist`): random dense window rows and lengths and top-k rows;
* on gfx950 with aiter, one delayed mHC seam of a step of up to 128 tokens (:mod:`.v41_rocm_mhc_post_collapse`; the
  decoder layer runs it at every seam with a post block inside FULL graph capture).
* on gfx942 / gfx950 at a tensor-parallel size above 1, each engram layer's sharded gate, every rank's partials and
  the finish (:mod:`._sweep_v41_rocm_engram`);
* on gfx950 without aiter's sparse MLA, a prefill step's MXFP8 attention rows (:mod:`._sweep_v41_rocm_prefill`),
* without aiter's sparse MLA, a prefill step's K gathers of every layer kind (:mod:`._sweep_v41_rocm_gather`),
* every layer kind's sparse MLA decode: gfx942's partial pass and reduce, the single-pass decode off gfx942 and gfx950
  (:mod:`._sweep_v41_rocm_decode`).

Each kernel's first launch is checked against its PyTorch reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._sweep_v41_rocm_decode import ROCM_DECODE_DRIVES, drive_rocm_decode
from ._sweep_v41_rocm_engram import ROCM_ENGRAM_DRIVES, drive_rocm_engram
from ._sweep_v41_rocm_gather import ROCM_GATHER_DRIVES, drive_rocm_prefill_gather
from ._sweep_v41_rocm_prefill import ROCM_PREFILL_DRIVES, drive_rocm_prefill_rows
from ._v41 import index_ratios
from .rocm_decode_topk import global_topk_ragged_reference
from .rocm_ragged import ragged_from_dense_reference
from .swa_indices import decode_swa_indices_reference
from .sweep_inputs import DSV4_PREFIX, I32, KV, DSV4Step
from .v41_rocm_keylist import MONO_TOPK, MONO_WINDOW, keylist_reference
from .v41_rocm_mhc_post_collapse import mhc_post_collapse_rms_norm_reference
from .v41_rocm_swa_decode_meta import MAX_ROWS as META_ROWS
from .v41_rocm_swa_decode_meta import swa_decode_meta_reference
from .v41_rocm_topk_pack import MAX_ROWS as PACK_ROWS

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ROCM41_DRIVES", "drive_rocm41"]

SWA_META, TOPK_PACK, LENS, PACK, SEAM, KEYLIST = (
    DSV4_PREFIX + n
    for n in (
        "v41_rocm_swa_decode_meta", "v41_rocm_topk_pack", "rocm_topk_lens", "rocm_pack_topk_ragged",
        "v41_rocm_mhc_post_collapse_rmsnorm", "v41_rocm_keylist",
    )
)  # fmt: skip
COUNT, COMPACT = DSV4_PREFIX + "rocm_ragged_count", DSV4_PREFIX + "rocm_ragged_compact"
#: The kernels :func:`drive_rocm41` launches.
ROCM41_DRIVES = (
    frozenset({SWA_META, TOPK_PACK, LENS, PACK, SEAM, KEYLIST, COUNT, COMPACT})
    | ROCM_ENGRAM_DRIVES
    | ROCM_PREFILL_DRIVES
    | ROCM_GATHER_DRIVES
    | ROCM_DECODE_DRIVES
)
_SEAM_TOKENS = 128  # MHC_OVERLAP_MAX_TOKENS: the overlap runs in FULL graph capture of up to this many tokens
_SWA_BLOCK = 32  # V4.1's sliding-window cache block (sweep_v41.SWA41)


def drive_rocm41(s: DSV41Sweep, st: DSV4Step) -> None:
    """The step's ROCm decode metadata and one mHC seam (see the module docstring), and the engram layers' sharded
    gate (:mod:`._sweep_v41_rocm_engram`) and the MXFP8 prefill rows."""
    _seam(s, st)
    drive_rocm_engram(s, st)
    drive_rocm_prefill_rows(s, st)
    drive_rocm_prefill_gather(s, st)
    drive_rocm_decode(s, st)
    if not st.batch.decode_tokens:
        return
    _swa_meta(s, st)
    _swa_ragged(s, st)
    ratios = sorted({r for r in s.m.ratios[: s.m.num_hidden_layers] if r > 0})
    for ratio in ratios:
        _decode_topk(s, st, ratio)
    for ratio in sorted(r for r in index_ratios(s.m) if r):
        _keylist(s, st, ratio)


def _swa_meta(s: DSV41Sweep, st: DSV4Step) -> None:
    b, n = st.batch, st.batch.decode_tokens
    if SWA_META not in s.names or b.num_prefills or not 0 < n <= META_ROWS:
        return
    rows, w = s.lim.max_tokens, s.window
    # the builder's buffers, sized for the deployment's step (max_num_batched_tokens rows)
    valid, indices, lens = (
        torch.zeros(rows, dtype=torch.bool, device=s.dev), torch.full((rows, 1, w), -7, dtype=I32, device=s.dev),
        torch.full((rows,), -7, dtype=I32, device=s.dev),
    )  # fmt: skip
    ragged, indptr = torch.empty(rows * w, dtype=I32, device=s.dev), torch.empty(rows + 1, dtype=I32, device=s.dev)
    table = s.tables[_SWA_BLOCK]
    args = (st.qsl, st.seq_lens, st.token_to_req, table, st.replay)

    def ours() -> tuple[torch.Tensor, ...]:
        s.kernel(SWA_META)(st.slots[_SWA_BLOCK], valid[:n], indices, lens, ragged, indptr, *args, n, w, _SWA_BLOCK)
        total = int(indptr[n])
        return valid[:n], indices[:n, 0], lens[:n], ragged[:total], indptr[: n + 1]

    def want() -> tuple[torch.Tensor, ...]:
        slots, qsl, seq_lens, t2r, table_, replay = (a.cpu() for a in (st.slots[_SWA_BLOCK], *args))
        out = swa_decode_meta_reference(slots, qsl, seq_lens, t2r, table_, replay, n, w, _SWA_BLOCK, w)
        return tuple(t.to(s.dev) for t in out)

    s.launch(SWA_META, f"{n} decode tokens", ours, ref=want)


def _swa_ragged(s: DSV41Sweep, st: DSV4Step) -> None:
    """``build_ragged_indices_from_dense`` of the decode SWA rows, for a step the one-launch build does not take:
    the count (into an unset ``indptr``), the cumsum, the compaction (checked on the written prefix)."""
    b, n, w = st.batch, st.batch.decode_tokens, s.window
    if COUNT not in s.names or (SWA_META in s.names and not b.num_prefills and n <= META_ROWS):
        return
    args = (st.positions, st.token_to_req, st.slots[_SWA_BLOCK] >= 0, s.tables[_SWA_BLOCK], st.replay)
    indices, lens = decode_swa_indices_reference(
        *(a.cpu() for a in args), num_tokens=n, window_size=w, index_width=w, block_size=_SWA_BLOCK
    )
    want = ragged_from_dense_reference(indices, lens)
    indices, lens = indices.to(s.dev), lens.to(s.dev)
    indptr = torch.full((n + 1,), -1, dtype=I32, device=s.dev)
    what = f"{n} decode SWA rows"
    counts = s.launch(
        COUNT, what, lambda: s.kernel(COUNT)(indices, lens, indptr), fallback=lambda: want[1].diff().to(s.dev),
        ref=lambda: want[1].diff().to(I32).to(s.dev),
    )  # fmt: skip
    torch.cumsum(counts, dim=0, out=indptr[1:])
    flat, total = torch.empty(n * w, dtype=I32, device=s.dev), int(indptr[-1])
    s.launch(
        COMPACT, what, lambda: s.kernel(COMPACT)(indices, lens, indptr, out=flat)[:total],
        ref=lambda: want[0].to(s.dev),
    )  # fmt: skip


def _decode_topk(s: DSV41Sweep, st: DSV4Step, ratio: int) -> None:
    b, nd = st.batch, st.batch.decode_tokens
    if not ({TOPK_PACK, LENS} & s.names):
        return
    visible = (st.positions[:nd] + 1) // ratio  # the compressed positions each token sees
    width = s.m.index_topk
    topk = torch.randint(0, 1 << 30, (nd, width), generator=s.gen, device=s.dev) % visible.clamp(min=1)[:, None]
    topk = torch.where(torch.arange(width, device=s.dev)[None, :] < visible[:, None], topk, -1).to(I32)
    valid = (st.slots[_SWA_BLOCK] >= 0)[:nd]
    table, bs = s.tables[KV][: b.num_decodes], KV // ratio
    what = f"c{ratio} layers, {nd} decode tokens"

    def want() -> tuple[torch.Tensor, ...]:
        out = global_topk_ragged_reference(topk.cpu(), st.token_to_req.cpu(), table.cpu(), bs, valid.cpu())
        return tuple(t.to(s.dev) for t in out)

    if TOPK_PACK in s.names and nd <= PACK_ROWS:

        def pack() -> tuple[torch.Tensor, ...]:
            ragged, indptr, lens = s.kernel(TOPK_PACK)(topk, st.token_to_req, table, bs, valid)
            return ragged[: int(indptr[-1])], indptr, lens

        s.launch(TOPK_PACK, what, pack, ref=want)
        return
    if LENS not in s.names:
        return
    lens = s.launch(LENS, what, lambda: s.kernel(LENS)(topk, valid), fallback=lambda: want()[2], ref=lambda: want()[2])
    indptr = torch.zeros(nd + 1, dtype=I32, device=s.dev)
    torch.cumsum(lens, dim=0, out=indptr[1:])
    flat, total = torch.empty(topk.numel(), dtype=I32, device=s.dev), int(indptr[-1])

    def pack2() -> torch.Tensor:
        s.kernel(PACK)(topk, indptr, st.token_to_req, table, block_size=bs, out=flat)
        return flat[:total]

    s.launch(PACK, what, pack2, ref=lambda: want()[0])


def _seam(s: DSV41Sweep, st: DSV4Step) -> None:
    """One delayed mHC seam of a step of up to 128 tokens: random bf16 streams and sublayer output, fp32 gates of
    sigmoid's range, the norm weight near 1. Checked within two bf16 steps (the interpreter truncates to bf16 where
    the reference rounds)."""
    T, h = st.batch.tokens, s.m.hidden_size
    if SEAM not in s.names or not 0 < T <= _SEAM_TOKENS:
        return
    rand = torch.rand
    args = (
        s.randn(T, 4, h), s.randn(T, h), rand(T, 4, 1, generator=s.gen, device=s.dev),
        rand(T, 4, 4, generator=s.gen, device=s.dev), rand(T, 4, generator=s.gen, device=s.dev),
        s.randn(h, scale=0.1).add_(1), s.m.rms_norm_eps,
    )  # fmt: skip
    s.launch(
        SEAM, f"{T} tokens", lambda: s.kernel(SEAM)(*args), ref=lambda: mhc_post_collapse_rms_norm_reference(*args),
        tol=(2**-6, 2**-6),
    )  # fmt: skip


def _keylist(s: DSV41Sweep, st: DSV4Step, ratio: int) -> None:
    b, n = st.batch, st.batch.decode_tokens
    if KEYLIST not in s.names or b.num_prefills:
        return
    gen, dev, keys = s.gen, s.dev, MONO_TOPK + MONO_WINDOW
    args = (
        st.slots[_SWA_BLOCK][:n], st.positions[:n],
        torch.randint(0, 1 << 20, (n, 1, MONO_WINDOW), generator=gen, device=dev, dtype=I32),
        torch.randint(0, MONO_WINDOW + 1, (n,), generator=gen, device=dev, dtype=I32), st.token_to_req[:n],
    )  # fmt: skip
    topk = torch.randint(-1, 1 << 10, (n, MONO_TOPK), generator=gen, device=dev, dtype=I32)
    table, block = s.tables[KV][: b.num_decodes], KV // ratio
    kt, klen = torch.full((n * keys,), -7, dtype=I32, device=dev), torch.full((2 * n,), -7, dtype=I32, device=dev)

    def ours() -> tuple[torch.Tensor, torch.Tensor]:
        s.kernel(KEYLIST)(kt, klen, *args, ratio, topk=topk, comp_block_table=table, comp_block=block)
        return kt.view(n, keys), klen

    def want() -> tuple[torch.Tensor, ...]:
        slots, pos, swa, swa_lens, t2r = (a.cpu() for a in args)
        out = keylist_reference(slots, pos, swa, swa_lens, t2r, ratio, topk.cpu(), table.cpu(), block)
        return tuple(t.to(dev) for t in out)

    s.launch(KEYLIST, f"ratio-{ratio} index layers, {n} decode tokens", ours, ref=want)
