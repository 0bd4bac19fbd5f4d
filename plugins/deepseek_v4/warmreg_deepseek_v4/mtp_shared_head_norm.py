"""The MTP draft module's shared-head RMSNorm (vLLM 0.33 ``models/deepseek_v4/common/ops/fused_mtp_input_rmsnorm.py``),
with the fp32 recipe of :mod:`._rmsnorm`. Grid ``(T,)``: ``out[t] = rms(x[t]; shared_head.norm.weight)``.

``x`` is contiguous (row offsets ``t * H`` in int64); the output is fresh or the caller's ``out=`` (contiguous
and aligned alike). ``x`` may start anywhere (its 16-byte alignment is a key field); the weight must be aligned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_norm_weights
from ._rmsnorm import rms_reference, rms_row
from .dspark import mtp_drafts
from .model import DSV4, PLUGIN

__all__ = ["MTPSharedHeadNormKey", "MTPSharedHeadRMSNorm", "mtp_shared_head_rmsnorm_reference", "register"]


@triton.jit
def _mtp_shared_head_rmsnorm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    eps,
    HIDDEN: tl.constexpr,  # hidden_size: the row length
    BLOCK_SIZE: tl.constexpr,  # next_pow2(HIDDEN): one tile covers a row
):
    t = tl.program_id(0).to(tl.int64)
    keep = tl.where(t >= 0, True, False)  # no masked rows; an int1 scalar, as in the input norm
    rms_row(x_ptr + t * HIDDEN, w_ptr, out_ptr + t * HIDDEN, eps, keep, HIDDEN, BLOCK_SIZE)


@attrs.frozen(kw_only=True)
class MTPSharedHeadNormKey(warmreg.CompileKey):
    """What changes the binary of the MTP shared-head norm."""

    dtype: str
    weight_dtype: str
    hidden: int
    block_size: int
    x_aligned: bool
    num_warps: int


class MTPSharedHeadRMSNorm(warmreg.TritonKernel[MTPSharedHeadNormKey]):
    """The MTP shared-head norm (after ``hc_head``, before the LM head): a plain RMSNorm of ``[T, H]``.

    :param hidden: ``hidden_size``.
    :param dtype: activation dtype name.
    :param weight_dtype: norm weight dtype name (default: ``dtype``).
    :param plugin: the registering plugin, named in config errors.
    """

    name = "deepseek_v4.mtp_shared_head_rmsnorm"
    key_type = MTPSharedHeadNormKey
    jit = _mtp_shared_head_rmsnorm_kernel

    def __init__(
        self, *, hidden: int, dtype: str = "bfloat16", weight_dtype: str | None = None, plugin: str = PLUGIN
    ) -> None:
        self.hidden = hidden
        self.dtype, self.weight_dtype = getattr(torch, dtype), getattr(torch, weight_dtype or dtype)
        self.plugin = plugin

    def dispatch(self, *, x: torch.Tensor, weight: torch.Tensor) -> MTPSharedHeadNormKey:
        return MTPSharedHeadNormKey(
            dtype=warmreg.dtype_name(x.dtype),
            weight_dtype=warmreg.dtype_name(weight.dtype),
            hidden=x.shape[-1],
            block_size=warmreg.next_pow2(x.shape[-1]),
            x_aligned=warmreg.is_aligned(x),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = warmreg.token_counts(config, plugin=self.plugin)
        return {
            "x": [warmreg.meta((t, self.hidden), self.dtype) for t in tokens],
            "weight": [warmreg.meta((self.hidden,), self.weight_dtype)],
        }

    def warmup_inputs(self, key: MTPSharedHeadNormKey) -> Mapping[str, Any]:
        return {
            "x": warmreg.meta((1, key.hidden), getattr(torch, key.dtype), offset=0 if key.x_aligned else 1),
            "weight": warmreg.meta((key.hidden,), getattr(torch, key.weight_dtype)),
            "eps": 1e-6,
        }

    @warmreg.kernel_launcher
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[MTPSharedHeadNormKey]:
        """Normalize ``x [T, H]`` (contiguous); returns ``[T, H]`` of ``x``'s dtype (fresh, or ``out``).

        :param out: the output to write instead of a fresh one: exactly ``[T, H]`` of ``x``'s dtype, contiguous,
            16-byte aligned.
        :raises warmreg.LaunchError: for a non-contiguous or non-2-D ``x``, a wrong weight, or an ``out`` unlike
            the fresh output.
        """
        if x.ndim != 2 or not x.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"x must be a contiguous [T, H] (got {tuple(x.shape)} stride {x.stride()})"
            )
        check_norm_weights(self.name, x.shape[1], weight)
        key = self.dispatch(x=x, weight=weight)
        out = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)  # torch.empty: x is contiguous
        kwargs = dict(x_ptr=x, w_ptr=weight, out_ptr=out, eps=eps, HIDDEN=key.hidden, BLOCK_SIZE=key.block_size)
        return warmreg.LaunchSpec(key, (x.shape[0],) if x.shape[0] else None, kwargs, out)


def mtp_shared_head_rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch reference of :class:`MTPSharedHeadRMSNorm`."""
    return rms_reference(x, weight, eps)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MTP shared-head norm when the model has MTP layers and they draft (every platform runs it):
    ``speculative_method`` ``mtp`` or unset. Any other method drafts without them (DSpark: its own draft layers).

    :raises warmreg.ConfigError: for an unknown ``speculative_method``.
    """
    if model.num_nextn_predict_layers > 0 and mtp_drafts(config):
        registry.add(MTPSharedHeadRMSNorm(hidden=model.hidden_size, dtype=model.dtype))
