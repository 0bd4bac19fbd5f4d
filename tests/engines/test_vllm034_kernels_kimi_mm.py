"""Kimi-K3's vision-tower input normalisation against vLLM 0.34's own kernel (issue 37), under the interpreter.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_mm.py``); skips, naming why, elsewhere. vLLM's side is ``FusedMMInputNorm``
built as ``build_mm_input_norm`` builds it from a processor's mean, std and rescale factor, called through its CUDA
forward (``forward_cuda``, which ``forward_hip`` is too; the CPU platform's dispatch would pick ``forward_native``)
on what ``MoonVision3dPatchEmbed.forward`` passes it: the ``[P, 3, 14, 14]`` uint8 patches flattened to
``[P, 588]`` and the patch embedding's dtype. warmreg's op takes the module's own fp32 ``weight`` and ``bias``
buffers. Both run ``fp32(x) * w + b`` and one cast, so the outputs are compared bitwise; nothing is patched (the
module is built under a default ``VllmConfig``, as ``CustomOp.__init__`` asks for a current one).
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

vllm_norm = engine("vllm.model_executor.layers.fusion.mm_input_norm")
vllm_config = engine("vllm.config")
from warmreg_kimi_k3.mm_input_norm import MMInputNorm  # noqa: E402

#: Kimi-K2.5's processor (MoonViT's media_proc_cfg), and an uneven one with a non-default rescale.
PROCESSORS = [
    ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], 1 / 255),
    ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711], 1 / 127.5),
]


@pytest.mark.parametrize("processor", PROCESSORS)
@pytest.mark.parametrize(("patches", "dtype"), [(1, torch.bfloat16), (37, torch.bfloat16), (16, torch.float16)])
def test_mm_input_norm_matches_vllm(processor: tuple[list[float], list[float], float], patches: int,
                                    dtype: torch.dtype) -> None:  # fmt: skip
    mean, std, rescale = processor
    with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):  # a CustomOp reads it when built
        module = vllm_norm.FusedMMInputNorm(image_mean=mean, image_std=std, rescale_factor=rescale, channel=3)
    g = seeded(patches)
    raw = torch.randint(0, 256, (patches + 1, 3, 14, 14), generator=g, dtype=torch.uint8)[1:]  # an offset view
    ours, theirs = clones(x=raw), clones(x=raw)
    want = module.forward_cuda(theirs["x"].flatten(1), dtype).view_as(raw)
    got = MMInputNorm(dtype="bfloat16")(ours["x"].flatten(1), module.weight, module.bias, out_dtype=dtype).view_as(raw)
    assert got.dtype == want.dtype == dtype
    assert_same(got, want, "normalised patches")
    assert_same(ours["x"], theirs["x"], "the input (unwritten)")
