"""Distributed warm on this machine: 1 rank against N ranks (gloo, cross-compiling), side by side.

Every rank gets its own empty Triton cache (as on separate nodes). Also estimates 8 ranks on the
GPU host from the per-key compile times measured there (benchmarks/results/h200.json, step
warm_time:deepseek_v4_flash).

    python benchmarks/distributed_warm.py examples/deepseek_v4_flash.json --target cuda:90 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write

_RANK = """
import json, time, torch.distributed as dist, warmreg
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank={rank}, world_size={world})
t = time.perf_counter()
r = warmreg.warm({config!r}, target={target!r}, workers={workers}, progress=False)
print(json.dumps({{"wall": time.perf_counter() - t, "shard_compiled": r.stage("shard").get("compiled"), "received": r.stage("shard").get("received"), "keys": r.declared}}))
dist.destroy_process_group()
"""

_SINGLE = """
import json, time, warmreg
t = time.perf_counter()
r = warmreg.warm({config!r}, target={target!r}, workers={workers}, progress=False, distributed=False)
print(json.dumps({{"wall": time.perf_counter() - t, "compiled": r.compiled, "keys": r.declared}}))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(config: str, target: str, world: int, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            out = subprocess.run(
                [sys.executable, "-c", _SINGLE.format(config=config, target=target, workers=workers)],
                env={**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, "c")}, capture_output=True, text=True, check=True,
            )
            return {"ranks": [json.loads(out.stdout.strip().splitlines()[-1])]}
        port, t = _port(), time.perf_counter()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK.format(port=port, rank=r, world=world, config=config, target=target, workers=workers)],
                env={**os.environ, "TRITON_CACHE_DIR": os.path.join(tmp, f"c{r}")}, stdout=subprocess.PIPE, text=True,
            )
            for r in range(world)
        ]
        outs = [p.communicate()[0] for p in procs]
        return {"ranks": [json.loads(o.strip().splitlines()[-1]) for o in outs], "job_wall_with_process_start": time.perf_counter() - t}


def estimate_8_ranks() -> dict | None:
    """Round-robin the GPU host's measured per-key compile times over 8 ranks."""
    path = RESULTS / "h200.json"
    if not path.exists():
        return None
    step = json.loads(path.read_text())["steps"].get("warm_time:deepseek_v4_flash") or {}
    if not step.get("result"):
        return None
    gpu = step["result"]["variants"]
    per_key = gpu["cold_serial"]["per_key_seconds"]
    shares = [sum(per_key[i::8]) for i in range(8)]
    return {
        "source": str(path.relative_to(RESULTS.parent.parent)),
        "keys": len(per_key),
        "serial_compile_seconds": sum(per_key),
        "per_rank_compile_seconds_8_ranks": shares,
        "slowest_rank_seconds": max(shares),
        "final_pass_launchers_cached_seconds": gpu["warm_disk_cache"]["wall"],
        "final_pass_fresh_node_seconds": gpu["from_pack"]["wall"],
        "estimate_8_ranks_seconds": max(shares) + gpu["from_pack"]["wall"],
        "single_host_16_threads_seconds": gpu["cold_threads"]["wall"],
        "note": "per-key times are the serial cold compiles (without launcher builds) on one H200 host, dealt round-robin to 8 ranks; "
        "every rank then installs the others' binaries and runs a local pass that loads modules, which the from-pack variant "
        "measured on a fresh cache; that pack carried prebuilt C launchers, as the exchange does for launchers built on "
        "the other ranks; the launchers of a rank's own shard and the byte exchange (about 0.3 MB for this space) are not counted",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--target", default="cuda:90")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="compile threads per rank (1: ranks are the only parallelism)")
    args = ap.parse_args()
    one = run(args.config, args.target, 1, args.workers)
    many = run(args.config, args.target, args.ranks, args.workers)
    slowest = max(r["wall"] for r in many["ranks"])
    data = {
        "config": args.config, "target": args.target, "workers_per_rank": args.workers,
        "one_rank": one, f"{args.ranks}_ranks": many,
        "ratio_one_over_many": one["ranks"][0]["wall"] / slowest,
        "estimate_8_ranks_on_gpu_host": estimate_8_ranks(),
    }  # fmt: skip
    path = write(f"distributed_warm_cpu{os.cpu_count()}core", data)
    print(json.dumps({"one_rank_s": one["ranks"][0]["wall"], f"{args.ranks}_ranks_slowest_s": slowest, "ratio": data["ratio_one_over_many"]}), "->", path)


if __name__ == "__main__":
    main()
