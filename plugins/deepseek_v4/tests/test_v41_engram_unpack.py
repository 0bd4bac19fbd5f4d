"""DeepSeek-V4.1's engram FP8 staging against its PyTorch reference under Triton's interpreter (the packed rows of
an all-to-all and the peer tables, the scale tile's padding, errors, in place, warmup inputs), and the plan: nothing
is planned (no warmreg setting expresses the engram data-parallel group that launches it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4._v41_mxfp8 import mxfp8_scale_bytes, mxfp8_scale_offset
from warmreg_deepseek_v4.v41_engram_unpack import EngramUnpackFp8, EngramUnpackFp8Key, engram_unpack_fp8_reference

import warmreg
from warmreg.testing import Allocations, OpCall, assert_warmup_inputs_reproduce

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
U8 = torch.uint8


def _buffers(g: torch.Generator, layers: int, heads: int, dim: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Garbage persistent buffers: values of ``tokens`` rows, scales with spare bytes past the tiles."""
    values = torch.randint(0, 256, (layers, tokens, heads * dim), generator=g, dtype=U8)
    scales = torch.randint(0, 256, (layers, mxfp8_scale_bytes(tokens, heads * dim) + 64), generator=g, dtype=U8)
    return values, scales


def test_one_row_by_hand() -> None:
    """Rank 1's head 0 of token 2, layer 1 (packed row [1 * 3 + 2, 1, 0]) lands at head 2 (2 local heads a rank) of
    token 2, its scales at F8_128x4 (2, 2 * 2 + j); token 3 of the 128-row tile gets zero scales."""
    dim, heads, local = 64, 4, 2
    packed = torch.zeros(6, 2, local, dim + 2, dtype=U8)
    packed[5, 1, 0, :dim] = torch.arange(dim, dtype=U8) + 1
    packed[5, 1, 0, dim:] = torch.tensor([120, 130], dtype=U8)
    values, scales = torch.full((2, 3, heads * dim), 7, dtype=U8), torch.full((2, 1088), 9, dtype=U8)
    EngramUnpackFp8()(packed, values, scales, num_tokens=3, heads=heads, local_heads=local)
    assert values[1, 2, 2 * dim : 3 * dim].tolist() == list(range(1, dim + 1))
    at = mxfp8_scale_offset(torch.tensor([2, 2]), torch.tensor([4, 5]), heads * 2).tolist()
    assert scales[1, at].tolist() == [120, 130]
    assert scales[1, mxfp8_scale_offset(torch.tensor(3), torch.tensor(0), heads * 2)] == 0  # past the tokens
    assert scales[:, 1024:].eq(9).all()  # bytes past the one 128-row tile (8 groups: 2 x 512) are untouched


@pytest.mark.parametrize(
    ("layers", "ranks", "local", "dim", "tokens"),
    [(2, 2, 3, 64, 5), (2, 8, 3, 256, 130), (1, 4, 1, 128, 1), (3, 2, 2, 32, 0)],
)
def test_matches_reference(layers: int, ranks: int, local: int, dim: int, tokens: int) -> None:
    """V4.1-Flash's two layers of 24 hash columns over 8 ranks (256-wide heads) past one 128-row tile, odd splits and
    an empty slot."""
    g = torch.Generator().manual_seed(layers * 100 + tokens)
    heads = ranks * local
    packed = torch.randint(0, 256, (ranks * tokens + 2, layers, local, dim + dim // 32), generator=g, dtype=U8)
    values, scales = _buffers(g, layers, heads, dim, tokens + 3)
    kw = dict(num_tokens=tokens, heads=heads, local_heads=local)
    want = engram_unpack_fp8_reference(packed, values, scales, **kw)
    EngramUnpackFp8()(packed, values, scales, **kw)
    assert torch.equal(values, want[0]) and torch.equal(scales, want[1])


def test_peer_tables_read_this_ranks_rows_of_every_peer() -> None:
    """With peer tables rank ``r`` reads rows ``[r * N + t]`` of each peer's buffer: the same staging as packed rows
    that hold exactly those."""
    g = torch.Generator().manual_seed(5)
    layers, ranks, local, dim, n, rank = 2, 3, 2, 64, 4, 1
    peers = [torch.randint(0, 256, (ranks * n, layers, local, dim + 2), generator=g, dtype=U8) for _ in range(ranks)]
    addresses = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64)
    values, scales = _buffers(g, layers, ranks * local, dim, n)
    kw = dict(num_tokens=n, heads=ranks * local, local_heads=local)
    want = engram_unpack_fp8_reference(torch.cat([p[rank * n : (rank + 1) * n] for p in peers]), values, scales, **kw)
    EngramUnpackFp8()(addresses, values, scales, rank=rank, peer=True, **kw)
    assert torch.equal(values, want[0]) and torch.equal(scales, want[1])


def test_errors_name_the_argument() -> None:
    kernel, packed = EngramUnpackFp8(), torch.zeros(8, 2, 2, 66, dtype=U8)
    values, scales = torch.zeros(2, 4, 256, dtype=U8), torch.zeros(2, 1024, dtype=U8)
    kw = dict(num_tokens=4, heads=4, local_heads=2)
    with pytest.raises(warmreg.LaunchError, match="local_heads"):
        kernel(packed, values, scales, num_tokens=4, heads=4, local_heads=3)
    with pytest.raises(warmreg.LaunchError, match="values must be"):
        kernel(packed, values[:, :, :200], scales, **kw)
    with pytest.raises(warmreg.LaunchError, match="values must be"):
        kernel(packed, values[:, :3], scales, **kw)
    with pytest.raises(warmreg.LaunchError, match="scales must be"):
        kernel(packed, values, scales[:, :100], **kw)
    with pytest.raises(warmreg.LaunchError, match="packed must be contiguous"):
        kernel(packed[:7], values, scales, **kw)
    with pytest.raises(warmreg.LaunchError, match="peer addresses"):
        kernel(torch.zeros(3, dtype=torch.int64), values, scales, peer=True, **kw)


def test_in_place_and_allocates_nothing() -> None:
    args = (torch.zeros(8, 2, 2, 66, dtype=U8), torch.zeros(2, 4, 256, dtype=U8), torch.zeros(2, 1024, dtype=U8))
    with Allocations() as fresh:
        spec = OpCall(EngramUnpackFp8(), args, dict(num_tokens=4, heads=4, local_heads=2)).launch_code()
    assert not fresh.calls and spec.outputs[0] is args[1] and spec.outputs[1] is args[2]


def test_keys_and_nothing_planned() -> None:
    """``EngramBatch._stage``'s calls (the persistent buffers of max_tokens rows, any slot, layer count and split)
    reproduce one key per head dim and exchange; no example or target plans it."""
    kernel = EngramUnpackFp8(dim=256)
    keys = {EngramUnpackFp8Key(dim=256, block=16, peer=p, num_warps=4) for p in (False, True)}
    for slot, layers, ranks in ((1, 2, 8), (300, 2, 4), (4096, 3, 2)):
        values, scales = warmreg.meta((layers, 4096, 24 * 256), U8), warmreg.meta((layers, 4096 * 192), U8)
        packed = warmreg.meta((4096 * ranks, layers, 24 // ranks, 264), U8)
        kw = dict(num_tokens=slot, heads=24, local_heads=24 // ranks)
        assert OpCall(kernel, (packed, values, scales), kw).launch_code().key in keys
        peer = (warmreg.meta((ranks,), torch.int64), values, scales)
        assert OpCall(kernel, peer, {**kw, "rank": 1, "peer": True}).launch_code().key in keys
    assert_warmup_inputs_reproduce(kernel, sorted(keys, key=lambda k: k.peer))
    for target in ("cuda:90", "cuda:100"):
        names = {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels}
        assert EngramUnpackFp8.name not in names
