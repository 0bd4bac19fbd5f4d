"""DeepSeek-V4.1's engram peer lookup against its PyTorch reference under Triton's interpreter (hand-picked ids,
random groups, ownership at the vocab range's ends, errors, in place, warmup inputs), and the plan: nothing is
planned (no warmreg setting expresses the engram data-parallel group that launches it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.v41_engram_peer import EngramPeerLookup, EngramPeerLookupKey, engram_peer_lookup_reference

import warmreg
from warmreg.testing import Allocations, OpCall, assert_warmup_inputs_reproduce

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
I32, I64, U8 = torch.int32, torch.int64, torch.uint8
Table = tuple[torch.Tensor, torch.Tensor, int, int]


def _tables(g: torch.Generator, layers: int, rows: int, dim: int) -> tuple[list[Table], torch.Tensor]:
    """Each layer's shard (e4m3 weights, UE8M0 scales) owning ids ``[start, start + rows)``, and the metadata."""
    tables: list[Table] = []
    for layer in range(layers):
        weight = torch.randint(0, 256, (rows, dim), generator=g, dtype=U8).view(torch.float8_e4m3fn)
        scales = torch.randint(0, 256, (rows, dim // 32), generator=g, dtype=U8)
        tables.append((weight, scales, 7 * layer + 3, 7 * layer + 3 + rows))
    metadata = torch.tensor([[w.data_ptr(), s.data_ptr(), a, b] for w, s, a, b in tables], dtype=I64)
    return tables, metadata


def test_lookup_by_hand() -> None:
    """Two ranks of one token, one layer, 4 heads: rank 1 owns heads 2 and 3 and looks them up for both peers' tokens;
    an id below the range, at its end, or -1 (past a peer's tokens) gives a zero row."""
    tables, metadata = _tables(torch.Generator().manual_seed(0), 1, 5, 32)
    weight, scales, start, _ = tables[0]  # ids 3..7
    ids = [torch.tensor([[[0, 0, 4, 8]]], dtype=I32), torch.tensor([[[0, 0, 7, -1]]], dtype=I32)]
    id_ptrs = torch.tensor([t.data_ptr() for t in ids], dtype=I64)
    out = torch.full((2, 1, 2, 33), 9, dtype=U8)
    got = EngramPeerLookup(dim=32)(metadata, id_ptrs, out, num_tokens=1, heads=4, rank=1)
    assert got is out
    row = lambda i: torch.cat([weight.view(U8)[i - start], scales[i - start]]).tolist()  # noqa: E731
    assert out[0, 0].tolist() == [row(4), [0] * 33] and out[1, 0].tolist() == [row(7), [0] * 33]


@pytest.mark.parametrize(
    ("group", "tokens", "layers", "heads", "dim", "rank"),
    [(8, 3, 2, 24, 256, 5), (2, 17, 1, 4, 64, 0), (4, 0, 2, 8, 32, 3)],
)
def test_matches_reference(group: int, tokens: int, layers: int, heads: int, dim: int, rank: int) -> None:
    """V4.1-Flash's two layers of 24 hash columns over a DP group of 8 (256-wide heads), a 17-token slot, an empty one;
    ids spread over and around each layer's range."""
    g = torch.Generator().manual_seed(group * 10 + tokens)
    tables, metadata = _tables(g, layers, 40, dim)
    ids = [torch.randint(-1, 60, (tokens + 2, layers, heads), generator=g, dtype=I32) for _ in range(group)]
    id_ptrs = torch.tensor([t.data_ptr() for t in ids], dtype=I64)
    out = torch.randint(0, 256, (group * tokens + 3, layers, heads // group, dim + dim // 32), generator=g, dtype=U8)
    want = engram_peer_lookup_reference(ids, tables, out, num_tokens=tokens, rank=rank)
    EngramPeerLookup(dim=dim)(metadata, id_ptrs, out, num_tokens=tokens, heads=heads, rank=rank)
    assert torch.equal(out, want)


def test_errors_name_the_argument() -> None:
    kernel, metadata, id_ptrs = EngramPeerLookup(), torch.zeros(2, 4, dtype=I64), torch.zeros(2, dtype=I64)
    out = torch.zeros(6, 2, 2, 66, dtype=U8)
    kw = dict(num_tokens=3, heads=4, rank=1)
    with pytest.raises(warmreg.LaunchError, match="metadata"):
        kernel(metadata[:, :3], id_ptrs, out, **kw)
    with pytest.raises(warmreg.LaunchError, match="id_ptrs"):
        kernel(metadata, id_ptrs.int(), out, **kw)
    with pytest.raises(warmreg.LaunchError, match="multiple"):
        kernel(metadata, id_ptrs, out, num_tokens=3, heads=5, rank=1)
    with pytest.raises(warmreg.LaunchError, match="rank"):
        kernel(metadata, id_ptrs, out, num_tokens=3, heads=4, rank=2)
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        kernel(metadata, id_ptrs, out[:5], **kw)
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        kernel(metadata, id_ptrs, torch.zeros(6, 2, 2, 60, dtype=U8), **kw)


def test_in_place_and_allocates_nothing() -> None:
    args = (torch.zeros(2, 4, dtype=I64), torch.zeros(2, dtype=I64), torch.zeros(6, 2, 2, 66, dtype=U8))
    with Allocations() as fresh:
        spec = OpCall(EngramPeerLookup(), args, dict(num_tokens=3, heads=4, rank=1)).launch_code()
    assert not fresh.calls and spec.outputs is args[2]


def test_one_key_a_head_dim_and_nothing_planned() -> None:
    """``exchange``'s calls (the symmetric row buffer of max_tokens rows, any slot, group and rank) reproduce one key;
    no example or target plans it."""
    kernel = EngramPeerLookup(dim=256)
    key = EngramPeerLookupKey(dim=256, block=16, num_warps=4)
    for slot, group, rank in ((1, 2, 1), (300, 8, 7), (1023, 4, 0)):
        out = warmreg.meta((1024 * group, 2, 24 // group, 264), U8)
        args = (warmreg.meta((2, 4), I64), warmreg.meta((group,), I64), out)
        assert OpCall(kernel, args, dict(num_tokens=slot, heads=24, rank=rank)).launch_code().key == key
    assert_warmup_inputs_reproduce(kernel, [key, EngramPeerLookupKey(dim=128, block=16, num_warps=4)])
    for target in ("cuda:90", "cuda:100"):
        names = {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels}
        assert EngramPeerLookup.name not in names
