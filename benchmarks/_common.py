"""Shared helpers of the benchmarks: machine description, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What ran the benchmark: host, CPUs, Python, torch, Triton, GPU."""
    import torch
    import triton

    info: dict[str, Any] = {
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        info["nvidia_driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["nvidia_driver"] = None
    return info


def qkv_decode_inputs(op: Any, device: Any) -> tuple[Any, Any, Any, Any]:
    """The fused Q/KV RMSNorm's decode inputs at T = 1 for ``op``'s layout: ``qr`` and ``kv`` as
    views of one bf16 projection row, and two bf16 weights near 1 (launch_floor, first_launch, first_call_cpu)."""
    import torch

    q, kv, width = op.q_size, op.kv_size, op.proj_width
    proj = torch.randn(1, width, device=device).to(torch.bfloat16)
    qw = (1 + 0.1 * torch.randn(q, device=device)).to(torch.bfloat16)
    kvw = (1 + 0.1 * torch.randn(kv, device=device)).to(torch.bfloat16)
    return proj[:, :q], proj[:, q : q + kv], qw, kvw


def memory_walk(mib: int = 64) -> None:
    """Touch ``mib`` MiB of fresh memory, one write a page, as other start-up work does between a
    warm and the first launch (first_launch, first_call_cpu)."""
    walk = bytearray(mib << 20)
    walk[::4096] = bytes(len(walk) // 4096)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write(name: str, data: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (and a copy under $OUT when set).

    Under ``benchmarks/run_gpu.py`` (``WARMREG_BENCH_DIR`` set) the file goes to that directory
    instead, and the entry script gathers every step into one results file.
    """
    data = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **data}
    staging = os.environ.get("WARMREG_BENCH_DIR")
    if staging:
        Path(staging).mkdir(parents=True, exist_ok=True)
        path = Path(staging, f"{name}.json")
        path.write_text(json.dumps(data, indent=2, default=str))
        return path
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(data, indent=2, default=str))
    return path
