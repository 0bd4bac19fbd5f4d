"""DeepSeek-V4.1's engram row selection against vLLM 0.34's own kernel, on identical engine-shaped inputs, under
Triton's interpreter: ``_engram_select_rows`` (``_engram_select_rows_kernel``) as ``Engram.embed`` calls it under
sequence parallelism and ``_gather_engram_rows`` under engram data parallelism, and ``EngramBatch._stage``'s FP8
staging (``_engram_unpack_fp8_kernel``) after the all-to-all and after the peer exchange, and the peer exchange's
lookup (``EngramPeerExchange.exchange``, ``_peer_lookup_kernel``).

Runs in the vLLM 0.34 venv; skips, naming why, elsewhere. Each test calls vLLM's entry point
(``vllm/models/deepseek_v41/common/engram.py``) with its call sites' arguments (the all-gathered rows, a fresh output,
the per-rank token count, the window start, ``local_heads * dim``) and warmreg's op on clones of the same seeded
tensors, then compares every buffer, bitwise (a copy). The all-gathers are not kernels: their results stand in, rows
stacked rank-major as ``all_gather(dim=0)`` returns them. ``_stage`` runs on a stand-in ``EngramBatch`` holding what
it reads (its buffers, the layers' tables); its communication is patched, CUDA-only and no kernel: the all-to-all
becomes a copy of the packed rows (the exchanged rows stand in), the DP group a stand-in object (no collective runs), the table lookups (their
own op, ``v41_engram_lookup``) leave the seeded rows, and the peer exchange returns the peers' row addresses.
``exchange`` runs on a stand-in ``EngramPeerExchange`` whose symmetric buffers are CPU tensors (the peers' ids at
their addresses, this rank's among them) and whose barriers (symmetric memory, CUDA only) do nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

from types import SimpleNamespace

import pytest
import torch

vllm_engram = engine("vllm.models.deepseek_v41.common.engram")
vllm_peer = engine("vllm.models.deepseek_v41.nvidia.ops.engram_peer")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_engram_peer import EngramPeerLookup  # noqa: E402
from warmreg_deepseek_v4.v41_engram_select import EngramSelectRows  # noqa: E402
from warmreg_deepseek_v4.v41_engram_unpack import EngramUnpackFp8  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("ranks", "tokens", "local_heads", "n_hash_cols", "dim", "rank", "chunk"),
    [
        (8, 5, 3, 24, 256, 2, 1),  # Engram.embed, SP at TP 8: V4.1-Flash's 24 hash columns, chunk cdiv(5, 8)
        (8, 13, 3, 24, 256, 7, 2),  # the last rank's chunk runs past the last token (zeros)
        (4, 9, 6, 22, 64, 1, 3),  # a table split into more heads than the layer keeps (6 x 4 = 24 > 22)
        (2, 700, 4, 8, 256, 1, 350),  # _gather_engram_rows: DP 2, a replica's 350-token slot, many tiles
    ],
)
def test_select_rows_equals_vllm(
    ranks: int, tokens: int, local_heads: int, n_hash_cols: int, dim: int, rank: int, chunk: int
) -> None:
    g = seeded(tokens * ranks + rank)
    args = {
        "gathered": torch.randn(ranks * tokens, local_heads, dim, generator=g).to(BF16),
        "out": torch.randn(chunk, n_hash_cols, dim, generator=g).to(BF16),  # vLLM's new_empty: garbage
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_engram._engram_select_rows(theirs["gathered"], theirs["out"], tokens, rank * chunk, local_heads * dim)
    EngramSelectRows()(
        ours["gathered"], source_tokens=tokens, token_start=rank * chunk, local_width=local_heads * dim, out=ours["out"]
    )
    for name in theirs:
        assert_same(ours[name], theirs[name], f"_engram_select_rows: {name}")
    assert not torch.equal(theirs["out"], args["out"])


def _stand_in(layers: int, heads: int, local: int, dim: int, max_tokens: int, g: torch.Generator) -> SimpleNamespace:
    """What ``EngramBatch._stage`` reads, with the persistent buffers ``EngramBatch.__init__`` sizes (garbage)."""
    table = SimpleNamespace(n_hash_cols=heads, part_n_hash_cols=local, dim=dim, lookup=lambda ids, out: None)
    ranks, row = heads // local, dim + dim // 32
    return SimpleNamespace(
        layers=[SimpleNamespace(embed_tokens=table, layer_hash_index=i) for i in range(layers)],
        packed_rows=torch.randint(0, 256, (max_tokens * ranks, layers, local, row), generator=g, dtype=torch.uint8),
        exchanged_rows=torch.randint(0, 256, (max_tokens * ranks, layers, local, row), generator=g, dtype=torch.uint8),
        fp8_values=torch.randint(0, 256, (layers, max_tokens, heads * dim), generator=g, dtype=torch.uint8),
        fp8_scales=torch.randint(
            0, 256, (layers, vllm_engram.mxfp8_scale_bytes(max_tokens, heads * dim)), generator=g, dtype=torch.uint8
        ),
        peer_exchange=None,
    )


@pytest.mark.parametrize(
    ("layers", "ranks", "local", "dim", "slot", "peer"),
    [(2, 8, 3, 256, 5, False), (2, 4, 6, 256, 130, False), (1, 2, 2, 128, 1, False), (2, 4, 2, 128, 3, True)],
)
def test_unpack_fp8_equals_vllm(
    monkeypatch: pytest.MonkeyPatch, layers: int, ranks: int, local: int, dim: int, slot: int, peer: bool
) -> None:
    """V4.1-Flash's two engram layers of 24 hash columns over DP 8 (256-wide heads), a slot past one 128-row tile, one
    layer, and a peer exchange (rank 1 reading its rows of each peer's buffer)."""
    g = seeded(layers * 1000 + slot + peer)
    heads, max_tokens = ranks * local, slot + 3
    state = _stand_in(layers, heads, local, dim, max_tokens, g)
    hashes = torch.zeros(slot * ranks, layers, heads, dtype=torch.int32)
    peers = [torch.randint(0, 256, state.packed_rows.shape, generator=g, dtype=torch.uint8) for _ in range(ranks)]
    addresses = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64)
    if peer:
        state.peer_exchange = SimpleNamespace(exchange=lambda h, n: addresses, dp_rank=1)
    monkeypatch.setattr(vllm_engram, "get_engram_dp_group", lambda: SimpleNamespace(device_group=None))
    monkeypatch.setattr(torch.distributed, "all_to_all_single", lambda out, inp, group=None: out.copy_(inp))
    ours = SimpleNamespace(values=state.fp8_values.clone(), scales=state.fp8_scales.clone())
    exchanged = state.packed_rows[: slot * ranks].clone()
    vllm_engram.EngramBatch._stage(state, hashes, slot, peer)
    kw = dict(num_tokens=slot, heads=heads, local_heads=local)
    if peer:
        EngramUnpackFp8()(addresses, ours.values, ours.scales, rank=1, peer=True, **kw)
    else:
        EngramUnpackFp8()(exchanged, ours.values, ours.scales, **kw)
    assert_same(ours.values, state.fp8_values, "EngramBatch._stage: fp8_values")
    assert_same(ours.scales, state.fp8_scales, "EngramBatch._stage: fp8_scales")


@pytest.mark.parametrize(
    ("group", "rank", "layers", "heads", "dim", "slot", "tokens"), [(8, 3, 2, 24, 256, 5, 4), (2, 0, 1, 4, 128, 3, 3)]
)
def test_peer_lookup_equals_vllm(
    group: int, rank: int, layers: int, heads: int, dim: int, slot: int, tokens: int
) -> None:
    """``exchange(hashes, slot)`` of V4.1-Flash's two engram layers (24 hash columns, DP 8, 256-wide heads) with a
    token short of the slot (its ids -1: zero rows), and of a one-layer group of two."""
    g = seeded(group * 100 + slot)
    max_tokens, rows = slot + 2, 40
    peer_ids = [
        torch.randint(-1, 3 * rows, (max_tokens, layers, heads), generator=g, dtype=torch.int32) for _ in range(group)
    ]
    tables = []
    for layer in range(layers):  # layer l owns ids [40 * (l % 3), 40 * (l % 3 + 1)): ids spread over three shards
        weight = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.uint8)
        scales = torch.randint(0, 256, (rows, dim // 32), generator=g, dtype=torch.uint8)
        tables.append((weight, scales, rows * (layer % 3), rows * (layer % 3 + 1)))
    metadata = torch.tensor([[w.data_ptr(), s.data_ptr(), a, b] for w, s, a, b in tables], dtype=torch.int64)
    id_ptrs = torch.tensor([t.data_ptr() for t in peer_ids], dtype=torch.int64)
    out = torch.randint(
        0, 256, (max_tokens * group, layers, heads // group, dim + dim // 32), generator=g, dtype=torch.uint8
    )
    hashes = torch.randint(
        0, 3 * rows, (tokens, 1 + layers, heads), generator=g, dtype=torch.int32
    )  # layer 0 not engram
    ours = out.clone()
    barrier = SimpleNamespace(barrier=lambda: None)
    state = SimpleNamespace(
        ids=peer_ids[rank], hash_start=1, num_layers=layers, id_handle=barrier, row_handle=barrier, metadata=metadata,
        id_ptrs=id_ptrs, rows=out, heads=heads, dp_size=group, dp_rank=rank, dim=dim, row_ptrs=None,
    )  # fmt: skip
    vllm_peer.EngramPeerExchange.exchange(state, hashes, slot)
    assert torch.equal(peer_ids[rank][:tokens], hashes[:, 1:]) and (peer_ids[rank][tokens:slot] == -1).all()
    EngramPeerLookup(dim=dim)(metadata, id_ptrs, ours, num_tokens=slot, heads=heads, rank=rank)
    assert_same(ours, out, "EngramPeerExchange.exchange: rows")
