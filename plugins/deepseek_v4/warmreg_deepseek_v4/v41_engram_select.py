"""DeepSeek-V4.1's engram row selection: one token window of a rank-major all-gathered buffer laid out with its ranks
side by side (vLLM 0.34 ``models/deepseek_v41/common/engram.py``: ``_engram_select_rows_kernel``, launched by
``_engram_select_rows``).

An engram table sharded over ranks looks up each rank's heads for every token, and an all-gather stacks the ranks'
rows: ``gathered`` holds ``[rank][token][L]`` values (``L = local_heads * dim``, ``N`` tokens a rank, contiguous). A
rank keeps the window of ``T`` tokens from ``token_start``, every rank's heads side by side: for the flat index
``o < T * W`` of ``out`` (``[T, heads, dim]`` contiguous, ``W = heads * dim``), ``t = token_start + o // W`` and
``c = o % W``::

    out[o] = gathered[(c // L * N + t) * L + c % L]      if t < N
    out[o] = 0                                           otherwise (the window's padding past the last token)

``gathered`` and ``out`` share a dtype (bf16 in vLLM). Grid ``(cdiv(T * W, 1024),)``, 1024 values a program, Triton's
default four warps, as in vLLM.

Where it runs: V4.1 engram layers whose table rows cross ranks. ``Engram.embed`` under sequence parallelism
(tensor parallel > 1 with expert parallelism and data parallelism or a MegaMoE backend: ``_use_sequence_parallel``)
selects this rank's token chunk of the TP all-gather; ``_gather_engram_rows`` (an engram data-parallel group,
``get_engram_dp_group``) selects this replica's tokens of the DP all-gather. Warmreg has no expert-, data-parallel or
MoE-backend setting, so :func:`register` plans nothing; a deployment that runs either registers
:class:`EngramSelectRows` itself.

Key: the dtype, the tile and the warps. vLLM's ``L`` and ``W`` are constexprs; here they are runtime integers like the
token counts (``do_not_specialize``): one binary serves every head split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4

__all__ = ["EngramSelectRows", "EngramSelectRowsKey", "engram_select_rows_reference", "register"]

_BLOCK = 1024
_NUM_WARPS = 4
_INTS = ["num_tokens", "token_start", "num_elements", "local_width", "width"]


@triton.jit(do_not_specialize=_INTS)
def _engram_select_rows_kernel(
    gathered_ptr,  # [ranks * N * L], rank-major
    out_ptr,  # [T * W], contiguous
    num_tokens,
    token_start,
    num_elements,
    local_width,
    width,
    BLOCK: tl.constexpr,  # values a program
):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = o < num_elements
    t = token_start + o // width
    c = o % width
    src = (c // local_width * num_tokens + t) * local_width + c % local_width
    values = tl.load(gathered_ptr + src, mask=inside & (t < num_tokens), other=0)
    tl.store(out_ptr + o, values, mask=inside)


@attrs.frozen(kw_only=True)
class EngramSelectRowsKey(warmreg.CompileKey):
    """What changes the binary of the row selection: the dtype, the tile and the warps."""

    dtype: str
    block: int
    num_warps: int


class EngramSelectRows(warmreg.TritonKernel[EngramSelectRowsKey]):
    """A token window of rank-major all-gathered engram rows, ranks side by side (the module docstring has the math).

    :param dtype: the rows' dtype (domains only; vLLM's are bf16).
    """

    name = "deepseek_v4.v41_engram_select_rows"
    key_type = EngramSelectRowsKey
    jit = _engram_select_rows_kernel

    def __init__(self, *, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype

    def dispatch(self, *, gathered: torch.Tensor) -> EngramSelectRowsKey:
        return EngramSelectRowsKey(dtype=warmreg.dtype_name(gathered.dtype), block=_BLOCK, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"gathered": [warmreg.meta((2, 1, 64), self.dtype)]}

    def warmup_inputs(self, key: EngramSelectRowsKey) -> Mapping[str, Any]:
        dtype = getattr(torch, key.dtype)
        return {
            "gathered": warmreg.meta((2, 1, 64), dtype),
            "source_tokens": 1,
            "token_start": 0,
            "local_width": 64,
            "out": warmreg.meta((1, 2, 64), dtype),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        gathered: torch.Tensor,
        *,
        source_tokens: int,
        token_start: int,
        local_width: int,
        out: torch.Tensor,
    ) -> warmreg.LaunchSpec[EngramSelectRowsKey]:
        """Fill ``out`` with the window (vLLM's ``_engram_select_rows(gathered, out, source_tokens, token_start,
        local_width)``); returns ``out``.

        :param gathered: the all-gathered rows, contiguous, ``ranks * source_tokens * local_width`` values.
        :param source_tokens: ``N``, the tokens each rank contributed.
        :param token_start: the window's first token.
        :param local_width: ``L``, values a rank contributes a token (``local_heads * dim``).
        :param out: ``[T, heads, dim]``, contiguous, ``gathered``'s dtype, ``heads * dim <= ranks * L``: the caller's
            (vLLM allocates it per call), every value written.
        :raises warmreg.LaunchError: naming the argument of another dtype or layout, or a window the rows do not hold.
        """
        _check(self.name, gathered, source_tokens, token_start, local_width, out)
        key = self.dispatch(gathered=gathered)
        n = out.numel()
        kwargs = dict(
            gathered_ptr=gathered, out_ptr=out, num_tokens=source_tokens, token_start=token_start, num_elements=n,
            local_width=local_width, width=out.shape[1] * out.shape[2], BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (triton.cdiv(n, key.block),) if n else None, kwargs, out)


def _check(
    name: str, gathered: torch.Tensor, tokens: int, start: int, local_width: int, out: torch.Tensor
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM passes it."""
    if not gathered.is_contiguous() or gathered.dtype != out.dtype:
        raise warmreg.LaunchError(
            name, f"gathered must be contiguous and of out's dtype {out.dtype} (got {gathered.dtype})"
        )
    if out.ndim != 3 or not out.is_contiguous():
        raise warmreg.LaunchError(name, f"out must be contiguous [tokens, heads, dim] (got {tuple(out.shape)})")
    if local_width < 1 or tokens < 0 or start < 0:
        raise warmreg.LaunchError(
            name, f"need local_width ({local_width}) >= 1, source_tokens ({tokens}) and token_start ({start}) >= 0"
        )
    ranks = -(-out.shape[1] * out.shape[2] // local_width)
    if out.numel() and gathered.numel() < ranks * tokens * local_width:
        raise warmreg.LaunchError(
            name,
            f"gathered holds {gathered.numel()} values, fewer than the {ranks} ranks x {tokens} tokens x "
            f"{local_width} (local_width) out's width reads",
        )


def engram_select_rows_reference(
    gathered: torch.Tensor, *, source_tokens: int, token_start: int, local_width: int, out: torch.Tensor
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramSelectRows`: a new tensor of ``out``'s shape."""
    rows, width = out.shape[0], out.shape[1] * out.shape[2]
    ranks = -(-width // local_width)
    src = gathered.reshape(-1)[: ranks * source_tokens * local_width].reshape(ranks, source_tokens, local_width)
    padded = torch.zeros(ranks, token_start + rows, local_width, dtype=out.dtype, device=out.device)
    kept = max(0, min(source_tokens, token_start + rows))
    padded[:, :kept] = src[:, :kept]
    window = padded[:, token_start : token_start + rows].transpose(0, 1).reshape(rows, ranks * local_width)
    return window[:, :width].reshape(out.shape).clone()


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM selects rows only under engram data parallelism or sequence parallelism (module
    docstring), which no warmreg setting expresses; a deployment that serves them registers :class:`EngramSelectRows`
    itself."""
