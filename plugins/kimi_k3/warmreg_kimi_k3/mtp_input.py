"""The input of Kimi-K3's MTP draft layer: both of its RMSNorms, side by side in the projection's layout (vLLM 0.34
``models/kimi_k3/common/mtp.py``: ``fused_mtp_input``, ``_fused_mtp_input_kernel``).

Math, for each token ``t < T`` with ``H = hidden_size``, in fp32, ``rms(x; w) = x * rsqrt(sum(x * x) / H + eps) * w``::

    e = 0 if positions[t] == 0 else inputs_embeds[t]       # the first position's embedding is masked out
    out[t, 0:H]   = rms(e; enorm_weight)
    out[t, H:2H]  = rms(previous_hidden_states[t]; hnorm_weight)

cast once to ``inputs_embeds``' dtype. ``out`` is a fresh contiguous ``[T, 2H]`` (the ``eh_proj`` input). Grid
``(T, 2)``: a program normalizes one row of one input in a single ``next_pow2(H)`` tile, four warps, as in vLLM.

Where it runs: every forward of a Kimi-K3 MTP draft layer (``KimiK3MultiTokenPredictorLayer.forward``, in
``models/kimi_k3/nvidia/mtp.py`` on CUDA and XPU and ``amd/mtp.py`` on ROCm), with the layer's ``enorm`` /
``hnorm`` weights (model dtype) and ``rms_norm_eps``. Those layers exist only in vLLM's ``KimiK3MTPModel``
draft, built when the speculative method is ``mtp`` and the checkpoint has ``num_nextn_predict_layers > 0``: the
kernel is registered when ``text.num_nextn_predict_layers > 0``, ``serving.num_speculative_tokens > 0`` and
``serving.speculative_method`` is ``mtp`` or unset (as the DeepSeek-V4 plugin reads it), on every GPU platform.

Key: the dtypes, ``H`` and its tile, the 16-byte alignment of the two inputs and the output, the integer classes
of their row strides (specialized as in vLLM, so that rows load in vectors) and ``num_warps``. ``eps`` is a runtime
float, ``T`` only the grid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import PLUGIN, KimiK3, positive_text_int

__all__ = ["FusedMTPInput", "FusedMTPInputKey", "fused_mtp_input_reference", "register"]


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _fused_mtp_input_kernel(
    positions_ptr,  # [T]
    embeds_ptr,  # [T, HIDDEN], channels contiguous
    hidden_ptr,  # [T, HIDDEN], channels contiguous
    enorm_w_ptr,  # [HIDDEN]
    hnorm_w_ptr,  # [HIDDEN]
    out_ptr,  # [T, 2 * HIDDEN]
    eps,
    embeds_stride,
    hidden_stride,
    out_stride,
    HIDDEN: tl.constexpr,  # the row length: a model constant
    BLOCK: tl.constexpr,  # next_pow2(HIDDEN): one tile a row
):
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)  # 0: the embedding and enorm, 1: the previous hidden state and hnorm
    cols = tl.arange(0, BLOCK)
    inside = cols < HIDDEN
    if which == 0:
        keep = tl.load(positions_ptr + t) != 0
        x = tl.load(embeds_ptr + t * embeds_stride + cols, mask=tl.where(keep, inside, False), other=0.0)
        w = tl.load(enorm_w_ptr + cols, mask=inside, other=0.0)
    else:
        x = tl.load(hidden_ptr + t * hidden_stride + cols, mask=inside, other=0.0)
        w = tl.load(hnorm_w_ptr + cols, mask=inside, other=0.0)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / HIDDEN
    y = x * tl.rsqrt(mean_square + eps) * w.to(tl.float32)
    tl.store(out_ptr + t * out_stride + which * HIDDEN + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@attrs.frozen(kw_only=True)
class FusedMTPInputKey(warmreg.CompileKey):
    """What changes the binary of the MTP input: ``T`` and ``eps`` do not."""

    dtype: str  # inputs_embeds and the output
    hidden_dtype: str  # previous_hidden_states
    weight_dtype: str  # both norm weights
    positions_dtype: str
    hidden: int  # HIDDEN
    block: int  # BLOCK
    embeds_stride: warmreg.IntClass
    hidden_stride: warmreg.IntClass
    out_stride: warmreg.IntClass
    embeds_aligned: bool
    hidden_aligned: bool
    num_warps: int


class FusedMTPInput(warmreg.TritonKernel[FusedMTPInputKey]):
    """Mask and normalize both inputs of the MTP draft layer into ``[T, 2H]`` (the module docstring has the math).

    :param hidden_size: the model's hidden size (domains only).
    :param dtype: the activation (and norm weight) dtype name (domains only).
    """

    name = "kimi_k3.fused_mtp_input"
    key_type = FusedMTPInputKey
    jit = _fused_mtp_input_kernel

    def __init__(self, *, hidden_size: int, dtype: str = "bfloat16") -> None:
        self.hidden_size, self.dtype = hidden_size, getattr(torch, dtype)

    def dispatch(
        self,
        *,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        enorm_weight: torch.Tensor,
    ) -> FusedMTPInputKey:
        hidden = inputs_embeds.shape[1]
        return FusedMTPInputKey(
            dtype=warmreg.dtype_name(inputs_embeds.dtype),
            hidden_dtype=warmreg.dtype_name(previous_hidden_states.dtype),
            weight_dtype=warmreg.dtype_name(enorm_weight.dtype),
            positions_dtype=warmreg.dtype_name(positions.dtype),
            hidden=hidden,
            block=warmreg.next_pow2(hidden),
            embeds_stride=warmreg.int_class(inputs_embeds.stride(0)),
            hidden_stride=warmreg.int_class(previous_hidden_states.stride(0)),
            out_stride=warmreg.int_class(2 * hidden),
            embeds_aligned=warmreg.is_aligned(inputs_embeds),
            hidden_aligned=warmreg.is_aligned(previous_hidden_states),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # The drafter's embeddings and the target's hidden states, fresh or leading rows of persistent buffers;
        # int64 positions. T is not in the key.
        h, dt = self.hidden_size, self.dtype
        return {
            "positions": [warmreg.meta((2,), torch.int64)],
            "inputs_embeds": [warmreg.meta((2, h), dt)],
            "previous_hidden_states": [warmreg.meta((2, h), dt)],
            "enorm_weight": [warmreg.meta((h,), dt)],
        }

    def warmup_inputs(self, key: FusedMTPInputKey) -> Mapping[str, Any]:
        h, w = key.hidden, getattr(torch, key.weight_dtype)

        def rows(dtype: str, stride: warmreg.IntClass, aligned: bool) -> torch.Tensor:
            return warmreg.meta((1, h), getattr(torch, dtype), stride=(warmreg.int_class_rep(stride), 1),
                                offset=0 if aligned else 1)  # fmt: skip

        return {
            "positions": warmreg.meta((1,), getattr(torch, key.positions_dtype)),
            "inputs_embeds": rows(key.dtype, key.embeds_stride, key.embeds_aligned),
            "previous_hidden_states": rows(key.hidden_dtype, key.hidden_stride, key.hidden_aligned),
            "enorm_weight": warmreg.meta((h,), w),
            "hnorm_weight": warmreg.meta((h,), w),
            "eps": 1e-5,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        enorm_weight: torch.Tensor,
        hnorm_weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[FusedMTPInputKey]:
        """``[T, 2H]``: the normalized masked embeddings, then the normalized previous hidden states (``out``, or a
        fresh tensor); vLLM's ``fused_mtp_input`` arguments, in its order.

        :param positions: int32 or int64 ``[T]``; a row at position 0 takes a zero embedding.
        :param inputs_embeds: ``[T, H]``, channels contiguous, any row stride.
        :param previous_hidden_states: ``[T, H]``, channels contiguous, any row stride.
        :param enorm_weight: ``[H]`` contiguous; ``hnorm_weight`` the same, of one dtype.
        :param eps: the norms' epsilon (``rms_norm_eps``).
        :param out: a preallocated output, contiguous ``[T, 2H]`` of ``inputs_embeds``' dtype.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out``
            that is not the output's shape, dtype and layout.
        """
        self._check(positions, inputs_embeds, previous_hidden_states, enorm_weight, hnorm_weight)
        key = self.dispatch(
            positions=positions, inputs_embeds=inputs_embeds, previous_hidden_states=previous_hidden_states,
            enorm_weight=enorm_weight,
        )  # fmt: skip
        tokens, hidden = inputs_embeds.shape
        out = warmreg.output(self.name, "out", out, (tokens, 2 * hidden), inputs_embeds.dtype, inputs_embeds.device)
        kwargs = dict(
            positions_ptr=positions, embeds_ptr=inputs_embeds, hidden_ptr=previous_hidden_states,
            enorm_w_ptr=enorm_weight, hnorm_w_ptr=hnorm_weight, out_ptr=out, eps=float(eps),
            embeds_stride=inputs_embeds.stride(0), hidden_stride=previous_hidden_states.stride(0),
            out_stride=out.stride(0), HIDDEN=key.hidden, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (tokens, 2) if tokens else None, kwargs, out)

    def _check(
        self,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        hidden: torch.Tensor,
        enorm_weight: torch.Tensor,
        hnorm_weight: torch.Tensor,
    ) -> None:
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] == 0 or inputs_embeds.stride(1) != 1:
            raise warmreg.LaunchError(
                self.name,
                f"inputs_embeds must be [T, H] with contiguous channels (got {tuple(inputs_embeds.shape)}, "
                f"strides {inputs_embeds.stride()})",
            )
        shape = tuple(inputs_embeds.shape)
        if tuple(hidden.shape) != shape or hidden.stride(1) != 1 or not hidden.dtype.is_floating_point:
            raise warmreg.LaunchError(
                self.name,
                f"previous_hidden_states must be a float [T, H] = {list(shape)} with contiguous channels "
                f"(got {hidden.dtype} {tuple(hidden.shape)}, strides {hidden.stride()})",
            )
        if positions.shape != shape[:1] or positions.dtype not in (torch.int32, torch.int64):
            raise warmreg.LaunchError(
                self.name,
                f"positions must be int32 or int64 [{shape[0]}] (got {positions.dtype} {tuple(positions.shape)})",
            )
        for name, w in (("enorm_weight", enorm_weight), ("hnorm_weight", hnorm_weight)):
            if w.shape != shape[1:] or w.stride(0) != 1 or w.dtype != enorm_weight.dtype:
                raise warmreg.LaunchError(
                    self.name,
                    f"{name} must be [{shape[1]}] contiguous, both weights of one dtype "
                    f"(got {w.dtype} {tuple(w.shape)})",
                )
        devices = {t.device for t in (positions, inputs_embeds, hidden, enorm_weight, hnorm_weight)}
        if len(devices) > 1:
            raise warmreg.LaunchError(self.name, f"all inputs must be on one device (got {sorted(map(str, devices))})")


def fused_mtp_input_reference(
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
    previous_hidden_states: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """PyTorch reference of :class:`FusedMTPInput`: fp32 math, one cast to ``inputs_embeds``' dtype."""

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()

    embeds = torch.where((positions == 0)[:, None], torch.zeros_like(inputs_embeds), inputs_embeds)
    both = torch.cat([rms(embeds, enorm_weight), rms(previous_hidden_states, hnorm_weight)], dim=-1)
    return both.to(inputs_embeds.dtype)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MTP input when the checkpoint's MTP layers draft (the module docstring has the condition).

    :raises warmreg.ConfigError: for a malformed ``text.num_nextn_predict_layers`` or
        ``serving.speculative_method``, or a missing ``text.hidden_size`` when the layers draft.
    """
    layers = config.get("text.num_nextn_predict_layers", int, plugin=PLUGIN, default=0)
    drafts = config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0)
    method = config.get("serving.speculative_method", str, plugin=PLUGIN, default=None)
    if layers <= 0 or drafts <= 0 or method not in (None, "mtp"):
        return
    kernel = FusedMTPInput(hidden_size=positive_text_int(config, "hidden_size"), dtype=m.dtype)
    registry.add(kernel, when=warmreg.is_cuda | warmreg.is_rocm | warmreg.is_xpu)
