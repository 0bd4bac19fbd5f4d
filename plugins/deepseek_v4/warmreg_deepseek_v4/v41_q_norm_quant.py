"""DeepSeek-V4.1's fused Q/KV RMSNorm with an MXFP8 query (vLLM 0.34 ``models/deepseek_v41/common/ops/query_quant.py``:
``fused_q_kv_rmsnorm_quant`` / ``_q_kv_norm_quant_kernel``).

Both halves of the fused ``wqa`` / ``wkv`` projection ``[T, Q + KV]`` are RMS-normed; the query is then quantized to
MXFP8 for the MXFP8 ``wq_b`` GEMMs, with FlashInfer's swizzled UE8M0 scales. For token ``t`` (fp32 math)::

    qn  = bf16(q[t] * rsqrt(mean(q[t]^2) + eps) * wq)          (rounded to the input dtype, as a stored norm)
    kvo[t] = kv[t] * rsqrt(mean(kv[t]^2) + eps) * wkv           (in kv's dtype)
    for each 32-group g:  a = amax(|qn[g]|) / 448
        e = the biased exponent of a, rounded up unless a's mantissa is 0 (or a is subnormal <= 2^-127), <= 254;
        0 where a <= 0
        qo[t, g] = e4m3(qn[g] * 2^(127 - e))   (2^(127 - e) taken as 0 where e = 0)
        scales[F(t, g)] = e      with F(t, g) = (t // 128 * ceil(G / 4) + g // 4) * 512 + t % 32 * 16
                                            + t % 128 // 32 * 4 + g % 4       (F8_128x4, G = Q / 32 groups)

``scales`` (uint8, ``ceil(T / 128) * 128 * ceil(G / 4) * 4`` bytes) is zero for the padding rows up to the next
128 and the padding groups up to the next 4. Grid ``(ceil(T / 128) * 128, 2)``: column 0 the query and its
scales, column 1 the KV norm; eight warps when the tile ``next_pow2(max(Q, KV))`` is >= 2048, else four.
PDL (sm_90+) waits for the projection and triggers the dependents after the wait (before it with
``early_trigger``).

Where it runs: V4.1 on CUDA with MXFP8 linears on FlashInfer's MXFP8 GEMMs (SM10x / SM12x) and ``q_lora_rank % 32
== 0`` (:func:`.v41.fused_query_quant`), every attention layer every step:
``DeepseekV4Attention._split_qkv_and_norm``. The specialized decode runtime's ``early_trigger`` variant
(``nvidia/specialized_decode/attention/step.py``) is not planned: warmreg has no setting for that runtime.

Key: ``Q``, ``KV`` and the tile (constexprs), the input dtype, both row strides' integer classes (specialized, as in
vLLM), PDL and the trigger order, and the warps; ``T`` is ``do_not_specialize``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_mxfp8 import mxfp8_quant_reference, mxfp8_scale_bytes, rms_norm_reference
from .model import DSV4

__all__ = ["QKVNormQuant", "QKVNormQuantKey", "q_kv_norm_quant_reference", "register"]


@triton.jit
def _rms_row(x_ptr, w_ptr, row, stride, eps, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + c, c < SIZE, 0).to(tl.float32)
    x = tl.load(x_ptr + row * stride + c, c < SIZE, 0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 0) / SIZE + eps) * w


@triton.jit(do_not_specialize=["num_tokens"])
def _q_kv_norm_quant_kernel(
    q_ptr, kv_ptr, qw_ptr, kvw_ptr, qo_ptr, kvo_ptr, scales_ptr,
    num_tokens, q_stride, kv_stride, eps,
    Q_SIZE: tl.constexpr,  # q_lora_rank: a model constant, a multiple of 32
    KV_SIZE: tl.constexpr,  # head_dim
    BLOCK: tl.constexpr,  # next_pow2(max(Q_SIZE, KV_SIZE)): the row tile
    LAUNCH_PDL: tl.constexpr,  # gate the PDL intrinsics; the launch option launch_pdl matches it
    TRIGGER_FIRST: tl.constexpr,  # trigger the dependents before the grid-dependency wait
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    if LAUNCH_PDL:
        if TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
    if tl.program_id(1) == 1:
        if row < num_tokens:
            tl.store(kvo_ptr + row * KV_SIZE + c, _rms_row(kv_ptr, kvw_ptr, row, kv_stride, eps, KV_SIZE, BLOCK),
                     c < KV_SIZE)  # fmt: skip
    else:
        G: tl.constexpr = Q_SIZE // 32
        g = tl.arange(0, BLOCK // 32)
        e = tl.zeros((BLOCK // 32,), tl.uint32)
        if row < num_tokens:
            y = _rms_row(q_ptr, qw_ptr, row, q_stride, eps, Q_SIZE, BLOCK)
            y = y.to(q_ptr.dtype.element_ty).to(tl.float32)  # the stored norm's rounding
            groups = tl.reshape(y, (BLOCK // 32, 32))
            a = tl.max(tl.abs(groups), 1) * (1.0 / 448.0)
            bits = a.to(tl.uint32, bitcast=True)
            exp, man = (bits >> 23) & 255, bits & 0x7FFFFF
            up = (man != 0) & ~((exp == 0) & (man <= 0x400000))
            e = tl.where(a <= 0, 0, tl.minimum(exp + up, 254))
            inv = tl.where(e == 0, 0, (254 - e) << 23).to(tl.float32, bitcast=True)
            tl.store(qo_ptr + row * Q_SIZE + c, tl.reshape(groups * inv[:, None], (BLOCK,)), c < Q_SIZE)
        e = tl.where(g < G, e, 0)
        offset = (row // 128 * triton.cdiv(G, 4) + g // 4) * 512 + row % 32 * 16 + row % 128 // 32 * 4 + g % 4
        tl.store(scales_ptr + offset, e, g < triton.cdiv(G, 4) * 4)


@attrs.frozen(kw_only=True)
class QKVNormQuantKey(warmreg.CompileKey):
    """What changes the binary: the widths and tile, the dtype, the row strides' classes, PDL, the warps."""

    q_size: int
    kv_size: int
    block: int
    dtype: str
    q_stride: warmreg.IntClass
    kv_stride: warmreg.IntClass
    trigger_first: bool
    launch_pdl: bool
    num_warps: int


class QKVNormQuant(warmreg.TritonKernel[QKVNormQuantKey]):
    """Q/KV RMSNorm with an MXFP8 query and swizzled scales (the module docstring has the math).

    :param q_size: ``q_lora_rank`` (domains only).
    :param kv_size: ``head_dim`` (domains only).
    :param dtype: the model dtype (domains only).
    """

    name = "deepseek_v4.v41_q_kv_norm_quant"
    key_type = QKVNormQuantKey
    jit = _q_kv_norm_quant_kernel

    def __init__(self, *, q_size: int, kv_size: int, dtype: str) -> None:
        self.q_size, self.kv_size, self.dtype = q_size, kv_size, dtype

    def dispatch(self, *, qr: torch.Tensor, kv: torch.Tensor, early_trigger: bool, launch_pdl: bool) -> QKVNormQuantKey:
        block = triton.next_power_of_2(max(qr.shape[1], kv.shape[1]))
        return QKVNormQuantKey(
            q_size=qr.shape[1], kv_size=kv.shape[1], block=block, dtype=warmreg.dtype_name(qr.dtype),
            q_stride=warmreg.int_class(qr.stride(0)), kv_stride=warmreg.int_class(kv.stride(0)),
            trigger_first=launch_pdl and early_trigger, launch_pdl=launch_pdl, num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype, width = getattr(torch, self.dtype), self.q_size + self.kv_size
        fused = warmreg.meta((2, width), dtype)  # the fused projection's two views
        return {
            "qr": [fused[:, : self.q_size]],
            "kv": [fused[:, self.q_size :]],
            "early_trigger": [False],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: QKVNormQuantKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        q_stride, kv_stride = warmreg.int_class_rep(key.q_stride), warmreg.int_class_rep(key.kv_stride)
        return {
            "qr": warmreg.meta((1, key.q_size), dtype, stride=(max(q_stride, key.q_size), 1)),
            "kv": warmreg.meta((1, key.kv_size), dtype, stride=(max(kv_stride, key.kv_size), 1)),
            "q_weight": warmreg.meta((key.q_size,), dtype),
            "kv_weight": warmreg.meta((key.kv_size,), dtype),
            "eps": 1e-6,
            "early_trigger": key.trigger_first,
            "launch_pdl": key.launch_pdl,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        qr: torch.Tensor,
        kv: torch.Tensor,
        q_weight: torch.Tensor,
        kv_weight: torch.Tensor,
        eps: float,
        *,
        early_trigger: bool = False,
        launch_pdl: bool | None = None,
    ) -> warmreg.LaunchSpec[QKVNormQuantKey]:
        """``(qo, scales, kvo)``: the e4m3 query ``[T, Q]``, its uint8 F8_128x4 scales and the normed KV ``[T, KV]``.

        :param qr: ``[T, Q]``, unit column stride, 16-byte aligned (the fused projection's query view).
        :param kv: ``[T, KV]``, the same (its KV view).
        :param q_weight: ``[Q]`` contiguous; ``kv_weight``: ``[KV]`` contiguous.
        :param early_trigger: trigger the PDL dependents before the wait (with PDL only).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :raises warmreg.LaunchError: for views of other shapes or layouts, weights of other sizes, or ``Q`` not a
            multiple of 32.
        """
        _check(self.name, qr, kv, q_weight, kv_weight)
        local = warmreg.runtime_platform()
        pdl = (local is not None and local.supports_pdl) if launch_pdl is None else launch_pdl
        key = self.dispatch(qr=qr, kv=kv, early_trigger=early_trigger, launch_pdl=pdl)
        tokens = qr.shape[0]
        qo = torch.empty(qr.shape, dtype=torch.float8_e4m3fn, device=qr.device)
        kvo = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        scales = torch.empty(mxfp8_scale_bytes(tokens, key.q_size), dtype=torch.uint8, device=qr.device)
        kwargs = dict(
            q_ptr=qr, kv_ptr=kv, qw_ptr=q_weight, kvw_ptr=kv_weight, qo_ptr=qo, kvo_ptr=kvo, scales_ptr=scales,
            num_tokens=tokens, q_stride=qr.stride(0), kv_stride=kv.stride(0), eps=eps, Q_SIZE=key.q_size,
            KV_SIZE=key.kv_size, BLOCK=key.block, LAUNCH_PDL=key.launch_pdl, TRIGGER_FIRST=key.trigger_first,
        )  # fmt: skip
        grid = (triton.cdiv(tokens, 128) * 128, 2) if tokens else None
        return warmreg.LaunchSpec(key, grid, kwargs, (qo, scales, kvo))


def _check(name: str, qr: torch.Tensor, kv: torch.Tensor, qw: torch.Tensor, kvw: torch.Tensor) -> None:
    """Raise :class:`warmreg.LaunchError` naming the argument vLLM's asserts refuse."""
    for arg, t in (("qr", qr), ("kv", kv)):
        if t.ndim != 2 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
            raise warmreg.LaunchError(name, f"{arg} must be a 16-byte aligned [T, width] view with unit column stride "
                                      f"(got {tuple(t.shape)}, stride {t.stride()})")  # fmt: skip
    if kv.shape[0] != qr.shape[0] or kv.dtype != qr.dtype or qr.shape[1] % 32:
        raise warmreg.LaunchError(name, f"qr ({qr.dtype} {tuple(qr.shape)}) and kv ({kv.dtype} {tuple(kv.shape)}) "
                                  "must share T and dtype, with a query width that is a multiple of 32")  # fmt: skip
    for arg, w, n in (("q_weight", qw, qr.shape[1]), ("kv_weight", kvw, kv.shape[1])):
        if w.shape != (n,) or not w.is_contiguous():
            raise warmreg.LaunchError(name, f"{arg} must be contiguous [{n}] (got {tuple(w.shape)})")


def q_kv_norm_quant_reference(
    qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`QKVNormQuant`: ``(qo, scales, kvo)``."""
    qn = rms_norm_reference(qr, q_weight, eps).to(qr.dtype)
    qo, scales = mxfp8_quant_reference(qn.float())
    return qo, scales, rms_norm_reference(kv, kv_weight, eps).to(kv.dtype)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the fused norm + query quant where V4.1 runs it (:func:`.v41.fused_query_quant`)."""
    from .v41 import fused_query_quant  # v41 imports this module

    del config  # the predicate reads the model and the target only
    kernel = QKVNormQuant(q_size=model.q_lora_rank, kv_size=model.head_dim, dtype=model.dtype)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 and fused_query_quant(model, platform) else False)
