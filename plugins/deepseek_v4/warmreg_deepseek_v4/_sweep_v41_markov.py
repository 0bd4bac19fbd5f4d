"""The DeepSeek-V4.1 sweep's DSpark draft sampling (vLLM 0.34 ``nvidia/ops/fused_markov.py``:
``FusedMarkovSampler.__call__``), called once a step by :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` where the
plan holds the fused Markov sampler.

After the target step, every request of the step drafts ``num_speculative_tokens`` tokens as
``DSparkSpeculator._sample_sequential`` does with the sampler: the base logits of its ``(request, step)`` rows
(random, in the head dtype), the Markov embedding of its anchor token, then per speculative step the bias GEMM
(``markov_w2``), the sample kernel and the select kernel, whose embedding scratch feeds the next step's bias. The
persistent buffers are the speculator's (``max_num_seqs`` request states, the draft-logits cache, the draft tokens,
seeds, temperatures and the sampler's scratch); the step's requests take shuffled states, sampled at temperatures
0.5 to 1.5, with one inert row (``-1``) when the step has two or more requests. The logits, ``markov_w1`` and
``markov_w2`` are drawn on grids (multiples of 1/8 up to 4, of 1 up to 1, of 1/8 up to 1/8) that keep the bias GEMM
and the biased logits exact in bf16, so that the first launch of each kernel is checked against its reference within
the default tolerance even though Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from ._v41_markov import block_p
from .sweep_inputs import DSV4_PREFIX, F32, I64, DSV4Step
from .v41_markov_sample import markov_sample_reference
from .v41_markov_select import markov_select_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["MARKOV_DRIVES", "drive_markov"]

_SAMPLE, _SELECT = DSV4_PREFIX + "v41_markov_sample", DSV4_PREFIX + "v41_markov_select"
#: The kernels :func:`drive_markov` launches.
MARKOV_DRIVES = frozenset({_SAMPLE, _SELECT})


def _grid(sweep: DSV41Sweep, shape: tuple[int, ...], span: int, denominator: int, dtype: torch.dtype) -> torch.Tensor:
    """Random multiples of ``1 / denominator`` in ``[-span, span] / denominator``."""
    ints = torch.randint(-span, span + 1, shape, generator=sweep.gen, device=sweep.dev)
    return (ints.to(F32) / denominator).to(dtype)


def _state(sweep: DSV41Sweep) -> dict[str, Any]:
    """The speculator's and the draft model's persistent tensors, made once a sweep."""
    state: dict[str, Any] | None = getattr(sweep, "_markov_state", None)
    if state is None:
        sample, select = sweep.kernel(_SAMPLE), sweep.kernel(_SELECT)
        reqs, steps, vocab, rank, dev = sweep.lim.max_seqs, sample.num_steps, sample.vocab, select.rank, sweep.dev
        dtype = getattr(torch, sample.dtype)
        state = {
            "cache": sweep.randn(reqs, steps, vocab, dtype=dtype),
            "tokens": torch.zeros(reqs, steps, dtype=I64, device=dev),
            "seeds": torch.randint(0, 2**62, (reqs,), generator=sweep.gen, device=dev, dtype=I64),
            "temp": torch.rand(reqs, generator=sweep.gen, device=dev) + 0.5,
            "w1": _grid(sweep, (vocab, rank), 1, 1, dtype),
            "w2": _grid(sweep, (vocab, rank), 1, 8, dtype),
            "embed": torch.empty(reqs, rank, dtype=dtype, device=dev),
            "pmax": torch.empty(reqs, block_p(vocab), dtype=F32, device=dev),
            "psum": torch.empty(reqs, block_p(vocab), dtype=F32, device=dev),
            "idx": torch.full((reqs * steps,), -1, dtype=I64, device=dev),
            "pos": torch.zeros(reqs * steps, dtype=I64, device=dev),
        }
        sweep._markov_state = state  # type: ignore[attr-defined]
    return state


def drive_markov(sweep: DSV41Sweep, st: DSV4Step) -> None:
    """Draft every request of the step with the fused Markov sampler (see the module docstring), where the plan holds
    it."""
    if _SAMPLE not in sweep.names:
        return
    s = _state(sweep)
    sample, select = sweep.kernel(_SAMPLE), sweep.kernel(_SELECT)
    steps, vocab, dtype = sample.num_steps, sample.vocab, s["cache"].dtype
    reqs = min(len(st.batch.qlens), s["tokens"].shape[0])
    rows = reqs * steps
    states = torch.randperm(s["tokens"].shape[0], generator=sweep.gen, device=sweep.dev)[:reqs].to(I64)
    s["idx"].fill_(-1)
    s["idx"][:rows] = states.repeat_interleave(steps)
    if reqs > 1:
        s["idx"][steps : 2 * steps] = -1  # a padded row of the captured batch
    seq = torch.tensor(st.batch.seqs[:reqs], dtype=I64, device=sweep.dev)
    s["pos"][:rows] = (seq[:, None] + torch.arange(1, steps + 1, device=sweep.dev)).flatten()
    base = _grid(sweep, (rows, vocab), 32, 8, dtype)
    anchors = torch.randint(0, vocab, (reqs,), generator=sweep.gen, device=sweep.dev)
    markov = s["w1"][anchors]
    for step in range(steps):
        bias = markov @ s["w2"].t()
        args = (base, bias, step, s["idx"], s["temp"], s["cache"], s["pmax"], s["psum"])
        sweep.launch(
            _SAMPLE, f"{reqs} drafting requests, step {step} of {steps}", partial(sample, *args),
            ref=partial(markov_sample_reference, *args),
        )  # fmt: skip
        chosen = (step, s["idx"], s["pos"], s["temp"], s["seeds"], s["cache"], s["tokens"], s["w1"], s["embed"],
                  s["pmax"], s["psum"])  # fmt: skip
        sweep.launch(
            _SELECT, f"{reqs} drafting requests, step {step} of {steps}", partial(select, *chosen, num_reqs=reqs),
            ref=partial(markov_select_reference, *chosen, num_reqs=reqs),
        )  # fmt: skip
        markov = s["embed"][:reqs]
