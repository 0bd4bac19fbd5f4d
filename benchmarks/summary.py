"""The launch-floor and warm-time figures of one Triton release, in one command, on the local GPU:
``benchmarks/results/summary.json``, one entry per release (``"triton-3.6.0"``, ``"triton-3.8.0"``).

Runs, each in its own subprocess (fresh Triton caches inside each benchmark), and keeps each one's
raw rounds in its own results file:

- ``benchmarks/launch_floor.py``: every launch path side by side (and one process's first launch);
- ``benchmarks/first_launch.py``: the first launch after warm against steady over fresh processes
  (``first_over_steady`` is their median), split into phases, without rehearsal, eager modules, and
  against steady launches that each follow the same work as the first (``first_over_steady_same_work``);
- ``benchmarks/warm_time.py --quick --rounds 5`` on the DeepSeek-V4-Flash example (``warm_cold_s``,
  ``warm_cache_s`` and ``warm_pack_s`` are the median of five processes each): cold with every core (the default,
  misses compiled in forked processes, and on threads only), from a warm disk cache and from a pack,
  each after ``warmreg.prefetch()`` as an engine calls it (at start-up, done while the weights
  load; with the pack: ``prefetch(pack=...)``, which installs it meanwhile, and for comparison the
  install left to the warm; cold also without it), and a second warm in the same process;
- ``benchmarks/gpu_all_keys.py`` on the Flash example from its pack: every key's first launch, with what it did
  that a steady launch does not (``first_launch_compiles``, ``first_launch_module_loads``, ``first_launch_triton_calls``);
- ``benchmarks/autotune_warm.py`` on the Kimi-K3 full example (every chunk-prefill candidate a key): cold, its
  slowest key compiled alone (``kimi_full_critical_path_s``) and, with ``--kimi-pack``, from its pack;
- ``benchmarks/sweep.py`` over every example, the monitor in ``error`` mode: the misses.

The entry holds the medians the issue names (microseconds, seconds) and the file each came from.
``benchmarks/render_results.py`` renders the README's summary table from it.

Without ``--fresh`` a run updates the figures of the steps it ran and keeps the entry's others (a release's steps
split over several commands; ``steps`` names the command and time each step's figures came from); with it the entry
starts empty (a new summary of record: run every step).

The Flash pack may be a cross build (``warmreg build examples/deepseek_v4_flash.json --target cuda:90 -o PACK``); the
Kimi-K3 pack must carry its tuning choices, so build it on this GPU without ``--target`` (``autotune_warm.py`` refuses
one without them).

    python benchmarks/summary.py --pack flash-cuda90.tar.gz [--kimi-pack kimi-full-cuda90.tar.gz] [--only launch,first,keys,warm,autotune,sweep] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import RESULTS, machine  # noqa: E402
from run_gpu import CONFIGS  # noqa: E402

SUMMARY = RESULTS / "summary.json"


def _step(cmd: list[str], stem: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    print("==", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print((proc.stdout + proc.stderr)[-1500:], flush=True)
    if proc.returncode:
        raise SystemExit(f"{cmd[1]} failed with {proc.returncode}")
    staged = Path(env["WARMREG_BENCH_DIR"], f"{stem}.json")
    data = json.loads(staged.read_text())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"== {stem}: {time.perf_counter() - start:.1f} s", flush=True)
    return data


def main() -> None:
    import torch
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True, help="a pack of examples/deepseek_v4_flash.json for this GPU and release")
    ap.add_argument("--kimi-pack", default=None, help="a pack of examples/kimi_k3_full.json for this GPU and release (autotune step)")
    ap.add_argument("--only", default="launch,first,keys,warm,autotune,sweep", help="comma-separated: launch, first, keys, warm, autotune, sweep")
    ap.add_argument("--step-timeout", type=float, default=300.0)
    ap.add_argument("--warm-rounds", type=int, default=5, help="processes for each headline warm time (cold, warm cache, pack): the median")
    ap.add_argument("--fresh", action="store_true", help="start this release's entry empty (default: update the steps run, keep the rest)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("summary.py measures on a CUDA GPU")
    release = f"triton-{triton.__version__}"
    gpu = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "_")
    tag = f"{gpu}_{release}"
    only = set(args.only.split(","))
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    entry: dict[str, Any] = {} if args.fresh else dict(summary.get(release, {}))
    entry.update(machine=machine(), command=" ".join([Path(sys.executable).name, *sys.argv]), time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    files = dict(entry.get("files", {}))
    steps = dict(entry.get("steps", {}))  # each step's figures: the command and time of the run that took them
    this_run = {"command": entry["command"], "time": entry["time"]}
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "OUT")}
        env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tmp, "pycache"))
        env["WARMREG_BENCH_DIR"] = os.path.join(tmp, "results")
        subprocess.run([py, "-c", "import torch, triton, warmreg, warmreg_deepseek_v4, warmreg_kimi_k3"], env=env, cwd=ROOT, check=True)
        if "launch" in only:
            stem = f"launch_floor_{tag}"
            lf = _step([py, "benchmarks/launch_floor.py", "--tag", tag], stem, env, args.step_timeout)
            med = lf["median_us"]
            entry.update(
                launch_driver_us=med["driver"], launch_floor_us=med["floor"], launch_fast_us=med["fast"], launch_fast_python_us=med["fast_python"],
                launch_triton_prealloc_us=med["triton_prealloc"], launch_op_us=med["op"], launch_op_out_us=med["op_out"],
                launch_op_python_us=med["op_python"], launch_triton_same_alloc_us=med["triton_same_alloc"],
                launch_native_built=lf["native_built"], first_over_steady_one_process=lf["first_over_steady"],
                launch_paired_ratios=lf["paired_ratios"],
            )  # fmt: skip
            files["launch"] = f"{stem}.json"
        if "first" in only:
            stem = f"first_launch_{tag}"
            fl = _step([py, "benchmarks/first_launch.py", "--tag", tag], stem, env, args.step_timeout)
            entry.update(
                first_over_steady=fl["first_over_steady"],
                first_over_steady_by_variant={k: v["median_first_over_steady"] for k, v in fl["variants"].items()},
                first_over_steady_same_work=fl["variants"]["plan_each"]["median_first_over_steady"],
            )  # fmt: skip
            entry["first_over_steady_walk_each"] = fl["variants"].get("walk_each", {}).get("median_first_over_steady")
            files["first"] = f"{stem}.json"
        if "keys" in only:
            stem = f"gpu_all_keys_{tag}"
            cmd = [py, "benchmarks/gpu_all_keys.py", CONFIGS[0], "--pack", f"{CONFIGS[0]}={args.pack}", "--tag", tag]
            keys = _step(cmd, stem, env, args.step_timeout)["configs"][0]
            work = keys["first_launch_work"]
            entry.update(
                first_launch_keys=sum(k["launched"] for k in keys["kernels"].values()),
                first_launch_compiles=work["compiles"], first_launch_module_loads=work["module_loads"],
                first_launch_triton_calls=work["triton_run"] + work["triton_launcher"],
            )  # fmt: skip
            files["keys"] = f"{stem}.json"
        if "warm" in only:
            stem = f"warm_time_{tag}"
            cmd = [py, "benchmarks/warm_time.py", CONFIGS[0], "--quick", "--rounds", str(args.warm_rounds), "--pack", args.pack, "--tag", tag]
            v = _step(cmd, stem, env, args.step_timeout)["variants"]
            entry.update(
                warm_pack_s=v["from_pack_prefetched"]["wall"], warm_pack_install=v["from_pack_prefetched"]["pack"],
                warm_pack_installed_in_warm_s=v["from_pack_installed_in_warm"]["wall"],
                warm_cache_s=v["warm_disk_cache_prefetched"]["wall"],
                warm_cold_s=v["cold_processes_prefetched"]["wall"], warm_cold_not_prefetched_s=v["cold_processes"]["wall"],
                warm_cold_flat_s=v["cold_processes_flat_prefetched"]["wall"],
                warm_cold_threads_s=v["cold_threads_prefetched"]["wall"],
                warm_again_s=v["warm_disk_cache_prefetched"]["again_wall"],
                warm_again_was_already_warm=v["warm_disk_cache_prefetched"]["already_warm"],
                warm_keys=v["cold_processes"]["keys"], warm_cpus=entry["machine"]["cpus"],
            )  # fmt: skip
            files["warm"] = f"{stem}.json"
        if "autotune" in only:
            stem = f"autotune_warm_{tag}"
            cmd = [py, "benchmarks/autotune_warm.py", "examples/kimi_k3_full.json", "--tag", tag]
            at = _step(cmd + (["--pack", args.kimi_pack] if args.kimi_pack else []), stem, env, args.step_timeout)
            entry.update(kimi_full_cold_s=at["kimi_full_cold_s"], kimi_full_critical_path_s=at["kimi_full_critical_path_s"],
                         kimi_full_pack_s=at.get("kimi_full_pack_s"), kimi_full_slowest_key=at["slowest_key"])  # fmt: skip
            files["autotune"] = f"{stem}.json"
        if "sweep" in only:
            stem = f"sweep_{tag}"
            sweep = _step([py, "benchmarks/sweep.py", *CONFIGS, "--tag", tag], stem, env, args.step_timeout)
            entry["sweep_misses"] = sum(c["monitor_misses"] for c in sweep["configs"]) + len(sweep.get("crashed", []))
            entry["sweep_launches"] = sum(
                sum(k.get("launches", 0) for k in c["kernels"].values()) for c in sweep["configs"]
            )  # fmt: skip
            files["sweep"] = f"{stem}.json"
    steps.update({step: this_run for step in ("launch", "first", "keys", "warm", "autotune", "sweep") if step in only})
    entry["files"], entry["steps"] = files, steps
    summary[release] = entry
    SUMMARY.write_text(json.dumps(summary, indent=1, default=str))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], SUMMARY.name).write_text(json.dumps(summary, indent=1, default=str))
    keys = ("launch_driver_us", "launch_floor_us", "launch_fast_us", "launch_triton_prealloc_us", "launch_op_us", "launch_triton_same_alloc_us",
            "first_over_steady", "first_over_steady_walk_each", "first_launch_compiles", "first_launch_module_loads", "first_launch_triton_calls",
            "warm_pack_s", "warm_cache_s", "warm_cold_s", "warm_again_s", "kimi_full_cold_s", "kimi_full_critical_path_s", "kimi_full_pack_s",
            "sweep_misses")  # fmt: skip
    print(json.dumps({k: entry.get(k) for k in keys}, indent=1), "->", SUMMARY)


if __name__ == "__main__":
    main()
