"""DeepSeek-V4.1's engram gate: the gated update of the hyper-connection streams from the engram projection
(vLLM 0.34 ``models/deepseek_v41/common/engram.py``: ``Engram._post_wkv`` / ``_fused_engram_post_wkv_kernel``).

``kv = wkv(rows)`` is ``[T_kv, (C + 1) * D]``: one key per stream ``c < C = hc_mult`` then one shared value. For
token ``t`` and stream ``c``, in fp32 over ``d < D = hidden_size``, with ``x = hidden[t, c]``, ``y = kv[t, c*D:(c+1)*D]``
and ``v = kv[t, C*D:]`` (both zero for ``t >= num_kv_tokens``)::

    dot  = sum(x * q_weight[c] * k_weight[c] * y) * rsqrt(mean(x^2) + eps) * rsqrt(mean(y^2) + eps) * rsqrt(D)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))          # 0 where token_mask[t] is False (or t >= T_kv)
    out[t, c] = x + gate * v                                      # stored in hidden's dtype

``out`` is a fresh tensor like ``hidden_states``. One program a ``(token, stream)`` pair, the row in one tile of
``next_pow2(D)``, 8 warps from a 2048-wide tile up, else 4, as in vLLM.

Where it runs: every engram layer's ``Engram.forward`` on CUDA (``DeepseekV4DecoderLayer.forward`` before the
layer's mHC pre-mix), every step: bf16 ``[T, hc_mult, hidden_size]`` streams, the bf16 ``wkv`` output
``[T, (hc_mult + 1) * hidden_size]``, bf16 ``[hc_mult, hidden_size]`` weights, eps ``rms_norm_eps``, clamp ``1e-6``
and always a bool token mask (``~image_sentinel_mask``, or the dummy hashes' all-False mask of a profile run), so
``HAS_MASK`` is on. ``num_kv_tokens`` is below ``T`` only under sequence parallelism (expert parallel with a
token-sharded MoE or data parallel), which warmreg has no setting for; the op takes it either way.

Key: ``D``, ``C``, the tile, the mask switch, the dtypes and the warps. Unlike vLLM's kernel, which specializes its
strides and pointers' alignment, every stride and ``num_kv_tokens`` are runtime integers that are not specialized
and no pointer is specialized on alignment.
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

__all__ = ["CLAMP", "EngramGate", "EngramGateKey", "engram_gate_reference", "register"]

#: vLLM's ``Engram.clamp_value``.
CLAMP = 1e-6
_INTS = [
    "num_kv_tokens", "hs_t", "hs_c", "hs_d", "kv_t", "kv_d", "q_c", "q_d", "k_c", "k_d", "mask_t", "out_t", "out_c",
    "out_d",
]  # fmt: skip
_PTRS = ["hidden_ptr", "kv_ptr", "q_ptr", "k_ptr", "mask_ptr", "out_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _engram_gate_kernel(
    hidden_ptr,  # [T, C, D]
    kv_ptr,  # [>= T_kv, (C + 1) * D]
    q_ptr,  # [C, D]
    k_ptr,  # [C, D]
    mask_ptr,  # [>= T_kv] bool (any pointer when HAS_MASK is off)
    out_ptr,  # [T, C, D]
    num_kv_tokens,
    hs_t,
    hs_c,
    hs_d,
    kv_t,
    kv_d,
    q_c,
    q_d,
    k_c,
    k_d,
    mask_t,
    out_t,
    out_c,
    out_d,
    eps,
    clamp,
    D: tl.constexpr,  # hidden_size: the row is one tile
    C: tl.constexpr,  # hc_mult: the value follows the C keys
    BLOCK: tl.constexpr,  # next_pow2(D)
    HAS_MASK: tl.constexpr,  # a token mask shuts the gate
):
    pid = tl.program_id(0)
    t = (pid // C).to(tl.int64)
    c = pid % C
    has_kv = t < num_kv_tokens
    d = tl.arange(0, BLOCK)
    live = d < D
    x = tl.load(hidden_ptr + t * hs_t + c * hs_c + d * hs_d, mask=live, other=0.0).to(tl.float32)
    y = tl.load(kv_ptr + t * kv_t + (c * D + d) * kv_d, mask=tl.where(has_kv, live, False), other=0.0).to(tl.float32)
    qw = tl.load(q_ptr + c * q_c + d * q_d, mask=live, other=0.0).to(tl.float32)
    kw = tl.load(k_ptr + c * k_c + d * k_d, mask=live, other=0.0).to(tl.float32)
    x_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y_rms = tl.rsqrt(tl.sum(y * y, axis=0) / D + eps)
    dot = tl.sum(x * qw * kw * y, axis=0)
    dot *= x_rms * y_rms * tl.rsqrt(D * 1.0)
    g = tl.sqrt(tl.maximum(tl.abs(dot), clamp))
    g = tl.where(dot < 0.0, -g, g)
    gate = tl.sigmoid(g)
    if HAS_MASK:
        keep = tl.load(mask_ptr + t * mask_t, mask=has_kv, other=0)
        gate = tl.where(keep, gate, 0.0)
    v = tl.load(kv_ptr + t * kv_t + (C * D + d) * kv_d, mask=tl.where(has_kv, live, False), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * out_t + c * out_c + d * out_d, x + gate * v, mask=live)


@attrs.frozen(kw_only=True)
class EngramGateKey(warmreg.CompileKey):
    """What changes the binary of the gate: the widths, the tile, the mask switch, the dtypes and the warps."""

    dim: int
    hc_mult: int
    block: int
    has_mask: bool
    dtype: str  # hidden_states and out
    kv_dtype: str
    weight_dtype: str
    num_warps: int


class EngramGate(warmreg.TritonKernel[EngramGateKey]):
    """The engram's gated update of the ``hc_mult`` streams (the module docstring has the math).

    :param hidden_size: the model's ``hidden_size`` (domains only).
    :param hc_mult: the model's ``hc_mult`` (domains only).
    :param dtype: the model dtype (domains only).
    """

    name = "deepseek_v4.v41_engram_gate"
    key_type = EngramGateKey
    jit = _engram_gate_kernel

    def __init__(self, *, hidden_size: int, hc_mult: int, dtype: str) -> None:
        self.hidden_size, self.hc_mult, self.dtype = hidden_size, hc_mult, dtype

    def dispatch(
        self, *, hidden_states: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, token_mask: torch.Tensor | None
    ) -> EngramGateKey:
        _, c, d = hidden_states.shape
        block = warmreg.next_pow2(d)
        return EngramGateKey(
            dim=d, hc_mult=c, block=block, has_mask=token_mask is not None,
            dtype=warmreg.dtype_name(hidden_states.dtype), kv_dtype=warmreg.dtype_name(kv.dtype),
            weight_dtype=warmreg.dtype_name(q_weight.dtype), num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype, c, d = getattr(torch, self.dtype), self.hc_mult, self.hidden_size
        return {
            "hidden_states": [warmreg.meta((1, c, d), dtype)],  # no size is in the key
            "kv": [warmreg.meta((1, (c + 1) * d), dtype)],
            "q_weight": [warmreg.meta((c, d), dtype)],
            "token_mask": [warmreg.meta((1,), torch.bool)],
        }

    def warmup_inputs(self, key: EngramGateKey) -> Mapping[str, Any]:
        c, d, dtype = key.hc_mult, key.dim, getattr(torch, key.dtype)
        weight = warmreg.meta((c, d), getattr(torch, key.weight_dtype))
        return {
            "hidden_states": warmreg.meta((1, c, d), dtype),
            "kv": warmreg.meta((1, (c + 1) * d), getattr(torch, key.kv_dtype)),
            "q_weight": weight,
            "k_weight": weight,
            "token_mask": warmreg.meta((1,), torch.bool) if key.has_mask else None,
            "eps": 1e-6,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        hidden_states: torch.Tensor,
        kv: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        num_kv_tokens: int | None = None,
        *,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        clamp: float = CLAMP,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[EngramGateKey]:
        """The updated streams, like ``hidden_states`` (``out``, or a fresh tensor); vLLM's ``Engram._post_wkv``
        arguments, the module's weights and constants as keywords.

        :param hidden_states: ``[T, C, D]``, any strides.
        :param kv: ``[>= num_kv_tokens, (C + 1) * D]``, any strides: the ``wkv`` output.
        :param token_mask: bool ``[>= num_kv_tokens]``, any stride, or None (every gate open).
        :param num_kv_tokens: tokens with a ``kv`` row (default ``kv.shape[0]``); later tokens pass through.
        :param q_weight: ``[C, D]``, any strides.
        :param k_weight: ``[C, D]``, any strides, ``q_weight``'s dtype.
        :param eps: the RMS epsilon (``rms_norm_eps``).
        :param clamp: the floor of ``|dot|`` under the square root.
        :param out: a buffer instead of a fresh one: contiguous, ``hidden_states``' shape and dtype.
        :raises warmreg.LaunchError: naming the argument whose shape or dtype does not fit.
        """
        kv_tokens = kv.shape[0] if num_kv_tokens is None else num_kv_tokens
        self._check(hidden_states, kv, token_mask, kv_tokens, q_weight, k_weight)
        key = self.dispatch(hidden_states=hidden_states, kv=kv, q_weight=q_weight, token_mask=token_mask)
        t, c, d = hidden_states.shape
        out = warmreg.output(self.name, "out", out, (t, c, d), hidden_states.dtype, hidden_states.device)
        mask = token_mask if token_mask is not None else hidden_states
        kwargs = dict(
            hidden_ptr=hidden_states, kv_ptr=kv, q_ptr=q_weight, k_ptr=k_weight, mask_ptr=mask, out_ptr=out,
            num_kv_tokens=kv_tokens, hs_t=hidden_states.stride(0), hs_c=hidden_states.stride(1),
            hs_d=hidden_states.stride(2), kv_t=kv.stride(0), kv_d=kv.stride(1), q_c=q_weight.stride(0),
            q_d=q_weight.stride(1), k_c=k_weight.stride(0), k_d=k_weight.stride(1),
            mask_t=token_mask.stride(0) if token_mask is not None else 0, out_t=out.stride(0), out_c=out.stride(1),
            out_d=out.stride(2), eps=eps, clamp=clamp, D=key.dim, C=key.hc_mult, BLOCK=key.block,
            HAS_MASK=key.has_mask,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t * c,) if t else None, kwargs, out)

    def _check(
        self, hidden: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, kv_tokens: int, q: torch.Tensor,
        k: torch.Tensor,
    ) -> None:  # fmt: skip
        if hidden.ndim != 3 or not hidden.dtype.is_floating_point:
            raise warmreg.LaunchError(self.name, f"hidden_states must be a float [T, C, D] (got {tuple(hidden.shape)})")
        _, c, d = hidden.shape
        if kv.ndim != 2 or kv.shape[1] != (c + 1) * d or not 0 <= kv_tokens <= kv.shape[0]:
            raise warmreg.LaunchError(
                self.name,
                f"kv must be [>= num_kv_tokens = {kv_tokens}, (C + 1) * D = {(c + 1) * d}] (got {tuple(kv.shape)})",
            )
        if mask is not None and (mask.ndim != 1 or mask.dtype != torch.bool or mask.shape[0] < kv_tokens):
            raise warmreg.LaunchError(
                self.name, f"token_mask must be bool [>= {kv_tokens}] (got {mask.dtype} {tuple(mask.shape)})"
            )
        for name, w in (("q_weight", q), ("k_weight", k)):
            if w.shape != (c, d) or w.dtype != q.dtype:
                raise warmreg.LaunchError(
                    self.name, f"{name} must be [{c}, {d}] of one dtype (got {w.dtype} {tuple(w.shape)})"
                )


def engram_gate_reference(
    hidden_states: torch.Tensor, kv: torch.Tensor, token_mask: torch.Tensor | None = None,
    num_kv_tokens: int | None = None, *, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    clamp: float = CLAMP,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramGate` in fp32 (the module docstring's math)."""
    t, c, d = hidden_states.shape
    n = kv.shape[0] if num_kv_tokens is None else num_kv_tokens
    x = hidden_states.float()
    rows = torch.zeros(t, (c + 1) * d)
    rows[: min(n, t)] = kv[: min(n, t)].float()
    y, v = rows[:, : c * d].reshape(t, c, d), rows[:, c * d :].reshape(t, 1, d)
    dot = (x * q_weight.float() * k_weight.float() * y).sum(-1)
    dot = dot * torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(y.square().mean(-1) + eps) / d**0.5
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=clamp).sqrt())
    keep = torch.arange(t) < n
    if token_mask is not None:
        keep &= torch.zeros(t, dtype=torch.bool).index_copy(0, torch.arange(min(n, t)), token_mask[: min(n, t)].bool())
    gate = torch.where(keep[:, None], gate, 0.0)
    return (x + gate[..., None] * v).to(hidden_states.dtype)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gate for a V4.1 deployment with engram layers, on CUDA (every engram layer, every step)."""
    if model.engram is None:
        return
    kernel = EngramGate(hidden_size=model.hidden_size, hc_mult=model.hc_mult, dtype=model.dtype)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 else False)
