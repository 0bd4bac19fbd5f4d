"""An autotuned deployment's warm against its critical path: the Kimi-K3 full example (every autotune candidate of
the chunked KDA prefill is a key), cold, from its pack, and its slowest key compiled alone, in one run.

Each step is a fresh process with its own empty Triton cache, started as an engine starts (``warmreg.prefetch()``,
CUDA up, the prefetch done while the weights load; with the pack, ``prefetch(pack=...)`` installs it meanwhile):

- ``cold``: ``warm()`` with every core; every key's compile time as the warm measured it (its worker's wall,
  other compiles running beside it) and, for a key that is an autotune candidate, which candidate it is;
- ``critical_path``: the key that took longest in ``cold``, compiled alone in a fresh process and cache (the
  floor of a cold warm however many cores it has: ``kimi_full_critical_path_s``), plus the same for the slowest
  key of every other kernel with candidates, so a candidate that is slow to compile is named;
- ``pack`` (with ``--pack``): ``warm()`` from the config's pack, prefetched; the tuning choices come from the pack
  (``tuning`` in the report: what was benchmarked, 0 when every choice came from the pack).

Writes ``benchmarks/results/autotune_warm_<tag>.json``; ``benchmarks/summary.py`` copies ``kimi_full_cold_s``,
``kimi_full_critical_path_s`` and ``kimi_full_pack_s`` from it.

    python benchmarks/autotune_warm.py [examples/kimi_k3_full.json] [--pack PACK] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write

ROOT = Path(__file__).resolve().parents[1]

_WARM = r"""
import json, sys, time, torch, warmreg
CONFIG, PACK, TARGET = json.loads(sys.argv[1])
warmreg.prefetch(pack=PACK)
if TARGET is None:
    torch.empty(1, device="cuda")
from warmreg.api.prefetch import wait_for_prefetch
wait_for_prefetch()
t = time.perf_counter()
r = warmreg.warm(CONFIG, target=TARGET, on_error="continue", pack=PACK, progress=False)
wall = time.perf_counter() - t
keys = [{"kernel": x.kernel, "key": str(x.key), "candidate": getattr(x.key, "config", None), "status": x.status,
         "seconds": x.seconds, "load_seconds": x.load_seconds} for x in r.results]
print(json.dumps({"wall": wall, "summary": r.summary(), "compiled": r.compiled, "from_cache": r.from_cache,
                  "failed": len(r.failed), "tuning": r.stage("tuning"), "pack": r.stage("pack").get("summary"),
                  "processes": r.stage("processes").get("processes", 0), "processes_timeline": r.stage("processes").get("timeline", {}), "rehearsal": r.stage("rehearsal"), "keys": keys},
                 default=str))
"""

_ONE_KEY = r"""
import json, sys, time, attrs, torch, warmreg
from warmreg.pipeline.run import run as _run
from warmreg.stages import compose
CONFIG, KERNEL, KEY, TARGET = json.loads(sys.argv[1])
if TARGET is None:
    torch.empty(1, device="cuda")
plan = warmreg.plan(CONFIG, target=TARGET)
kp = next(k for k in plan.kernels if k.name == KERNEL)
key = next(k for k in kp.keys if str(k) == KEY)
one = attrs.evolve(plan, kernels=(attrs.evolve(kp, keys=(key,)),))
stages = compose.for_warm(one, workers=1, pack=None, shard=None, rehearse=False)
t = time.perf_counter()
results = _run(one, workers=1, on_error="continue", stages=stages, progress=False)
print(json.dumps({"wall": time.perf_counter() - t, "seconds": [x.seconds for x in results],
                  "status": [x.status for x in results]}, default=str))
"""


def _child(code: str, payload: list[Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"a benchmark process exited with {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_choices(pack: str) -> None:
    """``kimi_full_pack_s`` is a warm that takes its tuning choices from the pack: refuse, before anything runs, a
    pack without them (a cross build, ``--target``, records none; the warm from it would benchmark every candidate)."""
    from warmreg.stages.pack import inspect_pack

    if not inspect_pack(pack).tuning:
        raise SystemExit(
            f"--pack {pack}: the pack carries no autotune choices, so a warm from it would benchmark; build it on this "
            "GPU without --target (warmreg build CONFIG -o PACK), or pass --tuning with a cross build"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="examples/kimi_k3_full.json")
    ap.add_argument("--pack", default=None, help="a pack of the config for this GPU and Triton release")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--target", default=None, help="cross-compile for this target (a check of the benchmark without a GPU)")
    args = ap.parse_args()
    if args.pack:
        _check_choices(args.pack)
    cold = _child(_WARM, [args.config, None, args.target])
    by_kernel: dict[str, dict[str, Any]] = {}
    for k in cold["keys"]:
        if k["status"] == "compiled" and k["seconds"] > by_kernel.get(k["kernel"], {"seconds": -1.0})["seconds"]:
            by_kernel[k["kernel"]] = k
    if not by_kernel:
        raise SystemExit(f"the cold warm compiled nothing: {cold['summary']}")
    slowest = max(by_kernel.values(), key=lambda k: k["seconds"])
    alone = {}
    for name, k in sorted(by_kernel.items(), key=lambda kv: -kv[1]["seconds"]):
        if k is slowest or k["candidate"] is not None:
            alone[name] = {**k, "alone": _child(_ONE_KEY, [args.config, name, k["key"], args.target])}
    critical = alone[slowest["kernel"]]["alone"]["wall"]
    out: dict[str, Any] = {
        "config": args.config,
        "cpus": len(os.sched_getaffinity(0)),
        "cold": cold,
        "slowest_key": slowest,
        "alone": alone,
        "kimi_full_cold_s": cold["wall"],
        "kimi_full_critical_path_s": critical,
        "cold_over_critical_path": cold["wall"] / critical,
    }
    if args.pack:
        pack = _child(_WARM, [args.config, str(Path(args.pack).resolve()), args.target])
        out.update(pack=pack, kimi_full_pack_s=pack["wall"])
    path = write(f"autotune_warm_{args.tag}", out)
    shown = {k: v for k, v in out.items() if k.startswith(("kimi_full", "cold_over"))}
    print(json.dumps(shown, indent=1), "slowest:", slowest["kernel"], slowest["key"], round(slowest["seconds"], 2), "->", path)


if __name__ == "__main__":
    main()
