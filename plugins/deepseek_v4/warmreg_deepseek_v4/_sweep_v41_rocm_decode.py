"""The DeepSeek-V4.1 sweep's ROCm sparse MLA decode (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py:
DeepseekV41ROCMAiterMLAAttention._forward_decode`` -> ``rocm_sparse_attn_decode``), called once a step with decode
tokens by :func:`._sweep_v41_rocm.drive_rocm41`, for each layer kind of the model (SWA-only, compressed).

A layer's decode rows ``q [T, n_local_heads, head_dim]`` attend to the compaction of the step's decode SWA rows (the
SWA builder's stream, from :func:`.swa_indices.decode_swa_indices_reference`, V4.1's 32-token SWA blocks) and, for a
compressed layer, the decode tokens' top-k rows as compressed-cache slots (random causal local positions through the
block table, :func:`.rocm_decode_topk.global_topk_ragged_reference`), over random ``fp8_ds_mla`` pages viewed
``[pages, B, 584]`` as vLLM's caches are. On gfx942: the partial pass at vLLM's split count, then the reduce with the
inverse RoPE at the decode positions; elsewhere (not gfx950) the single-pass decode. On the CPU the interpreter takes
bf16 by value (:mod:`._interpreter_dot`); each first launch is checked against its reference, with the ops' tests'
bounds. Off gfx950, every step first rotates back, in place, the rows the decode did not (random bf16 rows of the
step's attention output, their positions and V4.1's rotary cache: ``forward_mqa``'s ``rocm_inverse_rope_rows_``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import triton

from ._interpreter_dot import bf16_dot_by_value
from ._rocm_decode_splits import cu_count, decode_num_splits
from ._sweep_rocm_decode import decode_rotates
from .fp8_ds_mla import SCALE_BYTES, TOKEN_BYTES
from .rocm_decode_topk import global_topk_ragged_reference
from .rocm_inverse_rope import rocm_inverse_rope_reference
from .rocm_ragged import ragged_from_dense_reference
from .rocm_sparse_attn_decode import decode_partial_reference
from .rocm_sparse_attn_decode_ragged import decode_ragged_reference
from .rocm_sparse_attn_reduce import decode_reduce_reference
from .swa_indices import decode_swa_indices_reference
from .sweep_inputs import DSV4_PREFIX, F32, I32, KV, DSV4Step, fp8_ds_mla_cache

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ROCM_DECODE_DRIVES", "drive_rocm_decode"]

PARTIAL, REDUCE, RAGGED, INV_ROPE = (
    DSV4_PREFIX + n
    for n in ("rocm_sparse_attn_decode_partial", "rocm_sparse_attn_reduce", "rocm_sparse_attn_decode_ragged",
              "rocm_inverse_rope")
)  # fmt: skip
#: The kernels :func:`drive_rocm_decode` launches.
ROCM_DECODE_DRIVES = frozenset({PARTIAL, REDUCE, RAGGED, INV_ROPE})
_SWA_BLOCK = 32  # V4.1's sliding-window cache block (sweep_v41.SWA41)


def _paged(s: DSV41Sweep, slots: torch.Tensor, block: int) -> torch.Tensor:
    """Random ``fp8_ds_mla`` pages covering ``slots``, viewed ``[pages, B, 584]`` at the page stride."""
    pages = int(slots.max().clamp(min=0)) // block + 1 if slots.numel() else 1
    cache = fp8_ds_mla_cache(pages, block, s.gen, s.dev)
    width = TOKEN_BYTES + SCALE_BYTES
    return cache.as_strided((pages, block, width), (cache.stride(0), width, 1))


def _streams(s: DSV41Sweep, st: DSV4Step, ratio: int) -> tuple[torch.Tensor, ...]:
    """``(cache, indices, indptr)`` of the SWA segment (``ratio`` 0) or of a compressed layer's top-k segment."""
    b, nd = st.batch, st.batch.decode_tokens
    valid = (st.slots[_SWA_BLOCK] >= 0)[:nd]
    if not ratio:
        args = (st.positions, st.token_to_req, st.slots[_SWA_BLOCK] >= 0, s.tables[_SWA_BLOCK], st.replay)
        dense = decode_swa_indices_reference(
            *(a.cpu() for a in args), num_tokens=nd, window_size=s.window, index_width=s.window, block_size=_SWA_BLOCK
        )
        flat, indptr = ragged_from_dense_reference(*dense)
        return _paged(s, flat, _SWA_BLOCK), flat.to(I32).to(s.dev), indptr.to(I32).to(s.dev)
    visible = (st.positions[:nd] + 1) // ratio
    width = s.m.index_topk
    topk = torch.randint(0, 1 << 30, (nd, width), generator=s.gen, device=s.dev) % visible.clamp(min=1)[:, None]
    topk = torch.where(torch.arange(width, device=s.dev)[None, :] < visible[:, None], topk, -1).to(I32)
    table, bs = s.tables[KV][: b.num_decodes], KV // ratio
    flat, indptr, _ = global_topk_ragged_reference(topk.cpu(), st.token_to_req.cpu(), table.cpu(), bs, valid.cpu())
    return _paged(s, flat, bs), flat.to(I32).to(s.dev), indptr.to(I32).to(s.dev)


def drive_rocm_decode(s: DSV41Sweep, st: DSV4Step) -> None:
    """Each layer kind's decode of the step, then the inverse RoPE of its prefill rows (see the module docstring);
    nothing where no such kernel is planned."""
    _prefill_rows(s, st)
    nd = st.batch.decode_tokens
    if not nd or not ((ROCM_DECODE_DRIVES - {INV_ROPE}) & s.names):
        return
    main = _streams(s, st, 0)
    for ratio in sorted(set(s.m.ratios)):
        _layer(s, st, main, _streams(s, st, ratio) if ratio else None, f"ratio {ratio} layer, {nd} decode tokens")


def _layer(s: DSV41Sweep, st: DSV4Step, main: tuple[torch.Tensor, ...], other: tuple[torch.Tensor, ...] | None,
           what: str) -> None:  # fmt: skip
    m, nd, fnuz = s.m, st.batch.decode_tokens, s.plan.platform.fp8_fnuz
    heads = m.num_attention_heads // s.tp
    q, sink, scale = s.randn(nd, heads, m.head_dim), s.randn(heads, dtype=F32), m.head_dim**-0.5
    segments: list[Any] = [(*main, fnuz)] + ([(*other, False)] if other else [])
    host: list[Any] = [tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in seg) for seg in segments]
    interp = contextlib.nullcontext if s.cuda else bf16_dot_by_value
    if RAGGED in s.names:

        def single() -> torch.Tensor:
            with interp():
                return s.kernel(RAGGED)(q, *main, *(other or ()), attn_sink=sink, scale=scale, fnuz_main=fnuz)  # type: ignore[no-any-return]

        ref = lambda: decode_ragged_reference(q.cpu(), host, sink.cpu(), scale=scale)  # noqa: E731
        s.launch(RAGGED, what, single, ref=ref, tol=(2e-2, 2**-7))  # the op's tests' bound
        return
    if PARTIAL not in s.names:
        return
    splits = decode_num_splits(
        nd, triton.cdiv(heads, 16), main[1].numel() / nd, other[1].numel() / nd if other else 0.0,
        cu=cu_count(s.dev), gfx950=False,
    )  # fmt: skip

    def partial() -> tuple[torch.Tensor, ...]:
        with interp():
            return s.kernel(PARTIAL)(q, *main, *(other or ()), scale=scale, num_splits=splits, fnuz_main=fnuz)  # type: ignore[no-any-return]

    parts = s.launch(PARTIAL, what, partial, ref=lambda: decode_partial_reference(q.cpu(), host, scale=scale,
                     num_splits=splits), tol=(0.1, 2**-7))  # fmt: skip  # the op's tests' bounds
    if parts is None or REDUCE not in s.names:
        return
    m_, l_, acc_ = parts
    pos, cs = st.positions[:nd], s.rope41

    def reference() -> torch.Tensor:
        return decode_reduce_reference(m_.cpu(), l_.cpu(), acc_.cpu(), sink.cpu(), positions=pos.cpu(),
                                       cos_sin_cache=cs.cpu(), rope_head_dim=m.qk_rope_head_dim)  # fmt: skip

    s.launch(REDUCE, what, lambda: s.kernel(REDUCE)(m_, l_, acc_, sink, positions=pos, cos_sin_cache=cs), ref=reference,
             tol=(1e-2, 2**-7))  # fmt: skip  # fp32 sums in another order, then bf16


def _prefill_rows(s: DSV41Sweep, st: DSV4Step) -> None:
    """``rocm_inverse_rope_rows_`` of the rows the decode did not rotate, in place: the prefill rows ``[decode_tokens,
    T)``, every row on gfx1250 and RDNA (:func:`._sweep_rocm_decode.decode_rotates`); none: no launch."""
    b, m = st.batch, s.m
    first = b.decode_tokens if decode_rotates(s.plan.platform) else 0
    if INV_ROPE not in s.names or b.tokens <= first:
        return
    o = s.randn(b.tokens - first, m.num_attention_heads // s.tp, m.head_dim, scale=3)
    args = (st.positions[first:], s.rope41)
    want = rocm_inverse_rope_reference(o.clone(), *args, rope_head_dim=m.qk_rope_head_dim)

    def launch() -> torch.Tensor:
        return s.kernel(INV_ROPE)(o, *args, rope_head_dim=m.qk_rope_head_dim, inplace=True)  # type: ignore[no-any-return]

    s.launch(INV_ROPE, f"{o.shape[0]} rows from {first}", launch, ref=lambda: want)
