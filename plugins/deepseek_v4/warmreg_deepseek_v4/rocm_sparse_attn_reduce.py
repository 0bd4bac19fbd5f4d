"""ROCm DeepSeek-V4 sparse MLA decode, the reduce of the split-KV partials with the sink and the inverse RoPE folded in
(vLLM 0.34 ``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_sparse_attn_decode_reduce_kernel``, launched by
``_rocm_sparse_attn_decode_ragged_triton`` after its partial pass on gfx942 and gfx950).

For decode query ``t`` and head ``h``, over the ``S`` splits' raw states ``(m_j, l_j, acc_j)`` (``part_m``, ``part_l``
``[T, S, H]``, ``part_acc [T, S, H, D]``, fp32; :mod:`.rocm_sparse_attn_decode`) and the head's sink ``z``
(``attn_sink``; none: ``-inf``)::

    M = max(max_j m_j, z);   L = sum_j exp(m_j - M) l_j + exp(z - M)
    o = L > 0 ? (sum_j exp(m_j - M) acc_j) / max(L, 1e-30) : 0          (the acc sum in split order)

With ``FUSE_INV_ROPE`` the RoPE lanes of ``o`` are rotated back at ``positions[t]`` (pairs ``(e, o)`` of lanes
``NOPE + 2k``: ``e c + o s``, ``o c - e s`` with ``c, s = cos_sin_cache[pos, k], [pos, HALF + k]``; the NoPE lanes
take ``c = 1, s = 0``, as vLLM writes it), and ``out[t, h] = bf16(o)``. With ``ADAPTIVE`` (gfx950's adaptive splits) a
split that saw no key (``m_j`` = fp32 lowest) contributes nothing, not even its buffers' bytes. Grid ``(T, H)``, a
program a (query, head) (vLLM's ``BLOCK_H = 1``). vLLM's split count is a constexpr (``NUM_SPLITS``, its power-of-two
pad ``SPLITS_PAD``); this kernel walks the splits at run time, one binary for every count: ``L`` sums the splits in
order where vLLM's ``tl.sum`` adds them as a tree, a reordering of fp32 sums (the outputs agree within a bf16 step).

Where it runs: every ROCm sparse decode through vLLM's Triton path on gfx942 and gfx950
(``DeepseekV4ROCMAiterMLAAttention._forward_decode`` -> ``rocm_sparse_attn_decode``, every layer type on every step
with decode tokens, unless decode takes aiter's sparse MLA: :func:`._rocm_attention.aiter_sparse_mla`). The rotation is
fused on the BF16 ``wo_a`` path (``forward_mqa``'s ``fuse_inv_rope``: not with aiter's FP8 ``wo_a``,
:func:`.rocm_inverse_rope.fp8_wo_a`); adaptive splits on gfx950 for C128 layers under CUDA-graph capture with 16 or
more workgroups and more than 4 splits (``adaptive_splits``). DeepSeek-V4.1's MXFP8 epilogue (``QUANT_OUT``) is not
covered here.

Key: the sink flag, adaptive splits, the head width, the rotation with its NoPE width and RoPE pairs, the output and
position dtypes and the warps (4). Strides, the head count and the split count are runtime ints
(``do_not_specialize``); the partial buffers are fresh (aligned), the output a row slice of the layer's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._rocm_attention import aiter_sparse_mla
from .model import DSV4
from .rocm_inverse_rope import fp8_wo_a

__all__ = ["RocmSparseAttnReduce", "RocmSparseAttnReduceKey", "decode_reduce_reference", "register"]

_NUM_WARPS = 4
_NEG = tl.constexpr(-3.4028234663852886e38)
_LOWEST = -3.4028234663852886e38


@triton.jit(
    do_not_specialize=[
        "out_stride_t", "out_stride_h", "pm_stride_t", "pm_stride_s", "pa_stride_t", "pa_stride_s", "pa_stride_h",
        "cs_stride", "num_splits",
    ]
)  # fmt: skip
def _rocm_decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, out_ptr, pos_ptr, cos_sin_ptr, out_stride_t, out_stride_h,
    pm_stride_t, pm_stride_s, pa_stride_t, pa_stride_s, pa_stride_h, cs_stride, num_splits,
    HAS_SINK: tl.constexpr,  # fold the head's sink into M and L
    ADAPTIVE: tl.constexpr,  # skip splits that saw no key
    COMB_DIM: tl.constexpr,  # head width (a power of two: 512)
    FUSE_INV_ROPE: tl.constexpr,  # rotate the RoPE lanes back before the store
    NOPE: tl.constexpr,  # lanes before the RoPE pairs
    HALF: tl.constexpr,  # RoPE pairs
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    m_row = part_m_ptr + t * pm_stride_t + h
    l_row = part_l_ptr + t * pm_stride_t + h
    top = tl.load(m_row)
    for s in range(1, num_splits):
        top = tl.maximum(top, tl.load(m_row + s * pm_stride_s))
    if HAS_SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    total = tl.exp(tl.load(m_row) - top) * tl.load(l_row)
    for s in range(1, num_splits):
        total += tl.exp(tl.load(m_row + s * pm_stride_s) - top) * tl.load(l_row + s * pm_stride_s)
    if HAS_SINK:
        total += tl.exp(sink - top)
    lanes = tl.arange(0, COMB_DIM)
    acc = tl.zeros((COMB_DIM,), dtype=tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(m_row + s * pm_stride_s)
        w = tl.exp(m_s - top)
        acc_row = part_acc_ptr + t * pa_stride_t + s * pa_stride_s + h * pa_stride_h + lanes
        if ADAPTIVE:
            active = m_s > _NEG
            acc += tl.where(active, w, 0.0) * tl.load(acc_row, mask=tl.where(active, lanes >= 0, False), other=0.0)
        else:
            acc += w * tl.load(acc_row)
    out = tl.where(total > 0.0, acc / tl.maximum(total, 1.0e-30), 0.0)
    if FUSE_INV_ROPE:
        pair = tl.arange(0, COMB_DIM // 2) - NOPE // 2
        rope = pair >= 0
        k = tl.where(rope, pair, 0)
        row = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * cs_stride
        cos = tl.where(rope, tl.load(row + k), 1.0)
        sin = tl.where(rope, tl.load(row + HALF + k), 0.0)
        even, odd = tl.split(tl.reshape(out, (COMB_DIM // 2, 2)))
        out = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), (COMB_DIM,))
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + lanes, out.to(out_ptr.dtype.element_ty))


@attrs.frozen(kw_only=True)
class RocmSparseAttnReduceKey(warmreg.CompileKey):
    """What changes the binary of the decode reduce: sink, adaptive splits, widths, the rotation, dtypes, warps."""

    has_sink: bool
    adaptive: bool
    comb_dim: int
    fuse_inv_rope: bool
    nope: int
    half: int
    out_dtype: str
    pos_dtype: str  # "" without the rotation
    num_warps: int


class RocmSparseAttnReduce(warmreg.TritonKernel[RocmSparseAttnReduceKey]):
    """The split-KV reduce of ROCm's sparse MLA decode (see the module docstring).

    :param rope_head_dim: the RoPE lanes at the end of each head (64).
    """

    name = "deepseek_v4.rocm_sparse_attn_reduce"
    key_type = RocmSparseAttnReduceKey
    jit = _rocm_decode_reduce_kernel

    def __init__(self, *, rope_head_dim: int = 64) -> None:
        self.rope_head_dim = rope_head_dim

    def dispatch(
        self,
        *,
        part_acc: torch.Tensor,
        attn_sink: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        adaptive: bool = False,
    ) -> RocmSparseAttnReduceKey:
        dim = part_acc.shape[-1]
        return RocmSparseAttnReduceKey(
            has_sink=attn_sink is not None, adaptive=adaptive, comb_dim=dim, fuse_inv_rope=positions is not None,
            nope=dim - self.rope_head_dim, half=self.rope_head_dim // 2, out_dtype="bfloat16",
            pos_dtype=warmreg.dtype_name(positions.dtype) if positions is not None else "", num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        gfx950 = platform.is_rocm and platform.arch == "gfx950"
        return {  # the layer always has its fp32 sink; vLLM's positions are int64
            "part_acc": [warmreg.meta((1, 1, 1, model.head_dim), torch.float32)],
            "attn_sink": [warmreg.meta((1,), torch.float32)],
            "positions": [None] if fp8_wo_a(config, platform) else [warmreg.meta((1,), torch.int64)],
            "adaptive": [False, True] if gfx950 and model.has_c128 else [False],
        }

    def warmup_inputs(self, key: RocmSparseAttnReduceKey) -> Mapping[str, Any]:
        part = warmreg.meta((1, 1, 1), torch.float32)
        rotate = key.fuse_inv_rope
        return {
            "part_m": part, "part_l": part, "part_acc": warmreg.meta((1, 1, 1, key.comb_dim), torch.float32),
            "attn_sink": warmreg.meta((1,), torch.float32) if key.has_sink else None,
            "positions": warmreg.meta((1,), getattr(torch, key.pos_dtype)) if rotate else None,
            "cos_sin_cache": warmreg.meta((1, 2 * key.half), torch.float32) if rotate else None,
            "adaptive": key.adaptive,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        part_m: torch.Tensor,
        part_l: torch.Tensor,
        part_acc: torch.Tensor,
        attn_sink: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
        adaptive: bool = False,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RocmSparseAttnReduceKey]:
        """The bf16 attention output ``[T, H, D]`` (fresh, or ``out``: vLLM's ``output[:num_decode_tokens]``).

        :param part_m: fp32 ``[T, S, H]`` split maxima, with ``part_l`` (same shape and strides) and ``part_acc``
            fp32 ``[T, S, H, D]``, each contiguous in its last dim (``D`` a power of two).
        :param attn_sink: fp32 ``[>= H]`` contiguous sinks, or None.
        :param positions: int32 or int64 ``[>= T]`` positions to rotate the RoPE lanes back at, with the fp32
            ``cos_sin_cache [P, rope_head_dim]``; both or neither.
        :param adaptive: gfx950's adaptive splits (skip splits without keys).
        :param out: the output to write instead of a fresh one, exactly as it would be allocated.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or an ``out`` unlike the fresh one.
        """
        self._check(part_m, part_l, part_acc, attn_sink, positions, cos_sin_cache)
        key = self.dispatch(part_acc=part_acc, attn_sink=attn_sink, positions=positions, adaptive=adaptive)
        tokens, splits, heads, dim = part_acc.shape
        result = warmreg.output(self.name, "out", out, (tokens, heads, dim), torch.bfloat16, part_acc.device)
        kwargs = dict(
            part_m_ptr=part_m, part_l_ptr=part_l, part_acc_ptr=part_acc, sink_ptr=attn_sink, out_ptr=result,
            pos_ptr=positions, cos_sin_ptr=cos_sin_cache, out_stride_t=result.stride(0), out_stride_h=result.stride(1),
            pm_stride_t=part_m.stride(0), pm_stride_s=part_m.stride(1), pa_stride_t=part_acc.stride(0),
            pa_stride_s=part_acc.stride(1), pa_stride_h=part_acc.stride(2),
            cs_stride=cos_sin_cache.stride(0) if cos_sin_cache is not None else 0, num_splits=splits,
            HAS_SINK=key.has_sink, ADAPTIVE=key.adaptive, COMB_DIM=key.comb_dim, FUSE_INV_ROPE=key.fuse_inv_rope,
            NOPE=key.nope, HALF=key.half,
        )  # fmt: skip
        grid = (tokens, heads) if tokens and heads and splits else None
        return warmreg.LaunchSpec(key, grid, kwargs, result)

    def _check(
        self,
        part_m: torch.Tensor,
        part_l: torch.Tensor,
        part_acc: torch.Tensor,
        attn_sink: torch.Tensor | None,
        positions: torch.Tensor | None,
        cos_sin_cache: torch.Tensor | None,
    ) -> None:
        dim = part_acc.shape[-1] if part_acc.ndim == 4 else 0
        if part_acc.dtype != torch.float32 or part_acc.ndim != 4 or part_acc.stride(3) != 1 or dim & (dim - 1):
            raise warmreg.LaunchError(self.name, f"part_acc must be fp32 [T, S, H, D] (D a power of two, last dim "
                                      f"contiguous; got {part_acc.dtype} {tuple(part_acc.shape)})")  # fmt: skip
        for name, t in (("part_m", part_m), ("part_l", part_l)):
            if t.dtype != torch.float32 or t.shape != part_acc.shape[:3] or t.stride() != part_m.stride() or (
                t.stride(2) != 1
            ):  # fmt: skip
                raise warmreg.LaunchError(self.name, f"{name} must be fp32 {tuple(part_acc.shape[:3])}, contiguous "
                                          f"heads, part_m's strides (got {t.dtype} {tuple(t.shape)})")  # fmt: skip
        heads = part_acc.shape[2]
        if attn_sink is not None and (
            attn_sink.dtype != torch.float32 or attn_sink.ndim != 1 or attn_sink.shape[0] < heads
        ):
            raise warmreg.LaunchError(self.name, f"attn_sink must be fp32 [>= {heads}] (got {attn_sink.dtype} "
                                      f"{tuple(attn_sink.shape)})")  # fmt: skip
        if (positions is None) != (cos_sin_cache is None):
            raise warmreg.LaunchError(self.name, "pass positions and cos_sin_cache together, or neither")
        if positions is not None and cos_sin_cache is not None and (
            positions.dtype not in (torch.int32, torch.int64) or positions.ndim != 1
            or positions.shape[0] < part_acc.shape[0] or cos_sin_cache.dtype != torch.float32
            or cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != self.rope_head_dim or cos_sin_cache.stride(1) != 1
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"positions must be int32/int64 [>= T] and cos_sin_cache fp32 "
                                      f"[P, {self.rope_head_dim}] (got {positions.dtype} {tuple(positions.shape)}, "
                                      f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})")  # fmt: skip


def decode_reduce_reference(
    part_m: torch.Tensor,
    part_l: torch.Tensor,
    part_acc: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    *,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    rope_head_dim: int = 64,
    adaptive: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmSparseAttnReduce`: bf16 ``[T, H, D]``."""
    tokens, _, heads, dim = part_acc.shape
    m, sums, acc = part_m.float(), part_l.float(), part_acc.float()
    sink = attn_sink[:heads].float() if attn_sink is not None else torch.full((heads,), float("-inf"))
    top = torch.maximum(m.max(dim=1).values, sink[None, :])  # [T, H]
    w = torch.exp(m - top[:, None, :])
    if adaptive:  # a split without keys: neither its weight nor its accumulator's bytes
        w = torch.where(m > _LOWEST, w, torch.zeros_like(w))
        acc = torch.where((m > _LOWEST)[..., None], acc, torch.zeros_like(acc))
    total = (w * sums).sum(dim=1) + torch.exp(sink[None, :] - top)
    o = (w[..., None] * acc).sum(dim=1)
    o = torch.where(total[..., None] > 0, o / total.clamp_min(1e-30)[..., None], torch.zeros_like(o))
    if positions is not None and cos_sin_cache is not None:
        nope, half = dim - rope_head_dim, rope_head_dim // 2
        cs = cos_sin_cache[positions[:tokens].long()].float()[:, None, :]
        even, odd = o[..., nope::2].clone(), o[..., nope + 1 :: 2].clone()
        o[..., nope::2] = even * cs[..., :half] + odd * cs[..., half:]
        o[..., nope + 1 :: 2] = odd * cs[..., :half] - even * cs[..., half:]
    return o.to(torch.bfloat16)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the reduce on gfx942 and gfx950 unless decode takes aiter's sparse MLA (see the module docstring)."""
    on = not aiter_sparse_mla(platform)
    registry.add(RocmSparseAttnReduce(rope_head_dim=model.qk_rope_head_dim),
                 when=warmreg.rocm_arch_in("gfx942", "gfx950") if on else False)  # fmt: skip
