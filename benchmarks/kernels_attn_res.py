"""Kimi-K3's ``attn_res`` at the call sites of a deployment: warmreg's kernel timed, and vLLM's beside it.

For every distinct call site of ``examples/kimi_k3_attn_res.json`` (``warmreg_kimi_k3.attn_res.call_sites``: the
attention and MLP inputs of each layer and the model output) at T = 1, 64, 256 and 8192 tokens: the engine's buffers
(prefix and delta ``[T, hidden]``, the residual buffer ``[T, blocks, hidden]``, bf16 weights), warmreg's
``AttnRes`` and, with ``--engine-module``, vLLM's ``attn_res`` from a copy of
``vllm/models/kimi_k3/nvidia/ops/attn_res.py`` (loaded from its file; where vLLM is not installed, minimal
stand-ins for its imports of ``vllm.triton_utils``, ``vllm.platforms`` and ``vllm._custom_ops``).

Timing: CUDA events around one call that the GPU reaches only after the host has queued it (a short
``torch.cuda._sleep`` first, so the figure is the kernel's GPU time, not the launcher's host time), the two sides
interleaved call by call, a warmup first, then the median (and p10 / p90) of ``--reps`` calls; L2 is not flushed
(the layers run back to back). Check: on clones of one input set, warmreg's output, updated prefix and residual buffer
against vLLM's (bitwise: elements differing and the largest distance in bf16 steps) and both outputs against the
PyTorch reference (``attn_res_reference``, fp32 math; the largest distance in bf16 steps).

    python benchmarks/kernels_attn_res.py [--engine-module PATH] [--tag h200_triton-3.6.0]   # on the GPU
    python benchmarks/kernels_attn_res.py --dry-run [--engine-module PATH]    # CPU: interpreter, T = 1 and 3
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before any @triton.jit runs (Triton reads it at decoration) and vLLM imports
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps Triton on without a GPU driver (its distributed case)

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write
from _engine_module import load_engine, uses_stand_ins
from warmreg_kimi_k3.attn_res import AttnRes, CallSite, attn_res_reference

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "kimi_k3_attn_res.json"
TOKENS = (1, 64, 256, 8192)
BF16 = torch.bfloat16


# -- inputs and the two sides -----------------------------------------------------------------------------------------
def deployment(path: Path) -> tuple[AttnRes, list[CallSite]]:
    """The ``AttnRes`` op of a config file and its distinct call sites."""
    text = json.loads(path.read_text())["model"]["text_config"]
    eps = float(text["rms_norm_eps"])
    op = AttnRes(hidden_size=text["hidden_size"], num_layers=text["num_hidden_layers"],
                 block_size=text["attn_res_block_size"], eps=eps, output_norm_eps=eps)  # fmt: skip
    return op, op.call_sites


def buffers(op: AttnRes, tokens: int, device: str, seed: int = 0) -> SimpleNamespace:
    """The engine's buffers at ``tokens`` rows: prefix, a delta, the residual buffer ``[T, blocks, hidden]`` and the
    three weights (logits of a few units, as a trained model's: a softmax neither flat nor one-hot)."""
    g = torch.Generator(device=device).manual_seed(seed)
    d = op.hidden_size

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (shift + scale * torch.randn(*shape, generator=g, device=device)).to(BF16)

    return SimpleNamespace(prefix=randn(tokens, d), delta=randn(tokens, d, scale=0.1),
                           blocks=randn(tokens, op.max_blocks, d), norm_w=randn(d, scale=0.2, shift=1.0),
                           qk_w=randn(d, scale=0.02), out_w=randn(d, scale=0.2, shift=1.0))  # fmt: skip


def site_args(op: AttnRes, b: SimpleNamespace, site: CallSite) -> dict[str, Any]:
    """``attn_res``'s arguments at one call site, as the model passes them (vLLM's names)."""
    norm = site.apply_output_norm
    return {
        "prefix": b.prefix, "delta": b.delta if site.has_delta else None, "blocks": b.blocks,
        "norm_weight": b.norm_w, "qk_weight": b.qk_w, "output_norm_weight": b.out_w if norm else None,
        "num_blocks": site.num_blocks, "block_write_idx": site.block_write_idx, "eps": op.eps,
        "output_norm_eps": op.output_norm_eps if norm else 0.0,  # the model passes 0.0 at the output
    }  # fmt: skip


def warmreg_call(op: AttnRes, args: dict[str, Any], launch_pdl: bool | None) -> torch.Tensor:
    kw = dict(args)
    if kw["output_norm_weight"] is None:
        kw["output_norm_eps"] = None
    return op(**kw, launch_pdl=launch_pdl)


def engine_call(mod: ModuleType, args: dict[str, Any]) -> torch.Tensor:
    a = args  # vLLM's positional order: prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, ...
    return mod.attn_res(a["prefix"], a["delta"], a["blocks"], a["norm_weight"], a["qk_weight"],
                        a["output_norm_weight"], a["num_blocks"], a["block_write_idx"], a["eps"],
                        a["output_norm_eps"])  # fmt: skip


def _cloned(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# -- comparison -----------------------------------------------------------------------------------------------------
def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in representable steps (bf16 bit patterns on a monotone integer line)."""
    x, y = a.reshape(-1).view(torch.int16).int(), b.reshape(-1).view(torch.int16).int()
    x, y = torch.where(x < 0, -(x + 32768), x), torch.where(y < 0, -(y + 32768), y)
    return (x - y).abs()


def _distance(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    steps = _steps(a, b)
    diff, ref = (a.float() - b.float()).norm(), b.float().norm()
    return {"differing": int((steps > 0).sum()), "of": steps.numel(),
            "max_steps": int(steps.max()) if steps.numel() else 0,
            "max_abs": float((a.float() - b.float()).abs().max()) if steps.numel() else 0.0,
            "rel_l2": float(diff / ref) if ref > 0 else float(diff)}  # fmt: skip


def check(op: AttnRes, mod: ModuleType | None, args: dict[str, Any]) -> dict[str, Any]:
    """Warmreg's output and buffer writes against vLLM's (when given) and both outputs against the reference, on
    clones of one input set."""
    ref_args = {k: v for k, v in args.items() if k != "output_norm_eps"}
    ref_args["output_norm_eps"] = args["output_norm_eps"] if args["output_norm_weight"] is not None else None
    ref_out, ref_prefix, ref_blocks = attn_res_reference(**_cloned(ref_args))
    ours = _cloned(args)
    out = warmreg_call(op, ours, None)
    result: dict[str, Any] = {
        "warmreg_vs_reference": _distance(out, ref_out),
        "warmreg_prefix_vs_reference": _distance(ours["prefix"], ref_prefix),
        "warmreg_blocks_vs_reference": _distance(ours["blocks"], ref_blocks),
    }
    if mod is not None:
        theirs = _cloned(args)
        want = engine_call(mod, theirs)
        result.update(vllm_vs_reference=_distance(want, ref_out), warmreg_vs_vllm=_distance(out, want),
                      prefix_vs_vllm=_distance(ours["prefix"], theirs["prefix"]),
                      blocks_vs_vllm=_distance(ours["blocks"], theirs["blocks"]))  # fmt: skip
    return result


# -- timing ---------------------------------------------------------------------------------------------------------
def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    i = (len(s) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def _summary(us: list[float]) -> dict[str, Any]:
    return {"median_us": statistics.median(us), "p10_us": _quantile(us, 0.1), "p90_us": _quantile(us, 0.9),
            "raw_us": [round(u, 3) for u in us]}  # fmt: skip


def time_events(fns: dict[str, Callable[[], Any]], reps: int, warmup: int, sleep_cycles: int) -> dict[str, Any]:
    """Each candidate's GPU time per call: ``warmup`` calls, then ``reps`` interleaved rounds, each call between two
    CUDA events after a ``torch.cuda._sleep`` that keeps the GPU busy while the host queues it. On the CPU (dry
    run): wall time per call, no sleep."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cuda = torch.cuda.is_available()
    for _ in range(reps):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                torch.cuda._sleep(sleep_cycles)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3)
            else:
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1e6)
    return {name: _summary(us) for name, us in times.items()}


def time_graphs(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Any]:
    """Back-to-back calls replayed from a CUDA graph (``_timing.interleaved``): what a layer loop sees, PDL
    overlap between consecutive launches included."""
    from _timing import interleaved

    out = interleaved(fns, rounds=rounds, target_ms=2.0)
    return {name: {"median_us": s["median_ms"] * 1e3, "p10_us": s["p10_ms"] * 1e3, "p90_us": s["p90_ms"] * 1e3,
                   "calls_per_round": s["calls_per_round"], "method": s["method"],
                   "raw_us": [round(t * 1e3, 3) for t in s["raw_ms"]]} for name, s in out.items()}  # fmt: skip


# -- the run --------------------------------------------------------------------------------------------------------
def run_tokens(op: AttnRes, sites: list[CallSite], mod: ModuleType | None, tokens: int, args: argparse.Namespace,
               device: str) -> list[dict[str, Any]]:  # fmt: skip
    b = buffers(op, tokens, device)
    rows = []
    for site in sites:
        a = site_args(op, b, site)
        key = op.dispatch(prefix=a["prefix"], delta=a["delta"], blocks=a["blocks"], norm_weight=a["norm_weight"],
                          output_norm_weight=a["output_norm_weight"], num_blocks=a["num_blocks"],
                          block_write_idx=a["block_write_idx"], eps=a["eps"],
                          output_norm_eps=a["output_norm_eps"] if a["output_norm_weight"] is not None else None,
                          launch_pdl=bool(device == "cuda" and torch.cuda.get_device_capability()[0] >= 9))  # fmt: skip
        row: dict[str, Any] = {"tokens": tokens, "site": dict(num_blocks=site.num_blocks,
                               block_write_idx=site.block_write_idx, has_delta=site.has_delta,
                               apply_output_norm=site.apply_output_norm),
                               "warmreg_tile": dict(block_l=key.block_l, num_warps=key.num_warps,
                                                    launch_pdl=key.launch_pdl)}  # fmt: skip
        if not args.no_check:
            row["check"] = check(op, mod, a)
        fns: dict[str, Callable[[], Any]] = {"warmreg": functools.partial(warmreg_call, op, a, None)}
        if mod is not None:
            fns["vllm"] = functools.partial(engine_call, mod, a)
        if key.launch_pdl:  # vLLM's kernel names its PDL constexpr launch_pdl, which keeps Triton's option off
            fns["warmreg_no_pdl"] = functools.partial(warmreg_call, op, a, False)
        row["events"] = time_events(fns, args.reps, args.warmup, args.sleep_cycles)
        if device == "cuda" and not args.no_graphs:
            row["graphs"] = time_graphs(fns, args.graph_rounds)
        if "vllm" in row["events"]:
            row["vllm_over_warmreg"] = row["events"]["vllm"]["median_us"] / row["events"]["warmreg"]["median_us"]
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _site_name(site: dict[str, Any]) -> str:
    return (f"nb={site['num_blocks']} w={site['block_write_idx']:>2} "
            f"{'delta' if site['has_delta'] else '  -  '} {'norm' if site['apply_output_norm'] else ' -  '}")  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    ev = row["events"]
    parts = [f"T={row['tokens']:<5} {_site_name(row['site'])}"]
    parts += [f"{name} {s['median_us']:9.1f} us" for name, s in ev.items()]
    if "vllm_over_warmreg" in row:
        parts.append(f"vllm/warmreg {row['vllm_over_warmreg']:.2f}x")
    if "graphs" in row and "vllm" in row["graphs"]:
        g = row["graphs"]
        parts.append(f"graph {g['warmreg']['median_us']:.1f} / {g['vllm']['median_us']:.1f} us")
    chk = row.get("check", {})
    if "warmreg_vs_vllm" in chk:
        parts.append(f"differ {chk['warmreg_vs_vllm']['differing']} (max {chk['warmreg_vs_vllm']['max_steps']} steps)")
    return "  ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--engine-module", type=Path, default=None, help="a copy of vLLM's ops/attn_res.py")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,64,256,8192; 1,3 dry)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls of each side per site (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls of each side per site first")
    ap.add_argument("--sleep-cycles", type=int, default=200_000, help="torch.cuda._sleep before each timed call")
    ap.add_argument("--graph-rounds", type=int, default=11, help="rounds of the CUDA-graph timing")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timing")
    ap.add_argument("--no-check", action="store_true", help="skip the comparisons")
    ap.add_argument("--sites", default=None, help="indices into the sorted call sites (default: all)")
    ap.add_argument("--tag", default=None, help="result name suffix (default h200_triton-<version>; cpu_dryrun)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny token counts, 1 rep")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run for the CPU-side logic")
    if args.dry_run:
        args.reps, args.warmup = 1, 0
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 3] if args.dry_run else list(TOKENS))
    op, sites = deployment(args.config)
    if args.sites:
        sites = [sites[int(i)] for i in args.sites.split(",")]
    mod = load_engine(args.engine_module, entry="attn_res") if args.engine_module else None
    tag = args.tag or ("cpu_dryrun" if args.dry_run else f"h200_triton-{triton.__version__}")
    t0, rows = time.perf_counter(), []
    for t in tokens:  # the file is rewritten after each token count: a run cut short keeps what it measured
        rows += run_tokens(op, sites, mod, t, args, device)
        data = {
            "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
            "engine_module": str(args.engine_module) if args.engine_module else None,
            "engine_stand_ins": mod is not None and uses_stand_ins(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "tokens": tokens, "num_sites": len(sites),
            "method": {"events": f"median of {args.reps} calls, {args.warmup} warmup calls, "
                                 f"torch.cuda._sleep({args.sleep_cycles}) before each, sides interleaved",
                       "graphs": None if args.no_graphs or device != "cuda"
                       else f"_timing.interleaved: {args.graph_rounds} rounds of a CUDA graph of back-to-back calls"},
            "rows": rows, "wall_s": time.perf_counter() - t0,
        }  # fmt: skip
        path = write(f"kernels_attn_res_{tag}", data)
    print("->", path)


if __name__ == "__main__":
    main()
