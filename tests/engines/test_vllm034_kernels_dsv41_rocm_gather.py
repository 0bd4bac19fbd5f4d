"""DeepSeek-V4.1's ROCm ``fp8_ds_mla`` gather against vLLM 0.34's own kernel, on identical engine-shaped inputs, under
Triton's interpreter: ``dequantize_and_gather_k_cache`` on 584-byte ``fp8_ds_mla`` pages, which on ROCm launches
``_dequantize_and_gather_k_one_pass_kernel``, as the in-tree prefill (``DeepseekV41ROCMAiterMLAAttention.
_forward_prefill`` in ``models/deepseek_v41/amd/rocm.py``) calls it for a prefill chunk: the compressed cache
(``gather_lens=None``, ``offset=0``, ``use_fnuz=False``, ``max_gather_len`` the chunk's longest compressed length) and
the SWA cache (the chunk's gather lens, ``offset=chunk_N``, ``use_fnuz`` the platform's).

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point
(``vllm/models/deepseek_v41/common/ops/cache_utils.py``) with the call site's arguments and warmreg's op on clones of
the same seeded tensors, then compares the whole workspace and the cache, bitwise: each value is an e4m3 value times a
power of two (exact in fp32 and bf16 on both sides) or a copied bf16. The pages are random ``fp8_ds_mla`` records
without e4m3's NaN codes (a NaN's payload is not part of the contract) and with scales near 1 (products far from fp32's
subnormals, which hardware may flush).

Patched, and only while vLLM's entry point runs: its two platform queries, ``current_platform.is_rocm()`` (answered
True: the one-pass kernel is ROCm's) and ``has_cutedsl()`` (answered False: ROCm has no CuTeDSL; the CPU venv may).
No kernel and no math is patched.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_cache = engine("vllm.models.deepseek_v41.common.ops.cache_utils")
import vllm  # noqa: E402
from warmreg_deepseek_v4._sweep_v41_rocm_gather import random_fp8_ds_mla_pages  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_gather_k import V41RocmGatherKCache  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, BF16 = torch.int32, torch.bfloat16


def _on_rocm() -> AbstractContextManager[Any]:
    """vLLM's two platform queries on the gather's path, answered as on ROCm."""
    return mock.patch.multiple(
        vllm_cache,
        has_cutedsl=lambda: False,
        current_platform=mock.Mock(wraps=vllm_cache.current_platform, is_rocm=lambda: True),
    )


def _backing(pages: torch.Tensor) -> torch.Tensor:
    """The whole page buffer ``[pages, page stride]`` of a view of padded pages."""
    return pages.as_strided((pages.shape[0], pages.stride(0)), (pages.stride(0), 1))


@pytest.mark.parametrize(
    ("seqs", "glens", "block_size", "offset", "fnuz"),
    [
        ((9, 1, 17), None, 128, 0, False),  # compressed, ratio 2 (256 // 2 tokens a page)
        ((130,), None, 256, 0, False),  # compressed, ratio 1
        ((40, 3), (35, 3), 32, 20, True),  # SWA on gfx942 (FNUZ), after 20 compressed rows
        ((70, 5, 0), (40, 5, 0), 32, 0, False),  # SWA-only layer, an empty request
    ],
)
def test_one_pass_gather_equals_vllm(
    seqs: tuple[int, ...], glens: tuple[int, ...] | None, block_size: int, offset: int, fnuz: bool
) -> None:
    """A prefill chunk (the rows ``[1, 1 + chunk)`` of a wider prefill block table; the workspace ``kv[:chunk]`` of a
    larger buffer) over pages with a stride past their records."""
    g = seeded(sum(seqs) * 7 + block_size + offset)
    chunk, width = len(seqs), max(-(-s // block_size) for s in seqs) + 2
    rows = offset + max(glens or seqs) + 3
    args = {
        "kv": torch.randn(chunk + 2, rows, 512, generator=g).to(BF16),
        "pages": _backing(random_fp8_ds_mla_pages(7, block_size, g, torch.device("cpu"), page_pad=128)),
        "seq_lens": torch.tensor(seqs, dtype=I32),
        "gather_lens": torch.tensor(glens or seqs, dtype=I32),
        "block_table": torch.randint(0, 7, (chunk + 3, width), generator=g, dtype=I32),
    }
    theirs, ours = clones(**args), clones(**args)
    size = block_size * 584
    theirs["k_cache"], ours["k_cache"] = (d["pages"][:, :size].view(7, block_size, 584) for d in (theirs, ours))
    table = slice(1, 1 + chunk)
    most = None if glens is not None else max(seqs)
    with _on_rocm():
        vllm_cache.dequantize_and_gather_k_cache(
            theirs["kv"][:chunk], theirs["k_cache"], seq_lens=theirs["seq_lens"],
            gather_lens=None if glens is None else theirs["gather_lens"], block_table=theirs["block_table"][table],
            block_size=block_size, offset=offset, use_fnuz=fnuz, max_gather_len=most,
        )  # fmt: skip
    V41RocmGatherKCache()(
        ours["kv"][:chunk], ours["k_cache"], ours["seq_lens"], None if glens is None else ours["gather_lens"],
        ours["block_table"][table], block_size=block_size, offset=offset, use_fnuz=fnuz, max_gather_len=most,
    )  # fmt: skip
    for name in ("kv", "pages", "seq_lens", "gather_lens", "block_table"):
        assert_same(ours[name], theirs[name], f"dequantize_and_gather_k_cache: {name}")
    assert not torch.equal(theirs["kv"], args["kv"]) or sum(seqs) == 0  # rows were written
