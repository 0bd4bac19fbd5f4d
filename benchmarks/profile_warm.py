"""Where a warm spends its time, stage by stage and thread by thread (all threads, unlike cProfile).

Runs a cold warm (fresh Triton cache), a warm from that cache and, with ``--pack``, a warm from
the pack into another fresh cache, each in its own subprocess, started as an engine starts:
``warmreg.prefetch()`` first and the rest of its start-up meanwhile (``--no-prefetch``: not), a
CUDA context created before the timer starts. Timers go around warmreg's phases (plan, bind,
pack read and install, the cache lookups, the compile step, module loads, fast launches, the
rehearsal) and Triton's (``JITFunction._do_compile``, ``compile`` and its frontend and backend
stages, ``triton_key``, C-launcher builds, module loads). Each timer records its thread and its
interval, so the JSON shows both CPU-seconds per stage and how much ran concurrently. Writes
``benchmarks/results/profile_warm_<tag>.json``.

    python benchmarks/profile_warm.py examples/deepseek_v4_flash.json [--workers N] [--target cuda:90] [--pack PACK] [--tag h200]
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
from _common import write

_CHILD = r"""
import functools, json, sys, threading, time
CONFIG, WORKERS, TARGET, PREFETCH, PACK = json.loads(sys.argv[1])
import torch, triton
import triton.compiler.compiler as cc
import triton.runtime.cache as rc
import triton.runtime.jit as rj
from triton.backends.nvidia import compiler as nvc, driver as nvd
import warmreg
import warmreg.pipeline.bind as wb
import warmreg.api.warm as ww
from warmreg.api import session as _session
from warmreg.api.prefetch import wait_for_prefetch
from warmreg import _triton
from warmreg.stages import pack_install as _pack_install
from warmreg._triton import cache as _triton_cache
from warmreg.pipeline import compile as wc
from warmreg.stages import pack as wp
from warmreg.pipeline import run as wpl
from warmreg.stages import processes
from warmreg.stages import rehearsal

if PREFETCH:
    warmreg.prefetch()
if torch.cuda.is_available():
    torch.empty(1, device="cuda")
if PREFETCH:  # the rest of an engine's start-up (loading weights) takes longer than the prefetch
    wait_for_prefetch()
events = []
lock = threading.Lock()

def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1 = time.perf_counter()
            with lock:
                events.append((name, threading.current_thread().name, t0, t1))
    return wrapper

def patch(owner, attr, name, static=False):
    fn = getattr(owner, attr)
    w = timed(name, fn)
    setattr(owner, attr, staticmethod(w) if static else w)

rc.triton_key = timed("triton_key", rc.triton_key)
patch(cc, "compile", "compile (pool)")
triton.compiler.compile = cc.compile
patch(cc.ASTSource, "make_ir", "frontend make_ir")
for stage in ("make_ttir", "make_ttgir"):
    patch(nvc.CUDABackend, stage, "stage " + stage, static=True)
for stage in ("make_llir", "make_ptx", "make_cubin"):
    patch(nvc.CUDABackend, stage, "stage " + stage)
for attr in ("compile_module_from_src", "compile_module_from_file"):  # 3.6-3.7 / 3.8+: the launcher's C module
    if hasattr(nvd, attr):
        patch(nvd, attr, "launcher build/load")
patch(cc.CompiledKernel, "_init_handles", "init_handles (load)")
patch(rj.JITFunction, "_do_compile", "_do_compile (submit)")
patch(wb, "_bind", "warmreg bind (launch code + specialize)")
patch(_triton_cache, "specialize_remembered", "warmreg specialize")
patch(wc, "load_hit", "warmreg load_hit (a disk-cache hit, directly)")
from warmreg.runtime import fast as _fast
patch(_fast, "build", "warmreg fast launch build (key)")
patch(rehearsal.Rehearse, "_rehearse", "warmreg rehearse (key)")
if hasattr(nvd, "CudaUtils"):  # the module load itself (cuModuleLoadData), apart from building the launcher
    _utils = nvd.CudaUtils
    _orig_init = _utils.__init__
    def _init(self, *a, **k):
        _orig_init(self, *a, **k)
        self.load_binary = timed("cuModuleLoadData (load_binary)", self.load_binary)
    _utils.__init__ = _init
if hasattr(nvd, "CudaLauncher"):  # the launcher object apart from its module (3.6: built from C)
    patch(nvd, "CudaLauncher", "launcher object (CudaLauncher init)")
patch(ww, "plan", "warmreg plan")
patch(wpl, "bind_all", "warmreg bind_all")
patch(wp.PackInstall, "before_compile", "warmreg pack install")
patch(wp, "_read_checked", "warmreg pack read + verify")
patch(_pack_install, "local_hash", "warmreg pack local hash")
patch(_pack_install, "_publish", "warmreg pack publish (entry)")
patch(_triton_cache, "in_disk_cache", "warmreg in_disk_cache")
patch(processes.Processes, "first", "warmreg processes (misses)")
patch(wpl, "compile_tasks", "warmreg compile step")
patch(wc, "_load", "warmreg load (key)")
patch(wpl, "prepare_fast_launches", "warmreg fast launches")
patch(rehearsal.Rehearse, "after_load", "warmreg rehearsal")
patch(_session, "finish", "warmreg report")

t0 = time.perf_counter()
r = warmreg.warm(CONFIG, target=TARGET, workers=WORKERS, on_error="continue", progress=False, pack=PACK)
wall = time.perf_counter() - t0
stages = {}
for name, thread, a, b in events:
    row = stages.setdefault(name, {"calls": 0, "seconds": 0.0, "threads": set(), "first": a - t0, "last": b - t0})
    row["calls"] += 1
    row["seconds"] += b - a
    row["threads"].add(thread)
    row["first"] = min(row["first"], a - t0)
    row["last"] = max(row["last"], b - t0)
for row in stages.values():
    row["threads"] = len(row["threads"])
print(json.dumps({"wall": wall, "summary": r.summary(), "plan_seconds": r.plan_seconds, "pack": r.stage("pack").get("summary"),
                  "sympy_imported": "sympy" in sys.modules, "stages": stages}))
"""


def _run(config: str, workers: int, target: str | None, cache: str, *, prefetch: bool, pack: str | None = None) -> dict:
    settings = json.dumps([config, workers, target, prefetch, pack])  # an argument: no value is pasted into the code
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, settings], env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--target", default=None, help="cross-compile target (default: the local GPU)")
    ap.add_argument("--pack", default=None, help="also warm from this pack into a fresh cache")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="no warmreg.prefetch() before the warm")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as fresh:
        runs["cold"] = _run(args.config, args.workers, args.target, cache, prefetch=args.prefetch)
        runs["warm_cache"] = _run(args.config, args.workers, args.target, cache, prefetch=args.prefetch)
        if args.pack:
            runs["from_pack"] = _run(args.config, args.workers, args.target, fresh, prefetch=args.prefetch, pack=args.pack)
    result = {"config": args.config, "target": args.target or "local", "workers": args.workers, "prefetch": args.prefetch, "pack": args.pack, **runs}
    path = write(f"profile_warm_{args.tag}", result)
    for name, run in runs.items():
        print(f"{name}: {run['summary']} wall {run['wall']:.2f} s (sympy imported: {run['sympy_imported']})")
        for stage, row in sorted(run["stages"].items(), key=lambda kv: -kv[1]["seconds"]):
            print(f"  {stage:40s} {row['calls']:4d} calls {row['seconds']:7.2f} s on {row['threads']:2d} threads, "
                  f"{row['first']:5.2f}..{row['last']:5.2f} s")  # fmt: skip
    print("->", path)


if __name__ == "__main__":
    main()
