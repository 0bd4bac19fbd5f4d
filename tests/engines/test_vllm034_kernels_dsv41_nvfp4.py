"""DeepSeek-V4.1's NVFP4 compressed-record gather against vLLM 0.34's own kernel, on identical engine-shaped inputs,
under Triton's interpreter: ``dequantize_and_gather_k_cache`` on 288-byte records (``_dequantize_and_gather_k_nvfp4_
kernel``), as FlashMLA's ``_forward_prefill`` and mega attention's ``_forward_prefill_mega`` call it for a compressed
layer's prefill chunk.

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point
(``vllm/models/deepseek_v41/common/ops/cache_utils.py``) with the call sites' arguments (``gather_lens=None``,
``offset=0``, ``block_size`` the kernel block over the ratio, the chunk's rows of the prefill block table) and
warmreg's op on clones of the same seeded tensors, then compares the whole workspace, bitwise: each value is an e2m1
value times an e4m3 scale, exact in fp32 and in bf16 on both sides. Records are random bytes whose scales avoid e4m3's
NaN codes (0x7F, 0xFF: the writer never stores them, and a NaN's sign and payload are not part of the contract).
vLLM's NVFP4 branch takes no CuTeDSL path and asks nothing CUDA-only.
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

vllm_cache = engine("vllm.models.deepseek_v41.common.ops.cache_utils")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_nvfp4_gather import Nvfp4GatherKCache  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, U8, BF16 = torch.int32, torch.uint8, torch.bfloat16


def _records(g: torch.Generator, blocks: int, block_size: int) -> torch.Tensor:
    """uint8 ``[blocks, block_size, 288]`` records: random nibbles, e4m3 scales of every non-NaN code."""
    cache = torch.randint(0, 256, (blocks, block_size, 288), generator=g, dtype=U8)
    scales = torch.randint(0, 254, (blocks, block_size, 32), generator=g, dtype=U8)
    cache[:, :, 256:] = scales + (scales >= 0x7F).to(U8)  # skip 0x7F; 0xFF is out of range
    return cache


@pytest.mark.parametrize(
    ("seqs", "block_size", "rows", "mega"),
    [((9, 1, 17), 64, 20, False), ((130,), 128, 133, False), ((3, 40), 64, 48, True), ((2, 0), 16, 4, True)],
)
def test_nvfp4_gather_equals_vllm(seqs: tuple[int, ...], block_size: int, rows: int, mega: bool) -> None:
    """A prefill chunk's compressed lengths (``seq_lens // ratio``; an empty one) over pages of a 64- or 128-token
    kernel block at ratio 1 or 2 (block sizes 16..128), the chunk's rows of a wider prefill block table; the
    workspace FlashMLA's (``kv[:chunk_size]`` of a larger buffer) or mega attention's retained one
    (``kv_ws[:, :chunk_n]``, a column slice)."""
    g = seeded(sum(seqs) * 3 + block_size + mega)
    chunk, width = len(seqs), max(-(-s // block_size) for s in seqs) + 2
    workspace = torch.randn(chunk + 2, rows + (40 if mega else 0), 512, generator=g).to(BF16)
    args = {
        "kv": workspace,
        "k_cache": _records(g, 9, block_size),
        "seq_lens": torch.tensor(seqs, dtype=I32),
        "block_table": torch.randint(0, 9, (chunk + 3, width), generator=g, dtype=I32),
    }
    theirs, ours = clones(**args), clones(**args)
    table = slice(1, 1 + chunk)  # the chunk's rows past the decodes: [num_decodes:][chunk_start:chunk_end]
    out_t = theirs["kv"][:chunk, :rows] if mega else theirs["kv"][:chunk]
    vllm_cache.dequantize_and_gather_k_cache(
        out_t, theirs["k_cache"], seq_lens=theirs["seq_lens"], gather_lens=None,
        block_table=theirs["block_table"][table], block_size=block_size, offset=0,
    )  # fmt: skip
    out_o = ours["kv"][:chunk, :rows] if mega else ours["kv"][:chunk]
    Nvfp4GatherKCache()(
        out_o, ours["k_cache"], ours["seq_lens"], None, ours["block_table"][table], block_size=block_size
    )
    for name in theirs:
        assert_same(ours[name], theirs[name], f"dequantize_and_gather_k_cache: {name}")
    assert not torch.equal(theirs["kv"], args["kv"]) or sum(seqs) == 0  # rows were written
