"""The first launch after warm against the steady launch, over fresh processes, with where it goes.

A first launch happens once per process, so each sample is its own process: warm the config (the
disk cache is warm after the first), then time warmreg's fused Q/KV RMSNorm at T = 1 (launch and
synchronize, as ``launch_floor.py`` does) once, then ``--steady`` more times. Variants, each over
``--processes`` processes:

- ``op``: the whole op, first call against the median of the steady calls (``first_over_steady``);
- ``phases``: the same call split into the launch code (checks, key, allocations: the op's
  ``LaunchSpec``), ``warmreg.runtime.launch.run`` (lookups and the fast launch) and the synchronize;
- ``no_rehearsal``: ``op`` after a warm with ``rehearse=False``;
- ``eager_modules``: ``op`` with ``CUDA_MODULE_LOADING=EAGER`` (the driver loads every function at
  module load instead of at its first launch);
- ``touch``: ``op`` right after one call of the same op on scratch inputs (what is left when
  nothing ran between: the CPU's caches hold the launch path);
- ``touch_then_memory_walk``: ``touch``, then 64 MiB of memory touched before the first call, as
  other start-up work does (how much of the gap is the CPU cache state, not an initialization);
- ``walk_each``: ``op`` with the same 64 MiB walk before the first call and before each steady one:
  the first launch against steady ones in the same CPU cache state (what a one-time cost left
  after warm would show as: a ratio above 1);
- ``inputs_each``: ``op`` with fresh inputs built (and the GPU synchronized) before the first call
  and before each steady one: steady launches that each follow other work, as in a serving loop;
- ``plan_each``: ``op`` with all of what precedes its first call after warm (``warmreg.plan``, fresh
  inputs, a synchronize) before the first call and before each steady one: the first launch
  against steady launches that follow the same work (``first_over_steady_same_work`` in
  ``summary.json``), so a ratio above 1 is what the first launch pays once.

    python benchmarks/first_launch.py [examples/deepseek_v4_flash.json] [--processes 5] [--tag NAME] [--variants op,plan_each]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write

ROOT = Path(__file__).resolve().parents[1]

_PROCESS = """
import json, sys, time, torch, warmreg, warmreg.runtime.launch
sys.path.insert(0, "benchmarks")
from _common import memory_walk, qkv_decode_inputs
from warmreg.ops import FusedQKVRMSNorm
config, variant, steady_n = sys.argv[1], sys.argv[2], int(sys.argv[3])
dev = torch.device("cuda")
torch.empty(1, device=dev)  # an engine has CUDA up before it warms
warmreg.warm(config, on_error="continue", progress=False, rehearse=variant != "no_rehearsal")
op = warmreg.plan(config).kernel(FusedQKVRMSNorm.name).kernel
a, b, qw, kvw = qkv_decode_inputs(op, dev)
if variant in ("touch", "touch_then_memory_walk"):  # the same op once on scratch inputs, just before
    op(*qkv_decode_inputs(op, dev), 1e-6)
if variant == "touch_then_memory_walk":  # then touch 64 MiB, as other start-up work does
    memory_walk(64)
torch.cuda.synchronize()
body = type(op).__call__.__wrapped__
now = time.perf_counter

def whole():
    t = now(); op(a, b, qw, kvw, 1e-6); torch.cuda.synchronize(); return {"total": (now() - t) * 1e3}

def phases():
    t0 = now(); spec = body(op, a, b, qw, kvw, 1e-6); t1 = now()
    warmreg.runtime.launch.run(op, spec); t2 = now(); torch.cuda.synchronize(); t3 = now()
    return {"launch_code": (t1 - t0) * 1e3, "run": (t2 - t1) * 1e3, "synchronize": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3}

fn = phases if variant == "phases" else whole
if variant == "walk_each":  # every call, the first and each steady one, after the same 64 MiB walk
    def fn(inner=fn):
        memory_walk(64); return inner()
if variant == "inputs_each":  # every call, the first and each steady one, on inputs built just before it
    def fn(inner=fn):
        global a, b, qw, kvw
        a, b, qw, kvw = qkv_decode_inputs(op, dev); torch.cuda.synchronize(); return inner()
if variant == "plan_each":  # every call after all that precedes the first call in op (one op throughout,
    def fn(inner=fn):       # so what an op instance does once still shows in its first call)
        global a, b, qw, kvw
        warmreg.plan(config).kernel(FusedQKVRMSNorm.name)
        a, b, qw, kvw = qkv_decode_inputs(op, dev); torch.cuda.synchronize(); return inner()
first = fn()
steady = [fn() for _ in range(steady_n)]
print(json.dumps({"first": first, "steady": {k: sorted(s[k] for s in steady)[len(steady) // 2] for k in first}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "examples" / "deepseek_v4_flash.json"))
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--steady", type=int, default=50)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--variants", default=None, help="comma-separated variants to run (op always runs; default: all)")
    args = ap.parse_args()
    variants = {
        "op": {}, "phases": {}, "no_rehearsal": {}, "eager_modules": {"CUDA_MODULE_LOADING": "EAGER"},
        "touch": {}, "touch_then_memory_walk": {}, "walk_each": {}, "inputs_each": {}, "plan_each": {},
    }  # fmt: skip
    if args.variants:
        variants = {name: env for name, env in variants.items() if name in args.variants.split(",") or name == "op"}
    out: dict[str, object] = {"config": args.config, "processes": args.processes, "steady_calls": args.steady, "variants": {}}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        subprocess.run([sys.executable, "-c", "import warmreg, sys; warmreg.warm(sys.argv[1], progress=False)", args.config],
                       env=env, check=True, cwd=ROOT)  # fmt: skip
        for name, extra in variants.items():
            runs = []
            for _ in range(args.processes):
                proc = subprocess.run(
                    [sys.executable, "-c", _PROCESS, args.config, name, str(args.steady)],
                    env={**env, **extra}, capture_output=True, text=True, timeout=600, cwd=ROOT,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise SystemExit(f"{name}: {proc.stderr[-3000:]}")
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            ratios = [r["first"]["total"] / r["steady"]["total"] for r in runs]
            out["variants"][name] = {  # type: ignore[index]
                "env": extra,
                "runs": runs,
                "first_over_steady": ratios,
                "median_first_over_steady": median(ratios),
                "median_first_ms": {k: median([r["first"][k] for r in runs]) for k in runs[0]["first"]},
                "median_steady_ms": {k: median([r["steady"][k] for r in runs]) for k in runs[0]["steady"]},
            }
            print(name, round(median(ratios), 3), out["variants"][name]["median_first_ms"], out["variants"][name]["median_steady_ms"])  # type: ignore[index]
    out["first_over_steady"] = out["variants"]["op"]["median_first_over_steady"]  # type: ignore[index]
    print("->", write(f"first_launch_{args.tag}", out))


if __name__ == "__main__":
    main()
