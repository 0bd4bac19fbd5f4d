"""DeepSeek-V4.1's fused Markov sampler against vLLM 0.34's own, on identical DSpark-shaped inputs, under Triton's
interpreter: ``FusedMarkovSampler.__call__`` (``models/deepseek_v41/nvidia/ops/fused_markov.py``:
``_markov_sample_kernel`` and ``_markov_select_kernel`` once per speculative step) beside warmreg's
``deepseek_v4.v41_markov_sample`` and ``deepseek_v4.v41_markov_select`` driven the same way.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. vLLM's
sampler is called as ``DSparkSpeculator._sample_sequential`` calls it (``sample_sequential(self, num_reqs,
head_hidden)``), on a stand-in speculator holding exactly the attributes it reads (its persistent buffers, the
draft-logits cache, and a draft model whose logits, Markov embedding and bias are small matrix products in the head
dtype, as ``LogitsProcessor`` and ``nn.Embedding`` compute them). warmreg's ops run the same loop on clones of the
same seeded tensors. Every buffer either side writes is compared bitwise: the draft tokens, the draft-logits cache,
the Markov embedding scratch and both partials (the same fp32 operations in the same order on both sides).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

fused_markov = engine("vllm.models.deepseek_v41.nvidia.ops.fused_markov")
import vllm  # noqa: E402
from warmreg_deepseek_v4._v41_markov import block_p  # noqa: E402
from warmreg_deepseek_v4.v41_markov_sample import MarkovSample  # noqa: E402
from warmreg_deepseek_v4.v41_markov_select import MarkovSelect  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I64, F32 = torch.int64, torch.float32
_HIDDEN = 16


class _Draft:
    """The draft model's hooks ``FusedMarkovSampler`` calls: ``compute_draft_logits`` (hidden -> logits in the head
    dtype), ``markov_embed`` (an embedding row of ``markov_w1``), ``markov_bias`` (``markov_w2`` applied in the head
    dtype), and ``model.markov_head.markov_w1.weight``."""

    def __init__(self, g: torch.Generator, vocab: int, rank: int, dtype: torch.dtype) -> None:
        self.head = (torch.randn(vocab, _HIDDEN, generator=g) * 0.5).to(dtype)
        self.w1 = torch.randn(vocab, rank, generator=g).to(dtype)
        self.w2 = (torch.randn(vocab, rank, generator=g) * 0.3).to(dtype)
        self.model = SimpleNamespace(markov_head=SimpleNamespace(markov_w1=SimpleNamespace(weight=self.w1)))

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head.t()

    def markov_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w1[ids]

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        return embed @ self.w2.t()


def _buffers(seed: int, *, max_reqs: int, steps: int, vocab: int, num_reqs: int, dtype: torch.dtype) -> dict[str, Any]:
    """A speculator's persistent buffers for a step of ``num_reqs`` requests: request states in a shuffled order, a
    padded tail of inert rows (``-1``), greedy and sampled temperatures, 64-bit seeds, positions anywhere, garbage in
    the draft tokens, the draft-logits cache and the sampler's scratch (a larger step wrote them before)."""
    g = seeded(seed)
    rows = max_reqs * steps
    states = torch.randperm(max_reqs, generator=g)[:num_reqs]
    idx = torch.full((rows,), -1, dtype=I64)
    idx[: num_reqs * steps] = states.repeat_interleave(steps)
    if num_reqs > 1:
        idx[steps : 2 * steps] = -1  # an inert request inside the batch (a padded CUDA-graph row)
    temp = torch.rand(max_reqs, generator=g) * 1.5
    temp[torch.rand(max_reqs, generator=g) < 0.35] = 0.0
    q = max_reqs * steps + 3
    return {
        "idx": idx,
        "pos": torch.randint(1, 1 << 20, (rows,), generator=g, dtype=I64),
        "temp": temp,
        "seeds": torch.randint(-(2**62), 2**62, (max_reqs,), generator=g, dtype=I64),
        "tokens": torch.randint(-9, 9, (max_reqs, steps), generator=g, dtype=I64),
        "cache": torch.randn(max_reqs, steps, vocab, generator=g).to(dtype),
        "hidden": torch.randn(q, _HIDDEN, generator=g).to(dtype),
        "sample_indices": torch.randperm(q, generator=g)[:rows].to(I64),
        "input_ids": torch.randint(0, vocab, (q,), generator=g, dtype=I64),
        "anchor": torch.arange(max_reqs, dtype=I64) * steps,
        "pmax": torch.randn(max_reqs, block_p(vocab), generator=g),
        "psum": torch.randn(max_reqs, block_p(vocab), generator=g),
    }


def _speculator(b: dict[str, Any], draft: _Draft, steps: int) -> SimpleNamespace:
    return SimpleNamespace(
        model=draft, num_speculative_steps=steps, sample_indices=b["sample_indices"],
        input_buffers=SimpleNamespace(input_ids=b["input_ids"]), _anchor_idx=b["anchor"],
        sample_idx_mapping=b["idx"], temperature=b["temp"], draft_logits=SimpleNamespace(values=b["cache"]),
        sample_pos=b["pos"], seeds=b["seeds"], draft_tokens=b["tokens"],
    )  # fmt: skip


def _warmreg_loop(b: dict[str, Any], draft: _Draft, num_reqs: int, steps: int, embed: torch.Tensor) -> None:
    """``FusedMarkovSampler.__call__``'s loop over warmreg's ops: the same base logits, embedding and bias GEMMs."""
    vocab, rank = b["cache"].shape[2], draft.w1.shape[1]
    dtype = str(b["cache"].dtype).removeprefix("torch.")
    sample = MarkovSample(num_steps=steps, vocab=vocab, dtype=dtype)
    select = MarkovSelect(num_steps=steps, vocab=vocab, rank=rank, dtype=dtype)
    base = draft.compute_draft_logits(b["hidden"][b["sample_indices"][: num_reqs * steps]])
    markov = draft.markov_embed(b["input_ids"][b["anchor"][:num_reqs]])
    for step in range(steps):
        bias = draft.markov_bias(markov)
        sample(base, bias, step, b["idx"], b["temp"], b["cache"], b["pmax"], b["psum"])
        select(step, b["idx"], b["pos"], b["temp"], b["seeds"], b["cache"], b["tokens"], draft.w1, embed,
               b["pmax"], b["psum"], num_reqs=num_reqs)  # fmt: skip
        markov = embed[:num_reqs]


@pytest.mark.parametrize(
    ("dtype", "max_reqs", "num_reqs", "steps", "vocab", "rank"),
    [
        (torch.bfloat16, 6, 4, 3, 5000, 16),
        (torch.float32, 5, 5, 2, 4096, 8),
        (torch.bfloat16, 3, 1, 4, 2100, 32),
        (torch.float32, 4, 3, 1, 131, 4),
    ],
)
def test_fused_markov_equals_vllm(dtype: torch.dtype, max_reqs: int, num_reqs: int, steps: int, vocab: int,
                                  rank: int) -> None:  # fmt: skip
    """A whole draft (every step) in bf16 (V4.1's head dtype) and fp32 (``head_dtype`` float32): vocabularies of
    several blocks, exactly two blocks, one block and a bit, less than one; a full batch, one request."""
    b = _buffers(max_reqs * 31 + vocab, max_reqs=max_reqs, steps=steps, vocab=vocab, num_reqs=num_reqs, dtype=dtype)
    draft = _Draft(seeded(vocab + rank), vocab, rank, dtype)
    theirs, ours = clones(**b), clones(**b)
    sampler = fused_markov.FusedMarkovSampler(max_reqs, vocab, rank, dtype)
    sampler.markov_embed.copy_(torch.randn(max_reqs, rank, generator=seeded(1)).to(dtype))
    sampler.partial_max.copy_(theirs["pmax"])
    sampler.partial_sum.copy_(theirs["psum"])
    embed = sampler.markov_embed.clone()
    assert sampler(_speculator(theirs, draft, steps), num_reqs, theirs["hidden"]) is True
    _warmreg_loop(ours, draft, num_reqs, steps, embed)
    assert_same(ours["tokens"], theirs["tokens"], "draft_tokens")
    assert_same(ours["cache"], theirs["cache"], "draft logits cache")
    assert_same(embed, sampler.markov_embed, "markov_embed scratch")
    assert_same(ours["pmax"][:num_reqs], sampler.partial_max[:num_reqs], "partial_max")
    assert_same(ours["psum"][:num_reqs], sampler.partial_sum[:num_reqs], "partial_sum")
    live = ours["idx"][: num_reqs * steps : steps] >= 0
    drawn = ours["tokens"][:num_reqs][live]
    assert ((drawn >= 0) & (drawn < vocab)).all()
    assert not torch.equal(ours["cache"], b["cache"])  # both sides wrote the live rows
