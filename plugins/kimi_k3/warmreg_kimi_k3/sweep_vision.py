"""The Kimi-K3 sweep's vision tower: what a step's image batch launches before the text layers.

Part of the sweep driver (:mod:`warmreg_kimi_k3.sweep`), never imported by registration. vLLM encodes a step's new
images first (``KimiK3ForConditionalGeneration`` -> ``MoonViT3dPretrainedModel``), and the patch embedding's input
normalisation (:mod:`warmreg_kimi_k3.mm_input_norm`) runs on the batch's raw ``[P, 3, 14, 14]`` uint8 patches,
flattened to ``[P, 588]``.
"""

from __future__ import annotations

from typing import Any

import torch

from .mm_input_norm import CHANNELS, mm_input_norm_reference

__all__ = ["MM_INPUT_NORM", "mm_input_norm_step"]

MM_INPUT_NORM = "kimi_k3.mm_input_norm"
#: Kimi-K2.5's processor (MoonViT): rescale 1/255, mean 0.5, std 0.5, folded as vLLM folds them.
_WEIGHT, _BIAS = (1 / 255) / 0.5, -0.5 / 0.5


def mm_input_norm_step(sweep: Any) -> None:
    """One encoder batch: a random number of images of random 2x2-merged grids (``P`` a multiple of 4), now and
    then an offset slice of a larger staging buffer, normalised into the model dtype and checked against the
    reference (one bf16 step: the sweep's default tolerance).

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its generator, device and ``launch``).
    """
    kernel = sweep.kernel(MM_INPUT_NORM)
    max_patches = 4096 if sweep.cuda else 64  # the interpreter's time on the CPU; the count is not in the key
    patches = 4 * sweep.rng.randint(1, max_patches // 4)
    offset = sweep.rng.choice((0, 0, 5))
    raw = torch.randint(0, 256, (offset + patches, CHANNELS * 14 * 14), generator=sweep.gen, device=sweep.dev,
                        dtype=torch.uint8)[offset:]  # fmt: skip
    weight = torch.full((CHANNELS,), _WEIGHT, dtype=torch.float32, device=sweep.dev)
    bias = torch.full((CHANNELS,), _BIAS, dtype=torch.float32, device=sweep.dev)
    dtype = getattr(torch, kernel.dtype)
    sweep.launch(
        MM_INPUT_NORM,
        f"{patches} patches, offset {offset}",
        lambda: kernel(raw, weight, bias, out_dtype=dtype),
        ref=lambda: mm_input_norm_reference(raw, weight, bias, out_dtype=dtype),
    )
