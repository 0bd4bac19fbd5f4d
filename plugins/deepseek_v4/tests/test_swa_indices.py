"""Decode SWA indices and the FlashMLA prefill combine of top-k and SWA indices: exact equality with the
PyTorch references (Triton interpreter on CPU), registration, warm coverage, real cross-compiles."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import triton
from warmreg_deepseek_v4 import combine_indices, swa_indices
from warmreg_deepseek_v4.backends import c128_active_width
from warmreg_deepseek_v4.combine_indices import CombineTopkSwaIndices, combine_topk_swa_indices_reference
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sparse_mla import c128_topk_metadata_reference
from warmreg_deepseek_v4.swa_indices import DecodeSwaIndices, decode_swa_indices_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
WINDOW = 16  # small window: narrow rows in the interpreter (the kernels take it at runtime / per instance)
PAGE = 8  # SWA page size in the tests (64 in deployments)


class Step(NamedTuple):
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    is_valid: torch.Tensor  # bool [T]
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    replay_start: torch.Tensor  # int32 [R]
    num_decode_tokens: int


def _step(seed: int, *, decodes: int, prefills: int, max_model_len: int = 2000, replay: bool = False) -> Step:
    """A decode-first step: one-token decode requests, then prefill chunks of 1-9 tokens.

    One decode request is at ``max_model_len``; ~1 token in 5 is padding; with ``replay`` some
    requests start their SWA replay inside the window.
    """
    rng = random.Random(seed)
    qlens = [1] * decodes + [rng.randint(1, 9) for _ in range(prefills)]
    seqs = [rng.choice([q, rng.randint(q, 64), rng.randint(q, max_model_len)]) for q in qlens]
    if decodes:
        seqs[0] = max_model_len
    positions = [s - q + i for s, q in zip(seqs, qlens) for i in range(q)]
    reqs = [r for r, q in enumerate(qlens) for _ in range(q)]
    replay_start = [
        max(0, s - q - rng.randint(0, WINDOW)) if replay and rng.random() < 0.5 else 0 for s, q in zip(seqs, qlens)
    ]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    return Step(
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(reqs, dtype=torch.int32),
        torch.tensor([rng.random() > 0.2 for _ in positions], dtype=torch.bool),
        torch.tensor(seqs, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(replay_start, dtype=torch.int32),
        decodes,
    )


def _block_table(seed: int, reqs: int, width: int) -> torch.Tensor:
    return torch.randint(
        0, 5000, (max(reqs, 1), width), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)
    )


# -- decode SWA indices ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decodes", "offset", "index_width", "image", "replay"),
    [
        (7, 0, WINDOW, False, False),  # causal decode rows
        (1, 0, WINDOW, False, True),  # T = 1, bounded replay
        (9, 2, WINDOW, False, True),  # token_offset: a slice of the step
        (5, 0, WINDOW + 24, True, False),  # image spans widen the window; non-pow2 row width
    ],
)
def test_decode_swa_indices_match_reference(
    decodes: int, offset: int, index_width: int, image: bool, replay: bool
) -> None:
    s = _step(decodes, decodes=decodes, prefills=0, replay=replay)
    block_table = _block_table(decodes, s.seq_lens.shape[0], triton.cdiv(2000 + 8, PAGE))  # + right visibility
    gen = torch.Generator().manual_seed(5)
    n = decodes - offset
    kw: dict[str, Any] = dict(
        num_tokens=n, window_size=WINDOW, index_width=index_width, block_size=PAGE, token_offset=offset
    )
    if image:
        kw["left_visible"] = torch.randint(0, 2 * WINDOW, (decodes,), generator=gen, dtype=torch.int32)
        kw["right_visible"] = torch.randint(0, 8, (decodes,), generator=gen, dtype=torch.int32)
    args = (s.positions, s.token_to_req, s.is_valid, block_table, s.replay_start)
    got = DecodeSwaIndices()(*args, **kw)
    want = decode_swa_indices_reference(*args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (n, index_width)


def test_decode_swa_indices_empty_and_bad_inputs() -> None:
    s = _step(0, decodes=3, prefills=0)
    kernel, bt = DecodeSwaIndices(), _block_table(0, 3, 300)
    args = (s.positions, s.token_to_req, s.is_valid, bt, s.replay_start)
    out, lens = kernel(*args, num_tokens=0, window_size=WINDOW, index_width=WINDOW, block_size=PAGE)
    assert out.shape == (0, WINDOW) and lens.shape == (0,)
    with pytest.raises(warmreg.LaunchError, match="cover"):
        kernel(*args, num_tokens=4, window_size=WINDOW, index_width=WINDOW, block_size=PAGE)
    with pytest.raises(warmreg.LaunchError, match="both"):
        kernel(
            *args, num_tokens=3, window_size=WINDOW, index_width=WINDOW, block_size=PAGE, left_visible=s.token_to_req
        )


# -- combine top-k + SWA indices ---------------------------------------------------------------------
def _gather_lens(s: Step, reqs: slice) -> torch.Tensor:
    """As :class:`SparseSWAPrefillMetadata` computes it: ``qlen + min(max(prefix - replay_start, 0), window - 1)`` per prefill request."""
    qlen = (s.query_start_loc[1:] - s.query_start_loc[:-1])[reqs]
    prefix = s.seq_lens[reqs] - qlen
    visible = (prefix - s.replay_start[reqs]).clamp(min=0)
    return (qlen + visible.clamp(max=WINDOW - 1)).to(torch.int32)


def _c4_topk(seed: int, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Indexer-like top-k: ``min((pos + 1) // 4, topk)`` distinct local indices, then -1."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in positions.tolist():
        n = (p + 1) // 4
        pick = torch.randperm(max(n, 1), generator=gen)[: min(n, topk)]
        rows.append(torch.cat([pick, torch.full((topk - pick.numel(),), -1)]))
    return torch.stack(rows).to(torch.int32) if rows else torch.empty(0, topk, dtype=torch.int32)


@pytest.mark.parametrize(
    ("ratio", "topk", "prefills", "skip", "replay"),
    [
        (4, 24, 4, 1, False),  # C4: the indexer's top-k; the chunk starts at request 1 (offset views)
        (128, 128, 3, 0, True),  # C128: the C128A prefill_local rows of width W; bounded replay
        (1, 0, 3, 2, True),  # SWA-only: no top-k (None)
        (4, 24, 1, 0, False),  # one request of one token or more
    ],
)
@pytest.mark.parametrize("max_tile", [None, 32], ids=["one_tile", "tiles_of_32"])
def test_combine_matches_reference(
    ratio: int, topk: int, prefills: int, skip: int, replay: bool, max_tile: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact against the reference; with tiles of 32 columns every row (128 or 256) takes 4 or 8 loop steps, the
    top-k and the window crossing tile boundaries (a C128 row at a 1M context is 9 steps of 1,024)."""
    if max_tile is not None:
        monkeypatch.setattr(combine_indices, "_MAX_TILE", max_tile)
    s = _step(
        ratio + prefills,
        decodes=0,
        prefills=prefills + skip,
        max_model_len=40_000 if ratio == 128 else 2000,
        replay=replay,
    )
    reqs = slice(skip, skip + prefills)
    qsl, seq = s.query_start_loc[skip : skip + prefills + 1], s.seq_lens[reqs]  # not rebased: the kernel rebases
    tokens = slice(int(qsl[0]), int(qsl[-1]))
    gather = _gather_lens(s, reqs)
    n_rows = int((seq // max(ratio, 1)).max()) if ratio > 1 else 0
    M = n_rows + int(gather.max())
    if ratio == 4:
        topk_indices = _c4_topk(prefills, s.positions[tokens], topk)
    elif ratio == 128:
        topk_indices = c128_topk_metadata_reference(
            s.positions[tokens], s.token_to_req[tokens], torch.zeros(1, 1, dtype=torch.int32), s.positions[tokens],
            num_decode_tokens=0, max_compressed_tokens=topk, block_size=2,
        )[2]  # fmt: skip
    else:
        topk_indices = None
    kw: dict[str, Any] = dict(num_tokens=tokens.stop - tokens.start, compress_ratio=ratio, M=M, N=n_rows)
    op = CombineTopkSwaIndices(window_size=WINDOW, workers=3)
    got = op(topk_indices, qsl, seq, gather, **kw)
    want = combine_topk_swa_indices_reference(topk_indices, qsl, seq, gather, **kw, window_size=WINDOW)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape[1] == triton.cdiv(topk + WINDOW, 128) * 128
    key = op.dispatch(top_k=topk, compress_ratio=ratio, image_width=0)
    assert key.tile == min(triton.next_power_of_2(key.width), max_tile or 1024)
    assert (key.width > key.tile) == (max_tile is not None)
    # every SWA column points into the request's gathered rows [N, N + gather_len)
    req_of_row = torch.repeat_interleave(torch.arange(prefills), (qsl[1:] - qsl[:-1]).long())
    rows = got[0].long() - (M * req_of_row)[:, None]
    topk_len = torch.clamp((s.positions[tokens] + 1) // max(ratio, 1), max=topk)
    swa_cols = (torch.arange(got[0].shape[1]) >= topk_len[:, None]) & (got[0] >= 0)
    assert torch.all((rows >= n_rows) | ~swa_cols) and torch.all(
        (rows < n_rows + gather[req_of_row][:, None]) | ~swa_cols
    )


def test_combine_empty_chunk_and_bad_inputs() -> None:
    kernel = CombineTopkSwaIndices(window_size=WINDOW, workers=2)
    qsl, one = torch.tensor([3, 3], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    out, lens = kernel(None, qsl, one, one, num_tokens=0, compress_ratio=1, M=8, N=0)
    assert out.shape == (0, 128) and lens.shape == (0,)
    with pytest.raises(warmreg.LaunchError, match="rows"):
        kernel(torch.zeros(2, 8, dtype=torch.int32), qsl, one, one, num_tokens=4, compress_ratio=4, M=8, N=0)
    with pytest.raises(warmreg.LaunchError, match="int32"):
        kernel(None, qsl.long(), one, one, num_tokens=0, compress_ratio=1, M=8, N=0)


# -- registration, coverage, warm --------------------------------------------------------------------
def _Plugin() -> RegisterPlugin:
    """Registers only this module's kernels."""
    return RegisterPlugin(swa_indices.register, combine_indices.register, model=DSV4.from_config)


_config = example_config
#: FlashInfer's DeepSeek-V4 backend with a cache it takes on SM10x (per-tensor FP8 rows)
FLASHINFER = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_runtime_batches_hit_warmed_keys(example: str) -> None:
    """Realistic steps dispatch to keys of the cuda:90 plan (combine: FlashMLA deployments only)."""
    config = _config(example)
    plan = warmreg.plan(config, target="cuda:90", plugins=[_Plugin()], entry_points=False)
    model = DSV4.from_config(warmreg.WarmConfig.load(config))
    max_len = config["serving"]["max_model_len"]
    swa = plan.kernel(DecodeSwaIndices.name)
    assert (
        swa.kernel.dispatch(
            window_size=model.sliding_window, index_width=model.sliding_window, block_size=64, has_image=False
        )
        in swa.keys
    )
    if config["serving"]["attention_backend"] != "FLASHMLA_SPARSE_DSV4":
        assert CombineTopkSwaIndices.name not in {k.name for k in plan.kernels}
        return
    combine = plan.kernel(CombineTopkSwaIndices.name)
    rng = random.Random(1)
    for ratio in sorted(set(model.ratios)):
        for _ in range(20):
            # the launcher's top_k is the width of the top-k it is handed: index_topk, the step's C128 width, or 0
            width = c128_active_width(rng.choice([1, rng.randint(1, max_len), max_len]), max_len)
            top_k = {1: 0, 4: model.index_topk, 128: width}[ratio]
            assert combine.kernel.dispatch(top_k=top_k, compress_ratio=ratio, image_width=0) in combine.keys


def test_registration_follows_backend_and_platform() -> None:
    def names(config: dict[str, Any], target: str) -> set[str]:
        return {k.name for k in warmreg.plan(config, target=target, plugins=[_Plugin()], entry_points=False).kernels}

    assert names(_config("deepseek_v4_flash"), "cuda:90") == {DecodeSwaIndices.name, CombineTopkSwaIndices.name}
    # FlashInfer: no combine
    assert names(_config("deepseek_v4_pro", **FLASHINFER), "cuda:100") == {DecodeSwaIndices.name}
    assert names(_config("deepseek_v4_flash"), "rocm:gfx950") == set()


def test_warm_cross_compiles_for_cuda_90() -> None:
    # 128K context: 4 C128 widths, so combine has 1 + 1 + 4 keys, plus one decode-SWA key
    config = _config("deepseek_v4_flash", max_model_len=131072)
    report = warmreg.warm(
        config, target="cuda:90", plugins=[_Plugin()], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 7


def test_combine_clamps_a_bounded_replay_to_the_gathered_rows() -> None:
    """A bounded SWA replay that starts after ``pos - (window - 1)``: the window starts at the first
    gathered row. vLLM 0.33's ``combine_topk_swa_indices`` keeps the plain window start there, so its
    first SWA columns index workspace rows before the request's gathered ones (never written)."""
    seq, qlen, gather = 300, 12, 14  # replay kept 2 prefix tokens: gather_start 286 > pos - (WINDOW - 1) <= 284
    qsl, seqs, gathers = (torch.tensor(v, dtype=torch.int32) for v in ([0, qlen], [seq], [gather]))
    kw: dict[str, Any] = dict(num_tokens=qlen, compress_ratio=1, M=gather, N=0)
    got_idx, got_len = CombineTopkSwaIndices(window_size=WINDOW, workers=1)(None, qsl, seqs, gathers, **kw)
    want_idx, want_len = combine_topk_swa_indices_reference(None, qsl, seqs, gathers, **kw, window_size=WINDOW)
    assert torch.equal(got_idx, want_idx) and torch.equal(got_len, want_len)
    gather_start = seq - gather
    for i in range(qlen):
        pos = seq - qlen + i
        assert pos - (WINDOW - 1) < gather_start  # the case: the plain window starts before the gathered rows
        assert int(got_len[i]) == pos - gather_start + 1 < min(pos + 1, WINDOW)  # clamped, not the full window
        row = got_idx[i, : int(got_len[i])]
        assert int(row[0]) == 0 and torch.equal(row, torch.arange(int(got_len[i]), dtype=torch.int32))


def test_combine_reads_in_image_visibility() -> None:
    """A vision batch: rows widened by ``image_width``; tokens inside an image span (prefilled whole, in this
    chunk) see ``left`` tokens back past the window and ``right`` tokens ahead, as vLLM 0.33's
    ``combine_topk_swa_indices`` does with ``left_visible`` / ``right_visible``."""
    image, ctx, qlen = 40, 10, 36  # one request: a span over positions 12..43, wider than the window
    seq = ctx + qlen
    gather = qlen + min(ctx, WINDOW - 1)
    qsl, seqs, gathers = (torch.tensor(v, dtype=torch.int32) for v in ([0, qlen], [seq], [gather]))
    pos = torch.arange(ctx, seq)
    inside = (pos >= 12) & (pos <= 43)
    left = torch.where(inside, (pos - 12).clamp(max=image - 1), 0).to(torch.int32)
    right = torch.where(inside, (43 - pos).clamp(max=image), 0).to(torch.int32)
    kw: dict[str, Any] = dict(num_tokens=qlen, compress_ratio=1, M=gather, N=0, image_width=image)
    kernel = CombineTopkSwaIndices(window_size=WINDOW, workers=2)
    got = kernel(None, qsl, seqs, gathers, **kw, left_visible=left, right_visible=right)
    want = combine_topk_swa_indices_reference(
        None, qsl, seqs, gathers, **kw, window_size=WINDOW, left_visible=left, right_visible=right
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape[1] == triton.cdiv(WINDOW + image, 128) * 128
    plain = kernel(None, qsl, seqs, gathers, **kw)
    assert torch.equal(plain[1][~inside], got[1][~inside]) and bool((got[1][inside] > plain[1][inside]).all())
    with pytest.raises(warmreg.LaunchError, match="together"):
        kernel(None, qsl, seqs, gathers, **kw, left_visible=left)


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def _swa_indices_call() -> OpCall:
    s = _step(7, decodes=7, prefills=0, replay=True)
    block_table = _block_table(7, s.seq_lens.shape[0], triton.cdiv(2000 + 1, PAGE))
    args = (s.positions, s.token_to_req, s.is_valid, block_table, s.replay_start)
    kw = dict(num_tokens=6, window_size=WINDOW, index_width=WINDOW, block_size=PAGE, token_offset=1)
    return OpCall(DecodeSwaIndices(), args, kw)


def _combine_indices_call() -> OpCall:
    s = _step(8, decodes=0, prefills=4)
    gather = _gather_lens(s, slice(0, 4))
    n_rows = int((s.seq_lens // 4).max())
    args = (_c4_topk(4, s.positions, 24), s.query_start_loc, s.seq_lens, gather)
    kw = dict(num_tokens=s.positions.shape[0], compress_ratio=4, M=n_rows + int(gather.max()), N=n_rows)
    return OpCall(CombineTopkSwaIndices(window_size=WINDOW, workers=2), args, kw)


@pytest.mark.parametrize("build", [_swa_indices_call, _combine_indices_call], ids=["swa_indices", "combine_indices"])
def test_out(build: Callable[[], OpCall]) -> None:
    check_out(build, tuple_error=r"out must be a tuple of \d buffers")
