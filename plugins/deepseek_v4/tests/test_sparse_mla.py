"""C128A top-k metadata and C4 global top-k: exact equality with the PyTorch references
(Triton interpreter on CPU), registration, warm coverage of runtime-shaped batches, real cross-compiles."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import triton
from warmreg_deepseek_v4 import global_topk, sparse_mla
from warmreg_deepseek_v4.backends import c128_active_width, c128_max_width, c128_widths
from warmreg_deepseek_v4.global_topk import GlobalTopkIndices, global_topk_indices_reference
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sparse_mla import C128ATopkMetadata, c128_topk_metadata_reference

import warmreg
from warmreg.testing import (
    OpCall,
    RegisterPlugin,
    assert_allocates_nothing,
    assert_out_is_the_buffer_keywords,
    check_out,
    config_loader,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
MAX_MODEL_LEN = 100_000  # small enough for quick tests; Wmax = 896 is not a power of two


class Batch(NamedTuple):
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    slot_mapping: torch.Tensor  # int64 [T], -1 = padding
    num_decode_tokens: int
    num_reqs: int


def _batch(seed: int, *, decodes: int, prefills: int, max_model_len: int = MAX_MODEL_LEN, spec: int = 1) -> Batch:
    """A decode-first batch: ``decodes`` requests of ``spec`` tokens, then prefill chunks of 1-6 tokens.

    One decode request sits at ``max_model_len``; about one token in five is padding (slot -1).
    """
    rng = random.Random(seed)
    qlens = [spec] * decodes + [rng.randint(1, 6) for _ in range(prefills)]
    seqs = [rng.randint(q, max_model_len) for q in qlens]
    if decodes:
        seqs[0] = max_model_len
    positions = [s - q + i for s, q in zip(seqs, qlens) for i in range(q)]
    reqs = [r for r, q in enumerate(qlens) for _ in range(q)]
    slots = [rng.randint(0, 10**6) if rng.random() > 0.2 else -1 for _ in positions]
    return Batch(
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(reqs, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        decodes * spec,
        len(qlens),
    )


def _block_table(seed: int, reqs: int, width: int) -> torch.Tensor:
    return torch.randint(
        0, 5000, (max(reqs, 1), width), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)
    )


# -- C128A top-k metadata --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decodes", "prefills", "width"),
    [
        (4, 3, 128),  # mixed
        (6, 0, 256),  # decode-only
        (0, 4, 896),  # prefill-only, Wmax of MAX_MODEL_LEN (not a power of two)
        (1, 0, 128),  # T = 1
        (3, 2, 512),
    ],
)
def test_c128a_metadata_matches_reference(decodes: int, prefills: int, width: int) -> None:
    b = _batch(decodes * 10 + prefills, decodes=decodes, prefills=prefills, spec=2 if decodes == 4 else 1)
    block_table = _block_table(1, b.num_reqs, triton.cdiv(MAX_MODEL_LEN // 128, 2))
    kw: dict[str, Any] = dict(num_decode_tokens=b.num_decode_tokens, max_compressed_tokens=width, block_size=2)
    got = C128ATopkMetadata()(b.positions, b.token_to_req, block_table, b.slot_mapping, **kw)
    want = c128_topk_metadata_reference(b.positions, b.token_to_req, block_table, b.slot_mapping, **kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    nd = b.num_decode_tokens
    assert got[0].shape == (nd, 1, width) and got[2].shape == (b.positions.shape[0] - nd, width)


def test_c128a_metadata_writes_into_persistent_buffers() -> None:
    b = _batch(7, decodes=3, prefills=2)
    wmax, rows = c128_max_width(MAX_MODEL_LEN), 16
    bufs = {n: torch.full((rows, wmax), 99, dtype=torch.int32) for n in ("global_decode", "prefill_local")}
    lens = torch.full((rows,), 99, dtype=torch.int32)
    block_table = _block_table(2, b.num_reqs, triton.cdiv(MAX_MODEL_LEN // 128, 2))
    kw: dict[str, Any] = dict(num_decode_tokens=b.num_decode_tokens, max_compressed_tokens=256, block_size=2)
    got = C128ATopkMetadata()(b.positions, b.token_to_req, block_table, b.slot_mapping, **kw, decode_lens=lens, **bufs)
    want = c128_topk_metadata_reference(b.positions, b.token_to_req, block_table, b.slot_mapping, **kw)
    assert got[0].data_ptr() == bufs["global_decode"].data_ptr() and got[0].stride(0) == wmax  # a view, row stride Wmax
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.all(bufs["global_decode"][:, 256:] == 99) and torch.all(lens[b.num_decode_tokens :] == 99)


def test_c128a_metadata_empty_batch_and_bad_inputs() -> None:
    kernel = C128ATopkMetadata()
    empty64, empty32 = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
    gd, lens, pl = kernel(
        empty64,
        empty32,
        torch.zeros(1, 1, dtype=torch.int32),
        empty64,
        num_decode_tokens=0,
        max_compressed_tokens=128,
        block_size=2,
    )
    assert gd.shape == (0, 1, 128) and lens.shape == (0,) and pl.shape == (0, 128)
    b = _batch(3, decodes=2, prefills=1)
    with pytest.raises(warmreg.LaunchError, match="num_decode_tokens"):
        kernel(
            b.positions,
            b.token_to_req,
            torch.zeros(3, 4, dtype=torch.int32),
            b.slot_mapping,
            num_decode_tokens=99,
            max_compressed_tokens=128,
            block_size=2,
        )
    with pytest.raises(warmreg.LaunchError, match="int32"):
        kernel(
            b.positions,
            b.token_to_req.long(),
            torch.zeros(3, 4, dtype=torch.int32),
            b.slot_mapping,
            num_decode_tokens=2,
            max_compressed_tokens=128,
            block_size=2,
        )
    with pytest.raises(warmreg.LaunchError, match="smaller"):
        kernel(b.positions, b.token_to_req, torch.zeros(3, 4, dtype=torch.int32), b.slot_mapping, num_decode_tokens=2,
               max_compressed_tokens=256, block_size=2, global_decode=torch.empty(4, 128, dtype=torch.int32))  # fmt: skip


def test_c128_widths() -> None:
    assert c128_widths(1 << 20) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert c128_widths(131072) == [128, 256, 512, 1024]
    assert c128_widths(MAX_MODEL_LEN) == [128, 256, 512, 896]
    for seq in (1, 127, 128 * 129, 40_000, MAX_MODEL_LEN):
        assert c128_active_width(seq, MAX_MODEL_LEN) in c128_widths(MAX_MODEL_LEN)


# -- global top-k indices --------------------------------------------------------------------------
def _topk(seed: int, rows: int, topk: int, max_local: int) -> torch.Tensor:
    """Indexer-like local indices: a valid prefix of random length, then -1; a few -1 holes."""
    gen = torch.Generator().manual_seed(seed)
    vals = torch.randint(0, max_local, (rows, topk), generator=gen, dtype=torch.int32)
    count = torch.randint(0, topk + 1, (rows, 1), generator=gen)
    holes = torch.rand(rows, topk, generator=gen) < 0.05
    return torch.where((torch.arange(topk) < count) & ~holes, vals, -1).to(torch.int32)


@pytest.mark.parametrize(
    ("tokens", "topk", "row_offset", "width"),
    [
        (9, 32, 0, 32),  # decode rows: a prefix of the indexer buffer
        (1, 24, 0, 24),  # T = 1
        (7, 40, 3, 41),  # prefill rows: offset view of a wider buffer (unaligned base), non-pow2 topk
        (3, 1100, 0, 1100),  # two column tiles
    ],
)
def test_global_topk_matches_reference(tokens: int, topk: int, row_offset: int, width: int) -> None:
    b = _batch(tokens, decodes=tokens, prefills=0)
    bt_width = 20  # 20 pages of 64 compressed tokens
    buffer = _topk(tokens, tokens + row_offset, width, bt_width * 64)
    topk_indices = buffer[row_offset:, :topk]
    block_table = _block_table(3, b.num_reqs, bt_width)
    valid = b.slot_mapping >= 0
    got = GlobalTopkIndices()(topk_indices, b.token_to_req, block_table, valid, block_size=64)
    want = global_topk_indices_reference(topk_indices, b.token_to_req, block_table, valid, block_size=64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if row_offset:
        key = GlobalTopkIndices().dispatch(topk_indices=topk_indices, block_table=block_table, block_size=64)
        assert not key.topk_aligned and key.topk_stride == width


def test_global_topk_empty_batch_and_bad_inputs() -> None:
    kernel = GlobalTopkIndices()
    bt, t2r = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    out, lens = kernel(torch.empty(0, 16, dtype=torch.int32), t2r, bt, torch.ones(4, dtype=torch.bool), block_size=64)
    assert out.shape == (0, 16) and lens.shape == (0,)
    with pytest.raises(warmreg.LaunchError, match="is_valid_token"):
        kernel(torch.zeros(4, 16, dtype=torch.int32), t2r, bt, torch.ones(4, dtype=torch.int32), block_size=64)
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        kernel(torch.zeros(16, 4, dtype=torch.int32).t(), t2r, bt, torch.ones(4, dtype=torch.bool), block_size=64)


# -- registration, coverage, warm --------------------------------------------------------------------
def _Plugin() -> RegisterPlugin:
    """Registers only this module's kernels."""
    return RegisterPlugin(sparse_mla.register, global_topk.register, model=DSV4.from_config)


_config = example_config
#: FlashInfer's DeepSeek-V4 backend with a cache it takes on SM10x (per-tensor FP8 rows)
FLASHINFER = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_runtime_batches_hit_warmed_keys(example: str) -> None:
    """Realistic steps (meta tensors, the example's sizes) dispatch to keys of the cuda:90 plan."""
    config = _config(example)
    plan = warmreg.plan(config, target="cuda:90", plugins=[_Plugin()], entry_points=False)
    serving, model = config["serving"], config["model"]
    max_len, max_tokens, max_reqs = serving["max_model_len"], serving["max_num_batched_tokens"], serving["max_num_seqs"]
    c128, topk = plan.kernel(C128ATopkMetadata.name), plan.kernel(GlobalTopkIndices.name)
    assert len(c128.keys) == 1 and len(topk.keys) == 1
    rng = random.Random(0)
    block_table = warmreg.meta((max_reqs, triton.cdiv(max_len, 256)), torch.int32)
    topk_buffer = warmreg.meta((max_tokens, model["index_topk"]), torch.int32)
    for _ in range(50):
        # the launcher's C128 dispatch inputs: the step's width from its longest sequence
        width = c128_active_width(rng.choice([1, 128, rng.randint(1, max_len), max_len]), max_len)
        assert c128.kernel.dispatch(compress_ratio=128, max_compressed_tokens=width, block_size=2) in c128.keys
        # global top-k: decode rows [:nd] or FlashInfer's prefill rows [nd:T] of the indexer buffer
        nd = rng.randint(0, max_tokens)
        total = rng.randint(nd, max_tokens)
        for view in (topk_buffer[:nd], topk_buffer[nd:total]):
            assert topk.kernel.dispatch(topk_indices=view, block_table=block_table, block_size=64) in topk.keys


def test_registration_follows_backend_platform_and_ratios() -> None:
    def names(config: dict[str, Any], target: str) -> set[str]:
        return {k.name for k in warmreg.plan(config, target=target, plugins=[_Plugin()], entry_points=False).kernels}

    both = {C128ATopkMetadata.name, GlobalTopkIndices.name}
    assert names(_config("deepseek_v4_pro", **FLASHINFER), "cuda:100") == both  # FlashInfer too
    assert names(_config("deepseek_v4_flash"), "rocm:gfx942") == set()
    assert names(_config("deepseek_v4_flash", attention_backend="TRITON_MLA"), "cuda:90") == set()
    c4_only = _config("deepseek_v4_flash")
    c4_only["model"]["compress_ratios"] = [0, 4, 4, 0]
    assert names(c4_only, "cuda:90") == {GlobalTopkIndices.name}
    with pytest.raises(warmreg.ConfigError, match="block_size"):
        names(_config("deepseek_v4_flash", block_size=64), "cuda:90")


def test_warm_cross_compiles_for_cuda_90() -> None:
    report = warmreg.warm(
        _config("deepseek_v4_flash"),
        target="cuda:90",
        plugins=[_Plugin()],
        entry_points=False,
        workers=2,
        on_error="continue",
    )
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 2


# -- out= (the kit's checks) -----------------------------------------------------------------------------------
def _global_topk_call() -> OpCall:
    b = _batch(5, decodes=5, prefills=0)
    args = (_topk(5, 5, 40, 20 * 64), b.token_to_req, _block_table(3, b.num_reqs, 20), b.slot_mapping >= 0)
    return OpCall(GlobalTopkIndices(), args, {"block_size": 64})


def test_global_topk_out() -> None:
    """check_out: the caller's buffers come back fully written, wrong ones are refused, nothing is allocated."""
    check_out(_global_topk_call, tuple_error=r"out must be a tuple of \d buffers")


def _c128a_call() -> tuple[OpCall, tuple[torch.Tensor, ...]]:
    """The C128A metadata with persistent buffers larger than needed (rows past T untouched: tested above)."""
    b = _batch(7, decodes=3, prefills=2)
    block_table = _block_table(2, b.num_reqs, triton.cdiv(MAX_MODEL_LEN // 128, 2))
    kw = dict(num_decode_tokens=b.num_decode_tokens, max_compressed_tokens=256, block_size=2)
    bufs = (torch.full((16, 384), 99, dtype=torch.int32), torch.full((16,), 99, dtype=torch.int32),
            torch.full((16, 384), 99, dtype=torch.int32))  # fmt: skip
    return OpCall(C128ATopkMetadata(), (b.positions, b.token_to_req, block_table, b.slot_mapping), kw), bufs


def test_c128a_launch_with_out_allocates_nothing() -> None:
    call, bufs = _c128a_call()
    assert_allocates_nothing(call, bufs)


def test_c128a_out_tuple_is_the_buffer_keywords() -> None:
    call, bufs = _c128a_call()
    assert_out_is_the_buffer_keywords(call, bufs, ("global_decode", "decode_lens", "prefill_local"))
