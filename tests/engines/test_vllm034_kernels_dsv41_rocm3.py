"""DeepSeek-V4.1's ROCm DSpark Markov draft steps (``deepseek_v4.v41_rocm_markov_step`` / ``_last``) against vLLM
0.34's own kernels, on identical engine-shaped inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. vLLM's side is its entry point as its call site calls it:
``models/deepseek_v41/amd/ops/fused_markov.py: sample_sequential(speculator, num_reqs, head_hidden)`` (from
``DSparkDeepseekV4ForCausalLM.sample_sequential``, which ``DSparkSpeculator._sample_sequential`` asks first), given a
stand-in speculator holding the buffers a ``DSparkSpeculator`` holds (the dtypes and layouts of
``v1/worker/gpu/spec_decode``: int32 ``input_ids``, int64 anchors, draft tokens, request map and positions, fp32
temperatures, int64 seeds, a bf16 ``[max_num_reqs, S, V]`` draft logits cache) and a stand-in draft model whose
``compute_draft_logits`` returns seeded bf16 base logits and whose Markov head holds seeded bf16 weights. warmreg's
ops run vLLM's loop (the same scratch alternation) on clones. Every buffer either side writes is compared bitwise:
the draft tokens and the logits cache (both kernels compute the bias in the same K_CHUNK order and round the same
way under the interpreter; the Gumbel noise is the same fp32 expressions).

Patched, and only that: ``monokernel_cdna3_or_4`` (``--monokernel`` on a CDNA3/4 GPU: answered True) and
``vllm.platforms.rocm.get_cdna_version`` (the GPU's CDNA generation, read by ``_why_not``: answered 3 or 4, which
sets the row limit), and ``vllm.platforms.rocm``'s one platform query at import (answered gfx942). No kernel code
and no math is patched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, engine, seeded  # isort: skip

import pytest
import torch
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

with mock.patch.object(
    torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx942:sramecc+")
):
    vllm_rocm_platform = engine("vllm.platforms.rocm")
vllm_markov = engine("vllm.models.deepseek_v41.amd.ops.fused_markov")

from warmreg_deepseek_v4.v41_rocm_markov import BLOCK, V41RocmMarkovLast, V41RocmMarkovStep  # noqa: E402

I64, F32, BF16 = torch.int64, torch.float32, torch.bfloat16


class UnquantizedEmbeddingMethod:
    """Stands for the Markov head's quantization method: ``_why_not`` reads only its class name."""


def _case(rows: int, steps: int, vocab: int, rank: int, max_reqs: int, seed: int) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    q = steps + 1  # DSpark's query tokens a request: the anchor and the draft block
    idx = torch.randperm(max_reqs, generator=g)[:rows].to(I64)[:, None].expand(rows, steps).contiguous()
    idx_flat = torch.full((max_reqs * steps,), -1, dtype=I64)
    idx_flat[: rows * steps] = idx.reshape(-1)
    if rows > 1:
        idx_flat[(rows - 1) * steps : rows * steps] = -1  # the last row is inert (a padded request)
    temp = torch.rand(max_reqs, generator=g) * 1.5
    temp[::3] = 0.0  # greedy requests
    return {
        "input_ids": torch.randint(0, vocab, (max_reqs * q,), generator=g, dtype=torch.int32),
        "anchor_idx": torch.arange(max_reqs, dtype=I64) * q,
        "w1": (torch.randn(vocab, rank, generator=g) * 0.3).to(BF16),
        "w2": (torch.randn(vocab, rank, generator=g) * 0.3).to(BF16),
        "base": (torch.randn(rows * steps, vocab, generator=g) * 3).to(BF16),
        "cache": (torch.randn(max_reqs, steps, vocab, generator=g)).to(BF16),
        "tokens": torch.full((max_reqs, steps), -3, dtype=I64),
        "idx_flat": idx_flat,
        "pos_flat": torch.randint(1, 5000, (max_reqs * steps,), generator=g, dtype=I64),
        "temperature": temp.to(F32),
        "seeds": torch.randint(0, 2**62, (max_reqs,), generator=g, dtype=I64),
    }


def _vllm(c: dict[str, torch.Tensor], rows: int, steps: int, cdna: int) -> bool:
    head = SimpleNamespace(
        markov_w1=SimpleNamespace(weight=c["w1"]),
        markov_w2=SimpleNamespace(weight=c["w2"], quant_method=UnquantizedEmbeddingMethod()),
    )
    base = c["base"]
    model = SimpleNamespace(model=SimpleNamespace(markov_head=head), compute_draft_logits=lambda hidden: base)
    spec = SimpleNamespace(
        model=model, draft_logits=SimpleNamespace(values=c["cache"]), draft_watermarker=None,
        _d2t_scatter_index=None, use_confidence_head=False, acceptance_estimator=None,
        num_speculative_steps=steps, sample_indices=torch.arange(rows * steps, dtype=I64),
        sample_idx_mapping=c["idx_flat"], sample_pos=c["pos_flat"], draft_tokens=c["tokens"],
        use_fp64_gumbel=False, input_buffers=SimpleNamespace(input_ids=c["input_ids"]), _anchor_idx=c["anchor_idx"],
        temperature=c["temperature"], seeds=c["seeds"],
    )  # fmt: skip
    with (
        mock.patch.object(vllm_markov, "monokernel_cdna3_or_4", lambda: True),
        mock.patch.object(vllm_rocm_platform, "get_cdna_version", lambda: cdna),
    ):
        return vllm_markov.sample_sequential(spec, rows, torch.zeros(rows * steps, 8, dtype=BF16))


def _warmreg(c: dict[str, torch.Tensor], rows: int, steps: int) -> None:
    vocab = c["base"].shape[1]
    nb = -(-vocab // BLOCK)
    bufs = [(torch.empty(8, nb, dtype=F32), torch.empty(8, nb, dtype=I64)) for _ in range(2)]
    base = c["base"].view(rows, steps, vocab)
    idx_map = c["idx_flat"][: rows * steps].view(rows, steps)
    pos = c["pos_flat"][: rows * steps].view(rows, steps)
    step, last = V41RocmMarkovStep(), V41RocmMarkovLast()
    for s in range(steps):
        step(bufs[(s + 1) % 2], bufs[s % 2], c["input_ids"], c["anchor_idx"], c["tokens"], c["w1"], c["w2"],
             base[:, s], c["cache"], idx_map, pos, c["temperature"], c["seeds"], s)  # fmt: skip
    last(bufs[(steps - 1) % 2], c["tokens"], rows, vocab)


@pytest.mark.parametrize(
    ("rows", "steps", "vocab", "rank", "cdna"),
    [(3, 3, 700, 64, 3), (1, 2, 512, 128, 4), (5, 1, 301, 64, 4), (8, 2, 260, 64, 3)],
)
def test_markov_steps_match_vllm(rows: int, steps: int, vocab: int, rank: int, cdna: int) -> None:
    """Draft tokens and the draft logits cache, bitwise, for greedy, sampled and inert rows (partial last blocks)."""
    want = _case(rows, steps, vocab, rank, max_reqs=10, seed=rows * 31 + vocab)
    got = {k: v.clone() for k, v in want.items()}
    assert _vllm(want, rows, steps, cdna) is True  # vLLM took the fused launches, not its loop
    _warmreg(got, rows, steps)
    assert_same(got["tokens"], want["tokens"], "draft tokens")
    assert_same(got["cache"], want["cache"], "draft logits cache")
    assert (got["tokens"][rows:] == -3).all()
