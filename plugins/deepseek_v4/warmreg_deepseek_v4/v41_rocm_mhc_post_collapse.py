"""DeepSeek-V4.1 on ROCm gfx950 with aiter: the layer-input half of a delayed mHC seam, the post block, the collapse
with the carried pre-mix and the RMSNorm in one kernel (vLLM 0.34 ``model_executor/kernels/mhc/triton.py``:
``mhc_post_collapse_rms_norm_triton`` / ``_mhc_post_collapse_rms_norm_kernel``).

For token ``t`` with the four residual streams ``f_j = residual[t, j]`` (bf16 ``[4, H]``), the sublayer output
``x = sublayer_out[t]`` (bf16 ``[H]``), the previous seam's post gate ``post[t, j]`` and comb ``comb[t, h, j]``
(source stream ``h``, destination ``j``) and the carried pre-mix ``pre[t, j]`` (all fp32), in fp32 and this order::

    g_j = bf16(post[t, j] * x + comb[t, 0, j] * f_0 + comb[t, 1, j] * f_1 + comb[t, 2, j] * f_2 + comb[t, 3, j] * f_3)
    residual_out[t, j] = g_j
    c = bf16(pre[t, 0] * g_0 + pre[t, 1] * g_1 + pre[t, 2] * g_2 + pre[t, 3] * g_3)
    out[t] = bf16(c * rsqrt(mean(c * c) + eps) * weight)

(vLLM keeps aiter's fused kernel's expression order, so the new residual is bit-identical to it.) One program a
token, the whole row in one ``next_pow2(H)`` tile, 16 warps, as vLLM's launch.

Where it runs: ``DeepseekV4DecoderLayer.forward`` (``models/deepseek_v41/amd/model.py``) with an
``MHCOverlapStream``, which ``supports_mhc_overlap`` builds on CDNA4 (gfx950) where aiter's fused
post/pre-delayed RMSNorm exists (``+aiter``), ``hc_mult == 4`` and no micro-batching (warmreg has no DBO setting:
taken off). Inside FULL CUDA-graph capture of steps of 1..128 tokens, ``mhc_pre_delayed_overlap`` runs it at every
seam that has a post block, a carried pre-mix and the fused norm: the attention seam of every layer after the first
without engram injection, and every FFN seam. ``DeepseekV4DecoderLayer.__init__`` registers vLLM's warmup at the
model's ``hidden_size`` and the norm weight's dtype.

Key: ``H`` and its tile, the weight dtype and the warps (vLLM's kernel takes ``H`` as a constexpr; the token count is
the grid). ``norm_eps`` is a float argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4

__all__ = ["MhcPostCollapseRmsNorm", "MhcPostCollapseRmsNormKey", "mhc_post_collapse_rms_norm_reference", "register"]

_NUM_WARPS = 16  # vLLM's launch
_WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@triton.jit
def _post_stream(post_ptr, comb_ptr, t, j: tl.constexpr, x, f0, f1, f2, f3):
    comb = comb_ptr + t * 16 + j  # comb[t, h, j] at t * 16 + h * 4 + j
    acc = tl.load(post_ptr + t * 4 + j) * x
    acc = acc + tl.load(comb) * f0
    acc = acc + tl.load(comb + 4) * f1
    acc = acc + tl.load(comb + 8) * f2
    acc = acc + tl.load(comb + 12) * f3
    return acc.to(tl.bfloat16)


@triton.jit
def _mhc_post_collapse_kernel(
    residual_ptr,  # [T, 4, H] bf16, contiguous
    x_ptr,  # [T, H] bf16, contiguous
    post_ptr,  # [T, 4, 1] fp32, contiguous
    comb_ptr,  # [T, 4, 4] fp32, contiguous
    pre_ptr,  # [T, 4] fp32, contiguous
    weight_ptr,  # [H]
    residual_out_ptr,  # [T, 4, H] bf16
    out_ptr,  # [T, H] bf16
    eps,
    H: tl.constexpr,  # hidden_size: a model constant
    BLOCK_H: tl.constexpr,  # next_pow2(H): the row in one tile
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    row = residual_ptr + t * 4 * H + cols
    f0 = tl.load(row, mask=live, other=0.0).to(tl.float32)
    f1 = tl.load(row + H, mask=live, other=0.0).to(tl.float32)
    f2 = tl.load(row + 2 * H, mask=live, other=0.0).to(tl.float32)
    f3 = tl.load(row + 3 * H, mask=live, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * H + cols, mask=live, other=0.0).to(tl.float32)
    g0 = _post_stream(post_ptr, comb_ptr, t, 0, x, f0, f1, f2, f3)
    g1 = _post_stream(post_ptr, comb_ptr, t, 1, x, f0, f1, f2, f3)
    g2 = _post_stream(post_ptr, comb_ptr, t, 2, x, f0, f1, f2, f3)
    g3 = _post_stream(post_ptr, comb_ptr, t, 3, x, f0, f1, f2, f3)
    dst = residual_out_ptr + t * 4 * H + cols
    tl.store(dst, g0, mask=live)
    tl.store(dst + H, g1, mask=live)
    tl.store(dst + 2 * H, g2, mask=live)
    tl.store(dst + 3 * H, g3, mask=live)
    pre = pre_ptr + t * 4
    c = tl.load(pre) * g0.to(tl.float32)
    c = c + tl.load(pre + 1) * g1.to(tl.float32)
    c = c + tl.load(pre + 2) * g2.to(tl.float32)
    c = c + tl.load(pre + 3) * g3.to(tl.float32)
    c = c.to(tl.bfloat16).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(c * c, 0) * (1.0 / H) + eps)
    w = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, ((c * rstd) * w).to(tl.bfloat16), mask=live)


@attrs.frozen(kw_only=True)
class MhcPostCollapseRmsNormKey(warmreg.CompileKey):
    """What changes the binary: the hidden size and its tile, the norm weight's dtype, the warps."""

    hidden: int
    block_h: int
    weight_dtype: str
    num_warps: int


class MhcPostCollapseRmsNorm(warmreg.TritonKernel[MhcPostCollapseRmsNormKey]):
    """The post block, collapse and RMSNorm of a delayed mHC seam (the module docstring has the math).

    :param hidden_size: the model's ``hidden_size``; ``dtype``: the norm weight's, torch's name (the model dtype).
        Domains only.
    """

    name = "deepseek_v4.v41_rocm_mhc_post_collapse_rmsnorm"
    key_type = MhcPostCollapseRmsNormKey
    jit = _mhc_post_collapse_kernel

    def __init__(self, *, hidden_size: int = 5120, dtype: str = "bfloat16") -> None:
        self.hidden_size, self.dtype = hidden_size, dtype

    def dispatch(self, *, residual: torch.Tensor, norm_weight: torch.Tensor) -> MhcPostCollapseRmsNormKey:
        h = residual.shape[-1]
        return MhcPostCollapseRmsNormKey(
            hidden=h, block_h=triton.next_power_of_2(h), weight_dtype=str(norm_weight.dtype).removeprefix("torch."),
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h = self.hidden_size
        weight = warmreg.meta((h,), _WEIGHT_DTYPES[self.dtype])
        return {"residual": [warmreg.meta((1, 4, h), torch.bfloat16)], "norm_weight": [weight]}

    def warmup_inputs(self, key: MhcPostCollapseRmsNormKey) -> Mapping[str, Any]:
        h, f32 = key.hidden, torch.float32
        return {
            "residual": warmreg.meta((1, 4, h), torch.bfloat16), "sublayer_out": warmreg.meta((1, h), torch.bfloat16),
            "post_layer_mix": warmreg.meta((1, 4, 1), f32), "comb_res_mix": warmreg.meta((1, 4, 4), f32),
            "pre_mix": warmreg.meta((1, 4), f32), "norm_weight": warmreg.meta((h,), _WEIGHT_DTYPES[key.weight_dtype]),
            "norm_eps": 1e-6,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        residual: torch.Tensor,
        sublayer_out: torch.Tensor,
        post_layer_mix: torch.Tensor,
        comb_res_mix: torch.Tensor,
        pre_mix: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[MhcPostCollapseRmsNormKey]:
        """``(residual_out [T, 4, H], layer_input [T, H])`` bf16, fresh or ``out`` (vLLM's
        ``mhc_post_collapse_rms_norm_triton``, same arguments; the inputs contiguous, as it makes them).

        :param residual: bf16 ``[T, 4, H]``; ``sublayer_out``: bf16 ``[T, H]``; ``post_layer_mix``: fp32 ``[T, 4, 1]``;
            ``comb_res_mix``: fp32 ``[T, 4, 4]``; ``pre_mix``: fp32 ``[T, 4]``: all contiguous.
        :param norm_weight: ``[H]`` contiguous, bf16 / fp16 / fp32; ``norm_eps``: the RMSNorm epsilon.
        :param out: two buffers instead of fresh ones, each exactly as the fresh one.
        :raises warmreg.LaunchError: for an input of another dtype, shape or layout, or an ``out`` unlike the fresh
            buffers.
        """
        self._check(residual, sublayer_out, post_layer_mix, comb_res_mix, pre_mix, norm_weight)
        t, _, h = residual.shape
        parts = (None, None) if out is None else out
        if not isinstance(parts, tuple) or len(parts) != 2:
            raise warmreg.LaunchError(self.name, "out must be a tuple of 2 buffers (residual_out, layer_input)")
        res_out = warmreg.output(self.name, "out[0]", parts[0], (t, 4, h), torch.bfloat16, residual.device)
        layer_in = warmreg.output(self.name, "out[1]", parts[1], (t, h), torch.bfloat16, residual.device)
        key = self.dispatch(residual=residual, norm_weight=norm_weight)
        kwargs = dict(
            residual_ptr=residual, x_ptr=sublayer_out, post_ptr=post_layer_mix, comb_ptr=comb_res_mix,
            pre_ptr=pre_mix, weight_ptr=norm_weight, residual_out_ptr=res_out, out_ptr=layer_in, eps=norm_eps,
            H=key.hidden, BLOCK_H=key.block_h,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t,) if t else None, kwargs, (res_out, layer_in))

    def _check(self, residual: torch.Tensor, *rest: torch.Tensor) -> None:
        t, h = (residual.shape[0], residual.shape[-1]) if residual.ndim == 3 else (-1, -1)
        f32 = torch.float32
        wanted = (
            ("residual", (t, 4, h), (torch.bfloat16,)), ("sublayer_out", (t, h), (torch.bfloat16,)),
            ("post_layer_mix", (t, 4, 1), (f32,)), ("comb_res_mix", (t, 4, 4), (f32,)), ("pre_mix", (t, 4), (f32,)),
            ("norm_weight", (h,), tuple(_WEIGHT_DTYPES.values())),
        )  # fmt: skip
        for (what, shape, dtypes), tensor in zip(wanted, (residual, *rest), strict=True):
            if tuple(tensor.shape) != shape or tensor.dtype not in dtypes or not tensor.is_contiguous():
                raise warmreg.LaunchError(
                    self.name,
                    f"{what} must be a contiguous {shape} tensor of {', '.join(str(d) for d in dtypes)} "
                    f"(got {tensor.dtype} {tuple(tensor.shape)})",
                )


def mhc_post_collapse_rms_norm_reference(
    residual: torch.Tensor,
    sublayer_out: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    pre_mix: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``(residual_out, layer_input)`` in the kernel's order, bf16 rounded to nearest (Triton's
    interpreter truncates fp32 -> bf16, so a comparison under it allows a bf16 step or two)."""
    f = residual.float()
    x = sublayer_out.float()
    streams = []
    for j in range(4):
        acc = post_layer_mix[:, j, :].float() * x
        for h in range(4):
            acc = acc + comb_res_mix[:, h, j : j + 1].float() * f[:, h]
        streams.append(acc.to(torch.bfloat16))
    c = pre_mix[:, 0:1].float() * streams[0].float()
    for j in range(1, 4):
        c = c + pre_mix[:, j : j + 1].float() * streams[j].float()
    c = c.to(torch.bfloat16).float()
    rstd = torch.rsqrt((c * c).sum(-1, keepdim=True) * (1.0 / c.shape[-1]) + norm_eps)
    return torch.stack(streams, dim=1), ((c * rstd) * norm_weight.float()).to(torch.bfloat16)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the seam kernel for V4.1 with ``hc_mult == 4`` on gfx950 with aiter (``supports_mhc_overlap``)."""
    kernel = MhcPostCollapseRmsNorm(hidden_size=model.hidden_size, dtype=model.dtype)
    on = model.v41 and model.hc_mult == 4
    registry.add(kernel, when=warmreg.rocm_arch_in("gfx950") & warmreg.has_feature("aiter") if on else False)
