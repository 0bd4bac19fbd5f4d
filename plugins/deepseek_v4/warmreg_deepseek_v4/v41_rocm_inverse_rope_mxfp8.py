"""DeepSeek-V4.1's inverse GPT-J RoPE of the prefill attention rows on gfx950, MXFP8-quantized for ``wo_a`` (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``rocm_inverse_rope_mxfp8_rows`` / ``_inverse_rope_mxfp8_quant_kernel``
with its ``_mxfp8_quantize_rows`` and ``_mxfp8_scale_bits``).

For token ``t`` at position ``p = positions[t]`` and head ``h`` of ``o [T, H, D]`` (bf16, ``D = N + R``: ``N`` NoPE
then ``R = rope_head_dim`` RoPE lanes), every lane pair ``(a, b) = (x[2i], x[2i+1])`` in fp32 is rotated back, the
NoPE pairs with ``cos = 1, sin = 0`` (one expression for the whole row, as in :mod:`.rocm_inverse_rope`, which writes
the bf16 variant; here nothing is rounded to bf16)::

    y[2i], y[2i+1] = a * c + b * s, b * c - a * s        # c, s = cos_sin_cache[p, k], cos_sin_cache[p, R/2 + k]
                                                          # for k = i - N/2 >= 0, else 1, 0
    e[t, h*D/32 + g] = clamp(ceil(log2(max(amax_g, 2^-126) / 448)) + 127, 0, 254)   # amax over 32 lanes of y
    data[t, h*D + j] = e4m3(y[j] * 2^(127 - e))                                        # uint8 E8M0 scale bytes

Grid ``(T, H)``, a program a (token, head), 4 warps, as in vLLM.

Where it runs: ``DeepseekV41ROCMAiterMLAAttention`` (``models/deepseek_v41/amd/rocm.py``) on gfx950 allocates the
attention output as ``wo_a``'s MXFP8 input (``_alloc_attn_out``: ``_ON_GFX950``); the decode reduce writes its rows,
and ``_forward_prefill`` (the in-tree prefill: not under ``VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA``, the
``+aiter_sparse_mla`` feature, whose prefill stores the rows itself) attends into bf16 rows
``[num_prefill_tokens, n_local_heads, head_dim]`` and calls ``rocm_inverse_rope_mxfp8_rows(output, positions,
rotary_emb.cos_sin_cache, rope_head_dim, mxfp8_out[0][:T], mxfp8_out[1][:T])``: every layer of every step with prefill
tokens. vLLM's positions are int64 and the rotary cache fp32.

Key: the head width, the NoPE width and half the RoPE width (vLLM's constexprs), the dtypes and the warps. The strides
are runtime ints (``do_not_specialize``; vLLM specializes them) and the positions are not specialized on alignment (a
row slice); the outputs are whole rows of ``[T, H * D]`` buffers (aligned).
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
from ._serving import serving_int
from .model import DSV4

__all__ = ["RocmInverseRopeMxfp8", "RocmInverseRopeMxfp8Key", "inverse_rope_mxfp8_reference", "register"]

_NUM_WARPS = 4  # vLLM's num_warps=4
_GROUP = 32  # lanes an E8M0 scale covers
_INTS = ["s_t", "s_h", "qs_t", "ss_t", "cs_stride"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["pos_ptr"])
def _inverse_rope_mxfp8_kernel(
    o_ptr,  # [T, H, D] bf16, last dim contiguous
    data_ptr,  # [T, H * D] e4m3
    scale_ptr,  # [T, H * D / 32] uint8 E8M0
    pos_ptr,  # [>= T]
    cos_sin_ptr,  # [P, R] fp32: cosines, then sines
    s_t,
    s_h,
    qs_t,
    ss_t,
    cs_stride,
    D: tl.constexpr,  # head_dim: one head row is one tile
    NOPE: tl.constexpr,  # D - R: the pairs that keep cos 1, sin 0
    HALF: tl.constexpr,  # R / 2: where the sines start in a cache row
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, D // 2)
    row = o_ptr + t * s_t + h * s_h
    a = tl.load(row + 2 * i).to(tl.float32)
    b = tl.load(row + 2 * i + 1).to(tl.float32)
    p = tl.load(pos_ptr + t).to(tl.int64)
    k = i - NOPE // 2
    rope = k >= 0
    k = tl.where(rope, k, 0)
    c = tl.where(rope, tl.load(cos_sin_ptr + p * cs_stride + k), 1.0)
    s = tl.where(rope, tl.load(cos_sin_ptr + p * cs_stride + HALF + k), 0.0)
    ya = tl.reshape(a * c + b * s, (D // 32, 16))  # the even lanes of each 32-lane block
    yb = tl.reshape(b * c - a * s, (D // 32, 16))
    amax = tl.maximum(tl.max(tl.abs(ya), axis=1), tl.max(tl.abs(yb), axis=1))
    amax = tl.maximum(amax, 1.1754943508222875e-38)
    bits = tl.minimum(tl.maximum(tl.ceil(tl.log2(amax / 448.0)) + 127.0, 0.0), 254.0)
    mult = tl.exp2(127.0 - bits)[:, None]  # the reciprocal: a 2^-127 divisor would flush to zero
    out = data_ptr + t * qs_t + h * D + 2 * tl.reshape(i, (D // 32, 16))
    tl.store(out, (ya * mult).to(data_ptr.dtype.element_ty))
    tl.store(out + 1, (yb * mult).to(data_ptr.dtype.element_ty))
    tl.store(scale_ptr + t * ss_t + h * (D // 32) + tl.arange(0, D // 32), bits.to(tl.uint8))


@attrs.frozen(kw_only=True)
class RocmInverseRopeMxfp8Key(warmreg.CompileKey):
    """What changes the binary: the widths, the dtypes and the warps."""

    head_dim: int
    nope: int
    half: int
    dtype: str  # o
    data_dtype: str
    pos_dtype: str
    cos_sin_dtype: str
    num_warps: int


class RocmInverseRopeMxfp8(warmreg.TritonKernel[RocmInverseRopeMxfp8Key]):
    """Inverse RoPE of the attention rows, MXFP8-quantized for ``wo_a`` (see the module docstring)."""

    name = "deepseek_v4.v41_rocm_inverse_rope_mxfp8"
    key_type = RocmInverseRopeMxfp8Key
    jit = _inverse_rope_mxfp8_kernel

    def dispatch(
        self, *, o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_head_dim: int
    ) -> RocmInverseRopeMxfp8Key:
        d = o.shape[-1]
        return RocmInverseRopeMxfp8Key(
            head_dim=d, nope=d - rope_head_dim, half=rope_head_dim // 2, dtype=warmreg.dtype_name(o.dtype),
            data_dtype="float8_e4m3fn", pos_dtype=warmreg.dtype_name(positions.dtype),
            cos_sin_dtype=warmreg.dtype_name(cos_sin_cache.dtype), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        return {  # bf16 attention rows, int64 positions, the fp32 rotary cache
            "o": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "positions": [warmreg.meta((1,), torch.int64)],
            "cos_sin_cache": [warmreg.meta((1, model.qk_rope_head_dim), torch.float32)],
            "rope_head_dim": [model.qk_rope_head_dim],
        }

    def warmup_inputs(self, key: RocmInverseRopeMxfp8Key) -> Mapping[str, Any]:
        return {
            "o": warmreg.meta((1, 1, key.head_dim), getattr(torch, key.dtype)),
            "positions": warmreg.meta((1,), getattr(torch, key.pos_dtype)),
            "cos_sin_cache": warmreg.meta((1, 2 * key.half), getattr(torch, key.cos_sin_dtype)),
            "rope_head_dim": 2 * key.half,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        o: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        rope_head_dim: int,
        out: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    ) -> warmreg.LaunchSpec[RocmInverseRopeMxfp8Key]:
        """``(data, scale)``: e4m3 ``[T, H * D]`` and uint8 E8M0 ``[T, H * D / 32]`` (fresh, or ``out``: vLLM's
        ``mxfp8_out`` row slices).

        :param o: bf16 (any float) ``[T, H, D]``, last dim contiguous, any row and head strides; ``D`` a multiple of
            32 whose half is a power of two.
        :param positions: int32 or int64 ``[>= T]``, contiguous.
        :param cos_sin_cache: fp32 ``[P, rope_head_dim]``, last dim contiguous: cosines, then sines.
        :param rope_head_dim: the RoPE lanes at the end of each head: even, positive, at most ``D``.
        :param out: ``(data, scale)`` buffers exactly as they would be allocated (either may be None).
        :raises warmreg.LaunchError: naming the argument whose dtype, rank, width or layout does not fit.
        """
        self._check(o, positions, cos_sin_cache, rope_head_dim)
        key = self.dispatch(o=o, positions=positions, cos_sin_cache=cos_sin_cache, rope_head_dim=rope_head_dim)
        t, h, d = o.shape
        out_data, out_scale = out_parts(self.name, out, 2)
        data = warmreg.output(self.name, "out[0]", out_data, (t, h * d), torch.float8_e4m3fn, o.device)
        scale = warmreg.output(self.name, "out[1]", out_scale, (t, h * d // _GROUP), torch.uint8, o.device)
        kwargs = dict(
            o_ptr=o, data_ptr=data, scale_ptr=scale, pos_ptr=positions, cos_sin_ptr=cos_sin_cache, s_t=o.stride(0),
            s_h=o.stride(1), qs_t=data.stride(0), ss_t=scale.stride(0), cs_stride=cos_sin_cache.stride(0), D=d,
            NOPE=key.nope, HALF=key.half,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, h) if t and h else None, kwargs, (data, scale))

    def _check(self, o: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope: int) -> None:
        if not o.dtype.is_floating_point or o.ndim != 3 or o.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"o must be a float [T, H, D] tensor with a contiguous last dim (got "
                                      f"{o.dtype} {tuple(o.shape)}, strides {o.stride()})")  # fmt: skip
        d = o.shape[2]
        if d % _GROUP or (d // 2) & (d // 2 - 1):
            raise warmreg.LaunchError(self.name, f"o's head dim must be a multiple of 32 and twice a power of two "
                                      f"(got {d})")  # fmt: skip
        if rope <= 0 or rope % 2 or rope > d:
            raise warmreg.LaunchError(
                self.name, f"rope_head_dim must be even, positive and at most D = {d} (got {rope})"
            )
        if (
            positions.dtype not in (torch.int32, torch.int64)
            or positions.ndim != 1
            or positions.shape[0] < o.shape[0]
            or (positions.shape[0] > 1 and positions.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"positions must be a contiguous int32 or int64 [>= {o.shape[0]}] "
                                      f"tensor (got {positions.dtype} {tuple(positions.shape)})")  # fmt: skip
        if cos_sin.dtype != torch.float32 or cos_sin.ndim != 2 or cos_sin.shape[1] != rope or cos_sin.stride(1) != 1:
            raise warmreg.LaunchError(self.name, f"cos_sin_cache must be float32 [P, {rope}] with a contiguous last "
                                      f"dim (got {cos_sin.dtype} {tuple(cos_sin.shape)})")  # fmt: skip


def inverse_rope_mxfp8_reference(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, rope_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmInverseRopeMxfp8`: ``(e4m3 [T, H * D], uint8 [T, H * D / 32])``, the
    module docstring's math (e4m3 rounded to nearest even by torch)."""
    t, h, d = o.shape
    nope, half = d - rope_head_dim, rope_head_dim // 2
    cs = cos_sin_cache[positions[:t].long()].float()
    ones, zeros = torch.ones(t, nope // 2), torch.zeros(t, nope // 2)
    cos = torch.cat((ones, cs[:, :half]), 1)[:, None]
    sin = torch.cat((zeros, cs[:, half:]), 1)[:, None]
    x = o.float()
    a, b = x[..., 0::2], x[..., 1::2]
    y = torch.stack((a * cos + b * sin, b * cos - a * sin), -1).reshape(t, h * d // _GROUP, _GROUP)
    amax = y.abs().amax(-1).clamp(min=1.1754943508222875e-38)
    bits = (torch.ceil(torch.log2(amax / 448.0)) + 127.0).clamp(0.0, 254.0)
    q = (y * torch.exp2(127.0 - bits)[..., None]).reshape(t, h * d)
    return q.to(torch.float8_e4m3fn), bits.to(torch.uint8)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the op for V4.1 on gfx950 where prefill attends in-tree (not aiter's sparse MLA): see the module
    docstring."""
    on = model.v41 and not aiter_sparse_mla(platform)
    registry.add(RocmInverseRopeMxfp8(), when=warmreg.rocm_arch_in("gfx950") if on else False)
