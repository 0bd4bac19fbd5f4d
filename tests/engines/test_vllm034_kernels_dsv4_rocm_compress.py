"""DeepSeek-V4's ROCm two-stage C128 compressor against vLLM 0.34's own kernels, on identical engine-shaped inputs, under
Triton's interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. The test
calls vLLM's Python entry point exactly as ROCm's ``DeepseekCompressor.forward`` does for a C128 layer
(``compress_norm_rope_store_two_stage_triton`` with ``head_dim=512``, ``overlap=False``, its ``num_decode_tokens`` and
its ``[max_num_batched_tokens, 512]`` float32 scratch), which runs ``_compress_gather_split_sparse_attn`` and
``_finalize_norm_rope_quant_store_sparse_attn`` on the prefill rows and the single-pass kernel on the decode rows; and
warmreg's ops as the sweep driver does (``deepseek_v4.rocm_compress_gather_split`` with vLLM's split count, then
``deepseek_v4.rocm_compress_finalize``, on the prefill rows; ``deepseek_v4.rocm_sparse_compress_insert`` on the decode
rows) on copies of the same seeded tensors, then compares the scratch and the cache storage bitwise: both sides run
the same operations in the same order (softmax pooling over the same column tiles, RMSNorm, RoPE), and vLLM's bf16 and
e4m3fn casts go through torch (round to nearest even, satfinite: the ``_hardware_casts`` fixture of
``test_vllm034_kernels_dsv4_rocm_indexer.py``), as a GPU rounds, where warmreg's exact encoders give the same bits.

Patched, none of them a kernel or its math: the module's ``_n_cu`` (``torch.cuda.get_device_properties``), set to CU
counts that make vLLM pick each of its split counts 1..16 for these rows, and ``_ON_GFX950`` (the finalize's
``SANITIZE_CACHE_NANS``), run both ways.
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

vllm_compress = engine("vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache")
from test_vllm034_kernels_dsv4_rocm_indexer import _hardware_casts  # noqa: E402, F401  (the fixture)
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes  # noqa: E402
from warmreg_deepseek_v4.rocm_compress_insert import RocmSparseCompressInsert  # noqa: E402
from warmreg_deepseek_v4.rocm_compress_two_stage import (  # noqa: E402
    RocmCompressFinalize,
    RocmCompressGatherSplit,
    compress_num_splits,
)

I32, U8, PAGE = torch.int32, torch.uint8, 64  # Flash's C128 cache: 64 compressed tokens a page


@pytest.mark.usefixtures("_hardware_casts")
@pytest.mark.parametrize(("cu", "decodes", "gfx950"), [(256, 2, False), (8, 0, True), (4, 3, False), (2, 2, True),
                                                       (1, 0, False)])  # fmt: skip
def test_two_stage_compressor_equals_vllm(cu: int, decodes: int, gfx950: bool) -> None:
    """A step of single-token decode rows then prefill rows (vLLM's order): closing and non-closing positions, a
    null state slot and a null compressed slot among the prefill rows, 8-token state pages, Flash's 64-token
    ``fp8_ds_mla`` pages at the allocated stride; every split count (the CU counts). Every byte of the cache storage
    and every scratch entry the same."""
    g = seeded(cu + decodes + gfx950)
    spages, pages, stride = 48, 4, page_bytes(PAGE)
    positions = torch.tensor([127, 255, 383, 0, 126, 127, 255, 511, 639, 767])
    n = positions.shape[0]
    inputs = {
        "state_cache": torch.randn(spages, 8, 1024, generator=g),
        "token_to_req_indices": torch.tensor([0, 1, 2, 3, 3, 4, 4, 4, 5, 5], dtype=I32),
        "positions": positions,
        "slot_mapping": torch.tensor([1, 2, 3, 4, 5, 6, -1, 8, 9, 10]),
        "block_table": torch.randint(0, spages, (6, 100), generator=g, dtype=I32),
        "norm_weight": (torch.randn(512, generator=g) * 0.1 + 1).to(torch.bfloat16),
        "cos_sin_cache": torch.rand(800, 64, generator=g) * 2 - 1,
        "backing": torch.randint(0, 256, (pages * stride,), generator=g, dtype=torch.int64).to(U8),
        "kv_slot_mapping": torch.tensor([3, 70, 5, 133, 9, 130, 11, -1, 200, 12]),
        "scratch": torch.randn(n + 4, 512, generator=g),  # [max_num_batched_tokens, 512], garbage past the step
    }
    theirs, ours = ({k: v.clone() for k, v in inputs.items()} for _ in range(2))

    def cache(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["backing"].as_strided((pages, PAGE, 584), (stride, 584, 1))

    with mock.patch.object(vllm_compress, "_ON_GFX950", gfx950), mock.patch.object(vllm_compress, "_n_cu", lambda: cu):
        vllm_compress.compress_norm_rope_store_two_stage_triton(
            state_cache=theirs["state_cache"], num_actual=n, token_to_req_indices=theirs["token_to_req_indices"],
            positions=theirs["positions"], slot_mapping=theirs["slot_mapping"], block_table=theirs["block_table"],
            block_size=8, state_width=512, cos_sin_cache=theirs["cos_sin_cache"], kv_cache=cache(theirs),
            k_cache_metadata=SimpleNamespace(slot_mapping=theirs["kv_slot_mapping"]), pdl_kwargs={}, head_dim=512,
            rope_head_dim=64, compress_ratio=128, overlap=False, use_fp4_cache=False,
            rms_norm_weight=theirs["norm_weight"], rms_norm_eps=1e-6, quant_block=64, token_stride=576, scale_dim=8,
            num_decode_tokens=decodes, compress_scratch=theirs["scratch"],
        )  # fmt: skip
    d = decodes
    splits = compress_num_splits(n - d, cu)
    RocmCompressGatherSplit()(
        ours["state_cache"], ours["token_to_req_indices"][d:], ours["positions"][d:], ours["slot_mapping"][d:],
        ours["block_table"], ours["scratch"][: n - d], num_splits=splits,
    )  # fmt: skip
    RocmCompressFinalize()(
        ours["scratch"][: n - d], ours["positions"][d:], ours["slot_mapping"][d:], ours["norm_weight"],
        ours["cos_sin_cache"], cache(ours), ours["kv_slot_mapping"][d:], 1e-6, sanitize_nans=gfx950,
    )  # fmt: skip
    if d:
        RocmSparseCompressInsert()(
            ours["state_cache"], ours["token_to_req_indices"], ours["positions"], ours["slot_mapping"][:d],
            ours["block_table"], ours["norm_weight"], ours["cos_sin_cache"], cache(ours), ours["kv_slot_mapping"],
            1e-6, compress_ratio=128, sanitize_nans=gfx950,
        )  # fmt: skip
    assert_same(ours["scratch"], theirs["scratch"], "scratch")
    assert_same(ours["backing"], theirs["backing"], "cache bytes")
    assert not torch.equal(theirs["backing"], inputs["backing"]), "nothing was written"
    assert not torch.equal(theirs["scratch"], inputs["scratch"]), "nothing was pooled"
