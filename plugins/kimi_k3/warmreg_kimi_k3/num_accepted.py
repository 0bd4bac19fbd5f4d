"""The model runner's accepted-token counts of a hybrid (KDA) model, updated after every step (vLLM 0.34
``v1/worker/gpu/model_states/mamba_hybrid.py``: ``MambaHybridModelState.postprocess_state``,
``_scatter_num_accepted_kernel`` and ``_fill_num_accepted_kernel``).

vLLM's Model Runner V2 keeps one accepted count per request slot, ``num_accepted_tokens[max_num_reqs]`` (int32,
1 for a fresh request), which the KDA layers read on the next step (a speculative step's conv update and recurrence
start from the state of the last accepted token). After a step's sampling it stores each request's count into its
slot. Math, for each batch row ``r < R`` (``R = idx_mapping.shape[0]``), with ``i = idx_mapping[r]``::

    skip the row if i < 0                                  # a row filtered out under pipeline parallelism
    num_accepted[i] = max(num_sampled[r], 1)               # scatter: the step's sampled counts (a tensor)
    num_accepted[i] = value                                # fill: one host int (vLLM passes max(num_sampled, 1))

A chunked prefill samples nothing (``num_sampled`` 0) and is stored as 1, the neutral count. Slots no row names
are left as they are. Grid ``(cdiv(R, 128),)``: 128 rows a program, one warp (vLLM launches a program per row with
its default four warps; the stores are the same).

Where it runs: ``GPUModelRunner.postprocess_sampled`` calls ``postprocess_state`` on every step of the last
pipeline stage with the sampler's ``num_sampled`` (int32 ``[R]``; the batch's ``idx_mapping`` is int64): the
scatter. The fill runs only on the other stages of a pipeline-parallel deployment
(``model_runner.py``: ``postprocess_state(input_batch.idx_mapping, 0)`` when the batch still has prefill
chunks). Model Runner V2 is vLLM 0.34's only runner, and every Kimi-K3 model (``KimiLinearForCausalLM`` and
``KimiK3ForConditionalGeneration``, on CUDA, ROCm and XPU) runs ``KimiK3ModelState`` or the hybrid model state
it extends, whether or not the config lists KDA layers. So the scatter is registered for every Kimi-K3
deployment on every GPU platform; the fill is not registered: warmreg has no pipeline-parallel setting and plans
a single stage.

Key: the three dtypes, the rows per program and ``num_warps``. ``R``, ``num_sampled``'s stride and the fill value
are runtime integers that are not specialized, and no pointer is specialized on alignment (vLLM's pointers are, and
its fill specializes the value 1): one binary serves every step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import PLUGIN, KimiK3

__all__ = [
    "BLOCK_ROWS",
    "FillNumAccepted",
    "NumAcceptedKey",
    "ScatterNumAccepted",
    "fill_num_accepted_reference",
    "register",
    "scatter_num_accepted_reference",
]

#: Batch rows per program.
BLOCK_ROWS = 128
_POINTERS = ["idx_mapping_ptr", "num_sampled_ptr", "num_accepted_ptr"]


@triton.jit(do_not_specialize=["sampled_stride", "num_rows", "value"], do_not_specialize_on_alignment=_POINTERS)
def _store_num_accepted_kernel(
    idx_mapping_ptr,  # [R]: batch row -> request slot, < 0 to skip
    num_sampled_ptr,  # [R] (SCATTER), else unused
    num_accepted_ptr,  # [max_num_reqs], updated in place
    sampled_stride,
    num_rows,
    value,  # the count every row stores (not SCATTER)
    SCATTER: tl.constexpr,  # per-row counts from num_sampled, else the one value
    BLOCK_ROWS: tl.constexpr,  # batch rows per program
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < num_rows
    slots = tl.load(idx_mapping_ptr + rows, mask=live, other=-1)
    store = live & (slots >= 0)
    if SCATTER:
        counts = tl.maximum(tl.load(num_sampled_ptr + rows.to(tl.int64) * sampled_stride, mask=store, other=1), 1)
    else:
        counts = tl.zeros([BLOCK_ROWS], dtype=tl.int32) + value
    tl.store(num_accepted_ptr + slots.to(tl.int64), counts.to(num_accepted_ptr.dtype.element_ty), mask=store)


@attrs.frozen(kw_only=True)
class NumAcceptedKey(warmreg.CompileKey):
    """What changes the binary of the accepted-count stores: no size, value or alignment does."""

    index_dtype: str  # idx_mapping
    sampled_dtype: str | None  # num_sampled; None for the fill
    accepted_dtype: str  # num_accepted_tokens
    block_rows: int
    num_warps: int


def _check_common(kernel: str, idx_mapping: torch.Tensor, num_accepted: torch.Tensor) -> None:
    ints = (torch.int32, torch.int64)
    if idx_mapping.ndim != 1 or idx_mapping.dtype not in ints:
        raise warmreg.LaunchError(
            kernel,
            f"idx_mapping must be a 1-D int32 or int64 tensor (got {idx_mapping.dtype} {tuple(idx_mapping.shape)})",
        )
    if idx_mapping.stride(0) != 1 and idx_mapping.shape[0] > 1:
        raise warmreg.LaunchError(kernel, f"idx_mapping must be contiguous (got stride {idx_mapping.stride(0)})")
    if (
        num_accepted.ndim != 1
        or num_accepted.dtype not in ints
        or (num_accepted.stride(0) != 1 and num_accepted.shape[0] > 1)
    ):
        raise warmreg.LaunchError(
            kernel,
            f"num_accepted_tokens must be a contiguous 1-D int32 or int64 tensor "
            f"(got {num_accepted.dtype} {tuple(num_accepted.shape)}, strides {num_accepted.stride()})",
        )
    if idx_mapping.device != num_accepted.device:
        raise warmreg.LaunchError(kernel, f"inputs on {idx_mapping.device} and {num_accepted.device}: use one device")


def _grid(rows: int) -> tuple[int] | None:
    return ((rows + BLOCK_ROWS - 1) // BLOCK_ROWS,) if rows else None


class ScatterNumAccepted(warmreg.TritonKernel[NumAcceptedKey]):
    """Store each batch row's ``max(num_sampled, 1)`` into its request slot (the module docstring has the math).

    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.scatter_num_accepted"
    key_type = NumAcceptedKey
    jit = _store_num_accepted_kernel

    def __init__(self, *, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def dispatch(
        self, *, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_accepted_tokens: torch.Tensor
    ) -> NumAcceptedKey:
        return NumAcceptedKey(
            index_dtype=warmreg.dtype_name(idx_mapping.dtype),
            sampled_dtype=warmreg.dtype_name(num_sampled.dtype),
            accepted_dtype=warmreg.dtype_name(num_accepted_tokens.dtype),
            block_rows=BLOCK_ROWS,
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        n = self.max_num_seqs  # vLLM's buffers: int64 idx_mapping, int32 num_sampled and num_accepted_tokens
        return {
            "idx_mapping": [warmreg.meta((n,), torch.int64)],
            "num_sampled": [warmreg.meta((n,), torch.int32)],
            "num_accepted_tokens": [warmreg.meta((n,), torch.int32)],
        }

    def warmup_inputs(self, key: NumAcceptedKey) -> Mapping[str, Any]:
        return {
            "idx_mapping": warmreg.meta((1,), getattr(torch, key.index_dtype)),
            "num_sampled": warmreg.meta((1,), getattr(torch, key.sampled_dtype or "int32")),
            "num_accepted_tokens": warmreg.meta((1,), getattr(torch, key.accepted_dtype)),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_accepted_tokens: torch.Tensor
    ) -> warmreg.LaunchSpec[NumAcceptedKey]:
        """Update ``num_accepted_tokens`` in place (vLLM's ``postprocess_state`` with a tensor ``num_sampled``);
        returns it.

        :param idx_mapping: int32 or int64 ``[R]``, contiguous: each batch row's request slot, ``< 0`` to skip.
        :param num_sampled: int32 or int64 ``[R]``, any stride: tokens each row sampled this step.
        :param num_accepted_tokens: int32 or int64 ``[max_num_reqs]``, contiguous: the runner's counts.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take.
        """
        _check_common(self.name, idx_mapping, num_accepted_tokens)
        if num_sampled.shape != idx_mapping.shape or num_sampled.dtype not in (torch.int32, torch.int64):
            raise warmreg.LaunchError(
                self.name,
                f"num_sampled must be int32 or int64 [R] = [{idx_mapping.shape[0]}] "
                f"(got {num_sampled.dtype} {tuple(num_sampled.shape)})",
            )
        if num_sampled.device != idx_mapping.device:
            raise warmreg.LaunchError(
                self.name, f"num_sampled on {num_sampled.device}, idx_mapping on {idx_mapping.device}"
            )
        key = self.dispatch(idx_mapping=idx_mapping, num_sampled=num_sampled, num_accepted_tokens=num_accepted_tokens)
        kwargs = dict(
            idx_mapping_ptr=idx_mapping, num_sampled_ptr=num_sampled, num_accepted_ptr=num_accepted_tokens,
            sampled_stride=num_sampled.stride(0), num_rows=idx_mapping.shape[0], value=1, SCATTER=True,
            BLOCK_ROWS=key.block_rows,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, _grid(idx_mapping.shape[0]), kwargs, num_accepted_tokens)


class FillNumAccepted(warmreg.TritonKernel[NumAcceptedKey]):
    """Store one count into the request slot of every batch row (vLLM's ``postprocess_state`` with an int
    ``num_sampled``, which stores ``max(num_sampled, 1)``). Not registered: see the module docstring.

    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.fill_num_accepted"
    key_type = NumAcceptedKey
    jit = _store_num_accepted_kernel

    def __init__(self, *, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def dispatch(self, *, idx_mapping: torch.Tensor, num_accepted_tokens: torch.Tensor) -> NumAcceptedKey:
        return NumAcceptedKey(
            index_dtype=warmreg.dtype_name(idx_mapping.dtype),
            sampled_dtype=None,
            accepted_dtype=warmreg.dtype_name(num_accepted_tokens.dtype),
            block_rows=BLOCK_ROWS,
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        n = self.max_num_seqs
        return {
            "idx_mapping": [warmreg.meta((n,), torch.int64)],
            "num_accepted_tokens": [warmreg.meta((n,), torch.int32)],
        }

    def warmup_inputs(self, key: NumAcceptedKey) -> Mapping[str, Any]:
        return {
            "idx_mapping": warmreg.meta((1,), getattr(torch, key.index_dtype)),
            "num_accepted_tokens": warmreg.meta((1,), getattr(torch, key.accepted_dtype)),
            "value": 1,
        }

    @warmreg.kernel_launcher
    def __call__(
        self, idx_mapping: torch.Tensor, num_accepted_tokens: torch.Tensor, value: int
    ) -> warmreg.LaunchSpec[NumAcceptedKey]:
        """Store ``value`` into the slot of every row of ``idx_mapping`` (rows ``< 0`` skipped); returns
        ``num_accepted_tokens``, updated in place.

        :param idx_mapping: int32 or int64 ``[R]``, contiguous.
        :param num_accepted_tokens: int32 or int64 ``[max_num_reqs]``, contiguous.
        :param value: the count, ``>= 1`` (vLLM stores ``max(num_sampled, 1)``).
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or a value
            ``< 1`` or past int32.
        """
        _check_common(self.name, idx_mapping, num_accepted_tokens)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
            raise warmreg.LaunchError(self.name, f"value must be an int in [1, 2**31) (got {value!r})")
        key = self.dispatch(idx_mapping=idx_mapping, num_accepted_tokens=num_accepted_tokens)
        kwargs = dict(
            idx_mapping_ptr=idx_mapping, num_sampled_ptr=idx_mapping, num_accepted_ptr=num_accepted_tokens,
            sampled_stride=0, num_rows=idx_mapping.shape[0], value=value, SCATTER=False,
            BLOCK_ROWS=key.block_rows,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, _grid(idx_mapping.shape[0]), kwargs, num_accepted_tokens)


def scatter_num_accepted_reference(
    idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_accepted_tokens: torch.Tensor
) -> torch.Tensor:
    """PyTorch reference of :class:`ScatterNumAccepted`: a copy of ``num_accepted_tokens`` with the rows stored."""
    out = num_accepted_tokens.clone()
    keep = idx_mapping >= 0
    out[idx_mapping[keep].long()] = num_sampled[keep].clamp(min=1).to(out.dtype)
    return out


def fill_num_accepted_reference(
    idx_mapping: torch.Tensor, num_accepted_tokens: torch.Tensor, value: int
) -> torch.Tensor:
    """PyTorch reference of :class:`FillNumAccepted`: a copy of ``num_accepted_tokens`` with the rows stored."""
    out = num_accepted_tokens.clone()
    out[idx_mapping[idx_mapping >= 0].long()] = value
    return out


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the scatter of the accepted counts for every Kimi-K3 deployment, on CUDA, ROCm and XPU (the
    module docstring says why the fill is not registered).

    :raises warmreg.ConfigError: for a missing ``serving.max_num_seqs``.
    """
    kernel = ScatterNumAccepted(max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN))
    registry.add(kernel, when=warmreg.is_cuda | warmreg.is_rocm | warmreg.is_xpu)
