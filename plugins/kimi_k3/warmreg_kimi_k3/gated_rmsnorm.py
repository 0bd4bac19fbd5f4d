"""The gated RMSNorm at the end of a KDA layer: ``o = rmsnorm(x; w, eps) * sigmoid(g)``, per head.

This is the KDA layer's ``o_norm`` (``vllm/models/kimi_k3/nvidia/kda.py``: ``FusedRMSNormGated(head_dim,
activation="sigmoid")``, the last statement of ``KimiK3DeltaAttention._forward``), whose Triton path is
``vllm/third_party/flash_linear_attention/ops/kda.py``: ``rms_norm_gated`` -> ``layer_norm_gated_fwd`` ->
``layer_norm_gated_fwd_kernel`` (``IS_RMS_NORM``, ``ACTIVATION="sigmoid"``, a weight, no bias, no residual).
That kernel is not autotuned: a ``@triton.heuristics`` only turns the absent residual / weight / bias pointers
into flags, and the launch is fixed: 16 rows a program and 8 warps for ``D <= 512`` (Kimi-K3: ``D = 128``), else
``layer_norm_gated_fwd_kernel1`` with one row a program and 4 warps. The same two tiles are used here.

Math, for each row ``r`` of ``x`` seen as ``[R, D]`` (``R = tokens * H``; row ``r`` is head ``r % H`` of token
``r // H``), in fp32::

    rstd = 1 / sqrt(sum_d x[r, d]^2 / D + eps)
    o[r, d] = cast(x[r, d] * rstd * w[d] * sigmoid(g[r // H, r % H, d]), dtype of x)

``x`` is the layer's core attention output ``[1, T, H, D]`` (contiguous), ``g`` the output-gate projection
``[T, H, D]``: a column view of the fused ``in_proj_qkvgfab`` output, so its token stride is the projection's
width (6288 for the example at TP 8, 6144 on the projection-overlap path of ``low_latency_gemm.py``) and a runtime
argument here; ``w`` is ``o_norm.weight`` ``[D]`` in the model dtype. vLLM writes into ``x``; this op returns a
fresh tensor (the layer copies the result into ``x``).

Where it runs: at the end of every KDA step that is not taken whole by a fused decode kernel, i.e. every step
with prefill tokens (whatever ``kda_prefill_backend`` resolves to: FlashKDA, FlashInfer or Triton), speculative
decode on the ``native`` spec backend, and plain decode on the ``triton`` decode backend. Every deployment
prefills, so it is registered whenever there are KDA layers, on CUDA and XPU: there Kimi-K3 defaults to breakable
CUDA graphs, which set ``CompilationMode.NONE``, so custom ops stay enabled and ``FusedRMSNormGated`` takes
``forward_cuda`` (``forward_xpu`` calls it). On ROCm (``models/kimi_k3/amd``) the model compiles with Inductor and
default custom ops ``none``: ``forward_native``, plain PyTorch, so nothing is registered there.

Key: the dtypes, ``H`` and ``D`` (constexprs: model constants), the tile, the integer class of ``g``'s token
stride and the alignment of ``x`` and ``g``. The row count is not specialized, so one binary serves every batch
(vLLM's kernel specializes its ``T`` and takes the gate stride as a constexpr).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .backends import kda_layout
from .model import PLUGIN, KimiK3

__all__ = ["DEFAULT_EPS", "GatedRMSNorm", "GatedRMSNormKey", "gated_rmsnorm_reference", "register"]

#: ``FusedRMSNormGated``'s default epsilon, which the KDA layer keeps (a runtime argument: not in the key).
DEFAULT_EPS = 1e-5
#: Head dims up to this take the 16-row tile, larger ones one row a program (``layer_norm_gated_fwd``'s split).
TILED_MAX_D = 512


# The row count is a runtime bound only; the weight is one [D] vector a program, loaded once.
@triton.jit(do_not_specialize=["num_rows"], do_not_specialize_on_alignment=["w_ptr"])
def _gated_rmsnorm_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    o_ptr,
    num_rows,
    g_stride,  # g's token stride: the fused projection's width
    eps,
    H: tl.constexpr,  # heads on this rank: row r is head r % H of token r // H
    D: tl.constexpr,  # head dim: a model constant
    BLOCK_T: tl.constexpr,  # rows per program: 16 (D <= 512) or 1
    BLOCK_D: tl.constexpr,  # next_pow2(D): one tile covers a row
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    mask_d = cols < D
    mask = (rows < num_rows)[:, None] & mask_d[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)
    g_rows = (rows // H) * g_stride + (rows % H) * D
    g = tl.load(g_ptr + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o = x * rstd[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=mask)


@attrs.frozen(kw_only=True)
class GatedRMSNormKey(warmreg.CompileKey):
    """What changes the binary of the gated RMSNorm."""

    dtype: str  # x and o
    gate_dtype: str
    weight_dtype: str
    num_heads: int  # H
    head_dim: int  # D
    block_t: int
    block_d: int
    g_stride: warmreg.IntClass  # g's token stride (a fused projection's width)
    x_aligned: bool
    g_aligned: bool
    num_warps: int


def _tile(head_dim: int) -> tuple[int, int]:
    """``(rows per program, num_warps)``: ``layer_norm_gated_fwd``'s two launches."""
    return (16, 8) if head_dim <= TILED_MAX_D else (1, 4)


def projection_width(num_heads: int, head_dim: int) -> int:
    """The row width of the KDA layer's fused ``in_proj_qkvgfab`` output on one rank: q, k, v and g
    (``4 * H * D``), ``f_a`` (``D``), beta (``H``), padded to a multiple of 16 columns
    (``KimiK3DeltaAttention.__init__``; the FP8 per-block weight-only checkpoint pads to 128 instead)."""
    width = 4 * num_heads * head_dim + head_dim + num_heads
    return width + (-width % 16)


class GatedRMSNorm(warmreg.TritonKernel[GatedRMSNormKey]):
    """The gated RMSNorm of the KDA output (the module docstring has the math).

    :param num_heads: KDA heads on one rank (domains only).
    :param head_dim: ``D`` (domains only).
    :param dtype: activation dtype name (x, g, the weight and o).
    """

    name = "kimi_k3.gated_rmsnorm"
    key_type = GatedRMSNormKey
    jit = _gated_rmsnorm_kernel

    def __init__(self, *, num_heads: int, head_dim: int, dtype: str = "bfloat16") -> None:
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dtype = getattr(torch, dtype)

    def dispatch(self, *, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> GatedRMSNormKey:
        d = x.shape[-1]
        block_t, num_warps = _tile(d)
        return GatedRMSNormKey(
            dtype=warmreg.dtype_name(x.dtype),
            gate_dtype=warmreg.dtype_name(g.dtype),
            weight_dtype=warmreg.dtype_name(weight.dtype),
            num_heads=g.shape[1],
            head_dim=d,
            block_t=block_t,
            block_d=warmreg.next_pow2(d),
            g_stride=warmreg.int_class(g.stride(0)),
            x_aligned=warmreg.is_aligned(x),
            g_aligned=warmreg.is_aligned(g),
            num_warps=num_warps,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """Token counts of every class, each with the layer's fresh ``[1, T, H, D]`` output and the gate
        columns ``[3HD, 4HD)`` of the fused projection at its usual width and at the ``4HD`` width of the
        projection-overlap path."""
        h, d, dt = self.num_heads, self.head_dim, self.dtype
        weight = warmreg.meta((d,), dt)
        return [
            {
                "x": warmreg.meta((1, t, h, d), dt),
                "g": warmreg.meta((t, h, d), dt, stride=(width, d, 1), offset=3 * h * d),
                "weight": weight,
            }
            for t in warmreg.token_counts(config, plugin=PLUGIN)
            if t
            for width in (projection_width(h, d), 4 * h * d)
        ]

    def warmup_inputs(self, key: GatedRMSNormKey) -> Mapping[str, Any]:
        h, d = key.num_heads, key.head_dim
        stride = warmreg.int_class_rep(key.g_stride)
        return {
            "x": warmreg.meta((1, h, d), getattr(torch, key.dtype), offset=0 if key.x_aligned else 1),
            "g": warmreg.meta(
                (1, h, d), getattr(torch, key.gate_dtype), stride=(stride, d, 1), offset=0 if key.g_aligned else 1
            ),
            "weight": warmreg.meta((d,), getattr(torch, key.weight_dtype)),
            "eps": DEFAULT_EPS,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        weight: torch.Tensor,
        eps: float = DEFAULT_EPS,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[GatedRMSNormKey]:
        """Normalise every head of ``x`` and gate it with ``sigmoid(g)``; returns a tensor like ``x`` (``out``, or
        a fresh one).

        :param x: ``[..., D]`` contiguous, ``T * H`` rows of ``D`` (e.g. the layer's ``[1, T, H, D]``).
        :param g: ``[T, H, D]``, heads and ``D`` contiguous; the token stride is free (a projection view).
        :param weight: ``[D]`` contiguous, the norm's weight.
        :param eps: the norm's epsilon.
        :param out: a preallocated output, contiguous, x's shape and dtype (then nothing is allocated).
        :raises warmreg.LaunchError: for shapes, layouts, dtypes or devices the kernel cannot take, or an ``out``
            that is not the output's shape, dtype and layout.
        """
        self._check(x, g, weight)
        key = self.dispatch(x=x, g=g, weight=weight)
        o = warmreg.output(self.name, "out", out, x.shape, x.dtype, x.device)
        rows = x.numel() // key.head_dim if key.head_dim else 0
        kwargs = dict(
            x_ptr=x, g_ptr=g, w_ptr=weight, o_ptr=o, num_rows=rows, g_stride=g.stride(0), eps=float(eps),
            H=key.num_heads, D=key.head_dim, BLOCK_T=key.block_t, BLOCK_D=key.block_d,
        )  # fmt: skip
        grid = ((rows + key.block_t - 1) // key.block_t,) if rows else None
        return warmreg.LaunchSpec(key, grid, kwargs, o)

    def _check(self, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if g.ndim != 3 or g.stride(2) != 1 or g.stride(1) != g.shape[2]:
            fail(f"g must be [T, H, D] with heads and D contiguous (got {tuple(g.shape)}, strides {g.stride()})")
        t, h, d = g.shape
        if x.ndim < 1 or x.shape[-1] != d or x.numel() != t * h * d or not x.is_contiguous():
            fail(
                f"x {tuple(x.shape)} must be contiguous with last dim D = {d} and T * H * D = {t * h * d} elements",
                fix="pass the layer's [1, T, H, D] output for the gate's T tokens",
            )
        if weight.shape != (d,) or not weight.is_contiguous():
            fail(f"weight must be a contiguous [D] = [{d}] vector (got {tuple(weight.shape)})")
        if not all(a.dtype.is_floating_point for a in (x, g, weight)):
            fail(f"x, g and weight must be floating point (got {x.dtype}, {g.dtype}, {weight.dtype})")
        if len({a.device for a in (x, g, weight)}) > 1:
            fail(f"x, g and weight must be on one device (got {x.device}, {g.device}, {weight.device})")


def gated_rmsnorm_reference(
    x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """PyTorch reference of :class:`GatedRMSNorm`: fp32 math, one cast to x's dtype."""
    t, h, d = g.shape
    xf = x.reshape(t, h, d).float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float() * torch.sigmoid(g.float())).to(x.dtype).reshape(x.shape)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gated RMSNorm on CUDA and XPU when there are KDA layers (see the module docstring: every
    step with prefill tokens runs it, whatever the KDA prefill and decode backends).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return
    kernel = GatedRMSNorm(num_heads=layout.num_heads, head_dim=layout.head_dim, dtype=m.dtype)
    registry.add(kernel, when=warmreg.is_cuda | warmreg.is_xpu)
