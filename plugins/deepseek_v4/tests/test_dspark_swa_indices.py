"""DSpark non-causal SWA indices: exact equality with the PyTorch reference (Triton interpreter on CPU), the
engine's edge cases, registration on every platform with DSpark on, warm coverage, a real cross-compile."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from warmreg_deepseek_v4 import dspark_inputs, dspark_swa_indices
from warmreg_deepseek_v4.dspark import SPECULATIVE_METHODS, dspark_swa_index_width
from warmreg_deepseek_v4.dspark_swa_indices import DSparkSwaIndices, dspark_swa_indices_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_allocates_nothing, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

DSPARK = "deepseek_v4_flash_0731_dspark"
PAGE = 64


class Draft(NamedTuple):
    qsl: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    token_to_req: torch.Tensor  # int32 [T]
    is_valid: torch.Tensor  # bool [T]
    block_table: torch.Tensor  # int32 [R, width] (a view of a wider table when asked)


def _draft(prefixes: list[int], qlen: int, *, seed: int = 0, invalid: tuple[int, ...] = (), wider: int = 0) -> Draft:
    """A draft batch: each request ``qlen`` query tokens after ``prefix`` context tokens; tokens in ``invalid``
    padded (slot -1); the table a ``[:, :width]`` view of one ``wider`` columns wider."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [p + qlen for p in prefixes]
    width = max(seqs) // PAGE + 1
    table = torch.randint(1, 1 << 20, (len(seqs), width + wider), generator=gen, dtype=torch.int32)[:, :width]
    qsl = torch.arange(len(seqs) + 1, dtype=torch.int32) * qlen
    t = len(seqs) * qlen
    valid = torch.ones(t, dtype=torch.bool)
    valid[list(invalid)] = False
    req = torch.arange(len(seqs), dtype=torch.int32).repeat_interleave(qlen)
    return Draft(qsl, torch.tensor(seqs, dtype=torch.int32), req, valid, table)


def _check(
    d: Draft, *, window: int, width: int, offset: int = 0, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n = d.token_to_req.shape[0] - offset if n is None else n
    kw: dict[str, Any] = dict(num_tokens=n, window_size=window, index_width=width, block_size=PAGE, token_offset=offset)
    got = DSparkSwaIndices()(d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table, **kw)
    want = dspark_swa_indices_reference(d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table, **kw)
    assert got[0].shape == want[0].shape == (n, width)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return got


@pytest.mark.parametrize("prefix", [0, 1, 127, 128, 129, 10**6])
def test_prefixes_with_the_deployed_width(prefix: int) -> None:
    """W = 192 (window 128, N = 5): the window starts at 0 for short prefixes, straddles pages otherwise."""
    d = _draft([prefix, 3], 5, seed=prefix)
    idx, lens = _check(d, window=128, width=dspark_swa_index_width(128, 5))
    want_len = min(prefix, 128) + 5
    assert lens[:5].tolist() == [want_len] * 5 and bool((idx[:5] == idx[0]).all())  # one row per request
    start = max(prefix - 128, 0)
    p = torch.arange(start, start + want_len)
    assert torch.equal(idx[0, :want_len].long(), d.block_table[0].long()[p // PAGE] * PAGE + p % PAGE)
    assert bool((idx[0, want_len:] == -1).all())


@pytest.mark.parametrize(("window", "n"), [(1000, 5), (1000, 30)])
def test_rows_of_one_tile_and_more(window: int, n: int) -> None:
    """W >= 1024: exactly one 1024-column tile (1000 + 5 -> 1024) and two (1000 + 30 -> 1088)."""
    width = dspark_swa_index_width(window, n)
    assert width == {5: 1024, 30: 1088}[n]
    _check(_draft([5000, 999, 2], n, seed=n), window=window, width=width)


def test_a_block_wider_than_the_row_keeps_the_unclamped_length() -> None:
    """1 + N query tokens with (window + N) % 64 == 0: L = 128 + 65 > W = 192; only W entries are stored."""
    d = _draft([400, 10], 65)
    idx, lens = _check(d, window=128, width=dspark_swa_index_width(128, 64))
    assert lens[0] == 193 and idx.shape[1] == 192 and bool((idx[0] >= 0).all())


def test_invalid_tokens_in_the_middle_and_a_wider_table() -> None:
    """Padded tokens inside a request get lens 0 and a row of -1; the table's row stride exceeds its width."""
    d = _draft([300, 0, 129], 5, invalid=(2, 6, 7, 14), wider=37)
    assert d.block_table.stride(0) != d.block_table.shape[1]
    idx, lens = _check(d, window=128, width=192)
    assert lens[[2, 6, 7, 14]].tolist() == [0] * 4 and bool((idx[[2, 6, 7, 14]] == -1).all())


def test_token_offset_and_stale_persistent_buffers() -> None:
    """Rows of tokens from ``token_offset`` on, into the builder's ``[max, 1, W]`` buffer full of stale values."""
    d = _draft([50, 700, 128], 5, invalid=(9,))
    buf, lens = torch.full((32, 1, 192), 7, dtype=torch.int32), torch.full((32,), 9, dtype=torch.int32)
    kw: dict[str, Any] = dict(num_tokens=10, window_size=128, index_width=192, block_size=PAGE, token_offset=5)
    got = DSparkSwaIndices()(d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table, out=(buf, lens), **kw)
    want = dspark_swa_indices_reference(d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(buf[:10, 0], want[0]) and bool((buf[10:] == 7).all()) and bool((lens[10:] == 9).all())


def test_random_batches() -> None:
    rng = random.Random(3)
    for seed in range(3):
        prefixes = [rng.choice([0, rng.randint(0, 300), rng.randint(0, 5000)]) for _ in range(rng.randint(1, 4))]
        t = len(prefixes) * 5
        d = _draft(prefixes, 5, seed=seed, invalid=tuple(i for i in range(t) if rng.random() < 0.2))
        _check(d, window=128, width=192)


def test_empty_batch_and_bad_inputs() -> None:
    d = _draft([10], 5)
    args = (d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table)
    kw: dict[str, Any] = dict(window_size=128, index_width=192, block_size=PAGE)
    idx, lens = DSparkSwaIndices()(*args, num_tokens=0, **kw)
    assert idx.shape == (0, 192) and lens.shape == (0,)
    with pytest.raises(warmreg.LaunchError, match="cover tokens"):
        DSparkSwaIndices()(*args, num_tokens=6, **kw)
    with pytest.raises(warmreg.LaunchError, match="bool"):
        DSparkSwaIndices()(d.qsl, d.seq_lens, d.token_to_req, d.is_valid.int(), d.block_table, num_tokens=5, **kw)
    with pytest.raises(warmreg.LaunchError, match="out indices"):
        small = (torch.zeros(5, 1, 128, dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
        DSparkSwaIndices()(*args, num_tokens=5, out=small, **kw)


# -- registration, coverage, warm --------------------------------------------------------------------
def _plan(config: Any, target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(dspark_swa_indices.register, dspark_inputs.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "rocm:gfx950", "xpu:pvc"])
def test_planned_on_every_platform_with_dspark(target: str) -> None:
    plan = _plan(example_config(DSPARK), target)
    (key,) = plan.kernel(DSparkSwaIndices.name).keys
    assert key == DSparkSwaIndices().dispatch(window_size=128, index_width=192, block_size=64)
    assert (key.window_size, key.index_width, key.block_size, key.triton_block_size) == (
        "div16",
        "div16",
        "div16",
        1024,
    )


@pytest.mark.parametrize("method", ["mtp", "eagle", "ngram", None])
def test_not_planned_without_dspark(method: str | None) -> None:
    """The dspark_* model fields give sizes, not the switch: only speculative_method "dspark" turns it on."""
    config = example_config(DSPARK)
    if method is None:
        del config["serving"]["speculative_method"]
    else:
        config["serving"]["speculative_method"] = method
    assert not _plan(config, "cuda:90").kernels
    assert not _plan(example_config("deepseek_v4_flash"), "cuda:90").kernels


def test_an_unknown_method_names_the_accepted_ones() -> None:
    with pytest.raises(warmreg.ConfigError, match="accepted: mtp, dspark") as exc:
        _plan(example_config(DSPARK, speculative_method="dspark2"), "cuda:90")
    assert all(m in str(exc.value) for m in SPECULATIVE_METHODS)


def test_width_follows_num_speculative_tokens() -> None:
    """Unset, N is dspark_block_size (5); set, the setting: every N the core accepts (1..64) gives W 192."""
    for n, width in ((None, 192), (64, 192), (1, 192)):
        serving = {} if n is None else {"num_speculative_tokens": n}
        kernel = _plan(example_config(DSPARK, **serving), "cuda:90").kernel(DSparkSwaIndices.name).kernel
        assert kernel.index_width == width


def test_warm_cross_compiles_for_cuda_90() -> None:
    plugin = RegisterPlugin(dspark_swa_indices.register, model=DSV4.from_config)
    report = warmreg.warm(example_config(DSPARK), target="cuda:90", plugins=[plugin], entry_points=False, workers=1)
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 1


# -- out= (persistent buffers larger than needed: rows past T untouched, tested above) -------------------------
def test_launch_with_out_allocates_nothing() -> None:
    d, width = _draft([5, 300], 5), dspark_swa_index_width(128, 5)
    kw = dict(num_tokens=10, window_size=128, index_width=width, block_size=PAGE)
    bufs = (torch.full((12, 1, width), 7, dtype=torch.int32), torch.full((12,), 7, dtype=torch.int32))
    call = OpCall(DSparkSwaIndices(), (d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table), kw)
    assert_allocates_nothing(call, bufs)
