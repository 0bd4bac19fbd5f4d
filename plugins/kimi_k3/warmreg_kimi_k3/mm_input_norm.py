"""The vision tower's input normalisation: raw image bytes to the patch embedding's dtype, in one pass.

This is the Triton path of ``vllm/model_executor/layers/fusion/mm_input_norm.py`` (``_fused_mm_input_norm_kernel``,
launched by ``fused_mm_input_norm_triton`` from ``FusedMMInputNorm.forward_cuda``, which ROCm's ``forward_hip``
also runs). Kimi-K3's vision tower (``MoonViT3dPretrainedModel`` built with ``input_norm =
build_mm_input_norm(model_config)`` in ``vllm/models/kimi_k3/nvidia/model.py`` and ``amd/model.py``) calls it first
in ``MoonVision3dPatchEmbed.forward`` (``vllm/model_executor/models/kimi_k25_vit.py``)::

    x = self.input_norm(x.flatten(1), self.proj.weight.dtype).view_as(x)

on the ``[P, C, ph, pw]`` patches of a step's images: the "pcl" layout ``[P, C * L]`` with ``L = ph * pw``.

Math, with the processor's ``rescale_factor``, ``image_mean[c]`` and ``image_std[c]`` folded by vLLM into the fp32
buffers ``weight[c] = rescale_factor / image_std[c]`` and ``bias[c] = -image_mean[c] / image_std[c]``::

    y[p, c * L + l] = cast(fp32(x[p, c * L + l]) * weight[c] + bias[c], out dtype)

over the flat index ``i`` of the ``[P, C, L]`` view, the channel being ``(i // L) % C`` (int32 offsets, as vLLM's:
the launcher refuses ``P * C * L >= 2**31``). One program per ``BLOCK = 1024`` elements, four warps; the input is
made contiguous first (a copy only if it is not), the output is a fresh contiguous tensor of the shape of ``x``.

When vLLM runs it: ``mm_device_do_normalize`` (``ModelConfig.multimodal_config``) defaults to the model class's
``supports_mm_device_do_normalize``, which ``KimiK3ForConditionalGeneration`` sets (off only when asked, or under
``VLLM_USE_RUST_FRONTEND``); then the pixels reach the device as ``uint8`` and, unless the processor's rescale and
normalisation are the identity (``NormParams.is_identity``; Kimi-K2.5's processor, whose vision tower Kimi-K3 reuses,
rescales by 1/255 and normalises by mean 0.5 and std 0.5), this kernel runs for every image batch. Every
``KimiK3ForConditionalGeneration`` has a vision tower (``KimiK3Config`` builds a default ``vision_config`` when the
checkpoint has none). Neither ``mm_device_do_normalize``, the processor config nor a zero ``--limit-mm-per-prompt``
(which skips the tower) reaches warmreg: the key is planned for every such checkpoint on CUDA and ROCm (one key a
deployment that turns it off warms without launching). XPU takes its own C++ kernel for ``uint8``.

Key: the input and output dtypes, ``C`` (3, RGB: ``len(image_mean)``), the tile and ``num_warps``. Unlike vLLM's
kernel, whose ``numel`` and ``L`` are specialized ints (a binary per divisibility class of the batch's element count),
both are runtime ints that are not specialized, and the input pointer is not specialized on alignment (the patches
may be a view at any byte offset): one binary serves every batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import PLUGIN, KimiK3

__all__ = [
    "BLOCK", "CHANNELS", "VISION_ARCHITECTURES", "MMInputNorm", "MMInputNormKey", "has_vision_tower",
    "mm_input_norm_reference", "register",
]  # fmt: skip

#: Elements per program (vLLM's ``BLOCK_SIZE``: 8 a lane at four warps).
BLOCK = 1024
#: Image channels (RGB): ``len(image_mean)`` of the processor, MoonViT's ``in_dim``.
CHANNELS = 3
#: The architectures with a MoonViT vision tower (``vllm/model_executor/models/registry.py``).
VISION_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration")
_INT32_LIMIT = 2**31


@triton.jit(do_not_specialize=["numel", "patch_len"], do_not_specialize_on_alignment=["x_ptr"])
def _mm_input_norm_kernel(
    x_ptr,  # [P, C, L] contiguous, uint8 (raw pixels) or the visual dtype
    y_ptr,  # [P, C, L] contiguous, the visual dtype
    w_ptr,  # [C] fp32: rescale_factor / image_std
    b_ptr,  # [C] fp32: -image_mean / image_std
    numel,  # P * C * L < 2**31
    patch_len,  # L
    C: tl.constexpr,  # channels: the modulus of the channel index
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: the launcher bounds numel
    mask = offs < numel
    c = (offs // patch_len) % C
    x = tl.load(x_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0).to(tl.float32)
    b = tl.load(b_ptr + c, mask=mask, other=0).to(tl.float32)
    tl.store(y_ptr + offs, x * w + b, mask=mask, eviction_policy="evict_first")


@attrs.frozen(kw_only=True)
class MMInputNormKey(warmreg.CompileKey):
    """What changes the binary of the input normalisation: no size, stride or input alignment does."""

    input_dtype: str  # uint8 (raw pixels) or the visual dtype
    output_dtype: str  # the patch embedding's weight dtype
    channels: int
    block: int
    num_warps: int


class MMInputNorm(warmreg.TritonKernel[MMInputNormKey]):
    """Raw patches to normalised patches of the visual dtype (the module docstring has the math).

    :param dtype: the vision tower's dtype (the model's), the output's (domains only).
    :param max_patches: patches of one encoder batch in the domains (their count is not in the key).
    """

    name = "kimi_k3.mm_input_norm"
    key_type = MMInputNormKey
    jit = _mm_input_norm_kernel

    def __init__(self, *, dtype: str, max_patches: int = 1024) -> None:
        self.dtype, self.max_patches = dtype, max_patches

    def dispatch(self, *, pixel_values: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> MMInputNormKey:
        return MMInputNormKey(
            input_dtype=warmreg.dtype_name(pixel_values.dtype),
            output_dtype=warmreg.dtype_name(out_dtype),
            channels=weight.numel(),
            block=BLOCK,
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "pixel_values": [warmreg.meta((self.max_patches, CHANNELS * 14 * 14), torch.uint8)],
            "weight": [warmreg.meta((CHANNELS,), torch.float32)],
            "out_dtype": [getattr(torch, self.dtype)],
        }

    def warmup_inputs(self, key: MMInputNormKey) -> Mapping[str, Any]:
        return {
            "pixel_values": warmreg.meta((1, key.channels * 4), getattr(torch, key.input_dtype)),
            "weight": warmreg.meta((key.channels,), torch.float32),
            "bias": warmreg.meta((key.channels,), torch.float32),
            "out_dtype": getattr(torch, key.output_dtype),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        pixel_values: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[MMInputNormKey]:
        """``pixel_values * weight[c] + bias[c]`` per channel, as ``out_dtype`` (``out``, or a fresh tensor of the
        shape of ``pixel_values``).

        :param pixel_values: ``[P, C * L]`` ("pcl": each patch's channels one after the other), any dtype (vLLM:
            ``uint8``); made contiguous first, as vLLM does.
        :param weight: fp32 ``[C]``, ``rescale_factor / image_std``.
        :param bias: fp32 ``[C]``, ``-image_mean / image_std``.
        :param out_dtype: the output's dtype (the patch embedding's weight dtype).
        :param out: a preallocated contiguous output of the shape of ``pixel_values`` and ``out_dtype``.
        :raises warmreg.LaunchError: for shapes, dtypes or devices the kernel cannot take, a flat size past int32,
            or an ``out`` that is not the output's shape, dtype and layout.
        """
        self._check(pixel_values, weight, bias)
        key = self.dispatch(pixel_values=pixel_values, weight=weight, out_dtype=out_dtype)
        x = pixel_values.contiguous()
        out = warmreg.output(self.name, "out", out, tuple(x.shape), out_dtype, x.device)
        numel = x.numel()
        kwargs = dict(
            x_ptr=x, y_ptr=out, w_ptr=weight.contiguous(), b_ptr=bias.contiguous(), numel=numel,
            patch_len=x.shape[1] // key.channels, C=key.channels, BLOCK=key.block,
        )  # fmt: skip
        grid = (triton.cdiv(numel, key.block),) if numel else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(self, pixel_values: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
        c = weight.numel()
        if weight.dtype != torch.float32 or bias.dtype != torch.float32 or bias.numel() != c or c == 0:
            raise warmreg.LaunchError(
                self.name,
                f"weight and bias must be fp32 with one value a channel (got {weight.dtype} {tuple(weight.shape)} "
                f"and {bias.dtype} {tuple(bias.shape)})",
            )
        if pixel_values.ndim != 2 or pixel_values.shape[1] % c:
            raise warmreg.LaunchError(
                self.name,
                f"pixel_values must be [P, C * L] with C = {c} channels (got {tuple(pixel_values.shape)})",
            )
        if pixel_values.numel() >= _INT32_LIMIT:
            raise warmreg.LaunchError(
                self.name, f"pixel_values has {pixel_values.numel()} elements: the kernel indexes below 2**31"
            )
        if not pixel_values.device == weight.device == bias.device:
            raise warmreg.LaunchError(
                self.name,
                f"inputs on {pixel_values.device}, {weight.device} and {bias.device}: use one device",
            )


def mm_input_norm_reference(
    pixel_values: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, out_dtype: torch.dtype
) -> torch.Tensor:
    """PyTorch reference of :class:`MMInputNorm` (vLLM's ``FusedMMInputNorm.forward_native``): fp32 by type
    promotion, then one cast to ``out_dtype``."""
    c = weight.numel()
    x3 = pixel_values.reshape(pixel_values.shape[0], c, -1)
    return (x3 * weight.view(1, c, 1) + bias.view(1, c, 1)).reshape(pixel_values.shape).to(out_dtype)


def has_vision_tower(config: warmreg.WarmConfig) -> bool:
    """Whether vLLM builds a MoonViT vision tower for this checkpoint: its ``architectures`` name a Kimi-K3
    ``ForConditionalGeneration`` class (or, with none given, its ``model_type`` is ``kimi_k3``).

    :raises warmreg.ConfigError: for ``architectures`` that are not a list.
    """
    archs = config.get("model.architectures", tuple, plugin=PLUGIN, default=None)
    if archs is None:
        return config.model_type == "kimi_k3"
    return any(arch in VISION_ARCHITECTURES for arch in archs)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the input normalisation on CUDA and ROCm for checkpoints with a vision tower (see the module
    docstring for the settings it assumes).

    :raises warmreg.ConfigError: for malformed ``architectures``.
    """
    if not has_vision_tower(config):
        return
    registry.add(MMInputNorm(dtype=m.dtype), when=warmreg.is_cuda | warmreg.is_rocm)
