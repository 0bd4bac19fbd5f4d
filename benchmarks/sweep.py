"""The zero-JIT sweep: every registered kernel of a deployment, driven like an engine, with the monitor in ``error``.

For each config: ``warmreg.warm(config)``, arm the JIT monitor in ``error`` mode, then run engine steps of a
randomized request mix through EVERY kernel of ``warmreg.plan(config).kernels``. The kernels are driven by the
model family's plugin: its sweep driver (a :class:`warmreg.testing.sweep.Sweep` subclass, declared under the
``warmreg.sweep`` entry-point group; DeepSeek-V4's in ``warmreg_deepseek_v4/sweep.py``, Kimi-K3's in
``warmreg_kimi_k3/sweep.py``) says which layer types a step launches and how. This file names no plugin kernel. A
plan kernel without a driver stops the sweep before anything runs (:class:`SweepError` names it); a driver whose
kernel the plan lacks is skipped.

Steps are decode-only, prefill-only or mixed (the first three one of each, then 5:2:3 at random), decode requests
first as engines schedule them. A decode request carries ``1 + num_speculative_tokens`` tokens (70% of steps), 1
(15%) or either (15%: no uniform decode), and the first step's mix ``1 + num_speculative_tokens`` and 1 (unequal
decode lengths: the C4 indexer's padded decode path); token counts run from 1 to ``max_num_batched_tokens`` and
sequence lengths to ``max_model_len`` (each step first draws its longest sequence: log-uniform and uniform draws
and both extremes); a fifth of the requests replay a bounded SWA window. Inputs are built as an engine builds them
and go through the plugins' launchers (``plan.kernel(name).kernel``): ``query_start_loc``/``seq_lens``/
``positions`` from the batch, persistent block tables of random, valid block ids, the family's caches and random
bf16/fp32 activations; each kernel's outputs feed the next. Once a step, the block-table slot mapping of each
KV-cache group of the plan; then ONE launch per layer TYPE, not per layer (the layers of a type launch the same
keys). A launch that raises :class:`warmreg.JitMissError` (error mode refuses the compile) or fails is recorded
with its batch and the step goes on; the metadata it should have produced is then computed in PyTorch for the
kernels downstream.

Reported per config and kernel: launches, misses (explanations), failures, the monitor's counters as a cross-check,
and every key launched that the plan does not hold; plus steps, tokens and the mix of step kinds.

``--device cpu`` runs the same drivers on CPU tensors through Triton's interpreter: no warm (nothing compiles
there), the plan for ``cuda:90`` (the H200), sizes capped (``--max-tokens``, ``--max-seq-len``, ``--max-seqs``),
and the first launch of each kernel that has a PyTorch reference checked against it.

    python benchmarks/sweep.py [configs...] [--steps 60] [--seed 0] [--tag h200] [--pack CONFIG=PACK]
    python benchmarks/sweep.py --device cpu [--steps 3] [--max-tokens 4] [--max-seq-len 256] [--max-seqs 4]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write

import warmreg
from warmreg.testing.sweep import KINDS, Batch, Limits, SweepError, driver_for, make_batch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = tuple(
    str(ROOT / "examples" / f"{n}.json")
    for n in ("deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3", "kimi_k3_full", "deepseek_v4_flash_0731_dspark")
)
CPU_TARGET = "cuda:90"  # the plan a CPU run drives: the H200's


# -- one config, the CLI -------------------------------------------------------------------------------------------
def run_config(
    config: str,
    *,
    steps: int,
    seed: int,
    device: str,
    max_tokens: int | None,
    pack: str | None = None,
    max_seq_len: int | None = None,
    max_seqs: int | None = None,
    target: str = CPU_TARGET,
) -> dict[str, Any]:
    """Warm ``config`` (CUDA), arm the monitor in ``error`` mode and sweep ``steps`` engine steps.

    :param device: ``"cuda"`` (warm, then the local GPU) or ``"cpu"`` (no warm, Triton's interpreter, the plan for
        ``target``).
    :param target: the plan a CPU run drives (default ``cuda:90``, the H200's; e.g. ``cuda:100`` for a config whose
        kernels only that target plans, such as an MXFP4 indexer). A CUDA run plans for its own GPU.
    :param max_tokens: cap on tokens per step (default: ``max_num_batched_tokens`` on CUDA, 4 on the CPU).
    :param pack: warm from this pack (CUDA).
    :param max_seq_len: cap on sequence lengths (default: ``max_model_len`` on CUDA, 256 on the CPU).
    :param max_seqs: cap on requests per step (default: ``max_num_seqs`` on CUDA, 4 on the CPU).
    :returns: the config's results (see the module docstring).
    :raises SweepError: for a config without a driver, a plan kernel its driver does not drive, or CUDA requested
        without a GPU.
    """
    t0, dev = time.perf_counter(), torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SweepError("--device cuda needs a GPU; --device cpu runs the kernels through Triton's interpreter")
    plan = warmreg.plan(config) if cuda else warmreg.plan(config, target=target)
    driver = driver_for(plan)  # the model family's, checked to drive every plan kernel
    warm: dict[str, Any] | str = "skipped on the CPU: kernels run through Triton's interpreter, nothing compiles"
    if cuda:
        t = time.perf_counter()
        report = warmreg.warm(config, pack=pack, on_error="continue")
        failed = [(r.kernel, str(r.key), r.error) for r in report.failed]
        tuning = report.stage("tuning")  # the Tune stage's section: its choices and seconds (empty without tuning)
        warm = {
            "summary": report.summary(), "wall_s": time.perf_counter() - t, "failed": failed,
            "tuning": list(tuning.get("choices", [])), "tuning_s": tuning.get("seconds", 0.0),
        }  # fmt: skip
    spec = driver.speculative_tokens(plan.config)
    lim = Limits.of(plan.config, cuda=cuda, spec=spec, max_tokens=max_tokens, max_seq_len=max_seq_len, max_seqs=max_seqs)
    sweep = driver(plan, dev, lim, seed)
    rng, batches = random.Random(seed), []
    mon = warmreg.arm("error")
    try:
        for i in range(steps):
            kind = KINDS[i] if i < len(KINDS) else rng.choices(KINDS, weights=(5, 2, 3))[0]
            batches.append(make_batch(rng, kind, lim, mix_decode=i == 0))
            sweep.step(batches[-1], i)
        if cuda:
            torch.cuda.synchronize()
    finally:
        warmreg.disarm(mon)
    head = {"config": config, "device": device, "platform": plan.platform.target, "pack": pack, "warm": warm}
    body = {"limits": vars(lim), "layer_types": sweep.layer_types(), **_mix(batches), **sweep.results(mon)}
    return {**head, **body, "monitor_misses": len(mon.misses), "wall_s": time.perf_counter() - t0}


def _mix(batches: list[Batch]) -> dict[str, Any]:
    """Steps, tokens, requests and the distribution of step kinds."""
    kinds = Counter(b.kind for b in batches)
    tokens = [b.tokens for b in batches]
    return {
        "steps": len(batches),
        "tokens": sum(tokens),
        "step_kinds": dict(kinds),
        "tokens_per_kind": {k: sum(b.tokens for b in batches if b.kind == k) for k in kinds},
        "step_tokens": {"min": min(tokens, default=0), "max": max(tokens, default=0)},
        "requests": sum(len(b.qlens) for b in batches),
        "max_seq_len_seen": max((max(b.seqs) for b in batches), default=0),
        "uniform_decode_steps": sum(1 for b in batches if b.num_decodes and b.uniform_decode_len),
    }


def _summary(run: dict[str, Any]) -> str:
    k = run["kernels"].values()
    launches, misses, failures = (sum(x[f] for x in k) for f in ("launches", "misses", "failures"))
    kinds = ", ".join(f"{n} {c}" for n, c in run["step_kinds"].items())
    return (
        f"{run['config']}: {run['steps']} steps ({kinds}), {run['tokens']} tokens; {launches} launches of "
        f"{len(run['kernels'])} kernels, {misses} misses, {failures} failures, {len(run['step_failures'])} step "
        f"failures, {len(run['not_launched'])} kernels never launched ({run['wall_s']:.1f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("configs", nargs="*", default=list(EXAMPLES))
    ap.add_argument("--steps", type=int, default=None, help="engine steps per config (default 60; 3 on cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None, help='results file suffix (default "h200"; "cpu" with --device cpu)')
    ap.add_argument("--pack", action="append", default=[], help="CONFIG=PACK: warm that config from a pack")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--max-tokens", type=int, help="cap on tokens per step (default: the config's; 4 on cpu)")
    ap.add_argument("--max-seq-len", type=int, help="cap on sequence lengths (default: the config's; 256 on cpu)")
    ap.add_argument("--max-seqs", type=int, help="cap on requests per step (default: the config's; 4 on cpu)")
    args = ap.parse_args()
    packs = dict(p.split("=", 1) for p in args.pack)
    sizes = dict(max_tokens=args.max_tokens, max_seq_len=args.max_seq_len, max_seqs=args.max_seqs)
    steps = args.steps or (60 if args.device == "cuda" else 3)
    runs: list[dict[str, Any]] = []
    crashed: list[dict[str, str]] = []
    name = f"sweep_{args.tag or ('h200' if args.device == 'cuda' else 'cpu')}"
    for config in args.configs:
        try:
            run = run_config(config, steps=steps, seed=args.seed, device=args.device, pack=packs.get(config), **sizes)
        except SweepError as exc:
            sys.exit(f"sweep: {exc}")
        except Exception as exc:  # recorded, and the other configs still run (a CUDA fault may stop them too)
            crashed.append(
                {"config": config, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            )
            print(f"{config}: crashed: {type(exc).__name__}: {exc}", flush=True)
            continue
        runs.append(run)
        print(_summary(run), flush=True)
        write(name, {"configs": runs, "crashed": crashed})  # after each config: a later crash loses nothing
    path = write(name, {"configs": runs, "crashed": crashed})
    for run in runs:
        print(run["config"])
        for name, k in run["kernels"].items():
            print(f"  {name}: {k['launches']} launches, {k['misses']} misses, {k['failures']} failures")
    print("->", path)
    bad = sum(k["misses"] + k["failures"] for run in runs for k in run["kernels"].values())
    sys.exit(1 if bad or crashed or any(run["step_failures"] or run["not_launched"] for run in runs) else 0)


if __name__ == "__main__":
    main()
