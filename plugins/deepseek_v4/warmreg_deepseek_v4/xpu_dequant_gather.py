"""XPU sparse decode's dequant gather: the ``fp8_ds_mla`` cache rows a decode step attends to, as BF16 workspace rows
(vLLM 0.34 ``models/deepseek_v4/xpu/xpu_sparse_decode_fp8.py``: ``dequant_gather_slots`` →
``_dequant_gather_slots_kernel``, called by ``xpu_sparse_decode_fp8`` from ``xpu_sparse.py:
DeepseekV4XPUSparseAttention._forward_decode`` once for the compressed cache's top-k rows (C4 / C128 layers) and once
for the SWA rows, every XPU decode step).

Math, for workspace row ``i`` and global slot ``s = indices[i]`` of a cache with ``BS`` tokens a page (page ``p = s //
BS``, token ``j = s % BS``, page bytes at ``cache + p * page_stride``; :mod:`.fp8_ds_mla`'s layout: a token's 448 FP8
NoPE bytes and 64 BF16 RoPE values at ``j * 576``, its 7 UE8M0 scale bytes at ``BS * 576 + j * 8``)::

    out[i, 64 q + c] = bf16(float(e4m3(nope[64 q + c])) * 2 ** (scale[q] - 127))   q < 7, c < 64
    out[i, 448 + r] = rope[r]                                                        r < 64
    out[i, :] = 0                                                                    if s < 0

Key: the page's token count (a constexpr: 64 for the SWA and C4 caches, 2 for C128) and ``num_warps``. The page
stride is a runtime int (``do_not_specialize``: unified pages differ from a group's own), and no pointer is
specialized on alignment (the workspace halves and the caches are views).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .fp8_ds_mla import (
    HEAD_DIM,
    NOPE_DIM,
    QUANT_BLOCK,
    ROPE_DIM,
    SCALE_BYTES,
    TOKEN_BYTES,
    check_model_layout,
    paged_caches,
    uses_fp8_ds_mla,
)
from .model import DSV4

__all__ = ["DequantGatherKey", "XPUDequantGatherSlots", "register", "xpu_dequant_gather_reference"]


@triton.jit(do_not_specialize=["page_stride"], do_not_specialize_on_alignment=["out_ptr", "cache_ptr", "indices_ptr"])
def _xpu_dequant_gather_kernel(
    out_ptr,
    cache_ptr,
    indices_ptr,
    page_stride,
    BLOCK_SIZE: tl.constexpr,  # tokens a page: where the scale region starts
    NOPE: tl.constexpr,  # FP8 values of a token (448)
    ROPE: tl.constexpr,  # BF16 values of a token (64)
    QBLOCK: tl.constexpr,  # values per scale (64)
    TOKEN: tl.constexpr,  # bytes of a token's values (576)
    SCALES: tl.constexpr,  # bytes of a token's scales (8)
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices_ptr + i).to(tl.int64)
    valid = slot >= 0
    s = tl.maximum(slot, 0)
    page = cache_ptr + (s // BLOCK_SIZE) * page_stride
    token = page + (s % BLOCK_SIZE) * TOKEN
    scales = page + BLOCK_SIZE * TOKEN + (s % BLOCK_SIZE) * SCALES
    row = out_ptr + i * (NOPE + ROPE)
    c = tl.arange(0, QBLOCK)
    for q in tl.static_range(NOPE // QBLOCK):
        x = tl.load(token + q * QBLOCK + c, mask=tl.where(valid, c < QBLOCK, False), other=0)
        e = tl.load(scales + q, mask=valid, other=127).to(tl.float32)
        y = x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.exp2(e - 127.0)
        tl.store(row + q * QBLOCK + c, y.to(tl.bfloat16))
    r = tl.arange(0, ROPE)
    rope = tl.load(
        (token + NOPE).to(tl.pointer_type(tl.bfloat16)) + r, mask=tl.where(valid, r < ROPE, False), other=0.0
    )
    tl.store((row + NOPE).to(tl.pointer_type(tl.bfloat16)) + r, rope)


@attrs.frozen(kw_only=True)
class DequantGatherKey(warmreg.CompileKey):
    """What changes the binary of the XPU dequant gather."""

    block_size: int  # tokens a page of the gathered cache
    num_warps: int


class XPUDequantGatherSlots(warmreg.TritonKernel[DequantGatherKey]):
    """The dequant gather of the XPU FP8 sparse decode (see the module docstring).

    :param block_sizes: tokens a page of each ``fp8_ds_mla`` cache the decode gathers from (SWA, C4, C128).
    """

    name = "deepseek_v4.xpu_dequant_gather_slots"
    key_type = DequantGatherKey
    jit = _xpu_dequant_gather_kernel

    def __init__(self, *, block_sizes: Sequence[int] = (64,)) -> None:
        self.block_sizes = tuple(sorted(set(block_sizes)))

    def dispatch(self, *, cache: torch.Tensor) -> DequantGatherKey:
        return DequantGatherKey(block_size=cache.shape[1], num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"cache": [warmreg.meta((1, bs, TOKEN_BYTES + SCALE_BYTES), torch.uint8) for bs in self.block_sizes]}

    def warmup_inputs(self, key: DequantGatherKey) -> Mapping[str, Any]:
        return {
            "cache": warmreg.meta((2, key.block_size, TOKEN_BYTES + SCALE_BYTES), torch.uint8),
            "indices": warmreg.meta((3,), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, cache: torch.Tensor, indices: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[DequantGatherKey]:
        """Returns BF16 ``[N, 512]`` rows (``out`` when given: vLLM's workspace half, contiguous rows).

        :param cache: uint8 ``[num_blocks, block_size, 584]`` ``fp8_ds_mla`` pages, any page stride (``stride(0)``).
        :param indices: int32 ``[N]`` global slots, -1 for none (a zero row).
        :raises warmreg.LaunchError: naming the argument, for wrong dtypes or shapes.
        """
        if cache.dtype != torch.uint8 or cache.ndim != 3 or cache.shape[2] != TOKEN_BYTES + SCALE_BYTES:
            raise warmreg.LaunchError(
                self.name, f"cache must be uint8 [blocks, block_size, {TOKEN_BYTES + SCALE_BYTES}] (got "
                f"{cache.dtype} {tuple(cache.shape)})",
            )  # fmt: skip
        if cache.shape[1] > 1 and (cache.stride(1) != TOKEN_BYTES + SCALE_BYTES or cache.stride(2) != 1):
            raise warmreg.LaunchError(self.name, "cache pages must be packed (only the page stride is free)")
        if indices.dtype != torch.int32 or indices.ndim != 1 or (indices.shape[0] > 1 and indices.stride(0) != 1):
            raise warmreg.LaunchError(self.name, f"indices must be a contiguous 1-D int32 tensor (got {indices.dtype})")
        n = indices.shape[0]
        out = warmreg.output(self.name, "out", out, (n, HEAD_DIM), torch.bfloat16, indices.device)
        key = self.dispatch(cache=cache)
        kwargs = dict(
            out_ptr=out, cache_ptr=cache, indices_ptr=indices, page_stride=cache.stride(0), BLOCK_SIZE=key.block_size,
            NOPE=NOPE_DIM, ROPE=ROPE_DIM, QBLOCK=QUANT_BLOCK, TOKEN=TOKEN_BYTES, SCALES=SCALE_BYTES,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (n,) if n else None, kwargs, out)


def xpu_dequant_gather_reference(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`XPUDequantGatherSlots`."""
    bs = cache.shape[1]
    flat = cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))
    out = torch.zeros(indices.shape[0], HEAD_DIM, dtype=torch.bfloat16)
    for i, s in enumerate(indices.tolist()):
        if s < 0:
            continue
        page, j = flat[s // bs].cpu(), s % bs
        nope = page[j * TOKEN_BYTES : j * TOKEN_BYTES + NOPE_DIM].view(torch.float8_e4m3fn).float()
        e = page[bs * TOKEN_BYTES + j * SCALE_BYTES :][: NOPE_DIM // QUANT_BLOCK].float()
        out[i, :NOPE_DIM] = (nope * torch.exp2(e - 127).repeat_interleave(QUANT_BLOCK)).to(torch.bfloat16)
        out[i, NOPE_DIM:] = page[j * TOKEN_BYTES + NOPE_DIM : (j + 1) * TOKEN_BYTES].view(torch.bfloat16)
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather on XPU over every ``fp8_ds_mla`` cache a decode step reads: the SWA cache, and the C4 /
    C128 caches of the compressed layers (:func:`.fp8_ds_mla.paged_caches`). DeepSeek-V4.1 runs on CUDA only here.

    :raises warmreg.ConfigError: if the model's head does not fit the layout (448 + 64).
    """
    if model.v41 or not uses_fp8_ds_mla(config, platform):
        return
    check_model_layout(model)
    sizes = [cache.block_size for cache in paged_caches(model, config)]
    registry.add(XPUDequantGatherSlots(block_sizes=sizes), when=warmreg.is_xpu)
