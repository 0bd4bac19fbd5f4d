"""DeepSeek-V4.1's engram row selection against its PyTorch reference under Triton's interpreter (by hand, the
sequence-parallel and data-parallel windows, padding past the last token, errors, in place, warmup inputs), and the
plan: nothing is planned (no warmreg setting expresses the parallelism that launches it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.v41_engram_select import EngramSelectRows, EngramSelectRowsKey, engram_select_rows_reference

import warmreg
from warmreg.testing import Allocations, OpCall, assert_warmup_inputs_reproduce

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BF16 = torch.bfloat16


def test_select_by_hand() -> None:
    """Two ranks of 3 tokens x 2 values: the window of tokens 1..2 lays rank 0's values then rank 1's side by side;
    a third window row past the last token is zeros."""
    gathered = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2).to(BF16)  # rank r, token t: 6r + 2t + (0, 1)
    out = torch.full((3, 2, 2), 99.0, dtype=BF16)
    got = EngramSelectRows()(gathered, source_tokens=3, token_start=1, local_width=2, out=out)
    assert got is out
    assert out.reshape(3, 4).tolist() == [[2, 3, 8, 9], [4, 5, 10, 11], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("ranks", "tokens", "heads", "local_heads", "dim", "start", "rows"),
    [
        (8, 5, 24, 3, 64, 2 * 1, 1),  # SP at TP 8: rank 2 of chunks of 1 (cdiv(5, 8)), 24 hash columns of 3 a rank
        (4, 37, 22, 6, 32, 10, 10),  # heads not a multiple of the ranks' (6 x 4 = 24 gathered, 22 kept)
        (2, 700, 8, 4, 256, 512, 256),  # a window past the last token (rows 700..767 zero), more than one tile
        (3, 0, 3, 1, 64, 0, 0),  # an empty window: no launch
    ],
)
def test_select_matches_reference(
    ranks: int, tokens: int, heads: int, local_heads: int, dim: int, start: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(tokens + heads)
    gathered = torch.randn(ranks * tokens, local_heads, dim, generator=g).to(BF16)
    out = torch.randn(rows, heads, dim, generator=g).to(BF16)
    kw = dict(source_tokens=tokens, token_start=start, local_width=local_heads * dim)
    want = engram_select_rows_reference(gathered, out=out, **kw)
    EngramSelectRows()(gathered, out=out, **kw)
    assert torch.equal(out, want)


def test_errors_name_the_argument() -> None:
    kernel, gathered, out = EngramSelectRows(), torch.zeros(4, 2, 8, dtype=BF16), torch.zeros(2, 4, 8, dtype=BF16)
    kw = dict(source_tokens=2, token_start=0, local_width=16)
    with pytest.raises(warmreg.LaunchError, match="gathered"):
        kernel(gathered.float(), out=out, **kw)
    with pytest.raises(warmreg.LaunchError, match="gathered"):
        kernel(gathered.transpose(0, 1), out=out, **kw)
    with pytest.raises(warmreg.LaunchError, match="out must be"):
        kernel(gathered, out=out.reshape(2, 32), **kw)
    with pytest.raises(warmreg.LaunchError, match="local_width"):
        kernel(gathered, out=out, source_tokens=2, token_start=0, local_width=0)
    with pytest.raises(warmreg.LaunchError, match="fewer than"):
        kernel(gathered, out=out, source_tokens=3, token_start=0, local_width=16)


def test_in_place_and_allocates_nothing() -> None:
    gathered, out = torch.zeros(4, 2, 8, dtype=BF16), torch.zeros(2, 4, 8, dtype=BF16)
    with Allocations() as fresh:
        spec = OpCall(
            EngramSelectRows(), (gathered,), dict(source_tokens=2, token_start=0, local_width=16, out=out)
        ).launch_code()
    assert not fresh.calls and spec.outputs is out


def test_one_key_a_dtype_and_nothing_planned() -> None:
    """vLLM's two call sites, any split of heads over ranks and any window, reproduce the one bf16 key; no example
    or target plans it."""
    kernel = EngramSelectRows()
    (key,) = {kernel.dispatch(gathered=warmreg.meta((n, h, 256), BF16)) for n in (1, 8, 4096) for h in (1, 3, 24)}
    assert key == EngramSelectRowsKey(dtype="bfloat16", block=1024, num_warps=4)
    for tokens, start in ((1, 0), (17, 3), (8192, 1024)):
        args = (warmreg.meta((8 * tokens, 3, 256), BF16),)
        kw = dict(source_tokens=tokens, token_start=start, local_width=768, out=warmreg.meta((tokens, 24, 256), BF16))
        assert OpCall(kernel, args, kw).launch_code().key == key
    assert_warmup_inputs_reproduce(kernel, [key, EngramSelectRowsKey(dtype="float32", block=1024, num_warps=4)])
    for target in ("cuda:90", "cuda:100"):
        names = {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels}
        assert EngramSelectRows.name not in names
