"""DeepSeek-V4.1's engram gate with a tensor-parallel-sharded ``wkv`` on gfx942 / gfx950 (vLLM 0.34
``models/deepseek_v41/amd/engram.py``: ``RocmEngram._post_wkv``, ``_engram_gate_partials_kernel`` and
``_engram_gate_finish_kernel``): the math of :mod:`.v41_engram_gate`, split around one all-gather.

Each of ``P = tp`` ranks keeps ``W = D / P`` columns (``[r*W, (r+1)*W)``) of every key and of the value, so its
``kv`` is ``[T, (C + 1) * W]``. **Partials** (one program a token and a stream, or the value): rank ``r`` packs a
row of ``send`` (``kv``'s dtype, ``[T, W + 4*C]``): its value slice ``kv[t, C*W:]``, then for each stream ``c`` two
fp32 values stored in the bytes of four 16-bit columns (``send.view(float32)[t, W/2 + 2c : W/2 + 2c + 2]``)::

    (sum_d y^2,  sum_d x * q_weight[c] * k_weight[c] * y)    # d over the slice, x = hidden[t, c, r*W + d]

**Finish** (one program a token and a stream): from ``gathered = all_gather(send)`` (``[P*T, W + 4*C]``, rank
``r``'s rows at ``r*T``) it sums the ``P`` pairs (in rank order, fp32) and runs the CUDA gate on them::

    dot  = sum_r dot_r * rsqrt(mean(x^2) + eps) * rsqrt(sum_r key_sq_r / D + eps) * rsqrt(D)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, clamp)))          # 0 where token_mask[t] is False
    out[t, c, d] = x + gate * gathered[(d // W) * T + t, d % W]

Where it runs: every engram layer's ``Engram.forward`` of V4.1's ``amd`` model (``DeepseekV4DecoderLayer.forward``,
after the FFN's mHC post), every step, when ``RocmEngram._create_wkv`` shards the projection: CDNA3 / CDNA4
(``_shards_engram_gate``: ``get_cdna_version() in (3, 4)``), tensor parallel above 1 and no sequence parallelism
(``_use_sequence_parallel`` is always False on ROCm). Elsewhere on ROCm the unsharded CUDA gate runs. Inputs: bf16
streams ``[T, hc_mult, hidden_size]``, the bf16 ``wkv`` shard, bf16 ``[hc_mult, hidden_size]`` weights, eps
``rms_norm_eps``, clamp ``1e-6`` and always a bool token mask (``~image_sentinel_mask`` or the dummy hashes' mask),
so ``HAS_MASK`` is on; 4 warps for the partials, and for the finish 8 from a 2048-wide tile up, else 4.

Keys: the widths, the tile, the rank count, the mask switch, the dtypes and the warps. Unlike vLLM's kernels, which
specialize strides, ``dim_start`` and pointer alignment, every stride, ``dim_start`` and ``num_tokens`` are runtime
integers that are not specialized and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from ._v41_rocm import MONOKERNEL_ARCHS
from .model import DSV4
from .v41_engram_gate import CLAMP

__all__ = [
    "EngramGateFinish", "EngramGateFinishKey", "EngramGatePartials", "EngramGatePartialsKey", "gate_finish_reference",
    "gate_partials_reference", "register", "unpack_partials",
]  # fmt: skip

_P_INTS = ["hs_t", "hs_c", "hs_d", "kv_t", "kv_d", "q_c", "q_d", "k_c", "k_d", "send_t", "send32_t", "dim_start"]
_P_PTRS = ["hidden_ptr", "kv_ptr", "q_ptr", "k_ptr", "send_ptr", "send32_ptr"]
_F_INTS = ["num_tokens", "hs_t", "hs_c", "hs_d", "g_t", "g32_t", "mask_t", "out_t", "out_c", "out_d"]
_F_PTRS = ["hidden_ptr", "g_ptr", "g32_ptr", "mask_ptr", "out_ptr"]


@triton.jit(do_not_specialize=_P_INTS, do_not_specialize_on_alignment=_P_PTRS)
def _gate_partials_kernel(
    hidden_ptr,  # [T, C, D]
    kv_ptr,  # [T, (C + 1) * W]: this rank's key slices, then its value slice
    q_ptr,  # [C, D]
    k_ptr,  # [C, D]
    send_ptr,  # [T, W + 4C] in kv's dtype
    send32_ptr,  # the same bytes as fp32
    hs_t,
    hs_c,
    hs_d,
    kv_t,
    kv_d,
    q_c,
    q_d,
    k_c,
    k_d,
    send_t,
    send32_t,
    dim_start,
    W: tl.constexpr,  # the rank's slice of the hidden size
    C: tl.constexpr,  # hc_mult: program C of a token copies the value
    BLOCK: tl.constexpr,  # next_pow2(W)
):
    pid = tl.program_id(0)
    t = (pid // (C + 1)).to(tl.int64)
    c = pid % (C + 1)
    d = tl.arange(0, BLOCK)
    live = d < W
    if c == C:
        v = tl.load(kv_ptr + t * kv_t + (C * W + d) * kv_d, mask=live)
        tl.store(send_ptr + t * send_t + d, v, mask=live)
    else:
        x = tl.load(hidden_ptr + t * hs_t + c * hs_c + (dim_start + d) * hs_d, mask=live, other=0.0).to(tl.float32)
        y = tl.load(kv_ptr + t * kv_t + (c * W + d) * kv_d, mask=live, other=0.0).to(tl.float32)
        qw = tl.load(q_ptr + c * q_c + (dim_start + d) * q_d, mask=live, other=0.0).to(tl.float32)
        kw = tl.load(k_ptr + c * k_c + (dim_start + d) * k_d, mask=live, other=0.0).to(tl.float32)
        pair = send32_ptr + t * send32_t + W // 2 + 2 * c
        tl.store(pair, tl.sum(y * y, axis=0))
        tl.store(pair + 1, tl.sum(x * qw * kw * y, axis=0))


@triton.jit(do_not_specialize=_F_INTS, do_not_specialize_on_alignment=_F_PTRS)
def _gate_finish_kernel(
    hidden_ptr,  # [T, C, D]
    g_ptr,  # [P * T, W + 4C]: the gathered rows, rank-major
    g32_ptr,  # the same bytes as fp32
    mask_ptr,  # [T] bool (any pointer when HAS_MASK is off)
    out_ptr,  # [T, C, D]
    num_tokens,
    hs_t,
    hs_c,
    hs_d,
    g_t,
    g32_t,
    mask_t,
    out_t,
    out_c,
    out_d,
    eps,
    clamp,
    D: tl.constexpr,  # hidden_size: the row is one tile
    W: tl.constexpr,  # D / P: a rank's value slice and where its fp32 pairs start
    P: tl.constexpr,  # tensor-parallel ranks: the pairs are summed in an unrolled loop
    C: tl.constexpr,  # hc_mult
    BLOCK: tl.constexpr,  # next_pow2(D)
    HAS_MASK: tl.constexpr,  # a token mask shuts the gate
):
    pid = tl.program_id(0)
    t = (pid // C).to(tl.int64)
    c = pid % C
    d = tl.arange(0, BLOCK)
    live = d < D
    x = tl.load(hidden_ptr + t * hs_t + c * hs_c + d * hs_d, mask=live, other=0.0).to(tl.float32)
    key_sq = 0.0
    dot = 0.0
    for r in tl.static_range(P):
        pair = g32_ptr + (r * num_tokens + t) * g32_t + W // 2 + 2 * c
        key_sq += tl.load(pair)
        dot += tl.load(pair + 1)
    x_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y_rms = tl.rsqrt(key_sq / D + eps)
    dot *= x_rms * y_rms * tl.rsqrt(D * 1.0)
    g = tl.sqrt(tl.maximum(tl.abs(dot), clamp))
    g = tl.where(dot < 0.0, -g, g)
    gate = tl.sigmoid(g)
    if HAS_MASK:
        keep = tl.load(mask_ptr + t * mask_t)
        gate = tl.where(keep, gate, 0.0)
    v = tl.load(g_ptr + ((d // W) * num_tokens + t) * g_t + d % W, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * out_t + c * out_c + d * out_d, x + gate * v, mask=live)


@attrs.frozen(kw_only=True)
class EngramGatePartialsKey(warmreg.CompileKey):
    """What changes the partials' binary: the slice width, the streams, the tile, the dtypes and the warps."""

    width: int
    hc_mult: int
    block: int
    dtype: str  # hidden_states
    kv_dtype: str  # kv and send
    weight_dtype: str
    num_warps: int


@attrs.frozen(kw_only=True)
class EngramGateFinishKey(warmreg.CompileKey):
    """What changes the finish's binary: the widths, the rank count, the tile, the mask switch, dtypes and warps."""

    dim: int
    width: int
    tp_size: int
    hc_mult: int
    block: int
    has_mask: bool
    dtype: str  # hidden_states and out
    gathered_dtype: str
    num_warps: int


def _float16ish(name: str, kernel: str, t: torch.Tensor) -> None:
    if t.dtype.itemsize != 2 or not t.dtype.is_floating_point:
        raise warmreg.LaunchError(kernel, f"{name} must be a 16-bit float (got {t.dtype}): its rows hold fp32 pairs")


class EngramGatePartials(warmreg.TritonKernel[EngramGatePartialsKey]):
    """One rank's packed row of the sharded gate: value slice and per-stream fp32 partial sums (module docstring).

    :param hidden_size: the model's ``hidden_size`` (domains only).
    :param hc_mult: the model's ``hc_mult`` (domains only).
    :param tp_size: the tensor-parallel size, the ranks sharing ``wkv`` (domains only).
    :param dtype: the model dtype (domains only).
    """

    name = "deepseek_v4.v41_rocm_engram_gate_partials"
    key_type = EngramGatePartialsKey
    jit = _gate_partials_kernel

    def __init__(self, *, hidden_size: int, hc_mult: int, tp_size: int, dtype: str) -> None:
        self.hidden_size, self.hc_mult, self.tp_size, self.dtype = hidden_size, hc_mult, tp_size, dtype

    def dispatch(
        self, *, hidden_states: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor
    ) -> EngramGatePartialsKey:
        c = hidden_states.shape[1]
        w = kv.shape[1] // (c + 1)
        return EngramGatePartialsKey(
            width=w, hc_mult=c, block=warmreg.next_pow2(w), dtype=warmreg.dtype_name(hidden_states.dtype),
            kv_dtype=warmreg.dtype_name(kv.dtype), weight_dtype=warmreg.dtype_name(q_weight.dtype), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype, c, d = getattr(torch, self.dtype), self.hc_mult, self.hidden_size
        return {
            "hidden_states": [warmreg.meta((1, c, d), dtype)],  # no size is in the key
            "kv": [warmreg.meta((1, (c + 1) * (d // self.tp_size)), dtype)],
            "q_weight": [warmreg.meta((c, d), dtype)],
        }

    def warmup_inputs(self, key: EngramGatePartialsKey) -> Mapping[str, Any]:
        c, w = key.hc_mult, key.width
        weight = warmreg.meta((c, w), getattr(torch, key.weight_dtype))
        return {
            "hidden_states": warmreg.meta((1, c, w), getattr(torch, key.dtype)),
            "kv": warmreg.meta((1, (c + 1) * w), getattr(torch, key.kv_dtype)),
            "dim_start": 0,
            "q_weight": weight,
            "k_weight": weight,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        hidden_states: torch.Tensor,
        kv: torch.Tensor,
        dim_start: int,
        *,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[EngramGatePartialsKey]:
        """This rank's ``send`` rows ``[T, W + 4*C]`` in ``kv``'s dtype (``out``, or a fresh tensor); vLLM's
        ``RocmEngram._post_wkv`` operands, ``dim_start = tp_rank * W``.

        :param hidden_states: ``[T, C, D]``, any strides.
        :param kv: ``[T, (C + 1) * W]``, any strides, a 16-bit float: this rank's ``wkv`` output.
        :param dim_start: the first hidden column of the rank's slice, with ``dim_start + W <= D``.
        :param q_weight: ``[C, D]``, any strides.
        :param k_weight: ``[C, D]``, any strides, ``q_weight``'s dtype.
        :param out: a buffer instead of a fresh one: contiguous ``[T, W + 4*C]`` of ``kv``'s dtype.
        :raises warmreg.LaunchError: naming the argument whose shape or dtype does not fit.
        """
        self._check(hidden_states, kv, dim_start, q_weight, k_weight)
        key = self.dispatch(hidden_states=hidden_states, kv=kv, q_weight=q_weight)
        t, c, w = hidden_states.shape[0], key.hc_mult, key.width
        out = warmreg.output(self.name, "out", out, (t, w + 4 * c), kv.dtype, kv.device)
        send32 = out.view(torch.float32)
        kwargs = dict(
            hidden_ptr=hidden_states, kv_ptr=kv, q_ptr=q_weight, k_ptr=k_weight, send_ptr=out, send32_ptr=send32,
            hs_t=hidden_states.stride(0), hs_c=hidden_states.stride(1), hs_d=hidden_states.stride(2),
            kv_t=kv.stride(0), kv_d=kv.stride(1), q_c=q_weight.stride(0), q_d=q_weight.stride(1),
            k_c=k_weight.stride(0), k_d=k_weight.stride(1), send_t=out.stride(0), send32_t=send32.stride(0),
            dim_start=dim_start, W=w, C=c, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t * (c + 1),) if t else None, kwargs, out)

    def _check(self, hidden: torch.Tensor, kv: torch.Tensor, start: int, q: torch.Tensor, k: torch.Tensor) -> None:
        if hidden.ndim != 3 or not hidden.dtype.is_floating_point:
            raise warmreg.LaunchError(self.name, f"hidden_states must be a float [T, C, D] (got {tuple(hidden.shape)})")
        t, c, d = hidden.shape
        if kv.ndim != 2 or kv.shape[0] != t or kv.shape[1] % (c + 1) or kv.shape[1] // (c + 1) % 2:
            raise warmreg.LaunchError(
                self.name, f"kv must be [T = {t}, (C + 1) * W] with C = {c} and W even (got {tuple(kv.shape)})"
            )
        _float16ish("kv", self.name, kv)
        if not 0 <= start <= d - kv.shape[1] // (c + 1):
            raise warmreg.LaunchError(self.name, f"dim_start must be in [0, D - W] (got {start})")
        for name, wt in (("q_weight", q), ("k_weight", k)):
            if wt.shape != (c, d) or wt.dtype != q.dtype:
                raise warmreg.LaunchError(
                    self.name, f"{name} must be [{c}, {d}] of one dtype (got {wt.dtype} {tuple(wt.shape)})"
                )


class EngramGateFinish(warmreg.TritonKernel[EngramGateFinishKey]):
    """The gated update of the streams from every rank's gathered ``send`` rows (module docstring).

    :param hidden_size: the model's ``hidden_size`` (domains only).
    :param hc_mult: the model's ``hc_mult`` (domains only).
    :param tp_size: the tensor-parallel size (domains only).
    :param dtype: the model dtype (domains only).
    """

    name = "deepseek_v4.v41_rocm_engram_gate_finish"
    key_type = EngramGateFinishKey
    jit = _gate_finish_kernel

    def __init__(self, *, hidden_size: int, hc_mult: int, tp_size: int, dtype: str) -> None:
        self.hidden_size, self.hc_mult, self.tp_size, self.dtype = hidden_size, hc_mult, tp_size, dtype

    def dispatch(
        self, *, hidden_states: torch.Tensor, gathered: torch.Tensor, token_mask: torch.Tensor | None, tp_size: int
    ) -> EngramGateFinishKey:
        _, c, d = hidden_states.shape
        block = warmreg.next_pow2(d)
        return EngramGateFinishKey(
            dim=d, width=d // tp_size, tp_size=tp_size, hc_mult=c, block=block, has_mask=token_mask is not None,
            dtype=warmreg.dtype_name(hidden_states.dtype), gathered_dtype=warmreg.dtype_name(gathered.dtype),
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype, c, d, p = getattr(torch, self.dtype), self.hc_mult, self.hidden_size, self.tp_size
        return {
            "hidden_states": [warmreg.meta((1, c, d), dtype)],
            "gathered": [warmreg.meta((p, d // p + 4 * c), dtype)],
            "token_mask": [warmreg.meta((1,), torch.bool)],
            "tp_size": [p],
        }

    def warmup_inputs(self, key: EngramGateFinishKey) -> Mapping[str, Any]:
        c, p = key.hc_mult, key.tp_size
        return {
            "hidden_states": warmreg.meta((1, c, key.dim), getattr(torch, key.dtype)),
            "gathered": warmreg.meta((p, key.width + 4 * c), getattr(torch, key.gathered_dtype)),
            "token_mask": warmreg.meta((1,), torch.bool) if key.has_mask else None,
            "tp_size": p,
            "eps": 1e-6,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        hidden_states: torch.Tensor,
        gathered: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        tp_size: int,
        eps: float,
        clamp: float = CLAMP,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[EngramGateFinishKey]:
        """The updated streams, like ``hidden_states`` (``out``, or a fresh tensor).

        :param hidden_states: ``[T, C, D]``, any strides, ``D`` a multiple of ``tp_size``.
        :param gathered: ``[tp_size * T, D / tp_size + 4 * C]``, any row stride, unit column stride, a 16-bit float:
            the all-gathered :class:`EngramGatePartials` rows, rank-major.
        :param token_mask: bool ``[T]``, any stride, or None (every gate open).
        :param tp_size: the ranks whose rows ``gathered`` holds.
        :param eps: the RMS epsilon (``rms_norm_eps``).
        :param clamp: the floor of ``|dot|`` under the square root.
        :param out: a buffer instead of a fresh one: contiguous, ``hidden_states``' shape and dtype.
        :raises warmreg.LaunchError: naming the argument whose shape or dtype does not fit.
        """
        self._check(hidden_states, gathered, token_mask, tp_size)
        key = self.dispatch(hidden_states=hidden_states, gathered=gathered, token_mask=token_mask, tp_size=tp_size)
        t, c, d = hidden_states.shape
        out = warmreg.output(self.name, "out", out, (t, c, d), hidden_states.dtype, hidden_states.device)
        g32 = gathered.view(torch.float32)
        mask = token_mask if token_mask is not None else hidden_states
        kwargs = dict(
            hidden_ptr=hidden_states, g_ptr=gathered, g32_ptr=g32, mask_ptr=mask, out_ptr=out, num_tokens=t,
            hs_t=hidden_states.stride(0), hs_c=hidden_states.stride(1), hs_d=hidden_states.stride(2),
            g_t=gathered.stride(0), g32_t=g32.stride(0),
            mask_t=token_mask.stride(0) if token_mask is not None else 0, out_t=out.stride(0), out_c=out.stride(1),
            out_d=out.stride(2), eps=eps, clamp=clamp, D=d, W=key.width, P=tp_size, C=c, BLOCK=key.block,
            HAS_MASK=key.has_mask,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (t * c,) if t else None, kwargs, out)

    def _check(self, hidden: torch.Tensor, gathered: torch.Tensor, mask: torch.Tensor | None, p: int) -> None:
        if hidden.ndim != 3 or not hidden.dtype.is_floating_point:
            raise warmreg.LaunchError(self.name, f"hidden_states must be a float [T, C, D] (got {tuple(hidden.shape)})")
        t, c, d = hidden.shape
        if not (isinstance(p, int) and p >= 1 and d % p == 0 and d // p % 2 == 0):
            raise warmreg.LaunchError(self.name, f"tp_size must divide D = {d} into even slices (got {p!r})")
        width = d // p + 4 * c
        if gathered.ndim != 2 or gathered.shape != (p * t, width) or gathered.stride(1) != 1:
            raise warmreg.LaunchError(
                self.name, f"gathered must be [{p * t}, {width}] with unit column stride (got {tuple(gathered.shape)})"
            )
        _float16ish("gathered", self.name, gathered)
        if mask is not None and (mask.ndim != 1 or mask.dtype != torch.bool or mask.shape[0] != t):
            raise warmreg.LaunchError(
                self.name, f"token_mask must be bool [{t}] (got {mask.dtype} {tuple(mask.shape)})"
            )


def unpack_partials(send: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``send`` rows ``[N, W + 4*C]`` into the value slices ``[N, W]`` and the fp32 pairs ``[N, C, 2]``
    (``(sum key^2, sum x*q*k*key)``)."""
    w = send.shape[1] - 4 * hc_mult
    return send[:, :w], send.contiguous().view(torch.float32)[:, w // 2 :].reshape(-1, hc_mult, 2)


def gate_partials_reference(
    hidden_states: torch.Tensor, kv: torch.Tensor, dim_start: int, *, q_weight: torch.Tensor, k_weight: torch.Tensor
) -> torch.Tensor:
    """PyTorch reference of :class:`EngramGatePartials` (the module docstring's packing, sums in fp32)."""
    t, c, _ = hidden_states.shape
    w = kv.shape[1] // (c + 1)
    cols = slice(dim_start, dim_start + w)
    x, y = hidden_states[:, :, cols].float(), kv[:, : c * w].float().reshape(t, c, w)
    pairs = torch.stack(
        [y.square().sum(-1), (x * q_weight[:, cols].float() * k_weight[:, cols].float() * y).sum(-1)], -1
    )
    send = torch.empty(t, w + 4 * c, dtype=kv.dtype, device=kv.device)
    send[:, :w] = kv[:, c * w :]
    send.view(torch.float32)[:, w // 2 :] = pairs.reshape(t, 2 * c)
    return send


def gate_finish_reference(
    hidden_states: torch.Tensor, gathered: torch.Tensor, token_mask: torch.Tensor | None = None, *, tp_size: int,
    eps: float, clamp: float = CLAMP,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramGateFinish` in fp32 (the module docstring's math)."""
    t, c, d = hidden_states.shape
    value, pairs = unpack_partials(gathered, c)
    pairs = pairs.reshape(tp_size, t, c, 2).sum(0)
    v = value.reshape(tp_size, t, d // tp_size).permute(1, 0, 2).reshape(t, 1, d).float()
    x = hidden_states.float()
    dot = pairs[..., 1] * torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(pairs[..., 0] / d + eps) / d**0.5
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=clamp).sqrt())
    if token_mask is not None:
        gate = torch.where(token_mask[:, None], gate, 0.0)
    return (x + gate[..., None] * v).to(hidden_states.dtype)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register both kernels where V4.1's ``amd`` model shards the engram ``wkv``: engram layers on gfx942 / gfx950
    at a tensor-parallel size above 1 (``RocmEngram._create_wkv``) that splits ``hidden_size`` into even slices
    (``MergedColumnParallelLinear`` splits each output evenly)."""
    if model.engram is None or not model.v41:
        return
    tp = serving_int(config, "tensor_parallel_size", 1)
    if tp == 1 or model.hidden_size % (2 * tp):
        return
    sharded = warmreg.rocm_arch_in(*MONOKERNEL_ARCHS)  # _shards_engram_gate: CDNA3 or CDNA4
    registry.add(
        EngramGatePartials(hidden_size=model.hidden_size, hc_mult=model.hc_mult, tp_size=tp, dtype=model.dtype),
        when=sharded,
    )
    registry.add(
        EngramGateFinish(hidden_size=model.hidden_size, hc_mult=model.hc_mult, tp_size=tp, dtype=model.dtype),
        when=sharded,
    )
