"""Decode context parallelism, all-to-all combine: the received partial outputs merged by their packed lses.

This is ``vllm/v1/attention/ops/dcp.py: _dcp_a2a_unpack_combine_kernel``, launched by ``_dcp_a2a_unpack_combine`` at
the end of ``dcp_a2a_lse_reduce``, after the all-to-all of the buffer :mod:`warmreg_kimi_k3.dcp_a2a_pack` filled (the
same deployments: Kimi-K3's MLA decode with DCP > 1, ``dcp_comm_backend`` ``a2a`` and no direct workspace, through
``dcp_a2a_v_up_proj_lse_reduce``, with ``return_lse=False``; ``D`` is ``kv_lora_rank`` below 8 decode tokens and
``v_head_dim`` from 8, when vLLM passes ``out`` = its attention output's rows).

Math, one program per token ``b`` and head ``h``, in fp32, ``exp`` / ``log`` natural when ``IS_BASE_E`` (the backend's
``lse_base_on_e``) and base 2 otherwise, the lse ``l_r`` of rank ``r`` unpacked from ``recv[r, b, h, D:D+pack]`` (two
16-bit words, low first, for 16-bit dtypes) with NaN and +inf taken as -inf::

    m = max_r l_r  (0 when every l_r is -inf)
    lse = log(sum_r exp(l_r - m)) + m                                        -> out_lse[b, h] if RETURN_LSE
    w_r = exp(l_r - lse), NaN taken as 0
    out[b, h, :] = sum_r (0 if w_r == 0 else recv[r, b, h, :D]) * w_r        (cast to out's dtype)

summed over the ranks in order, as vLLM does. Sizes and strides are runtime ints here (vLLM's are plain ints too) and
no pointer is specialized on alignment: the key is the dtypes, ``N``, ``D``, the lse base and ``RETURN_LSE``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dcp_a2a_pack import a2a_plan, lse_pack_dim
from .dcp_correct_attn_out import lse_base_on_e
from .model import KimiK3

__all__ = ["DCPA2AUnpackCombine", "DCPA2AUnpackCombineKey", "dcp_a2a_unpack_combine_reference", "register"]

_INTS = ["recv_stride_n", "recv_stride_b", "recv_stride_h", "out_stride_b", "out_stride_h", "out_lse_stride_b",
         "out_lse_stride_h"]  # fmt: skip


@triton.jit
def _unpacked_lse(base, HEAD_DIM: tl.constexpr, LSE_PACK_DIM: tl.constexpr):
    """The lse stored after a row's ``HEAD_DIM`` values, NaN and +inf as -inf."""
    if LSE_PACK_DIM == 1:
        lse = tl.load(base + HEAD_DIM).to(tl.float32)
    else:
        lo = tl.load(base + HEAD_DIM).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = tl.load(base + HEAD_DIM + 1).to(tl.uint16, bitcast=True).to(tl.uint32)
        lse = (lo | (hi << 16)).to(tl.float32, bitcast=True)
    return tl.where((lse != lse) | (lse == float("inf")), -float("inf"), lse)


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["recv_ptr", "out_ptr", "out_lse_ptr"])
def _dcp_a2a_unpack_combine_kernel(
    recv_ptr,  # [N, B, H, D + pack], unit stride over the last dim: the ranks' outputs and lses
    out_ptr,  # [B, H, D], D contiguous: the combined output
    out_lse_ptr,  # [B, H] float32 with RETURN_LSE (else any pointer of recv's dtype, unwritten)
    recv_stride_n,
    recv_stride_b,
    recv_stride_h,
    out_stride_b,
    out_stride_h,
    out_lse_stride_b,
    out_lse_stride_h,
    N: tl.constexpr,  # the DCP group size: the rank loops are unrolled
    HEAD_DIM: tl.constexpr,  # D, a power of two (the arange)
    IS_BASE_E: tl.constexpr,  # natural-log lses (else base 2)
    RETURN_LSE: tl.constexpr,  # write the global lse
    LSE_PACK_DIM: tl.constexpr,  # 2: the fp32 lse as two 16-bit words; 1: one fp32
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    row = recv_ptr + b * recv_stride_b + h * recv_stride_h
    top = -float("inf")
    for r in tl.static_range(N):
        top = tl.maximum(top, _unpacked_lse(row + r * recv_stride_n, HEAD_DIM, LSE_PACK_DIM))
    top = tl.where(top == -float("inf"), 0.0, top)
    total = 0.0
    for r in tl.static_range(N):
        lse = _unpacked_lse(row + r * recv_stride_n, HEAD_DIM, LSE_PACK_DIM)
        if IS_BASE_E:
            total += tl.exp(lse - top)
        else:
            total += tl.exp2(lse - top)
    if IS_BASE_E:
        total = tl.log(total) + top
    else:
        total = tl.log2(total) + top
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for r in tl.static_range(N):
        lse = _unpacked_lse(row + r * recv_stride_n, HEAD_DIM, LSE_PACK_DIM)
        if IS_BASE_E:
            w = tl.exp(lse - total)
        else:
            w = tl.exp2(lse - total)
        w = tl.where(w != w, 0.0, w)
        part = tl.load(row + r * recv_stride_n + d).to(tl.float32)
        acc += tl.where(w == 0.0, 0.0, part) * w
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, acc)
    if RETURN_LSE:
        tl.store(out_lse_ptr + b * out_lse_stride_b + h * out_lse_stride_h, total)


@attrs.frozen(kw_only=True)
class DCPA2AUnpackCombineKey(warmreg.CompileKey):
    """What changes the binary: the dtype, ``N``, ``D``, the lse base and whether the lse is returned."""

    dtype: str
    world_size: int
    head_dim: int
    is_base_e: bool
    return_lse: bool
    num_warps: int


class DCPA2AUnpackCombine(warmreg.TritonKernel[DCPA2AUnpackCombineKey]):
    """The received partial outputs merged by their lses (the module docstring has the math).

    :param dtype: the combined output's dtype (the model's; domains only).
    :param world_size: the DCP group size (domains only).
    :param head_dims: ``D`` of each combine the deployment runs (domains only).
    :param is_base_e: the attention backend's ``lse_base_on_e`` (domains only).
    :param heads: heads per rank (domains only; not in the key).
    """

    name = "kimi_k3.dcp_a2a_unpack_combine"
    key_type = DCPA2AUnpackCombineKey
    jit = _dcp_a2a_unpack_combine_kernel

    def __init__(
        self, *, dtype: str, world_size: int, head_dims: Iterable[int], is_base_e: bool, heads: int = 16
    ) -> None:
        self.dtype, self.world_size, self.is_base_e, self.heads = dtype, world_size, is_base_e, heads
        self.head_dims = tuple(sorted(head_dims))

    def dispatch(
        self, *, recv_buffer: torch.Tensor, return_lse: bool, is_lse_base_on_e: bool
    ) -> DCPA2AUnpackCombineKey:
        return DCPA2AUnpackCombineKey(
            dtype=warmreg.dtype_name(recv_buffer.dtype), world_size=recv_buffer.shape[0],
            head_dim=recv_buffer.shape[-1] - lse_pack_dim(recv_buffer.dtype), is_base_e=bool(is_lse_base_on_e),
            return_lse=bool(return_lse), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        pack = lse_pack_dim(dtype)
        return {
            "recv_buffer": [warmreg.meta((self.world_size, 8, self.heads, d + pack), dtype) for d in self.head_dims],
            "return_lse": [False],  # dcp_a2a_v_up_proj_lse_reduce never asks for it
            "is_lse_base_on_e": [self.is_base_e],
        }

    def warmup_inputs(self, key: DCPA2AUnpackCombineKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        return {
            "recv_buffer": warmreg.meta((key.world_size, 1, 1, key.head_dim + lse_pack_dim(dtype)), dtype),
            "return_lse": key.return_lse,
            "is_lse_base_on_e": key.is_base_e,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        recv_buffer: torch.Tensor,
        *,
        return_lse: bool = False,
        is_lse_base_on_e: bool = True,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[DCPA2AUnpackCombineKey]:
        """Combine and return ``out [B, H, D]`` (with ``return_lse``, ``(out, lse [B, H] float32)``): vLLM's
        ``_dcp_a2a_unpack_combine(recv_buffer, D, pack, return_lse, is_lse_base_on_e, out)``, whose ``D`` and
        ``pack`` follow from the shape and dtype.

        :param recv_buffer: ``[N, B, H, D + pack]`` float16/bfloat16/float32, ``D`` a power of two, unit stride over
            the last dim.
        :param return_lse: also return the global lse.
        :param is_lse_base_on_e: natural-log lses (else base 2).
        :param out: a preallocated contiguous ``[B, H, D]`` of the buffer's dtype (vLLM's attention output rows); the
            lse of ``return_lse`` is always fresh.
        :raises warmreg.LaunchError: for a shape, dtype or layout the kernel cannot take, or a wrong ``out``.
        """
        self._check(recv_buffer)
        key = self.dispatch(recv_buffer=recv_buffer, return_lse=return_lse, is_lse_base_on_e=is_lse_base_on_e)
        n, b, h, _ = recv_buffer.shape
        dev = recv_buffer.device
        result = warmreg.output(self.name, "out", out, (b, h, key.head_dim), recv_buffer.dtype, dev)
        # unwritten without RETURN_LSE: the output stands in for vLLM's [1, 1] buffer of the same dtype
        lse = torch.empty((b, h), dtype=torch.float32, device=dev) if return_lse else result[:1, 0]
        kwargs = dict(
            recv_ptr=recv_buffer, out_ptr=result, out_lse_ptr=lse, recv_stride_n=recv_buffer.stride(0),
            recv_stride_b=recv_buffer.stride(1), recv_stride_h=recv_buffer.stride(2), out_stride_b=result.stride(0),
            out_stride_h=result.stride(1), out_lse_stride_b=lse.stride(0), out_lse_stride_h=lse.stride(1), N=n,
            HEAD_DIM=key.head_dim, IS_BASE_E=key.is_base_e, RETURN_LSE=key.return_lse,
            LSE_PACK_DIM=lse_pack_dim(recv_buffer.dtype),
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (b, h) if b and h else None, kwargs, (result, lse) if return_lse else result)

    def _check(self, recv: torch.Tensor) -> None:
        if recv.ndim != 4 or recv.dtype not in (torch.float16, torch.bfloat16, torch.float32) or recv.shape[0] < 1:
            raise warmreg.LaunchError(
                self.name, f"recv_buffer must be a float16/bfloat16/float32 [N, B, H, D + pack] (got {recv.dtype} "
                f"{tuple(recv.shape)})",
            )  # fmt: skip
        d = recv.shape[-1] - lse_pack_dim(recv.dtype)
        if d < 1 or d != warmreg.next_pow2(d) or recv.stride(3) != 1:
            raise warmreg.LaunchError(
                self.name, f"recv_buffer's last dim must be D + {lse_pack_dim(recv.dtype)} with D a power of two, unit "
                f"stride (got {recv.shape[-1]}, strides {recv.stride()})",
            )  # fmt: skip


def dcp_a2a_unpack_combine_reference(
    recv_buffer: torch.Tensor, *, return_lse: bool = False, is_lse_base_on_e: bool = True
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`DCPA2AUnpackCombine`: ``out`` (and the global lse with ``return_lse``)."""
    pack = lse_pack_dim(recv_buffer.dtype)
    d = recv_buffer.shape[-1] - pack
    words = recv_buffer[..., d:]
    lses = words[..., 0].float() if pack == 1 else words.contiguous().view(torch.float32)[..., 0]
    exp, log = (torch.exp, torch.log) if is_lse_base_on_e else (torch.exp2, torch.log2)
    inf = float("inf")
    lses = torch.where(lses.isnan() | (lses == inf), -inf, lses)
    top = lses.amax(0)
    top = torch.where(top == -inf, 0.0, top)
    total = log(exp(lses - top).sum(0)) + top
    acc = torch.zeros(recv_buffer.shape[1:3] + (d,), dtype=torch.float32, device=recv_buffer.device)
    for r in range(recv_buffer.shape[0]):
        w = exp(lses[r] - total)
        w = torch.where(w.isnan(), 0.0, w)[..., None]
        acc += torch.where(w == 0, 0.0, recv_buffer[r, ..., :d].float()) * w
    out = acc.to(recv_buffer.dtype)
    return (out, total) if return_lse else out


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the combine on CUDA where :func:`~warmreg_kimi_k3.dcp_a2a_pack.a2a_plan` finds the Triton all-to-all
    combine (every MLA layer's decode, after the pack and the all-to-all).

    :raises warmreg.ConfigError: as :func:`~warmreg_kimi_k3.dcp_a2a_pack.a2a_plan`.
    """
    plan = a2a_plan(m, config)
    if plan is not None:
        kernel = DCPA2AUnpackCombine(
            dtype=m.dtype, world_size=plan.world_size, head_dims=plan.head_dims, is_base_e=lse_base_on_e(config),
            heads=plan.heads,
        )  # fmt: skip
        registry.add(kernel, when=warmreg.is_cuda)
