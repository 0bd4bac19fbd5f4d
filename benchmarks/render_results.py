"""Render the README's Results section from benchmarks/results/*.json.

    python benchmarks/render_results.py          # rewrites the block between the markers in README.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _machine(d: dict[str, Any]) -> str:
    m = d["machine"]
    gpu = m.get("gpu") or "no GPU"
    return f"{gpu}, {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, Triton {m['triton']} ({d['time']})"


def warm_table(d: dict[str, Any]) -> list[str]:
    v = d["variants"]
    rows = [
        ("cold, 1 worker", v["cold_serial"]),
        (f"cold, {d['cpus']} threads (Triton async compile)", v["cold_threads"]),
        (f"cold, {d['cpus']} processes + load", v["cold_processes"]),
        ("warm Triton disk cache", v["warm_disk_cache"]),
    ]
    if "from_pack" in v:
        rows.append(("from a pack built on the CPU machine (Python 3.11)", v["from_pack"]))
    out = [f"Warm time, {v['cold_serial']['keys']} keys over {v['cold_serial']['kernels']} kernels, `{d['config']}` on {d['target']}; {_machine(d)}", "",
           "| variant | wall s | compiled | from cache |", "| --- | ---: | ---: | ---: |"]
    for name, row in rows:
        load = row.get("load", row)
        out.append(f"| {name} | {row['wall']:.2f} | {load.get('compiled', '-')} | {load.get('from_cache', '-')} |")
    r = d["ratios"]
    out += ["", "Ratios: " + ", ".join(f"{k} {val:.2f}" for k, val in r.items()), ""]
    return out


def proof_lines(d: dict[str, Any]) -> list[str]:
    s, lo = d["sweep"], d["launch_overhead_us"]
    return [
        f"GPU proof ({_machine(d)}): {d['warm']['summary']}; then {s['launches']} real Q/KV RMSNorm launches, T = {s['token_counts'][0]}..{s['token_counts'][1]}, "
        f"monitor armed: **{len(s['misses'])} misses**; max |error| vs the PyTorch reference {s['max_abs_err_vs_reference']:g} (bf16); first launch after warm {s['first_launch_ms']:.3f} ms.",
        "",
        f"Host cost per launch (T = 1): warmreg {lo['median_warmreg']:.1f} µs, Triton `kernel[grid](...)` {lo['median_triton_direct']:.1f} µs "
        f"(ratio {lo['ratio']:.2f}), Triton with the same two output allocations {lo.get('median_triton_direct_with_output_alloc', float('nan')):.1f} µs "
        f"(ratio {lo.get('ratio_same_work', float('nan')):.2f}).",
        "",
    ]


def all_keys_table(d: dict[str, Any]) -> list[str]:
    out = [f"Every warmed key launched for real ({_machine(d)}):", "", "| config | warm | keys launched | launch failures | misses |", "| --- | --- | ---: | ---: | ---: |"]
    for c in d["configs"]:
        launched = sum(k["launched"] for k in c["kernels"].values())
        failures = sum(len(k["failures"]) for k in c["kernels"].values())
        src = " (from pack)" if c.get("pack") else ""
        out.append(f"| `{c['config']}`{src} | {c['warm_summary']} | {launched} | {failures} | {len(c['misses'])} |")
    return out + [""]


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def kernels_table(d: dict[str, Any], title: str) -> list[str]:
    """Per kernel at its largest size: check, times, speedups, achieved bandwidth."""
    bw = d.get("copy_bandwidth", {})
    copy = bw.get("GBps") if isinstance(bw, dict) else bw
    out = [f"{title} ({_machine(d)}); copy bandwidth measured in the same run {_num(copy, '.0f')} GB/s; "
           "per kernel, the largest size and the checks over all sizes:", "",
           "| kernel | largest size | checks passed | kernel ms | eager ref ms | x eager | x torch.compile | GB/s | % copy |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, k in d["kernels"].items():
        sizes = k.get("sizes", [])
        if not sizes:
            continue
        last = sizes[-1]
        passed = sum(1 for s in sizes if s.get("check") == "passed")
        size = last.get("size") or ", ".join(f"{k}={last[k]}" for k in ("T", "num_prefills", "prefills", "N") if k in last) or "?"
        eager = last.get("eager_ref_ms")
        speed = last.get("speedup", last.get("speedup_eager"))
        comp = last.get("speedup_vs_compiled", last.get("speedup_compiled"))
        out.append(
            f"| {name} | {size} | {passed}/{len(sizes)} | {_num(last.get('kernel_ms'), '.4f')} | {_num(eager, '.3f') if isinstance(eager, (int, float)) else 'capped'} "
            f"| {_num(speed, '.1f')} | {_num(comp, '.2f')} | {_num(last.get('GBps'), '.0f')} | {_num(100 * last['frac_copy_bw'] if isinstance(last.get('frac_copy_bw'), (int, float)) else None, '.1f')} |"
        )
    return out + [""]


def multi_gpu_lines(d: dict[str, Any]) -> list[str]:
    ranks = d["ranks"]
    sweep = [r.get("sweep") or {} for r in ranks]
    return [
        f"Distributed warm on {d['world_size']} GPUs of one host with NCCL ({_machine(d)}): each rank compiled "
        f"{', '.join(str(r['shard_compiled']) for r in ranks)} of {d['keys_compiled_across_job']} keys (each key once across the job); "
        f"job {max(r['job_wall_s'] for r in ranks):.2f} s against {d['single_process']['seconds']:.2f} s for one process "
        f"(ratio {d['ratio_single_over_sharded']:.2f}). Then, monitor in `error` on every rank: "
        f"{sum(s.get('steps', 0) for s in sweep)} serving-loop steps ({sum(s.get('tokens', 0) for s in sweep)} tokens) and "
        f"{sum(s.get('keys_launched', 0) for s in sweep)} key launches: **{d['total_misses']} misses**.",
        "",
    ]


def render() -> str:
    lines: list[str] = []
    if (ROOT / "docs" / "warm_time.png").exists():
        lines += ["![warm time](docs/warm_time.png)", ""]
    for name, fn in (("warm_time_h200", warm_table), ("warm_time_cpu2core_cuda90", warm_table), ("gpu_proof_h200", proof_lines), ("gpu_all_keys_h200", all_keys_table), ("multi_gpu_h200x2", multi_gpu_lines)):
        data = _load(name)
        if data is not None:
            lines += fn(data)
    for name, title in (("kernels_dsv4_index_h200", "DeepSeek-V4 index and metadata kernels"), ("kernels_numeric_h200", "Numeric kernels (DeepSeek-V4, shared Q/KV RMSNorm, Kimi-K3 KDA)")):
        data = _load(name)
        if data is not None:
            lines += kernels_table(data, title)
    return "\n".join(lines)


def chart() -> Path | None:
    """A bar chart of the warm-time variants on both machines (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [(name, _load(f"warm_time_{name}")) for name in ("h200", "cpu2core_cuda90")]
    runs = [(n, d) for n, d in runs if d is not None]
    if not runs:
        return None
    labels = ["cold, 1 worker", "cold, threads", "cold, processes", "warm disk cache", "from pack"]
    keys = ["cold_serial", "cold_threads", "cold_processes", "warm_disk_cache", "from_pack"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(runs)
    for i, (name, d) in enumerate(runs):
        values = [d["variants"].get(k, {}).get("wall", 0.0) for k in keys]
        where = "H200 host, 16 CPUs" if name == "h200" else "CPU machine, 2 cores (cross-compile cuda:90)"
        bars = ax.bar([x + i * width for x in range(len(keys))], values, width, label=where)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(keys))], labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"warmreg warm time, DeepSeek-V4-Flash example ({runs[0][1]['variants']['cold_serial']['keys']} keys)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = ROOT / "docs" / "warm_time.png"
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    chart()
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{START}\n{render()}\n{END}{tail}")


if __name__ == "__main__":
    main()
