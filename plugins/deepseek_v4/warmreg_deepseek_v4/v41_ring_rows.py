"""DeepSeek-V4.1's ring store under prefill context parallelism (vLLM 0.34
``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``: ``save_ring_rows``, ``_save_ring_rows_kernel``;
launched by ``DeepseekCompressor.forward`` when ``prev_rows`` is set, i.e. ``prefill_context_parallel_size > 1``).

Each of the fp32 ``[N, 1024]`` rows gathered across PCP ranks goes to its ring slot, capacity ``C``::

    s = slot_mapping[i];   if s >= 0:  state_cache[s // C, s % C, :] = rows[i, :]

One program per row, four warps, as in vLLM. Key: the ring capacity ``C`` (a constexpr: a power of two); the row
and ring strides are unspecialized runtime ints (vLLM: constexprs).

Where it runs: CUDA V4.1 deployments with a ratio-2 compressor and ``serving.prefill_context_parallel_size > 1``
(vLLM's ``parallel_config.prefill_context_parallel_size``), after every compressor step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41 import check_index_vector, pcp_size, ring_capacity, v41_register_predicate
from .model import DSV4

__all__ = ["V41SaveRingRows", "V41SaveRingRowsKey", "register", "v41_save_ring_rows_reference"]


@triton.jit(
    do_not_specialize=["row_stride", "state_stride", "state_row_stride"], do_not_specialize_on_alignment=["slots_ptr"]
)
def _v41_save_ring_rows_kernel(
    rows_ptr, slots_ptr, state_ptr, row_stride, state_stride, state_row_stride,
    STATE_BLOCK: tl.constexpr,  # ring capacity, a power of two
):  # fmt: skip
    i = tl.program_id(0)
    s = tl.load(slots_ptr + i)
    if s >= 0:
        d = tl.arange(0, 1024)
        dst = state_ptr + (s // STATE_BLOCK).to(tl.int64) * state_stride + (s % STATE_BLOCK) * state_row_stride
        tl.store(dst + d, tl.load(rows_ptr + i.to(tl.int64) * row_stride + d))


@attrs.frozen(kw_only=True)
class V41SaveRingRowsKey(warmreg.CompileKey):
    """What changes the binary of the PCP ring store."""

    state_block: int
    num_warps: int


class V41SaveRingRows(warmreg.TritonKernel[V41SaveRingRowsKey]):
    """Store gathered fp32 ``[kv, score]`` rows to their ring slots (the module docstring has the math).

    :param capacity: the ring capacity (domains only).
    """

    name = "deepseek_v4.v41_save_ring_rows"
    key_type = V41SaveRingRowsKey
    jit = _v41_save_ring_rows_kernel

    def __init__(self, *, capacity: int = 8) -> None:
        self.capacity = capacity

    def dispatch(self, *, state_cache: torch.Tensor) -> V41SaveRingRowsKey:
        return V41SaveRingRowsKey(state_block=state_cache.shape[1], num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"state_cache": [warmreg.meta((2, self.capacity, 1024), torch.float32)]}

    def warmup_inputs(self, key: V41SaveRingRowsKey) -> Mapping[str, Any]:
        return {
            "rows": warmreg.meta((1, 1024), torch.float32),
            "slot_mapping": warmreg.meta((1,), torch.int64),
            "state_cache": warmreg.meta((2, key.state_block, 1024), torch.float32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self, rows: torch.Tensor, slot_mapping: torch.Tensor, state_cache: torch.Tensor
    ) -> warmreg.LaunchSpec[V41SaveRingRowsKey]:
        """Write ``rows`` into ``state_cache`` in place (as ``save_ring_rows``); returns ``state_cache``.

        :param rows: float32 ``[N, 1024]`` with contiguous rows.
        :param slot_mapping: int64 ``[N]`` ring slots (``-1``: skipped), contiguous.
        :param state_cache: float32 ``[blocks, capacity, 1024]`` with contiguous rows, ``capacity`` a power of two.
        :raises warmreg.LaunchError: naming the argument that breaks these rules.
        """
        for name, t in (("rows", rows), ("state_cache", state_cache)):
            if t.dtype != torch.float32 or t.shape[-1] != 1024 or t.stride(-1) != 1:
                raise warmreg.LaunchError(
                    self.name,
                    f"{name} must be float32 [..., 1024] with contiguous rows (got {t.dtype} {tuple(t.shape)})",
                )
        if rows.ndim != 2 or state_cache.ndim != 3 or state_cache.shape[1] != warmreg.next_pow2(state_cache.shape[1]):
            raise warmreg.LaunchError(
                self.name,
                f"rows must be 2-D and state_cache 3-D with a power-of-two capacity (got {tuple(state_cache.shape)})",
            )
        N = rows.shape[0]
        check_index_vector(self.name, "slot_mapping", slot_mapping, N, torch.int64)
        key = self.dispatch(state_cache=state_cache)
        kwargs = dict(
            rows_ptr=rows, slots_ptr=slot_mapping, state_ptr=state_cache, row_stride=rows.stride(0),
            state_stride=state_cache.stride(0), state_row_stride=state_cache.stride(1), STATE_BLOCK=key.state_block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (N,) if N else None, kwargs, state_cache)


def v41_save_ring_rows_reference(rows: torch.Tensor, slot_mapping: torch.Tensor, state_cache: torch.Tensor) -> None:
    """PyTorch reference of :class:`V41SaveRingRows`: writes ``state_cache`` in place."""
    cap = state_cache.shape[1]
    live = slot_mapping >= 0
    s = slot_mapping[live]
    state_cache[s // cap, s % cap] = rows[live]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the ring store for a DeepSeek-V4.1 model with ratio-2 compressors on CUDA under prefill context
    parallelism (the module docstring).

    :raises warmreg.ConfigError: for an invalid ``serving.num_speculative_tokens`` or PCP size.
    """
    when, ratios = v41_register_predicate(model, config)
    pcp = 2 in ratios and pcp_size(config) > 1
    registry.add(V41SaveRingRows(capacity=ring_capacity(config)), when=when if pcp else False)
