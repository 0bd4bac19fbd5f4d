"""Chunked KDA prefill, stage 2: the gate, its chunk-local cumulative sum in log2 units, and beta.

vLLM: ``fused_kda_gate_chunk_cumsum`` (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk.py:
kda_gate_chunk_cumsum_vector_kernel``, autotuned on ``H, S, BT, IS_VARLEN`` over ``BS`` and ``num_warps``).
Grid ``(cdiv(K, BS) + 1, NT, H)``: program 0 of each (chunk, head) writes beta, the others a ``[BT, BS]`` tile
of the gate. Math, per token ``t`` of chunk ``c`` of a sequence and head ``h``, in fp32::

    x = raw_g[t, h] + dt_bias[h]                          # [K]; no bias if dt_bias is None
    gate = kda_gate(x, exp(A_log[h]), lower_bound)        # the decode step's gate (warmreg_kimi_k3.kda)
    g[t, h] = sum(gate[s, h] for s from the chunk's first token to t) / ln 2   # exp2(g) = exp(cumsum)
    beta[t, h] = sigmoid(raw_beta[t, h])

``g`` (fp32 ``[T, H, K]``) and ``beta`` (fp32 ``[T, H]``) are new tensors. The scale is vLLM's ``RCP_LN2``
(``1.4426950216``, the same float32). vLLM takes any head stride of raw_beta; the layer's is 1 (a column block of
its fused projection), which is what this stage takes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .kda import kda_gate, kda_gate_reference
from .kda_chunk_base import CHUNK_SIZE, ChunkStage, chunk_rows, meta_chunks, tuning_tensor

__all__ = ["GATE_TUNE_CONFIGS", "KDAChunkGate", "KDAChunkGateKey", "chunk_gate_reference"]

#: vLLM tunes BS in {32, 64} x {2, 4, 8} warps; the 8-warp pair is left out (a [64, 64] fp32 tile has
#: no work for 256 threads).
GATE_TUNE_CONFIGS = (
    warmreg.TuneConfig(constexprs={"BS": 32}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BS": 32}, num_warps=4),
    warmreg.TuneConfig(constexprs={"BS": 64}, num_warps=2),
    warmreg.TuneConfig(constexprs={"BS": 64}, num_warps=4),
)
_RCP_LN2 = tl.constexpr(1.4426950408889634)  # 1 / ln 2: exp(x) = exp2(x / ln 2)


# beta's token stride may be that of a wider projection: a runtime int. beta, A_log, dt_bias and the
# metadata are read a scalar (or a K row) at a time, so their alignment must not specialize.
@triton.jit(
    do_not_specialize=["beta_stride"],
    do_not_specialize_on_alignment=["beta_ptr", "a_log_ptr", "dt_bias_ptr", "cu_seqlens_ptr", "chunks_ptr"],
)
def _kda_chunk_gate_kernel(
    g_ptr,  # the raw gate [T, H, K]
    beta_ptr,  # the raw beta [T, H] (token stride beta_stride)
    a_log_ptr,  # [H] float32
    dt_bias_ptr,  # [H * K] float32 (A_log again when HAS_DT_BIAS is False: unread)
    g_out_ptr,  # fp32 [T, H, K]
    beta_out_ptr,  # fp32 [T, H]
    cu_seqlens_ptr,
    chunks_ptr,  # [NT, 2] (sequence, chunk within it)
    beta_stride,
    lower_bound,  # read only when USE_LOWER_BOUND
    H: tl.constexpr,  # heads on this rank: a model constant
    K: tl.constexpr,  # head dim
    BT: tl.constexpr,  # chunk size (64)
    BS: tl.constexpr,  # gate channels per program (tuned)
    HAS_DT_BIAS: tl.constexpr,  # add dt_bias to the raw gate
    USE_LOWER_BOUND: tl.constexpr,  # the gate's activation
):
    i_s, i_c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(chunks_ptr + 2 * i_c)
    c = tl.load(chunks_ptr + 2 * i_c + 1)
    bos = tl.load(cu_seqlens_ptr + n).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + n + 1).to(tl.int64) - bos
    offs_t = c.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = offs_t < length
    rows = bos + offs_t
    if i_s == 0:
        b = tl.load(beta_ptr + rows * beta_stride + h, mask=m_t, other=0.0).to(tl.float32)
        tl.store(beta_out_ptr + rows * H + h, tl.sigmoid(b), mask=m_t)
    else:
        offs_s = (i_s - 1) * BS + tl.arange(0, BS)
        m_s = offs_s < K
        mask = m_t[:, None] & m_s[None, :]
        offs = (rows[:, None] * H + h) * K + offs_s[None, :]
        x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias_ptr + h * K + offs_s, mask=m_s, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        gate = tl.where(mask, kda_gate(x, a, lower_bound, USE_LOWER_BOUND), 0.0)  # rows past the sequence: 0
        tl.store(g_out_ptr + offs, tl.cumsum(gate, axis=0) * _RCP_LN2, mask=mask)


@attrs.frozen(kw_only=True)
class KDAChunkGateKey(warmreg.CompileKey):
    """What changes the binary of the gate stage."""

    gate_dtype: str  # the raw gate
    beta_dtype: str  # the raw beta
    num_heads: int  # H
    head_dim: int  # K
    chunk_size: int  # BT
    has_dt_bias: bool  # HAS_DT_BIAS
    use_lower_bound: bool  # USE_LOWER_BOUND (the bound's value is a runtime float)
    g_aligned: bool  # the raw gate's 16-byte alignment
    config: int | None = None


class KDAChunkGate(ChunkStage[KDAChunkGateKey]):
    """The gate / cumsum / beta stage of the chunked KDA prefill: replaces ``fused_kda_gate_chunk_cumsum(raw_g,
    raw_beta, A_log, g_bias, cu_seqlens, chunk_indices, chunk_size=64, lower_bound)`` inside vLLM's
    ``chunk_kda_with_fused_gate`` (module docstring); tensors without vLLM's leading batch dim of 1."""

    name = "kimi_k3.kda_chunk_gate"
    key_type = KDAChunkGateKey
    jit = _kda_chunk_gate_kernel
    tune_configs: ClassVar[tuple[warmreg.TuneConfig, ...]] = GATE_TUNE_CONFIGS

    def dispatch(
        self, *, raw_g: torch.Tensor, raw_beta: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None
    ) -> KDAChunkGateKey:
        return KDAChunkGateKey(
            gate_dtype=warmreg.dtype_name(raw_g.dtype), beta_dtype=warmreg.dtype_name(raw_beta.dtype),
            num_heads=raw_g.shape[1], head_dim=raw_g.shape[2], chunk_size=CHUNK_SIZE, has_dt_bias=dt_bias is not None,
            use_lower_bound=lower_bound is not None, g_aligned=warmreg.is_aligned(raw_g),
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h, kd = self.num_heads, self.head_dim
        return {
            "raw_g": [warmreg.meta((t, h, kd), self.dtype) for t in self.token_counts()],
            "raw_beta": [warmreg.meta((t, h), self.dtype) for t in self.token_counts()],
            "dt_bias": [warmreg.meta((h * kd,), torch.float32) if self.has_dt_bias else None],
            "lower_bound": [self.lower_bound],
        }

    def when(self, *, raw_g: torch.Tensor, raw_beta: torch.Tensor, **_: Any) -> bool:
        return raw_g.shape[0] == raw_beta.shape[0]  # one batch

    def _inputs(self, key: KDAChunkGateKey, tokens: int, make: Any) -> dict[str, Any]:
        h, kd = key.num_heads, key.head_dim
        return {
            "raw_g": make((tokens, h, kd), getattr(torch, key.gate_dtype), 0 if key.g_aligned else 1),
            "raw_beta": make((tokens, h), getattr(torch, key.beta_dtype), 0),
            "A_log": make((h,), torch.float32, 0),
            "dt_bias": make((h * kd,), torch.float32, 0) if key.has_dt_bias else None,
            "lower_bound": -1.0 if key.use_lower_bound else None,  # any value: a runtime argument
        }

    def warmup_inputs(self, key: KDAChunkGateKey) -> Mapping[str, Any]:
        return {**self._inputs(key, 1, lambda s, d, off: warmreg.meta(s, d, offset=off)), **meta_chunks(1)}

    def tuning_inputs(self, key: KDAChunkGateKey, device: torch.device) -> Mapping[str, Any]:
        batch = self.tuning_batch(device)
        inputs = self._inputs(key, batch["tokens"], partial(tuning_tensor, device))
        return {**inputs, "cu_seqlens": batch["cu_seqlens"], "chunk_indices": batch["chunk_indices"]}

    @warmreg.kernel_launcher
    def __call__(
        self,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,  # the model's parameter name
        dt_bias: torch.Tensor | None,
        lower_bound: float | None,
        cu_seqlens: torch.Tensor,
        chunk_indices: torch.Tensor,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[KDAChunkGateKey]:
        """The chunk-local cumulative gate in log2 units and beta; returns ``(g, beta)`` (fp32 ``[T, H, K]``,
        fp32 ``[T, H]``; ``out``'s tensors, or fresh ones; rows outside ``cu_seqlens[0] .. cu_seqlens[N]``
        unwritten).

        :param raw_g: ``[T, H, K]`` contiguous, the raw gate projection.
        :param raw_beta: ``[T, H]``, heads contiguous (the token stride is free), the raw beta projection.
        :param A_log: float32, ``H`` contiguous elements.
        :param dt_bias: float32 ``[H * K]`` contiguous, or None.
        :param lower_bound: the gate's lower bound (``< 0``), or None for the softplus gate.
        :param cu_seqlens: int32 ``[N + 1]``.
        :param chunk_indices: int32 ``[NT, 2]`` (:func:`~warmreg_kimi_k3.kda_chunk_base.chunk_metadata`).
        :param out: preallocated ``(g, beta)``, contiguous, of those shapes and dtypes (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes or layouts the kernel cannot take, or an ``out`` that is not
            the outputs' shapes, dtypes and layouts.
        """
        if raw_g.ndim != 3 or not raw_g.is_contiguous():
            self.fail(
                f"raw_g must be a contiguous [T, H, K] tensor (got {tuple(raw_g.shape)}, strides {raw_g.stride()})"
            )
        t, h, kd = raw_g.shape
        if raw_beta.shape != (t, h) or (h > 1 and raw_beta.stride(1) != 1):
            self.fail(f"raw_beta must be [T, H] = {(t, h)} with contiguous heads (got {tuple(raw_beta.shape)})")
        for name, p, numel in (("A_log", A_log, h), ("dt_bias", dt_bias, h * kd)):
            if p is not None and (p.dtype != torch.float32 or p.numel() != numel or not p.is_contiguous()):
                self.fail(f"{name} must be float32 with {numel} contiguous elements (got {p.dtype} {tuple(p.shape)})")
        if lower_bound is not None and not lower_bound < 0:
            self.fail(f"lower_bound must be < 0 or None (got {lower_bound!r})")
        key = self.dispatch(raw_g=raw_g, raw_beta=raw_beta, dt_bias=dt_bias, lower_bound=lower_bound)
        g_out, beta_out = (None, None) if out is None else self.out_tuple(out, ("g", "beta"))
        g = warmreg.output(self.name, "out[0]", g_out, (t, h, kd), torch.float32, raw_g.device)
        beta = warmreg.output(self.name, "out[1]", beta_out, (t, h), torch.float32, raw_g.device)
        kwargs = dict(
            g_ptr=raw_g, beta_ptr=raw_beta, a_log_ptr=A_log, dt_bias_ptr=A_log if dt_bias is None else dt_bias,
            g_out_ptr=g, beta_out_ptr=beta, cu_seqlens_ptr=cu_seqlens, chunks_ptr=chunk_indices,
            beta_stride=raw_beta.stride(0), lower_bound=0.0 if lower_bound is None else float(lower_bound),
            H=h, K=kd, BT=key.chunk_size, HAS_DT_BIAS=key.has_dt_bias, USE_LOWER_BOUND=key.use_lower_bound,
        )  # fmt: skip
        num_chunks = chunk_indices.shape[0]

        def grid(meta: Mapping[str, Any]) -> tuple[int, ...]:
            return ((kd + meta["BS"] - 1) // meta["BS"] + 1, num_chunks, h)

        return warmreg.LaunchSpec(key, grid if num_chunks else None, kwargs, (g, beta))


def chunk_gate_reference(
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the stage: :func:`~warmreg_kimi_k3.kda.kda_gate_reference`, cumulative sums over
    each 64-token chunk of each sequence divided by ``ln 2``, and ``sigmoid(raw_beta)``, all fp32.

    :returns: ``(g, beta)``, zeros outside the sequences.
    """
    gate = kda_gate_reference(raw_g, A_log, dt_bias, lower_bound)
    g = torch.zeros_like(gate)
    beta = torch.zeros(raw_beta.shape, dtype=torch.float32)
    for rows in chunk_rows(cu_seqlens):
        g[rows] = gate[rows].cumsum(0) / math.log(2.0)
        beta[rows] = torch.sigmoid(raw_beta[rows].float())
    return g, beta
