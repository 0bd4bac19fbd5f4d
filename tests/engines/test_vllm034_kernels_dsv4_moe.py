"""DeepSeek-V4's ROCm aiter MegaMoE shared-expert routes against vLLM 0.34's own kernel, on identical engine-shaped
inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. The test
calls vLLM's Python entry point as ``DeepseekV4AiterMegaMoEExperts.forward`` does,
``append_shared_expert(topk_weights, topk_ids)``, on an experts object that holds exactly the attributes that method
reads, set by the formulas of ``DeepseekV4AiterMegaMoEExperts.__init__`` for a given rank (building the module needs
an expert-parallel group and aiter), and warmreg's drop-in on clones of the same seeded router outputs (int32 ids with
``-1`` routes, float32 weights), then compares both outputs and the inputs bitwise: the kernel copies and re-indexes.

``vllm/platforms/rocm.py`` resolves the GPU's arch at import (amdsmi, else ``torch.cuda.get_device_properties``);
on this CPU machine that one platform query is answered ``gfx950`` while the module is imported, so
``models/deepseek_v4/amd/mega_moe.py`` (which imports ``vllm._aiter_ops``) loads. No kernel and no math is patched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

# The platform query vllm/platforms/rocm.py makes at import (amdsmi is absent here): answered gfx950.
with mock.patch.object(
    torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx950:sramecc+")
):
    engine("vllm.platforms.rocm")
vllm_mega = engine("vllm.models.deepseek_v4.amd.mega_moe")
from warmreg_deepseek_v4.rocm_mega_moe import RocmMegaMoeAppendShared  # noqa: E402


def _experts(num_experts: int, top_k: int, ep_size: int, ep_rank: int) -> SimpleNamespace:
    """The attributes ``append_shared_expert`` reads, as ``DeepseekV4AiterMegaMoEExperts.__init__`` sets them with
    ``fuse_shared_expert=True``."""
    routed = num_experts // ep_size
    return SimpleNamespace(
        routed_top_k=top_k,
        top_k=top_k + 1,
        num_routed_local_experts=routed,
        shared_expert_id=ep_rank * (routed + 1) + routed,
    )


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "ep_size", "ep_rank"),
    [(1, 256, 6, 8, 0), (130, 256, 6, 8, 7), (64, 384, 6, 4, 2), (37, 256, 6, 1, 0), (0, 256, 6, 8, 3)],
)
def test_append_shared_expert_equals_vllm(
    tokens: int, num_experts: int, top_k: int, ep_size: int, ep_rank: int
) -> None:
    """V4-Flash (256 experts, top-6) and V4-Pro (384) at several expert-parallel sizes and ranks: one decode token,
    several 64-token tiles with a masked tail, one rank holding every expert, an empty step."""
    g = seeded(tokens * 31 + ep_size * 7 + ep_rank)
    args = {
        "topk_ids": torch.randint(-1, num_experts, (tokens, top_k), generator=g, dtype=torch.int32),
        "topk_weights": torch.rand((tokens, top_k), generator=g, dtype=torch.float32),
    }
    theirs, ours = clones(**args), clones(**args)
    experts = _experts(num_experts, top_k, ep_size, ep_rank)
    want = vllm_mega.DeepseekV4AiterMegaMoEExperts.append_shared_expert(
        experts, theirs["topk_weights"], theirs["topk_ids"]
    )
    got = RocmMegaMoeAppendShared()(
        ours["topk_weights"],
        ours["topk_ids"],
        routed_per_rank=experts.num_routed_local_experts,
        shared_expert_id=experts.shared_expert_id,
    )
    assert_same(got[0], want[0], "out_weights")
    assert_same(got[1], want[1], "out_ids")
    for name in args:
        assert_same(ours[name], theirs[name], name)
