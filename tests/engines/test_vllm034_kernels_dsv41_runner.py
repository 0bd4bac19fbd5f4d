"""DeepSeek-V4.1's per-step CUDA kernels against vLLM 0.34's own, on identical engine-shaped inputs, under Triton's
interpreter: the mHC head collapse of ``DeepseekV4Model.forward`` (``hc_collapse_triton``).

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's entry point as its call site does and warmreg's op on clones of the same seeded tensors, then compares
every buffer either side writes, bitwise: the collapse runs the same fp32 products and adds in the same order on both
sides, and the interpreter's fp32 -> bf16 conversion (a truncation, not the GPU's rounding) is the same on both.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_mhc = engine("vllm.model_executor.kernels.mhc.triton")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_hc_collapse import HcCollapse  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(("tokens", "hidden", "hc_mult"), [(3, 5120, 4), (5, 1100, 2), (0, 64, 4)])
def test_hc_collapse_equals_vllm(tokens: int, hidden: int, hc_mult: int) -> None:
    """``hc_collapse_triton(hidden_states, pre_mix)`` on the last layer's fresh ``[T, hc_mult, H]`` streams and
    ``[T, hc_mult]`` FFN pre-mix (V4.1-Flash's widths; a 76-column second tile; an empty step), then on a row-sliced
    stream buffer and a column slice of a wider mix (other strides, other binaries on both sides). The inputs are
    left as they were."""
    g = seeded(tokens + hidden)
    args = {
        "x": torch.randn(tokens, hc_mult, hidden + 32, generator=g).to(BF16),
        "pre": torch.rand(tokens, 3 * hc_mult, generator=g) * 2,
    }
    theirs, ours = clones(**args), clones(**args)
    kernel = HcCollapse(hidden_size=hidden, hc_mult=hc_mult)
    views = (
        lambda d: (d["x"][:, :, :hidden].contiguous(), d["pre"][:, :hc_mult].contiguous()),
        lambda d: (d["x"][:, :, :hidden], d["pre"][:, 2 * hc_mult :]),
    )
    for view in views:
        assert_same(kernel(*view(ours)), vllm_mhc.hc_collapse_triton(*view(theirs)), "hc_collapse_triton: out")
    for name in theirs:
        assert_same(ours[name], theirs[name], f"hc_collapse_triton: {name}")
