"""The DSpark Markov drafter's token of a draft step out of the step's per-program maxima (vLLM 0.34
``models/kimi_k3/nvidia/specialized_decode/drafter/markov.py``: ``_markov_select_kernel``, ``FusedMarkov.run``).

For row ``r < R`` of step ``s``, with ``NB`` per-program maxima ``out_max[r, j]`` and their tokens ``out_arg[r, j]``
(``warmreg_kimi_k3.markov_step``)::

    j* = first argmax_j out_max[r, j]
    tokens[r, s] = prev[r] = out_arg[r, j*]

One program a row, 4 warps (Triton's default, as vLLM launches it). Where it runs: after every Markov step
(``warmreg_kimi_k3.markov_step`` has when).

Key: ``NB`` rounded to a power of two (``cdiv(V, 256)``: 1024 at Kimi-K3's 163840) and the token dtypes. Unlike
vLLM's kernel, the step is a runtime int (vLLM: the constexpr ``STEP``, ``k`` binaries), no integer is specialized
and no pointer on its alignment: one binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._markov import VB
from .model import KimiK3
from .specialized import SM100_FAMILY, dspark_draft

__all__ = ["MarkovSelect", "MarkovSelectKey", "markov_select_reference", "register"]

_PTRS = ["max_ptr", "arg_ptr", "prev_tok_ptr", "tokens_ptr"]


@triton.jit(do_not_specialize=["tokens_stride", "num_blocks", "step"], do_not_specialize_on_alignment=_PTRS)
def _markov_select_kernel(
    max_ptr,  # [rows, num_blocks] fp32, contiguous
    arg_ptr,  # [rows, num_blocks] int64, contiguous
    prev_tok_ptr,  # [rows] the step's token, read by the next step
    tokens_ptr,  # [rows, k] draft tokens
    tokens_stride,
    num_blocks,
    step,
    NB_POW2: tl.constexpr,  # num_blocks rounded up to a power of two
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NB_POW2)
    m = tl.load(max_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf"))
    tok = tl.load(arg_ptr + r * num_blocks + tl.argmax(m, axis=0, tie_break_left=True))
    tl.store(prev_tok_ptr + r, tok)
    tl.store(tokens_ptr + r * tokens_stride + step, tok)


@attrs.frozen(kw_only=True)
class MarkovSelectKey(warmreg.CompileKey):
    """What changes the binary of the select: the maxima tile and the token dtypes."""

    nb_pow2: int
    prev_dtype: str
    tokens_dtype: str
    num_warps: int


class MarkovSelect(warmreg.TritonKernel[MarkovSelectKey]):
    """A draft step's tokens out of its per-program maxima (the module docstring has the math).

    :param vocab_size: ``V`` (domains only).
    """

    name = "kimi_k3.markov_select"
    key_type = MarkovSelectKey
    jit = _markov_select_kernel

    def __init__(self, *, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def dispatch(self, *, out_max: torch.Tensor, prev: torch.Tensor, tokens: torch.Tensor) -> MarkovSelectKey:
        return MarkovSelectKey(
            nb_pow2=warmreg.next_pow2(out_max.shape[1]), prev_dtype=warmreg.dtype_name(prev.dtype),
            tokens_dtype=warmreg.dtype_name(tokens.dtype), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # FusedMarkov: the maxima [max_num_reqs, cdiv(V, 256)]; prev and spec.draft_tokens are int64.
        return {
            "out_max": [warmreg.meta((1, triton.cdiv(self.vocab_size, VB)), torch.float32)],
            "prev": [warmreg.meta((1,), torch.int64)],
            "tokens": [warmreg.meta((1, 1), torch.int64)],
        }

    def warmup_inputs(self, key: MarkovSelectKey) -> Mapping[str, Any]:
        return {
            "out_max": warmreg.meta((1, key.nb_pow2), torch.float32),
            "out_arg": warmreg.meta((1, key.nb_pow2), torch.int64),
            "prev": warmreg.meta((1,), getattr(torch, key.prev_dtype)),
            "tokens": warmreg.meta((1, 1), getattr(torch, key.tokens_dtype)),
            "num_rows": 1, "step": 0,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        out_max: torch.Tensor,
        out_arg: torch.Tensor,
        prev: torch.Tensor,
        tokens: torch.Tensor,
        *,
        num_rows: int,
        step: int,
    ) -> warmreg.LaunchSpec[MarkovSelectKey]:
        """Write ``tokens[:num_rows, step]`` and ``prev[:num_rows]`` (returned, in that order).

        :param out_max: fp32 ``[>= num_rows, NB]`` contiguous; ``out_arg``: int64, the same shape.
        :param prev: int32 or int64 ``[>= num_rows]`` contiguous.
        :param tokens: int32 or int64 ``[>= num_rows, k]`` with unit step stride.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take.
        """
        self._check(out_max, out_arg, prev, tokens, num_rows, step)
        key = self.dispatch(out_max=out_max, prev=prev, tokens=tokens)
        kwargs = dict(
            max_ptr=out_max, arg_ptr=out_arg, prev_tok_ptr=prev, tokens_ptr=tokens, tokens_stride=tokens.stride(0),
            num_blocks=out_max.shape[1], step=step, NB_POW2=key.nb_pow2,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_rows,) if num_rows else None, kwargs, (tokens, prev))

    def _check(self, out_max: torch.Tensor, out_arg: torch.Tensor, prev: torch.Tensor, tokens: torch.Tensor,
               num_rows: int, step: int) -> None:  # fmt: skip
        if (
            out_max.ndim != 2
            or out_max.dtype != torch.float32
            or not out_max.is_contiguous()
            or out_max.shape[0] < num_rows
        ):
            raise warmreg.LaunchError(
                self.name, f"out_max must be contiguous float32 [>= {num_rows}, NB] (got {out_max.dtype} "
                f"{tuple(out_max.shape)})",
            )  # fmt: skip
        if out_arg.shape != out_max.shape or out_arg.dtype != torch.int64 or not out_arg.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"out_arg must be contiguous int64 {tuple(out_max.shape)} (got {out_arg.dtype} "
                f"{tuple(out_arg.shape)})",
            )  # fmt: skip
        ints = (torch.int32, torch.int64)
        if prev.ndim != 1 or prev.dtype not in ints or prev.shape[0] < num_rows or prev.stride(0) != 1:
            raise warmreg.LaunchError(self.name, f"prev must be contiguous int32 or int64 [>= {num_rows}] (got "
                                                 f"{prev.dtype} {tuple(prev.shape)})")  # fmt: skip
        if tokens.ndim != 2 or tokens.dtype not in ints or tokens.shape[0] < num_rows or tokens.stride(1) != 1:
            raise warmreg.LaunchError(self.name, f"tokens must be int32 or int64 [>= {num_rows}, k] with unit step "
                                                 f"stride (got {tokens.dtype} {tuple(tokens.shape)})")  # fmt: skip
        if not 0 <= step < tokens.shape[1] or num_rows < 0:
            raise warmreg.LaunchError(self.name, f"step must be in [0, {tokens.shape[1]}) and num_rows >= 0 (got "
                                                 f"{step}, {num_rows})")  # fmt: skip


def markov_select_reference(out_max: torch.Tensor, out_arg: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :class:`MarkovSelect`: each row's token (``torch.argmax`` returns the first maximum)."""
    return out_arg.gather(1, out_max.argmax(dim=1, keepdim=True))[:, 0]


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the select beside the Markov step (``warmreg_kimi_k3.markov_step.register``).

    :raises warmreg.ConfigError: for malformed specialized-decode settings.
    """
    draft = dspark_draft(config)
    if draft is None or not draft.probabilistic:
        return
    registry.add(MarkovSelect(vocab_size=draft.vocab_size), when=SM100_FAMILY)
