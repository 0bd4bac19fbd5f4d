"""PyTorch references of DeepSeek-V4.1's MXFP8 query quant (:mod:`.v41_q_norm_quant`): the RMSNorm, the UE8M0
group scales FlashInfer's MXFP8 GEMMs read, and their swizzled F8_128x4 layout (vLLM 0.34
``models/deepseek_v41/common/ops/query_quant.py``: ``mxfp8_scale_offset``, ``mxfp8_scale_bytes``)."""

from __future__ import annotations

import torch

__all__ = ["mxfp8_quant_reference", "mxfp8_scale_bytes", "mxfp8_scale_offset", "rms_norm_reference"]

#: Values an MXFP8 scale covers.
GROUP = 32
#: The largest finite e4m3 value: a group's amax maps at most onto it.
E4M3_MAX = 448.0


def mxfp8_scale_bytes(tokens: int, width: int) -> int:
    """Bytes of F8_128x4 scales for ``tokens`` rows of ``width`` MXFP8 values: rows padded to 128, groups to 4."""
    return -(-tokens // 128) * 128 * -(-(width // GROUP) // 4) * 4


def mxfp8_scale_offset(row: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The byte of scale ``(row, group)`` in F8_128x4: ``[row / 128, group / 4, row % 32, row % 128 / 32, group % 4]``."""
    return (row // 128 * -(-groups // 4) + group // 4) * 512 + row % 32 * 16 + row % 128 // 32 * 4 + group % 4


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps) * weight.float()


def mxfp8_quant_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [T, W], uint8 F8_128x4 scales)`` of fp32 ``y`` ``[T, W]`` (``W % 32 == 0``): each group's UE8M0
    exponent is that of ``amax / 448`` rounded up (kept where the mantissa is 0 or the value a small subnormal),
    capped at 254, 0 for an all-zero group; the values are scaled by ``2^(127 - e)`` (0 where ``e = 0``)."""
    tokens, width = y.shape
    groups = y.reshape(tokens, width // GROUP, GROUP)
    a = groups.abs().amax(-1) * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    bits = a.view(torch.int32).long()
    exp, man = (bits >> 23) & 255, bits & 0x7FFFFF
    up = (man != 0) & ~((exp == 0) & (man <= 0x400000))
    e = torch.where(a <= 0, 0, torch.clamp(exp + up.long(), max=254))
    inv = torch.where(e == 0, 0, (254 - e) << 23).to(torch.int32).view(torch.float32)
    q = (groups * inv[..., None]).reshape(tokens, width).to(torch.float8_e4m3fn)
    scales = torch.zeros(mxfp8_scale_bytes(tokens, width), dtype=torch.uint8, device=y.device)
    if tokens:
        row = torch.arange(tokens, device=y.device)[:, None]
        g = torch.arange(width // GROUP, device=y.device)[None, :]
        scales[mxfp8_scale_offset(row, g, width // GROUP).reshape(-1)] = e.reshape(-1).to(torch.uint8)
    return q, scales
