"""How fast the CLI refuses bad input, from the shell: each case a fresh ``python -m warmreg`` process,
as a user or a deployment script meets it, against the cost of ``import torch`` alone measured in the
same run.

Cases: a pack that is a device (``/dev/zero``), an out-of-range serving int, ``--json`` into a missing
directory, ``build -o`` under a file, a cache directory that is a file, and a pack whose entries name
only a package no plugin provides (``jit_name: "this.f"``). Writes
``benchmarks/results/cli_refusals_<tag>.json`` with every run's wall time.

    python benchmarks/cli_refusals.py [--runs 5] [--tag cpu2core]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from _common import median, write  # noqa: E402


def _cases(tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    from tests.reliability.hostile import edited, write_tar

    kimi = str(ROOT / "examples" / "kimi_k3.json")
    absurd = tmp / "absurd.json"
    doc = json.loads(Path(kimi).read_text())
    doc["serving"]["num_speculative_tokens"] = 2**1000
    absurd.write_text(json.dumps(doc))
    a_file = tmp / "file"
    a_file.write_text("")
    pack = tmp / "kimi.tar"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "build-cache")}
    subprocess.run([sys.executable, "-m", "warmreg", "build", kimi, "--target", "cuda:90", "-o", str(pack)], env=env, check=True,
                   capture_output=True)  # fmt: skip
    with tarfile.open(pack) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}  # type: ignore[union-attr]
    stranger = write_tar(tmp / "stranger.tar", edited(members, lambda p: [e.update(jit_name="this.f") for e in p.entries]))
    return {
        "pack verify /dev/zero": (["pack", "verify", "/dev/zero"], {}),
        "plan: num_speculative_tokens = 2**1000": (["plan", str(absurd), "--target", "cuda:90"], {}),
        "warm --json into a missing directory": (["warm", kimi, "--target", "cuda:90", "--json", str(tmp / "no" / "r.json")], {}),
        "build -o under a file": (["build", kimi, "--target", "cuda:90", "-o", str(a_file / "p.tar")], {}),
        "pack install into a cache directory that is a file": (["pack", "install", str(pack)], {"TRITON_CACHE_DIR": str(a_file)}),
        "pack install, every entry names this.f": (["pack", "install", str(stranger)], {}),
    }


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - start, done.returncode, (done.stderr.strip().splitlines() or [""])[-1][:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tag", default="cpu2core")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cases = _cases(tmp)
        base = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "cache")}
        out: dict[str, Any] = {"runs": args.runs, "cases": {}}
        baseline = [_timed([sys.executable, "-c", "import torch"], base)[0] for _ in range(args.runs)]
        out["import_torch_s"] = {"runs": baseline, "median": median(baseline)}
        for name, (argv, env) in cases.items():
            runs = [_timed([sys.executable, "-m", "warmreg", *argv], {**base, **env}) for _ in range(args.runs)]
            walls = [r[0] for r in runs]
            out["cases"][name] = {"argv": argv, "runs_s": walls, "median_s": median(walls), "exit_codes": sorted({r[1] for r in runs}),
                                  "last_line": runs[-1][2], "ratio_to_import_torch": median(walls) / median(baseline)}  # fmt: skip
            print(f"{name}: median {median(walls):.2f} s (exit {runs[-1][1]}): {runs[-1][2][:100]}")
    print(f"import torch alone: median {median(baseline):.2f} s")
    print("->", write(f"cli_refusals_{args.tag}", out))


if __name__ == "__main__":
    main()
