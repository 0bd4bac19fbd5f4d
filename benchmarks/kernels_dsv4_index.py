"""DeepSeek-V4 index/metadata kernels against their PyTorch references at DeepSeek-V4-Flash serving sizes:
exact check, kernel / eager reference / torch.compile'd reference times (do_bench), speedup, bytes and GB/s
next to the device's copy bandwidth, and the JIT monitor's runtime misses after warm().

    python benchmarks/kernels_dsv4_index.py [--tag h200]         # on the GPU, from the repo root
    python benchmarks/kernels_dsv4_index.py --device cpu --small  # dry run through Triton's interpreter

Not covered: FlashInfer mixed indices (flashinfer_indices.py) need sm100; they are not registered on sm90.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write
from warmreg_deepseek_v4 import combine_indices as ci
from warmreg_deepseek_v4 import dspark_swa_indices as ds
from warmreg_deepseek_v4 import global_topk as gt
from warmreg_deepseek_v4 import metadata as md
from warmreg_deepseek_v4 import pack_seq as ps
from warmreg_deepseek_v4 import sparse_mla as sm
from warmreg_deepseek_v4 import swa_indices as si
from warmreg_deepseek_v4 import unpack_seq as us

import warmreg
from warmreg.ops import slot_mapping as sl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/deepseek_v4_flash.json"
#: Also warmed: the DSpark draft step's kernels are planned by the Flash-0731 example only.
DSPARK_CONFIG = "examples/deepseek_v4_flash_0731_dspark.json"
DSPARK_N = 5  # its draft tokens a request (dspark_block_size)
I32, I64 = torch.int32, torch.int64
PAGES = 100_000  # page ids in block tables: any value is valid, the kernels never dereference pages
LOOP = "not compiled: Python loop over requests/tokens with host syncs (int()/.tolist()), Dynamo would graph-break per iteration"


@dataclass
class Case:
    kernel: Callable[..., Any]
    ref: Callable[..., Any]
    kargs: tuple
    kkw: dict
    nbytes: int
    shape: dict
    rargs: tuple | None = None  # the reference's own arguments (else the kernel's, with rkw added)
    rkw: dict = field(default_factory=dict)
    compare: Callable[[Any], Any] | None = None  # what of an output is compared (default: all of it)


def _to(x: Any, dev: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, tuple):
        return tuple(_to(v, dev) for v in x)
    return {k: _to(v, dev) for k, v in x.items()} if isinstance(x, dict) else x


def _equal(got: Any, want: Any) -> bool:
    g, w = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return len(g) == len(w) and all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu()) for a, b in zip(g, w))


def _distinct(req: torch.Tensor, col: torch.Tensor) -> int:
    """Distinct (request, table column) pairs: block-table entries a launch must read at least once."""
    return int(torch.unique(req.long() * 2**32 + col.long()).numel())


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


# -- realistic decode-first steps ------------------------------------------------------------------
def _step(S: Any, rng: random.Random, T: int, *, decode_tokens: int | None = None) -> SimpleNamespace:
    """T tokens: decode requests of 1 + num_speculative_tokens tokens (the first at max_model_len), then
    prefill chunks of <= 2048 tokens with random contexts. Mixed steps (T > a full decode batch) keep 128
    decode requests, so requests stay <= max_num_seqs."""
    if decode_tokens is None:
        decode_tokens = T if T <= S.max_decode_tokens else S.max_decode_tokens // 2
    nd = decode_tokens
    qlens = [S.spec] * (nd // S.spec) + [1] * (nd % S.spec)
    ndr = len(qlens)
    qlens += [min(2048, T - nd - i) for i in range(0, T - nd, 2048)]
    seqs = [rng.randint(q, S.mml) for q in qlens[:ndr]] + [rng.randint(0, S.mml - q) + q for q in qlens[ndr:]]
    if ndr:
        seqs[0] = S.mml
    qsl = torch.tensor([0, *qlens], dtype=I64).cumsum(0).to(I32)
    return SimpleNamespace(
        qlens=qlens, seqs=seqs, nd=nd, R=len(qlens), qsl=qsl, seq_lens=torch.tensor(seqs, dtype=I32),
        positions=torch.tensor([s - q + i for s, q in zip(seqs, qlens) for i in range(q)], dtype=I64),
        token_to_req=torch.tensor([r for r, q in enumerate(qlens) for _ in range(q)], dtype=I32),
    )  # fmt: skip


def _pages(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, PAGES, shape, dtype=I32, generator=gen)


def _slots(gen: torch.Generator, n: int) -> torch.Tensor:
    """Uncompressed slots, about 1 in 10 PAD (-1: padding or replay)."""
    return torch.where(torch.rand(n, generator=gen) < 0.1, -1, torch.randint(0, 10**7, (n,), generator=gen))


def _local_topk(gen: torch.Generator, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Indexer-like C4 top-k: min((pos + 1) // 4, topk) local indices below (pos + 1) // 4, then -1."""
    n = (positions + 1) // 4
    vals = (torch.rand(positions.shape[0], topk, generator=gen) * n[:, None]).long()
    return torch.where(torch.arange(topk)[None, :] < n.clamp(max=topk)[:, None], vals, -1).to(I32)


# -- one builder per kernel: inputs at size T, and the bytes the kernel must read and write ---------
def c128a(S, rng, gen, T):
    st = _step(S, rng, T)
    W, nd = sm.c128_active_width(max(st.seqs), S.mml), st.nd
    table = _pages(gen, (S.max_seqs, triton.cdiv(S.mml // 128, 2)))  # 2 C128 entries per 256-token page
    n = ((st.positions + 1) // 128).clamp(max=W)
    # reads positions 8T, token_to_req + slot_mapping 12 nd, table 4 ceil(n/2) per decode row;
    # writes global_decode 4 nd W, decode_lens 4 nd, prefill_local 4 (T - nd) W
    nbytes = 8 * T + 16 * nd + 4 * int(((n[:nd] + 1) // 2).sum()) + 4 * T * W
    kw = dict(num_decode_tokens=nd, max_compressed_tokens=W, block_size=2)
    args = (st.positions, st.token_to_req, table, _slots(gen, T))
    return Case(sm.C128ATopkMetadata(), sm.c128_topk_metadata_reference, args, kw, nbytes, dict(T=T, decode_tokens=nd, W=W))


def global_topk(S, rng, gen, T):
    st = _step(S, rng, T)
    topk = _local_topk(gen, st.positions, S.topk)
    ok = topk >= 0
    req = st.token_to_req[:, None].expand_as(topk)
    # reads topk 4TK, token_to_req 4T, is_valid T, distinct table entries 4 each; writes out 4TK, lens 4T
    nbytes = 8 * T * S.topk + 9 * T + 4 * _distinct(req[ok], topk[ok] // 64)
    args = (topk, st.token_to_req, _pages(gen, (S.max_seqs, triton.cdiv(S.mml, S.block))), _slots(gen, T) >= 0)
    return Case(gt.GlobalTopkIndices(), gt.global_topk_indices_reference, args, dict(block_size=64), nbytes, dict(T=T, topk=S.topk))


def decode_swa(S, rng, gen, T):
    st = _step(S, rng, T)  # T <= a full decode batch: decode tokens only
    valid = _slots(gen, T) >= 0
    start = (st.positions - (S.window - 1)).clamp(min=0)
    span = torch.where(valid, st.positions // 64 - start // 64 + 1, 0)
    # reads positions 8T, token_to_req 4T, is_valid T, replay_start 4T, the SWA pages each row spans 4 each;
    # writes swa_indices 4 T window, swa_lens 4T
    nbytes = 21 * T + 4 * int(span.sum()) + 4 * T * S.window
    table = _pages(gen, (S.max_seqs, triton.cdiv(S.mml, 64)))
    args = (st.positions, st.token_to_req, valid, table, torch.zeros(st.R, dtype=I32))
    kw = dict(num_tokens=T, window_size=S.window, index_width=S.window, block_size=64)
    return Case(si.DecodeSwaIndices(), si.decode_swa_indices_reference, args, kw, nbytes, dict(T=T, requests=st.R))


def combine(S, rng, gen, T):
    st = _step(S, rng, T, decode_tokens=0)  # one FlashMLA prefill chunk, C4 layers (top-k = index_topk)
    qlen = torch.tensor(st.qlens, dtype=I32)
    gather = (qlen + (st.seq_lens - qlen).clamp(min=0, max=S.window - 1)).to(I32)  # §12, no replay
    N, topk = int((st.seq_lens // 4).max()), _local_topk(gen, st.positions, S.topk)
    width = triton.cdiv(S.topk + S.window, 128) * 128
    # reads qsl/seq_lens/gather_lens 12n + 4, topk entries below topk_len 4 each; writes out 4 T width, lens 4T
    nbytes = 12 * st.R + 4 + 4 * int((topk >= 0).sum()) + 4 * T * width + 4 * T
    kw = dict(num_tokens=T, compress_ratio=4, M=N + int(gather.max()), N=N)
    return Case(ci.CombineTopkSwaIndices(window_size=S.window), ci.combine_topk_swa_indices_reference,
                (topk, st.qsl, st.seq_lens, gather), kw, nbytes, dict(T=T, requests=st.R, width=width),
                rkw=dict(window_size=S.window))  # fmt: skip


def swa_prefill(S, rng, gen, P):
    decodes = min(64, S.max_seqs - P)
    qlens = [S.spec] * decodes + [rng.randint(1, max(1, (S.max_tokens - S.spec * decodes) // P)) for _ in range(P)]
    seqs = torch.tensor([rng.randint(q, S.mml) for q in qlens], dtype=I32)
    qsl = torch.tensor([0, *qlens], dtype=I64).cumsum(0).to(I32)
    nbytes = 4 * (P + 1) + 12 * P  # reads query_start_loc 4(P+1), seq_lens + replay_start 8P; writes gather_lens 4P
    kw = dict(num_decodes=decodes, num_prefills=P, window_size=S.window)
    return Case(md.SparseSWAPrefillMetadata(), md.sparse_swa_prefill_metadata_reference,
                (seqs, qsl, torch.zeros(len(qlens), dtype=I32)), kw, nbytes, dict(prefills=P, decodes=decodes))  # fmt: skip


def indexer_chunk(S, rng, gen, T):
    st = _step(S, rng, T, decode_tokens=0)  # one C4-indexer prefill chunk
    cu = torch.cat([torch.zeros(1, dtype=I64), (st.seq_lens // 4).long().cumsum(0)]).to(I32)
    rows = int(cu[-1])
    nbytes = 8 * (st.R + 1) + 4 * st.R + 4 * rows + 8 * T  # reads qsl, cu, seq_lens; writes token_to_seq 4 rows, ks/ke 8T
    kw = dict(num_compressed_rows=rows, query_slice_start=0, query_slice_stop=T, compress_ratio=4)
    return Case(md.IndexerPrefillChunkMetadata(compress_ratios=(4,)), md.indexer_prefill_chunk_metadata_reference,
                (st.qsl, st.seq_lens, cu), kw, nbytes, dict(T=T, requests=st.R, compressed_rows=rows))  # fmt: skip


def uniform_decode(S, rng, gen, T):
    D = S.spec if T > 1 else 1
    R, EW = T // D, sl.block_table_width(S.mml, S.block)
    seqs = torch.tensor([S.mml] + [rng.randint(1, S.mml) for _ in range(R - 1)], dtype=I32)
    # reads seq_lens 4R and the R table rows once 4 R EW; writes decode_seq_lens + decode_lens 8T, expanded 4 T EW
    nbytes = 4 * R + 4 * R * EW + 8 * T + 4 * T * EW
    return Case(md.PrepareUniformDecode(table_width=EW, max_decode_len=S.spec), md.prepare_uniform_decode_reference,
                (seqs, _pages(gen, (S.max_seqs, EW))), dict(max_decode_len=D), nbytes, dict(T=T, requests=R, D=D, EW=EW))  # fmt: skip


def compressed_slots(S, rng, gen, T):
    st = _step(S, rng, T)  # the C4 caches: 64 compressed states per 256-token block
    slots = _slots(gen, T)
    closes = ((st.positions + 1) % 4 == 0) & (slots != -1)
    # launcher's fill of out with -1 8T; kernel reads qsl/seq_lens 8R + 4, slot_mapping 8T, distinct table
    # entries of the closing tokens 4 each, writes out 8T
    nbytes = 24 * T + 8 * st.R + 4 + 4 * _distinct(st.token_to_req[closes], st.positions[closes] // 256)
    args = (slots, st.qsl, st.seq_lens, _pages(gen, (st.R, sl.block_table_width(S.mml, S.block))))
    return Case(md.CompressedSlotMapping(compress_ratios=(4, 128), cache_block_size=S.block), md.compressed_slot_mapping_reference,
                args, dict(num_tokens=T, block_size=64, compress_ratio=4), nbytes, dict(T=T, requests=st.R))  # fmt: skip


def block_table_slots(S, rng, gen, T):
    st = _step(S, rng, T)  # the SWA KV-cache group (block size 64), a persistent graph-padded slot buffer
    table, pad = _pages(gen, (S.max_seqs, sl.block_table_width(S.mml, 64))), max(S.max_tokens, T)
    # reads qsl 4(R+1), positions 8T, distinct table entries 4 each; writes slot_mapping 8 pad
    nbytes = 4 * (st.R + 1) + 8 * T + 4 * _distinct(st.token_to_req, st.positions // 64) + 8 * pad
    return Case(sl.BlockTableSlotMapping(block_sizes=(64,), max_model_len=S.mml), sl.block_table_slot_mapping_reference,
                (st.qsl, st.positions, table, torch.empty(pad, dtype=I64)), dict(block_size=64), nbytes,
                dict(T=T, requests=st.R, padded_to=pad), rargs=(st.qsl, st.positions, table),
                rkw=dict(block_size=64, max_num_tokens=pad))  # fmt: skip


def _decode_lengths(rng: random.Random, T: int, next_n: int) -> list[int]:
    """A decode batch of T tokens whose rows have unequal lengths in 1..next_n (the padded path)."""
    lens: list[int] = []
    while sum(lens) < T:
        lens.append(min(rng.randint(1, next_n), T - sum(lens)))
    if len(set(lens)) == 1 and T > 1:
        lens = [1, T - 1] if T - 1 <= next_n else [1, *lens[1:], lens[0] - 1] if lens[0] > 1 else lens
    return lens


def pack_q(S, rng, gen, T):
    lens = _decode_lengths(rng, T, S.spec)  # the C4 indexer's padded decode: its FP8 Q, [Td, 64 * 128]
    x = torch.randint(0, 255, (T, 64 * 128), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    lengths = torch.tensor(lens, dtype=I32)
    # reads x 8192 per packed token + lengths, writes out 8192 B Lmax (pads included)
    nbytes = 8192 * T + 4 * len(lens) + 8192 * len(lens) * max(lens)
    valid = torch.arange(max(lens))[None, :] < lengths[:, None]  # the -inf pad's FP8 bytes are the cast's (masked downstream)

    def rows(out: torch.Tensor) -> torch.Tensor:
        return out.view(torch.uint8).cpu()[valid]

    return Case(ps.PackSeq(), ps.pack_seq_reference, (x, lengths), dict(lengths_host=lens), nbytes,
                dict(T=T, rows=len(lens), Lmax=max(lens)), rargs=(x, lengths), compare=rows)  # fmt: skip


def unpack_topk(S, rng, gen, T):
    lens = _decode_lengths(rng, T, S.spec)  # the top-k of the padded rows back to one row a token
    packed = torch.randint(-1, 1 << 20, (len(lens), S.spec, S.topk), generator=gen, dtype=I32)
    nbytes = 8 * T * S.topk + 4 * len(lens)  # reads and writes 4 topk per token
    return Case(us.UnpackSeq(topk=S.topk), us.unpack_seq_reference, (packed, torch.tensor(lens, dtype=I32)),
                dict(lengths_host=lens), nbytes, dict(T=T, rows=len(lens)), rargs=(packed, torch.tensor(lens, dtype=I32)))  # fmt: skip


def dspark_swa(S, rng, gen, T):
    R = max(1, T // DSPARK_N)  # a draft step: N query tokens a request, one shared non-causal window row each
    T = R * DSPARK_N
    seqs = torch.tensor([rng.randint(DSPARK_N, S.mml) for _ in range(R)], dtype=I32)
    qsl = torch.arange(0, T + 1, DSPARK_N, dtype=I32)
    tok2req = torch.arange(R, dtype=I32).repeat_interleave(DSPARK_N)
    valid = _slots(gen, T) >= 0
    width = triton.cdiv(S.window + DSPARK_N, 64) * 64
    # reads qsl/seq_lens 8R, token_to_req + is_valid 5T, the table pages of each row 4 each; writes 4 T W + 4T
    nbytes = 8 * R + 9 * T + 4 * T * triton.cdiv(S.window + DSPARK_N, 64) + 4 * T * width
    kw = dict(num_tokens=T, window_size=S.window, index_width=width, block_size=64)
    args = (qsl, seqs, tok2req, valid, _pages(gen, (S.max_seqs, triton.cdiv(S.mml, 64))))
    return Case(ds.DSparkSwaIndices(), ds.dspark_swa_indices_reference, args, kw, nbytes, dict(T=T, requests=R, W=width))


# name: (builder, sizes, eager-reference cap (T, why) or None, torch.compile: True or why it is skipped)
KERNELS = {
    "deepseek_v4.c128a_topk_metadata": (c128a, "tokens", None, True),
    "deepseek_v4.global_topk_indices": (global_topk, "tokens", None, True),
    "deepseek_v4.decode_swa_indices": (decode_swa, "decode", None, True),
    "deepseek_v4.combine_topk_swa_indices": (combine, "tokens", (1024, "the eager reference loops over every token with host syncs (~1 s/call at T=8192)"), LOOP),
    "deepseek_v4.sparse_swa_prefill_metadata": (swa_prefill, "prefills", None, True),
    "warmreg.ops.indexer_prefill_chunk_metadata": (indexer_chunk, "tokens", None, LOOP),
    "warmreg.ops.prepare_uniform_decode": (uniform_decode, "decode", None, True),
    "warmreg.ops.compressed_slot_mapping": (compressed_slots, "tokens", None, LOOP),
    "warmreg.ops.block_table_slot_mapping": (block_table_slots, "tokens", None, LOOP),
    "deepseek_v4.pack_seq": (pack_q, "decode", None, LOOP),
    "deepseek_v4.unpack_seq": (unpack_topk, "decode", None, LOOP),
    "deepseek_v4.dspark_noncausal_swa_indices": (dspark_swa, "decode", None, LOOP),
}  # fmt: skip


def bench(fn: Callable[[], Any], S: Any) -> tuple[float, int]:
    """(median ms, reps) of an already warmed ``fn``. CUDA: do_bench (L2 flushed before each rep), >= 20 reps;
    CPU dry run: one timed call."""
    S.sync()
    t = time.perf_counter()
    fn()
    S.sync()
    est = (time.perf_counter() - t) * 1e3
    if not S.cuda:
        return est, 1
    if est > S.max_call_ms:
        raise TimeoutError(f"capped: one call took {est:.0f} ms (> {S.max_call_ms:.0f} ms), too slow for >= 20 timed reps")
    times = triton.testing.do_bench(fn, warmup=max(10.0, 2 * est), rep=max(50.0, 30 * est), return_mode="all")
    return statistics.median(times), len(times)


def _on_device(ref: Callable[..., Any], dev: torch.device, args: tuple, kw: dict, ctx: bool) -> Callable[[], Any]:
    """The reference on device tensors; with ctx its factory calls (arange, full, zeros) land on ``dev`` too."""

    def run() -> Any:
        with torch.device(dev) if ctx else contextlib.nullcontext():
            return ref(*args, **kw)

    return run


def run_size(spec: tuple, S: Any, T: int, row: dict) -> None:
    """Check, kernel timing and eager-reference timing at size T; row["_keep"] holds what run_compiled needs."""
    build, _, cap, _ = spec
    case = build(S, random.Random(T), torch.Generator().manual_seed(T), T)
    row.update(case.shape, bytes=case.nbytes)
    rargs, rkw = (case.kargs, {**case.kkw, **case.rkw}) if case.rargs is None else (case.rargs, case.rkw)
    kargs, kkw = _to(case.kargs, S.dev), _to(case.kkw, S.dev)
    try:  # the reference first, on CPU: invalid inputs raise IndexError here instead of faulting on the GPU
        want = case.ref(*rargs, **rkw)
        got = case.kernel(*kargs, **kkw)
        seen = case.compare or (lambda out: out)
        row["check"] = "passed" if _equal(seen(got), seen(want)) else "failed: kernel output differs from the reference (torch.equal)"
    except Exception as exc:
        row["check"], row["traceback"] = f"error: {_err(exc)}", traceback.format_exc()[-1500:]
        return
    try:
        row["kernel_ms"], row["kernel_reps"] = bench(lambda: case.kernel(*kargs, **kkw), S)
        row["GBps"] = case.nbytes / row["kernel_ms"] / 1e6
        row["frac_copy_bw"] = row["GBps"] / S.copy_gbps
    except Exception as exc:
        row["kernel_ms"] = f"error: {_err(exc)}"
    dargs, dkw = _to(rargs, S.dev), _to(rkw, S.dev)
    row["_keep"] = dict(dargs=dargs, dkw=dkw, got=got, ref=case.ref)
    if cap is not None and T > cap[0]:
        row["eager_ref_ms"] = f"capped at T <= {cap[0]}: {cap[1]}"
        return
    if time.perf_counter() > S.deadline:
        row["eager_ref_ms"] = "skipped: run budget spent"
        return
    for ctx in (True, False):  # without the device context if the reference moves data to the host itself
        fn = _on_device(case.ref, S.dev, dargs, dkw, ctx)
        try:
            row["eager_ref_matches"], row["eager_ref_device_ctx"] = _equal(fn(), want), ctx
            break
        except Exception as exc:
            row["eager_ref_ms"] = f"error: {_err(exc)}"
    else:
        return
    try:
        row["eager_ref_ms"], row["eager_ref_reps"] = bench(fn, S)
        if isinstance(row.get("kernel_ms"), float):
            row["speedup_eager"] = row["eager_ref_ms"] / row["kernel_ms"]
    except Exception as exc:
        row["eager_ref_ms"] = str(exc) if isinstance(exc, TimeoutError) else f"error: {_err(exc)}"


def run_compiled(S: Any, rows: list[dict], kept: list[dict | None]) -> None:
    """torch.compile of the reference, size by size (recompiles included); stops after a first compile
    over 20 s, at the first error, or when less than 12 s of the run budget is left."""
    stop, compiled = None, None
    for i, (row, keep) in enumerate(zip(rows, kept)):
        if stop or not keep or S.deadline - time.perf_counter() < 12:
            stop = stop or ("not compiled: run budget spent" if keep else None)
            row["compiled_ref_ms"] = stop or "not compiled: no inputs (the check errored)"
            continue
        try:
            compiled = compiled or torch.compile(keep["ref"])
            fn = _on_device(compiled, S.dev, keep["dargs"], keep["dkw"], True)
            t = time.perf_counter()
            out = fn()
            S.sync()
            row["compile_s"] = time.perf_counter() - t  # first call at this size: (re)compile + one run
            row["compiled_ref_matches_kernel"] = _equal(out, keep["got"])
            row["compiled_ref_ms"], row["compiled_ref_reps"] = bench(fn, S)
            if isinstance(row.get("kernel_ms"), float):
                row["speedup_compiled"] = row["compiled_ref_ms"] / row["kernel_ms"]
            if i == 0 and row["compile_s"] > 20:
                stop = f"not compiled: the first compile took {row['compile_s']:.0f} s (> 20 s)"
        except Exception as exc:
            row["compiled_ref_ms"] = stop = f"not compiled: {_err(exc)}"


def _copy_bandwidth(S: Any, size: int) -> dict[str, Any]:
    """``dst.copy_(src)`` of a ``size``-byte uint8 tensor; bytes = 2 x size (read + write)."""
    src, dst = torch.randint(0, 255, (size,), dtype=torch.uint8, device=S.dev), torch.empty(size, dtype=torch.uint8, device=S.dev)
    dst.copy_(src)
    ms, reps = bench(lambda: dst.copy_(src), S)
    return {"bytes": 2 * size, "ms": ms, "reps": reps, "GBps": 2 * size / ms / 1e6}


def _inductor_startup(S: Any) -> float | str:
    """Inductor's one-time start-up (a trivial compile), so that it is not charged to the first reference."""
    if S.deadline - time.perf_counter() < 20:
        return "skipped: run budget spent"
    try:
        t = time.perf_counter()
        with torch.device(S.dev):
            torch.compile(lambda x: (x * 2).sum())(torch.arange(8.0))
        S.sync()
        return time.perf_counter() - t
    except Exception as exc:
        return f"error: {_err(exc)}"


def _process_age() -> float:
    """Seconds since this process started (Linux /proc), so that the run budget counts the imports too."""
    try:
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


def settings(dev: torch.device, small: bool, budget_s: float, t0: float) -> tuple[Any, dict[str, list[int]]]:
    """Serving sizes from the example config (shrunk with --small) and the sizes each kernel runs at."""
    data = json.loads((ROOT / CONFIG).read_text())
    srv, model, spec = data["serving"], data["model"], 1 + int(data["serving"].get("num_speculative_tokens", 0))
    S = SimpleNamespace(
        dev=dev, cuda=dev.type == "cuda", deadline=t0 + budget_s, max_call_ms=150.0, copy_gbps=float("nan"), spec=spec,
        sync=torch.cuda.synchronize if dev.type == "cuda" else (lambda: None), topk=model["index_topk"],
        window=model["sliding_window"], block=srv["block_size"], mml=srv["max_model_len"], max_seqs=srv["max_num_seqs"],
        max_tokens=srv["max_num_batched_tokens"],
    )  # fmt: skip
    if small:
        S.mml, S.max_seqs, S.max_tokens, S.max_decode_tokens = 4096, 8, 32, 8 * spec
        return S, {"tokens": [1, 16], "prefills": [1, 4], "decode": [1, 16]}
    S.max_decode_tokens = S.max_seqs * spec  # decode tokens of a full decode batch (512 for V4-Flash)
    return S, {"tokens": [1, 64, 1024, 8192], "prefills": [1, 16, S.max_seqs], "decode": [1, 64, S.max_decode_tokens]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shapes (dry run; CPU tensors go through Triton's interpreter)")
    ap.add_argument("--tag", default=None, help='results name suffix (default "h200"; "cpu_dryrun" on cpu)')
    ap.add_argument("--budget-s", type=float, default=80.0, help="no new reference timing or compile start this many seconds after the process started")
    args = ap.parse_args()
    t0 = time.perf_counter() - _process_age()
    S, sizes = settings(torch.device(args.device), args.small, args.budget_s, t0)
    out: dict[str, Any] = {"config": CONFIG, "device": args.device, "small": args.small, "sizes": sizes}
    out["serving_sizes"] = dict(max_model_len=S.mml, max_num_seqs=S.max_seqs, max_num_batched_tokens=S.max_tokens,
                                index_topk=S.topk, sliding_window=S.window, decode_tokens_per_request=S.spec)  # fmt: skip
    out["not_covered"] = {"FlashInfer mixed indices (flashinfer_indices.py)": "need sm100; not registered on the H200 (sm90)"}
    mon = None
    if S.cuda:
        t = time.perf_counter()
        warmreg.warm(str(ROOT / DSPARK_CONFIG), on_error="continue")
        report = warmreg.warm(CONFIG if Path(CONFIG).exists() else str(ROOT / CONFIG), monitor="record", on_error="continue")
        out["warm"] = {"wall_s": time.perf_counter() - t, "summary": report.summary(),
                       "failed": [(r.kernel, str(r.key), r.error) for r in report.failed]}  # fmt: skip
        from warmreg.monitoring import current

        mon = current()
    else:
        out["warm"] = "skipped (cpu dry run: the kernels run through Triton's interpreter, nothing compiles)"
    # device copy bandwidth: dst.copy_(src) of a 1 GiB (16 MiB with --small) uint8 tensor; bytes = 2 x size
    out["copy_bandwidth"] = _copy_bandwidth(S, (16 if args.small else 1024) << 20)
    S.copy_gbps = out["copy_bandwidth"]["GBps"]
    out["method"] = {
        "check": "torch.equal of every output against the reference run on CPU copies of the inputs (as the tests do)",
        "timing": "do_bench median of >= 20 reps (reps recorded); L2 flushed before each rep, which hides host launch cost shorter "
        "than the flush" if S.cuda else "cpu dry run: one perf_counter-timed call after a warm call",
        "eager_ref": "reference on device tensors under `with torch.device(dev)` (device_ctx false: without it); speedup = ref_ms / kernel_ms",
        "bytes": "unique bytes the kernel must read and write (formulas in the builders); a random gather costs a 32 B sector",
    }
    results: dict[str, Any] = {}
    for name, kspec in KERNELS.items():
        entry = results[name] = {"torch_compile": "attempted" if kspec[3] is True else kspec[3], "sizes": []}
        if kspec[2]:
            entry["eager_ref_cap"] = f"T <= {kspec[2][0]}: {kspec[2][1]}"
        for T in sizes[kspec[1]]:
            row: dict[str, Any] = {}
            before = len(mon.misses) if mon else 0
            try:
                run_size(kspec, S, T, row)
            except Exception as exc:
                row["error"], row["traceback"] = _err(exc), traceback.format_exc()[-1500:]
            row["new_misses"] = len(mon.misses) - before if mon else None
            entry["sizes"].append(row)
            print(f"{name} {T}: {row.get('check', row.get('error'))} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["inductor_startup_s"] = _inductor_startup(S)
    for name, kspec in KERNELS.items():  # torch.compile last: the core numbers are in even if compiles are slow
        rows = results[name]["sizes"]
        kept = [row.pop("_keep", None) for row in rows]
        if kspec[3] is not True:
            for row in rows:
                row["compiled_ref_ms"] = kspec[3]
            continue
        run_compiled(S, rows, kept)
        print(f"{name} compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["kernels"] = results
    if mon is not None:
        out["misses"] = {"total": len(mon.misses), "per_kernel": dict(Counter(m.kernel or f"<unregistered> {m.jit_name}" for m in mon.misses)),
                         "counters": mon.counters(), "explain": [m.explain() for m in mon.misses[:20]],
                         "note": "a warmreg kernel's miss is a shape outside its declared domains (allowed, reported); "
                                 "<unregistered> ones are torch.compile (inductor) kernels of the compiled references"}  # fmt: skip
    else:
        out["misses"] = "not recorded (cpu dry run: no warm, no monitor)"
    out["wall_s"] = time.perf_counter() - t0
    path = write(f"kernels_dsv4_index_{args.tag or ('h200' if S.cuda else 'cpu_dryrun')}", out)
    _table(results)
    print(f"copy bandwidth {S.copy_gbps:.1f} GB/s; misses: {out['misses'] if mon is None else out['misses']['per_kernel']}")
    print(f"wall {out['wall_s']:.1f} s -> {path}")


def _fmt(v: Any, spec: str = ".4f") -> str:
    return format(v, spec) if isinstance(v, float) else ("-" if v is None else str(v)[:12])


def _table(results: dict) -> None:
    print(f"{'kernel':31} {'size':>5} {'check':6} {'kernel ms':>9} {'eager ms':>12} {'compiled ms':>12} {'x eager':>8} {'x comp':>8} {'GB/s':>8} {'%copy':>6} miss")
    for name, entry in results.items():
        for r in entry["sizes"]:
            frac = r.get("frac_copy_bw")
            print(f"{name.split('.')[-1][:31]:31} {r.get('T', r.get('prefills', '?'))!s:>5} {str(r.get('check', 'error'))[:6]:6} "
                  f"{_fmt(r.get('kernel_ms')):>9} {_fmt(r.get('eager_ref_ms')):>12} {_fmt(r.get('compiled_ref_ms')):>12} "
                  f"{_fmt(r.get('speedup_eager'), '.1f'):>8} {_fmt(r.get('speedup_compiled'), '.1f'):>8} "
                  f"{_fmt(r.get('GBps'), '.1f'):>8} {_fmt(frac * 100 if frac is not None else None, '.2f'):>6} {_fmt(r.get('new_misses'))}")  # fmt: skip


if __name__ == "__main__":
    main()
