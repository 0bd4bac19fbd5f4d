"""What the first launch after warm pays on the host's CPU, on a machine without a GPU: the fused
Q/KV RMSNorm's launch code (checks, the memoized key, two allocations, the ``LaunchSpec``; no
launch) on CPU tensors, first call against the median of the next ``--steady``, each sample its
own process after a warm for ``--target`` (cross-compiled, so no rehearsal runs). Variants:

- ``after_warm``: the first call right after the warm;
- ``touch``: after the same call once on scratch inputs (the rehearsal's effect, and what is left
  when nothing runs between);
- ``touch_then_memory_walk``: ``touch``, then 64 MiB of memory touched (as other start-up work
  does) before the first call: how much of a first call is the CPU cache state.

    python benchmarks/first_call_cpu.py [examples/deepseek_v4_flash.json] [--processes 5] [--tag cpu2core]
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
import json, sys, time, torch, warmreg
sys.path.insert(0, "benchmarks")
from _common import memory_walk, qkv_decode_inputs
from warmreg.ops import FusedQKVRMSNorm
config, target, variant, steady_n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
warmreg.warm(config, target=target, on_error="continue", progress=False)
op = warmreg.plan(config, target=target).kernel(FusedQKVRMSNorm.name).kernel
body = type(op).__call__.__wrapped__
cpu = torch.device("cpu")
args = qkv_decode_inputs(op, cpu)
if variant != "after_warm":
    for _ in range(2):
        body(op, *qkv_decode_inputs(op, cpu), 1e-6, True)
if variant == "touch_then_memory_walk":
    memory_walk(64)
now = time.perf_counter

def one():
    t = now(); body(op, *args, 1e-6, True); return (now() - t) * 1e6

first = one()
steady = sorted(one() for _ in range(steady_n))
print(json.dumps({"first_us": first, "steady_us": steady[len(steady) // 2]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "examples" / "deepseek_v4_flash.json"))
    ap.add_argument("--target", default="cuda:90")
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--steady", type=int, default=50)
    ap.add_argument("--tag", default="cpu2core")
    args = ap.parse_args()
    out: dict[str, object] = {"config": args.config, "target": args.target, "processes": args.processes, "variants": {}}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        subprocess.run([sys.executable, "-c", "import warmreg, sys; warmreg.warm(sys.argv[1], target=sys.argv[2], progress=False)", args.config, args.target],
                       env=env, check=True, cwd=ROOT)  # fmt: skip
        for variant in ("after_warm", "touch", "touch_then_memory_walk"):
            runs = []
            for _ in range(args.processes):
                proc = subprocess.run([sys.executable, "-c", _PROCESS, args.config, args.target, variant, str(args.steady)],
                                      env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
                if proc.returncode != 0:
                    raise SystemExit(f"{variant}: {proc.stderr[-3000:]}")
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            ratios = [r["first_us"] / r["steady_us"] for r in runs]
            out["variants"][variant] = {"runs": runs, "first_over_steady": ratios, "median_first_over_steady": median(ratios)}  # type: ignore[index]
            print(variant, round(median(ratios), 2), [round(r["first_us"], 1) for r in runs], [round(r["steady_us"], 1) for r in runs])
    print("->", write(f"first_call_cpu_{args.tag}", out))


if __name__ == "__main__":
    main()
