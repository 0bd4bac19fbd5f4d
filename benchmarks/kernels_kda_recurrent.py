"""Kimi-K3's KDA recurrent step: warmreg's ``kimi_k3.kda_recurrent`` timed beside vLLM's ``fused_recurrent_kda``.

For the per-rank KDA layout of ``examples/kimi_k3.json`` (``linear_attn_config.num_heads / tensor_parallel_size``
heads, K = V = ``head_dim``, the gate's lower bound, a ``dt_bias``, bf16 activations, an fp32 pool) at N = 1, 16, 64
and 256 sequences, two steps as ``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward`` passes them:

- ``spec``: ``1 + num_speculative_tokens`` tokens a sequence, ``[N, 1 + spec]`` state indices (distinct live slots)
  and ``num_accepted_tokens`` in 1 .. 1 + spec; what the layer launches for the speculative rows of a step;
- ``one``: one token a sequence, ``[N]`` indices, no accepted counts (``fused_recurrent_kda`` takes it; vLLM's NVIDIA
  layer runs its packed decode for plain decode instead).

q, k, v are column views of one ``[T, 3P]`` conv output, ``raw_g`` the gate projection's ``[T, P]`` rows, ``raw_beta``
a column block of the packed projection (its padded row, ``projection_row_stride``), ``A_log`` and ``dt_bias`` fp32,
the pool ``[S, H, V, K]`` fp32 (slot 0 the null block), ``out`` preallocated (vLLM's ``core_attn_out[:, :T]``).
warmreg's ``KDARecurrent`` and, with ``--engine-module``, vLLM's ``fused_recurrent_kda`` from a copy of
``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py`` (loaded by ``_engine_module``, on stand-ins for
its ``vllm.*`` imports where vLLM is not installed) run on identical inputs, each on its own clone of the pool.

Check: one call of each side on fresh clones; ``o`` on live rows and every pool element, warmreg's against vLLM's
(elements differing and the largest distance in representable steps, bf16 for ``o`` and fp32 for the pool: the same
tile, one warp and the same operation order, so bitwise is expected on the GPU), and each against the PyTorch
reference ``kda_recurrent_reference`` (largest absolute difference: a different summation order there).

Timing: ``_timing.interleaved``: each candidate's back-to-back calls captured in a CUDA graph, replayed in interleaved
rounds, the median per call (p10 / p90 beside it); every call advances its own pool in place, as successive steps do;
L2 is not flushed. warmreg runs with PDL where the GPU has it (its default) and without (``warmreg_no_pdl``).

    python benchmarks/kernels_kda_recurrent.py --engine-module PATH [--tag h200_triton-3.6.0]   # on the GPU
    python benchmarks/kernels_kda_recurrent.py --dry-run [--engine-module PATH]   # CPU: interpreter, 2 heads, N = 1, 2
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before any @triton.jit runs (Triton reads it at decoration) and vLLM imports
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps Triton on without a GPU driver (its distributed case)

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write
from _engine_module import load_engine, uses_stand_ins
from warmreg_kimi_k3.backends import KDALayout, kda_layout
from warmreg_kimi_k3.causal_conv1d import projection_row_stride
from warmreg_kimi_k3.kda import KDARecurrent, kda_recurrent_reference
from warmreg_kimi_k3.model import KimiK3, local_pdl

import warmreg

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "kimi_k3.json"
SEQS = (1, 16, 64, 256)
MODES = ("spec", "one")
BF16 = torch.bfloat16
Args = dict[str, Any]


# -- inputs and the two sides -----------------------------------------------------------------------------------------
def deployment(path: Path, heads: int | None) -> KDALayout:
    """The per-rank KDA layout of a config file (``heads`` overrides the heads on one rank)."""
    config = warmreg.WarmConfig.load(path)
    layout = kda_layout(KimiK3.from_config(config), config)
    if layout is None or not layout.num_speculative_tokens:
        raise SystemExit(f"{path}: no KDA layers or no speculative tokens (vLLM never launches the step)")
    return layout if heads is None else attrs.evolve(layout, num_heads=heads)


def step_args(layout: KDALayout, n: int, mode: str, device: str, seed: int = 0) -> Args:
    """One step's arguments of ``fused_recurrent_kda`` (vLLM's names) for ``n`` sequences, ``out`` included."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d, spec = layout.num_heads, layout.head_dim, layout.num_speculative_tokens
    cols = 1 + spec if mode == "spec" else 1
    t, p, row = n * cols, h * d, projection_row_stride(layout)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    conv = randn(t, 3 * p).to(BF16)  # the conv update's empty_like output
    proj = randn(t, row).mul(2).to(BF16)  # the packed projection: beta is its column block after q|k|v|g|f_a
    slots = torch.randperm(n * cols, generator=g, device=device).add(1).to(torch.int32).view(n, cols)
    accepted = torch.randint(1, cols + 1, (n,), generator=g, device=device, dtype=torch.int32)
    return {
        "q": conv[:, :p].view(1, t, h, d), "k": conv[:, p : 2 * p].view(1, t, h, d),
        "v": conv[:, 2 * p :].view(1, t, h, d),
        "raw_g": randn(t, p).sub(1).to(BF16).view(1, t, h, d),  # the gate projection's rows (f_b_proj output)
        "raw_beta": proj[:, 4 * p + d : 4 * p + d + h].unsqueeze(0),
        "A_log": torch.rand(h, generator=g, device=device).mul(1.5).add(0.5).log(),
        "dt_bias": randn(h * d).mul(0.5), "lower_bound": layout.lower_bound,
        "initial_state": randn(n * cols + 1, h, d, d).mul(0.1),  # [S, H, V, K]: slot 0 the null block
        "cu_seqlens": torch.arange(0, t + 1, cols, dtype=torch.int32, device=device),
        "ssm_state_indices": slots if mode == "spec" else slots[:, 0],
        "num_accepted_tokens": accepted if mode == "spec" else None,
        "out": torch.empty(1, t, h, d, dtype=BF16, device=device),
    }  # fmt: skip


def own_side(args: Args) -> Args:
    """The arguments with a clone of the pool and a fresh ``out`` (NaN: rows nobody writes stay visible)."""
    return {**args, "initial_state": args["initial_state"].clone(), "out": torch.full_like(args["out"], float("nan"))}


def warmreg_call(op: KDARecurrent, args: Args, launch_pdl: bool | None) -> torch.Tensor:
    return op(**args, launch_pdl=launch_pdl)


def engine_call(mod: ModuleType, args: Args) -> torch.Tensor:
    """vLLM's call, as the layer makes it (keywords; ``core_attn_out_spec, _ = ...``)."""
    return mod.fused_recurrent_kda(**args)[0]


def live_rows(args: Args) -> torch.Tensor:
    """Tokens of the sequences whose initial slot is live (> 0): the rows both sides must write alike."""
    idx, accepted = args["ssm_state_indices"], args["num_accepted_tokens"]
    if idx.ndim == 1:
        first = idx
    elif accepted is None:
        first = idx[:, 0]
    else:
        first = idx.gather(1, accepted.long()[:, None] - 1)[:, 0]
    lens = args["cu_seqlens"].diff()
    return torch.repeat_interleave(first > 0, lens.long())


# -- comparison -------------------------------------------------------------------------------------------------------
def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1).view({16: torch.int16, 32: torch.int32}[torch.finfo(a.dtype).bits]).long()


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in representable steps (bit patterns on a monotone integer line; +0 and -0 are 0 apart)."""
    sign = 1 << (torch.finfo(a.dtype).bits - 1)
    x, y = _bits(a), _bits(b)
    x, y = torch.where(x < 0, -(x + sign), x), torch.where(y < 0, -(y + sign), y)
    return (x - y).abs()


def _distance(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """``differing``: elements whose bytes differ; ``max_steps``: the largest distance in representable steps."""
    steps = _steps(a, b)
    return {"differing": int((_bits(a) != _bits(b)).sum()), "of": steps.numel(),
            "max_steps": int(steps.max()) if steps.numel() else 0,
            "max_abs": float((a.float() - b.float()).abs().max()) if steps.numel() else 0.0}  # fmt: skip


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check(op: KDARecurrent, mod: ModuleType | None, args: Args) -> dict[str, Any]:
    """Each side once on its own clone of the pool: warmreg's ``o`` (live rows) and pool against vLLM's when given,
    both against the reference."""
    live = live_rows(args)
    ref_args = {k: v for k, v in args.items() if k != "out"}
    ref_o, ref_pool = kda_recurrent_reference(**ref_args)
    ours = own_side(args)
    o = warmreg_call(op, ours, None)
    result: dict[str, Any] = {
        "live_rows": int(live.sum()), "rows": int(live.numel()),
        "warmreg_vs_reference": {"o_max_abs": _max_abs(o[:, live], ref_o[:, live]),
                                 "pool_max_abs": _max_abs(ours["initial_state"], ref_pool)},
    }  # fmt: skip
    if mod is not None:
        theirs = own_side(args)
        want = engine_call(mod, theirs)
        result["vllm_vs_reference"] = {"o_max_abs": _max_abs(want[:, live], ref_o[:, live]),
                                       "pool_max_abs": _max_abs(theirs["initial_state"], ref_pool)}  # fmt: skip
        result["o_vs_vllm"] = _distance(o[:, live], want[:, live])
        result["pool_vs_vllm"] = _distance(ours["initial_state"], theirs["initial_state"])
    return result


# -- timing -----------------------------------------------------------------------------------------------------------
def time_graphs(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Any]:
    """Back-to-back calls replayed from a CUDA graph, candidates interleaved (``_timing.interleaved``)."""
    from _timing import interleaved

    out = interleaved(fns, rounds=rounds, target_ms=2.0)
    return {name: {"median_us": s["median_ms"] * 1e3, "p10_us": s["p10_ms"] * 1e3, "p90_us": s["p90_ms"] * 1e3,
                   "spread": s["spread"], "calls_per_round": s["calls_per_round"], "method": s["method"],
                   "raw_us": [round(t * 1e3, 3) for t in s["raw_ms"]]} for name, s in out.items()}  # fmt: skip


def time_wall(fns: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """One call of each, host wall time (the dry run: the interpreter's time, no measure of the kernels)."""
    out = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        out[name] = {"median_us": (time.perf_counter() - t) * 1e6, "method": "one call, wall time (interpreter)"}
    return out


def step_bytes(layout: KDALayout, args: Args) -> int:
    """Bytes a step must move: each sequence's initial state read, each token's state written (all slots live
    here), q/k/v/raw_g/raw_beta read and o written (bf16), the indices and accepted counts."""
    h, d = layout.num_heads, layout.head_dim
    n, t = args["cu_seqlens"].numel() - 1, args["q"].shape[1]
    state = h * d * d * 4
    return n * state + t * state + t * h * (4 * d + 1) * 2 + t * h * d * 2 + args["ssm_state_indices"].numel() * 4


def compiled_launch_pdl(kernel: Any) -> list[bool] | None:
    """The ``launch_pdl`` launch option of every binary a JIT kernel compiled (None where it cannot be read: the
    interpreter, another Triton layout): whether Triton launched vLLM's kernel with PDL."""
    fn = kernel
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):  # through @triton.heuristics / autotune
        fn = fn.fn
    try:
        caches = fn.device_caches.values()
        return sorted({bool(k.metadata.launch_pdl) for cache in caches for k in cache[0].values()})
    except (AttributeError, IndexError, TypeError):
        return None


# -- the run ----------------------------------------------------------------------------------------------------------
def run_step(layout: KDALayout, mod: ModuleType | None, n: int, mode: str, cli: argparse.Namespace,
             device: str) -> dict[str, Any]:  # fmt: skip
    op = KDARecurrent.from_layout(layout, max_num_seqs=n)
    args = step_args(layout, n, mode, device)
    pdl = local_pdl(None)
    key = op.dispatch(q=args["q"], k=args["k"], v=args["v"], raw_g=args["raw_g"], raw_beta=args["raw_beta"],
                      dt_bias=args["dt_bias"], lower_bound=args["lower_bound"], initial_state=args["initial_state"],
                      cu_seqlens=args["cu_seqlens"], num_accepted_tokens=args["num_accepted_tokens"],
                      launch_pdl=pdl)  # fmt: skip
    row: dict[str, Any] = {
        "mode": mode, "seqs": n, "tokens": args["q"].shape[1], "head_sequences": layout.num_heads * n,
        "indices": list(args["ssm_state_indices"].shape), "bytes": step_bytes(layout, args),
        "warmreg_tile": {"block_v": key.block_v, "num_stages": key.num_stages, "num_warps": key.num_warps,
                         "launch_pdl": key.launch_pdl},
    }  # fmt: skip
    if not cli.no_check:
        row["check"] = check(op, mod, args)
    sides = {"warmreg": own_side(args)}
    fns: dict[str, Callable[[], Any]] = {"warmreg": functools.partial(warmreg_call, op, sides["warmreg"], None)}
    if mod is not None:
        sides["vllm"] = own_side(args)
        fns["vllm"] = functools.partial(engine_call, mod, sides["vllm"])
    if pdl:  # the same tile without the launch attribute
        sides["warmreg_no_pdl"] = own_side(args)
        fns["warmreg_no_pdl"] = functools.partial(warmreg_call, op, sides["warmreg_no_pdl"], False)
    timing = time_graphs(fns, cli.graph_rounds) if device == "cuda" else time_wall(fns)
    for s in timing.values():
        s["gb_per_s"] = row["bytes"] / s["median_us"] / 1e3
    row["timing"] = timing
    if mod is not None:
        row["vllm_over_warmreg"] = timing["vllm"]["median_us"] / timing["warmreg"]["median_us"]
        if "warmreg_no_pdl" in timing:
            row["vllm_over_warmreg_no_pdl"] = timing["vllm"]["median_us"] / timing["warmreg_no_pdl"]["median_us"]
        row["vllm_compiled_launch_pdl"] = compiled_launch_pdl(mod.fused_recurrent_kda_fwd_kernel)
    print(_line(row), flush=True)
    return row


def _line(row: dict[str, Any]) -> str:
    tile = row["warmreg_tile"]
    parts = [
        f"{row['mode']:<4} N={row['seqs']:<4} T={row['tokens']:<5} BV={tile['block_v']:<2} st={tile['num_stages']}"
    ]
    parts += [f"{name} {s['median_us']:9.1f} us" for name, s in row["timing"].items()]
    if "vllm_over_warmreg" in row:
        parts.append(f"vllm/warmreg {row['vllm_over_warmreg']:.3f}x")
    chk = row.get("check", {})
    if "o_vs_vllm" in chk:
        o, pool = chk["o_vs_vllm"], chk["pool_vs_vllm"]
        parts.append(f"o differ {o['differing']}/{o['of']} (max {o['max_steps']} steps)")
        parts.append(f"pool differ {pool['differing']} (max {pool['max_steps']} steps)")
    elif chk:
        parts.append(f"o vs reference {chk['warmreg_vs_reference']['o_max_abs']:.3g}")
    return "  ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--engine-module", type=Path, default=None,
                    help="a copy of vLLM's ops/third_party/kda/fused_recurrent.py")  # fmt: skip
    ap.add_argument("--seqs", default=None, help="comma-separated sequence counts N (default 1,16,64,256; 1,2 dry)")
    ap.add_argument("--modes", default=",".join(MODES), help="spec (1 + spec tokens, [N, 1 + spec] indices), one")
    ap.add_argument("--heads", type=int, default=None, help="heads on one rank (default: the config's; 2 dry)")
    ap.add_argument("--graph-rounds", type=int, default=15, help="rounds of the CUDA-graph timing")
    ap.add_argument("--no-check", action="store_true", help="skip the comparisons")
    ap.add_argument("--tag", default=None, help="result name suffix (default h200_triton-<version>; cpu_dryrun)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, 2 heads, N = 1 and 2")
    cli = ap.parse_args()
    device = "cpu" if cli.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run for the CPU-side logic")
    seqs = [int(n) for n in cli.seqs.split(",")] if cli.seqs else ([1, 2] if cli.dry_run else list(SEQS))
    modes = cli.modes.split(",")
    if any(m not in MODES for m in modes):
        sys.exit(f"--modes: each of {MODES} (got {cli.modes})")
    layout = deployment(cli.config, cli.heads if cli.heads is not None else (2 if cli.dry_run else None))
    mod = load_engine(cli.engine_module, entry="fused_recurrent_kda") if cli.engine_module else None
    tag = cli.tag or ("cpu_dryrun" if cli.dry_run else f"h200_triton-{triton.__version__}")
    t0, rows = time.perf_counter(), []
    for mode in modes:  # the file is rewritten after each step: a run cut short keeps what it measured
        for n in seqs:
            rows.append(run_step(layout, mod, n, mode, cli, device))
            data = {
                "config": str(cli.config.relative_to(ROOT) if cli.config.is_relative_to(ROOT) else cli.config),
                "layout": {"num_heads": layout.num_heads, "head_dim": layout.head_dim,
                           "lower_bound": layout.lower_bound, "num_speculative_tokens": layout.num_speculative_tokens,
                           "dtype": layout.dtype, "dt_bias": True, "pool": "[S, H, V, K] float32, contiguous"},
                "engine_module": str(cli.engine_module) if cli.engine_module else None,
                "engine_stand_ins": mod is not None and uses_stand_ins(),
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                "seqs": seqs, "modes": modes,
                "method": ("one call of each side, wall time (the interpreter)" if device != "cuda" else
                           f"_timing.interleaved: {cli.graph_rounds} rounds of a CUDA graph of back-to-back calls "
                           "(about 2 ms a replay), median per call; each side on its own pool, advanced in place"),
                "rows": rows, "wall_s": time.perf_counter() - t0,
            }  # fmt: skip
            path = write(f"kernels_kda_recurrent_{tag}", data)
    print("->", path)


if __name__ == "__main__":
    main()
