"""Gather the prefill requests' initial KDA states into one dense tensor (vLLM 0.33
``model_executor/layers/mamba/ops/gather_initial_states.py``: ``gather_initial_states``,
``_gather_initial_states_kernel``).

Math, for each request ``n`` of ``N`` (``indices`` and ``has_initial_state`` both ``[N]``), with a state row
being everything past the slot dim (``state[0].numel()`` elements, ``H * V * K`` for the KDA state)::

    out[n] = state[indices[n]]   if has_initial_state[n]
             0                   otherwise (indices[n] is then never read as an address)

``state`` is the layer's recurrent-state pool ``[num_slots, ...]``: its slot stride is free (a Mamba page may
pad it) but each row is dense. ``out`` is a fresh ``[N, *state.shape[1:]]`` of the pool's dtype. Grid
``(cdiv(row, BLOCK), N)``, ``BLOCK = min(next_pow2(row), 1024)``, 8 warps, as in vLLM.

Where it runs: ``KimiK3DeltaAttention._forward`` (``vllm/models/kimi_k3/nvidia/kda.py``) calls it on every step
with prefill requests, before the chunked prefill, with ``non_spec_state_indices_tensor`` (a column of the
block table, or of the aligned state indices) and the builder's ``has_initial_state``
(``num_computed_tokens > 0``); it does so for every ``kda_prefill_backend`` (FlashKDA, FlashInfer and Triton all
take its output as their initial state). ROCm's Kimi-K3 KDA (``models/kimi_k3/amd/ops/kda_prefill.py:
chunk_kda_prefill``) calls it too, on its Triton path: it hands the pool over (``state_cache``) and that function
gathers, runs ``chunk_kda_with_fused_gate`` and scatters (a ROCm tensor passes vLLM's ``is_cuda`` assertion); its
``fused`` and ``gluon`` paths read the pool themselves. So it is registered whenever there are KDA layers on CUDA
and XPU, and on ROCm where the prefill backend resolves to ``"triton"``
(:func:`~warmreg_kimi_k3.backends.kda_prefill_backend`).

Key: the state dtype, the index dtype (int32 or int64), the row size and tile (constexprs), the integer class of
the pool's slot stride and the pool's alignment, PDL (``launch_pdl`` on SM >= 90, as vLLM's
``is_arch_support_pdl``) and ``num_warps``. ``indices`` and ``has_initial_state`` are read one scalar a program:
their strides are not specialized and their pointers not on alignment (vLLM specializes both strides; here a
column view of any block-table width is served by the same binary).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from .backends import kda_layout, kda_prefill_backend
from .model import PLUGIN, KimiK3, local_pdl

__all__ = ["MAX_BLOCK", "GatherInitialStates", "GatherInitialStatesKey", "gather_initial_states_reference", "register"]

#: The largest tile (elements of a state row per program).
MAX_BLOCK = 1024
_SCALARS = ["indices_ptr", "flags_ptr"]


@triton.jit(do_not_specialize=["indices_stride", "flags_stride"], do_not_specialize_on_alignment=_SCALARS)
def _gather_initial_states_kernel(
    state_ptr,
    indices_ptr,
    flags_ptr,  # has_initial_state, bool
    out_ptr,
    state_stride,  # the pool's slot stride (a padded Mamba page may make it wider than a row)
    indices_stride,
    flags_stride,
    ROW: tl.constexpr,  # elements of one state row: a model constant
    BLOCK: tl.constexpr,  # min(next_pow2(ROW), 1024) elements per program
    USE_PDL: tl.constexpr,  # wait for the previous kernel first; matches the launch option launch_pdl
):
    n = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    has = tl.load(flags_ptr + n * flags_stride).to(tl.int1)
    slot = tl.where(has, tl.load(indices_ptr + n * indices_stride).to(tl.int64), 0)
    # the flag as a full-width mask: a scalar int1 ANDed into a block mask is refused by Triton 3.9's interpreter
    load = mask & ((offs * 0 + has.to(tl.int32)) != 0)
    values = tl.load(state_ptr + slot * state_stride + offs, mask=load, other=0.0)
    tl.store(out_ptr + n * ROW + offs, values, mask=mask)


@attrs.frozen(kw_only=True)
class GatherInitialStatesKey(warmreg.CompileKey):
    """What changes the binary of the initial-state gather."""

    dtype: str  # the state pool and the output
    index_dtype: str  # int32 (the block table's) or int64
    row_size: int
    block: int
    state_stride: warmreg.IntClass
    state_aligned: bool
    launch_pdl: bool  # USE_PDL and the launch option
    num_warps: int


class GatherInitialStates(warmreg.TritonKernel[GatherInitialStatesKey]):
    """Gather ``state[indices]`` into a dense tensor, zeros where there is no initial state (the module
    docstring has the math).

    :param num_heads: KDA heads on one rank (domains only).
    :param head_dim: key and value head dim (domains only).
    :param max_num_seqs: requests in a step: the pool holds one slot each plus the padding slot (domains only).
    """

    name = "kimi_k3.gather_initial_states"
    key_type = GatherInitialStatesKey
    jit = _gather_initial_states_kernel

    def __init__(self, *, num_heads: int, head_dim: int, max_num_seqs: int) -> None:
        self.num_heads, self.head_dim, self.max_num_seqs = num_heads, head_dim, max_num_seqs

    def dispatch(self, *, state: torch.Tensor, indices: torch.Tensor, launch_pdl: bool) -> GatherInitialStatesKey:
        row = state.shape[1:].numel()
        return GatherInitialStatesKey(
            dtype=warmreg.dtype_name(state.dtype),
            index_dtype=warmreg.dtype_name(indices.dtype),
            row_size=row,
            block=min(warmreg.next_pow2(row), MAX_BLOCK),
            state_stride=warmreg.int_class(state.stride(0)),
            state_aligned=warmreg.is_aligned(state),
            launch_pdl=bool(launch_pdl),
            num_warps=8,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h, d = self.num_heads, self.head_dim
        return {
            # The recurrent-state pool [slots, H, V, K] in float32 (the KDA step's pool), contiguous.
            "state": [warmreg.meta((self.max_num_seqs + 1, h, d, d), torch.float32)],
            "indices": [warmreg.meta((self.max_num_seqs,), torch.int32)],  # a block-table column
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: GatherInitialStatesKey) -> Mapping[str, Any]:
        stride = warmreg.int_class_rep(key.state_stride)
        return {
            "state": warmreg.meta(
                (1, key.row_size), getattr(torch, key.dtype), stride=(stride, 1), offset=0 if key.state_aligned else 1
            ),
            "indices": warmreg.meta((1,), getattr(torch, key.index_dtype)),
            "has_initial_state": warmreg.meta((1,), torch.bool),
            "launch_pdl": key.launch_pdl,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        state: torch.Tensor,
        indices: torch.Tensor,
        has_initial_state: torch.Tensor,
        *,
        launch_pdl: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[GatherInitialStatesKey]:
        """The initial states of ``N`` requests: ``[N, *state.shape[1:]]`` of the pool's dtype (``out``, or a
        fresh tensor), zeros for requests without one.

        :param state: ``[num_slots, ...]``, each slot's row contiguous; the slot stride is free.
        :param indices: int32 or int64 ``[N]``, each request's slot (any stride, e.g. a block-table column).
        :param has_initial_state: bool ``[N]``: whether request ``n`` continues from its slot's state.
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated output, contiguous ``[N, *state.shape[1:]]`` of the pool's dtype (then nothing
            is allocated; every element is written).
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or devices the kernel cannot take, or an ``out``
            that is not the output's shape, dtype and layout.
        """
        self._check(state, indices, has_initial_state)
        launch_pdl = local_pdl(launch_pdl)
        key = self.dispatch(state=state, indices=indices, launch_pdl=launch_pdl)
        n = indices.shape[0]
        out = warmreg.output(self.name, "out", out, (n, *state.shape[1:]), state.dtype, state.device)
        kwargs = dict(
            state_ptr=state, indices_ptr=indices, flags_ptr=has_initial_state, out_ptr=out,
            state_stride=state.stride(0), indices_stride=indices.stride(0), flags_stride=has_initial_state.stride(0),
            ROW=key.row_size, BLOCK=key.block, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = ((key.row_size + key.block - 1) // key.block, n) if n and key.row_size else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(self, state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if state.ndim < 2 or state.shape[0] < 1:
            fail(f"state must be a [num_slots, ...] pool with at least one slot (got {tuple(state.shape)})")
        if not state[0].is_contiguous():
            fail(
                f"each slot of state must be contiguous (got strides {state.stride()})", fix="pad only the slot stride"
            )
        if indices.ndim != 1 or indices.dtype not in (torch.int32, torch.int64):
            fail(f"indices must be a 1-D int32 or int64 tensor (got {indices.dtype} {tuple(indices.shape)})")
        if has_initial_state.shape != indices.shape or has_initial_state.dtype != torch.bool:
            fail(
                f"has_initial_state must be bool with the shape of indices {tuple(indices.shape)} "
                f"(got {has_initial_state.dtype} {tuple(has_initial_state.shape)})"
            )
        if len({state.device, indices.device, has_initial_state.device}) > 1:
            fail(f"all inputs must be on one device (got {state.device}, {indices.device}, {has_initial_state.device})")


def gather_initial_states_reference(
    state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """PyTorch reference of :class:`GatherInitialStates`: ``state[indices]`` with the rows of requests
    without an initial state zeroed (their indices are never used)."""
    slots = torch.where(has_initial_state, indices.long(), torch.zeros_like(indices, dtype=torch.long))
    out = state[slots].clone()
    out[~has_initial_state] = 0
    return out


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the gather when there are KDA layers (every prefill step launches it) on CUDA and XPU, and on
    ROCm where the prefill backend resolves to ``"triton"`` (the module docstring says why).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config``, or a missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return
    kernel = GatherInitialStates(
        num_heads=layout.num_heads,
        head_dim=layout.head_dim,
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
    )
    when = warmreg.is_cuda | warmreg.is_xpu
    if platform.is_rocm and kda_prefill_backend(m, config, platform) == "triton":
        when = when | warmreg.is_rocm
    registry.add(kernel, when=when)
