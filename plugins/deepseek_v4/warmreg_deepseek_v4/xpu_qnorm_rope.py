"""XPU attention's Q norm and RoPE, and the KV RoPE before the FP8 insert (vLLM 0.34
``models/deepseek_v4/xpu/xpu_qnorm_rope_kv_fp8_insert.py``: ``xpu_qnorm_rope_kv_fp8_insert`` → ``_xpu_qnorm_rope_kernel``,
called every XPU step by ``xpu_sparse.py: _fused_qnorm_rope_kv_insert`` from ``DeepseekV4Attention.forward``, and by
the XPU DSpark draft's ``_insert_context_kv`` (``xpu/dspark.py``) with a dummy ``q`` of the same shape; the insert that
follows is :class:`~.cache_insert.QuantInsertKCache`).

Math, for token ``t`` at position ``p`` (``c, s = cos_sin_cache[p, :32], cos_sin_cache[p, 32:]``, fp32) and GPT-J pairs
``(x[448 + 2i], x[448 + 2i + 1])``::

    q[t, h] <- x * rsqrt(sum(x * x) / 512 + eps)   then its pairs rotated: (e c - o s, e s + o c)   (in place)
    kv_roped[t] = kv[t] with its pairs rotated (no norm)

all in fp32, each store cast to the tensor's dtype. Grid ``(T, H + 1)``: program ``h < H`` one query head, ``h = H`` the
token's KV row.

Key: the dtypes, the local heads ``H`` and ``eps`` (constexprs, as vLLM), ``num_warps``; the token count is a runtime
int and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .fp8_ds_mla import HEAD_DIM, NOPE_DIM, ROPE_DIM, check_model_layout, uses_fp8_ds_mla
from .model import DSV4, PLUGIN

__all__ = ["XPUQNormRope", "XPUQNormRopeKey", "register", "xpu_qnorm_rope_reference"]

_POINTERS = ["q_ptr", "kv_ptr", "kv_out_ptr", "positions_ptr", "cos_sin_ptr"]


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=_POINTERS)
def _xpu_qnorm_rope_kernel(
    q_ptr,
    kv_ptr,
    kv_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_tokens,
    EPS: tl.constexpr,  # the query norm's epsilon (config.rms_norm_eps)
    NUM_HEADS: tl.constexpr,  # local query heads: program NUM_HEADS is the KV row
    HEAD: tl.constexpr,  # 512
    NOPE: tl.constexpr,  # 448: the rotated pairs follow
    HALF: tl.constexpr,  # 32 rotated pairs
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + i).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + i).to(tl.float32)
    d = tl.arange(0, HEAD)
    if h < NUM_HEADS:
        row = q_ptr + (t * NUM_HEADS + h) * HEAD
        x = tl.load(row + d).to(tl.float32)
        rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD + EPS)
        tl.store(row + d, (x * rms).to(q_ptr.dtype.element_ty), mask=d < NOPE)
        even = tl.load(row + NOPE + 2 * i).to(tl.float32) * rms
        odd = tl.load(row + NOPE + 2 * i + 1).to(tl.float32) * rms
        tl.store(row + NOPE + 2 * i, (even * cos - odd * sin).to(q_ptr.dtype.element_ty))
        tl.store(row + NOPE + 2 * i + 1, (even * sin + odd * cos).to(q_ptr.dtype.element_ty))
    else:
        src, dst = kv_ptr + t * HEAD, kv_out_ptr + t * HEAD
        tl.store(dst + d, tl.load(src + d), mask=d < NOPE)
        even = tl.load(src + NOPE + 2 * i).to(tl.float32)
        odd = tl.load(src + NOPE + 2 * i + 1).to(tl.float32)
        tl.store(dst + NOPE + 2 * i, (even * cos - odd * sin).to(kv_out_ptr.dtype.element_ty))
        tl.store(dst + NOPE + 2 * i + 1, (even * sin + odd * cos).to(kv_out_ptr.dtype.element_ty))


@attrs.frozen(kw_only=True)
class XPUQNormRopeKey(warmreg.CompileKey):
    """What changes the binary of the XPU Q norm + RoPE."""

    dtype: str  # q and kv (the model dtype)
    cos_sin_dtype: str
    num_heads: int
    eps: float
    num_warps: int


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class XPUQNormRope(warmreg.TritonKernel[XPUQNormRopeKey]):
    """The XPU Q norm + RoPE (see the module docstring).

    :param num_heads: local query heads (``num_attention_heads / tensor_parallel_size``).
    :param eps: the query norm's epsilon (``rms_norm_eps``).
    :param dtype: the model dtype name.
    """

    name = "deepseek_v4.xpu_qnorm_rope"
    key_type = XPUQNormRopeKey
    jit = _xpu_qnorm_rope_kernel

    def __init__(self, *, num_heads: int = 1, eps: float = 1e-6, dtype: str = "bfloat16") -> None:
        self.num_heads, self.eps, self.dtype = num_heads, eps, dtype

    def dispatch(self, *, q: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float) -> XPUQNormRopeKey:
        return XPUQNormRopeKey(
            dtype=_name(q.dtype), cos_sin_dtype=_name(cos_sin_cache.dtype), num_heads=q.shape[1], eps=float(eps),
            num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        return {
            "q": [warmreg.meta((1, self.num_heads, HEAD_DIM), dtype)],
            "cos_sin_cache": [warmreg.meta((16, ROPE_DIM), torch.float32)],
            "eps": [self.eps],
        }

    def warmup_inputs(self, key: XPUQNormRopeKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        return {
            "q": warmreg.meta((2, key.num_heads, HEAD_DIM), dtype),
            "kv": warmreg.meta((2, HEAD_DIM), dtype),
            "positions": warmreg.meta((2,), torch.int64),
            "cos_sin_cache": warmreg.meta((16, ROPE_DIM), getattr(torch, key.cos_sin_dtype)),
            "eps": key.eps,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[XPUQNormRopeKey]:
        """Normalize and rotate ``q`` in place; returns ``(q, kv_roped)`` (``out``: the ``kv_roped`` buffer).

        :param q: ``[T, H, 512]`` contiguous, the model dtype; ``kv``: ``[T, 512]`` contiguous, the same dtype.
        :param positions: int64 ``[T]``; ``cos_sin_cache``: ``[P, 64]`` contiguous rows, cosines then sines.
        :raises warmreg.LaunchError: naming the argument, for wrong shapes, dtypes or layouts.
        """
        t = q.shape[0]
        if q.ndim != 3 or q.shape[2] != HEAD_DIM or not q.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"q must be a contiguous [T, H, {HEAD_DIM}] tensor (got {tuple(q.shape)})"
            )
        if kv.shape != (t, HEAD_DIM) or kv.dtype != q.dtype or not kv.is_contiguous():
            raise warmreg.LaunchError(self.name, f"kv must be a contiguous [{t}, {HEAD_DIM}] tensor of q's dtype")
        if positions.shape != (t,) or positions.dtype != torch.int64:
            raise warmreg.LaunchError(self.name, f"positions must be int64 [{t}] (got {positions.dtype})")
        if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != ROPE_DIM or not cos_sin_cache.is_contiguous():
            raise warmreg.LaunchError(self.name, f"cos_sin_cache must be a contiguous [P, {ROPE_DIM}] tensor")
        kv_roped = warmreg.output(self.name, "out", out, (t, HEAD_DIM), kv.dtype, kv.device)
        key = self.dispatch(q=q, cos_sin_cache=cos_sin_cache, eps=eps)
        kwargs = dict(
            q_ptr=q, kv_ptr=kv, kv_out_ptr=kv_roped, positions_ptr=positions, cos_sin_ptr=cos_sin_cache,
            num_tokens=t, EPS=key.eps, NUM_HEADS=key.num_heads, HEAD=HEAD_DIM, NOPE=NOPE_DIM, HALF=ROPE_DIM // 2,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t, key.num_heads + 1) if t else None, kwargs, (q, kv_roped))


def xpu_qnorm_rope_reference(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`XPUQNormRope`: new ``(q, kv_roped)`` (``q`` itself untouched)."""
    cs = cos_sin_cache.float()[positions.long()]
    cos, sin = cs[:, : ROPE_DIM // 2], cs[:, ROPE_DIM // 2 :]

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., NOPE_DIM::2], x[..., NOPE_DIM + 1 :: 2]
        out = x.clone()
        out[..., NOPE_DIM::2], out[..., NOPE_DIM + 1 :: 2] = even * c - odd * s, even * s + odd * c
        return out

    x = q.float()
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) / HEAD_DIM + eps)
    q_new = rotate(x, cos[:, None], sin[:, None]).to(q.dtype)
    return q_new, rotate(kv.float(), cos, sin).to(kv.dtype)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register it on XPU (every step; the DSpark draft's context insert launches the same key). DeepSeek-V4.1 runs on
    CUDA only here.

    :raises warmreg.ConfigError: if ``serving.tensor_parallel_size`` does not divide the heads, or the head does not fit
        the layout (448 + 64).
    """
    if model.v41 or not platform.is_xpu or not uses_fp8_ds_mla(config, platform):
        return
    check_model_layout(model)
    tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
    if model.num_attention_heads % tp:
        raise warmreg.ConfigError(
            "serving.tensor_parallel_size", f"must divide num_attention_heads {model.num_attention_heads} (got {tp})",
            plugin=PLUGIN,
        )  # fmt: skip
    kernel = XPUQNormRope(num_heads=model.num_attention_heads // tp, eps=model.rms_norm_eps, dtype=model.dtype)
    registry.add(kernel, when=warmreg.is_xpu)
