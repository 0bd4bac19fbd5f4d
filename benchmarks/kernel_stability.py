"""Do two runs of the kernel benchmark agree? The DSv4 index/metadata kernels and their references,
timed with interleaved rounds, CUDA-graph replay for calls under 50 µs and medians with their spread
(``_timing.interleaved``), in two separate processes; then each subcase's run-2 / run-1 ratio.

    python benchmarks/kernel_stability.py [--runs 2] [--rounds 21] [--tag h200]    # on the GPU

Writes benchmarks/results/kernel_stability_<tag>.json: every subcase's figures per run (raw rounds
included) and the agreement between runs (ratios, how many within 10%).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write

ROOT = Path(__file__).resolve().parents[1]
REF_CAP_MS = 50.0  # a reference slower than this per call is timed, but not in the agreement check


def one_run(rounds: int) -> dict[str, Any]:
    import kernels_dsv4_index as kb
    import torch
    from _timing import interleaved

    import warmreg

    dev = torch.device("cuda")
    S, sizes = kb.settings(dev, False, 1e9, time.perf_counter())
    warmreg.warm(str(ROOT / kb.DSPARK_CONFIG), on_error="continue", progress=False)  # the DSpark kernels
    report = warmreg.warm(str(ROOT / kb.CONFIG), on_error="continue", progress=False)
    out: dict[str, Any] = {"warm": report.summary(), "subcases": {}}
    for name, (build, axis, _cap, _compile) in kb.KERNELS.items():
        for T in sizes[axis]:
            sub = f"{name.split('.')[-1]}[{T}]"
            try:
                case = build(S, random.Random(T), torch.Generator().manual_seed(T), T)
                rargs, rkw = (case.kargs, {**case.kkw, **case.rkw}) if case.rargs is None else (case.rargs, case.rkw)
                kargs, kkw = kb._to(case.kargs, dev), kb._to(case.kkw, dev)
                dargs, dkw = kb._to(rargs, dev), kb._to(rkw, dev)
                fns = {"kernel": lambda c=case, a=kargs, k=kkw: c.kernel(*a, **k)}
                ref = kb._on_device(case.ref, dev, dargs, dkw, True)
                try:
                    t = time.perf_counter()
                    ref()
                    torch.cuda.synchronize()
                    if (time.perf_counter() - t) * 1e3 < REF_CAP_MS:
                        fns["eager_ref"] = ref
                except Exception:
                    pass  # the reference moves data to the host itself: kernel only
                fns["kernel"]()
                out["subcases"][sub] = interleaved(fns, rounds=rounds)
            except Exception as exc:
                out["subcases"][sub] = {"error": f"{type(exc).__name__}: {exc}"[:300], "traceback": traceback.format_exc()[-800:]}
            print(sub, {k: round(v["median_ms"] * 1e3, 1) for k, v in out["subcases"][sub].items() if isinstance(v, dict)}, flush=True)
    return out


def _agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run 2 / run 1 per subcase, for the figures both runs took by graph replay (GPU time) and,
    apart, for the host-bound ones (references that cannot be captured)."""
    first, second = runs[0]["subcases"], runs[1]["subcases"]
    graphed: dict[str, float] = {}
    host: dict[str, float] = {}
    for sub, a in first.items():
        b = second.get(sub, {})
        for who in ("kernel", "eager_ref"):
            if isinstance(a.get(who), dict) and isinstance(b.get(who), dict):
                ratio = b[who]["median_ms"] / a[who]["median_ms"]
                (graphed if a[who]["graphed"] and b[who]["graphed"] else host)[f"{sub} {who}"] = ratio

    def summary(ratios: dict[str, float]) -> dict[str, Any]:
        devs = [abs(v - 1) for v in ratios.values()]
        return {
            "subcases": len(ratios), "within_10pct": sum(d <= 0.10 for d in devs),
            "median_abs_dev": statistics.median(devs) if devs else None, "max_abs_dev": max(devs) if devs else None,
            "outside_10pct": {k: v for k, v in ratios.items() if abs(v - 1) > 0.10}, "ratios_run2_over_run1": ratios,
        }  # fmt: skip

    kernels = {k: v for k, v in graphed.items() if k.endswith(" kernel")}
    small = {k: v for k, v in kernels.items() if first[k.rsplit(" ", 1)[0]]["kernel"]["median_ms"] < 0.05}
    return {"graph_replayed": summary(graphed), "kernels": summary(kernels), "kernels_under_50us": summary(small), "host_bound": summary(host)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run into this file
    args = ap.parse_args()
    if args.one:
        Path(args.one).write_text(json.dumps(one_run(args.rounds)))
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):  # separate processes: nothing (allocator, caches, clocks state) carries over
            path = Path(tmp, f"run{i}.json")
            subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--one", str(path)], check=True)
            runs.append(json.loads(path.read_text()))
    result: dict[str, Any] = {"rounds": args.rounds, "method": __doc__, "runs": runs}
    if len(runs) >= 2:
        result["agreement"] = _agreement(runs)
    path = write(f"kernel_stability_{args.tag}", result)
    for name, part in result.get("agreement", {}).items():
        print(name, {k: v for k, v in part.items() if k != "ratios_run2_over_run1"})
    print("->", path)


if __name__ == "__main__":
    main()
