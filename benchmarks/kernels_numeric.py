"""Numeric kernels at serving sizes: checked against their references, timed, set against copy bandwidth.

Covers DeepSeek-V4 (Flash config) fp8_ds_mla dequantize-and-gather, save partial states, MTP input and shared-head
RMSNorms, indexer Q RoPE + FP8 quant, indexer KV compress + insert, inverse RoPE + FP8 quant, the shared Q/KV
RMSNorm (DeepSeek-V4 and Kimi-K3 layouts) and the Kimi-K3 KDA recurrent step. Per size: check (tests' tolerances,
FP8 as uint8), kernel / eager reference / torch.compile'd reference times (do_bench median, >= 20 reps), speedup,
bytes (each builder's docstring is its formula), GB/s and fraction of the copy bandwidth. On CUDA both example
configs are warmed first, monitor armed in record mode; misses are reported per kernel.

    python benchmarks/kernels_numeric.py [--tag h200]          # on the GPU, from the repo root
    python benchmarks/kernels_numeric.py --device cpu --small  # dry run through Triton's interpreter
"""

from __future__ import annotations

import argparse
import functools
import inspect
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
from warmreg_deepseek_v4 import DSV4
from warmreg_deepseek_v4.cache import DequantGatherKCache, dequant_gather_k_reference
from warmreg_deepseek_v4.cache_insert import QuantInsertKCache
from warmreg_deepseek_v4.fp8_ds_mla import PagedCache, page_bytes
from warmreg_deepseek_v4.indexer import IndexerKVCompressInsert, IndexerQRopeQuant, indexer_page_stride
from warmreg_deepseek_v4.indexer import indexer_kv_compress_insert_reference as idx_kv_ref
from warmreg_deepseek_v4.indexer import indexer_q_rope_quant_reference as idx_q_ref
from warmreg_deepseek_v4.inv_rope_quant import InvRopeFP8Quant, inv_rope_fp8_quant_reference
from warmreg_deepseek_v4.mtp_norm import MTPInputRMSNorm, MTPSharedHeadRMSNorm, mtp_input_rmsnorm_reference
from warmreg_deepseek_v4.mtp_norm import mtp_shared_head_rmsnorm_reference as mtp_head_ref
from warmreg_deepseek_v4.sparse_mla import compressed_block_size
from warmreg_deepseek_v4.state_cache import SavePartialStates, save_partial_states_reference
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.kda import KDARecurrent, kda_recurrent_reference
from warmreg_kimi_k3.kda_packed_decode import KDAPackedDecode

import warmreg
from warmreg.monitoring import current
from warmreg.ops import FusedQKVRMSNorm, fused_qkv_rmsnorm_reference

ROOT = Path(__file__).resolve().parents[1]
BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8
REF_CAP_MS = 50.0  # an eager reference whose one call takes longer is not timed with do_bench (Python loops)
COMPILE_CAP_S = 20.0  # a torch.compile that took longer is not tried at larger sizes
S = SimpleNamespace(dev=torch.device("cpu"), small=False, compile=True, compile_budget_s=30.0, compile_spent_s=0.0,
                    deadline_s=90.0, t0=time.perf_counter(), copy_gbps=None, rope=None)  # fmt: skip


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync = torch.cuda.synchronize if S.dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t) * 1e3


def bench(fn: Callable[[], Any]) -> tuple[float, int]:
    """(median ms, reps): a warm call, then do_bench (L2 cleared per rep) for >= 20 reps; CPU: one timed call."""
    if S.dev.type != "cuda":
        return timed(fn)[1], 1
    est = timed(fn)[1]
    times = triton.testing.do_bench(fn, warmup=10, rep=max(50.0, 25 * est), return_mode="all")
    return statistics.median(times), len(times)


def over_deadline() -> bool:
    return S.dev.type == "cuda" and time.perf_counter() - S.t0 > S.deadline_s


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:600]


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=S.dev)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def code_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in FP8 codes: the bytes compared as uint8 (as the tests do)."""
    return (a.view(U8).int() - b.view(U8).int()).abs()


def close(pairs: list[tuple[torch.Tensor, torch.Tensor]], atol: float, rtol: float) -> tuple[bool, float, str]:
    msgs = []
    for got, want in pairs:
        try:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        except AssertionError as exc:
            msgs.append(" ".join(str(exc).split("\n")[:3])[:300])
    return not msgs, max(max_abs(g, w) for g, w in pairs), "; ".join(msgs)


@dataclass
class Case:
    size: str
    nbytes: int
    kernel: Callable[[], Any]
    ref: Callable[[], Any]
    compare: Callable[[Any, Any], tuple[bool, float, str]]
    compile: tuple[Callable[..., Any], tuple, dict] | None = None  # (reference, args, kwargs) for torch.compile
    tokens: int = 0  # > 0: each time is also reported per token (``*_us_per_token``)
    others: dict[str, Callable[[], Any]] = field(default_factory=dict)  # other ops timed beside it (``<name>_ms``)
    note: str = ""  # said in the row


# -- builders: realistic inputs at one size; the docstring is the bytes formula ------------------------------


def rope_cache() -> torch.Tensor:
    if S.rope is None:  # float32 [P, 64] cos|sin, P = max_position_embeddings (4096 with --small)
        angles = torch.rand(4096 if S.small else S.max_pos, S.m.qk_rope_head_dim // 2, device=S.dev) * 6.3
        S.rope = torch.cat([angles.cos(), angles.sin()], dim=1)
    return S.rope


def b_qkv(q: int, kv: int, width: int, eps: float) -> Callable[[int], Case]:
    def build(t: int) -> Case:
        """read T*(q+kv)*2 (the q and kv columns of the projection) + (q+kv)*2 weights; write T*(q+kv)*2"""
        proj = randn(t, width).to(BF16)  # one fused projection: qr and kv are views of it
        args = (proj[:, :q], proj[:, q : q + kv], (1 + 0.1 * randn(q)).to(BF16), (1 + 0.1 * randn(kv)).to(BF16), eps)
        kern = FusedQKVRMSNorm(q_size=q, kv_size=kv, proj_width=width)
        return Case(f"T={t}", 2 * t * (q + kv) * 2 + (q + kv) * 2, lambda: kern(*args),
                    lambda: fused_qkv_rmsnorm_reference(*args), lambda g, w: close(list(zip(g, w)), 0.0, 2**-7),
                    (fused_qkv_rmsnorm_reference, args, {}))  # fmt: skip

    return build


def b_mtp_input(t: int) -> Case:
    """read (T-masked)*H*2 embeds + T*hc*H*2 prev_hidden + T*8 positions + 2*H*2 weights; write T*(1+hc)*H*2"""
    h, hc, eps = S.m.hidden_size, S.m.hc_mult, S.m.rms_norm_eps
    pos = torch.randint(1, 1 << 20, (t,), device=S.dev)
    pos[1::17] = 0  # request starts: masked enorm rows (exactly 0, not read)
    masked = int((pos == 0).sum())
    args = ((3 * randn(t, h)).to(BF16), pos, (3 * randn(t, hc * h)).to(BF16), (1 + 0.1 * randn(h)).to(BF16),
            (1 + 0.1 * randn(h)).to(BF16), eps)  # fmt: skip
    kern = MTPInputRMSNorm(hidden=h, hc_mult=hc)
    def compare(got: Any, want: Any) -> tuple[bool, float, str]:
        ok, err, msg = close(list(zip(got, want)), 0.0, 2**-7)
        zero = bool(got[0][pos == 0].eq(0).all())
        return ok and zero, err, msg + ("" if zero else "; masked rows not zero")
    nbytes = (t - masked) * h * 2 + t * hc * h * 2 + t * 8 + 2 * h * 2 + t * (1 + hc) * h * 2
    return Case(f"T={t}", nbytes, lambda: kern(*args), lambda: mtp_input_rmsnorm_reference(*args), compare,
                (mtp_input_rmsnorm_reference, args, {}))  # fmt: skip


def b_mtp_head(t: int) -> Case:
    """read T*H*2 + H*2 weight; write T*H*2"""
    h = S.m.hidden_size
    args = ((3 * randn(t, h)).to(BF16), (1 + 0.1 * randn(h)).to(BF16), S.m.rms_norm_eps)
    kern = MTPSharedHeadRMSNorm(hidden=h)
    return Case(f"T={t}", 2 * t * h * 2 + h * 2, lambda: kern(*args), lambda: mtp_head_ref(*args),
                lambda g, w: close([(g, w)], 0.0, 2**-7), (mtp_head_ref, args, {}))  # fmt: skip


def b_indexer_q(t: int) -> Case:
    """read T*H*D*2 q + T*H*2 weights + T*8 positions + T*R*4 cos/sin row; write T*H*D fp8 + T*H*4 w_out"""
    h, d, r = S.m.index_n_heads, S.m.index_head_dim, S.m.qk_rope_head_dim
    cs = rope_cache()
    args = (torch.randint(0, cs.shape[0], (t,), device=S.dev), (2 * randn(t, h, d)).to(BF16), cs,
            randn(t, h).to(BF16), d**-0.5, h**-0.5)  # fmt: skip
    kw = {"fp8_dtype": S.fp8, "explicit_fma": S.fma}
    kern = IndexerQRopeQuant(num_heads=h, head_dim=d, rope_dim=r)
    def compare(got: Any, want: Any) -> tuple[bool, float, str]:
        dist = code_dist(got[0], want[0])
        top = int(dist.max()) if dist.numel() else 0
        # tests: bit-exact without explicit fma; with it (ROCm) <= 1 code in the RoPE part, NoPE exact
        codes_ok = top <= 1 and int(dist[..., : d - r].max()) == 0 if S.fma else top == 0
        w_ok = torch.equal(got[1], want[1])
        bad = int((dist > 0).sum())
        return codes_ok and w_ok, float(top), f"fp8 bytes differing {bad}/{dist.numel()}, w equal {w_ok}"
    nbytes = t * h * d * 2 + t * h * 2 + t * 8 + t * r * 4 + t * h * d + t * h * 4
    return Case(f"T={t}", nbytes, lambda: kern(*args, **kw), lambda: idx_q_ref(*args, **kw), compare,
                (idx_q_ref, args, kw))  # fmt: skip


def b_indexer_kv(t: int) -> Case:
    """read T*28 (positions, slots, request index) + C*(2*8*D*4 state halves + 8*4 block table + R*4 cos/sin)
    + D*2 weight; write C*(D+4) (fp8 K + fp32 scale); C = tokens closing a compression window"""
    d, r, eps = S.m.index_head_dim, S.m.qk_rope_head_dim, S.m.rms_norm_eps
    per = min(t, 1024)  # prefill chunks of <= 1024 tokens per request; T = 1: a decode token closing a window
    nreq = t // per
    starts = torch.tensor([1023] if t == 1 else [1000 + 37 * i for i in range(nreq)])
    pos = (starts[:, None] + torch.arange(per)).reshape(-1)
    width = int(pos.max()) // 4 + 1  # state pages (4 positions each) of a request, scattered over the pool
    table = torch.randperm(nreq * width).to(I32).view(nreq, width)
    closing = (pos + 1) % 4 == 0
    n_close = int(closing.sum())
    per_page = compressed_block_size(S.flash, 4)  # 64 compressed tokens per indexer-cache page
    stride = indexer_page_stride(S.flash, per_page, d)  # 8640 bytes
    pages = n_close // per_page + 2
    idx = (torch.cumsum(closing.long(), 0) - 1).clamp(min=0)
    cslot = torch.where(closing, torch.randperm(pages)[idx // per_page] * per_page + idx % per_page, -1)
    backing = torch.zeros(pages, stride, dtype=U8, device=S.dev)
    backing_ref = backing.clone()
    def view(b: torch.Tensor) -> torch.Tensor:
        return b.as_strided((pages, per_page, d + 4), (stride, d + 4, 1))
    args = [randn(nreq * width, 4, 4 * d), table, torch.arange(nreq, dtype=I32).repeat_interleave(per), pos,
            torch.arange(t), cslot, torch.rand(d).add(0.5).to(BF16), rope_cache()]  # fmt: skip
    args = [a.to(S.dev) for a in args]
    kern = IndexerKVCompressInsert(head_dim=d, rope_dim=r, compress_ratio=4)
    def ref() -> Any:
        with torch.device(S.dev):  # the reference makes its window buffers with factory calls (CPU by default)
            return idx_kv_ref(*args, view(backing_ref), eps, compress_ratio=4, mx_scale=S.mx)
    def compare(_got: Any, _want: Any) -> tuple[bool, float, str]:
        v, sc = per_page * d, per_page * (d + 4)
        top = int(code_dist(backing[:, :v], backing_ref[:, :v]).max())
        scales = torch.equal(backing[:, v:sc], backing_ref[:, v:sc])
        tail = torch.equal(backing[:, sc:], backing_ref[:, sc:])
        # tests: K bytes within one code (exp/rsqrt rounding), scales and untouched bytes identical
        return top <= 1 and scales and tail, float(top), f"{n_close} windows closed; scales equal {scales}"
    nbytes = t * 28 + n_close * (2 * 8 * d * 4 + 8 * 4 + r * 4) + d * 2 + n_close * (d + 4)
    return Case(f"T={t} ({nreq} req)", nbytes,
                lambda: kern(*args, view(backing), eps, compress_ratio=4, mx_scale=S.mx), ref, compare)  # fmt: skip


def b_inv_rope(t: int) -> Case:
    """read T*H*D*2 o + T*8 positions + T*R*4 cos/sin; write T*H*D fp8 + G*K*round_up(T,4)*4 scales
    (H, G per rank; K = 4*H/G fp32 scales on sm90, H/G int32 words on sm100)"""
    h, g, d, r = S.m.num_attention_heads // S.tp, S.m.o_groups // S.tp, S.m.head_dim, S.m.qk_rope_head_dim
    cs = rope_cache()
    args = ((3 * randn(t, h, d)).to(BF16), torch.randint(0, cs.shape[0], (t,), device=S.dev), cs, g)
    kw = {"tma_aligned_scales": S.tma}
    kern = InvRopeFP8Quant(num_heads=h, n_groups=g, head_dim=d, rope_dim=r)
    def compare(got: Any, want: Any) -> tuple[bool, float, str]:
        dist = code_dist(got[0], want[0])
        top = int(dist.max()) if dist.numel() else 0
        scales = torch.equal(got[1], want[1])  # tests: FP8 bytes and scales bit-exact
        return top == 0 and scales, float(top), f"fp8 bytes differing {int((dist > 0).sum())}/{dist.numel()}, scales equal {scales}"
    k = h // g if S.tma else h // g * d // 128
    nbytes = t * h * d * 2 + t * 8 + t * r * 4 + t * h * d + g * k * triton.cdiv(t, 4) * 4 * 4
    return Case(f"T={t}", nbytes, lambda: kern(*args, **kw), lambda: inv_rope_fp8_quant_reference(*args, **kw),
                compare, (inv_rope_fp8_quant_reference, args, kw))  # fmt: skip


def b_state(t: int) -> Case:
    """read T*(2*HEAD*4 kv and score + 16 position and slot) + 4*HEAD*4 ape; write T*2*HEAD*4 (HEAD = 2*head_dim)"""
    head, ratio, pbs = 2 * S.m.head_dim, 4, 4  # the main C4 compressor: coff 2 x head_dim, 4 slots per page
    kv_score = randn(t, 2 * head)  # the fp32 GEMM output; kv and score are column views of it
    pages = t // pbs + 2
    args = (kv_score[:, :head], kv_score[:, head:], randn(ratio, head), torch.randint(0, 1 << 20, (t,), device=S.dev),
            torch.randperm(pages * pbs, device=S.dev)[:t])  # fmt: skip
    state = torch.full((pages, pbs, 2 * head), -5.0, device=S.dev)
    state_ref = state.clone()
    kern = SavePartialStates(head_size=head, compress_ratio=ratio, state_block_size=pbs)
    nbytes = t * (2 * head * 4 + 16) + ratio * head * 4 + t * 2 * head * 4
    return Case(f"T={t}", nbytes, lambda: kern(*args, state), lambda: save_partial_states_reference(*args, state_ref),
                lambda g, w: close([(g, w)], 0.0, 0.0))  # fmt: skip


def b_gather(size: tuple[int, int]) -> Case:
    """read rows*(448 fp8 + 128 rope + 7 scale bytes + 4 block-table entry) + reqs*8 lens; write rows*512*2"""
    reqs, glen = size
    seq = torch.randint(glen, glen + (70 if S.small else 2000) + 1, (reqs,))
    npages = (seq + 63) // 64
    total, width = int(npages.sum()), int(npages.max())
    perm, table, start = torch.randperm(total).to(I32), torch.zeros(reqs, width, dtype=I32), 0
    for i, count in enumerate(npages.tolist()):  # distinct, scattered pages per request
        table[i, :count] = perm[start : start + count]
        start += count
    stride = page_bytes(64)
    cache = torch.zeros(total, stride, dtype=U8, device=S.dev)
    with warmreg.monitor("off"):  # the writer is XPU-only in the registry: not warmed on CUDA, not benchmarked
        k = (2 * randn(total * 64, 512)).to(BF16)
        QuantInsertKCache(block_size=64)(k, cache, torch.arange(total * 64, device=S.dev), block_size=64)
    table, seq = table.to(S.dev), seq.to(I32).to(S.dev)
    kw = {"block_size": 64, "gather_lens": torch.full((reqs,), glen, dtype=I32, device=S.dev)}
    out, out_ref = (torch.zeros(reqs, glen, 512, dtype=BF16, device=S.dev) for _ in range(2))
    kern = DequantGatherKCache(cache=PagedCache("swa", 64, (stride,), width))
    def ref() -> Any:
        with torch.device(S.dev):  # torch.ones(...) inside the reference
            return dequant_gather_k_reference(out_ref, cache, seq, table, **kw)
    def compare(got: Any, want: Any) -> tuple[bool, float, str]:
        return torch.equal(got.view(torch.int16), want.view(torch.int16)), max_abs(got, want), "bit-exact required"
    rows = reqs * glen
    nbytes = rows * (448 + 128 + 7 + 4) + reqs * 8 + rows * 512 * 2
    return Case(f"T={rows} ({reqs} req x {glen} rows)", nbytes, lambda: kern(out, cache, seq, table, **kw), ref, compare)


def b_kda(size: tuple[int, int]) -> Case:
    """read T*H*(3*K*2 q,k,v + K*2 raw gate + 2 raw beta) + H*4 A_log + H*K*4 dt_bias + N*(8 + 4*C) + N*H*V*K*4 state;
    write T*H*V*2 o + T*H*V*K*4 states (one a token; C = state columns of a sequence: 1 + spec, 1 for plain decode)"""
    n, s = size
    t, h, d, spec = n * s, S.kda_heads, S.kda_dim, s > 1
    p = h * d
    conv = randn(t, 3 * p).to(BF16)  # the conv update's output: q, k, v are its rearranged column slices
    q, k, v = (conv[:, i * p : (i + 1) * p].view(1, t, h, d) for i in range(3))
    raw_g = randn(1, t, h, d).to(BF16)
    raw_beta = randn(t, 6288).to(BF16)[:, 6288 - h :].unsqueeze(0)  # a column of the packed projection
    a_log, dt_bias = torch.rand(h, device=S.dev).mul(1.5).add(0.5).log(), 0.1 * randn(h * d)
    lower_bound = -5.0  # as the example config assumes (a runtime argument: no key depends on it)
    cols = s if spec else 1
    pool = 0.1 * randn(n * cols + 1, h, d, d)  # [slots, H, V, K]: a slot per state column, slot 0 the null block
    pool_k, pool_p = pool.clone(), pool.clone()
    table = torch.randperm(n * cols, device=S.dev).add(1).to(I32).view(n, cols)
    indices = table if spec else table[:, 0]
    accepted = torch.randint(1, cols + 1, (n,), device=S.dev, dtype=I32) if spec else None
    cu = torch.arange(0, t + 1, s, dtype=I32, device=S.dev)
    args = (q, k, v, raw_g, raw_beta, a_log, dt_bias, lower_bound)
    kern = KDARecurrent(num_heads=h, head_k_dim=d, head_v_dim=d, lower_bound=lower_bound)
    others: dict[str, Callable[[], Any]] = {}
    if not spec:  # plain decode: vLLM's layer runs the packed decode on the same rows
        layout = KDALayout(num_heads=h, head_dim=d, conv_width=4, lower_bound=lower_bound, tensor_parallel_size=1,
                           num_speculative_tokens=0, dtype="bfloat16")  # fmt: skip
        packed = KDAPackedDecode(layout=layout)
        others["kda_packed_decode"] = lambda: packed(conv, raw_g, raw_beta, a_log, dt_bias, lower_bound, pool_p, indices)
    def compare(got: Any, want: Any) -> tuple[bool, float, str]:
        ok_o, err, msg = close([(got[0], want[0])], 1e-2, 1.6e-2)  # tests: bf16 o, one rounding step
        ok_s, err_s, msg_s = close([(got[1], want[1])], 1e-5, 1e-5)  # fp32 state
        return ok_o and ok_s, err, f"state max abs err {err_s:.3g} {msg} {msg_s}"
    nbytes = t * h * (3 * d * 2 + d * 2 + 2) + h * 4 + h * d * 4 + n * (8 + 4 * cols) + n * h * d * d * 4
    nbytes += t * h * d * 2 + t * h * d * d * 4
    what = f"{n} x {s} tok (T={t}, " + (f"{s - 1} draft tokens, [N, {s}] indices)" if spec else "plain decode, [N] indices)")
    note = "" if spec else ("[N] indices: not a planned key (vLLM's layer runs kimi_k3.kda_packed_decode for plain "
                            "decode, timed beside it); the op compiles at its first call, before timing")  # fmt: skip
    return Case(what, nbytes, lambda: (kern(*args, pool_k, cu, indices, accepted), pool_k),
                lambda: kda_recurrent_reference(*args, pool, cu, indices, accepted), compare,
                tokens=t, others=others, note=note)  # fmt: skip


# -- harness -------------------------------------------------------------------------------------------------


def time_compiled(case: Case, row: dict[str, Any], state: dict[str, Any]) -> None:
    """torch.compile the reference (one wrapper per kernel); state["skip"] stops it for the later sizes."""
    if state["skip"] or case.compile is None or not S.compile:
        row["compiled_ref"] = state["skip"] or "not compiled: --no-compile"
        return
    if S.compile_spent_s > S.compile_budget_s or over_deadline():
        row["compiled_ref"] = f"not compiled: the script's budget ({S.compile_budget_s:.0f} s of compiles, {S.deadline_s:.0f} s) is spent"
        return
    fn, args, kw = case.compile
    state["fn"] = state["fn"] or torch.compile(fn)
    call = functools.partial(state["fn"], *args, **kw)
    try:
        first = timed(call)[1] / 1e3
        S.compile_spent_s += first
        row["compile_first_call_s"] = first
        if first > COMPILE_CAP_S:
            state["skip"] = f"not compiled beyond {case.size}: compiling took {first:.1f} s (> {COMPILE_CAP_S:.0f} s)"
        row["compiled_ref_ms"], row["compiled_ref_reps"] = bench(call)
        row["compiled_ref"] = "ok"
    except Exception as exc:
        state["skip"] = row["compiled_ref"] = f"not compiled: {short(exc)}"


def time_others(case: Case, row: dict[str, Any]) -> None:
    """Time the ops compared with the kernel (``<name>_ms``), then every time per token where the case has tokens."""
    if case.note:
        row["note"] = case.note
    for name, fn in case.others.items():
        try:
            row[f"{name}_ms"], row[f"{name}_reps"] = bench(fn)
        except Exception as exc:
            row[f"{name}_error"] = short(exc)
    if case.tokens:
        for src in ("kernel_ms", "eager_ref_ms", "compiled_ref_ms", *(f"{name}_ms" for name in case.others)):
            if isinstance(row.get(src), float):
                row[src.removesuffix("_ms") + "_us_per_token"] = row[src] * 1e3 / case.tokens


def run_entry(registered: str, sizes: list, build: Callable[[Any], Case], metric: str, tol: str, loop: str = "") -> dict:
    """One kernel over its sizes; ``loop``: the eager reference is a Python loop over these (not compiled, capped)."""
    res: dict[str, Any] = {"kernel": registered, "bytes_formula": " ".join((inspect.getdoc(build) or "").split()),
                           "error_metric": metric, "tolerance": tol, "sizes": []}  # fmt: skip
    if loop:
        res["eager_reference"] = f"Python loop over {loop}: timed only at sizes where one call takes < {REF_CAP_MS:.0f} ms"
    mon = current()
    seen = len(mon.misses) if mon else 0
    state = {"fn": None, "skip": f"not compiled: Python loop over {loop}" if loop else None}
    for size in sizes:
        row: dict[str, Any] = {"size": str(size)}
        res["sizes"].append(row)
        try:
            case = build(size)
            row.update(size=case.size, bytes=case.nbytes)
        except Exception as exc:
            row.update(check="error", error=f"building inputs: {short(exc)}")
            traceback.print_exc(limit=4)
            continue
        ref_ms = 0.0
        try:
            got, _ = timed(case.kernel)
            want, ref_ms = timed(case.ref)
            ok, err, detail = case.compare(got, want)
            row.update(check="passed" if ok else "failed", max_error=err, detail=detail, ref_check_call_ms=ref_ms)
        except Exception as exc:
            row.update(check="error", error=short(exc))
            traceback.print_exc(limit=4)
        try:
            row["kernel_ms"], row["kernel_reps"] = bench(case.kernel)
        except Exception as exc:
            row["kernel_error"] = short(exc)
        try:
            if over_deadline():
                row["eager_ref_note"] = f"skipped: past the script's {S.deadline_s:.0f} s budget for reference timings"
            else:
                cap = S.dev.type == "cuda"  # the dry run times one call anyway
                if cap and REF_CAP_MS < ref_ms < 10 * REF_CAP_MS:
                    ref_ms = min(ref_ms, timed(case.ref)[1])  # the first call may have paid one-off costs
                if cap and ref_ms > REF_CAP_MS:
                    row["eager_ref_note"] = f"capped: one call takes {ref_ms:.0f} ms (> {REF_CAP_MS:.0f} ms), not timed"
                    row["eager_ref_one_call_ms"] = ref_ms
                else:
                    row["eager_ref_ms"], row["eager_ref_reps"] = bench(case.ref)
        except Exception as exc:
            row["eager_ref_error"] = short(exc)
        time_compiled(case, row, state)
        time_others(case, row)
        kms = row.get("kernel_ms")
        if kms:
            row["GBps"] = case.nbytes / (kms * 1e6)
            row["frac_copy_bw"] = row["GBps"] / S.copy_gbps if S.copy_gbps else None
            for src, dst in (("eager_ref_ms", "speedup"), ("compiled_ref_ms", "speedup_vs_compiled"),
                             ("eager_ref_one_call_ms", "speedup_from_one_eager_call")):  # fmt: skip
                if row.get(src):
                    row[dst] = row[src] / kms
        del case
    if mon:
        res["misses_during_entry"] = dict(Counter(m.kernel or f"unregistered {m.jit_name}" for m in mon.misses[seen:]))
    return res


def entries() -> list[tuple]:
    m, kimi, tok = S.m, S.kimi.text, [1, 8] if S.small else [1, 64, 1024, 8192]
    bf16 = "assert_close atol 0, rtol 2**-7 (one bf16 rounding step, as the tests)"
    fp8 = "max fp8 code distance (bytes as uint8)"
    kq, kkv = kimi["q_lora_rank"], kimi["kv_lora_rank"]
    return [
        ("qkv_rmsnorm[deepseek_v4_flash]", FusedQKVRMSNorm.name, tok,
          b_qkv(m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps), "max abs err", bf16),
        ("qkv_rmsnorm[kimi_k3]", FusedQKVRMSNorm.name, tok,
          b_qkv(kq, kkv, kq + kkv + kimi["qk_rope_head_dim"], kimi["rms_norm_eps"]), "max abs err", bf16),
        ("mtp_input_rmsnorm", MTPInputRMSNorm.name, tok, b_mtp_input, "max abs err", bf16 + "; masked rows 0"),
        ("mtp_shared_head_rmsnorm", MTPSharedHeadRMSNorm.name, tok, b_mtp_head, "max abs err", bf16),
        ("indexer_q_rope_quant", IndexerQRopeQuant.name, tok, b_indexer_q, fp8,
          "FP8 bytes and w_out bit-exact (tests; explicit-fma ROCm: <= 1 code in the RoPE part)"),
        ("indexer_kv_compress_insert", IndexerKVCompressInsert.name, tok, b_indexer_kv, fp8,
          "K bytes <= 1 code, scales and untouched bytes identical (tests)", "tokens and window positions"),
        ("inv_rope_fp8_quant", InvRopeFP8Quant.name, tok, b_inv_rope, fp8, "FP8 bytes and scales bit-exact (tests)"),
        ("save_partial_states[main C4]", SavePartialStates.name, tok, b_state, "max abs err",
          "exact: atol 0, rtol 0 (tests)", "tokens"),
        ("dequant_gather_k_cache[swa]", DequantGatherKCache.name,
          [(1, 1), (2, 4)] if S.small else [(1, 1), (1, 64), (8, 128), (64, 128)], b_gather, "max abs err",
          "bit-exact (tests)", "requests and gathered rows"),
        ("kda_recurrent", KDARecurrent.name,
          [(n, s) for n in ((1, 2) if S.small else (1, 64, 256)) for s in (1, 1 + S.kda_spec)], b_kda,
          "max abs err of o", "o atol 1e-2 rtol 1.6e-2; state atol/rtol 1e-5 (tests)", "sequences and tokens"),
    ]  # fmt: skip


def copy_bandwidth() -> dict[str, Any]:
    """The device's copy bandwidth: dst.copy_(src) of 1 GiB (16 MiB with --small) uint8; bytes = 2 x size."""
    n = (16 << 20) if S.small else (1 << 30)
    src = torch.ones(n, dtype=U8, device=S.dev)
    dst = torch.empty_like(src).copy_(src)  # touch both buffers first
    ms, reps = bench(lambda: dst.copy_(src))
    S.copy_gbps = 2 * n / (ms * 1e6)
    return {"bytes": 2 * n, "ms": ms, "reps": reps, "GBps": S.copy_gbps, "what": "dst.copy_(src), uint8"}


def setup(args: argparse.Namespace) -> dict[str, Any]:
    S.dev, S.small, S.compile = torch.device(args.device), args.small, not args.no_compile
    torch.manual_seed(0)
    S.flash = warmreg.WarmConfig.load(ROOT / "examples/deepseek_v4_flash.json")
    S.kimi = warmreg.WarmConfig.load(ROOT / "examples/kimi_k3.json")
    S.m, S.tp, S.max_pos = DSV4.from_config(S.flash), S.flash.serving["tensor_parallel_size"], S.flash.model["max_position_embeddings"]
    lin = S.kimi.text["linear_attn_config"]
    S.kda_heads, S.kda_dim = lin["num_heads"] // S.kimi.serving["tensor_parallel_size"], lin["head_dim"]
    S.max_seqs, S.kda_spec = S.kimi.serving["max_num_seqs"], S.kimi.serving["num_speculative_tokens"]
    plat = warmreg.runtime_platform() if S.dev.type == "cuda" else None  # the launchers' defaults, for the references
    S.fma, S.fp8 = bool(plat and plat.is_rocm), torch.float8_e4m3fnuz if plat and plat.fp8_fnuz else torch.float8_e4m3fn
    S.tma, S.mx = bool(plat and plat.is_cuda and plat.sm >= 100), bool(plat and plat.is_cuda and 100 <= plat.sm < 110)
    return {"device": args.device, "small": S.small, "platform": plat.target if plat else None,
            "flags": {"fp8": str(S.fp8), "explicit_fma": S.fma, "tma_aligned_scales": S.tma, "mx_scale": S.mx},
            "caps": {"eager_ref_one_call_ms": REF_CAP_MS, "compile_cap_s": COMPILE_CAP_S,
                     "compile_budget_s": S.compile_budget_s, "reference_timing_deadline_s": S.deadline_s}}  # fmt: skip


def print_table(data: dict[str, Any]) -> None:
    def f(v: Any, fmt: str, w: int) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-".rjust(w)
    print(f"\ncopy bandwidth {S.copy_gbps:.0f} GB/s; wall {data['wall_s']:.0f} s; misses {data.get('misses', {}).get('per_kernel')}")
    print(f"{'kernel':30} {'size':24} {'check':6} {'max_err':>8} {'kern_ms':>9} {'eager_ms':>9} {'comp_ms':>8} {'speedup':>8} {'GB/s':>7} {'%copy':>6}")
    for name, entry in data["kernels"].items():
        for r in entry["sizes"]:
            frac = r.get("frac_copy_bw")
            print(f"{name[:30]:30} {r['size'][:24]:24} {r.get('check', '-')[:6]:6} {f(r.get('max_error'), '8.2g', 8)} "
                  f"{f(r.get('kernel_ms'), '9.4f', 9)} {f(r.get('eager_ref_ms'), '9.4f', 9)} {f(r.get('compiled_ref_ms'), '8.4f', 8)} "
                  f"{f(r.get('speedup'), '8.1f', 8)} {f(r.get('GBps'), '7.1f', 7)} {f(frac * 100 if frac else None, '6.1f', 6)}")  # fmt: skip
            per_token = {k.removesuffix("_us_per_token"): v for k, v in r.items() if k.endswith("_us_per_token")}
            if per_token:
                print(f"{'':30} us/token: " + ", ".join(f"{k} {v:.3f}" for k, v in per_token.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes, one timing call (with --device cpu)")
    ap.add_argument("--tag", default=None, help='results name suffix (default "h200"; "cpu_dryrun" on CPU)')
    ap.add_argument("--only", default=None, help="comma-separated substrings of the kernels to run")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --small for a dry run")
    data = setup(args)
    if S.dev.type == "cuda":  # warm both configs; the monitor armed by the first stays armed to the end
        data["warm"] = {}
        for name, mode in (("deepseek_v4_flash", "record"), ("kimi_k3", None)):
            try:
                rep = warmreg.warm(str(ROOT / f"examples/{name}.json"), on_error="continue", monitor=mode)
                data["warm"][name] = {"summary": rep.summary(), "failed": [(r.kernel, str(r.key), r.error) for r in rep.failed]}
            except Exception as exc:
                data["warm"][name] = {"error": short(exc)}
        data["warm"]["done_at_s"] = time.perf_counter() - S.t0
    data["copy_bandwidth"], data["kernels"] = copy_bandwidth(), {}
    for name, *spec in entries():
        if not args.only or any(s in name for s in args.only.split(",")):
            print(f"== {name}", flush=True)
            data["kernels"][name] = run_entry(*spec)
    mon = current()
    if mon is not None:
        per = Counter(m.kernel or f"unregistered {m.jit_name}" for m in mon.misses)
        data["misses"] = {"total": len(mon.misses), "per_kernel": dict(per), "counters": mon.counters(),
                          "explain": [m.explain()[:1500] for m in mon.misses[:40]],
                          "note": "a miss of a warmreg kernel: a launch compiled or loaded what warm() had not (allowed "
                                  "outside the declared domains); 'unregistered': torch.compile's own Triton kernels"}  # fmt: skip
        for entry in data["kernels"].values():
            entry["misses_total"] = per.get(entry["kernel"], 0)
        warmreg.disarm()
    data["compile_spent_s"], data["wall_s"] = S.compile_spent_s, time.perf_counter() - S.t0
    path = write(f"kernels_numeric_{args.tag or ('cpu_dryrun' if args.device == 'cpu' else 'h200')}", data)
    print_table(data)
    print("->", path)


if __name__ == "__main__":
    main()
