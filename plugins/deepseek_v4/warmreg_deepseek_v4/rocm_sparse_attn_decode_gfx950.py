"""ROCm DeepSeek-V4 sparse MLA decode on gfx950, split-KV partial pass (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_sparse_attn_decode_gfx950_partial_kernel`` with
``_sparse_attn_decode_gfx950_partial_loaded_tile``, launched by ``_rocm_sparse_attn_decode_ragged_triton`` on gfx950;
its reduce is :mod:`.rocm_sparse_attn_reduce`).

The same partial states as gfx942's pass (:mod:`.rocm_sparse_attn_decode`: split ``j`` of ``S`` over the SWA segment,
then the compressed one, of ``fp8_ds_mla`` keys), computed gfx950's way: the 512 lanes of a key in one bf16 tile
(``k = bf16(fp32(fp8) * 2**(e - 127))`` for the NoPE lanes, E8M0 byte 0 read as ``2**-127``; the bf16 RoPE tail), one
``tl.dot`` for the scores, the online softmax in base 2 (``s * scale * log2(e)``, ``exp2``) and the maximum stored back
in natural units (``m * ln 2``; fp32's lowest where the split saw no key). The compressed cache is NaN-scrubbed
unless vLLM trusts it (``extra_cache_nan_free``: the ``fp8_ds_mla`` cache without a KV connector). With adaptive
splits (C128 layers under CUDA-graph capture, 16 or more workgroups, more than 4 splits) a query whose segments fit in
at most 3 tiles of ``4 * 32`` keys works on 4 splits (or, for 16..63 workgroups, on ``one_wave_splits = CUs //
workgroups`` when those fit 3 tiles of their own): the splits past them store only ``m`` = fp32's lowest and ``l = 0``.

vLLM passes the q and cache strides, page sizes, the scale, the head count and the split counts as constexprs; here
they are run-time values (``S`` is ``tl.num_programs(1)``): one binary serves them all, the arithmetic unchanged (the
scale times ``log2(e)`` is formed in double precision by the launcher, as vLLM's constexpr product is, and rounded to
fp32 where it multiplies). vLLM walks the compressed segment two tiles at a time: the same tiles, in the same order.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` on gfx950 without aiter's sparse MLA
(:func:`._rocm_attention.aiter_sparse_mla`), every layer type on every step with decode tokens
(:func:`.rocm_sparse_attn_decode.decode_gfx942` is gfx942's pipeline; :func:`decode_gfx950` this one's).

Key: the extra segment, the FP8 flavours, the trusted cache, adaptive splits, the blocks (16 heads, 32 keys), the
stages (1) and the warps (4; vLLM also passes ``waves_per_eu=0``, the AMD backend's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import out_parts
from ._rocm_attention import aiter_sparse_mla
from ._rocm_decode_splits import cu_count, decode_num_splits
from ._serving import serving_int
from .model import DSV4, kv_cache_dtype
from .rocm_sparse_attn_decode import RocmSparseAttnDecodePartial, check_segment, decode_partial_reference
from .rocm_sparse_attn_reduce import RocmSparseAttnReduce

__all__ = [
    "RocmSparseAttnDecodeGfx950",
    "RocmSparseAttnDecodeGfx950Key",
    "decode_gfx950",
    "decode_gfx950_partial_reference",
    "register",
    "work_splits",
]

_BLOCK_H, _BLOCK_K, _NUM_STAGES, _NUM_WARPS = 16, 32, 1, 4
_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453
_NEG = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _e8m0(byte):
    """2 ** (byte - 127) from its bits; byte 0 is the subnormal 2 ** -127."""
    bits = tl.where(byte == 0, 1 << 22, byte.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile(q, cache_ptr, slot, live, page, page_stride, scale_log2, head_ok, m_i, l_i, acc,
          FNUZ: tl.constexpr, SCRUB: tl.constexpr):  # fmt: skip
    """One tile of keys (``slot``, ``live``): dequantize all 512 lanes, fold them into the base-2 online softmax."""
    lanes = tl.arange(0, 512)
    nope = lanes < 448
    slot = tl.where(live, slot, 0)
    base = cache_ptr + (slot // page).to(tl.int64) * page_stride
    token = base + (slot % page) * 576
    both = live[:, None] & nope[None, :]
    raw = tl.load(token[:, None] + lanes[None, :], mask=both, other=0)
    exps = tl.load((base + page * 576 + (slot % page) * 8)[:, None] + lanes[None, :] // 64, mask=both, other=127)
    if FNUZ:
        x = raw.to(tl.float8e4b8, bitcast=True).to(tl.bfloat16).to(tl.float32)
    else:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    rope = tl.load((token + 448).to(tl.pointer_type(tl.bfloat16))[:, None] + (lanes - 448)[None, :],
                   mask=live[:, None] & (lanes >= 448)[None, :], other=0.0)  # fmt: skip
    k = tl.where(nope[None, :], (x * _e8m0(exps)).to(tl.bfloat16), rope)
    k = tl.where(live[:, None], k, 0.0).to(tl.bfloat16)
    if SCRUB:
        k = tl.where(k == k, k, 0.0).to(tl.bfloat16)
    keep = head_ok[:, None] & live[None, :]
    scores = tl.where(keep, tl.dot(q, tl.trans(k)) * scale_log2, _NEG)
    new_max = tl.maximum(m_i, tl.max(scores, axis=1))
    decay = tl.exp2(m_i - new_max)
    p = tl.where(keep, tl.exp2(scores - new_max[:, None]), 0.0)
    l_i = l_i * decay + tl.sum(p, axis=1)
    acc = acc * decay[:, None] + tl.dot(p.to(tl.bfloat16), k)
    return new_max, l_i, acc


@triton.jit(
    do_not_specialize=[
        "q_stride_t", "q_stride_h", "main_stride", "extra_stride", "main_rows", "extra_rows", "main_page",
        "extra_page", "num_heads", "one_wave",
    ]
)  # fmt: skip
def _gfx950_partial_kernel(
    q_ptr, main_ptr, main_idx_ptr, main_indptr_ptr, extra_ptr, extra_idx_ptr, extra_indptr_ptr, part_m_ptr,
    part_l_ptr, part_acc_ptr, q_stride_t, q_stride_h, main_stride, extra_stride, main_rows, extra_rows, main_page,
    extra_page, scale_log2, num_heads, one_wave,
    HAS_EXTRA: tl.constexpr,  # walk the compressed cache's segment too
    FNUZ_MAIN: tl.constexpr,  # the SWA cache's FP8 is e4m3fnuz
    FNUZ_EXTRA: tl.constexpr,  # the compressed cache's FP8 is e4m3fnuz
    TRUST_EXTRA: tl.constexpr,  # skip the compressed cache's NaN scrub
    ADAPTIVE: tl.constexpr,  # short queries work on fewer splits
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_K: tl.constexpr,  # keys a tile
    NUM_STAGES: tl.constexpr,  # pipelining of the key loops
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    at = (t * splits + split) * num_heads + heads
    main_start = tl.load(main_indptr_ptr + t)
    main_len = tl.load(main_indptr_ptr + t + 1) - main_start
    extra_start = main_start * 0
    extra_len = main_len * 0
    if HAS_EXTRA:
        extra_start = tl.load(extra_indptr_ptr + t)
        extra_len = tl.load(extra_indptr_ptr + t + 1) - extra_start
    work = splits
    if ADAPTIVE:
        if (one_wave > 4) & (one_wave < splits):
            span = one_wave * BLOCK_K
            work = tl.where((main_len + span - 1) // span + (extra_len + span - 1) // span <= 3, one_wave, work)
        span4 = 4 * BLOCK_K
        work = tl.where((main_len + span4 - 1) // span4 + (extra_len + span4 - 1) // span4 <= 3, 4, work)
    if split >= work:
        tl.store(part_m_ptr + at, tl.full((BLOCK_H,), _NEG, tl.float32), mask=head_ok)
        tl.store(part_l_ptr + at, tl.zeros((BLOCK_H,), tl.float32), mask=head_ok)
    else:
        lanes = tl.arange(0, 512)
        q_rows = q_ptr + t * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h
        q = tl.load(q_rows + lanes[None, :], mask=head_ok[:, None], other=0.0)
        m_i = tl.full((BLOCK_H,), _NEG, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, 512), dtype=tl.float32)
        keys = tl.arange(0, BLOCK_K)
        chunk = (main_len + work - 1) // work
        lo = split * chunk
        hi = tl.minimum(lo + chunk, main_len)
        for k0 in tl.range(lo, hi, BLOCK_K, num_stages=NUM_STAGES):
            inside = k0 + keys < hi
            slot = tl.load(main_idx_ptr + main_start + k0 + keys, mask=inside, other=-1)
            live = inside & (slot >= 0) & (slot < main_rows)
            m_i, l_i, acc = _tile(q, main_ptr, slot, live, main_page, main_stride, scale_log2, head_ok, m_i, l_i,
                                  acc, FNUZ_MAIN, True)  # fmt: skip
        if HAS_EXTRA:
            chunk = (extra_len + work - 1) // work
            lo = split * chunk
            hi = tl.minimum(lo + chunk, extra_len)
            for k0 in tl.range(lo, hi, BLOCK_K, num_stages=NUM_STAGES):
                inside = k0 + keys < hi
                slot = tl.load(extra_idx_ptr + extra_start + k0 + keys, mask=inside, other=-1)
                live = inside & (slot >= 0) & (slot < extra_rows)
                m_i, l_i, acc = _tile(q, extra_ptr, slot, live, extra_page, extra_stride, scale_log2, head_ok, m_i,
                                      l_i, acc, FNUZ_EXTRA, not TRUST_EXTRA)  # fmt: skip
        tl.store(part_m_ptr + at, tl.where(l_i > 0.0, m_i * 0.6931471805599453, _NEG), mask=head_ok)
        tl.store(part_l_ptr + at, l_i, mask=head_ok)
        tl.store(part_acc_ptr + at[:, None].to(tl.int64) * 512 + lanes[None, :], acc, mask=head_ok[:, None])


def work_splits(main_len: int, extra_len: int, splits: int, one_wave: int, *, adaptive: bool, block_k: int = 32) -> int:
    """The splits a query works on: ``splits``, or with adaptive splits 4 (its segments fit 3 tiles of ``4 * 32``
    keys), else ``one_wave`` (``4 < one_wave < splits`` and they fit 3 tiles of ``one_wave * 32``)."""
    if not adaptive:
        return splits

    def tiles(n: int) -> int:
        return -(-main_len // (n * block_k)) - (-extra_len // (n * block_k))

    work = one_wave if 4 < one_wave < splits and tiles(one_wave) <= 3 else splits
    return 4 if tiles(4) <= 3 else work


@attrs.frozen(kw_only=True)
class RocmSparseAttnDecodeGfx950Key(warmreg.CompileKey):
    """What changes the binary of gfx950's partial pass: the extra segment, FP8 flavours, the trusted cache, adaptive
    splits, blocks, stages and warps."""

    q_dtype: str
    has_extra: bool
    fnuz_main: bool
    fnuz_extra: bool
    trust_extra: bool
    adaptive: bool
    block_h: int
    block_k: int
    num_stages: int
    num_warps: int


class RocmSparseAttnDecodeGfx950(warmreg.TritonKernel[RocmSparseAttnDecodeGfx950Key]):
    """gfx950's split-KV partial pass of ROCm's sparse MLA decode (see the module docstring). The inputs and outputs
    are those of :class:`~warmreg_deepseek_v4.rocm_sparse_attn_decode.RocmSparseAttnDecodePartial` (512-lane heads:
    448 NoPE, 64 RoPE), the partial buffers contiguous."""

    name = "deepseek_v4.rocm_sparse_attn_decode_gfx950"
    key_type = RocmSparseAttnDecodeGfx950Key
    jit = _gfx950_partial_kernel

    def dispatch(
        self,
        *,
        q: torch.Tensor,
        fnuz_main: bool,
        extra_cache: torch.Tensor | None = None,
        trust_extra: bool = False,
        adaptive: bool = False,
    ) -> RocmSparseAttnDecodeGfx950Key:
        return RocmSparseAttnDecodeGfx950Key(
            q_dtype=warmreg.dtype_name(q.dtype), has_extra=extra_cache is not None, fnuz_main=fnuz_main,
            fnuz_extra=False, trust_extra=trust_extra and extra_cache is not None, adaptive=adaptive, block_h=_BLOCK_H,
            block_k=_BLOCK_K, num_stages=_NUM_STAGES, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        cache = warmreg.meta((1, 1, 584), torch.uint8)
        return {  # SWA-only layers read the SWA cache alone; vLLM trusts an fp8_ds_mla compressed cache
            "q": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "extra_cache": [cache if r > 1 else None for r in sorted({min(r, 2) for r in model.ratios})],
            "fnuz_main": [platform.fp8_fnuz],
            "trust_extra": [kv_cache_dtype(config) == "fp8_ds_mla"],
            "adaptive": [False, True] if model.has_c128 else [False],
        }

    def when(self, *, extra_cache: torch.Tensor | None, adaptive: bool, **_: Any) -> bool:
        """Adaptive splits only with a compressed segment (C128 layers)."""
        return extra_cache is not None or not adaptive

    def warmup_inputs(self, key: RocmSparseAttnDecodeGfx950Key) -> Mapping[str, Any]:
        return {
            **RocmSparseAttnDecodePartial().warmup_inputs(_as_partial_key(key)),
            "trust_extra": key.trust_extra,
            "adaptive": key.adaptive,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        main_cache: torch.Tensor,
        main_indices: torch.Tensor,
        main_indptr: torch.Tensor,
        extra_cache: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_indptr: torch.Tensor | None = None,
        *,
        scale: float,
        num_splits: int,
        fnuz_main: bool,
        trust_extra: bool = False,
        adaptive: bool = False,
        one_wave_splits: int = 0,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RocmSparseAttnDecodeGfx950Key]:
        """``(part_m [T, S, H], part_l [T, S, H], part_acc [T, S, H, 512])`` fp32, fresh or ``out``.

        :param trust_extra: skip the compressed cache's NaN scrub (vLLM's ``extra_cache_nan_free``).
        :param adaptive: gfx950's adaptive splits, with ``one_wave_splits`` (vLLM's ``ONE_WAVE_SPLITS``).
        :raises warmreg.LaunchError: as :class:`~warmreg_deepseek_v4.rocm_sparse_attn_decode.RocmSparseAttnDecodePartial`
            does, and for heads other than 512 lanes.
        """
        extras = (extra_cache, extra_indices, extra_indptr)
        if any((t is None) == (extra_cache is not None) for t in extras):
            raise warmreg.LaunchError(self.name, "pass extra_cache, extra_indices and extra_indptr together, or none")
        check_segment(self.name, 64, q, main_cache, main_indices, main_indptr, "main")
        if extra_cache is not None and extra_indices is not None and extra_indptr is not None:
            check_segment(self.name, 64, q, extra_cache, extra_indices, extra_indptr, "extra")
        if q.shape[2] != 512 or num_splits < 1:
            raise warmreg.LaunchError(self.name, f"q must have 512-lane heads and num_splits be >= 1 (got "
                                      f"{q.shape[2]}, {num_splits})")  # fmt: skip
        key = self.dispatch(q=q, fnuz_main=fnuz_main, extra_cache=extra_cache, trust_extra=trust_extra,
                            adaptive=adaptive)  # fmt: skip
        tokens, heads, dim = q.shape
        out_m, out_l, out_acc = out_parts(self.name, out, 3)
        f32, dev = torch.float32, q.device
        part_m = warmreg.output(self.name, "out[0]", out_m, (tokens, num_splits, heads), f32, dev)
        part_l = warmreg.output(self.name, "out[1]", out_l, (tokens, num_splits, heads), f32, dev)
        part_acc = warmreg.output(self.name, "out[2]", out_acc, (tokens, num_splits, heads, dim), f32, dev)
        extra = extra_cache if extra_cache is not None else main_cache
        kwargs = dict(
            q_ptr=q, main_ptr=main_cache, main_idx_ptr=main_indices, main_indptr_ptr=main_indptr, extra_ptr=extra,
            extra_idx_ptr=extra_indices if extra_indices is not None else main_indices,
            extra_indptr_ptr=extra_indptr if extra_indptr is not None else main_indptr, part_m_ptr=part_m,
            part_l_ptr=part_l, part_acc_ptr=part_acc, q_stride_t=q.stride(0), q_stride_h=q.stride(1),
            main_stride=main_cache.stride(0), extra_stride=extra.stride(0),
            main_rows=main_cache.shape[0] * main_cache.shape[1], extra_rows=extra.shape[0] * extra.shape[1],
            main_page=main_cache.shape[1], extra_page=extra.shape[1], scale_log2=float(scale) * _LOG2E,
            num_heads=heads, one_wave=one_wave_splits or num_splits, HAS_EXTRA=key.has_extra,
            FNUZ_MAIN=key.fnuz_main, FNUZ_EXTRA=key.fnuz_extra, TRUST_EXTRA=key.trust_extra, ADAPTIVE=key.adaptive,
            BLOCK_H=key.block_h, BLOCK_K=key.block_k, NUM_STAGES=key.num_stages,
        )  # fmt: skip
        grid = (tokens, num_splits, triton.cdiv(heads, key.block_h)) if tokens and heads else None
        return warmreg.LaunchSpec(key, grid, kwargs, (part_m, part_l, part_acc))


def decode_gfx950_partial_reference(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]],
    *,
    scale: float,
    num_splits: int,
    adaptive: bool = False,
    one_wave_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmSparseAttnDecodeGfx950` (exact softmax state in fp32, natural units): each
    query's states over its :func:`work_splits`; the splits past them hold fp32's lowest and 0 (the kernel leaves
    their accumulators unwritten: zeros here)."""
    tokens = q.shape[0]
    m, l_, acc = decode_partial_reference(q, segments, scale=scale, num_splits=num_splits)
    for t in range(tokens):
        lens = [int(indptr[t + 1] - indptr[t]) for _, _, indptr, _ in segments] + [0]
        work = work_splits(lens[0], lens[1], num_splits, one_wave_splits or num_splits, adaptive=adaptive)
        if work != num_splits:
            one = [(c, i, p[t : t + 2], f) for c, i, p, f in segments]
            sub = decode_partial_reference(q[t : t + 1], one, scale=scale, num_splits=work)
            m[t], l_[t], acc[t] = -3.4028234663852886e38, 0.0, 0.0
            m[t, :work], l_[t, :work], acc[t, :work] = sub[0][0], sub[1][0], sub[2][0]
    return m, l_, acc


def _as_partial_key(key: RocmSparseAttnDecodeGfx950Key) -> Any:
    """gfx942's key with the same inputs, for its warmup inputs."""
    return RocmSparseAttnDecodePartial().dispatch(
        q=warmreg.meta((1, 1, 512), getattr(torch, key.q_dtype)), fnuz_main=key.fnuz_main,
        extra_cache=warmreg.meta((1, 1, 584), torch.uint8) if key.has_extra else None,
    )  # fmt: skip


def decode_gfx950(
    q: torch.Tensor,
    swa: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    attn_sink: torch.Tensor | None,
    *,
    scale: float,
    trust_extra: bool = False,
    adaptive: bool = False,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cu: int | None = None,
) -> torch.Tensor:
    """The drop-in for vLLM's gfx950 ``_rocm_sparse_attn_decode_ragged_triton`` (OCP caches): vLLM's split count and
    adaptive splits (``adaptive`` is the caller's ``adaptive_splits``), this partial pass, then the reduce."""
    tokens, heads = q.shape[0], q.shape[1]
    inv, cus, blocks = 1.0 / max(1, tokens), cu if cu is not None else cu_count(q.device), triton.cdiv(heads, _BLOCK_H)
    splits = decode_num_splits(tokens, blocks, swa[1].numel() * inv, extra[1].numel() * inv if extra else 0.0, cu=cus,
                               gfx950=True, block_k=_BLOCK_K)  # fmt: skip
    base = tokens * blocks
    adaptive = adaptive and base >= 16 and splits > 4
    one_wave = max(1, cus // base) if adaptive and 16 <= base < 64 else splits
    parts = RocmSparseAttnDecodeGfx950()(
        q, *swa, *(extra or (None, None, None)), scale=scale, num_splits=splits, fnuz_main=False,
        trust_extra=trust_extra and extra is not None, adaptive=adaptive, one_wave_splits=one_wave,
    )  # fmt: skip
    reduce = RocmSparseAttnReduce()
    return reduce(*parts, attn_sink, positions=positions, cos_sin_cache=cos_sin_cache, adaptive=adaptive, out=out)  # type: ignore[no-any-return]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register gfx950's partial pass unless decode takes aiter's sparse MLA (see the module docstring)."""
    on = not aiter_sparse_mla(platform)
    registry.add(RocmSparseAttnDecodeGfx950(), when=warmreg.rocm_arch_in("gfx950") if on else False)
