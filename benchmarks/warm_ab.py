"""Warm time of two checkouts side by side on this machine: this tree against a baseline tree.

Each round runs both, alternating (A, B, A, B, ...), each in a fresh process: a cold warm into an
empty Triton cache, then a warm from that cache, and with ``--pack`` a warm from that pack into
another empty cache; each after ``warmreg.prefetch()`` (``prefetch(pack=...)``, which installs the pack)
has finished, as an engine starts (its weights load meanwhile). Each
tree warms its own copy of the config (the same path inside each tree). The checkout is chosen by
``PYTHONPATH`` (its core and both plugins), so the same interpreter, Triton and torch run both. Each
run also reports the cyclic garbage collector's pauses inside the timed warm (a full collection
walks every object of the process, torch's included, whoever made them). Writes
benchmarks/results/warm_ab_<tag>.json with every round's wall times, the medians, their ratio and the
median of each round's own ratio (both trees back to back: a host that drifts between rounds cancels).

    git worktree add /tmp/base <commit>
    python benchmarks/warm_ab.py examples/deepseek_v4_flash.json --baseline /tmp/base [--tree DIR] [--rounds 5]
        [--target cuda:90 | --target local] [--pack PACK] [--only cold,warm_cache,from_pack] [--warmup 1] [--gpu-targets 90]
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
import gc, json, time, torch, warmreg
from warmreg import warm  # the pipeline (and torch) imported before the timer, as in an engine
if {target!r} is None:  # an engine has CUDA up before it warms
    torch.empty(1, device="cuda")
if {gpu_targets!r}:  # --gpu-targets: what the prefetch reads off a GPU host's NVML, on a machine with none
    import warmreg._triton as _t
    from triton.backends.compiler import GPUTarget
    _t.local_targets = lambda: [GPUTarget("cuda", arch, 32) for arch in {gpu_targets!r}]
warmreg.prefetch(pack={pack!r})  # ... and prefetched at start-up (with its pack), done while its weights loaded
try:  # as benchmarks/warm_time.py waits for the prefetch
    from warmreg.api.prefetch import wait_for_prefetch
    wait_for_prefetch()
except ImportError:  # a baseline from before wait_for_prefetch
    from warmreg.api.prefetch import wait_for_plugins
    from warmreg._triton import cache as _triton_cache
    from warmreg.stages import pack as _packs
    _triton_cache.wait_triton_key(); wait_for_plugins()
    for _f in list(_packs._PREFETCHED.values()): _f.exception()
pauses, began = [], [0.0]
def _gc(phase, info):
    if phase == "start": began[0] = time.perf_counter()
    else: pauses.append((info["generation"], time.perf_counter() - began[0]))
gc.callbacks.append(_gc)
t = time.perf_counter()
r = warm({config!r}, target={target!r}, workers={workers}, on_error="continue", progress=False, pack={pack!r})
wall = time.perf_counter() - t
gc.callbacks.remove(_gc)
assert r.ok, r.summary()
print(json.dumps({{"wall": wall, "keys": r.declared, "compiled": r.compiled, "from_cache": r.from_cache, "core": warmreg.__file__,
                   "gc_ms": sum(p for _, p in pauses) * 1e3, "gc_full": sum(1 for g, _ in pauses if g == 2)}}))
"""


def _run(tree: Path, code: str, cache: str) -> dict:
    # the tree first; then this process's own PYTHONPATH (another Triton release's copy, on the GPU host)
    path = os.pathsep.join([*(str(tree / p) for p in ("", "plugins/deepseek_v4", "plugins/kimi_k3")), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    if out.returncode:  # the child's own error, not only its exit status
        raise SystemExit(f"a warm of {tree} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--baseline", required=True, help="a checkout of the commit to compare against")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout measured against it (default: this one)")
    ap.add_argument("--target", default="cuda:90", help="a cross target, or 'local' for this machine's GPU")
    ap.add_argument("--pack", default=None, help="also warm from this pack (prefetched) into a fresh cache")
    ap.add_argument("--only", default="cold,warm_cache,from_pack", help="comma-separated: cold, warm_cache, from_pack")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=0, help="rounds run first and not recorded (the page cache, bytecode files)")
    ap.add_argument("--commits", default=None, help="'THIS,BASELINE' commit names where the trees are no git checkouts")
    ap.add_argument("--gpu-targets", default="", help="e.g. 90: the local GPUs' targets the prefetch makes binders for "
                    "(on a CPU machine, as NVML reports them on a GPU host; a tree without the prefetch's binders ignores it)")
    ap.add_argument("--tag", default="cpu2core")
    args = ap.parse_args()
    workers = len(os.sched_getaffinity(0))
    target = None if args.target == "local" else args.target
    gpu_targets = [int(a) for a in args.gpu_targets.split(",") if a]
    only = [v for v in ("cold", "warm_cache", "from_pack") if v in args.only.split(",") and (v != "from_pack" or args.pack)]
    trees = {"this": Path(args.tree).resolve(), "baseline": Path(args.baseline).resolve()}
    relative = Path(args.config).resolve().relative_to(ROOT)  # each tree warms its own copy of the config
    codes = {
        (name, pack): _WARM.format(config=str(tree / relative), target=target, workers=workers, pack=pack, gpu_targets=gpu_targets)
        for name, tree in trees.items() for pack in (None, args.pack)
    }  # fmt: skip
    rounds: dict[str, dict[str, list[float]]] = {name: {v: [] for v in only} for name in trees}
    gc_ms: dict[str, dict[str, list[float]]] = {name: {v: [] for v in only} for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(-args.warmup, args.rounds):
            for name, tree in trees.items():
                runs = []
                cache = os.path.join(tmp, f"{name}-{i}")
                os.makedirs(cache)
                if "cold" in only or "warm_cache" in only:
                    runs.append(("cold", _run(tree, codes[name, None], cache)))
                if "warm_cache" in only:
                    runs.append(("warm_cache", _run(tree, codes[name, None], cache)))
                if "from_pack" in only:
                    os.makedirs(cache + "-pack")
                    runs.append(("from_pack", _run(tree, codes[name, args.pack], cache + "-pack")))
                for variant, run in runs:
                    assert run["core"].startswith(str(tree)), run["core"]
                    if variant in only and i >= 0:
                        rounds[name][variant].append(run["wall"])
                        gc_ms[name][variant].append(run["gc_ms"])
    medians = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rounds.items()}
    ratios = {k: medians["this"][k] / medians["baseline"][k] for k in only}
    # the ratio within each round, where both trees ran back to back: a host that drifts between rounds cancels
    paired = {k: statistics.median(a / b for a, b in zip(rounds["this"][k], rounds["baseline"][k])) for k in only}
    commits = dict(zip(trees, args.commits.split(","))) if args.commits else {
        k: subprocess.run(["git", "-C", str(v), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() for k, v in trees.items()
    }  # fmt: skip
    results = {
        "config": args.config, "target": args.target, "pack": args.pack, "gpu_targets": gpu_targets, "workers": workers, "trees": {k: str(v) for k, v in trees.items()},
        "commits": commits, "warmup_rounds": args.warmup, "rounds": rounds, "gc_ms": gc_ms, "medians": medians,
        "this_over_baseline": ratios, "this_over_baseline_paired": paired,
    }  # fmt: skip
    path = write(f"warm_ab_{args.tag}", results)
    print(json.dumps({"medians": medians, "this_over_baseline": ratios, "this_over_baseline_paired": paired}, indent=1), "->", path)


if __name__ == "__main__":
    main()
