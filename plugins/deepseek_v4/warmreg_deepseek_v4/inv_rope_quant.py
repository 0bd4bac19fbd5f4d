"""DeepSeek-V4 fused inverse RoPE + FP8 block quant of the attention output (vLLM 0.33
``models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py``, the custom op ``vllm::fused_inv_rope_fp8_quant_kernel``).

The attention output ``o [T, H, D]`` (``D = 512 = 448 NoPE + 64 RoPE``) leaves sparse MLA still
rotated; before the grouped ``wo_a`` projection each head is rotated back and quantized in blocks of
128 for DeepGEMM. Grid ``(T_al, G * hpg)`` with ``T_al = round_up(T, 4)``, one program per token and
head ``h`` (group ``g = h // hpg``, head in group ``k = h % hpg``)::

    x = float32(o[t, h]);  pairs (e, o) = (x[2i], x[2i+1]) of the last 64 dims, c, s = cos_sin_cache[pos]:
    e' = e*c + o*s;  o' = o*c - e*s                          # rotation by -theta (GPT-J interleaved)
    not QUANTIZE:  out[g, t, 512k : 512(k+1)] = bf16(x')
    QUANTIZE, per 128-block b of the head:
        s_b = 2**ceil(log2(max(amax_b |x'|, 1e-10) * float32(1/448)))   (fp32, the backend's log2)
        out[g, t, 512k + 128b : +128] = e4m3fn(clamp(x' / s_b, +-448))

The scale is vLLM's, op for op (``tl.log2``, ``tl.ceil``, ``tl.exp2``), so the bytes are its bytes on every
backend: unlike the other DSv4 quant kernels (whose amax is a bf16 value, where the two agree) this amax is any
fp32, and an fp32 log2 of a ratio an ulp or two above ``2**k`` rounds to ``k``: such a block gets ``2**k`` and
its largest value saturates at 448, where the exact ceiling would give ``2**(k+1)``.

Scales are MN-major for DeepGEMM: a buffer of ``G * K * T_al`` viewed ``(G, T, K)`` with strides
``(K * T_al, 1, T_al)``. On sm90 (``TMA_ALIGNED_SCALES`` False) ``K = hpg * 4`` fp32 scales per token
and group; on sm100 (True) ``K = hpg`` int32 words, word ``k`` packing the UE8M0 bytes (fp32 exponent
fields) of head ``k``'s 4 blocks, block ``b`` at bits ``8b..8b+7``. Programs with ``t >= T`` (TMA
padding rows) write zero scales and no values. Returns ``out.transpose(0, 1)`` ``[T, G, hpg * 512]``
(e4m3fn on every platform; bf16 without QUANTIZE) and ``scale.transpose(0, 1)`` (``None`` without
QUANTIZE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from ._checks import out_parts
from ._quant import bf16_round, exp2i, fp8_bits
from .backends import SPARSE_BACKENDS, attention_backend, flashinfer_rope_quant
from .model import DSV4, PLUGIN, fp8_checkpoint

__all__ = ["InvRopeFP8Quant", "InvRopeQuantKey", "fp8_checkpoint", "inv_rope_fp8_quant_reference", "register"]

_FP8_MAX = 448.0
_QUANT_GROUP = 128
_SCALE_FLOOR = 1e-10


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit(
    do_not_specialize=["num_tokens", "num_tokens_padded"],
    do_not_specialize_on_alignment=["positions_ptr", "cos_sin_ptr"],
)
def _inv_rope_fp8_quant_kernel(
    o_ptr,
    positions_ptr,
    cos_sin_ptr,
    out_ptr,
    scale_ptr,
    o_stride_t,
    o_stride_h,
    cos_sin_stride,
    num_tokens,
    num_tokens_padded,
    HEADS_PER_GROUP: tl.constexpr,  # heads sharing one wo_a group (8 for DeepSeek-V4 at any TP)
    HEAD_DIM: tl.constexpr,  # 512: NoPE then RoPE
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32)
    QUANT_GROUP: tl.constexpr,  # 128: DeepGEMM's block (4 blocks per head)
    QUANTIZE: tl.constexpr,  # FP8 wo_a: quantize; else store bf16 (scale_ptr is None)
    TMA_ALIGNED_SCALES: tl.constexpr,  # sm100: UE8M0 x4 int32 words, not fp32 scales
    USE_PDL: tl.constexpr,  # gate the PDL intrinsics; the launch option launch_pdl matches it
):
    BLOCKS: tl.constexpr = HEAD_DIM // QUANT_GROUP
    ROW: tl.constexpr = HEADS_PER_GROUP * HEAD_DIM
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = (h // HEADS_PER_GROUP).to(tl.int64)
    k = h % HEADS_PER_GROUP
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
    # rows past T pad the scales for TMA: zero scales, no values.
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    valid = tl.where(t < num_tokens, True, False)
    d = tl.arange(0, HEAD_DIM)
    row = o_ptr + t * o_stride_t + h * o_stride_h
    x = tl.load(row + d, mask=valid, other=0.0).to(tl.float32)
    partner = tl.load(row + (d ^ 1), mask=valid, other=0.0).to(tl.float32)
    r = d - (HEAD_DIM - 2 * HALF_ROT)
    is_rot = r >= 0
    cs = cos_sin_ptr + tl.load(positions_ptr + t, mask=valid, other=0) * cos_sin_stride + (r >> 1)
    cos = tl.load(cs, mask=is_rot & valid, other=1.0)
    sin = tl.load(cs + HALF_ROT, mask=is_rot & valid, other=0.0)
    rotated = tl.where((d & 1) == 0, x * cos + partner * sin, x * cos - partner * sin)
    x = tl.where(is_rot, rotated, x)
    out = out_ptr + g * num_tokens * ROW + t * ROW + k * HEAD_DIM + d
    if QUANTIZE:
        blocks = tl.reshape(x, (BLOCKS, QUANT_GROUP))
        # vLLM's scale op for op (not the exact ceil of the other DSv4 quant kernels): this amax is an fp32, and an
        # fp32 log2 of a ratio an ulp or two above 2**k rounds to k, so such a block gets 2**k and saturates at 448
        e = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(blocks), axis=1), 1e-10) * (1.0 / 448.0))).to(tl.int32)
        q = tl.clamp(blocks * exp2i(-e)[:, None], -448.0, 448.0)
        tl.store(out, fp8_bits(tl.reshape(q, (HEAD_DIM,)), False), mask=valid)
        b = tl.arange(0, BLOCKS)
        if TMA_ALIGNED_SCALES:  # one int32 word per head: its BLOCKS (= 4) exponent bytes
            word = tl.reduce((e + 127) << (8 * b), 0, _bit_or)
            tl.store(scale_ptr + (g * HEADS_PER_GROUP + k) * num_tokens_padded + t, tl.where(valid, word, 0))
        else:
            k_col = g * HEADS_PER_GROUP * BLOCKS + k * BLOCKS + b
            tl.store(scale_ptr + k_col * num_tokens_padded + t, tl.where(valid, exp2i(e), 0.0))
    else:
        tl.store(out, bf16_round(x).to(tl.bfloat16), mask=valid)  # exact: already a bf16 value


@attrs.frozen(kw_only=True)
class InvRopeQuantKey(warmreg.CompileKey):
    """What changes the binary of the fused inverse RoPE + FP8 block quant."""

    dtype: str  # attention output dtype
    heads_per_group: int
    head_dim: int
    rope_dim: int
    quantize: bool  # FP8 wo_a (FP8 checkpoints)
    tma_aligned_scales: bool  # sm100: packed UE8M0 scales
    o_stride_t: str  # int classes of the specialized strides
    o_stride_h: str
    cos_sin_stride: str
    o_aligned: bool  # o may be a view of a larger attention buffer
    num_warps: int
    num_stages: int
    launch_pdl: bool


class InvRopeFP8Quant(warmreg.TritonKernel[InvRopeQuantKey]):
    """Fused inverse RoPE + FP8 block quant of the attention output, for the grouped ``wo_a``.

    :param num_heads: attention heads per rank (``num_attention_heads / TP``; domains only).
    :param n_groups: ``wo_a`` groups per rank (``o_groups / TP``).
    :param head_dim: ``head_dim`` (512).
    :param rope_dim: ``qk_rope_head_dim`` (64).
    :param dtype: activation dtype name.
    :param quantize: whether ``wo_a`` is FP8 (domains only; default: :func:`.model.fp8_checkpoint` of the config).
    """

    name = "deepseek_v4.inv_rope_fp8_quant"
    key_type = InvRopeQuantKey
    jit = _inv_rope_fp8_quant_kernel

    def __init__(
        self,
        *,
        num_heads: int = 64,
        n_groups: int = 8,
        head_dim: int = 512,
        rope_dim: int = 64,
        dtype: str = "bfloat16",
        quantize: bool | None = None,
    ) -> None:
        self.num_heads, self.n_groups, self.head_dim, self.rope_dim = num_heads, n_groups, head_dim, rope_dim
        self.dtype, self.quantize = getattr(torch, dtype), quantize

    def dispatch(
        self,
        *,
        o: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        n_groups: int,
        quantize: bool,
        tma_aligned_scales: bool,
        launch_pdl: bool,
    ) -> InvRopeQuantKey:
        return InvRopeQuantKey(
            dtype=warmreg.dtype_name(o.dtype),
            heads_per_group=o.shape[1] // n_groups,
            head_dim=o.shape[2],
            rope_dim=cos_sin_cache.shape[1],
            quantize=quantize,
            tma_aligned_scales=tma_aligned_scales and quantize,
            o_stride_t=warmreg.int_class(o.stride(0)),
            o_stride_h=warmreg.int_class(o.stride(1)),
            cos_sin_stride=warmreg.int_class(cos_sin_cache.stride(0)),
            o_aligned=warmreg.is_aligned(o),
            num_warps=1,
            num_stages=1,
            launch_pdl=launch_pdl,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        rows = config.get("model.max_position_embeddings", int, plugin=PLUGIN, default=1 << 20)
        return {
            "o": [
                warmreg.meta((t, self.num_heads, self.head_dim), self.dtype)
                for t in warmreg.token_counts(config, plugin=PLUGIN)
            ],
            "cos_sin_cache": [warmreg.meta((rows, self.rope_dim), torch.float32)],
            "n_groups": [self.n_groups],
            "quantize": [fp8_checkpoint(config) if self.quantize is None else self.quantize],
            "tma_aligned_scales": [platform.is_cuda and platform.sm >= 100],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: InvRopeQuantKey) -> Mapping[str, Any]:
        return {
            "o": warmreg.meta(
                (1, key.heads_per_group, key.head_dim),
                getattr(torch, key.dtype),
                stride=(warmreg.int_class_rep(key.o_stride_t), warmreg.int_class_rep(key.o_stride_h), 1),
                offset=0 if key.o_aligned else 1,
            ),
            "positions": warmreg.meta((1,), torch.int64),
            "cos_sin_cache": warmreg.meta((2, key.rope_dim), torch.float32, stride=(warmreg.int_class_rep(key.cos_sin_stride), 1)),
            "n_groups": 1,
            "quantize": key.quantize,
            "tma_aligned_scales": key.tma_aligned_scales,
            "launch_pdl": key.launch_pdl,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        o: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        n_groups: int,
        *,
        quantize: bool = True,
        tma_aligned_scales: bool | None = None,
        launch_pdl: bool | None = None,
        out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> warmreg.LaunchSpec[InvRopeQuantKey]:
        """Rotate back and quantize ``o``; returns ``(out [T, G, hpg * D], scale [T, G, K] or None)``: transposed
        views of fresh buffers, or of the ``out`` buffers.

        :param o: ``[T, H, D]`` attention output with a contiguous last dim.
        :param positions: int64 ``[T]``.
        :param cos_sin_cache: float32 ``[P, R]`` (the layer's own cache).
        :param n_groups: ``wo_a`` groups on this rank; ``H`` must be a multiple.
        :param quantize: FP8 ``wo_a`` (else bf16 out and no scales).
        :param tma_aligned_scales: packed UE8M0 scales (default: the local GPU is sm100 or newer).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: the two buffers to write instead of fresh ones, in the kernel's group-major layout (the
            returned tensors are their views): exactly ``[G, T, hpg * D]`` (float8_e4m3fn, or ``o``'s dtype
            without ``quantize``) and the scale storage ``[G, K, round_up(T, 4)]`` (int32 packed, float32
            otherwise; ``None`` without ``quantize``), contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve, or an ``out`` unlike
            the fresh buffers.
        """
        if o.ndim != 3 or o.stride(-1) != 1 or o.dtype != torch.bfloat16:
            raise warmreg.LaunchError(
                self.name, f"o must be bfloat16 [T, H, D] with a contiguous last dim (got {o.dtype} {tuple(o.shape)})"
            )
        t, h, d = o.shape
        if n_groups < 1 or h % n_groups:
            raise warmreg.LaunchError(self.name, f"{h} heads do not split into {n_groups} groups")
        if positions.dtype != torch.int64 or tuple(positions.shape) != (t,):
            raise warmreg.LaunchError(
                self.name, f"positions must be int64 [{t}] (got {positions.dtype} {tuple(positions.shape)})"
            )
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.ndim != 2 or cos_sin_cache.stride(-1) != 1:
            raise warmreg.LaunchError(self.name, "cos_sin_cache must be float32 [P, rope_dim] with contiguous rows")
        if d % _QUANT_GROUP or (d // _QUANT_GROUP) & (d // _QUANT_GROUP - 1) or cos_sin_cache.shape[1] > d:
            raise warmreg.LaunchError(self.name, f"head_dim {d} must be a power-of-two number of {_QUANT_GROUP}-blocks")
        local = warmreg.runtime_platform()
        if tma_aligned_scales is None:
            tma_aligned_scales = local is not None and local.is_cuda and local.sm >= 100
        if tma_aligned_scales and quantize and d != 4 * _QUANT_GROUP:
            raise warmreg.LaunchError(self.name, f"packed scales need 4 blocks per head (head_dim 512, got {d})")
        if launch_pdl is None:
            launch_pdl = local is not None and local.supports_pdl
        key = self.dispatch(
            o=o, cos_sin_cache=cos_sin_cache, n_groups=n_groups, quantize=quantize,
            tma_aligned_scales=tma_aligned_scales, launch_pdl=launch_pdl,
        )  # fmt: skip
        hpg, padded = key.heads_per_group, triton.cdiv(t, 4) * 4
        out_values, out_scales = out_parts(self.name, out, 2)
        values = warmreg.output(
            self.name, "out[0]", out_values, (n_groups, t, hpg * d), torch.float8_e4m3fn if quantize else o.dtype, o.device
        )
        scale: torch.Tensor | None = None
        if quantize:
            k = hpg if key.tma_aligned_scales else hpg * d // _QUANT_GROUP
            sdtype = torch.int32 if key.tma_aligned_scales else torch.float32
            storage = warmreg.output(self.name, "out[1]", out_scales, (n_groups, k, padded), sdtype, o.device)
            scale = storage[:, :, :t].transpose(1, 2)  # (G, T, K), strides (K * T_al, 1, T_al): MN-major
        elif out_scales is not None:
            raise warmreg.LaunchError(self.name, "out[1] must be None without quantize (no scales)")
        kwargs = dict(
            o_ptr=o, positions_ptr=positions, cos_sin_ptr=cos_sin_cache,
            out_ptr=values.view(torch.uint8) if quantize else values,
            scale_ptr=scale, o_stride_t=o.stride(0), o_stride_h=o.stride(1),
            cos_sin_stride=cos_sin_cache.stride(0), num_tokens=t, num_tokens_padded=padded,
            HEADS_PER_GROUP=hpg, HEAD_DIM=d, HALF_ROT=key.rope_dim // 2, QUANT_GROUP=_QUANT_GROUP,
            QUANTIZE=key.quantize, TMA_ALIGNED_SCALES=key.tma_aligned_scales, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = (padded, h) if padded and h else None
        return warmreg.LaunchSpec(
            key, grid, kwargs, (values.transpose(0, 1), scale.transpose(0, 1) if scale is not None else None)
        )


def inv_rope_fp8_quant_reference(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    n_groups: int,
    *,
    quantize: bool = True,
    tma_aligned_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch reference of :class:`InvRopeFP8Quant` (scale views over zero-padded rows included)."""
    t, h, d = o.shape
    rope, hpg = cos_sin_cache.shape[1], h // n_groups
    x = o.float()
    cs = cos_sin_cache[positions][:, None, :]
    even, odd = x[..., d - rope :: 2], x[..., d - rope + 1 :: 2]
    cos, sin = cs[..., : rope // 2], cs[..., rope // 2 :]
    rot = torch.stack([even * cos + odd * sin, odd * cos - even * sin], dim=-1).flatten(-2)
    y = torch.cat([x[..., : d - rope], rot], dim=-1)  # [T, H, D]
    if not quantize:
        return y.to(o.dtype).reshape(t, n_groups, hpg * d), None
    blocks = y.reshape(t, h, d // _QUANT_GROUP, _QUANT_GROUP)
    ratio = blocks.abs().amax(dim=-1).clamp(min=_SCALE_FLOOR) * torch.tensor(1 / _FP8_MAX, dtype=torch.float32)
    e = torch.log2(ratio).ceil().to(torch.int32)  # fp32 log2, as the kernel's (and vLLM's)
    s = ((e + 127) << 23).view(torch.float32)  # [T, H, B]
    q = (blocks / s[..., None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).reshape(t, n_groups, hpg * d)
    if tma_aligned_scales:
        shifts = torch.arange(d // _QUANT_GROUP, dtype=torch.int32) * 8
        scale = ((e + 127) << shifts).sum(dim=-1, dtype=torch.int64).to(torch.int32)  # [T, H]
        return q, scale.reshape(t, n_groups, hpg)
    return q, s.reshape(t, n_groups, hpg * d // _QUANT_GROUP)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the inverse RoPE + FP8 quant (DeepGEMM ``wo_a`` path of the FlashMLA / FlashInfer backends).

    CUDA and XPU only: ROCm runs aiter's ``inverse_rope_group_quant`` instead; and not where FlashInfer's SM10x
    kernel fuses it into the attention output (:func:`warmreg_deepseek_v4.backends.flashinfer_rope_quant`).
    DeepSeek-V4.1: :func:`_register_v41`.
    """
    if model.v41:
        _register_v41(registry, model, config, platform)
        return
    tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
    if model.num_attention_heads % tp or model.o_groups % tp:
        raise warmreg.ConfigError(
            "serving.tensor_parallel_size",
            f"must divide num_attention_heads {model.num_attention_heads} and o_groups {model.o_groups} (got {tp})",
            plugin=PLUGIN,
        )
    kernel = InvRopeFP8Quant(
        num_heads=model.num_attention_heads // tp,
        n_groups=model.o_groups // tp,
        head_dim=model.head_dim,
        rope_dim=model.qk_rope_head_dim,
        dtype=model.dtype,
    )
    # Not where FlashInfer's SM10x kernel writes the rotated FP8 output itself (RopeQuant: backends.flashinfer_rope_quant).
    sparse = attention_backend(config) in SPARSE_BACKENDS and not flashinfer_rope_quant(model, config, platform)
    registry.add(kernel, when=(warmreg.is_cuda | warmreg.is_xpu) if sparse else False)


def _register_v41(
    registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """DeepSeek-V4.1 on CUDA: ``dsv41_o_proj`` (``models/deepseek_v41/nvidia/ops/o_proj.py``) of the FlashMLA and
    FlashInfer attention classes runs ``DeepseekV4GroupedWoA.grouped_forward``, V4's ``deep_gemm_fp8_o_proj``, which
    launches V4's ``fused_inv_rope_fp8_quant`` (re-exported verbatim by ``models/deepseek_v41/common/ops``) on the live
    heads with ``quant_group_size = einsum_recipe[2]`` and ``quantize`` for an e4m3 ``wo_a`` weight. Mega attention
    rotates and quantizes inside its kernel (no launch). Which ``wo_a`` a checkpoint gets:

    * plain FP8 (128x128 blocks): e4m3, recipe block 128 (the V4 keys);
    * MXFP8 (:attr:`.model.DSV4.mxfp8_checkpoint`) below SM100: Marlin's MXFP8 linear repacks the weight to int32
      (``prepare_mxfp8_layer_for_marlin``), so ``quantize`` is False (bf16 output for ``torch.bmm``);
    * MXFP8 on SM100 and newer: DeepGEMM's MXFP8 BMM sets ``weight_block_size [1, 32]``, so the quant group is 32,
      which this op does not build (its group is 128): not registered, a gap of issue 37;
    * bf16: ``quantize`` False.
    """
    from .v41 import attention_kind, tensor_parallel_size  # here: .v41 imports the op modules

    if not platform.is_cuda or attention_kind(config, model, platform) == "mega":
        return
    if model.mxfp8_checkpoint and platform.sm >= 100:
        return
    tp = tensor_parallel_size(config)
    kernel = InvRopeFP8Quant(
        num_heads=model.num_attention_heads // tp, n_groups=model.o_groups // tp, head_dim=model.head_dim,
        rope_dim=model.qk_rope_head_dim, dtype=model.dtype, quantize=model.fp8_checkpoint and not model.mxfp8_checkpoint,
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
