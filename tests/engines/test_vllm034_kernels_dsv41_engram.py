"""DeepSeek-V4.1's engram kernels (issue 37) against vLLM 0.34's own entry points under Triton's interpreter:
``NgramHashState.forward`` (``_hash_ids_kernel``), ``ParallelEngramEmbedding.lookup`` (``_engram_lookup_kernel``,
bf16 rows, unsorted) and ``Engram._post_wkv`` (``_fused_engram_post_wkv_kernel``), each called as vLLM's forward
calls it, on modules built without their constructors (which load a tokenizer, a process group and a GPU table): the
attributes the entry point reads are set from vLLM's own ``EngramLayout`` and ``compute_hash_multipliers``.

The hash and the lookup are compared exactly (indices; an fp8 row times a power of two). The gate is compared
exactly too: both kernels run the same fp32 operations in the same order under the interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
from torch import nn
from warmreg_deepseek_v4._v41_engram import EngramLayout as OurLayout
from warmreg_deepseek_v4.v41_engram_gate import CLAMP, EngramGate
from warmreg_deepseek_v4.v41_engram_hash import EngramHash
from warmreg_deepseek_v4.v41_engram_lookup import EngramLookup

engram = engine("vllm.models.deepseek_v41.common.engram")

I32, BF16 = torch.int32, torch.bfloat16
CONFIG = SimpleNamespace(
    engram_layer_ids=[1, 14], engram_num_embeddings=[20000, 20000], engram_max_ngram_size=4, engram_n_heads=3,
    engram_head_dim=64, engram_compressed_vocab_size=50, engram_pad_token_id=2, engram_vocab_size=1000,
)  # fmt: skip


def _hash_state() -> tuple[nn.Module, dict]:
    """vLLM's hash module with the buffers ``NgramHashState.__init__`` registers (a stand-in token map)."""
    layout = engram.EngramLayout(CONFIG)
    state = engram.NgramHashState.__new__(engram.NgramHashState)
    nn.Module.__init__(state)
    token_map = torch.randint(0, 50, (80,), generator=seeded(7), dtype=I32)
    buffers = dict(
        token_map=token_map, primes=torch.tensor(layout.primes), offsets=layout.offsets,
        multipliers=engram.compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, 50),
    )  # fmt: skip
    for name, value in buffers.items():
        state.register_buffer(name, value, persistent=False)
    state.pad_id = int(token_map[CONFIG.engram_pad_token_id])
    return state, {**buffers, "pad_id": state.pad_id}


def test_hash_ids() -> None:
    """A step of a continued chunk (reading the runner's look-back), a decode and a prefill, with image tokens."""
    state, params = _hash_state()
    g = seeded(1)
    base = dict(
        input_ids=torch.randint(0, 80, (11,), generator=g, dtype=I32),
        positions=torch.cat([torch.arange(7, 11), torch.arange(20, 21), torch.arange(0, 6)]),
        query_start_loc=torch.tensor([0, 4, 5, 11, 11], dtype=I32),
        dead=torch.rand(11, generator=g) < 0.2,
        lookback=torch.randint(-1, 80, (6, 3), generator=g, dtype=I32),
    )
    base["lookback_dead"] = torch.rand(6, 3, generator=g) < 0.2
    theirs, ours = clones(**base), clones(**base)
    want = state(
        *(theirs[k] for k in ("input_ids", "positions", "query_start_loc", "dead", "lookback", "lookback_dead"))
    )
    layers, n_minus_1, heads = params["primes"].shape
    got = EngramHash(n_layers=layers, max_ngram_size=n_minus_1 + 1, n_heads=heads)(
        *(ours[k] for k in ("input_ids", "positions", "query_start_loc", "dead", "lookback", "lookback_dead")),
        **params,
    )
    assert_same(got, want, "hash ids")
    for name in base:
        assert_same(ours[name], theirs[name], name)


def _embedding(rows: int, head_start: int, local: int, vocab_start: int, seed: int) -> nn.Module:
    """vLLM's table module with the attributes ``lookup`` reads: a GPU-resident (not offloaded) shard."""
    table = engram.ParallelEngramEmbedding.__new__(engram.ParallelEngramEmbedding)
    nn.Module.__init__(table)
    g = seeded(seed)
    table.weight = nn.Parameter((torch.randn(rows, 64, generator=g) * 4).to(torch.float8_e4m3fn), requires_grad=False)
    scales = torch.randint(118, 136, (rows, 2), generator=g, dtype=torch.uint8)
    scales[0, 1] = 0
    table.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    table.cpu_offload, table.peer_rows, table._num_sms = False, 0, 3
    table.head_start, table.part_n_hash_cols, table.n_hash_cols, table.dim, table.block_size = (
        head_start,
        local,
        9,
        64,
        32,
    )
    table.vocab_start_idx, table.vocab_end_idx = vocab_start, vocab_start + rows
    return table


@pytest.mark.parametrize(("head_start", "background"), [(0, False), (6, True)])
def test_lookup_bf16(head_start: int, background: bool) -> None:
    """``Engram.prepare_embeddings``' lookup of one layer's hash columns (a strided view of the hash output) into its
    bf16 staging rows: TP rank 0 and the last of 3 ranks of 9 heads (3 a rank); SM cap 3 (1 in the background)."""
    table = _embedding(300, head_start, 3, 1000, head_start)
    hashes = torch.randint(950, 1350, (7, 2, 9), generator=seeded(2), dtype=I32)
    base = dict(hashes=hashes, staged=torch.full((7, 3, 64), 5.0, dtype=BF16))
    theirs, ours = clones(**base), clones(**base)
    table.lookup(theirs["hashes"][:, 1], theirs["staged"], background=background)
    EngramLookup(layout=OurLayout(layer_ids=(1, 14), max_ngram_size=4, n_heads=3, head_dim=64))(
        ours["hashes"][:, 1], ours["staged"], weight=table.weight.data, scales=table.weight_scale_inv.data,
        vocab_start=1000, head_start=head_start, max_programs=1 if background else 3,
    )  # fmt: skip
    assert_same(ours["staged"], theirs["staged"], "staged rows")
    assert_same(ours["hashes"], theirs["hashes"], "hashes")


@pytest.mark.parametrize("kv_tokens", [6, 4])
def test_post_wkv(kv_tokens: int) -> None:
    """``Engram.forward``'s gate: bf16 streams ``[T, 4, D]``, the ``wkv`` output, the image mask; fewer kv tokens as
    under sequence parallelism."""
    c, d = 4, 96
    layer = engram.Engram.__new__(engram.Engram)
    nn.Module.__init__(layer)
    g = seeded(3)
    layer.q_weight = nn.Parameter(torch.randn(c, d, generator=g).to(BF16), requires_grad=False)
    layer.k_weight = nn.Parameter(torch.randn(c, d, generator=g).to(BF16), requires_grad=False)
    layer.hc_mult, layer.dim, layer.eps, layer.clamp_value = c, d, 1e-6, CLAMP
    hidden = torch.randn(6, c, d, generator=g).to(BF16)
    kv = torch.randn(kv_tokens, (c + 1) * d, generator=g).to(BF16)
    mask = torch.rand(kv_tokens, generator=g) < 0.7
    want = layer._post_wkv(hidden.clone(), kv.clone(), mask.clone(), kv_tokens)
    got = EngramGate(hidden_size=d, hc_mult=c, dtype="bfloat16")(
        hidden, kv, mask, kv_tokens, q_weight=layer.q_weight.data, k_weight=layer.k_weight.data, eps=1e-6
    )
    assert_same(got, want, "updated streams")
