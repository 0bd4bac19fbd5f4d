"""The DSA indexer query of a Kimi-K3.1 layer to FP8, each head's scale folded into its weight (vLLM 0.34
``models/kimi_k3/nvidia/ops/dsa_indexer.py``: ``indexer_q_quant_fold_weights``,
``_indexer_q_quant_fold_weights_kernel``).

Math, for each token ``t < T`` and head ``h < H`` of ``index_q [T, H, D]`` (``D`` a power of two) and
``index_weights [T, H]``, with ``weight_scale`` (vLLM: ``D ** -0.5 * H ** -0.5``)::

    x = float32(index_q[t, h])
    scale = 2 ** ceil(log2(max(amax|x|, 1e-10) / 448))           (per_token_group_quant_fp8 with UE8M0, eps 1e-10)
    q_fp8[t, h] = e4m3fn(clamp(x / scale, -448, 448))
    weights[t, h] = float32(index_weights[t, h]) * scale * weight_scale

into fresh ``q_fp8 [T, P, D]`` (e4m3fn) and ``weights [T, P]`` (float32), ``P = padded_num_heads`` (32 or 64,
DeepGEMM's widths); heads ``H .. P - 1`` are zero (the outputs are zero-filled when ``P > H``). Grid ``(T, H)``, one
warp, as in vLLM.

Where it runs: ``KimiK3DSAIndexer.score`` on every forward step of a DSA layer with an FP8 indexer cache, fused
prologue or not (see :mod:`.dsa`), before ``sparse_attn_indexer``.

Key: the input dtypes and ``D``. Unlike vLLM's kernel, strides are unspecialized runtime ints and no pointer is
specialized on alignment (``index_q`` and the weights are column views of projection outputs): one binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dsa import DSALayout, dsa_layout
from .dsa_k_insert import FP8_MAX, _pow2_scale, fp8_pow2_quant_reference
from .model import PLUGIN, KimiK3

__all__ = ["DSAQQuantFoldWeights", "DSAQQuantKey", "dsa_q_quant_reference", "register"]

_INTS = ["q_stride0", "q_stride1", "w_stride0", "w_stride1", "out_q_stride0", "out_w_stride0"]
_POINTERS = ["q_ptr", "w_ptr", "out_q_ptr", "out_w_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _dsa_q_quant_kernel(
    q_ptr,  # [T, H, D], unit stride over D
    q_stride0,
    q_stride1,
    w_ptr,  # [T, H]
    w_stride0,
    w_stride1,
    out_q_ptr,  # [T, P, D] float8e4nv, contiguous
    out_q_stride0,
    out_w_ptr,  # [T, P] float32, contiguous
    out_w_stride0,
    weight_scale,
    D: tl.constexpr,  # index_head_dim: one quant block per head
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    x = tl.load(q_ptr + t * q_stride0 + h * q_stride1 + d).to(tl.float32)
    scale = _pow2_scale(tl.max(tl.abs(x), axis=0), 1e-10)
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    tl.store(out_q_ptr + t * out_q_stride0 + h * D + d, q)
    w = tl.load(w_ptr + t * w_stride0 + h * w_stride1).to(tl.float32)
    tl.store(out_w_ptr + t * out_w_stride0 + h, w * scale * weight_scale)


@attrs.frozen(kw_only=True)
class DSAQQuantKey(warmreg.CompileKey):
    """What changes the binary of the DSA query quant: no stride, size, head count or alignment does."""

    q_dtype: str
    weights_dtype: str
    head_dim: int
    num_warps: int


class DSAQQuantFoldWeights(warmreg.TritonKernel[DSAQQuantKey]):
    """The DSA indexer query's per-head FP8 quant with the scales folded into the head weights (the module
    docstring has the math).

    :param layout: the deployment's DSA layout (domains only).
    :param max_num_batched_tokens: tokens in a step (domains only).
    """

    name = "kimi_k3.dsa_q_quant_fold_weights"
    key_type = DSAQQuantKey
    jit = _dsa_q_quant_kernel

    def __init__(self, *, layout: DSALayout, max_num_batched_tokens: int) -> None:
        self.layout, self.max_num_batched_tokens = layout, max_num_batched_tokens

    def dispatch(self, *, index_q: torch.Tensor, index_weights: torch.Tensor) -> DSAQQuantKey:
        return DSAQQuantKey(
            q_dtype=warmreg.dtype_name(index_q.dtype), weights_dtype=warmreg.dtype_name(index_weights.dtype),
            head_dim=index_q.shape[-1], num_warps=1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        lay, t = self.layout, self.max_num_batched_tokens
        dtype = getattr(torch, lay.dtype)  # both are column slices of bf16 projection outputs
        return {
            "index_q": [warmreg.meta((t, lay.index_num_heads, lay.index_head_dim), dtype)],
            "index_weights": [warmreg.meta((t, lay.index_num_heads), dtype)],
        }

    def warmup_inputs(self, key: DSAQQuantKey) -> Mapping[str, Any]:
        return {
            "index_q": warmreg.meta((1, 1, key.head_dim), getattr(torch, key.q_dtype)),
            "index_weights": warmreg.meta((1, 1), getattr(torch, key.weights_dtype)),
            "weight_scale": 1.0,
            "padded_num_heads": 32,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        weight_scale: float,
        padded_num_heads: int,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[DSAQQuantKey]:
        """``(q_fp8 [T, P, D], weights [T, P] float32)`` (vLLM's ``indexer_q_quant_fold_weights``, same arguments).

        :param index_q: ``[T, H, D]`` float, unit stride over ``D`` (a power of two), any other strides.
        :param index_weights: ``[T, H]`` float, any strides.
        :param weight_scale: folded into every weight.
        :param padded_num_heads: ``P >= H``; heads ``H .. P - 1`` of both outputs are zero.
        :param out: preallocated ``(q_fp8, weights)``, contiguous, of the outputs' shapes and dtypes; with
            ``P > H`` their padded heads are zeroed here, as vLLM's zero-filled allocation does.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take, or a wrong ``out``.
        """
        self._check(index_q, index_weights, padded_num_heads)
        key = self.dispatch(index_q=index_q, index_weights=index_weights)
        t, h, d = index_q.shape
        if out is not None and (not isinstance(out, tuple | list) or len(out) != 2):
            raise warmreg.LaunchError(
                self.name, f"out must be a tuple of 2 buffers (q_fp8, weights), got {type(out).__name__}"
            )
        dev, shapes = index_q.device, ((t, padded_num_heads, d), (t, padded_num_heads))
        q_fp8 = warmreg.output(
            self.name, "out[0]", None if out is None else out[0], shapes[0], torch.float8_e4m3fn, dev
        )
        weights = warmreg.output(self.name, "out[1]", None if out is None else out[1], shapes[1], torch.float32, dev)
        if padded_num_heads > h:
            q_fp8.view(torch.uint8)[:, h:].zero_()
            weights[:, h:].zero_()
        kwargs = dict(
            q_ptr=index_q, q_stride0=index_q.stride(0), q_stride1=index_q.stride(1),
            w_ptr=index_weights, w_stride0=index_weights.stride(0), w_stride1=index_weights.stride(1),
            out_q_ptr=q_fp8, out_q_stride0=q_fp8.stride(0), out_w_ptr=weights, out_w_stride0=weights.stride(0),
            weight_scale=weight_scale, D=key.head_dim,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, h) if t and h else None, kwargs, (q_fp8, weights))

    def _check(self, q: torch.Tensor, w: torch.Tensor, padded: int) -> None:
        d = q.shape[-1] if q.ndim == 3 else 0
        if q.ndim != 3 or not q.dtype.is_floating_point or q.stride(2) != 1 or d != warmreg.next_pow2(d) or d < 4:
            raise warmreg.LaunchError(self.name, f"index_q must be a float [T, H, D] with D a power of two and unit "
                                      f"stride over D (got {q.dtype} {tuple(q.shape)}, strides {q.stride()})")  # fmt: skip
        if w.shape != q.shape[:2] or not w.dtype.is_floating_point:
            raise warmreg.LaunchError(self.name, f"index_weights must be a float [T, H] = {tuple(q.shape[:2])} "
                                      f"(got {w.dtype} {tuple(w.shape)})")  # fmt: skip
        if padded < q.shape[1]:
            raise warmreg.LaunchError(
                self.name, f"padded_num_heads ({padded}) must be at least the heads ({q.shape[1]})"
            )
        if q.device != w.device:
            raise warmreg.LaunchError(self.name, f"inputs on {q.device} and {w.device}: use one device")


def dsa_q_quant_reference(
    index_q: torch.Tensor, index_weights: torch.Tensor, weight_scale: float, padded_num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`DSAQQuantFoldWeights`: ``(q_fp8, weights)``."""
    t, h, d = index_q.shape
    q, scale = fp8_pow2_quant_reference(index_q.float(), 1e-10)  # |x| / scale <= 448: the clamp never bites
    q_fp8 = torch.zeros((t, padded_num_heads, d), dtype=torch.float8_e4m3fn, device=index_q.device)
    weights = torch.zeros((t, padded_num_heads), dtype=torch.float32, device=index_q.device)
    q_fp8[:, :h] = q
    weights[:, :h] = index_weights.float() * scale[..., 0] * weight_scale
    return q_fp8, weights


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the query quant on every deployment with DSA layers and an FP8 indexer cache (see :mod:`.dsa`).

    :raises warmreg.ConfigError: for a malformed ``dsa_config`` or a missing ``serving.max_num_batched_tokens``.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or layout.indexer_fp4:
        return
    tokens = config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN)
    registry.add(DSAQQuantFoldWeights(layout=layout, max_num_batched_tokens=tokens), when=warmreg.is_cuda)
