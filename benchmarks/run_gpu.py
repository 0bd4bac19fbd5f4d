"""The GPU proof in one command: every benchmark, one results file per GPU and Triton release,
``benchmarks/results/<gpu>_triton-<version>.json`` (e.g. ``h200_triton-3.8.0.json``).

Runs, each in its own subprocess (fresh Triton caches inside each benchmark):

- ``warm_time``: per example config, cold with one worker, cold with all cores (threads), cold with
  all cores (processes), warm disk cache and, where ``--pack`` names one, from a pack built elsewhere;
- ``profile_warm``: the DeepSeek-V4-Flash warm, stage by stage and thread by thread;
- ``gpu_proof``: RMSNorm sweep, first vs steady launch, host cost of a launch against Triton direct;
- ``sweep``: the zero-JIT sweep, every kernel of every config under a randomized request mix, monitor
  in ``error``;
- ``gpu_all_keys``: every warmed key launched for real, first launch against steady state;
- ``kernels_dsv4_index`` and ``kernels_numeric``: each kernel against its PyTorch reference.

Each step's JSON lands in one file with the command, the machine and each step's wall time and exit
status; a failing step is recorded and the rest still run. ``benchmarks/render_results.py`` renders
the README's Results section from it.

The H200 image ships its Python packages without bytecode and with ``PYTHONDONTWRITEBYTECODE=1``, so
every fresh process would compile torch's and Triton's sources again (about 3 s); a pip install writes
bytecode, so the children get a bytecode cache (``PYTHONPYCACHEPREFIX``), primed once before any
timing, as on an ordinary install.

    python benchmarks/run_gpu.py --pack examples/deepseek_v4_flash.json=flash.tar.gz [--only sweep,gpu_proof]
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

CONFIGS = [
    "examples/deepseek_v4_flash.json",
    "examples/deepseek_v4_pro.json",
    "examples/kimi_k3.json",
    "examples/kimi_k3_full.json",
    "examples/deepseek_v4_flash_0731_dspark.json",
]


def _steps(packs: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """(step name, result file stem, command) in run order."""
    py = sys.executable
    pack_args = [a for c, p in packs.items() for a in ("--pack", f"{c}={p}")]
    steps: list[tuple[str, str, list[str]]] = [  # the zero-JIT proof first: a run cut short keeps it
        ("sweep", "sweep_run", [py, "benchmarks/sweep.py", *CONFIGS, "--tag", "run", *pack_args]),
    ]
    proof = [py, "benchmarks/gpu_proof.py", CONFIGS[0], "--tag", "run"]
    if CONFIGS[0] in packs:
        proof += ["--pack", packs[CONFIGS[0]]]
    steps.append(("gpu_proof", "gpu_proof_run", proof))
    for config in CONFIGS:
        stem = Path(config).stem
        cmd = [py, "benchmarks/warm_time.py", config, "--tag", f"run_{stem}"]
        if config in packs:
            cmd += ["--pack", packs[config]]
        steps.append((f"warm_time:{stem}", f"warm_time_run_{stem}", cmd))
    steps.append(("profile_warm", "profile_warm_run", [py, "benchmarks/profile_warm.py", CONFIGS[0], "--tag", "run"]))
    steps.append(("gpu_all_keys", "gpu_all_keys_run", [py, "benchmarks/gpu_all_keys.py", *CONFIGS, "--tag", "run", *pack_args]))
    steps.append(("kernels_dsv4_index", "kernels_dsv4_index_run", [py, "benchmarks/kernels_dsv4_index.py", "--tag", "run"]))
    steps.append(("kernels_numeric", "kernels_numeric_run", [py, "benchmarks/kernels_numeric.py", "--tag", "run"]))
    return steps


def _gpu_slug() -> str:
    """``h200_triton-3.8.0``: the results file's stem, one per GPU model and Triton release."""
    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("run_gpu.py needs a CUDA GPU; the CPU dry runs are the individual scripts' --device cpu")
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_") + f"_triton-{triton.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", action="append", default=[], help="CONFIG=PACK: a pack built elsewhere for that config")
    ap.add_argument("--only", default=None, help="comma-separated step names (prefixes) to run")
    ap.add_argument("--step-timeout", type=float, default=400.0, help="seconds before a step is stopped")
    ap.add_argument("--merge", action="store_true", help="keep the other steps of an existing results file (a run split in parts)")
    args = ap.parse_args()
    packs = dict(p.split("=", 1) for p in args.pack)
    slug = _gpu_slug()
    only = args.only.split(",") if args.only else None
    command = " ".join([Path(sys.executable).name, *sys.argv])
    path = RESULTS / f"{slug}.json"
    previous = json.loads(path.read_text()) if args.merge and path.exists() else {}
    out: dict[str, Any] = {
        "command": command,
        "commands": [*previous.get("commands", []), command],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine(),
        "packs": {**previous.get("packs", {}), **packs},
        "steps": dict(previous.get("steps", {})),
    }
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "OUT")}
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        env["WARMREG_BENCH_DIR"] = os.path.join(tmp, "results")
        prime = "import torch, triton, warmreg, warmreg_deepseek_v4, warmreg_kimi_k3, triton.compiler.compiler"
        subprocess.run([sys.executable, "-c", prime], env=env, cwd=ROOT, check=True)
        out["bytecode"] = "PYTHONPYCACHEPREFIX in a temporary directory, primed before the first step"
        for name, stem, cmd in _steps(packs):
            if only and not any(name.startswith(o) for o in only):
                continue
            print(f"== {name}: {' '.join(cmd)}", flush=True)
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.step_timeout)
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = "timeout", str(exc.stdout or "")[-3000:]
            wall = time.perf_counter() - start
            staged = Path(env["WARMREG_BENCH_DIR"], f"{stem}.json")
            result = json.loads(staged.read_text()) if staged.exists() else None
            out["steps"][name] = {"command": " ".join(cmd), "rc": rc, "wall_s": wall, "result": result,
                                  "output_tail": tail if rc != 0 or result is None else tail[-600:]}  # fmt: skip
            print(tail[-1500:], flush=True)
            print(f"== {name}: rc {rc} in {wall:.1f} s", flush=True)
            _save(out, path)  # after every step: a later crash or timeout loses nothing measured
    print("->", path)


def _save(out: dict[str, Any], path: Path) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1, default=str)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(text)


if __name__ == "__main__":
    main()
