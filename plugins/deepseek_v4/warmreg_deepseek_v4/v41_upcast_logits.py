"""The sparse-attention indexer's upcast of BF16 MQA logits to FP32 for the top-k kernels (vLLM 0.34
``model_executor/layers/sparse_attn_indexer.py``: ``as_fp32_logits`` and ``_upcast_logits_kernel``).

For ``logits`` bf16 ``[rows, width]`` with row stride ``S`` (DeepGEMM's aligned stride, kept) and ``row_ends`` int32
``[rows]``::

    out = float32 [rows, width] with logits' strides (torch.empty_strided: uninitialised)
    out[r, c] = float32(logits[r, c])        for c < row_ends[r]; the other columns stay unwritten

Grid ``(rows, min(cdiv(width, 1024), max(1, 1024 // rows)))``: program ``(r, j)`` converts the 1024-column tiles
``j, j + splits, ...`` of row ``r`` below its end. FP32 logits are returned unchanged without a launch (the op refuses
them: no kernel runs for them), as are empty ones (a fresh ``out``, no launch).

Where it runs: vLLM's DeepSeek indexers (``SparseAttnIndexer``) on the SM100 family, where
``_set_deepseek_indexer_logits_dtype`` makes ``attention_config.indexer_logits_dtype`` ``auto`` BF16
(``mqa_logits_use_mx_scales``): every dense prefill chunk whose top-k is not DeepSelect (the default top-k backend
``auto`` never is; ``sparse_attn_indexer``'s prefill branch), and decode rows whose top-k does not take BF16
(``takes_bf16_logits``; ``_varlen_decode_rows``, the stock decode branch, and the specialized decode's
``_decode_rows`` before ``select_candidate_blocks_cooperative``). Elsewhere the logits are FP32 and nothing launches.
This plugin plans it on sm_10x (CUDA) for DeepSeek-V4.1's index-source layers and DeepSeek-V4's C4 indexer (the same
``SparseAttnIndexer``, ``models/deepseek_v4/attention.py``, whose ``DeepseekV4ForCausalLMConfig`` sets the same BF16
default): every deployment prefills, and a prefill chunk's dense logits are upcast unless DeepSelect ranks them.

Key: the logits' dtype, ``BLOCK`` 1024, four warps (vLLM's default). Unlike vLLM (a specialized ``stride`` and
alignment-specialized pointers), the row stride is an unspecialized runtime int and no pointer is specialized on
alignment: one binary serves every row layout and every ``row_ends`` slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41 import index_ratios
from .model import DSV4

__all__ = ["BLOCK", "UpcastLogits", "UpcastLogitsKey", "register", "upcast_grid", "upcast_logits_reference"]

#: Columns a program converts at a time (vLLM's ``block``).
BLOCK = 1024
_NUM_WARPS = 4  # vLLM launches with Triton's default


@triton.jit(do_not_specialize=["stride"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr", "ends_ptr"])
def _upcast_logits_kernel(
    src_ptr, dst_ptr, ends_ptr, stride,
    BLOCK: tl.constexpr,  # columns of one tile
):  # fmt: skip
    row = tl.program_id(0)
    end = tl.load(ends_ptr + row)
    base = row.to(tl.int64) * stride  # the same strides on both sides
    for start in range(tl.program_id(1) * BLOCK, end, tl.num_programs(1) * BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        values = tl.load(src_ptr + base + cols, mask=mask)
        tl.store(dst_ptr + base + cols, values.to(tl.float32), mask=mask)


@attrs.frozen(kw_only=True)
class UpcastLogitsKey(warmreg.CompileKey):
    """What changes the binary of the logits upcast."""

    logits_dtype: str
    block: int
    num_warps: int


def upcast_grid(rows: int, width: int) -> tuple[int, int] | None:
    """vLLM's grid for ``rows`` rows of ``width`` columns, or None when nothing launches."""
    if not rows or not width:
        return None
    return rows, min(triton.cdiv(width, BLOCK), max(1, BLOCK // rows))


class UpcastLogits(warmreg.TritonKernel[UpcastLogitsKey]):
    """``as_fp32_logits`` of BF16 logits (see the module docstring)."""

    name = "deepseek_v4.indexer_upcast_logits"
    key_type = UpcastLogitsKey
    jit = _upcast_logits_kernel

    def dispatch(self, *, logits: torch.Tensor) -> UpcastLogitsKey:
        return UpcastLogitsKey(logits_dtype=warmreg.dtype_name(logits.dtype), block=BLOCK, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"logits": [warmreg.meta((1, BLOCK), torch.bfloat16)]}  # the SM100 family's BF16 logits

    def warmup_inputs(self, key: UpcastLogitsKey) -> Mapping[str, Any]:
        return {
            "logits": warmreg.meta((1, BLOCK), getattr(torch, key.logits_dtype)),
            "row_ends": warmreg.meta((1,), torch.int32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, logits: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> warmreg.LaunchSpec[UpcastLogitsKey]:
        """The FP32 copy of ``logits`` below each row's end, as ``as_fp32_logits(logits, row_ends)`` returns it for
        BF16 logits.

        :param logits: bf16 (or fp16) ``[rows, width]``, unit column stride (any row stride).
        :param row_ends: int32 ``[rows]``, contiguous: the columns to convert of each row.
        :param out: the buffer to write instead of a fresh one: exactly float32 with ``logits``' shape and strides,
            16-byte aligned (the columns past each row's end are left as they are).
        :raises warmreg.LaunchError: naming the argument of another dtype, shape or layout.
        """
        rows, width = _check(self.name, logits, row_ends)
        key = self.dispatch(logits=logits)
        out = _output(self.name, out, logits)
        kwargs = dict(src_ptr=logits, dst_ptr=out, ends_ptr=row_ends, stride=logits.stride(0), BLOCK=key.block)
        return warmreg.LaunchSpec(key, upcast_grid(rows, width), kwargs, out)


def _check(name: str, logits: torch.Tensor, row_ends: torch.Tensor) -> tuple[int, int]:
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM passes it; ``(rows,
    width)``."""
    if logits.dtype not in (torch.bfloat16, torch.float16) or logits.ndim != 2 or (
        logits.shape[1] > 1 and logits.stride(1) != 1
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name, f"logits must be bf16 [rows, width] with unit column stride (got {logits.dtype} "
            f"{tuple(logits.shape)}; as_fp32_logits returns fp32 logits without a launch)",
        )  # fmt: skip
    rows, width = logits.shape
    if row_ends.dtype != torch.int32 or row_ends.ndim != 1 or row_ends.shape[0] != rows or (
        rows > 1 and row_ends.stride(0) != 1
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name, f"row_ends must be a contiguous 1-D int32 tensor of {rows} entries (got {row_ends.dtype} "
            f"{tuple(row_ends.shape)})",
        )  # fmt: skip
    return rows, width


def _output(name: str, out: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """``out``, checked, or vLLM's ``torch.empty_strided(logits.shape, logits.stride(), float32)``."""
    if out is None:
        return torch.empty_strided(logits.shape, logits.stride(), dtype=torch.float32, device=logits.device)
    if not isinstance(out, torch.Tensor):
        raise warmreg.LaunchError(name, f"out is a {type(out).__name__}, not a tensor", fix="pass a tensor or omit out")
    if out.dtype is not torch.float32 or out.shape != logits.shape or out.stride() != logits.stride() \
            or out.device != logits.device or out.data_ptr() & 15:  # fmt: skip
        raise warmreg.LaunchError(
            name, f"out is {out.dtype} {tuple(out.shape)}, strides {out.stride()} on {out.device}; this launch writes "
            f"a 16-byte aligned float32 {tuple(logits.shape)} with the logits' strides {logits.stride()} on "
            f"{logits.device}", fix="allocate out with torch.empty_strided(logits.shape, logits.stride(), "
            "dtype=torch.float32) or leave it out",
        )  # fmt: skip
    return out


def upcast_logits_reference(logits: torch.Tensor, row_ends: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """PyTorch reference of :class:`UpcastLogits`: the FP32 copy below each row's end, ``fill`` past it (where the op
    leaves ``out`` unwritten)."""
    out = torch.full(logits.shape, fill, dtype=torch.float32, device=logits.device)
    cols = torch.arange(logits.shape[1], device=logits.device)
    keep = cols[None, :] < row_ends.long()[:, None]
    return torch.where(keep, logits.float(), out)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the upcast for a DeepSeek-V4.1 model with index-source layers or a DeepSeek-V4 model with C4 layers
    (an indexer), on the SM100 family (BF16 indexer logits: ``indexer_logits_dtype`` ``auto``, vLLM's default; see the
    module docstring). It reads no serving setting."""
    if not (index_ratios(model) if model.v41 else model.has_c4):
        return
    registry.add(UpcastLogits(), when=warmreg.is_cuda & warmreg.sm_at_least(100) & warmreg.sm_below(110))
