"""Kimi-K3's MLA decode under decode context parallelism against vLLM 0.34's own kernel (issue 37), under the
interpreter: the all-gather + reduce-scatter combine's correction of a rank's partial output.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_dcp.py``); skips, naming why, elsewhere. vLLM's side is
``vllm/v1/attention/ops/dcp.py: correct_attn_out(out, lses, cp_rank, ctx, is_lse_base_on_e)`` as
``_cp_lse_common`` calls it (``cp_lse_ag_out_rs``, ``MLADCPManager.combine`` of ``nvidia/mla.py``): the rank's latent
output ``[B, H, 512]`` and the all-gathered lses ``[N, B, H]`` (contiguous, the padded rows of empty shards -inf as
``mask_dcp_empty_shards_`` leaves them), a fresh ``CPTritonContext`` per call. warmreg's op runs on clones; both
outputs (``out`` rescaled in place) and both lses are compared bitwise: the same fp32 operations in the same order.
One stand-in: vLLM's launcher counts the kernel's ``constexprs`` (a ``JITFunction`` attribute) to split its
arguments, which the interpreter's ``InterpretedFunction`` lacks; it is given the same list (the indices of the three
``tl.constexpr`` parameters). No kernel and no math is patched.
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
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

vllm_dcp = engine("vllm.v1.attention.ops.dcp")
from warmreg_kimi_k3.dcp_correct_attn_out import DCPCorrectAttnOut  # noqa: E402

_jit = vllm_dcp._CORRECT_ATTN_CP_OUT_KERNEL.kernel
if not hasattr(_jit, "constexprs"):  # the interpreter's function: JITFunction.constexprs, as Triton computes it
    _jit.constexprs = [i for i, name in enumerate(_jit.arg_names) if name in ("HEAD_DIM", "N_ROUNDED", "IS_BASE_E")]

D = 512  # kv_lora_rank: the latent output's head dim


@pytest.mark.parametrize("base_e", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "world", "rank"), [(1, 16, 2, 1), (5, 12, 4, 3), (9, 8, 8, 0)])
def test_correct_attn_out_matches_vllm(base_e: bool, tokens: int, heads: int, world: int, rank: int) -> None:
    g = seeded(tokens * world)
    out = torch.randn(tokens, heads, D, generator=g).bfloat16()
    lses = torch.randn(world, tokens, heads, generator=g) * 4
    lses[:, -1] = -float("inf")  # a padded row: every rank's shard empty
    if world > 2:
        lses[1, 0] = -float("inf")  # one rank empty for one token
    ours, theirs = clones(out=out, lses=lses), clones(out=out, lses=lses)
    want_out, want_lse = vllm_dcp.correct_attn_out(theirs["out"], theirs["lses"], rank, None, is_lse_base_on_e=base_e)
    kernel = DCPCorrectAttnOut(dtype="bfloat16", head_dim=D, world_size=world, is_base_e=base_e, heads=heads)
    got_lse = kernel(ours["out"], ours["lses"], rank, is_lse_base_on_e=base_e)
    assert want_out.data_ptr() == theirs["out"].data_ptr()  # vLLM rescales in place, as the op does
    assert_same(ours["out"], theirs["out"], "rescaled output")
    assert_same(got_lse, want_lse, "global lse")
    assert_same(ours["lses"], theirs["lses"], "lses (unwritten)")
