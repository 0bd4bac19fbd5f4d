"""A DeepSeek-V4.1 DSpark draft's two DeepSeek-V4 DSpark kernels against vLLM 0.34's own, with V4.1's values (its
32-token SWA pages, ``DeepseekV4SWACache(block_size=32)`` in ``models/deepseek_v41/attention.py``), on identical
seeded inputs under Triton's interpreter; every buffer either side writes is compared bitwise (index and metadata
kernels). Buffers start as a byte sentinel so a region one side leaves unwritten and the other writes shows up.

Run in the vLLM 0.34 venv::

    VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest -q \\
        -p no:cacheprovider tests/engines/test_vllm034_kernels_dsv41_dspark.py
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

import numpy as np
import pytest
import torch

vllm_swa = engine("vllm.v1.attention.backends.mla.sparse_swa")
vllm_compressor = engine("vllm.v1.attention.backends.mla.compressor_utils")
vllm_dflash = engine("vllm.v1.worker.gpu.spec_decode.dflash.speculator")
vllm_input_batch = engine("vllm.v1.worker.gpu.input_batch")

from warmreg_deepseek_v4.dspark import V41_SWA_PAGE_SIZE  # noqa: E402
from warmreg_deepseek_v4.dspark_inputs import DraftInputs, DSparkInputs  # noqa: E402
from warmreg_deepseek_v4.dspark_swa_indices import DSparkSwaIndices  # noqa: E402

WINDOW = 128  # V4.1-Flash's sliding_window
PAGE = V41_SWA_PAGE_SIZE  # 32
MAX_TOKENS, MAX_REQS = 128, 8  # persistent buffers (small)
_BYTE = 0x5A


def _sentinel(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(_BYTE)
    return t


@pytest.mark.parametrize(("contexts", "n_spec"), [([0, 31, 32, 129, 300], 5), ([1, 64, 4000], 1)])
def test_dspark_noncausal_swa_indices_equals_vllm(contexts: list[int], n_spec: int) -> None:
    """``ComputeDSparkNoncausalSWAIndicesKernel`` (``sparse_swa.py``), called as ``DeepseekSparseSWAMetadataBuilder.build``
    calls it for a draft batch built with ``causal=False`` (V4.1's CUDA builder, and the fallback of its ROCm one): the
    persistent ``[max_tokens, 1, W]`` buffer, ``decode_swa_lens`` zeroed past the decode tokens, a wider persistent
    SWA table of 32-token pages and an invalid token inside a request."""
    g = seeded(sum(contexts) + n_spec)
    reqs, nq = len(contexts), n_spec
    seq_lens = torch.tensor([c + nq for c in contexts], dtype=torch.int32)
    table = torch.randint(1, 1 << 20, (MAX_REQS, int(seq_lens.max()) // PAGE + 4), generator=g, dtype=torch.int32)
    width = vllm_compressor.get_dspark_swa_index_width(WINDOW, n_spec)
    nd = reqs * nq
    valid = torch.ones(nd, dtype=torch.bool)
    valid[nq] = False  # a padded token of request 1
    lens = _sentinel((MAX_TOKENS,), torch.int32)
    lens[nd:] = 0
    args: dict[str, Any] = {
        "indices": _sentinel((MAX_TOKENS, 1, width), torch.int32), "lens": lens,
        "qsl": torch.arange(reqs + 1, dtype=torch.int32) * nq, "seq_lens": seq_lens,
        "token_to_req": torch.arange(reqs, dtype=torch.int32).repeat_interleave(nq), "valid": valid,
        "table": table[:reqs],
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    vllm_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL(
        theirs["indices"], theirs["lens"], WINDOW, width, theirs["qsl"], theirs["seq_lens"], theirs["token_to_req"],
        theirs["valid"], theirs["table"], PAGE, num_tokens=nd, token_offset=0,
    )  # fmt: skip
    DSparkSwaIndices()(
        ours["qsl"], ours["seq_lens"], ours["token_to_req"], ours["valid"], ours["table"], num_tokens=nd,
        window_size=WINDOW, index_width=width, block_size=PAGE, out=(ours["indices"], ours["lens"]),
    )  # fmt: skip
    assert_same(ours["indices"], theirs["indices"], "decode_swa_indices_noncausal")
    assert_same(ours["lens"], theirs["lens"], "decode_swa_lens")


@pytest.mark.parametrize(
    ("targets", "rejected", "sampled"), [([4, 4, 1], [3, 0, 0], [1, 1, 1]), ([40, 2], [0, 1], [0, 1])]
)
def test_prepare_dspark_inputs_equals_vllm(targets: list[int], rejected: list[int], sampled: list[int]) -> None:
    """``prepare_dflash_inputs`` (``v1/worker/gpu/spec_decode/dflash/speculator.py``), called as
    ``DFlashSpeculator.propose`` calls it for a V4.1 DSpark draft (``sample_from_anchor=True``, ``Nq = N = 3``) with
    the SWA group's 32-token pages and the runner's persistent buffers; every buffer either side writes is compared."""
    g = seeded(sum(targets))
    n_spec = nq = 3
    noise, max_model_len, num_reqs = 128799, 512, len(targets)
    contexts = [37, 505][:num_reqs] + [200] * (num_reqs - 2)
    qsl = torch.tensor([0, *np.cumsum(targets).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(contexts, targets)]).to(torch.int64)
    table = torch.randint(1, 1 << 16, (MAX_REQS, max_model_len // PAGE), generator=g, dtype=torch.int32)
    table[0, 0] = 0  # the null block
    states = torch.tensor([5, 2, 7][:num_reqs], dtype=torch.int64)
    buffers = vllm_input_batch.InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
    for t in (buffers.input_ids, buffers.positions, buffers.query_start_loc, buffers.seq_lens):
        t.copy_(_sentinel(t.shape, t.dtype))
    samples = MAX_REQS * n_spec
    outs: dict[str, Any] = {
        "input_ids": buffers.input_ids, "positions": buffers.positions, "is_padding": buffers.is_padding,
        "query_start_loc": buffers.query_start_loc, "seq_lens": buffers.seq_lens,
        "query_slot_mapping": _sentinel((MAX_TOKENS,), torch.int64),
        "context_positions": _sentinel((MAX_TOKENS,), torch.int64),
        "context_slot_mapping": _sentinel((MAX_TOKENS,), torch.int64),
        "sample_indices": _sentinel((samples,), torch.int64), "sample_pos": _sentinel((samples,), torch.int64),
        "sample_idx_mapping": _sentinel((samples,), torch.int64),
        "temperature": _sentinel((MAX_REQS,), torch.float32), "seeds": _sentinel((MAX_REQS,), torch.int64),
    }  # fmt: skip
    ins: dict[str, Any] = {
        "target_positions": positions, "target_qsl": qsl, "idx_mapping": states,
        "num_sampled": torch.tensor(sampled, dtype=torch.int32),
        "num_rejected": torch.tensor(rejected, dtype=torch.int32),
        "last_sampled": torch.randint(0, 129280, (MAX_REQS, 1), generator=g),
        "next_prefill_tokens": torch.randint(0, 129280, (2, MAX_REQS), generator=g).to(torch.int32),
        "input_temperature": torch.rand(MAX_REQS, generator=g),
        "input_seeds": torch.randint(0, 2**40, (MAX_REQS,), generator=g),
        "block_table": table,
    }  # fmt: skip
    theirs, ours = clones(**outs, **ins), clones(**outs, **ins)
    batch = SimpleNamespace(
        num_reqs=num_reqs, num_scheduled_tokens=np.array(targets, dtype=np.int32),
        positions=theirs["target_positions"], query_start_loc=theirs["target_qsl"], idx_mapping=theirs["idx_mapping"],
    )  # fmt: skip
    names = ("input_ids", "positions", "is_padding", "query_start_loc", "seq_lens")
    vllm_dflash.prepare_dflash_inputs(
        SimpleNamespace(**{k: theirs[k] for k in names}), theirs["query_slot_mapping"], theirs["context_positions"],
        theirs["context_slot_mapping"], theirs["sample_indices"], theirs["sample_pos"], theirs["sample_idx_mapping"],
        theirs["temperature"], theirs["seeds"], batch, theirs["num_sampled"], theirs["num_rejected"],
        theirs["last_sampled"], theirs["next_prefill_tokens"], theirs["input_temperature"], theirs["input_seeds"],
        theirs["block_table"], PAGE, 0, 1, 1, noise, nq, n_spec, MAX_REQS, MAX_TOKENS, max_model_len, True, num_reqs,
    )  # fmt: skip
    DSparkInputs()(
        ours["target_positions"], ours["target_qsl"], ours["idx_mapping"], ours["last_sampled"],
        ours["next_prefill_tokens"], ours["num_sampled"], ours["num_rejected"], ours["input_temperature"],
        ours["input_seeds"], ours["block_table"], num_reqs=num_reqs, max_query_len=max(targets), block_size=PAGE,
        parallel_drafting_token_id=noise, num_query_per_req=nq, num_speculative_steps=n_spec, max_num_reqs=MAX_REQS,
        max_num_tokens=MAX_TOKENS, max_model_len=max_model_len, cp_rank=0, cp_size=1, cp_interleave=1,
        sample_from_anchor=True, out=DraftInputs(*(ours[k] for k in outs)),
    )  # fmt: skip
    for name in (*outs, "input_temperature", "input_seeds"):
        assert_same(ours[name], theirs[name], name)
