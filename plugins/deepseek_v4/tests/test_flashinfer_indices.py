"""FlashInfer mixed sparse indices: exact equality with the PyTorch reference (Triton interpreter
on CPU) for SWA-only, C4 and C128 layers, registration, warm coverage for cuda:100, real cross-compiles."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import triton
from dsv4_support import ModulePlugin, example_config
from warmreg_deepseek_v4.backends import c128_active_width, c128_widths
from warmreg_deepseek_v4.flashinfer_indices import (
    FlashInferMixedSparseIndices,
    flashinfer_mixed_sparse_indices_reference,
    register,
)
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.sparse_mla import c128_topk_metadata_reference
from warmreg_deepseek_v4.swa_indices import decode_swa_indices_reference

import warmreg

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
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
    wide = (torch.cat([args[0], args[0]], dim=1), *args[1:])
    with pytest.raises(warmreg.LaunchError, match="causal"):
        kernel(*wide, **kw)  # DSpark's non-causal rows are not supported yet


# -- registration, coverage, warm --------------------------------------------------------------------
def _Plugin() -> ModulePlugin:
    """Registers only this module's kernels."""
    return ModulePlugin(register)


_config = example_config


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_runtime_batches_hit_warmed_keys(example: str) -> None:
    """Realistic steps of every layer type dispatch to keys of the cuda:100 FlashInfer plan."""
    config = _config(example, attention_backend="FLASHINFER_MLA_SPARSE_DSV4")
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


def test_registration_needs_flashinfer_on_sm100() -> None:
    def names(config: dict[str, Any], target: str) -> set[str]:
        return {k.name for k in warmreg.plan(config, target=target, plugins=[_Plugin()], entry_points=False).kernels}

    assert names(_config("deepseek_v4_pro"), "cuda:100") == {FlashInferMixedSparseIndices.name}
    assert names(_config("deepseek_v4_pro"), "cuda:90") == set()  # the Pro example on Hopper
    assert names(_config("deepseek_v4_flash"), "cuda:100") == set()  # FlashMLA backend


def test_warm_cross_compiles_for_cuda_100() -> None:
    # 32K context: C128 widths 128 and 256, so 1 + 2 + 2 * 2 = 7 keys
    report = warmreg.warm(_config("deepseek_v4_pro", max_model_len=32768), target="cuda:100", plugins=[_Plugin()],
                          entry_points=False, workers=2, on_error="continue")  # fmt: skip
    assert report.ok, [(r.kernel, r.error) for r in report.failed]
    assert report.compiled == 7
