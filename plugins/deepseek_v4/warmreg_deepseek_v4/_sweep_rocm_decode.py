"""The ROCm sparse MLA decode of the DeepSeek-V4 sweep driver (:mod:`.sweep_rocm` calls :func:`decode_attention` for
each layer type, where ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` runs ``rocm_sparse_attn_decode``).

A layer's decode rows attend to the SWA builder's decode stream (the compaction of a step's ``swa_decode`` rows) and,
for C4 layers, the indexer's packed top-k stream, for C128 layers the C128 builder's stream (the compaction of its
decode rows), over the sweep's ``fp8_ds_mla`` pages viewed ``[pages, B, 584]`` as vLLM's caches are. The split count
is vLLM's (:mod:`._rocm_decode_splits`, the device's compute units); the partial pass is gfx942's
(:mod:`.rocm_sparse_attn_decode`) or gfx950's (:mod:`.rocm_sparse_attn_decode_gfx950`: the compressed fp8_ds_mla cache
trusted NaN-free, adaptive splits for C128 layers where a captured decode batch would take them); then the reduce
(:mod:`.rocm_sparse_attn_reduce`), with the inverse RoPE folded in unless aiter's FP8 ``wo_a`` rotates. Every other
ROCm arch (gfx1250, RDNA) runs the single-pass decode (:mod:`.rocm_sparse_attn_decode_ragged`) instead: no split count,
no reduce, no rotation (:func:`decode_rotates`). The DSpark draft's layers are not driven here (the streams are the target step's). On the CPU the
interpreter takes bf16 by value (:mod:`._interpreter_dot`); each first launch is checked against its reference.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton

from ._interpreter_dot import bf16_dot_by_value
from ._rocm_decode_splits import cu_count, decode_num_splits
from .fp8_ds_mla import SCALE_BYTES, TOKEN_BYTES
from .model import kv_cache_dtype
from .rocm_inverse_rope import fp8_wo_a
from .rocm_sparse_attn_decode import decode_partial_reference
from .rocm_sparse_attn_decode_gfx950 import decode_gfx950_partial_reference
from .rocm_sparse_attn_decode_ragged import decode_ragged_reference
from .rocm_sparse_attn_reduce import decode_reduce_reference
from .sweep_inputs import DSV4_PREFIX, F32, SWA, DSV4Step

__all__ = ["DECODE_DRIVES", "decode_attention", "decode_rotates"]

PARTIAL, GFX950, REDUCE, RAGGED = (
    DSV4_PREFIX + "rocm_sparse_attn_decode_partial",
    DSV4_PREFIX + "rocm_sparse_attn_decode_gfx950",
    DSV4_PREFIX + "rocm_sparse_attn_reduce",
    DSV4_PREFIX + "rocm_sparse_attn_decode_ragged",
)
#: The decode kernels :func:`decode_attention` launches.
DECODE_DRIVES = frozenset({PARTIAL, GFX950, REDUCE, RAGGED})


def decode_rotates(platform: Any) -> bool:
    """Whether ``forward_mqa`` counts the decode rows as rotated by the decode (``fuse_decode_inv_rope``: not on
    gfx1250 nor RDNA, ``on_gfx1250() or on_rdna()``, i.e. gfx11xx and gfx12xx), where the layer rotates at all."""
    return not str(platform.arch).startswith(("gfx11", "gfx12"))


def _pages(cache: torch.Tensor, block: int) -> torch.Tensor:
    """The sweep's ``[pages, page_bytes]`` cache as vLLM's ``[pages, B, 584]`` view at the page stride."""
    return cache.as_strided(
        (cache.shape[0], block, TOKEN_BYTES + SCALE_BYTES), (cache.stride(0), TOKEN_BYTES + SCALE_BYTES, 1)
    )


def decode_attention(sweep: Any, st: DSV4Step, ratio: int, streams: dict[str, Any]) -> None:
    """One layer type's decode (see the module docstring): ``streams`` holds the step's ``"swa"`` stream and the
    layer type's ``"c4"`` / ``"c128"`` one (``(flat, indptr)``), under ``"step"`` the step they belong to."""
    nd, m = st.batch.decode_tokens, sweep.m
    swa, extra = streams.get("swa"), streams.get(f"c{ratio}") if ratio > 1 else None
    planned = sweep.has("rocm_sparse_attn_reduce") or sweep.has("rocm_sparse_attn_decode_ragged")
    if not planned or not nd or streams.get("step") is not st or swa is None:
        return
    if ratio > 1 and extra is None:
        return
    platform, heads = sweep.plan.platform, m.num_attention_heads // sweep.tp
    q, sink, scale = sweep.randn(nd, heads, m.head_dim), sweep.randn(heads, dtype=F32), m.head_dim**-0.5
    main = (_pages(sweep.fp8[1], SWA), *swa)
    other = (_pages(sweep.fp8[ratio], sweep.page[ratio]), *extra) if extra is not None else None
    if sweep.has("rocm_sparse_attn_decode_ragged"):
        _single_pass(sweep, q, main, other, sink, scale, f"c{ratio} layer, {nd} decode tokens")
        return
    gfx950 = platform.arch == "gfx950"
    splits = decode_num_splits(
        nd, triton.cdiv(heads, 16), main[1].numel() / nd, other[1].numel() / nd if other else 0.0,
        cu=cu_count(sweep.dev), gfx950=gfx950,
    )  # fmt: skip
    segments = [(*main, platform.fp8_fnuz)] + ([(*other, False)] if other else [])
    base = nd * triton.cdiv(heads, 16)
    adaptive = gfx950 and ratio == 128 and base >= 16 and splits > 4  # a captured C128 decode batch
    one_wave = max(1, cu_count(sweep.dev) // base) if adaptive and base < 64 else splits
    trust = gfx950 and other is not None and kv_cache_dtype(sweep.cfg) == "fp8_ds_mla"
    what = f"c{ratio} layer, {nd} decode tokens, {splits} splits"
    interp = contextlib.nullcontext if sweep.cuda else bf16_dot_by_value
    extra_kw: dict[str, Any] = dict(trust_extra=trust, adaptive=adaptive, one_wave_splits=one_wave) if gfx950 else {}

    def partial_reference() -> tuple[torch.Tensor, ...]:
        host = [tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in s) for s in segments]
        if gfx950:
            return decode_gfx950_partial_reference(q.cpu(), host, scale=scale, num_splits=splits, adaptive=adaptive,  # type: ignore[arg-type]
                                                   one_wave_splits=one_wave)  # fmt: skip
        return decode_partial_reference(q.cpu(), host, scale=scale, num_splits=splits)  # type: ignore[arg-type]

    name = GFX950 if gfx950 else PARTIAL

    def partial() -> tuple[torch.Tensor, ...]:
        with interp():
            return sweep.kernel(name)(q, *main, *(other or ()), scale=scale, num_splits=splits,  # type: ignore[no-any-return]
                                      fnuz_main=platform.fp8_fnuz, **extra_kw)  # fmt: skip

    if not sweep.has(name.removeprefix(DSV4_PREFIX)):
        return
    parts = sweep.launch(name, what, partial, ref=partial_reference, tol=(0.1, 2**-7))  # the ops' tests' bounds
    if parts is None:
        return
    rotate = not fp8_wo_a(sweep.cfg, platform)
    pos, cs = (st.positions[:nd], sweep.rope[ratio]) if rotate else (None, None)
    m_, l_, acc_ = parts

    def reference() -> torch.Tensor:
        host = (pos.cpu(), cs.cpu()) if pos is not None and cs is not None else (None, None)
        return decode_reduce_reference(
            m_.cpu(), l_.cpu(), acc_.cpu(), sink.cpu(), positions=host[0], cos_sin_cache=host[1], adaptive=adaptive
        )

    sweep.launch(
        REDUCE,
        what,
        lambda: sweep.k("rocm_sparse_attn_reduce")(
            m_, l_, acc_, sink, positions=pos, cos_sin_cache=cs, adaptive=adaptive
        ),
        ref=reference,
        tol=(1e-2, 2**-7),  # the op's tests: fp32 sums in another order, then bf16
    )


def _single_pass(sweep: Any, q: torch.Tensor, main: tuple[Any, ...], other: tuple[Any, ...] | None, sink: torch.Tensor,
                 scale: float, what: str) -> None:  # fmt: skip
    """Off gfx942 and gfx950: vLLM's single-pass decode (no split count, no reduce, the RoPE lanes left rotated)."""
    fnuz = sweep.plan.platform.fp8_fnuz
    segments = [(*main, fnuz)] + ([(*other, False)] if other else [])
    interp = contextlib.nullcontext if sweep.cuda else bf16_dot_by_value

    def reference() -> torch.Tensor:
        host = [tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in s) for s in segments]
        return decode_ragged_reference(q.cpu(), host, sink.cpu(), scale=scale)  # type: ignore[arg-type]

    def launch() -> torch.Tensor:
        with interp():
            return sweep.kernel(RAGGED)(q, *main, *(other or ()), attn_sink=sink, scale=scale, fnuz_main=fnuz)  # type: ignore[no-any-return]

    sweep.launch(RAGGED, what, launch, ref=reference, tol=(2e-2, 2**-7))  # the op's tests' bound
