"""The KDA layers' state slots under prefix caching: each request's aligned state indices (vLLM 0.33
``models/kimi_k3/nvidia/kda_metadata.py``: ``_mamba_get_block_table_tensor``, ``_get_aligned_state_indices_kernel``).

With prefix caching (vLLM's ``mamba_cache_mode == "align"``) a KDA request does not keep its recurrent state in
one fixed slot: its block-table row lists one state block per ``block_size`` tokens of the sequence, and a step
reads and writes the block of the sequence's current end, plus one block for each speculative token after it.
This kernel picks those columns out of the block table.

Math, for each request ``r < R`` (``R = block_table.shape[0]``), with ``L = seq_lens[r]`` (the sequence length,
the step's tokens included), the group's block size ``B`` and ``S`` state slots::

    c = max(floor((L - 1) / B), 0)                 # the block holding token L - 1; 0 for L <= 1
    out[r, s] = block_table[r, c + s]   for s < S  # S = 1 + the speculative blocks (num_speculative_tokens)

Integer division in Triton truncates toward zero; the clamp at 0 makes it agree with the floor above for every
``L <= 0`` too (vLLM's comment on its kernel). The caller guarantees ``c + S - 1`` is a column of the row (the
scheduler allocates those blocks); the kernel does not check it. ``out`` is a fresh ``[R, S]`` of the block
table's dtype. Grid ``(cdiv(R, 32),)``: 32 requests a program, one warp, as in vLLM.

Where it runs: the KDA metadata builder (``KimiK3KDAMetadataBuilder.build``) on every step in align mode when the
aligned indices were not precomputed, which is Model Runner V1 only (V2 precomputes them for every Mamba group
with its own kernel, ``v1/worker/mamba_utils.py``). vLLM turns align mode on whenever prefix caching is on (its
default); Kimi-K3 runs on V1 when V2 lacks a feature it needs (DSpark drafting, for one) or
``VLLM_USE_V2_MODEL_RUNNER=0``. vLLM 0.34 launches it nowhere: it removed Model Runner V1
(``v1/worker/gpu_model_runner.py`` is gone) and this kernel with it (0.34's ``kda_metadata.py`` has no
``_get_aligned_state_indices_kernel``; its builder asserts ``mamba_aligned_state_indices``, which the V2 runner
fills with ``v1/worker/mamba_utils.py: get_aligned_state_indices_multi_group_kernel``, not an op of this plugin).
Neither prefix caching, the runner nor the engine's version is a warmreg serving setting (a ``WarmConfig`` read from
a ``VllmConfig`` records the engine's class, not its version), so it is registered whenever there are KDA layers,
on CUDA (vLLM asserts CUDA tensors here): one small key, which a vLLM 0.34 deployment warms without launching. It
does not depend on the KDA prefill or decode backend.

Key: the dtypes, ``S`` and its power-of-two tile, the rows per program and PDL. Unlike vLLM's kernel, whose five
strides and block size are constexprs (one binary per block-table width and block size), the strides, ``B`` and
``R`` are runtime integers that are not specialized, and no pointer is specialized on alignment: the kernel moves
``S`` integers per request, and one binary serves every table layout.
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

from .backends import kda_layout
from .model import PLUGIN, KimiK3, local_pdl

__all__ = [
    "BLOCK_ROWS",
    "AlignedStateIndices",
    "AlignedStateIndicesKey",
    "aligned_state_indices_reference",
    "register",
]

#: Requests per program (vLLM's ``BLOCK_ROWS``).
BLOCK_ROWS = 32
_INTS = ["bt_stride_row", "bt_stride_col", "seq_lens_stride", "num_requests", "block_size"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "out_ptr"])
def _aligned_state_indices_kernel(
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_requests, NUM_STATE_SLOTS], contiguous
    bt_stride_row,
    bt_stride_col,
    seq_lens_stride,
    num_requests,
    block_size,  # the KDA group's (Mamba) block size in tokens
    NUM_STATE_SLOTS: tl.constexpr,  # 1 + the speculative blocks: a deployment constant
    BLOCK_STATE_SLOTS: tl.constexpr,  # next_pow2(NUM_STATE_SLOTS)
    BLOCK_ROWS: tl.constexpr,  # requests per program
    USE_PDL: tl.constexpr,  # wait for the previous kernel first; matches the launch option launch_pdl
):
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < num_requests
    seq_lens = tl.load(seq_lens_ptr + rows.to(tl.int64) * seq_lens_stride, mask=live, other=1)
    first = tl.maximum((seq_lens - 1) // block_size, 0)  # truncating division; the clamp makes it the floor
    slots = tl.arange(0, BLOCK_STATE_SLOTS)
    mask = live[:, None] & (slots < NUM_STATE_SLOTS)[None, :]
    cols = (first[:, None] + slots[None, :]).to(tl.int64)
    values = tl.load(block_table_ptr + rows.to(tl.int64)[:, None] * bt_stride_row + cols * bt_stride_col, mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * NUM_STATE_SLOTS + slots[None, :], values, mask=mask)


@attrs.frozen(kw_only=True)
class AlignedStateIndicesKey(warmreg.CompileKey):
    """What changes the binary of the aligned state indices: no stride, size or alignment does."""

    index_dtype: str  # the block table and the output
    seq_lens_dtype: str
    num_state_slots: int
    block_state_slots: int
    block_rows: int
    launch_pdl: bool  # USE_PDL and the launch option
    num_warps: int


class AlignedStateIndices(warmreg.TritonKernel[AlignedStateIndicesKey]):
    """Each request's state blocks out of its block-table row (the module docstring has the math).

    :param max_num_seqs: requests in a step (domains only).
    :param num_speculative_tokens: draft tokens per step; the state slots are ``1 +`` this (domains only).
    """

    name = "kimi_k3.aligned_state_indices"
    key_type = AlignedStateIndicesKey
    jit = _aligned_state_indices_kernel

    def __init__(self, *, max_num_seqs: int, num_speculative_tokens: int = 0) -> None:
        self.max_num_seqs, self.num_speculative_tokens = max_num_seqs, num_speculative_tokens

    def dispatch(
        self, *, block_table: torch.Tensor, seq_lens: torch.Tensor, num_state_slots: int, launch_pdl: bool
    ) -> AlignedStateIndicesKey:
        return AlignedStateIndicesKey(
            index_dtype=warmreg.dtype_name(block_table.dtype),
            seq_lens_dtype=warmreg.dtype_name(seq_lens.dtype),
            num_state_slots=num_state_slots,
            block_state_slots=warmreg.next_pow2(num_state_slots),
            block_rows=BLOCK_ROWS,
            launch_pdl=bool(launch_pdl),
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        n = self.max_num_seqs
        return {
            "block_table": [warmreg.meta((n, 64), torch.int32)],  # the width is not in the key
            "seq_lens": [warmreg.meta((n,), torch.int32)],
            "num_state_slots": [1 + self.num_speculative_tokens],
            "launch_pdl": [platform.supports_pdl],
        }

    def warmup_inputs(self, key: AlignedStateIndicesKey) -> Mapping[str, Any]:
        return {
            "block_table": warmreg.meta((1, key.num_state_slots), getattr(torch, key.index_dtype)),
            "seq_lens": warmreg.meta((1,), getattr(torch, key.seq_lens_dtype)),
            "block_size": 16,
            "num_state_slots": key.num_state_slots,
            "launch_pdl": key.launch_pdl,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        block_size: int,
        num_state_slots: int,
        launch_pdl: bool | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[AlignedStateIndicesKey]:
        """The ``[R, num_state_slots]`` state blocks of the ``R`` requests of ``block_table`` (``out``, or a
        fresh tensor).

        :param block_table: int32 or int64 ``[R, width]``, any strides (the KDA group's block table).
        :param seq_lens: int32 or int64 ``[R]``, any stride.
        :param block_size: the KDA group's block size in tokens (``> 0``).
        :param num_state_slots: ``1 +`` the speculative blocks (``>= 1``).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated output, contiguous ``[R, num_state_slots]`` of block_table's dtype (then nothing
            is allocated).
        :raises warmreg.LaunchError: for shapes, dtypes, sizes or devices the kernel cannot take, or an ``out``
            that is not the output's shape, dtype and layout.
        """
        self._check(block_table, seq_lens, block_size, num_state_slots)
        launch_pdl = local_pdl(launch_pdl)
        key = self.dispatch(
            block_table=block_table, seq_lens=seq_lens, num_state_slots=num_state_slots, launch_pdl=launch_pdl
        )
        rows = block_table.shape[0]
        out = warmreg.output(self.name, "out", out, (rows, num_state_slots), block_table.dtype, block_table.device)
        kwargs = dict(
            block_table_ptr=block_table, seq_lens_ptr=seq_lens, out_ptr=out,
            bt_stride_row=block_table.stride(0), bt_stride_col=block_table.stride(1),
            seq_lens_stride=seq_lens.stride(0), num_requests=rows, block_size=block_size,
            NUM_STATE_SLOTS=key.num_state_slots, BLOCK_STATE_SLOTS=key.block_state_slots,
            BLOCK_ROWS=key.block_rows, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = ((rows + key.block_rows - 1) // key.block_rows,) if rows else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_state_slots: int) -> None:
        ints = (torch.int32, torch.int64)
        if block_table.ndim != 2 or block_table.dtype not in ints:
            raise warmreg.LaunchError(
                self.name,
                f"block_table must be a 2-D int32 or int64 tensor (got {block_table.dtype} {tuple(block_table.shape)})",
            )
        if seq_lens.shape != block_table.shape[:1] or seq_lens.dtype not in ints:
            raise warmreg.LaunchError(
                self.name,
                f"seq_lens must be int32 or int64 [R] with R = {block_table.shape[0]} rows of block_table "
                f"(got {seq_lens.dtype} {tuple(seq_lens.shape)})",
            )
        if not 0 < num_state_slots <= block_table.shape[1] or block_size <= 0:
            raise warmreg.LaunchError(
                self.name,
                f"block_size ({block_size}) must be > 0 and num_state_slots ({num_state_slots}) in "
                f"[1, width = {block_table.shape[1]}]",
            )
        if block_table.device != seq_lens.device:
            raise warmreg.LaunchError(
                self.name, f"inputs on {block_table.device} and {seq_lens.device}: use one device"
            )


def aligned_state_indices_reference(
    block_table: torch.Tensor, seq_lens: torch.Tensor, *, block_size: int, num_state_slots: int
) -> torch.Tensor:
    """PyTorch reference of :class:`AlignedStateIndices` (vLLM's "equivalent PyTorch align path" in
    ``KimiK3KDAMetadataBuilder.build``): a gather of columns ``c .. c + S - 1`` of each row.

    :raises IndexError: (from ``torch.gather``) where ``c + S - 1`` is past a row, which the kernel assumes
        never happens.
    """
    first = torch.div(seq_lens.long() - 1, block_size, rounding_mode="floor").clamp_(min=0)
    cols = first[:, None] + torch.arange(num_state_slots, device=seq_lens.device)
    return torch.gather(block_table, 1, cols)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the aligned state indices on CUDA when there are KDA layers (see the module docstring for why
    neither prefix caching nor the model runner is asked).

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a missing ``serving.max_num_seqs``.
    """
    layout = kda_layout(m, config)
    if layout is None:
        return
    kernel = AlignedStateIndices(
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN),
        num_speculative_tokens=layout.num_speculative_tokens,
    )
    registry.add(kernel, when=warmreg.is_cuda)
