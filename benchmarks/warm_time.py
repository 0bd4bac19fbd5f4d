"""Warm time side by side: serial, threads only (Triton async compile), processes (the default:
misses compiled by forked children, ``warmreg.stages.processes``), warm disk cache, pack.

Each variant runs in a fresh subprocess with its own empty Triton cache, so in-memory state never
leaks between them. A prefetched variant starts as an engine does: ``warmreg.prefetch()`` (with a
pack variant's pack: ``prefetch(pack=...)``, which installs it meanwhile; ``from_pack_installed_in_warm``
leaves the install to the warm), CUDA up, the prefetch done while the weights load; the timer
starts at ``warm()``, and the pack note says how long the install took and where. With ``--quick
--rounds N`` the prefetched cold, warm-cache and pack variants run N times each (a fresh process, and
for cold and pack a fresh cache, each time) and report the median run with every round's wall, and
each round's parts in the order they ran (``round_parts``: plan, compile, load, rehearsal, forked
compile, and the garbage collector's pauses inside the timed warm). Every run records those pauses.
Writes benchmarks/results/warm_time_<machine>.json.

    python benchmarks/warm_time.py examples/deepseek_v4_flash.json [--target cuda:90] [--pack PACK] [--tag NAME] [--quick [--rounds N]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write

_WARM = """
import json, sys, time, torch, warmreg
if {prefetch!r}:  # engine-style start-up: warmreg.prefetch() first (with the pack it will warm with), then the rest
    warmreg.prefetch(pack={pack!r} if {prefetch_pack!r} else None)
if {target!r} is None:  # an engine has CUDA up before it warms: keep context creation out of the timing
    torch.empty(1, device="cuda")
if {pool!r}:  # cache hits on the compile pool too, as before warmreg.pipeline.compile.INLINE_HITS
    import warmreg.pipeline.compile; warmreg.pipeline.compile.INLINE_HITS = False
if not {processes!r}:  # misses compiled on threads only, as before warmreg.stages.processes
    import warmreg.stages.processes; warmreg.stages.processes.ENABLED = False
if {flat!r}:  # the warm forks every compile process itself, as before warmreg.stages.fork_pool's tree
    import warmreg.stages.processes; warmreg.stages.processes.TREE = False
if {prefetch!r}:  # ... which loads the weights (seconds) while the prefetch finishes
    from warmreg.api.prefetch import wait_for_prefetch
    wait_for_prefetch()  # Triton's key, the plugins, the local GPU's binders, the pack installed meanwhile
import gc
pauses, began = [], [0.0]
def _gc(phase, info):  # the collector's pauses inside the timed warm (a round's spread may be one of them)
    if phase == "start": began[0] = time.perf_counter()
    else: pauses.append((info["generation"], time.perf_counter() - began[0]))
gc.callbacks.append(_gc)
t = time.perf_counter()
r = warmreg.warm({config!r}, target={target!r}, workers={workers}, on_error="continue", pack={pack!r}, progress=False)
wall = time.perf_counter() - t
gc.callbacks.remove(_gc)
t = time.perf_counter()
again = warmreg.warm({config!r}, target={target!r}, workers={workers}, on_error="continue", progress=False)
print(json.dumps({{"wall": wall, "again_wall": time.perf_counter() - t, "already_warm": again.already_warm,
                   "rehearsed": r.stage("rehearsal").get("launched", 0), "rehearsal_seconds": r.stage("rehearsal").get("seconds", 0.0),
                   "rehearsal_synchronize_seconds": r.stage("rehearsal").get("synchronize_seconds", 0.0),
                   "rehearsal_slowest": r.stage("rehearsal").get("slowest", []),
                   "processes": r.stage("processes").get("processes", 0), "processes_seconds": r.stage("processes").get("seconds", 0.0), "processes_timeline": r.stage("processes").get("timeline", {{}}),
                   "plan_seconds": r.plan_seconds, "keys": r.declared, "kernels": len(r.per_kernel()), "pack": r.stage("pack").get("summary"),
                   "compiled": r.compiled, "from_cache": r.from_cache, "failed": len(r.failed),
                   "load_seconds": sum(x.load_seconds for x in r.results),
                   "compile_seconds": sum(x.seconds for x in r.results),
                   "gc_ms": sum(p for _, p in pauses) * 1e3, "gc_full": sum(1 for g, _ in pauses if g == 2),
                   "per_key_seconds": sorted(x.seconds for x in r.results)}}))
"""

def _run(code: str, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"a warm process exited with {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--target", default=None)
    ap.add_argument("--pack", default=None, help="a pack built elsewhere (e.g. on a CPU-only machine)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--quick", action="store_true", help="only cold with all cores (processes, then threads only), warm cache and pack (both prefetched; also with hits on the pool, and on 1 thread)")
    ap.add_argument("--rounds", type=int, default=1, help="with --quick: processes for each of the prefetched cold, warm-cache and pack variants; each keeps every round and reports the median one")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    results: dict = {"config": args.config, "target": args.target or "local", "cpus": cpus, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:

        def fresh(name: str) -> str:
            path = os.path.join(tmp, name)
            os.makedirs(path)
            return path

        def warm(
            workers: int, cache: str, pack: str | None = None, prefetch: bool = False, pool: bool = False, processes: bool = True,
            prefetch_pack: bool = True, flat: bool = False,
        ) -> dict:  # fmt: skip
            code = _WARM.format(
                config=args.config, target=args.target, workers=workers, pack=pack, prefetch=prefetch, pool=pool, processes=processes,
                prefetch_pack=prefetch_pack, flat=flat,
            )  # fmt: skip
            return _run(code, cache)

        def median_of(make: Callable[[int], dict]) -> dict:
            """``args.rounds`` runs of a variant (each in a fresh process): the median one, with every wall and, in the
            order they ran, where each round's time went (``round_parts``: a spread of rounds tells its cause)."""
            ran = [make(i) for i in range(args.rounds)]
            runs = sorted(ran, key=lambda r: r["wall"])
            parts = ("wall", "plan_seconds", "compile_seconds", "load_seconds", "rehearsal_seconds", "processes_seconds", "gc_ms", "gc_full")
            return {**runs[(len(runs) - 1) // 2], "rounds": [r["wall"] for r in runs], "round_parts": [{k: r[k] for k in parts} for r in ran]}

        threads_cache = fresh("threads")
        if args.quick:
            results["rounds"] = args.rounds
            results["variants"]["cold_processes"] = warm(cpus, fresh("procs"))
            results["variants"]["cold_processes_prefetched"] = median_of(lambda i: warm(cpus, fresh(f"procs2_{i}"), prefetch=True))
            # the same with the warm forking every compile process itself (no tree): the tree's effect, side by side
            results["variants"]["cold_processes_flat_prefetched"] = median_of(lambda i: warm(cpus, fresh(f"flat_{i}"), prefetch=True, flat=True))
            results["variants"]["cold_threads"] = warm(cpus, threads_cache, processes=False)
            results["variants"]["cold_threads_prefetched"] = warm(cpus, fresh("threads2"), prefetch=True, processes=False)
            results["variants"]["warm_disk_cache_prefetched"] = median_of(lambda i: warm(cpus, threads_cache, prefetch=True))
            if args.pack:  # the pack installed by prefetch(pack=...) meanwhile, and (before that existed) in the warm
                results["variants"]["from_pack_prefetched"] = median_of(lambda i: warm(cpus, fresh(f"pack2_{i}"), args.pack, prefetch=True))
                results["variants"]["from_pack_installed_in_warm"] = warm(cpus, fresh("pack3"), args.pack, prefetch=True, prefetch_pack=False)
            # the GIL, not the cores, bounds a warm of cache hits: the same two with the hits on the
            # compile pool (all cores), and with one thread for everything (loads included)
            results["variants"]["warm_disk_cache_prefetched_pool"] = warm(cpus, threads_cache, prefetch=True, pool=True)
            results["variants"]["warm_disk_cache_prefetched_1w"] = warm(1, threads_cache, prefetch=True)
            if args.pack:
                results["variants"]["from_pack_prefetched_pool"] = warm(cpus, fresh("pack_pool"), args.pack, prefetch=True, pool=True)
                results["variants"]["from_pack_prefetched_1w"] = warm(1, fresh("pack_1w"), args.pack, prefetch=True)
            tag = args.tag or "gpu_quick"
            path = write(f"warm_time_{tag}", results)
            print(json.dumps({k: val["wall"] for k, val in results["variants"].items()}, indent=1), "->", path)
            return
        results["variants"]["cold_serial"] = warm(1, fresh("serial"))
        results["variants"]["cold_threads"] = warm(cpus, threads_cache, processes=False)
        results["variants"]["cold_processes"] = warm(cpus, fresh("procs"))
        results["variants"]["warm_disk_cache"] = warm(cpus, threads_cache)
        if args.pack:
            results["variants"]["from_pack"] = warm(cpus, fresh("pack"), args.pack)
        # engine-style: warmreg.prefetch() at start-up, before CUDA is initialized, done by the time the
        # engine warms (it loads the weights meanwhile); the timer starts at warm(), as in every variant
        results["variants"]["warm_disk_cache_prefetched"] = warm(cpus, threads_cache, prefetch=True)
        if args.pack:
            results["variants"]["from_pack_prefetched"] = warm(cpus, fresh("pack2"), args.pack, prefetch=True)
    v = results["variants"]
    results["ratios"] = {
        "serial_over_threads": v["cold_serial"]["wall"] / v["cold_threads"]["wall"],
        "serial_over_processes": v["cold_serial"]["wall"] / v["cold_processes"]["wall"],
        "threads_over_processes": v["cold_threads"]["wall"] / v["cold_processes"]["wall"],
        "cold_threads_over_warm_cache": v["cold_threads"]["wall"] / v["warm_disk_cache"]["wall"],
    }
    if "from_pack" in v:
        results["ratios"]["cold_threads_over_pack"] = v["cold_threads"]["wall"] / v["from_pack"]["wall"]
    tag = args.tag or ("gpu" if args.target is None else f"cpu_{args.target.replace(':', '')}")
    path = write(f"warm_time_{tag}", results)
    print(json.dumps({k: (val["wall"] if isinstance(val, dict) else val) for k, val in v.items()}, indent=1))
    print(json.dumps(results["ratios"], indent=1), "->", path)


if __name__ == "__main__":
    main()
