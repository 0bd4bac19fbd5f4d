"""FlashInfer mixed sparse indices: exact equality with the PyTorch reference (Triton interpreter
on CPU) for SWA-only, C4 and C128 layers, registration, warm coverage for cuda:100, real cross-compiles."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import triton
from warmreg_deepseek_v4.backends import c128_active_width, c128_widths
from warmreg_deepseek_v4.dspark import dspark_swa_index_width
from warmreg_deepseek_v4.dspark_swa_indices import dspark_swa_indices_reference
from warmreg_deepseek_v4.flashinfer_indices import (
    FlashInferMixedSparseIndices,
    flashinfer_mixed_sparse_indices_reference,
    register,
)
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sparse_mla import c128_topk_metadata_reference
from warmreg_deepseek_v4.swa_indices import decode_swa_indices_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_allocates_nothing, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
WINDOW = 16  # small window for the interpreter (the kernel instance takes it)
SWA_PAGE, C4_PAGE, C4_TOPK = 8, 8, 24  # small pages and top-k (deployments: 64, 64, 512/1024)
MAX_MODEL_LEN = 40_000  # Wmax = 384: C128 widths 128, 256, 384


class Step(NamedTuple):
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    is_valid: torch.Tensor  # bool [T]
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    num_decode_tokens: int


def _step(seed: int, *, decodes: int, prefills: int) -> Step:
    """Decode-first: one-token decodes (one at max_model_len), then prefill chunks of 1-7 tokens; ~1/5 padding."""
    rng = random.Random(seed)
    qlens = [1] * decodes + [rng.randint(1, 7) for _ in range(prefills)]
    seqs = [rng.choice([q, rng.randint(q, 64), rng.randint(q, MAX_MODEL_LEN)]) for q in qlens]
    if decodes:
        seqs[0] = MAX_MODEL_LEN
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    positions = [s - q + i for s, q in zip(seqs, qlens) for i in range(q)]
    return Step(
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor([r for r, q in enumerate(qlens) for _ in range(q)], dtype=torch.int32),
        torch.tensor([rng.random() > 0.2 for _ in positions], dtype=torch.bool),
        torch.tensor(seqs, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        decodes,
    )


def _table(seed: int, reqs: int, width: int) -> torch.Tensor:
    return torch.randint(
        0, 3000, (max(reqs, 1), width), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)
    )


def _c4_topk(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Indexer-like local top-k: ``min((pos + 1) // 4, C4_TOPK)`` distinct indices, then -1."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in positions.tolist():
        n = (p + 1) // 4
        pick = torch.randperm(max(n, 1), generator=gen)[: min(n, C4_TOPK)]
        rows.append(torch.cat([pick, torch.full((C4_TOPK - pick.numel(),), -1)]))
    return torch.stack(rows).to(torch.int32) if rows else torch.empty(0, C4_TOPK, dtype=torch.int32)


def _layer_inputs(step: Step, ratio: int, *, image: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs the FlashInfer metadata builder hands the kernel for one layer type."""
    T, nd = step.positions.shape[0], step.num_decode_tokens
    reqs = step.seq_lens.shape[0]
    swa_table = _table(1, reqs, triton.cdiv(MAX_MODEL_LEN + 8, SWA_PAGE))
    decode_swa = decode_swa_indices_reference(
        step.positions, step.token_to_req, step.is_valid, swa_table, torch.zeros(reqs, dtype=torch.int32),
        num_tokens=nd, window_size=WINDOW, index_width=WINDOW, block_size=SWA_PAGE,
    )[0]  # fmt: skip
    dc = lens = valid = topk = cbt = None
    cbs, top_k = SWA_PAGE, 0
    if ratio == 4:
        cbs, top_k = C4_PAGE, C4_TOPK
        cbt = _table(2, reqs, triton.cdiv(MAX_MODEL_LEN // 4, C4_PAGE))
        dc, valid = _c4_topk(3, step.positions[:nd]), step.is_valid[:nd]
        topk = _c4_topk(4, step.positions[nd:])
    elif ratio == 128:
        cbs = 2
        cbt = _table(5, reqs, triton.cdiv(MAX_MODEL_LEN // 128, 2))
        top_k = c128_active_width(int(step.seq_lens.max()) if reqs else 1, MAX_MODEL_LEN)
        gd, lens, topk = c128_topk_metadata_reference(
            step.positions, step.token_to_req, cbt, torch.where(step.is_valid, 1, -1),
            num_decode_tokens=nd, max_compressed_tokens=top_k, block_size=2,
        )  # fmt: skip
        dc = gd.squeeze(1)
    kw: dict[str, Any] = dict(
        num_tokens=T, num_decode_tokens=nd, compress_ratio=ratio, top_k=top_k, swa_block_size=SWA_PAGE,
        compressed_block_size=cbs, swa_span=SWA_PAGE + 3, compressed_span=cbs * 2, image_width=image,
    )  # fmt: skip
    if image:
        gen = torch.Generator().manual_seed(6)
        kw["left_visible"] = torch.randint(0, 2 * WINDOW, (T,), generator=gen, dtype=torch.int32)
        kw["right_visible"] = torch.randint(0, 4, (T,), generator=gen, dtype=torch.int32)
    return (
        decode_swa,
        dc,
        lens,
        valid,
        topk,
        step.token_to_req,
        step.seq_lens,
        step.query_start_loc,
        swa_table,
        cbt,
    ), kw


@pytest.mark.parametrize(
    ("ratio", "decodes", "prefills", "image"),
    [
        (1, 4, 3, 0),  # SWA-only, mixed
        (4, 5, 3, 0),  # C4, mixed (local decode indices, padding tokens)
        (4, 6, 0, 0),  # C4, decode-only (top_k -> 0)
        (4, 0, 3, 0),  # C4, prefill-only (0-row decode views keep their width)
        (128, 4, 2, 0),  # C128, mixed
        (128, 5, 0, 0),  # C128, decode-only
        (128, 0, 4, 0),  # C128, prefill-only
        (128, 1, 0, 0),  # T = 1
        (4, 3, 2, 5),  # image columns with left/right visibility
    ],
)
def test_matches_reference(ratio: int, decodes: int, prefills: int, image: int) -> None:
    step = _step(ratio + decodes * 7 + prefills, decodes=decodes, prefills=prefills)
    args, kw = _layer_inputs(step, ratio, image=image)
    got = FlashInferMixedSparseIndices(window_size=WINDOW)(*args, **kw)
    want = flashinfer_mixed_sparse_indices_reference(*args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    top_k = kw["top_k"] if prefills else 0
    dct = args[1].shape[1] if args[1] is not None else 0
    assert got[0].shape == (step.positions.shape[0], WINDOW + image + triton.cdiv(max(top_k, dct), 4) * 4)


def test_persistent_buffers_keep_padding_rows() -> None:
    step = _step(3, decodes=3, prefills=2)
    args, kw = _layer_inputs(step, 4)
    T = step.positions.shape[0]
    indices, lens = torch.full((T + 4, 64), 77, dtype=torch.int32), torch.full((T + 4,), 77, dtype=torch.int32)
    got = FlashInferMixedSparseIndices(window_size=WINDOW)(*args, **kw, out=(indices, lens))
    want = flashinfer_mixed_sparse_indices_reference(*args, **kw)
    assert torch.equal(got[0][:, : want[0].shape[1]], want[0]) and torch.equal(got[1], want[1])
    assert torch.all(indices[T:] == 77) and torch.all(lens[T:] == 77)  # graph-padding rows untouched


def test_empty_batch_and_bad_inputs() -> None:
    kernel = FlashInferMixedSparseIndices(window_size=WINDOW)
    step = _step(0, decodes=0, prefills=0)
    args, kw = _layer_inputs(step, 4)
    indices, lens = kernel(*args, **kw)
    assert indices.shape == (0, WINDOW + C4_TOPK) and lens.shape == (0,)
    step = _step(1, decodes=2, prefills=1)
    args, kw = _layer_inputs(step, 4)
    with pytest.raises(warmreg.LaunchError, match="decode_is_valid_token"):
        kernel(*args[:3], None, *args[4:], **kw)
    narrow = (args[0][:, : WINDOW - 1], *args[1:])
    with pytest.raises(warmreg.LaunchError, match="< window"):
        kernel(*narrow, **kw)


# -- DSpark's non-causal draft rows ---------------------------------------------------------------------
def _draft(
    seed: int, contexts: list[int], qlen: int, ratio: int, *, pads: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A DSpark draft batch (all decode: ``qlen`` tokens a request after ``contexts``) and ``pads`` graph-pad tokens
    of an empty last request, with its non-causal SWA rows and, for C4/C128, the layer's decode inputs."""
    reqs, real = len(contexts), len(contexts) * qlen
    qsl = torch.tensor([i * qlen for i in range(reqs + 1)] + [real], dtype=torch.int32)
    seqs = torch.tensor([c + qlen for c in contexts] + [0], dtype=torch.int32)
    req = torch.cat([torch.arange(reqs).repeat_interleave(qlen), torch.full((pads,), reqs)]).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + qlen) for c in contexts] + [torch.zeros(pads, dtype=torch.int64)])
    valid = torch.ones(real + pads, dtype=torch.bool)
    valid[real:] = False
    rng = random.Random(seed)
    valid[[i for i in range(real) if rng.random() < 0.1]] = False
    width = dspark_swa_index_width(WINDOW, qlen if qlen <= 48 else qlen - 1)
    swa_table = _table(seed, reqs + 1, triton.cdiv(max(seqs.tolist()) + 8, SWA_PAGE))
    T = real + pads
    swa = dspark_swa_indices_reference(
        qsl, seqs, req, valid, swa_table, num_tokens=T, window_size=WINDOW, index_width=width, block_size=SWA_PAGE
    )[0]
    dc = lens = dvalid = cbt = None
    cbs = SWA_PAGE
    if ratio == 4:
        cbs, cbt = C4_PAGE, _table(seed + 1, reqs + 1, triton.cdiv(MAX_MODEL_LEN // 4, C4_PAGE))
        dc, dvalid = _c4_topk(seed, positions), valid
    elif ratio == 128:
        cbs, cbt = 2, _table(seed + 2, reqs + 1, triton.cdiv(MAX_MODEL_LEN // 128, 2))
        gd, lens, _ = c128_topk_metadata_reference(
            positions, req, cbt, torch.where(valid, 1, -1), num_decode_tokens=T, max_compressed_tokens=128, block_size=2
        )
        dc = gd.squeeze(1)
    kw: dict[str, Any] = dict(
        num_tokens=T, num_decode_tokens=T, compress_ratio=ratio, top_k={1: 0, 4: C4_TOPK, 128: 128}[ratio],
        swa_block_size=SWA_PAGE, compressed_block_size=cbs, swa_span=SWA_PAGE + 3, compressed_span=cbs * 2,
    )  # fmt: skip
    return (swa, dc, lens, dvalid, None, req, seqs, qsl, swa_table, cbt), kw


@pytest.mark.parametrize(
    ("ratio", "contexts", "qlen", "pads"),
    [
        (1, [0, 1, 15, 16, 17, 3000], 5, 0),  # the window starts at 0 for short contexts, full beyond 16
        (1, [40, 2], 5, 3),  # graph-pad tokens of an empty request: causal pad rows
        (1, [100, 5], 49, 0),  # 1 + N tokens with (window + N) % 64 == 0: L = 65 > W = 64
        (4, [0, 7, 500], 5, 2),  # C4: the compressed region starts after the spilled block
        (128, [300, 20], 5, 0),  # C128: lens from the C128A metadata
    ],
)
def test_noncausal_draft_rows_match_reference(ratio: int, contexts: list[int], qlen: int, pads: int) -> None:
    args, kw = _draft(len(contexts) + qlen + ratio, contexts, qlen, ratio, pads=pads)
    got = FlashInferMixedSparseIndices(window_size=WINDOW)(*args, **kw)
    want = flashinfer_mixed_sparse_indices_reference(*args, **kw, window_size=WINDOW)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if ratio == 1 and qlen <= 48:  # valid tokens: no -1 inside [0, wlen) or [W, lens), and only there live entries
        for t in range(len(contexts) * qlen):
            row, n = want[0][t], int(want[1][t])
            if args[0][t, 0] >= 0:
                wlen = int((row[:WINDOW] >= 0).sum())
                assert (
                    bool((row[:wlen] >= 0).all()) and bool((row[WINDOW:n] >= 0).all()) and bool((row[n:] == -1).all())
                )


def test_noncausal_rows_keep_the_causal_window_first() -> None:
    """Token q of a block after ``ctx`` context tokens: min(ctx + q + 1, W) entries, then the rest of the block."""
    args, kw = _draft(0, [30], 5, 1)
    idx, lens = FlashInferMixedSparseIndices(window_size=WINDOW)(*args, **kw)
    swa = (args[0].long() // SWA_PAGE) * (SWA_PAGE + 3) + args[0].long() % SWA_PAGE
    for q in range(5):
        assert lens[q] == 16 + 5 and torch.equal(idx[q, :16].long(), swa[q, :16])  # window: the first 16 of L = 21
        assert torch.equal(idx[q, 16:21].long(), swa[q, 16:21]) and bool((idx[q, 21:] == -1).all())


# -- registration, coverage, warm --------------------------------------------------------------------
def _Plugin() -> RegisterPlugin:
    """Registers only this module's kernels."""
    return RegisterPlugin(register, model=DSV4.from_config)


_config = example_config
#: FlashInfer's DeepSeek-V4 backend with a cache it takes on SM10x (per-tensor FP8 rows)
FLASHINFER = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "kv_cache_dtype": "fp8"}


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_runtime_batches_hit_warmed_keys(example: str) -> None:
    """Realistic steps of every layer type dispatch to keys of the cuda:100 FlashInfer plan."""
    config = _config(example, **FLASHINFER)
    plan = warmreg.plan(config, target="cuda:100", plugins=[_Plugin()], entry_points=False)
    kp = plan.kernel(FlashInferMixedSparseIndices.name)
    model = DSV4.from_config(warmreg.WarmConfig.load(config))
    max_len, max_tokens = config["serving"]["max_model_len"], config["serving"]["max_num_batched_tokens"]
    assert len(kp.keys) == 1 + 2 + 2 * len(c128_widths(max_len))  # SWA-only, C4, C128: each with/without prefill
    rng = random.Random(2)
    for _ in range(40):
        nd = rng.randint(0, 256)
        T = rng.choice([nd, rng.randint(nd, max_tokens)])
        width = c128_active_width(rng.choice([1, rng.randint(1, max_len), max_len]), max_len)
        for ratio in sorted(set(model.ratios)):
            # what the launcher computes: DCT from the decode tensor's width, TOP_K 0 without prefill rows
            dct, layer_top_k = {1: (0, 0), 4: (model.index_topk, model.index_topk), 128: (width, width)}[ratio]
            key = kp.kernel.dispatch(
                compress_ratio=ratio, swa_index_width=model.sliding_window, image_width=0,
                decode_compressed_topk=dct, top_k=layer_top_k if T > nd else 0,
            )  # fmt: skip
            assert key in kp.keys, key


def test_dspark_adds_the_draft_layers_noncausal_key() -> None:
    """Flash-0731 + DSpark under FlashInfer: one more key, the SWA-only draft layers' width-192 rows, no prefill."""
    config = _config("deepseek_v4_flash_0731_dspark", **FLASHINFER)
    kp = warmreg.plan(config, target="cuda:100", plugins=[_Plugin()], entry_points=False).kernel(
        FlashInferMixedSparseIndices.name
    )
    widths = c128_widths(config["serving"]["max_model_len"])
    assert len(kp.keys) == 1 + 2 + 2 * len(widths) + 1
    (extra,) = [k for k in kp.keys if k.swa_index_width != 128]
    assert (extra.swa_index_width, extra.compress_ratio, extra.top_k, extra.window_block_size) == (192, 1, 0, 256)
    assert (
        kp.kernel.dispatch(compress_ratio=1, swa_index_width=192, image_width=0, decode_compressed_topk=0, top_k=0)
        == extra
    )


def test_registration_needs_flashinfer_on_sm100() -> None:
    def names(config: dict[str, Any], target: str) -> set[str]:
        return {k.name for k in warmreg.plan(config, target=target, plugins=[_Plugin()], entry_points=False).kernels}

    assert names(_config("deepseek_v4_pro", **FLASHINFER), "cuda:100") == {FlashInferMixedSparseIndices.name}
    assert names(_config("deepseek_v4_pro", **FLASHINFER), "cuda:90") == set()  # Hopper (plugin.py refuses it)
    assert names(_config("deepseek_v4_pro"), "cuda:100") == set()  # FlashMLA backend


def test_warm_cross_compiles_for_cuda_100() -> None:
    # 32K context: C128 widths 128 and 256, so 1 + 2 + 2 * 2 = 7 keys
    config = _config("deepseek_v4_pro", max_model_len=32768, **FLASHINFER)
    report = warmreg.warm(
        config, target="cuda:100", plugins=[_Plugin()], entry_points=False, workers=2, on_error="continue"
    )
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 7


# -- out= (persistent buffers larger than needed: rows past T untouched, tested above) -------------------------
def test_launch_with_out_allocates_nothing() -> None:
    step = _step(3, decodes=3, prefills=2)
    args, kw = _layer_inputs(step, 4)
    T = step.positions.shape[0]
    bufs = (torch.full((T + 4, 64), 77, dtype=torch.int32), torch.full((T + 4,), 77, dtype=torch.int32))
    assert_allocates_nothing(OpCall(FlashInferMixedSparseIndices(window_size=WINDOW), args, kw), bufs)
