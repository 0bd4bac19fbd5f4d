"""Fused indexer Q RoPE + MXFP4 quant of the C4 indexer on an MXFP4 K cache (vLLM 0.33
``models/deepseek_v4/common/ops/fused_indexer_q.py``: ``FusedIndexerQRopeMxFp4TritonKernel``).

Grid ``(T, H)``, one program per token and head, over the head's ``D / 32`` blocks of 32 dims: the NoPE
blocks as they are, the RoPE blocks rotated (GPT-J interleaved pairs ``(e, o) = (x[2i], x[2i+1])`` of the last
``R = cos_sin_cache.shape[1]`` dims, ``c, s = cos_sin_cache[pos, i], cos_sin_cache[pos, R/2 + i]``)::

    e' = float32(bf16(e*c - o*s));   o' = float32(bf16(o*c + e*s))          (the NoPE part is not rounded)
    packed[t, h, 16b + j], scale[t, h, b] = MXFP4 of block b (see :mod:`._mxfp4`)
    w_out[t, h] = float32(index_weights[t, h]) * softmax_scale * head_scale   (no q-scale fold, unlike FP8)

Returns ``((packed uint8 [T, H, D/2], scale int32 [T, H]), w_out float32 [T, H])``: the four UE8M0 bytes of a head
viewed as one int32 (byte 0 lowest), as vLLM's wrapper returns them for DeepGEMM.

vLLM converts to E2M1 with PTX ``cvt.rn.satfinite.e2m1x2.f32``, which makes its kernel CUDA-only and
un-interpretable; this one computes the identical nibbles arithmetically (:func:`._mxfp4.e2m1_code`), so the
same binary logic runs under Triton's interpreter and on the GPU.

When it runs: the C4 indexer's ``_q_rope_quant`` with ``use_fp4_kv`` (``serving.indexer_kv_dtype`` resolving to
``"mxfp4"``, :func:`._serving.indexer_kv_dtype`), on CUDA, which for MXFP4 means the SM10x family. There vLLM
launches the CuTeDSL ``_INDEXER_Q_MXFP4_KERNEL`` when CuTeDSL is installed (``has_cutedsl()``) and this Triton
kernel otherwise, so it is registered unless the target says ``+cutedsl``, as the FP8 indexer Q is (a target
without ``+cutedsl`` warms the Triton fallback, the safe choice when nobody says which wheel runs). On ROCm the
MXFP4 Q is aiter's ``rocm_mxfp4_indexer_q_quant`` and on XPU a custom op: neither launches this kernel.
The ``weights_out`` dtype is float32: bf16 is only for DeepSeek-V4.1's sparse-logits indexer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_rope_cache, is_pow2, out_parts
from ._indexer_common import IndexerQBase, rope_pairs
from ._mxfp4 import MXFP4_BLOCK, mxfp4_quant, mxfp4_quant_reference
from ._quant import bf16_round
from ._serving import mxfp4_indexer
from .model import DSV4

__all__ = ["IndexerQMxfp4Key", "IndexerQRopeMxfp4", "indexer_q_rope_mxfp4_reference", "register"]


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "cos_sin_ptr", "weights_ptr"])
def _indexer_q_rope_mxfp4_kernel(
    q_ptr,
    positions_ptr,
    cos_sin_ptr,
    weights_ptr,
    packed_ptr,
    scale_ptr,
    w_out_ptr,
    q_stride_t,
    q_stride_h,
    weights_stride,
    cos_sin_stride,
    softmax_scale,
    head_scale,
    HEAD_DIM: tl.constexpr,  # index_head_dim (128): one program quantizes one whole head
    HALF_ROT: tl.constexpr,  # rope dims / 2 (32): the interleaved pairs rotated
    BLOCK: tl.constexpr,  # MXFP4 block (32 values per UE8M0 scale)
):
    NOPE: tl.constexpr = HEAD_DIM - 2 * HALF_ROT
    HALF: tl.constexpr = BLOCK // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = q_ptr + t * q_stride_t + h * q_stride_h
    out = (t * tl.num_programs(1) + h) * HEAD_DIM  # contiguous outputs: [T, H, D/2] bytes, [T, H, D/32] scales
    # NoPE blocks, quantized as they are
    nope_even, nope_odd = tl.split(tl.reshape(tl.load(row + tl.arange(0, NOPE)).to(tl.float32), (NOPE // 2, 2)))
    packed, scale = mxfp4_quant(tl.reshape(nope_even, (NOPE // BLOCK, HALF)), tl.reshape(nope_odd, (NOPE // BLOCK, HALF)))
    tl.store(packed_ptr + out // 2 + tl.arange(0, NOPE // 2), tl.reshape(packed, (NOPE // 2,)))
    tl.store(scale_ptr + out // BLOCK + tl.arange(0, NOPE // BLOCK), scale)
    # RoPE blocks: rotate the pairs, round through bf16, quantize
    rot = tl.load(row + NOPE + tl.arange(0, 2 * HALF_ROT)).to(tl.float32)
    even, odd = tl.split(tl.reshape(rot, (HALF_ROT, 2)))
    cs = cos_sin_ptr + tl.load(positions_ptr + t) * cos_sin_stride + tl.arange(0, HALF_ROT)
    cos = tl.load(cs)
    sin = tl.load(cs + HALF_ROT)
    even_r = tl.reshape(bf16_round(even * cos - odd * sin), (2 * HALF_ROT // BLOCK, HALF))
    odd_r = tl.reshape(bf16_round(odd * cos + even * sin), (2 * HALF_ROT // BLOCK, HALF))
    packed, scale = mxfp4_quant(even_r, odd_r)
    tl.store(packed_ptr + (out + NOPE) // 2 + tl.arange(0, HALF_ROT), tl.reshape(packed, (HALF_ROT,)))
    tl.store(scale_ptr + (out + NOPE) // BLOCK + tl.arange(0, 2 * HALF_ROT // BLOCK), scale)
    w = tl.load(weights_ptr + t * weights_stride + h).to(tl.float32)
    tl.store(w_out_ptr + t * tl.num_programs(1) + h, w * softmax_scale * head_scale)


@attrs.frozen(kw_only=True)
class IndexerQMxfp4Key(warmreg.CompileKey):
    """What changes the binary of the indexer Q RoPE + MXFP4 quant."""

    dtype: str  # index_q dtype (bfloat16: also the RoPE round-trip dtype)
    weights_dtype: str
    weights_out_dtype: str  # float32 for DeepSeek-V4 (bf16 only for V4.1's sparse logits)
    head_dim: int
    rope_dim: int
    block: int  # MXFP4 block (32)
    q_stride_t: str  # int classes of the specialized strides
    q_stride_h: str
    weights_stride: str
    cos_sin_stride: str
    q_aligned: bool
    num_warps: int
    enable_fp_fusion: bool


class IndexerQRopeMxfp4(IndexerQBase[IndexerQMxfp4Key]):
    """Indexer Q RoPE + MXFP4 quant, weights scaled but not q-scaled (see the module docstring; the parameters
    are :class:`~._indexer_common.IndexerQBase`'s)."""

    name = "deepseek_v4.indexer_q_rope_mxfp4"
    key_type = IndexerQMxfp4Key
    jit = _indexer_q_rope_mxfp4_kernel

    def dispatch(
        self, *, index_q: torch.Tensor, index_weights: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> IndexerQMxfp4Key:
        fields = self.q_key_fields(index_q, index_weights, cos_sin_cache)
        return IndexerQMxfp4Key(**fields, weights_out_dtype="float32", block=MXFP4_BLOCK)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return self.q_domains(config)

    def warmup_inputs(self, key: IndexerQMxfp4Key) -> Mapping[str, Any]:
        return self.q_warmup_inputs(key)

    def _check_blocks(self, head_dim: int, rope: int) -> None:
        nope = head_dim - rope
        if not (is_pow2(nope) and is_pow2(rope) and nope % MXFP4_BLOCK == 0 and rope % MXFP4_BLOCK == 0):
            raise warmreg.LaunchError(
                self.name,
                f"the NoPE ({nope}) and RoPE ({rope}) dims must be powers of two and multiples of {MXFP4_BLOCK} "
                "(whole MXFP4 blocks on each side)",
            )
        if head_dim % (4 * MXFP4_BLOCK):
            raise warmreg.LaunchError(
                self.name, f"head_dim {head_dim} must be a multiple of {4 * MXFP4_BLOCK} (4 scale bytes per int32 word)"
            )

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
        out: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[IndexerQMxfp4Key]:
        """RoPE and MXFP4-quantize ``index_q [T, H, D]``; returns ``((packed, scale), w_out)`` (fresh, or ``out``).

        :param positions: int64 ``[T]``.
        :param index_q: bfloat16 ``[T, H, D]`` with a contiguous last dim (token and head strides are passed).
        :param cos_sin_cache: float32 ``[P, R]``: ``R/2`` cosines then ``R/2`` sines per position.
        :param index_weights: ``[T, H]`` with a contiguous last dim.
        :param softmax_scale: ``D**-0.5``, folded into ``w_out``.
        :param head_scale: ``H**-0.5``, folded into ``w_out``.
        :param out: the outputs to write instead of fresh ones, nested as returned: exactly ``packed``, ``scale``
            (int32, as returned) and ``w_out`` below, contiguous, 16-byte aligned.
        :returns: ``packed`` uint8 ``[T, H, D/2]``, ``scale`` the UE8M0 bytes ``[T, H, D/32]`` viewed as int32
            ``[T, H, D/128]`` (``[T, H]`` for ``D = 128``), ``w_out`` float32 ``[T, H]``.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve, or an ``out`` unlike
            the fresh outputs.
        """
        self.check_q_inputs(positions, index_q, index_weights)
        check_rope_cache(self.name, cos_sin_cache, index_q.shape[-1])
        self._check_blocks(index_q.shape[-1], cos_sin_cache.shape[-1])
        key = self.dispatch(index_q=index_q, index_weights=index_weights, cos_sin_cache=cos_sin_cache)
        t, h, d = index_q.shape
        dev = index_q.device
        out_pair, out_w = out_parts(self.name, out, 2)
        out_p, out_s = out_parts(self.name, out_pair, 2, "out[0]")
        words = d // (4 * MXFP4_BLOCK)  # int32 words of 4 scale bytes per head
        packed = warmreg.output(self.name, "out[0][0]", out_p, (t, h, d // 2), torch.uint8, dev)
        scale = warmreg.output(self.name, "out[0][1]", out_s, (t, h) if words == 1 else (t, h, words), torch.int32, dev)
        w_out = warmreg.output(self.name, "out[1]", out_w, (t, h), torch.float32, dev)
        kwargs = dict(
            q_ptr=index_q, positions_ptr=positions, cos_sin_ptr=cos_sin_cache, weights_ptr=index_weights,
            packed_ptr=packed, scale_ptr=scale.view(torch.uint8), w_out_ptr=w_out, q_stride_t=index_q.stride(0),
            q_stride_h=index_q.stride(1), weights_stride=index_weights.stride(0), cos_sin_stride=cos_sin_cache.stride(0),
            softmax_scale=float(softmax_scale), head_scale=float(head_scale), HEAD_DIM=key.head_dim,
            HALF_ROT=key.rope_dim // 2, BLOCK=key.block,
        )  # fmt: skip
        grid = (t, h) if t and h else None
        return warmreg.LaunchSpec(key, grid, kwargs, ((packed, scale), w_out))


def indexer_q_rope_mxfp4_reference(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """PyTorch reference of :class:`IndexerQRopeMxfp4`: ``((packed, scale int32 view), w_out)``."""
    rope = cos_sin_cache.shape[1]
    x = index_q.float()
    cs = cos_sin_cache[positions][:, None, :]
    rot = rope_pairs(x[..., -rope:], cs[..., : rope // 2], cs[..., rope // 2 :])
    packed, scale = mxfp4_quant_reference(torch.cat([x[..., :-rope], rot.to(torch.bfloat16).float()], dim=-1))
    f32 = torch.float32
    w = index_weights.float() * torch.tensor(softmax_scale, dtype=f32) * torch.tensor(head_scale, dtype=f32)
    return (packed, scale.view(torch.int32).squeeze(-1)), w


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MXFP4 indexer Q when the C4 indexer runs on an MXFP4 K cache on CUDA (SM10x; see
    :func:`._serving.indexer_kv_dtype`), unless CuTeDSL replaces it (``+cutedsl``).

    :raises warmreg.ConfigError: for a ``serving.indexer_kv_dtype`` the platform cannot serve.
    """
    kernel = IndexerQRopeMxfp4(
        num_heads=model.index_n_heads, head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, dtype=model.dtype
    )
    triton_q = warmreg.is_cuda & ~warmreg.has_feature("cutedsl")
    registry.add(kernel, when=triton_q if mxfp4_indexer(config, model, platform) else False)
