"""The DSA indexer's query quant on an MXFP4 key cache: the query to MXFP4 (one UE8M0 scale per 32 values) and
the head weights scaled (vLLM 0.34 ``models/kimi_k3/nvidia/ops/dsa_indexer_mxfp4.py``: ``mxfp4_q_quant`` ->
``_mxfp4_q_quant_kernel``).

For token ``t`` and head ``h < H`` of ``index_q [T, H, D]`` (``D = 128``) and ``index_weights [T, H]``, padded
to ``P = padded_num_heads`` heads (DeepGEMM's 32 or 64)::

    q_packed[t, h], ue8m0[t, h] = MXFP4(float32(index_q[t, h]))       # [D/2] bytes, [D/32] scale bytes
    q_scale[t, h] = int32 of the 4 bytes ue8m0[t, h, 0..3] (byte 0 lowest)
    weights[t, h] = float32(index_weights[t, h]) * weight_scale        # the MX scales stay in the logits MMA
    q_packed[t, h] = q_scale[t, h] = weights[t, h] = 0  for H <= h < P

(MXFP4 as in :mod:`._mxfp4`.) Returns ``(q_packed uint8 [T, P, D/2], q_scale int32 [T, P], weights float32
[T, P])``, the query format of DeepGEMM's ``fp8_fp4_mqa_logits``.

Grid ``(T, ceil(P / HB))``, one warp a program, ``HB`` heads a program quantized as one row (an MXFP4 block never
straddles two heads): ``HB = min(2 if T < 128 else 8 if T < 1024 else 16, next_pow2(H))``, vLLM's choice by token
count. vLLM zero-fills the padded outputs with ``torch.zeros`` and launches over the ``H`` real heads; here the
programs cover all ``P`` heads and write the padding zeros themselves (one launch, and an ``out=`` buffer comes
back fully written). ``FULL`` (``H == P`` and ``HB`` divides ``H``) drops the masks, as vLLM's ``EVEN_HEADS``.

Where it runs: ``KimiK3DSAIndexer.score`` (``models/kimi_k3/nvidia/dsa.py``) on every DSA layer of every step,
fused forward or not, when the indexer keys are MXFP4 (``use_fp4_cache``: ``kimi_k3_indexer_uses_fp4``,
``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` on SM10x); ``weight_scale = D**-0.5 * H**-0.5``.

Key: the dtypes, ``D``, ``HB`` and ``FULL``, one warp. Strides, ``T``, ``H`` and ``P`` are runtime integers that are
not specialized, and no pointer on its alignment: ``HB`` (three values at most) is all that varies by step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._mxfp4 import MXFP4_BLOCK, mxfp4_reference, mxfp4_row
from .dsa import dsa_layout
from .model import PLUGIN, KimiK3

__all__ = ["HEAD_DIM", "MXFP4QQuant", "MXFP4QQuantKey", "heads_per_program", "mxfp4_q_quant_reference", "register"]

#: The query head dim the kernel serves: four MXFP4 blocks, whose scale bytes pack into one int32 (vLLM asserts it).
HEAD_DIM = 4 * MXFP4_BLOCK
_INTS = ["q_stride0", "q_stride1", "w_stride", "num_heads", "padded_heads"]
_POINTERS = ["q_ptr", "w_ptr", "q_out_ptr", "scale_ptr", "w_out_ptr"]
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_POINTERS)
def _mxfp4_q_quant_kernel(
    q_ptr,
    q_stride0,
    q_stride1,
    w_ptr,
    w_stride,
    q_out_ptr,  # uint8 [T, P, D/2], contiguous
    scale_ptr,  # the int32 [T, P] scales as uint8 [T, P * D/32]
    w_out_ptr,  # float32 [T, P], contiguous
    weight_scale,
    num_heads,
    padded_heads,
    D: tl.constexpr,  # index_head_dim (128)
    HB: tl.constexpr,  # heads a program, quantized as one row of HB * D values
    FULL: tl.constexpr,  # H == P and HB divides H: no program reaches a padded or missing head, no masks
):
    tok = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * HB
    offs = tl.arange(0, HB * D)
    head = head0 + offs // D
    q_in = q_ptr + tok * q_stride0 + head * q_stride1 + offs % D
    heads = head0 + tl.arange(0, HB)
    packed_at = head0 * (D // 2) + tl.arange(0, HB * D // 2)  # a token's packed heads are contiguous
    scale_at = head0 * (D // 32) + tl.arange(0, HB * D // 32)
    q_out = q_out_ptr + tok * padded_heads * (D // 2) + packed_at
    scale_out = scale_ptr + tok * padded_heads * (D // 32) + scale_at
    w_in = w_ptr + tok * w_stride + heads
    w_out = w_out_ptr + tok * padded_heads + heads
    if FULL:
        packed, scales = mxfp4_row(tl.load(q_in).to(tl.float32), HB * D)
        tl.store(q_out, packed)
        tl.store(scale_out, scales)
        tl.store(w_out, tl.load(w_in).to(tl.float32) * weight_scale)
    else:
        packed, scales = mxfp4_row(tl.load(q_in, mask=head < num_heads, other=0.0).to(tl.float32), HB * D)
        real = heads < num_heads
        w = tl.load(w_in, mask=real, other=0.0).to(tl.float32) * weight_scale
        tl.store(q_out, tl.where(packed_at < num_heads * (D // 2), packed, 0), mask=packed_at < padded_heads * (D // 2))
        tl.store(
            scale_out, tl.where(scale_at < num_heads * (D // 32), scales, 0), mask=scale_at < padded_heads * (D // 32)
        )
        tl.store(w_out, tl.where(real, w, 0.0), mask=heads < padded_heads)


def heads_per_program(num_tokens: int, num_heads: int) -> int:
    """Heads a program quantizes: 2 under 128 tokens, 8 under 1024, else 16 (vLLM's tuning on GB300), at most
    ``next_pow2(num_heads)``."""
    hb = 2 if num_tokens < 128 else 8 if num_tokens < 1024 else 16
    return min(hb, warmreg.next_pow2(num_heads))


@attrs.frozen(kw_only=True)
class MXFP4QQuantKey(warmreg.CompileKey):
    """What changes the binary of the MXFP4 query quant: no size, stride or alignment does."""

    q_dtype: str
    weights_dtype: str
    head_dim: int
    heads_per_program: int
    full: bool  # H == P and heads_per_program divides H: the unmasked variant
    num_warps: int


class MXFP4QQuant(warmreg.TritonKernel[MXFP4QQuantKey]):
    """MXFP4 query quant and head-weight scale of the DSA indexer (the module docstring has the math).

    :param num_heads: ``dsa_config.index_num_heads`` (domains only).
    :param padded_num_heads: DeepGEMM's padded head count, 32 or 64 (domains only).
    :param max_num_batched_tokens: the most tokens a step carries (domains only).
    :param dtype: the query's dtype, the model's (domains only).
    """

    name = "kimi_k3.dsa_mxfp4_q_quant"
    key_type = MXFP4QQuantKey
    jit = _mxfp4_q_quant_kernel

    def __init__(
        self,
        *,
        num_heads: int = 32,
        padded_num_heads: int = 32,
        max_num_batched_tokens: int = 8192,
        dtype: str = "bfloat16",
    ) -> None:
        self.num_heads, self.padded_num_heads = num_heads, padded_num_heads
        self.max_num_batched_tokens, self.dtype = max_num_batched_tokens, dtype

    def dispatch(self, *, index_q: torch.Tensor, index_weights: torch.Tensor, padded_num_heads: int) -> MXFP4QQuantKey:
        tokens, heads, d = index_q.shape
        hb = heads_per_program(tokens, heads)
        return MXFP4QQuantKey(
            q_dtype=warmreg.dtype_name(index_q.dtype),
            weights_dtype=warmreg.dtype_name(index_weights.dtype),
            head_dim=d,
            heads_per_program=hb,
            full=heads == padded_num_heads and heads % hb == 0,
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h, dtype = self.num_heads, getattr(torch, self.dtype)
        # one token count per heads-per-program bucket the step sizes reach (1..max_num_batched_tokens)
        counts = [t for t in (1, 128, 1024) if t <= self.max_num_batched_tokens]
        return {
            "index_q": [warmreg.meta((t, h, HEAD_DIM), dtype) for t in counts],
            "index_weights": [warmreg.meta((1, h), dtype)],  # only its dtype reaches the key
            "padded_num_heads": [self.padded_num_heads],
        }

    def warmup_inputs(self, key: MXFP4QQuantKey) -> Mapping[str, Any]:
        hb = key.heads_per_program
        tokens = 1 if hb <= 2 else 128 if hb <= 8 else 1024  # a step size whose bucket allows hb heads a program
        return {
            "index_q": warmreg.meta((tokens, hb, key.head_dim), getattr(torch, key.q_dtype)),  # H = hb heads
            "index_weights": warmreg.meta((tokens, hb), getattr(torch, key.weights_dtype)),
            "weight_scale": 1.0,
            "padded_num_heads": hb if key.full else 2 * hb,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        weight_scale: float,
        padded_num_heads: int,
        *,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[MXFP4QQuantKey]:
        """Quantize ``index_q`` to MXFP4 and scale ``index_weights`` (vLLM's ``mxfp4_q_quant``, same arguments).

        :param index_q: ``[T, H, D = 128]`` bf16, fp16 or fp32 with a unit last stride (any token and head strides).
        :param index_weights: ``[T, H]`` float with a unit last stride.
        :param weight_scale: the factor of the weights (``D**-0.5 * H**-0.5`` in vLLM).
        :param padded_num_heads: ``P >= H``: the output head count; heads ``[H, P)`` are zero.
        :param out: ``(q_packed, q_scale, weights)`` to write instead of fresh tensors: exactly the outputs below,
            contiguous, 16-byte aligned.
        :returns: ``(q_packed uint8 [T, P, D/2], q_scale int32 [T, P], weights float32 [T, P])``.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out``
            unlike the fresh outputs, naming the argument.
        """
        self._check(index_q, index_weights, padded_num_heads)
        key = self.dispatch(index_q=index_q, index_weights=index_weights, padded_num_heads=padded_num_heads)
        t, h, d = index_q.shape
        p, dev = padded_num_heads, index_q.device
        if out is not None and (not isinstance(out, tuple) or len(out) != 3):
            raise warmreg.LaunchError(self.name, "out must be a tuple of 3 tensors (q_packed, q_scale, weights)")
        q_packed = warmreg.output(self.name, "out[0]", out and out[0], (t, p, d // 2), torch.uint8, dev)
        q_scale = warmreg.output(self.name, "out[1]", out and out[1], (t, p), torch.int32, dev)
        weights = warmreg.output(self.name, "out[2]", out and out[2], (t, p), torch.float32, dev)
        kwargs = dict(
            q_ptr=index_q, q_stride0=index_q.stride(0), q_stride1=index_q.stride(1), w_ptr=index_weights,
            w_stride=index_weights.stride(0), q_out_ptr=q_packed, scale_ptr=q_scale.view(torch.uint8),
            w_out_ptr=weights, weight_scale=float(weight_scale), num_heads=h, padded_heads=p, D=key.head_dim,
            HB=key.heads_per_program, FULL=key.full,
        )  # fmt: skip
        grid = (t, triton.cdiv(p, key.heads_per_program)) if t and p else None
        return warmreg.LaunchSpec(key, grid, kwargs, (q_packed, q_scale, weights))

    def _check(self, index_q: torch.Tensor, index_weights: torch.Tensor, padded_num_heads: int) -> None:
        if index_q.ndim != 3 or index_q.dtype not in _FLOATS or index_q.shape[2] != HEAD_DIM or index_q.stride(2) != 1:
            raise warmreg.LaunchError(
                self.name, f"index_q must be [T, H, {HEAD_DIM}] bf16, fp16 or fp32 with a unit last stride (got "
                f"{index_q.dtype} {tuple(index_q.shape)}, strides {index_q.stride()})",
            )  # fmt: skip
        t, h, _ = index_q.shape
        w = index_weights
        if w.shape != (t, h) or w.dtype not in _FLOATS or (h > 1 and w.stride(1) != 1):
            raise warmreg.LaunchError(
                self.name, f"index_weights must be float [{t}, {h}] (index_q's tokens and heads) with a unit last "
                f"stride (got {w.dtype} {tuple(w.shape)}, strides {w.stride()})",
            )  # fmt: skip
        if padded_num_heads < h:
            raise warmreg.LaunchError(
                self.name, f"padded_num_heads ({padded_num_heads}) must be >= the {h} heads of index_q"
            )
        if index_q.device != w.device:
            raise warmreg.LaunchError(self.name, f"inputs on {index_q.device} and {w.device}: use one device")


def mxfp4_q_quant_reference(
    index_q: torch.Tensor, index_weights: torch.Tensor, weight_scale: float, padded_num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`MXFP4QQuant`: ``(q_packed, q_scale, weights)``, the padded heads zero."""
    t, h, d = index_q.shape
    packed, scales = mxfp4_reference(index_q.float())
    q_packed = torch.zeros(t, padded_num_heads, d // 2, dtype=torch.uint8)
    q_scale = torch.zeros(t, padded_num_heads, d // MXFP4_BLOCK, dtype=torch.uint8)
    weights = torch.zeros(t, padded_num_heads, dtype=torch.float32)
    q_packed[:, :h], q_scale[:, :h] = packed, scales
    weights[:, :h] = index_weights.float() * torch.tensor(weight_scale, dtype=torch.float32)
    return q_packed, q_scale.view(torch.int32).view(t, padded_num_heads), weights


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the MXFP4 query quant on DSA layers with MXFP4 indexer keys (``KimiK3DSAIndexer.score``, fused
    forward or not).

    :raises warmreg.ConfigError: for a malformed ``dsa_config``, a ``serving.indexer_kv_dtype`` vLLM refuses, an
        ``index_head_dim`` other than 128 with MXFP4 (``mxfp4_q_quant`` asserts four MXFP4 blocks a head, so vLLM
        fails at the first step), or a missing ``serving.max_num_batched_tokens``.
    """
    layout = dsa_layout(m, config, platform)
    if layout is None or not layout.indexer_fp4:
        return
    if layout.index_head_dim != HEAD_DIM:
        raise warmreg.ConfigError(
            "text.dsa_config.index_head_dim", f"is {layout.index_head_dim}; vLLM's MXFP4 indexer query takes "
            f"{HEAD_DIM} (four MXFP4 blocks, one int32 of scales a head)", plugin=PLUGIN,
            fix="set serving.indexer_kv_dtype to 'fp8' (or 'auto')",
        )  # fmt: skip
    kernel = MXFP4QQuant(
        num_heads=layout.index_num_heads, padded_num_heads=layout.padded_index_num_heads,
        max_num_batched_tokens=config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN), dtype=layout.dtype,
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
