"""Fused Q/KV RMSNorm: two RMSNorms in one launch (DeepSeek-V4, Kimi-K3 and other MLA models).

Math, per token ``t`` and task ``X`` in ``{Q, KV}``, entirely in fp32 with one cast at the store::

    x = float32(in_X[t, :SIZE_X]);  w = float32(w_X[:SIZE_X])
    out_X[t, :] = cast(x * rsqrt(sum(x * x) / SIZE_X + eps) * w, out dtype)

Inputs are usually strided views of one fused projection (last dim contiguous); outputs are fresh
and contiguous. Grid ``(T, 2)``: tokens on axis 0 (no 65535 limit), the task on axis 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from ..contract.config import WarmConfig
from ..contract.domains import next_pow2, runtime_platform, token_counts
from ..contract.kernel import LaunchSpec, TritonKernel, kernel_launcher, meta, output
from ..values.errors import LaunchError
from ..values.key import CompileKey, IntClass, dtype_name, int_class, int_class_rep, is_aligned
from ..values.platform import Platform

__all__ = ["FusedQKVRMSNorm", "QKVRMSNormKey", "fused_qkv_rmsnorm_reference"]


@triton.jit
def _rms_row(in_ptr, w_ptr, out_ptr, eps, SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK_SIZE)
    mask = offs < SIZE
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:  # weights are ours; the activations come from the previous kernel
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    x = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / SIZE + eps)
    tl.store(out_ptr + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_qkv_rmsnorm_kernel(
    q_in_ptr,
    kv_in_ptr,
    q_w_ptr,
    kv_w_ptr,
    q_out_ptr,
    kv_out_ptr,
    q_in_stride,
    kv_in_stride,
    eps,
    Q_SIZE: tl.constexpr,  # q row length: a model constant
    KV_SIZE: tl.constexpr,  # kv row length: a model constant
    BLOCK_SIZE: tl.constexpr,  # next_pow2(max(Q_SIZE, KV_SIZE)): one tile covers a row
    USE_PDL: tl.constexpr,  # gate the PDL intrinsics; the launch option launch_pdl matches it
):
    t = tl.program_id(0).to(tl.int64)  # in_stride * T can exceed 2**31
    if tl.program_id(1) == 0:
        _rms_row(q_in_ptr + t * q_in_stride, q_w_ptr, q_out_ptr + t * Q_SIZE, eps, Q_SIZE, BLOCK_SIZE, USE_PDL)
    else:
        _rms_row(kv_in_ptr + t * kv_in_stride, kv_w_ptr, kv_out_ptr + t * KV_SIZE, eps, KV_SIZE, BLOCK_SIZE, USE_PDL)


@attrs.frozen(kw_only=True, cache_hash=True)  # dispatch hands out memoized keys: hash them once
class QKVRMSNormKey(CompileKey):
    """What changes the binary of the fused Q/KV RMSNorm."""

    dtype: str  # activation (and output) dtype
    weight_dtype: str
    q_size: int
    kv_size: int
    block_size: int
    q_in_stride: IntClass
    kv_in_stride: IntClass
    q_in_aligned: bool  # the inputs are views into a fused projection: 16-byte alignment varies
    kv_in_aligned: bool
    q_weight_aligned: bool
    kv_weight_aligned: bool
    num_warps: int
    launch_pdl: bool



class FusedQKVRMSNorm(TritonKernel[QKVRMSNormKey]):
    """The fused Q/KV RMSNorm, configured with one model's projection layout.

    :param q_size: q row length (``q_lora_rank``).
    :param kv_size: kv row length (DeepSeek-V4 ``head_dim``; Kimi-K3 ``kv_lora_rank``).
    :param proj_width: row length of the fused projection the inputs are views of (the row stride).
    :param kv_offset: column where kv starts in the projection (``q_size`` unless something sits between).
    :param dtype: activation dtype name (``bfloat16``).
    :param plugin: the registering plugin, named in config errors.
    """

    name = "warmreg.ops.fused_qkv_rmsnorm"
    key_type = QKVRMSNormKey
    jit = _fused_qkv_rmsnorm_kernel
    #: dispatch's memo, shared by every instance (a key is a function of the inputs alone): the keys
    #: a plan dispatches from a deployment's domains are there at an engine instance's first launch
    _keys: ClassVar[dict[tuple[Any, ...], QKVRMSNormKey]] = {}

    def __init__(
        self,
        *,
        q_size: int,
        kv_size: int,
        proj_width: int,
        kv_offset: int | None = None,
        dtype: str = "bfloat16",
        weight_dtype: str | None = None,
        plugin: str = "warmreg",
    ) -> None:
        self.q_size, self.kv_size, self.proj_width = q_size, kv_size, proj_width
        self.kv_offset = q_size if kv_offset is None else kv_offset
        self.dtype = getattr(torch, dtype)
        self.weight_dtype = getattr(torch, weight_dtype or dtype)
        self.plugin = plugin
        self._pdl: bool | None = None  # the local GPU's default launch_pdl, looked up once

    def dispatch(
        self, *, qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, launch_pdl: bool
    ) -> QKVRMSNormKey:
        return self._key(qr, kv, q_weight, kv_weight, launch_pdl, qr.shape, kv.shape, qr.stride(0), kv.stride(0))

    def _key(
        self, qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, launch_pdl: bool,
        q_shape: torch.Size, kv_shape: torch.Size, q_stride: int, kv_stride: int,
    ) -> QKVRMSNormKey:  # fmt: skip
        # Memoized on exactly what the key and the checks of the weights are computed from (a pure
        # function stays pure): on the decode hot path one tuple lookup replaces building a 13-field
        # key and comparing the weights' shapes and dtypes, and the key's hash is cached.
        inputs = (
            qr.dtype, kv.dtype, q_weight.dtype, kv_weight.dtype, q_shape[-1], kv_shape[-1], q_weight.shape, kv_weight.shape,
            q_stride, kv_stride,
            (qr.data_ptr() & 15) | (kv.data_ptr() & 15) << 4 | (q_weight.data_ptr() & 15) << 8 | (kv_weight.data_ptr() & 15) << 12,
            launch_pdl,
        )  # fmt: skip
        key = self._keys.get(inputs)
        if key is None:
            if q_weight.shape != q_shape[-1:] or kv_weight.shape != kv_shape[-1:]:
                raise LaunchError(self.name, "weights must match the row lengths of qr and kv")
            if kv.dtype != qr.dtype or kv_weight.dtype != q_weight.dtype:
                raise LaunchError(
                    self.name, f"qr and kv ({qr.dtype}, {kv.dtype}) and their weights ({q_weight.dtype}, {kv_weight.dtype}) "
                    "must each share one dtype", fix="pass views of one projection and weights of one dtype",
                )  # fmt: skip
            key = self._dispatch(qr=qr, kv=kv, q_weight=q_weight, kv_weight=kv_weight, launch_pdl=launch_pdl)
            if len(self._keys) < 4096:
                self._keys[inputs] = key
        return key

    def _dispatch(
        self, *, qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, launch_pdl: bool
    ) -> QKVRMSNormKey:
        q_size, kv_size = qr.shape[-1], kv.shape[-1]
        block = next_pow2(q_size if q_size > kv_size else kv_size)
        return QKVRMSNormKey(
            dtype=dtype_name(qr.dtype),
            weight_dtype=dtype_name(q_weight.dtype),
            q_size=q_size,
            kv_size=kv_size,
            block_size=block,
            q_in_stride=int_class(qr.stride(0)),
            kv_in_stride=int_class(kv.stride(0)),
            q_in_aligned=is_aligned(qr),
            kv_in_aligned=is_aligned(kv),
            q_weight_aligned=is_aligned(q_weight),
            kv_weight_aligned=is_aligned(kv_weight),
            num_warps=8 if block >= 2048 else 4,
            launch_pdl=launch_pdl,
        )

    def _views(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        proj = meta((tokens, self.proj_width), self.dtype)
        return proj[:, : self.q_size], proj[:, self.kv_offset : self.kv_offset + self.kv_size]

    def domains(self, config: WarmConfig, platform: Platform) -> Mapping[str, Iterable[Any]]:
        views = [self._views(t) for t in token_counts(config, plugin=self.plugin)]
        return {
            "qr": [q for q, _ in views],
            "kv": [kv for _, kv in views],
            "q_weight": [meta((self.q_size,), self.weight_dtype)],
            "kv_weight": [meta((self.kv_size,), self.weight_dtype)],
            "launch_pdl": [platform.supports_pdl],
        }

    def when(self, *, qr: torch.Tensor, kv: torch.Tensor, **_: Any) -> bool:
        return qr.shape[0] == kv.shape[0]  # both are views of one projection

    def warmup_inputs(self, key: QKVRMSNormKey) -> Mapping[str, Any]:
        dtype, wdtype = getattr(torch, key.dtype), getattr(torch, key.weight_dtype)
        return {
            "qr": meta((1, key.q_size), dtype, stride=(int_class_rep(key.q_in_stride), 1), offset=0 if key.q_in_aligned else 1),
            "kv": meta((1, key.kv_size), dtype, stride=(int_class_rep(key.kv_in_stride), 1), offset=0 if key.kv_in_aligned else 1),
            "q_weight": meta((key.q_size,), wdtype, offset=0 if key.q_weight_aligned else 1),
            "kv_weight": meta((key.kv_size,), wdtype, offset=0 if key.kv_weight_aligned else 1),
            "eps": 1e-6,
            "launch_pdl": key.launch_pdl,
        }

    @kernel_launcher
    def __call__(
        self,
        qr: torch.Tensor,
        kv: torch.Tensor,
        q_weight: torch.Tensor,
        kv_weight: torch.Tensor,
        eps: float,
        launch_pdl: bool | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> LaunchSpec[QKVRMSNormKey]:
        """Normalize ``qr`` and ``kv``; returns ``(q_out, kv_out)``, fresh or ``out``.

        :param launch_pdl: use programmatic dependent launch (default: the local GPU supports it).
        :param out: preallocated ``(q_out [T, q_size], kv_out [T, kv_size])``, contiguous, of the inputs'
            dtype and device (engines' persistent buffers, CUDA-graph capture); the launch then allocates
            nothing.
        :raises LaunchError: for inputs that are not 2-D with a contiguous last dim, mismatched token
            counts or weight lengths, or qr and kv (or their weights) of two dtypes.
        """
        # checks ordered and written for the decode hot path (each costs a fraction of a microsecond)
        q_shape, kv_shape, q_stride, kv_stride = qr.shape, kv.shape, qr.stride(), kv.stride()
        if len(q_shape) != 2 or len(kv_shape) != 2 or q_shape[0] != kv_shape[0]:
            raise LaunchError(self.name, f"qr {tuple(q_shape)} and kv {tuple(kv_shape)} must be [T, size] with one T")
        if q_stride[1] != 1 or kv_stride[1] != 1:
            raise LaunchError(self.name, "qr and kv need a contiguous last dim", fix="pass views of the projection rows")
        if launch_pdl is None:
            launch_pdl = self._pdl
            if launch_pdl is None:
                local = runtime_platform()
                launch_pdl = self._pdl = bool(local and local.supports_pdl)
        key = self._key(qr, kv, q_weight, kv_weight, launch_pdl, q_shape, kv_shape, q_stride[0], kv_stride[0])
        if out is None:
            # new_empty_strided with the contiguous strides: the same tensors as new_empty, which
            # costs ~0.7 us more a call in PyTorch's argument handling (two calls: 7.0 vs 4.1 us on the H200 host)
            q_out = qr.new_empty_strided(q_shape, (q_shape[1], 1))
            kv_out = kv.new_empty_strided(kv_shape, (kv_shape[1], 1))
        else:
            q_out = output(self.name, "out[0]", out[0], q_shape, qr.dtype, qr.device)
            kv_out = output(self.name, "out[1]", out[1], kv_shape, kv.dtype, kv.device)
        kwargs = {
            "q_in_ptr": qr, "kv_in_ptr": kv, "q_w_ptr": q_weight, "kv_w_ptr": kv_weight, "q_out_ptr": q_out, "kv_out_ptr": kv_out,
            "q_in_stride": q_stride[0], "kv_in_stride": kv_stride[0], "eps": eps,
            "Q_SIZE": key.q_size, "KV_SIZE": key.kv_size, "BLOCK_SIZE": key.block_size, "USE_PDL": key.launch_pdl,
        }  # fmt: skip
        grid = (q_shape[0], 2) if q_shape[0] else None
        return LaunchSpec(key, grid, kwargs, (q_out, kv_out))


def fused_qkv_rmsnorm_reference(
    qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: fp32 RMSNorm of each input, one cast to the input dtype at the end."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()
        return y.to(x.dtype)

    return norm(qr, q_weight), norm(kv, kv_weight)
