"""ROCm DeepSeek-V4 inverse GPT-J RoPE of the attention output, written as bf16 (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_inverse_rope_gptj_kernel``, launched by ``_fused_inverse_rope_gptj``
from ``rocm_inverse_rope_rows_`` (in place) and ``rocm_inv_rope_einsum`` (a fresh output)).

Attention leaves each head of ``o [T, H, D]`` (``D = 448 NoPE + 64 RoPE``) rotated by its position; before the
grouped ``wo_a`` projection the trailing ``R = rope_head_dim`` lanes are rotated back. For token ``t`` at position
``p = positions[t]``, head ``h``, pair ``k < R / 2`` (``a, b`` the even and odd lane, fp32;
``c, s = cos_sin_cache[p, k], cos_sin_cache[p, R/2 + k]``, the fp32 cache ``[P, R]``, cosines then sines)::

    out[t, h, :D - R]            = bf16(o[t, h, :D - R])
    out[t, h, D - R + 2k]        = bf16(a * c + b * s)
    out[t, h, D - R + 2k + 1]    = bf16(b * c - a * s)

Grid ``(T, H)``, a program a (token, head), as in vLLM. ``out`` may be ``o`` itself: a program reads both lanes of a
pair before it stores either.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention.forward_mqa`` (``models/deepseek_v4/amd/rocm.py``) of every layer on
every step with rows the attention did not rotate (``fuse_inv_rope``: the BF16 ``wo_a`` path) calls
``rocm_inverse_rope_rows_(output[rotated:end, :n_local_heads], positions[rotated:end], rotary_emb.cos_sin_cache,
rope_head_dim)``. The in-tree sparse decode rotates its rows in the reduce epilogue (on gfx942 and gfx950), aiter's
sparse MLA its decode and prefill rows; so the rows left are the prefill rows of the in-tree prefill (any ROCm
deployment unless prefill takes aiter's sparse MLA, :func:`._rocm_attention.aiter_sparse_mla_prefill`). With the FP8
``wo_a`` path (``_prepare_fp8_wo_a``: gfx950, aiter, ``VLLM_ROCM_USE_AITER_FP8BMM=1`` and a block-scaled FP8 ``wo_a``,
an FP8 checkpoint) aiter's ``inverse_rope_group_quant`` rotates instead and this kernel never runs; the environment
variable is the target feature ``+aiter_fp8bmm`` (:data:`FP8BMM_FEATURE`). DeepSeek-V4's ``_o_proj`` calls
``rocm_inv_rope_einsum`` with ``inverse_rope=False`` (no launch).

Key: the input and position dtypes, the NoPE width and half the RoPE width with their power-of-two blocks (vLLM's
constexprs) and the warps (Triton's default, 4). The strides are runtime ints (``do_not_specialize``; vLLM specializes
them) and the positions are not specialized on alignment (a row slice); ``o`` and ``out`` rows start at whole rows of a
``[T, H, D]`` buffer (``D * 2`` bytes a head row: aligned). Buffers are far below 2 GB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._rocm_attention import aiter_sparse_mla_prefill
from ._serving import serving_int
from .model import DSV4, fp8_checkpoint

__all__ = [
    "FP8BMM_FEATURE",
    "RocmInverseRope",
    "RocmInverseRopeKey",
    "fp8_wo_a",
    "register",
    "rocm_inverse_rope_reference",
]

#: The target feature for ``VLLM_ROCM_USE_AITER_FP8BMM=1`` (an environment variable, not part of ``VllmConfig``).
FP8BMM_FEATURE = "aiter_fp8bmm"
_NUM_WARPS = 4  # Triton's default: vLLM passes none


@triton.jit(do_not_specialize=["s_t", "s_h", "os_t", "os_h", "cs_stride"], do_not_specialize_on_alignment=["pos_ptr"])
def _rocm_inverse_rope_kernel(
    o_ptr,
    out_ptr,
    pos_ptr,
    cos_sin_ptr,
    s_t,
    s_h,
    os_t,
    os_h,
    cs_stride,
    NOPE: tl.constexpr,  # lanes passed through (cast only)
    HALF: tl.constexpr,  # RoPE pairs: rope_head_dim // 2
    BLOCK_NOPE: tl.constexpr,  # next_pow2(NOPE)
    BLOCK_HALF: tl.constexpr,  # next_pow2(HALF)
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    src = o_ptr + t * s_t + h * s_h
    dst = out_ptr + t * os_t + h * os_h
    n = tl.arange(0, BLOCK_NOPE)
    tl.store(dst + n, tl.load(src + n, mask=n < NOPE).to(tl.bfloat16), mask=n < NOPE)
    k = tl.arange(0, BLOCK_HALF)
    live = k < HALF
    row = cos_sin_ptr + tl.load(pos_ptr + t).to(tl.int64) * cs_stride
    even = tl.load(src + NOPE + 2 * k, mask=live).to(tl.float32)
    odd = tl.load(src + NOPE + 2 * k + 1, mask=live).to(tl.float32)
    cos = tl.load(row + k, mask=live)
    sin = tl.load(row + HALF + k, mask=live)
    tl.store(dst + NOPE + 2 * k, (even * cos + odd * sin).to(tl.bfloat16), mask=live)
    tl.store(dst + NOPE + 2 * k + 1, (odd * cos - even * sin).to(tl.bfloat16), mask=live)


@attrs.frozen(kw_only=True)
class RocmInverseRopeKey(warmreg.CompileKey):
    """What changes the binary of the inverse RoPE: dtypes, the widths and their blocks, the warps."""

    dtype: str
    pos_dtype: str
    nope: int
    half: int
    block_nope: int
    block_half: int
    num_warps: int


class RocmInverseRope(warmreg.TritonKernel[RocmInverseRopeKey]):
    """Inverse GPT-J RoPE of the attention output's RoPE lanes, bf16 out (see the module docstring)."""

    name = "deepseek_v4.rocm_inverse_rope"
    key_type = RocmInverseRopeKey
    jit = _rocm_inverse_rope_kernel

    def dispatch(self, *, o: torch.Tensor, positions: torch.Tensor, rope_head_dim: int) -> RocmInverseRopeKey:
        nope, half = o.shape[-1] - rope_head_dim, rope_head_dim // 2
        return RocmInverseRopeKey(
            dtype=warmreg.dtype_name(o.dtype), pos_dtype=warmreg.dtype_name(positions.dtype), nope=nope, half=half,
            block_nope=warmreg.next_pow2(nope), block_half=warmreg.next_pow2(half), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        return {  # the attention output is the model's dtype (bf16); vLLM's positions are int64
            "o": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "positions": [warmreg.meta((1,), torch.int64)],
            "rope_head_dim": [model.qk_rope_head_dim],
        }

    def warmup_inputs(self, key: RocmInverseRopeKey) -> Mapping[str, Any]:
        rope = 2 * key.half
        return {
            "o": warmreg.meta((1, 1, key.nope + rope), getattr(torch, key.dtype)),
            "positions": warmreg.meta((1,), getattr(torch, key.pos_dtype)),
            "cos_sin_cache": warmreg.meta((1, rope), torch.float32),
            "rope_head_dim": rope,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        o: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        rope_head_dim: int,
        inplace: bool = False,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RocmInverseRopeKey]:
        """The rotated-back output, bf16 ``[T, H, D]``: ``o`` itself with ``inplace`` (``rocm_inverse_rope_rows_``),
        else fresh or ``out`` (``rocm_inv_rope_einsum``'s ``_fused_inverse_rope_gptj(o, ...)``).

        :param o: ``[T, H, D]`` attention output (bf16 in vLLM; any float dtype), last dim contiguous, any row and
            head strides (vLLM passes ``output[rotated:end, :n_local_heads]``); bf16 when ``inplace``.
        :param positions: int32 or int64 ``[>= T]`` positions (contiguous).
        :param cos_sin_cache: float32 ``[P, rope_head_dim]``: cosines then sines, last dim contiguous.
        :param rope_head_dim: the RoPE lanes at the end of each head: even, positive, below ``D``.
        :param inplace: write into ``o``.
        :param out: a buffer to write instead of a fresh one (not with ``inplace``), exactly as it would be allocated.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, widths or layouts, or an ``out`` unlike the fresh one.
        """
        self._check(o, positions, cos_sin_cache, rope_head_dim, inplace, out)
        key = self.dispatch(o=o, positions=positions, rope_head_dim=rope_head_dim)
        if inplace:
            result = o
        else:
            result = warmreg.output(self.name, "out", out, tuple(o.shape), torch.bfloat16, o.device)
        kwargs = dict(
            o_ptr=o, out_ptr=result, pos_ptr=positions, cos_sin_ptr=cos_sin_cache, s_t=o.stride(0), s_h=o.stride(1),
            os_t=result.stride(0), os_h=result.stride(1), cs_stride=cos_sin_cache.stride(0), NOPE=key.nope,
            HALF=key.half, BLOCK_NOPE=key.block_nope, BLOCK_HALF=key.block_half,
        )  # fmt: skip
        grid = (o.shape[0], o.shape[1]) if o.shape[0] and o.shape[1] else None
        return warmreg.LaunchSpec(key, grid, kwargs, result)

    def _check(
        self,
        o: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        rope_head_dim: int,
        inplace: bool,
        out: torch.Tensor | None,
    ) -> None:
        if not o.dtype.is_floating_point or o.ndim != 3 or o.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"o must be a float [T, H, D] tensor with a contiguous last dim (got "
                                      f"{o.dtype} {tuple(o.shape)}, strides {o.stride()})")  # fmt: skip
        if rope_head_dim <= 0 or rope_head_dim % 2 or rope_head_dim >= o.shape[2]:
            raise warmreg.LaunchError(self.name, f"rope_head_dim must be even, positive and below D = {o.shape[2]} "
                                      f"(got {rope_head_dim})")  # fmt: skip
        if (
            positions.dtype not in (torch.int32, torch.int64)
            or positions.ndim != 1
            or positions.shape[0] < o.shape[0]
            or (positions.shape[0] > 1 and positions.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"positions must be a contiguous int32 or int64 [>= {o.shape[0]}] "
                                      f"tensor (got {positions.dtype} {tuple(positions.shape)})")  # fmt: skip
        if (
            cos_sin_cache.dtype != torch.float32
            or cos_sin_cache.ndim != 2
            or cos_sin_cache.shape[1] != rope_head_dim
            or cos_sin_cache.stride(1) != 1
        ):
            raise warmreg.LaunchError(self.name, f"cos_sin_cache must be float32 [P, {rope_head_dim}] with a contiguous "
                                      f"last dim (got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)})")  # fmt: skip
        if inplace and (o.dtype != torch.bfloat16 or out is not None):
            raise warmreg.LaunchError(self.name, f"inplace writes bf16 into o: o must be bf16 (got {o.dtype}) and out "
                                      "left out")  # fmt: skip


def rocm_inverse_rope_reference(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, rope_head_dim: int
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmInverseRope` (out of place): bf16 ``[T, H, D]``."""
    nope, half = o.shape[-1] - rope_head_dim, rope_head_dim // 2
    cs = cos_sin_cache[positions[: o.shape[0]].long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = o.float()
    even, odd = x[..., nope::2], x[..., nope + 1 :: 2]
    rot = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    return torch.cat((o[..., :nope].to(torch.bfloat16), rot.to(torch.bfloat16)), dim=-1)


def fp8_wo_a(config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether ROCm's ``wo_a`` runs aiter's FP8 path (``_prepare_fp8_wo_a``): gfx950 with ``+aiter`` and
    ``+aiter_fp8bmm`` (``VLLM_ROCM_USE_AITER_FP8BMM``) on an FP8 (block-scaled) checkpoint."""
    on = warmreg.rocm_arch_in("gfx950") & warmreg.has_feature("aiter") & warmreg.has_feature(FP8BMM_FEATURE)
    return on(platform) and fp8_checkpoint(config)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the inverse RoPE on ROCm where prefill rows owe it: the in-tree prefill on the BF16 ``wo_a`` path (see
    the module docstring)."""
    on = not aiter_sparse_mla_prefill(config, model, platform) and not fp8_wo_a(config, platform)
    registry.add(RocmInverseRope(), when=warmreg.is_rocm if on else False)
