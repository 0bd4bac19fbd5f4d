"""Distributed warm on several GPUs of one host (NCCL), then zero runtime compiles on every rank.

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py examples/deepseek_v4_flash.json --single SINGLE.json

Each rank: joins the NCCL group, warms with the key list sharded across ranks (timed), arms the
monitor in ``error``, then drives the engine-shaped step loop of ``examples/serving_loop.py`` (random
decode / prefill / mixed batches through the DeepSeek-V4 metadata kernels and the Q/KV RMSNorm) and
launches every warmed key for real (as ``benchmarks/gpu_all_keys.py`` does). Rank 0 gathers every
rank's numbers (as JSON bytes) and writes ``multi_gpu_<tag>.json``, next to the single-process warm
time measured before the job (``--single``: a ``warmreg warm --json`` report).

``--cache-per-rank DIR`` gives each rank its own empty Triton cache ``DIR/rank<r>``, as on separate
hosts: the ranks then also hand each other the C launchers their loads built; each rank counts the
launchers it built with the C compiler before and after the exchange.

``--dry-run`` checks the script on a machine without GPUs: gloo, a cross target, no launches.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from _common import write  # noqa: E402

import warmreg  # noqa: E402
from warmreg.stages.distributed import _all_gather_bytes  # noqa: E402
from warmreg.testing import materialize  # noqa: E402


def sweep(config: str, steps: int, seed: int) -> dict[str, Any]:
    """Serving-loop steps and one real launch of every warmed key, under the armed monitor."""
    from serving_loop import make_batch, step

    plan = warmreg.plan(config)
    rng = random.Random(seed)
    tokens, errors = 0, []
    for i in range(steps):
        reqs, n_dec = make_batch(rng, ("decode", "prefill", "mixed")[i % 3], plan.config)
        try:
            tokens += step(plan, reqs, n_dec, torch.device("cuda"))
        except warmreg.JitMissError:
            raise
        except Exception as exc:  # recorded; the sweep goes on
            errors.append(f"step {i}: {type(exc).__name__}: {exc}"[:300])
    launched = 0
    for kp in plan.kernels:
        launcher = getattr(kp.kernel, kp.kernel.launcher)
        for key in kp.keys:
            inputs = {k: materialize(v, torch.device("cuda")) for k, v in kp.kernel.warmup_inputs(key).items()}
            functools.partial(launcher, **inputs)()
            launched += 1
    torch.cuda.synchronize()
    return {"steps": steps, "tokens": tokens, "keys_launched": launched, "step_errors": errors}


def _count_launcher_builds() -> dict[str, int]:
    """C compiler runs for Triton's launchers in this process, split at the sharded warm's exchange."""
    import triton.runtime.build as tb

    import warmreg.stages.distributed as wd

    counts = {"before_exchange": 0, "after_exchange": 0}
    phase = ["before_exchange"]
    real_build, real_gather = tb._build, wd._all_gather_bytes

    def build(*a: Any, **k: Any) -> Any:
        counts[phase[0]] += 1
        return real_build(*a, **k)

    def gather(*a: Any, **k: Any) -> Any:
        phase[0] = "after_exchange"
        return real_gather(*a, **k)

    tb._build, wd._all_gather_bytes = build, gather
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--single", default=None, help="the single-process warm report (JSON) measured before the job")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="h200x2")
    ap.add_argument("--cache-per-rank", default=None, metavar="DIR", help="an empty Triton cache DIR/rank<r> per rank")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.dry_run:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cache_per_rank:
        os.environ["TRITON_CACHE_DIR"] = os.path.join(args.cache_per_rank, f"rank{rank}")
    builds = _count_launcher_builds()
    dist.barrier()
    start = time.perf_counter()
    report = warmreg.warm(args.config, target="cuda:90" if args.dry_run else None, on_error="continue", progress=False)
    warm_wall = time.perf_counter() - start
    dist.barrier()
    job_wall = time.perf_counter() - start
    mine: dict[str, Any] = {
        "rank": rank,
        "device": torch.cuda.get_device_name() if not args.dry_run else None,
        "warm_wall_s": warm_wall,
        "job_wall_s": job_wall,
        "summary": report.summary(),
        "shard_compiled": report.stage("shard").get("compiled"),
        "shard_received": report.stage("shard").get("received"),
        "shard_launchers_received": report.stage("shard").get("launchers_received"),
        "launcher_builds": dict(builds),
        "failed": [(r.kernel, str(r.key), r.error) for r in report.failed],
    }
    if not args.dry_run:
        with warmreg.monitor("error") as mon:
            try:
                mine["sweep"] = sweep(args.config, args.steps, seed=rank)
                mine["miss_error"] = None
            except warmreg.JitMissError as exc:
                mine["miss_error"] = str(exc)
            mine["misses"] = len(mon.misses)
            mine["counters"] = mon.counters()
    gathered = [json.loads(b) for b in _all_gather_bytes(json.dumps(mine).encode(), dist.group.WORLD)]
    if rank == 0:
        data: dict[str, Any] = {"config": args.config, "world_size": world, "ranks": gathered}
        if args.single and Path(args.single).exists():
            single = json.loads(Path(args.single).read_text())
            data["single_process"] = {"seconds": single["seconds"], "summary": single["summary"]}
            data["ratio_single_over_sharded"] = single["seconds"] / max(r["job_wall_s"] for r in gathered)
        data["keys_compiled_across_job"] = sum(r["shard_compiled"] or 0 for r in gathered)
        data["total_misses"] = sum(r.get("misses", 0) for r in gathered)
        path = write(f"multi_gpu_{args.tag}" if not args.dry_run else "multi_gpu_dryrun", data)
        print(json.dumps({k: v for k, v in data.items() if k != "ranks"}, indent=1), "->", path)
        for r in gathered:
            print(r["rank"], r["summary"], "misses:", r.get("misses"), "sweep:", {k: v for k, v in (r.get("sweep") or {}).items() if k != "step_errors"}, r.get("miss_error"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
