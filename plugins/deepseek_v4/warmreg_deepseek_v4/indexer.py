"""DeepSeek-V4 C4 indexer: Q RoPE + FP8 quant (specs section 8) and KV compress + insert (section 11b).

Only the FP8 indexer path is implemented; the MXFP4 path (``indexer_kv_dtype == "mxfp4"``, PTX E2M1
conversion on CUDA, aiter on ROCm) is left for later. Both kernels round with exact power-of-two
scales ``s = 2**ceil(log2(max(amax, 1e-4) / FP8_MAX))`` (``ceil(log2)`` from the exponent bits) and
write FP8 bytes with a bit-exact encoder (see :mod:`._quant`). ``rope(x, p)`` below is GPT-J
interleaved RoPE on the last ``R = cos_sin_cache.shape[1]`` dims: pairs ``(e, o) = (x[2i], x[2i+1])``
of that part, ``c, s = cos_sin_cache[p, i], cos_sin_cache[p, R/2 + i]``, ``e' = e*c - o*s``,
``o' = o*c + e*s``.

**Indexer Q** (grid ``(T, H)``, one program per token and head)::

    y = float32(index_q[t, h]);  y[rot] = float32(bf16(rope(y, positions[t])[rot]))   # NoPE part as is
    s = pow2 scale of amax(|y|) with FP8_MAX (448 e4m3fn; 224 e4m3fnuz on gfx942)
    q_fp8[t, h] = fp8(y / s);   w_out[t, h] = float32(index_weights[t, h]) * s * softmax_scale * head_scale

The q scale is folded into the weights: there is no q-scale tensor. On ROCm the rotation uses
explicit ``fma(e, c, -(o*s))``, ``fma(o, c, e*s)``.

**Indexer KV compress + insert** (grid ``(T,)``; a token writes only if ``slot_mapping[t] >= 0``,
``(pos + 1) % cr == 0`` and ``compressed_slot_mapping[t] >= 0``). With window ``L = 2*cr`` (overlap)
ending at ``pos``, state rows read through the state block table, the older ``cr`` positions from
the first half of each state (kv ``[0, hd)``, score ``[SW, SW+hd)``), the newer ones from the second::

    c = sum_i softmax_i(score_i) * kv_i             (per column; positions < 0 excluded)
    n = c * rsqrt(mean(c**2) + eps) * w
    x = float32(bf16(rope(n, (pos // cr) * cr)))     s = pow2 scale of amax(|x|) with 448
    page, j = divmod(compressed_slot_mapping[t], kv_block_size)
    kv_cache page bytes [j*hd, (j+1)*hd) = e4m3fn(clamp(x / s, +-448))
    kv_cache page bytes [kv_block_size*hd + 4j, +4) = float32 s, or (MX_SCALE) the UE8M0 byte x4 as int32

K is always OCP e4m3fn (max 448), even on gfx942.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._quant import bf16_round, ceil_log2, exp2i, fp8_bits, pow2_scale_reference
from .model import DSV4, PLUGIN
from .sparse_mla import compressed_block_size

__all__ = [
    "IndexerKVInsertKey",
    "IndexerKVCompressInsert",
    "IndexerQKey",
    "IndexerQRopeQuant",
    "indexer_kv_compress_insert_reference",
    "indexer_page_stride",
    "indexer_q_rope_quant_reference",
    "register",
]

_SCALE_FLOOR = 1e-4
_K_FP8_MAX = 448.0
_SCALE_BYTES = 4  # one fp32 (or UE8M0 x4 int32) scale per 128-dim token


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "cos_sin_ptr", "weights_ptr"])
def _indexer_q_rope_quant_kernel(
    q_ptr,
    positions_ptr,
    cos_sin_ptr,
    weights_ptr,
    q_out_ptr,
    w_out_ptr,
    q_stride_t,
    q_stride_h,
    weights_stride,
    cos_sin_stride,
    softmax_scale,
    head_scale,
    HEAD_DIM: tl.constexpr,  # index_head_dim (128): one program quantizes one whole head
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32): the interleaved pairs rotated
    FP8_MAX: tl.constexpr,  # 448 (e4m3fn) or 224 (e4m3fnuz): the scale maps amax onto it
    FNUZ: tl.constexpr,  # write e4m3fnuz bytes (gfx942) instead of e4m3fn
    EXPLICIT_FMA: tl.constexpr,  # ROCm: rotate with explicit fma (the reference numerics there)
):
    NOPE: tl.constexpr = HEAD_DIM - 2 * HALF_ROT
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = q_ptr + t * q_stride_t + h * q_stride_h
    nope = tl.load(row + tl.arange(0, NOPE)).to(tl.float32)
    rot = tl.load(row + NOPE + tl.arange(0, 2 * HALF_ROT)).to(tl.float32)
    even, odd = tl.split(tl.reshape(rot, (HALF_ROT, 2)))
    cs = cos_sin_ptr + tl.load(positions_ptr + t) * cos_sin_stride + tl.arange(0, HALF_ROT)
    cos = tl.load(cs)
    sin = tl.load(cs + HALF_ROT)
    if EXPLICIT_FMA:
        even_r = tl.fma(even, cos, -(odd * sin))
        odd_r = tl.fma(odd, cos, even * sin)
    else:
        even_r = even * cos - odd * sin
        odd_r = odd * cos + even * sin
    even_r = bf16_round(even_r)
    odd_r = bf16_round(odd_r)
    amax = tl.maximum(
        tl.max(tl.abs(nope), axis=0), tl.maximum(tl.max(tl.abs(even_r), axis=0), tl.max(tl.abs(odd_r), axis=0))
    )
    e = ceil_log2(tl.math.div_rn(tl.maximum(amax, 1e-4), FP8_MAX))
    inv = exp2i(-e)  # x / 2**e == x * 2**-e exactly
    out = q_out_ptr + (t * tl.num_programs(1) + h) * HEAD_DIM
    tl.store(out + tl.arange(0, NOPE), fp8_bits(nope * inv, FNUZ))
    rot_q = tl.reshape(tl.join(even_r, odd_r), (2 * HALF_ROT,)) * inv
    tl.store(out + NOPE + tl.arange(0, 2 * HALF_ROT), fp8_bits(rot_q, FNUZ))
    w = tl.load(weights_ptr + t * weights_stride + h).to(tl.float32)
    tl.store(w_out_ptr + t * tl.num_programs(1) + h, w * exp2i(e) * softmax_scale * head_scale)


@attrs.frozen(kw_only=True)
class IndexerQKey(warmreg.CompileKey):
    """What changes the binary of the indexer Q RoPE + FP8 quant."""

    dtype: str  # index_q dtype (bfloat16: also the RoPE round-trip dtype)
    weights_dtype: str
    head_dim: int
    rope_dim: int
    fp8_dtype: str  # float8_e4m3fn or float8_e4m3fnuz (gfx942)
    fp8_max: float
    explicit_fma: bool
    q_stride_t: str  # int classes of the specialized strides
    q_stride_h: str
    weights_stride: str
    cos_sin_stride: str
    q_aligned: bool
    num_warps: int
    enable_fp_fusion: bool


def _rep(cls: str) -> int:
    """A representative of an int class stored in a key (``warmreg.int_class_rep``)."""
    return warmreg.int_class_rep(cls)  # type: ignore[arg-type]  # key fields hold the class as str


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _cos_sin_meta(config: warmreg.WarmConfig, rope_dim: int) -> torch.Tensor:
    rows = config.get("model.max_position_embeddings", int, plugin=PLUGIN, default=1 << 20)
    return warmreg.meta((rows, rope_dim), torch.float32)


def _check_rope(kernel: str, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2 or cos_sin_cache.stride(-1) != 1:
        raise warmreg.LaunchError(
            kernel,
            f"cos_sin_cache must be float32 [P, rope_dim] with a contiguous row (got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})",
        )
    rope = cos_sin_cache.shape[1]
    if rope % 2 or not _is_pow2(rope // 2) or not _is_pow2(head_dim - rope):
        raise warmreg.LaunchError(
            kernel, f"rope_dim {rope} and head_dim {head_dim} need power-of-two halves and NoPE part"
        )


class IndexerQRopeQuant(warmreg.TritonKernel[IndexerQKey]):
    """Indexer Q RoPE + FP8 quant with the q scale folded into the weights (specs section 8, FP8 path).

    :param num_heads: ``index_n_heads`` (domains only: the launch reads the tensors).
    :param head_dim: ``index_head_dim``.
    :param rope_dim: ``qk_rope_head_dim``.
    :param dtype: activation dtype name of ``index_q`` and ``index_weights``.
    """

    name = "deepseek_v4.indexer_q_rope_quant"
    key_type = IndexerQKey
    jit = _indexer_q_rope_quant_kernel

    def __init__(
        self, *, num_heads: int = 64, head_dim: int = 128, rope_dim: int = 64, dtype: str = "bfloat16"
    ) -> None:
        self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
        self.dtype = getattr(torch, dtype)

    def dispatch(
        self,
        *,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        fp8_dtype: torch.dtype,
        explicit_fma: bool,
    ) -> IndexerQKey:
        return IndexerQKey(
            dtype=_dtype_name(index_q.dtype),
            weights_dtype=_dtype_name(index_weights.dtype),
            head_dim=index_q.shape[-1],
            rope_dim=cos_sin_cache.shape[-1],
            fp8_dtype=_dtype_name(fp8_dtype),
            fp8_max=224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0,
            explicit_fma=explicit_fma,
            q_stride_t=warmreg.int_class(index_q.stride(0)),
            q_stride_h=warmreg.int_class(index_q.stride(1)),
            weights_stride=warmreg.int_class(index_weights.stride(0)),
            cos_sin_stride=warmreg.int_class(cos_sin_cache.stride(0)),
            q_aligned=warmreg.is_aligned(index_q),
            num_warps=1,
            enable_fp_fusion=True,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = warmreg.token_counts(config, plugin=PLUGIN)
        return {
            "index_q": [warmreg.meta((t, self.num_heads, self.head_dim), self.dtype) for t in tokens],
            "index_weights": [warmreg.meta((t, self.num_heads), self.dtype) for t in tokens],
            "cos_sin_cache": [_cos_sin_meta(config, self.rope_dim)],
            "fp8_dtype": [torch.float8_e4m3fnuz if platform.fp8_fnuz else torch.float8_e4m3fn],
            "explicit_fma": [platform.is_rocm],
        }

    def when(self, *, index_q: torch.Tensor, index_weights: torch.Tensor, **_: Any) -> bool:
        return index_q.shape[0] == index_weights.shape[0]

    def warmup_inputs(self, key: IndexerQKey) -> Mapping[str, Any]:
        return {
            "positions": warmreg.meta((1,), torch.int64),
            "index_q": warmreg.meta(
                (1, 1, key.head_dim),
                getattr(torch, key.dtype),
                stride=(_rep(key.q_stride_t), _rep(key.q_stride_h), 1),
                offset=0 if key.q_aligned else 1,
            ),
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), torch.float32, stride=(_rep(key.cos_sin_stride), 1)),
            "index_weights": warmreg.meta(
                (1, 1), getattr(torch, key.weights_dtype), stride=(_rep(key.weights_stride), 1)
            ),
            "softmax_scale": 1.0,
            "head_scale": 1.0,
            "fp8_dtype": getattr(torch, key.fp8_dtype),
            "explicit_fma": key.explicit_fma,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        index_q: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        index_weights: torch.Tensor,
        softmax_scale: float,
        head_scale: float,
        *,
        fp8_dtype: torch.dtype | None = None,
        explicit_fma: bool | None = None,
    ) -> warmreg.LaunchSpec[IndexerQKey]:
        """RoPE and quantize ``index_q [T, H, D]``; returns fresh ``(q_fp8 [T, H, D], w_out [T, H] float32)``.

        :param positions: int64 ``[T]``.
        :param index_q: ``[T, H, D]`` with a contiguous last dim (token and head strides are passed).
        :param cos_sin_cache: float32 ``[P, R]``: ``R/2`` cosines then ``R/2`` sines per position.
        :param index_weights: ``[T, H]`` with a contiguous last dim.
        :param softmax_scale: ``D**-0.5``, folded into ``w_out``.
        :param head_scale: ``H**-0.5``, folded into ``w_out``.
        :param fp8_dtype: ``float8_e4m3fn`` or ``float8_e4m3fnuz`` (default: the local GPU's; e4m3fn on CPU).
        :param explicit_fma: rotate with explicit fma (default: the local GPU is ROCm).
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        if index_q.ndim != 3 or index_q.stride(-1) != 1 or index_q.dtype != torch.bfloat16:
            raise warmreg.LaunchError(
                self.name,
                f"index_q must be bfloat16 [T, H, D] with a contiguous last dim (got {index_q.dtype} {tuple(index_q.shape)})",
            )
        t, h, d = index_q.shape
        if tuple(index_weights.shape) != (t, h) or index_weights.stride(-1) != 1:
            raise warmreg.LaunchError(self.name, f"index_weights must be [T, H] = {(t, h)} with a contiguous last dim")
        if positions.dtype != torch.int64 or tuple(positions.shape) != (t,):
            raise warmreg.LaunchError(
                self.name, f"positions must be int64 [{t}] (got {positions.dtype} {tuple(positions.shape)})"
            )
        _check_rope(self.name, cos_sin_cache, d)
        local = warmreg.runtime_platform()
        if fp8_dtype is None:
            fp8_dtype = torch.float8_e4m3fnuz if local is not None and local.fp8_fnuz else torch.float8_e4m3fn
        if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise warmreg.LaunchError(
                self.name, f"fp8_dtype must be float8_e4m3fn or float8_e4m3fnuz (got {fp8_dtype})"
            )
        if explicit_fma is None:
            explicit_fma = local is not None and local.is_rocm
        key = self.dispatch(
            index_q=index_q,
            index_weights=index_weights,
            cos_sin_cache=cos_sin_cache,
            fp8_dtype=fp8_dtype,
            explicit_fma=explicit_fma,
        )
        q_out = torch.empty((t, h, d), dtype=torch.uint8, device=index_q.device)  # fp8 bytes, viewed on return
        w_out = torch.empty((t, h), dtype=torch.float32, device=index_q.device)
        kwargs = dict(
            q_ptr=index_q, positions_ptr=positions, cos_sin_ptr=cos_sin_cache, weights_ptr=index_weights,
            q_out_ptr=q_out, w_out_ptr=w_out, q_stride_t=index_q.stride(0), q_stride_h=index_q.stride(1),
            weights_stride=index_weights.stride(0), cos_sin_stride=cos_sin_cache.stride(0),
            softmax_scale=float(softmax_scale), head_scale=float(head_scale), HEAD_DIM=key.head_dim, HALF_ROT=key.rope_dim // 2,
            FP8_MAX=key.fp8_max, FNUZ=key.fp8_dtype == "float8_e4m3fnuz", EXPLICIT_FMA=key.explicit_fma,
        )  # fmt: skip
        grid = (t, h) if t and h else None
        return warmreg.LaunchSpec(key, grid, kwargs, (q_out.view(fp8_dtype), w_out))


def _rope_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False, fma: bool = False
) -> torch.Tensor:
    """GPT-J interleaved rotation of ``x [..., R]`` (fp32) by ``cos, sin [..., R/2]``, in fp32 steps.

    ``fma`` emulates ``fma(e, c, -(o*s))``: the exact float64 product, one rounding of the sum to fp32
    (a second, float64 rounding can differ from a true fma only on exact ties, never seen in practice).
    """
    even, odd = x[..., 0::2], x[..., 1::2]
    if inverse:
        sin = -sin
    if fma:
        even_r = (even.double() * cos.double() - (odd * sin).double()).float()
        odd_r = (odd.double() * cos.double() + (even * sin).double()).float()
    else:
        even_r = even * cos - odd * sin
        odd_r = odd * cos + even * sin
    return torch.stack([even_r, odd_r], dim=-1).flatten(-2)


def indexer_q_rope_quant_reference(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    explicit_fma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`IndexerQRopeQuant`: ``(q_fp8 [T, H, D], w_out [T, H] float32)``."""
    rope = cos_sin_cache.shape[1]
    x = index_q.float()
    cs = cos_sin_cache[positions][:, None, :]
    rot = _rope_pairs(x[..., -rope:], cs[..., : rope // 2], cs[..., rope // 2 :], fma=explicit_fma)
    y = torch.cat([x[..., :-rope], rot.to(index_q.dtype).float()], dim=-1)
    fp8_max = 224.0 if fp8_dtype == torch.float8_e4m3fnuz else 448.0
    _, s = pow2_scale_reference(y.abs().amax(dim=-1), _SCALE_FLOOR, fp8_max)
    q = (y / s[..., None]).to(fp8_dtype)
    f32 = torch.float32
    w = index_weights.float() * s * torch.tensor(softmax_scale, dtype=f32) * torch.tensor(head_scale, dtype=f32)
    return q, w


@triton.jit(
    do_not_specialize=["state_stride0", "state_stride1", "block_table_stride", "cos_sin_stride", "eps"],
    do_not_specialize_on_alignment=[
        "state_ptr",  # rows sit at runtime strides: never vectorized, so alignment buys nothing
        "block_table_ptr",
        "token_to_req_ptr",
        "positions_ptr",
        "slot_mapping_ptr",
        "compressed_slot_mapping_ptr",
        "cos_sin_ptr",
    ],
)
def _indexer_kv_compress_insert_kernel(
    state_ptr,
    block_table_ptr,
    token_to_req_ptr,
    positions_ptr,
    slot_mapping_ptr,
    compressed_slot_mapping_ptr,
    norm_weight_ptr,
    cos_sin_ptr,
    kv_cache_ptr,
    state_stride0,
    state_stride1,
    block_table_stride,
    cos_sin_stride,
    eps,
    state_block_size,
    kv_block_size,
    HEAD_SIZE: tl.constexpr,  # indexer head_dim (128): one fp8 quant block per compressed token
    STATE_WIDTH: tl.constexpr,  # state_cache.shape[-1] // 2: kv state columns, then score + APE
    COMPRESS_RATIO: tl.constexpr,  # 4: a state closes every COMPRESS_RATIO positions
    OVERLAP: tl.constexpr,  # the window spans 2 * COMPRESS_RATIO positions over two state halves
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32)
    KV_BLOCK_STRIDE: tl.constexpr,  # kv_cache.stride(0): bytes per indexer cache page
    MX_SCALE: tl.constexpr,  # store the scale as UE8M0 x4 in an int32 (CUDA sm100 family) not fp32
):
    WINDOW: tl.constexpr = 2 * COMPRESS_RATIO if OVERLAP else COMPRESS_RATIO
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    kv_slot = tl.load(compressed_slot_mapping_ptr + t).to(tl.int64)
    if (tl.load(slot_mapping_ptr + t) >= 0) & ((pos + 1) % COMPRESS_RATIO == 0) & (kv_slot >= 0):
        i = tl.arange(0, WINDOW)
        p = pos - WINDOW + 1 + i
        valid = p >= 0
        req = tl.load(token_to_req_ptr + t).to(tl.int64)
        page = tl.load(block_table_ptr + req * block_table_stride + p // state_block_size, mask=valid, other=0)
        rows = state_ptr + page.to(tl.int64) * state_stride0 + (p % state_block_size) * state_stride1
        if OVERLAP:  # older window: first half of its state; current window: second half
            rows += tl.where(i >= COMPRESS_RATIO, HEAD_SIZE, 0)
        d = tl.arange(0, HEAD_SIZE)
        ptrs = rows[:, None] + d[None, :]
        score = tl.load(ptrs + STATE_WIDTH, mask=valid[:, None], other=float("-inf"))
        kv = tl.load(ptrs, mask=valid[:, None], other=0.0)
        prob = tl.exp(score - tl.max(score, axis=0)[None, :])
        prob = prob / tl.sum(prob, axis=0)[None, :]
        c = tl.sum(prob * kv, axis=0)
        n = c * tl.rsqrt(tl.sum(c * c, axis=0) / HEAD_SIZE + eps) * tl.load(norm_weight_ptr + d).to(tl.float32)
        # RoPE on the last 2 * HALF_ROT dims at the compressed position, as pairs (2k, 2k+1)
        even, odd = tl.split(tl.reshape(n, (HEAD_SIZE // 2, 2)))
        k = tl.arange(0, HEAD_SIZE // 2) - (HEAD_SIZE // 2 - HALF_ROT)
        is_rot = k >= 0
        cs = cos_sin_ptr + (pos // COMPRESS_RATIO * COMPRESS_RATIO) * cos_sin_stride + k
        cos = tl.load(cs, mask=is_rot, other=1.0)
        sin = tl.load(cs + HALF_ROT, mask=is_rot, other=0.0)
        even_r = tl.where(is_rot, even * cos - odd * sin, even)
        odd_r = tl.where(is_rot, odd * cos + even * sin, odd)
        x = bf16_round(tl.reshape(tl.join(even_r, odd_r), (HEAD_SIZE,)))
        e = ceil_log2(tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4), 448.0))
        q = fp8_bits(tl.clamp(x * exp2i(-e), -448.0, 448.0), False)  # K is OCP e4m3fn on every platform
        base = kv_cache_ptr + (kv_slot // kv_block_size) * KV_BLOCK_STRIDE
        j = kv_slot % kv_block_size
        tl.store(base + j * HEAD_SIZE + d, q)
        scale_ptr = base + kv_block_size * HEAD_SIZE + j * 4
        if MX_SCALE:
            b = e + 127
            tl.store(scale_ptr.to(tl.pointer_type(tl.int32)), b | (b << 8) | (b << 16) | (b << 24))
        else:
            tl.store(scale_ptr.to(tl.pointer_type(tl.float32)), exp2i(e))


@attrs.frozen(kw_only=True)
class IndexerKVInsertKey(warmreg.CompileKey):
    """What changes the binary of the indexer KV compress + RMSNorm + RoPE + FP8 quant + insert."""

    weight_dtype: str  # compressor RMSNorm weight
    head_size: int
    rope_dim: int
    state_width: int
    compress_ratio: int
    overlap: bool
    kv_block_stride: int  # indexer cache page stride in bytes (a constexpr)
    mx_scale: bool
    state_block_size: str  # int class of the state page size (4: "other")
    kv_block_size: str  # int class of the compressed tokens per page (64: "div16")
    kv_cache_aligned: bool  # pages may live in a shared allocation
    weight_aligned: bool
    num_warps: int
    launch_pdl: bool  # always False: PDL raced with the state writes (specs 11a)


def indexer_page_stride(config: warmreg.WarmConfig, tokens_per_page: int, head_dim: int) -> int:
    """The indexer cache's page stride as the KV manager allocates it (our best knowledge, specs 11b).

    ``round_up(tokens_per_page * (head_dim + 4), 576)`` when the attention caches are ``fp8_ds_mla``,
    else rounded to 512. The launch reads the real stride from ``kv_cache.stride(0)``.
    """
    layout = config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="fp8_ds_mla")
    unit = 576 if layout == "fp8_ds_mla" else 512
    return triton.cdiv(tokens_per_page * (head_dim + _SCALE_BYTES), unit) * unit


class IndexerKVCompressInsert(warmreg.TritonKernel[IndexerKVInsertKey]):
    """The C4 indexer's fused KV compress + RMSNorm + RoPE + FP8 quant + cache insert (specs 11b, FP8).

    :param head_dim: indexer head dim (128).
    :param rope_dim: ``qk_rope_head_dim`` (64).
    :param compress_ratio: 4 (the indexer runs on C4 layers only).
    :param state_block_size: compressor state page size (4 for C4).
    :param weight_dtype: dtype name of the compressor RMSNorm weight.
    """

    name = "deepseek_v4.indexer_kv_compress_insert"
    key_type = IndexerKVInsertKey
    jit = _indexer_kv_compress_insert_kernel

    def __init__(
        self,
        *,
        head_dim: int = 128,
        rope_dim: int = 64,
        compress_ratio: int = 4,
        state_block_size: int = 4,
        weight_dtype: str = "bfloat16",
    ) -> None:
        self.head_dim, self.rope_dim, self.compress_ratio = head_dim, rope_dim, compress_ratio
        self.state_block_size = state_block_size
        self.weight_dtype = getattr(torch, weight_dtype)

    def dispatch(
        self,
        *,
        state_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        compress_ratio: int,
        mx_scale: bool,
    ) -> IndexerKVInsertKey:
        head = norm_weight.shape[0]
        width = state_cache.shape[-1] // 2
        return IndexerKVInsertKey(
            weight_dtype=_dtype_name(norm_weight.dtype),
            head_size=head,
            rope_dim=cos_sin_cache.shape[-1],
            state_width=width,
            compress_ratio=compress_ratio,
            overlap=width == 2 * head,
            kv_block_stride=kv_cache.stride(0),
            mx_scale=mx_scale,
            state_block_size=warmreg.int_class(state_cache.shape[1]),
            kv_block_size=warmreg.int_class(kv_cache.shape[1]),
            kv_cache_aligned=warmreg.is_aligned(kv_cache),
            weight_aligned=warmreg.is_aligned(norm_weight),
            num_warps=1,
            launch_pdl=False,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        per_page = compressed_block_size(config, self.compress_ratio)
        stride = indexer_page_stride(config, per_page, self.head_dim)
        state_width = (2 if self.compress_ratio == 4 else 1) * self.head_dim
        return {
            "state_cache": [warmreg.meta((1024, self.state_block_size, 2 * state_width), torch.float32)],
            "kv_cache": [
                warmreg.meta(
                    (1024, per_page, self.head_dim + _SCALE_BYTES),
                    torch.uint8,
                    stride=(stride, self.head_dim + _SCALE_BYTES, 1),
                )
            ],
            "norm_weight": [warmreg.meta((self.head_dim,), self.weight_dtype)],
            "cos_sin_cache": [_cos_sin_meta(config, self.rope_dim)],
            "compress_ratio": [self.compress_ratio],
            "mx_scale": [platform.is_cuda and 100 <= platform.sm < 110],
        }

    def warmup_inputs(self, key: IndexerKVInsertKey) -> Mapping[str, Any]:
        row = key.head_size + _SCALE_BYTES
        ids = warmreg.meta((1,), torch.int64)
        return {
            "state_cache": warmreg.meta((2, _rep(key.state_block_size), 2 * key.state_width), torch.float32),
            "state_block_table": warmreg.meta((1, 1), torch.int32),
            "token_to_req_indices": warmreg.meta((1,), torch.int32),
            "positions": ids,
            "slot_mapping": ids,
            "compressed_slot_mapping": ids,
            "norm_weight": warmreg.meta(
                (key.head_size,), getattr(torch, key.weight_dtype), offset=0 if key.weight_aligned else 1
            ),
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), torch.float32),
            "kv_cache": warmreg.meta(
                (2, _rep(key.kv_block_size), row),
                torch.uint8,
                stride=(key.kv_block_stride, row, 1),
                offset=0 if key.kv_cache_aligned else 4,  # scales need 4-byte alignment
            ),
            "eps": 1e-6,
            "compress_ratio": key.compress_ratio,
            "mx_scale": key.mx_scale,
        }

    def _check(
        self,
        state_cache: torch.Tensor,
        state_block_table: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        compressed_slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        compress_ratio: int,
    ) -> None:
        t = positions.shape[0]
        problems = []
        if positions.ndim != 1 or positions.dtype != torch.int64:
            problems.append(f"positions must be int64 [T] (got {positions.dtype} {tuple(positions.shape)})")
        for name, ids in (("slot_mapping", slot_mapping), ("compressed_slot_mapping", compressed_slot_mapping)):
            if ids.ndim != 1 or ids.dtype != torch.int64 or ids.shape[0] < t:
                problems.append(f"{name} must be int64 [>= {t}] (got {ids.dtype} {tuple(ids.shape)})")
        if (
            token_to_req_indices.dtype != torch.int32
            or token_to_req_indices.ndim != 1
            or token_to_req_indices.shape[0] < t
        ):
            problems.append(f"token_to_req_indices must be int32 [>= {t}]")
        if state_block_table.dtype != torch.int32 or state_block_table.ndim != 2 or state_block_table.stride(1) != 1:
            problems.append("state_block_table must be int32 [num_reqs, blocks] with contiguous rows")
        head = norm_weight.shape[0] if norm_weight.ndim == 1 else -1
        if not _is_pow2(head) or norm_weight.stride(0) != 1:
            problems.append(
                f"norm_weight must be a contiguous power-of-two [head_dim] (got {tuple(norm_weight.shape)})"
            )
        width = state_cache.shape[-1] // 2 if state_cache.ndim == 3 else -1
        if state_cache.dtype != torch.float32 or width not in (head, 2 * head) or state_cache.stride(-1) != 1:
            problems.append(
                f"state_cache must be float32 [pages, page_size, 2 * (1 or 2) * {head}] (got {state_cache.dtype} {tuple(state_cache.shape)})"
            )
        if not _is_pow2(compress_ratio) or (width == 2 * head and compress_ratio != 4):
            problems.append(f"compress_ratio {compress_ratio} must be a power of two, and 4 with overlapping states")
        row = head + _SCALE_BYTES
        ok_cache = kv_cache.dtype == torch.uint8 and kv_cache.ndim == 3 and tuple(kv_cache.shape[2:]) == (row,)
        if (
            not ok_cache
            or kv_cache.stride(2) != 1
            or kv_cache.stride(1) != row
            or kv_cache.stride(0) < kv_cache.shape[1] * row
        ):
            problems.append(
                f"kv_cache must be uint8 [pages, tokens_per_page, {row}] with packed pages (got {kv_cache.dtype} {tuple(kv_cache.shape)} strides {kv_cache.stride()})"
            )
        if kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4:
            problems.append("kv_cache pages must start 4-byte aligned (the scales are 4-byte words)")
        unspecialized = (state_cache.stride(0), state_cache.stride(1), state_block_table.stride(0))
        if any(not -(2**31) <= v < 2**31 for v in unspecialized):
            problems.append(f"strides {unspecialized} must fit in int32 (the binary takes them as i32)")
        if problems:
            raise warmreg.LaunchError(self.name, "; ".join(problems))

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_cache: torch.Tensor,
        state_block_table: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        compressed_slot_mapping: torch.Tensor,
        norm_weight: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        eps: float,
        *,
        compress_ratio: int = 4,
        mx_scale: bool | None = None,
    ) -> warmreg.LaunchSpec[IndexerKVInsertKey]:
        """Compress each closing token's window and insert it into ``kv_cache`` (in place; returned).

        :param state_cache: float32 ``[pages, page_size, 2 * STATE_WIDTH]`` compressor states (specs 11a).
        :param state_block_table: int32 ``[num_reqs, blocks]``: state pages of each request.
        :param token_to_req_indices: int32 ``[>= T]``.
        :param positions: int64 ``[T]``; ``T`` is the grid.
        :param slot_mapping: int64 ``[>= T]``: the token's own slot, ``-1`` for PAD.
        :param compressed_slot_mapping: int64 ``[>= T]``: indexer cache slot, or ``-1`` (specs 20).
        :param norm_weight: ``[head_dim]`` compressor RMSNorm weight.
        :param cos_sin_cache: float32 ``[P, rope_dim]``.
        :param kv_cache: uint8 ``[pages, tokens_per_page, head_dim + 4]``; ``stride(0)`` is the page stride.
        :param mx_scale: UE8M0 x4 int32 scales (default: the local GPU is CUDA sm100 family).
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        self._check(
            state_cache, state_block_table, token_to_req_indices, positions, slot_mapping, compressed_slot_mapping,
            norm_weight, kv_cache, compress_ratio,
        )  # fmt: skip
        _check_rope(self.name, cos_sin_cache, norm_weight.shape[0])
        if mx_scale is None:
            local = warmreg.runtime_platform()
            mx_scale = local is not None and local.is_cuda and 100 <= local.sm < 110
        key = self.dispatch(
            state_cache=state_cache, kv_cache=kv_cache, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache,
            compress_ratio=compress_ratio, mx_scale=mx_scale,
        )  # fmt: skip
        kwargs = dict(
            state_ptr=state_cache, block_table_ptr=state_block_table, token_to_req_ptr=token_to_req_indices,
            positions_ptr=positions, slot_mapping_ptr=slot_mapping, compressed_slot_mapping_ptr=compressed_slot_mapping,
            norm_weight_ptr=norm_weight, cos_sin_ptr=cos_sin_cache, kv_cache_ptr=kv_cache,
            state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            block_table_stride=state_block_table.stride(0), cos_sin_stride=cos_sin_cache.stride(0), eps=float(eps),
            state_block_size=state_cache.shape[1], kv_block_size=kv_cache.shape[1],
            HEAD_SIZE=key.head_size, STATE_WIDTH=key.state_width, COMPRESS_RATIO=key.compress_ratio,
            OVERLAP=key.overlap, HALF_ROT=key.rope_dim // 2, KV_BLOCK_STRIDE=key.kv_block_stride, MX_SCALE=key.mx_scale,
        )  # fmt: skip
        t = positions.shape[0]
        return warmreg.LaunchSpec(key, (t,) if t else None, kwargs, kv_cache)


def indexer_kv_compress_insert_reference(
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    eps: float,
    *,
    compress_ratio: int = 4,
    mx_scale: bool = False,
) -> torch.Tensor:
    """PyTorch reference of :class:`IndexerKVCompressInsert`; writes ``kv_cache`` in place and returns it."""
    head, rope = norm_weight.shape[0], cos_sin_cache.shape[1]
    width = state_cache.shape[-1] // 2
    overlap = width == 2 * head
    window = (2 if overlap else 1) * compress_ratio
    state_bs, kv_bs = state_cache.shape[1], kv_cache.shape[1]
    for t in range(positions.shape[0]):
        pos, kv_slot = int(positions[t]), int(compressed_slot_mapping[t])
        if int(slot_mapping[t]) < 0 or (pos + 1) % compress_ratio or kv_slot < 0:
            continue
        req = int(token_to_req_indices[t])
        score = torch.full((window, head), float("-inf"))
        kv = torch.zeros((window, head))
        for i in range(window):
            p = pos - window + 1 + i
            if p < 0:
                continue
            row = state_cache[int(state_block_table[req, p // state_bs]), p % state_bs]
            col = head if overlap and i >= compress_ratio else 0
            score[i], kv[i] = row[width + col : width + col + head], row[col : col + head]
        c = (torch.softmax(score, dim=0) * kv).sum(dim=0)
        n = c * torch.rsqrt(c.pow(2).mean() + eps) * norm_weight.float()
        cs = cos_sin_cache[pos // compress_ratio * compress_ratio]
        x = torch.cat([n[:-rope], _rope_pairs(n[-rope:], cs[: rope // 2], cs[rope // 2 :])])
        x = x.to(torch.bfloat16).float()
        e, s = pow2_scale_reference(x.abs().amax(), _SCALE_FLOOR, _K_FP8_MAX)
        q = (x / s).clamp(-_K_FP8_MAX, _K_FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        page = kv_cache[kv_slot // kv_bs].view(-1)
        j = kv_slot % kv_bs
        page[j * head : (j + 1) * head] = q
        scale = ((e + 127) * 0x01010101).to(torch.int32).reshape(1) if mx_scale else s.reshape(1)
        page[kv_bs * head + 4 * j : kv_bs * head + 4 * j + 4] = scale.view(torch.uint8)
    return kv_cache


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the C4 indexer kernels (FP8 indexer cache).

    Indexer Q runs through Triton on ROCm and on CUDA without CuTeDSL (CuTeDSL replaces it; XPU has its
    own op). The KV compress + insert runs through Triton on every platform.
    """
    c4 = model.has_c4
    q_rope = IndexerQRopeQuant(
        num_heads=model.index_n_heads, head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, dtype=model.dtype
    )
    triton_q = warmreg.is_rocm | (warmreg.is_cuda & ~warmreg.has_feature("cutedsl"))
    registry.add(q_rope, when=triton_q if c4 else False)
    insert = IndexerKVCompressInsert(
        head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, compress_ratio=4, weight_dtype=model.dtype
    )
    registry.add(insert, when=c4)
