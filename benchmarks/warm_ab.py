"""Warm time of two checkouts side by side on this machine: this tree against a baseline tree.

Each round runs both, alternating (A, B, A, B, ...), each in a fresh process: a cold warm into an
empty Triton cache, then a warm from that cache. Each tree warms its own copy of the config (the same
path inside each tree). The checkout is chosen by ``PYTHONPATH`` (its core
and both plugins), so the same interpreter, Triton and torch run both. Writes
benchmarks/results/warm_ab_<tag>.json with every round's wall times, the medians and the ratios.

    git worktree add /tmp/base <commit>
    python benchmarks/warm_ab.py examples/deepseek_v4_flash.json --baseline /tmp/base [--tree DIR] [--rounds 5] [--target cuda:90]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write

ROOT = Path(__file__).resolve().parents[1]

_WARM = """
import json, time, torch, warmreg
from warmreg import warm  # the pipeline (and torch) imported before the timer, as in an engine
t = time.perf_counter()
r = warm({config!r}, target={target!r}, workers={workers}, on_error="continue", progress=False)
wall = time.perf_counter() - t
assert r.ok, r.summary()
print(json.dumps({{"wall": wall, "keys": r.declared, "compiled": r.compiled, "from_cache": r.from_cache, "core": warmreg.__file__}}))
"""


def _run(tree: Path, code: str, cache: str) -> dict:
    path = os.pathsep.join(str(tree / p) for p in ("", "plugins/deepseek_v4", "plugins/kimi_k3"))
    env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--baseline", required=True, help="a checkout of the commit to compare against")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout measured against it (default: this one)")
    ap.add_argument("--target", default="cuda:90")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="cpu2core")
    args = ap.parse_args()
    workers = len(os.sched_getaffinity(0))
    trees = {"this": Path(args.tree).resolve(), "baseline": Path(args.baseline).resolve()}
    relative = Path(args.config).resolve().relative_to(ROOT)  # each tree warms its own copy of the config
    codes = {name: _WARM.format(config=str(tree / relative), target=args.target, workers=workers) for name, tree in trees.items()}
    rounds: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm_cache": []} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name, tree in trees.items():
                cache = os.path.join(tmp, f"{name}-{i}")
                os.makedirs(cache)
                cold = _run(tree, codes[name], cache)
                assert cold["core"].startswith(str(tree)), cold["core"]
                rounds[name]["cold"].append(cold["wall"])
                rounds[name]["warm_cache"].append(_run(tree, codes[name], cache)["wall"])
    medians = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rounds.items()}
    ratios = {k: medians["this"][k] / medians["baseline"][k] for k in ("cold", "warm_cache")}
    results = {
        "config": args.config, "target": args.target, "workers": workers, "trees": {k: str(v) for k, v in trees.items()},
        "commits": {k: subprocess.run(["git", "-C", str(v), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() for k, v in trees.items()},
        "rounds": rounds, "medians": medians, "this_over_baseline": ratios,
    }  # fmt: skip
    path = write(f"warm_ab_{args.tag}", results)
    print(json.dumps({"medians": medians, "this_over_baseline": ratios}, indent=1), "->", path)


if __name__ == "__main__":
    main()
