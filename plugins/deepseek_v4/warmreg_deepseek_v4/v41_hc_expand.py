"""DeepSeek-V4.1's mHC stream expand on CUDA (vLLM 0.34 ``models/deepseek_v41/nvidia/ops/mhc.py``: ``hc_expand`` /
``_hc_expand_kernel``).

The first decoder layer turns the embedding ``x`` ``[M, H]`` into the ``hc_mult`` residual streams of
manifold-constrained hyper-connections, ``x.unsqueeze(1).expand(-1, N, -1).contiguous()``, reading ``x`` once::

    out[m, n, h] = x[m, h]        for n < N = hc_mult

``out`` is a fresh contiguous ``[M, N, H]`` tensor of ``x``'s dtype; ``x`` is read through its strides. Flat index
``i = m * H + h`` over ``numel = M * H``; grid ``(cdiv(numel, 1024),)``, 1024 elements a program, four warps, as in
vLLM.

Where it runs: every V4.1 CUDA deployment, every step: ``DeepseekV4DecoderLayer.forward`` of the first layer (no
residual yet, a 2-D ``x``: the embedding output, ``[M, hidden_size]`` in the model dtype, contiguous).

Key: ``H``, ``N`` and both strides of ``x`` (constexprs in vLLM's kernel, so a strided ``x`` is another binary), the
tile, the dtype, ``numel``'s integer class (specialized: ``M * H`` with ``H`` a multiple of 16 is ``div16``) and the
warps.
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

__all__ = ["HcExpand", "HcExpandKey", "hc_expand_reference", "register"]

_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _hc_expand_kernel(
    x_ptr,  # [M, H], strides (STRIDE_M, STRIDE_H)
    out_ptr,  # [M, N, H], contiguous
    numel,  # M * H
    H: tl.constexpr,  # hidden_size: a model constant
    N: tl.constexpr,  # hc_mult: the stream count, unrolled
    STRIDE_M: tl.constexpr,  # x's row stride (vLLM passes it as a constexpr)
    STRIDE_H: tl.constexpr,  # x's column stride
    BLOCK: tl.constexpr,  # elements a program
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < numel
    m, h = i // H, i % H
    value = tl.load(x_ptr + m * STRIDE_M + h * STRIDE_H, mask=live, other=0)
    for n in tl.static_range(N):
        tl.store(out_ptr + (m * N + n) * H + h, value, mask=live)


@attrs.frozen(kw_only=True)
class HcExpandKey(warmreg.CompileKey):
    """What changes the binary of the expand: the widths, ``x``'s strides, the tile, the dtype, the numel class."""

    hidden: int
    hc_mult: int
    stride_m: int
    stride_h: int
    block: int
    dtype: str
    numel: warmreg.IntClass
    num_warps: int


class HcExpand(warmreg.TritonKernel[HcExpandKey]):
    """The ``hc_mult`` copies of each embedding row (the module docstring has the math).

    :param hidden_size: the model's ``hidden_size`` (domains only).
    :param hc_mult: the model's ``hc_mult`` (domains only).
    :param dtype: the model dtype (domains only).
    """

    name = "deepseek_v4.v41_hc_expand"
    key_type = HcExpandKey
    jit = _hc_expand_kernel

    def __init__(self, *, hidden_size: int, hc_mult: int, dtype: str) -> None:
        self.hidden_size, self.hc_mult, self.dtype = hidden_size, hc_mult, dtype

    def dispatch(self, *, x: torch.Tensor, hc_mult: int) -> HcExpandKey:
        m, h = x.shape
        return HcExpandKey(
            hidden=h, hc_mult=hc_mult, stride_m=x.stride(0), stride_h=x.stride(1), block=_BLOCK,
            dtype=warmreg.dtype_name(x.dtype), numel=warmreg.int_class(m * h), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        tokens = [n for n in warmreg.token_counts(config, plugin=PLUGIN) if n]
        return {"x": [warmreg.meta((n, self.hidden_size), dtype) for n in tokens], "hc_mult": [self.hc_mult]}

    def warmup_inputs(self, key: HcExpandKey) -> Mapping[str, Any]:
        numel = warmreg.int_class_rep(key.numel)
        rows = max(1, -(-numel // key.hidden))
        stride = (key.stride_m, key.stride_h)
        return {"x": warmreg.meta((rows, key.hidden), getattr(torch, key.dtype), stride=stride), "hc_mult": key.hc_mult}

    @warmreg.kernel_launcher
    def __call__(
        self, x: torch.Tensor, hc_mult: int, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[HcExpandKey]:
        """The ``[M, hc_mult, H]`` streams of ``x`` (``out``, or a fresh tensor).

        :param x: ``[M, H]``, any strides, 16-byte aligned (the embedding output).
        :param hc_mult: the stream count (``>= 1``).
        :param out: a buffer instead of a fresh one: exactly ``x.dtype`` ``[M, hc_mult, H]``, contiguous, aligned.
        :raises warmreg.LaunchError: for an ``x`` that is not 2-D or not 16-byte aligned, ``hc_mult < 1``, or an
            ``out`` unlike the fresh output.
        """
        if x.ndim != 2 or x.data_ptr() % 16:
            raise warmreg.LaunchError(self.name, f"x must be a 16-byte aligned [M, H] tensor (got {tuple(x.shape)})")
        if hc_mult < 1:
            raise warmreg.LaunchError(self.name, f"hc_mult must be >= 1 (got {hc_mult})")
        key = self.dispatch(x=x, hc_mult=hc_mult)
        m, h = x.shape
        out = warmreg.output(self.name, "out", out, (m, hc_mult, h), x.dtype, x.device)
        kwargs = dict(
            x_ptr=x, out_ptr=out, numel=m * h, H=key.hidden, N=key.hc_mult, STRIDE_M=key.stride_m,
            STRIDE_H=key.stride_h, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (triton.cdiv(m * h, key.block),) if m * h else None, kwargs, out)


def hc_expand_reference(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """PyTorch reference of :class:`HcExpand`: ``x.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()``."""
    return x.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the expand for a V4.1 deployment on CUDA (the first layer's ``hc_expand``, every step)."""
    kernel = HcExpand(hidden_size=model.hidden_size, hc_mult=model.hc_mult, dtype=model.dtype)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 else False)
