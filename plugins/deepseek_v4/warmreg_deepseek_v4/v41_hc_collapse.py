"""DeepSeek-V4.1's mHC head collapse (vLLM 0.34 ``model_executor/kernels/mhc/triton.py``: ``hc_collapse_triton`` /
``_hc_head_reduce_store_kernel``).

After the last decoder layer, the ``hc_mult`` residual streams ``x`` ``[T, N, H]`` (bf16) collapse into one hidden
row with the last layer's FFN pre-mix ``pre`` ``[T, N]`` (fp32) - V4.1 has no learned ``hc_head``::

    acc = 0 (fp32);  for n < N:  acc = acc + f32(pre[t, n]) * f32(x[t, n, h])      (in stream order)
    out[t, h] = bf16(acc)

The multiply and the add stay separate fp32 operations (vLLM launches with ``enable_fp_fusion=False`` to match its
Torch reference; with fusion a GPU would contract them into an FMA, another binary and other bits). ``out`` is a fresh
contiguous ``[T, H]`` bf16 tensor. Grid ``(T, cdiv(H, 1024))``, 1024 columns a program, four warps, as in vLLM.

Where it runs: every V4.1 CUDA deployment, every step on the last pipeline rank: ``DeepseekV4Model.forward``
(``models/deepseek_v41/nvidia/model.py``) collapses the streams before the final norm; the DSpark draft
(``nvidia/dspark.py``) and specialized decode (``specialized_decode/runtime/decode.py``) call the same function on
the same widths. ``x`` comes from ``mhc_post_tilelang`` (or the replay layers) and ``pre`` from the last
``mhc_shifted_post_pre``: both fresh contiguous tensors, so a deployment launches one key.

Key: ``H``, ``N`` and the five input strides (constexprs in vLLM's kernel, as ``out``'s are: a strided view is
another binary), the tile, the warps and ``enable_fp_fusion``. The dtypes are fixed (vLLM asserts bf16 streams and
fp32 mixes); no runtime integer reaches the kernel, so the token count never changes the binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4, PLUGIN

__all__ = ["HcCollapse", "HcCollapseKey", "hc_collapse_reference", "register"]

_BLOCK_H = 1024
_NUM_WARPS = 4


@triton.jit
def _hc_collapse_kernel(
    pre_ptr,  # [T, N] fp32, strides (PRE_T, PRE_N)
    x_ptr,  # [T, N, H] bf16, strides (X_T, X_N, X_H)
    out_ptr,  # [T, H] bf16, strides (OUT_T, OUT_H)
    H: tl.constexpr,  # hidden_size: a model constant
    N: tl.constexpr,  # hc_mult: the stream count, unrolled
    PRE_T: tl.constexpr,  # vLLM passes every stride as a constexpr
    PRE_N: tl.constexpr,
    X_T: tl.constexpr,
    X_N: tl.constexpr,
    X_H: tl.constexpr,
    OUT_T: tl.constexpr,
    OUT_H: tl.constexpr,
    BLOCK_H: tl.constexpr,  # columns a program
):
    t = tl.program_id(0).to(tl.int64)  # T * N * H can exceed 2**31
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for n in tl.static_range(N):
        weight = tl.load(pre_ptr + t * PRE_T + n * PRE_N).to(tl.float32)
        row = tl.load(x_ptr + t * X_T + n * X_N + h * X_H, mask=live, other=0.0).to(tl.float32)
        acc += weight * row
    tl.store(out_ptr + t * OUT_T + h * OUT_H, acc, mask=live)


@attrs.frozen(kw_only=True)
class HcCollapseKey(warmreg.CompileKey):
    """What changes the binary of the collapse: the widths, the input strides (``out`` is always a contiguous
    ``[T, H]``: its strides ``(H, 1)`` follow from ``hidden``), the tile and the launch options."""

    hidden: int
    hc_mult: int
    pre_stride_t: int
    pre_stride_n: int
    x_stride_t: int
    x_stride_n: int
    x_stride_h: int
    block_h: int
    num_warps: int
    enable_fp_fusion: bool


class HcCollapse(warmreg.TritonKernel[HcCollapseKey]):
    """The weighted sum of the ``hc_mult`` residual streams (the module docstring has the math).

    :param hidden_size: the model's ``hidden_size`` (domains only).
    :param hc_mult: the model's ``hc_mult`` (domains only).
    """

    name = "deepseek_v4.v41_hc_collapse"
    key_type = HcCollapseKey
    jit = _hc_collapse_kernel

    def __init__(self, *, hidden_size: int, hc_mult: int) -> None:
        self.hidden_size, self.hc_mult = hidden_size, hc_mult

    def dispatch(self, *, x: torch.Tensor, pre_mix: torch.Tensor) -> HcCollapseKey:
        _, n, h = x.shape
        return HcCollapseKey(
            hidden=h, hc_mult=n, pre_stride_t=pre_mix.stride(0), pre_stride_n=pre_mix.stride(1),
            x_stride_t=x.stride(0), x_stride_n=x.stride(1), x_stride_h=x.stride(2), block_h=_BLOCK_H, num_warps=_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        n, h = self.hc_mult, self.hidden_size
        return [
            {"x": warmreg.meta((t, n, h), torch.bfloat16), "pre_mix": warmreg.meta((t, n), torch.float32)}
            for t in warmreg.token_counts(config, plugin=PLUGIN)
            if t
        ]

    def warmup_inputs(self, key: HcCollapseKey) -> Mapping[str, Any]:
        n, h = key.hc_mult, key.hidden
        return {
            "x": warmreg.meta((1, n, h), torch.bfloat16, stride=(key.x_stride_t, key.x_stride_n, key.x_stride_h)),
            "pre_mix": warmreg.meta((1, n), torch.float32, stride=(key.pre_stride_t, key.pre_stride_n)),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, x: torch.Tensor, pre_mix: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[HcCollapseKey]:
        """The collapsed ``[T, H]`` bf16 hidden rows (``out``, or a fresh tensor).

        :param x: the residual streams, bf16 ``[T, hc_mult, H]``, any strides, 16-byte aligned.
        :param pre_mix: the last layer's FFN pre-mix, fp32 ``[T, hc_mult]``, any strides, 16-byte aligned.
        :param out: a buffer instead of a fresh one: exactly bf16 ``[T, H]``, contiguous, aligned.
        :raises warmreg.LaunchError: for an ``x`` or ``pre_mix`` of another rank, dtype or shape, or not 16-byte
            aligned, or an ``out`` unlike the fresh output.
        """
        self._check(x, pre_mix)
        key = self.dispatch(x=x, pre_mix=pre_mix)
        t, _, h = x.shape
        out = warmreg.output(self.name, "out", out, (t, h), torch.bfloat16, x.device)
        kwargs = dict(
            pre_ptr=pre_mix, x_ptr=x, out_ptr=out, H=key.hidden, N=key.hc_mult,
            PRE_T=key.pre_stride_t, PRE_N=key.pre_stride_n, X_T=key.x_stride_t, X_N=key.x_stride_n,
            X_H=key.x_stride_h, OUT_T=out.stride(0), OUT_H=out.stride(1), BLOCK_H=key.block_h,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, triton.cdiv(h, key.block_h)) if t and h else None, kwargs, out)

    def _check(self, x: torch.Tensor, pre_mix: torch.Tensor) -> None:
        if x.ndim != 3 or x.dtype != torch.bfloat16 or x.data_ptr() % 16:
            raise warmreg.LaunchError(
                self.name, f"x must be a 16-byte aligned bf16 [T, hc_mult, H] tensor (got {x.dtype} {tuple(x.shape)})"
            )
        if pre_mix.shape != x.shape[:2] or pre_mix.dtype != torch.float32 or pre_mix.data_ptr() % 16:
            raise warmreg.LaunchError(
                self.name,
                f"pre_mix must be a 16-byte aligned fp32 {tuple(x.shape[:2])} tensor "
                f"(got {pre_mix.dtype} {tuple(pre_mix.shape)})",
            )


def hc_collapse_reference(x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`HcCollapse`: the fp32 products added in stream order, then bf16 (rounded to
    nearest; Triton's interpreter truncates, so a comparison under it allows one bf16 step)."""
    acc = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device)
    for n in range(x.shape[1]):
        acc = acc + pre_mix[:, n : n + 1].float() * x[:, n].float()
    return acc.to(torch.bfloat16)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the collapse for a V4.1 deployment on CUDA (``DeepseekV4Model.forward`` on the last pipeline rank,
    every step; warmreg has no pipeline setting, so every rank is the last)."""
    kernel = HcCollapse(hidden_size=model.hidden_size, hc_mult=model.hc_mult)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 else False)
