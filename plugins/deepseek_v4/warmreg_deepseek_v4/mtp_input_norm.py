"""The MTP draft module's fused input RMSNorm (vLLM 0.33 ``models/deepseek_v4/common/ops/fused_mtp_input_rmsnorm.py``:
``FusedMTPInputRMSNormKernel``), with the fp32 recipe of :mod:`._rmsnorm`. Grid ``(T, hc_mult + 1)``,
task 0 then tasks ``k = 1..hc_mult``::

    enorm_out[t]         = rms(positions[t] == 0 ? 0 : inputs_embeds[t]; enorm_w)   (a masked row is 0)
    hnorm_out[t, k - 1]  = rms(prev_hidden[t, k - 1]; hnorm_w)      prev_hidden viewed [T, hc_mult, H]

All tensors are contiguous (row offsets ``t * H`` in int64); outputs are fresh or the caller's ``out=``
(contiguous and aligned alike). Activations may start anywhere (their 16-byte alignment is a key field);
weights must be aligned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_norm_weights, out_parts
from ._rmsnorm import rms_reference, rms_row
from .dspark import mtp_drafts
from .model import DSV4, PLUGIN

__all__ = ["MTPInputNormKey", "MTPInputRMSNorm", "mtp_input_rmsnorm_reference", "register"]


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _mtp_input_rmsnorm_kernel(
    embeds_ptr,
    positions_ptr,
    hidden_ptr,
    enorm_w_ptr,
    hnorm_w_ptr,
    enorm_out_ptr,
    hnorm_out_ptr,
    eps,
    HIDDEN: tl.constexpr,  # hidden_size: the row length
    HC_MULT: tl.constexpr,  # hyper-connection copies of the previous hidden state (grid axis 1 - 1)
    BLOCK_SIZE: tl.constexpr,  # next_pow2(HIDDEN): one tile covers a row
):
    t = tl.program_id(0).to(tl.int64)  # T * hc_mult * HIDDEN can exceed 2**31
    task = tl.program_id(1)
    # only the enorm row is masked at position 0.
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    keep = tl.where((tl.load(positions_ptr + t) != 0) | (task > 0), True, False)
    if task == 0:
        rms_row(embeds_ptr + t * HIDDEN, enorm_w_ptr, enorm_out_ptr + t * HIDDEN, eps, keep, HIDDEN, BLOCK_SIZE)
    else:
        row = t * HC_MULT + task - 1
        rms_row(hidden_ptr + row * HIDDEN, hnorm_w_ptr, hnorm_out_ptr + row * HIDDEN, eps, keep, HIDDEN, BLOCK_SIZE)


@attrs.frozen(kw_only=True)
class MTPInputNormKey(warmreg.CompileKey):
    """What changes the binary of the MTP input norm."""

    dtype: str  # activation (and output) dtype
    weight_dtype: str
    hidden: int
    hc_mult: int
    block_size: int
    embeds_aligned: bool
    hidden_aligned: bool
    num_warps: int


class MTPInputRMSNorm(warmreg.TritonKernel[MTPInputNormKey]):
    """The MTP input norm: ``enorm`` of the masked embeddings and ``hnorm`` of each hc copy.

    :param hidden: ``hidden_size``.
    :param hc_mult: hyper-connection multiplicity (``hc_mult``).
    :param dtype: activation dtype name.
    :param weight_dtype: norm weight dtype name (default: ``dtype``).
    :param plugin: the registering plugin, named in config errors.
    """

    name = "deepseek_v4.mtp_input_rmsnorm"
    key_type = MTPInputNormKey
    jit = _mtp_input_rmsnorm_kernel

    def __init__(
        self,
        *,
        hidden: int,
        hc_mult: int,
        dtype: str = "bfloat16",
        weight_dtype: str | None = None,
        plugin: str = PLUGIN,
    ) -> None:
        self.hidden, self.hc_mult = hidden, hc_mult
        self.dtype, self.weight_dtype = getattr(torch, dtype), getattr(torch, weight_dtype or dtype)
        self.plugin = plugin

    def dispatch(
        self, *, inputs_embeds: torch.Tensor, prev_hidden: torch.Tensor, enorm_weight: torch.Tensor
    ) -> MTPInputNormKey:
        hidden = inputs_embeds.shape[-1]
        return MTPInputNormKey(
            dtype=warmreg.dtype_name(inputs_embeds.dtype),
            weight_dtype=warmreg.dtype_name(enorm_weight.dtype),
            hidden=hidden,
            hc_mult=math.prod(prev_hidden.shape[1:]) // max(hidden, 1),
            block_size=warmreg.next_pow2(hidden),
            embeds_aligned=warmreg.is_aligned(inputs_embeds),
            hidden_aligned=warmreg.is_aligned(prev_hidden),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = warmreg.token_counts(config, plugin=self.plugin)
        return {
            "inputs_embeds": [warmreg.meta((t, self.hidden), self.dtype) for t in tokens],
            "prev_hidden": [warmreg.meta((t, self.hc_mult * self.hidden), self.dtype) for t in tokens],
            "enorm_weight": [warmreg.meta((self.hidden,), self.weight_dtype)],
        }

    def when(self, *, inputs_embeds: torch.Tensor, prev_hidden: torch.Tensor, **_: Any) -> bool:
        return inputs_embeds.shape[0] == prev_hidden.shape[0]

    def warmup_inputs(self, key: MTPInputNormKey) -> Mapping[str, Any]:
        dtype, wdtype = getattr(torch, key.dtype), getattr(torch, key.weight_dtype)
        return {
            "inputs_embeds": warmreg.meta((1, key.hidden), dtype, offset=0 if key.embeds_aligned else 1),
            "positions": warmreg.meta((1,), torch.int64),
            "prev_hidden": warmreg.meta((1, key.hc_mult * key.hidden), dtype, offset=0 if key.hidden_aligned else 1),
            "enorm_weight": warmreg.meta((key.hidden,), wdtype),
            "hnorm_weight": warmreg.meta((key.hidden,), wdtype),
            "eps": 1e-6,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        enorm_weight: torch.Tensor,
        hnorm_weight: torch.Tensor,
        eps: float,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[MTPInputNormKey]:
        """Normalize; returns ``(enorm_out [T, H], hnorm_out shaped like prev_hidden)`` (fresh, or ``out``).

        :param inputs_embeds: ``[T, H]`` contiguous.
        :param positions: int64 ``[T]``; rows at position 0 of ``enorm_out`` are 0.
        :param prev_hidden: the target's residual ``[T, hc_mult * H]`` (or ``[T, hc_mult, H]``), contiguous.
        :param enorm_weight: ``[H]``; ``hnorm_weight``: ``[H]`` (same dtype, 16-byte aligned).
        :param out: the two outputs to write instead of fresh ones: exactly ``inputs_embeds``' and
            ``prev_hidden``'s shapes, of their dtype, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong shapes, dtypes or layouts, or an ``out`` unlike the fresh outputs.
        """
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] == 0 or prev_hidden.ndim < 2:
            raise warmreg.LaunchError(self.name, f"inputs_embeds must be [T, H] (got {tuple(inputs_embeds.shape)})")
        if not inputs_embeds.is_contiguous() or not prev_hidden.is_contiguous():
            raise warmreg.LaunchError(self.name, "inputs_embeds and prev_hidden must be contiguous")
        tokens, hidden = inputs_embeds.shape
        width = math.prod(prev_hidden.shape[1:])
        if prev_hidden.shape[0] != tokens or width % hidden or width == 0 or prev_hidden.dtype != inputs_embeds.dtype:
            raise warmreg.LaunchError(
                self.name,
                f"prev_hidden must be [{tokens}, hc_mult * {hidden}] of {inputs_embeds.dtype} "
                f"(got {prev_hidden.dtype} {tuple(prev_hidden.shape)})",
            )
        if positions.dtype != torch.int64 or tuple(positions.shape) != (tokens,):
            raise warmreg.LaunchError(
                self.name, f"positions must be int64 [{tokens}] (got {positions.dtype} {tuple(positions.shape)})"
            )
        check_norm_weights(self.name, hidden, enorm_weight, hnorm_weight)
        key = self.dispatch(inputs_embeds=inputs_embeds, prev_hidden=prev_hidden, enorm_weight=enorm_weight)
        # torch.empty, not empty_like: on warm's meta tensors empty_like runs PyTorch's Python reference,
        # which imports sympy (seconds in a fresh process); the inputs are contiguous, so this is the same
        out_e, out_h = out_parts(self.name, out, 2)
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        enorm_out = warmreg.output(self.name, "out[0]", out_e, inputs_embeds.shape, dtype, device)
        hnorm_out = warmreg.output(self.name, "out[1]", out_h, prev_hidden.shape, dtype, device)
        kwargs = dict(
            embeds_ptr=inputs_embeds, positions_ptr=positions, hidden_ptr=prev_hidden, enorm_w_ptr=enorm_weight,
            hnorm_w_ptr=hnorm_weight, enorm_out_ptr=enorm_out, hnorm_out_ptr=hnorm_out, eps=eps,
            HIDDEN=key.hidden, HC_MULT=key.hc_mult, BLOCK_SIZE=key.block_size,
        )  # fmt: skip
        grid = (tokens, key.hc_mult + 1) if tokens else None
        return warmreg.LaunchSpec(key, grid, kwargs, (enorm_out, hnorm_out))


def mtp_input_rmsnorm_reference(
    inputs_embeds: torch.Tensor,
    positions: torch.Tensor,
    prev_hidden: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`MTPInputRMSNorm`: fp32 math, one cast to the input dtype."""
    embeds = torch.where((positions == 0)[:, None], torch.zeros_like(inputs_embeds), inputs_embeds)
    hidden = inputs_embeds.shape[-1]
    hnorm = rms_reference(prev_hidden.reshape(prev_hidden.shape[0], -1, hidden), hnorm_weight, eps)
    return rms_reference(embeds, enorm_weight, eps), hnorm.reshape(prev_hidden.shape)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MTP input norm when the model has MTP layers and they draft (every platform runs it):
    ``speculative_method`` ``mtp`` or unset. Any other method drafts without them (DSpark: its own draft layers).

    :raises warmreg.ConfigError: for an unknown ``speculative_method``.
    """
    if model.num_nextn_predict_layers > 0 and mtp_drafts(config):
        registry.add(MTPInputRMSNorm(hidden=model.hidden_size, hc_mult=model.hc_mult, dtype=model.dtype))
