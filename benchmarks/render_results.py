"""Render the results docs from the result files: the full history of the H200 runs
(``benchmarks/results/h200_triton-*.json``, one per Triton release, from ``benchmarks/run_gpu.py``), the
summary runs (``summary.json``, from ``benchmarks/summary.py``), the CPU machine's and the 2-GPU run's files,
into ``docs/results.md``, and a short summary table into ``README.md``, each between the markers
``<!-- results:start -->`` and ``<!-- results:end -->``. Everything else in either file is kept as it is
(in ``docs/results.md`` the generated block starts the file; the notes after it are written by hand).

    python3 benchmarks/render_results.py            # rewrites both blocks (and docs/warm_time.png, with matplotlib)
    python3 benchmarks/render_results.py --check    # exit 1, naming the file, if either block is stale
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
COMMAND = "python3 benchmarks/render_results.py"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _release_key(path: Path) -> tuple[int, ...]:
    version = path.stem.split("_triton-", 1)[1]
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def gpu_runs() -> list[tuple[str, dict[str, Any]]]:
    """(Triton version, results) of each H200 run, oldest release first."""
    paths = sorted(RESULTS.glob("h200_triton-*.json"), key=_release_key)
    return [(p.stem.split("_triton-", 1)[1], json.loads(p.read_text())) for p in paths]


def _steps(gpu: dict[str, Any]) -> dict[str, Any]:
    return {name: st["result"] for name, st in gpu.get("steps", {}).items() if st.get("result")}


def _machine(d: dict[str, Any]) -> str:
    m = d["machine"]
    gpu = m.get("gpu") or "no GPU"
    return f"{gpu}, {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, Triton {m['triton']} ({d['time']})"


_VARIANTS = [("cold_serial", "cold, 1 worker"), ("cold_threads", "cold, all cores (threads)"),
             ("cold_processes", "cold, all cores (processes)"), ("warm_disk_cache", "warm disk cache"),
             ("from_pack", "from a pack built on the CPU machine"),
             ("warm_disk_cache_prefetched", "warm disk cache, engine-style start-up"),
             ("from_pack_prefetched", "from the pack, engine-style start-up")]  # fmt: skip


def warm_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One row per (machine, config): wall seconds of each warm variant, side by side."""
    out = ["Warm time in seconds (each variant a fresh process with its own Triton cache; CUDA context created "
           "before the timer, as in an engine). \"processes\": in runs from 2026-12-02 on, the default path, the misses "
           "compiled in forked children (`warmreg.stages.processes`); in the earlier H200 runs, fresh processes that each imported "
           "torch and the plugins and compiled a shard:", "",
           "| machine | config | keys / kernels | " + " | ".join(label for _, label in _VARIANTS) + " |",
           "| --- | --- | --- |" + " ---: |" * len(_VARIANTS)]  # fmt: skip
    for where, d in runs:
        v = d["variants"]
        cells = [f"{v[k]['wall']:.2f}" if k in v else "-" for k, _ in _VARIANTS]
        first = v["cold_serial"]
        out.append(
            f"| {where} | `{Path(d['config']).stem}` | {first['keys']} / {first['kernels']} | "
            + " | ".join(cells)
            + " |"
        )
    return out + [""]


def profile_lines(d: dict[str, Any]) -> list[str]:
    def top(run: dict[str, Any], n: int) -> str:
        rows = sorted(run["stages"].items(), key=lambda kv: -kv[1]["seconds"])[:n]
        return "; ".join(f"{name} {row['seconds']:.2f} s over {row['threads']} threads" for name, row in rows)

    cold, warm = d["cold"], d["warm_cache"]
    return [
        f"Where the time goes (`benchmarks/profile_warm.py`, {d['workers']} workers, CPU-seconds summed over threads): "
        f"cold {cold['wall']:.2f} s wall: {top(cold, 5)}. From the warm cache {warm['wall']:.2f} s wall: {top(warm, 4)}. "
        f"sympy imported during warm: {cold['sympy_imported'] or warm['sympy_imported']}.",
        "",
    ]


def proof_lines(d: dict[str, Any]) -> list[str]:
    s, lo = d["sweep"], d["launch_overhead_us"]
    pairs = [w / x for w, x in zip(lo["warmreg"], lo["triton_direct_with_output_alloc"])]
    paired = lo.get("ratio_same_work_paired", statistics.median(pairs))
    best = lo.get("ratio_same_work_best", min(lo["warmreg"]) / min(lo["triton_direct_with_output_alloc"]))
    return [
        f"RMSNorm proof: {d['warm']['summary']}; then {s['launches']} real Q/KV RMSNorm launches, T = {s['token_counts'][0]}..{s['token_counts'][1]}, "
        f"monitor armed: **{len(s['misses'])} misses**; max |error| vs the PyTorch reference {s['max_abs_err_vs_reference']:g} (bf16); "
        f"first launch after warm {s['first_launch_ms']:.3f} ms.",
        "",
        f"Host cost per launch (T = 1; {len(pairs)} interleaved rounds of 2000 calls; µs are medians over rounds, "
        "ratios are to Triton with the same allocations):",
        "",
        "| path | µs per call | ratio of medians |",
        "| --- | ---: | ---: |",
        f"| warmreg op (validate, dispatch, allocate 2 outputs, guarded fast launch) | {lo['median_warmreg']:.1f} | {lo['ratio_same_work']:.2f} |",
        f"| warmreg op through `JITFunction.run` (fast launch off) | {lo['median_warmreg_via_triton_run']:.1f} | {lo['ratio_same_work_via_triton_run']:.2f} |",
        f"| Triton `kernel[grid](...)`, same 2 allocations | {lo['median_triton_direct_with_output_alloc']:.1f} | 1.00 |",
        f"| Triton `kernel[grid](...)`, preallocated outputs | {lo['median_triton_direct']:.1f} | - |",
        "",
        f"warmreg against Triton with the same allocations, round by round (both back to back, so the host's drift "
        f"between rounds cancels): median ratio **{paired:.2f}** (rounds: {', '.join(f'{p:.2f}' for p in pairs)}); "
        f"fastest round against fastest round {best:.2f}. Where the time goes in warmreg's call (each part alone): "
        + "; ".join(f"{k} {v:.1f} µs" for k, v in lo.get("breakdown_us", {}).items())
        + ".",
        "",
    ]


def sweep_table(d: dict[str, Any]) -> list[str]:
    runs = d["configs"]
    packed = any(c.get("pack") for c in runs)
    source = "`warm()` from the CPU-built pack" if packed else "a cold `warm()`"
    out = [f"Zero-JIT sweep (`benchmarks/sweep.py`): per config, {source}, monitor in `error`, "
           "then randomized decode-only / prefill-only / mixed engine steps (token counts 1..max_num_batched_tokens, "
           "sequence lengths up to max_model_len, every layer type) through every registered kernel with real tensors:", "",
           "| config | steps (decode / prefill / mixed) | tokens | longest sequence | kernels launched | launches | misses | failures |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for c in runs:
        k = c["kernels"].values()
        kinds = c["step_kinds"]
        mix = " / ".join(str(kinds.get(x, 0)) for x in ("decode", "prefill", "mixed"))
        failures = sum(x["failures"] for x in k) + len(c.get("step_failures", []))
        out.append(f"| `{Path(c['config']).stem}` | {c['steps']} ({mix}) | {c['tokens']} | {c['max_seq_len_seen']} "
                   f"| {sum(1 for x in k if x['launches'])}/{len(c['kernels'])} | {sum(x['launches'] for x in k)} "
                   f"| **{sum(x['misses'] for x in k)}** | {failures} |")  # fmt: skip
    for crash in d.get("crashed", []):
        out.append(f"| `{Path(crash['config']).stem}` | crashed: {crash['error'][:120]} | | | | | | |")
    names = sorted({n for c in runs for n in c["kernels"]})
    out += ["", "Launches (misses) per kernel:", "",
            "| kernel | " + " | ".join(f"`{Path(c['config']).stem}`" for c in runs) + " |",
            "| --- |" + " ---: |" * len(runs)]  # fmt: skip
    for n in names:
        cells = [
            f"{c['kernels'][n]['launches']} ({c['kernels'][n]['misses']})" if n in c["kernels"] else "-" for c in runs
        ]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out + [""]


def all_keys_table(d: dict[str, Any]) -> list[str]:
    out = ["Every warmed key launched for real (`benchmarks/gpu_all_keys.py`, monitor recording), first launch after "
           "warm against the median of 20 steady-state launches (ms, synchronized, medians over keys):", "",
           "| config | warm | keys launched | launch failures | misses | launches through `JITFunction.run` | first launch ms | steady launch ms |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for c in d["configs"]:
        kernels = c["kernels"].values()
        launched = sum(k["launched"] for k in kernels)
        failures = sum(len(k["failures"]) for k in kernels)
        first = [x for k in kernels for x in k["first_ms"]]
        steady = [x for k in kernels for x in k["steady_ms"]]
        src = " (from pack)" if c.get("pack") else ""
        slow = sum(k["triton_run_calls"] for k in kernels) if all("triton_run_calls" in k for k in kernels) else "-"
        out.append(f"| `{Path(c['config']).stem}`{src} | {c['warm_summary']} | {launched} | {failures} | {len(c['misses'])} "
                   f"| {slow} | {statistics.median(first):.3f} | {statistics.median(steady):.3f} |")  # fmt: skip
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
        size = (
            last.get("size")
            or ", ".join(f"{k}={last[k]}" for k in ("T", "num_prefills", "prefills", "N") if k in last)
            or "?"
        )
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


def releases_table(gpus: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The H200 runs side by side, one row per Triton release: what a user of each release gets."""
    out = ["The H200 runs side by side (one H200 host type, one day, each release's own CPU-built packs; details per release below):", "",
           "| Triton | GPU tests | Flash cold (threads) s | Flash warm cache s | Flash from pack s | sweep launches / misses "
           "| every key: launched / misses / through `JITFunction.run` | launch µs warmreg / Triton same work |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for version, gpu in gpus:
        steps = _steps(gpu)
        flash = steps.get("warm_time:deepseek_v4_flash", {}).get("variants", {})
        cell = {
            k: f"{flash[k]['wall']:.2f}" if k in flash else "-"
            for k in ("cold_threads", "warm_disk_cache", "from_pack")
        }
        sweep = steps.get("sweep", {}).get("configs", [])
        launches = sum(x["launches"] for c in sweep for x in c["kernels"].values())
        misses = sum(x["misses"] for c in sweep for x in c["kernels"].values())
        keys = steps.get("gpu_all_keys", {}).get("configs", [])
        launched = sum(k["launched"] for c in keys for k in c["kernels"].values())
        key_misses = sum(len(c["misses"]) for c in keys)
        slow = sum(k.get("triton_run_calls", 0) for c in keys for k in c["kernels"].values())
        lo = steps.get("gpu_proof", {}).get("launch_overhead_us", {})
        tests_file = RESULTS / "gpu_tests" / f"gpu_tests_triton-{version}.txt"
        tests = tests_file.read_text().strip().splitlines()[-1] if tests_file.exists() else "-"
        us = f"{lo['median_warmreg']:.1f} / {lo['median_triton_direct_with_output_alloc']:.1f}" if lo else "-"
        out.append(f"| {version} | {tests} | {cell['cold_threads']} | {cell['warm_disk_cache']} | {cell['from_pack']} "
                   f"| {launches} / **{misses}** | {launched} / **{key_misses}** / {slow} | {us} |")  # fmt: skip
    return out + [""]


#: summary.json's figures with the target each is held to (issue 41's; a ratio of two figures where it is one).
_SUMMARY_COLUMNS = [
    ("launch_driver_us", "bare cuLaunchKernelEx µs", None),
    ("launch_fast_us", "fast launch µs", "≤ 1.3 x bare cuLaunchKernelEx"),
    ("launch_triton_prealloc_us", "Triton prealloc µs", None),
    ("launch_op_us", "op µs", "op ≤ 0.6 x Triton same alloc"),
    ("launch_triton_same_alloc_us", "Triton same alloc µs", None),
    ("first_over_steady", "first / steady (information)", None),
    ("first_over_steady_walk_each", "first / steady, same CPU state (walk_each)", "≤ 1.1"),
    ("first_launch_compiles", "first launches: compiles + loads + Triton calls", "= 0"),
    ("warm_pack_s", "warm from pack s", "≤ 0.08"),
    ("warm_cache_s", "warm cache s", "≤ 0.10"),
    ("warm_cold_s", "warm cold s", "≤ 1.0"),
    ("warm_cold_threads_s", "cold, threads only s", None),
    ("kimi_full_cold_s", "Kimi-K3 full cold s", "≤ 1.2 x its slowest key alone"),
    ("kimi_full_critical_path_s", "its slowest key alone s", None),
    ("kimi_full_pack_s", "Kimi-K3 full from its pack s", "≤ 0.2"),
    ("sweep_misses", "sweep misses", "= 0"),
]


def _met(entry: dict[str, Any]) -> dict[str, bool]:
    """Which of an entry's figures meet their target (a figure the entry lacks is not judged)."""
    e = entry
    checks = {
        "launch_fast_us": lambda: e["launch_fast_us"] <= 1.3 * e["launch_driver_us"],
        "launch_op_us": lambda: e["launch_op_us"] <= 0.6 * e["launch_triton_same_alloc_us"],
        "first_over_steady_walk_each": lambda: e["first_over_steady_walk_each"] <= 1.1,
        "first_launch_compiles": lambda: e["first_launch_compiles"] + e["first_launch_module_loads"] + e["first_launch_triton_calls"] == 0,
        "warm_pack_s": lambda: e["warm_pack_s"] <= 0.08,
        "warm_cache_s": lambda: e["warm_cache_s"] <= 0.10,
        "warm_cold_s": lambda: e["warm_cold_s"] <= 1.0,
        "kimi_full_cold_s": lambda: e["kimi_full_cold_s"] <= 1.2 * e["kimi_full_critical_path_s"],
        "kimi_full_pack_s": lambda: e["kimi_full_pack_s"] <= 0.2,
        "sweep_misses": lambda: e["sweep_misses"] == 0,
    }
    met = {}
    for key, check in checks.items():
        try:
            met[key] = bool(check())
        except (KeyError, TypeError):  # an entry from before the figure existed
            continue
    return met


def summary_table(summary: dict[str, Any]) -> list[str]:
    """One row per Triton release of ``benchmarks/results/summary.json`` (``benchmarks/summary.py``),
    each figure against its target (✓ met, ✗ not)."""
    gpus = " and ".join(sorted({e["machine"]["gpu"] for e in summary.values()}))
    out = [f"Launch and warm on the {gpus} (`benchmarks/summary.py`, one run per release; medians: the raw rounds are in the files summary.json names per release; "
           "each warm after `warmreg.prefetch()` as an engine calls it, at start-up, unless it says otherwise; cold: the misses compiled in forked processes, "
           "the default, against threads only):", "",
           "| Triton | " + " | ".join(label for _, label, _ in _SUMMARY_COLUMNS) + " | run |",
           "| --- |" + " ---: |" * len(_SUMMARY_COLUMNS) + " --- |",
           "| target | " + " | ".join(target or "" for _, _, target in _SUMMARY_COLUMNS) + " | |"]  # fmt: skip
    for release, e in sorted(summary.items(), key=lambda kv: _release_key(Path(f"x_{kv[0]}"))):
        met = _met(e)
        cells = []
        for key, _, _ in _SUMMARY_COLUMNS:
            value = e.get(key)
            if key == "first_launch_compiles" and value is not None:
                value = value + e["first_launch_module_loads"] + e["first_launch_triton_calls"]
            # seconds under one shown to the millisecond: a target of 0.08 s is met or missed by less than 0.01 s
            digits = 3 if key.endswith("_s") and isinstance(value, float) and value < 1 else 2
            text = "-" if value is None else (f"{value}" if isinstance(value, int) else f"{value:.{digits}f}")
            cells.append(text + (" ✓" if met.get(key) else " ✗" if key in met else ""))
        out.append(
            f"| {release.removeprefix('triton-')} | "
            + " | ".join(cells)
            + f" | {e['machine']['gpu']}, {e['machine']['cpus']} CPUs, {e['time']} |"
        )
    return out + [""]


def _ratios(rows: list[dict[str, Any]], ours: str, theirs: str) -> dict[Any, list[float]]:
    out: dict[Any, list[float]] = {}
    for r in rows:
        g = r.get("graphs", {})
        if ours in g and theirs in g:
            out.setdefault(r["tokens"] if "tokens" in r else r.get("step"), []).append(
                g[ours]["median_us"] / g[theirs]["median_us"]
            )
    return out


def fidelity_lines() -> list[str]:
    """The ops against vLLM's own kernels on the H200 (kernels_attn_res, kernels_kda_recurrent), the KDA step's
    per-token cost (kernels_numeric ... kda_vllm_convention) and the sweep over every example after those changes."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("kernels_attn_res_h200_triton-*.json")):
        d = json.loads(path.read_text())
        out += [f"`attn_res` against vLLM's own `_attn_res_kernel`, both launched on the same inputs ({_machine(d)}; "
                f"`{path.name}`, CUDA-graph replay of back-to-back calls, {d['num_sites']} call sites of "
                f"`{Path(d['config']).name}`): warmreg / vLLM time per T, min / median / max over the call sites:", "",
                "| T | min | median | max | outputs equal to vLLM's |", "| ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for tokens, qs in _ratios(d["rows"], "warmreg", "vllm").items():
            rows = [r for r in d["rows"] if r["tokens"] == tokens]
            same = sum(1 for r in rows if r.get("check", {}).get("warmreg_vs_vllm", {}).get("differing") == 0)
            qs = sorted(qs)
            out.append(
                f"| {tokens} | {qs[0]:.3f} | {qs[len(qs) // 2]:.3f} | {qs[-1]:.3f} | {same}/{len(rows)} bitwise |"
            )
        out.append("")
    for path in sorted(RESULTS.glob("kernels_kda_recurrent_h200_triton-*.json")):
        d = json.loads(path.read_text())
        out += [f"`kimi_k3.kda_recurrent` against vLLM's own `fused_recurrent_kda` ({_machine(d)}; `{path.name}`):", ""]
        out += ["| step | N | warmreg us | vLLM us | vLLM / warmreg | o, pool bytes equal to vLLM's |",
                "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for r in d["rows"]:
            t, c = r["timing"], r["check"]
            same = c["o_vs_vllm"]["differing"] == 0 and c["pool_vs_vllm"]["differing"] == 0
            out.append(f"| {r['mode']} ({r['tokens'] // r['seqs']} token{'s' if r['tokens'] > r['seqs'] else ''} a sequence) "
                       f"| {r['seqs']} | {t['warmreg']['median_us']:.1f} | {t['vllm']['median_us']:.1f} "
                       f"| {r['vllm_over_warmreg']:.3f} | {'bitwise' if same else 'differ'} |")  # fmt: skip
        out.append("")
    for path in sorted(RESULTS.glob("kernels_numeric_h200_triton-*_kda_vllm_convention.json")):
        d = json.loads(path.read_text())
        out += [f"The KDA step per token, in vLLM's convention (`{path.name}`, {_machine(d)}): kernel, eager PyTorch "
                "reference and, for one-token steps, the packed decode vLLM runs there (microseconds a token):", "",
                "| step | check | kernel | eager reference | packed decode |", "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        for size in d["kernels"]["kda_recurrent"]["sizes"]:
            eager = size.get("eager_ref_us_per_token")
            packed = size.get("kda_packed_decode_us_per_token")
            out.append(f"| {size['size']} | {size['check']} | {size['kernel_us_per_token']:.3f} | "
                       f"{_num(eager, '.1f') if eager else 'capped'} | {_num(packed, '.3f') if packed else '-'} |")  # fmt: skip
        out.append("")
    for path in sorted(RESULTS.glob("sweep_h200_triton-*_fidelity.json")):
        d = json.loads(path.read_text())
        out += [f"After the fidelity changes (`{path.name}`):", ""] + sweep_table(d)
    for path in sorted(RESULTS.glob("sweep_*_triton-*_layers.json")):  # the GPU the device gave: H100 or H200
        d = json.loads(path.read_text())
        out += [f"After the layers redesign, on {d['machine']['gpu']} (`{path.name}`):", ""] + sweep_table(d)
    for path in sorted(RESULTS.glob("sweep_*_triton-*_session.json")):
        d = json.loads(path.read_text())
        out += [f"With vLLM 0.34's kernels (issue 37: the DeepSeek-V4.1 and Kimi-K3 DSA examples), on {d['machine']['gpu']} "
                f"(`{path.name}`):", ""] + sweep_table(d)
    for path in sorted(RESULTS.glob("sweep_*_triton-*_wave6*.json")):
        d = json.loads(path.read_text())
        note = " (DeepSeek-V4.1 alone, after its sweep driver drew inputs on the GPU)" if path.stem.endswith("_v41") else ""
        out += [f"Every vLLM 0.34 kernel covered (issue 37, wave 6), on {d['machine']['gpu']}, Triton {d['machine']['triton']}{note} "
                f"(`{path.name}`):", ""] + sweep_table(d)
    return out + floor_session_table()


def _candidate_line(at: dict[str, Any]) -> str:
    """Each autotuned kernel's candidates in a Kimi-K3 full cold warm: compile seconds beside the other keys, and the
    benchmark's µs with the candidate the tuning kept (issue 41: may a candidate that never wins be pruned?)."""
    seconds: dict[str, dict[int, float]] = {}
    for k in at["cold"]["keys"]:
        if k.get("candidate") is not None:
            seconds.setdefault(k["kernel"], {})[int(k["candidate"])] = k["seconds"]
    bench = {c["kernel"]: c for c in at["cold"].get("tuning", {}).get("choices", [])}
    out = []
    for kernel, per in sorted(seconds.items()):
        us = bench.get(kernel, {}).get("microseconds", {})
        cells = ", ".join(
            f"{i}: {per[i]:.2f} s" + (f" / {us[str(i)]:.0f} µs" if str(i) in us else "") for i in sorted(per)
        )
        kept = bench.get(kernel, {}).get("config")
        out.append(f"`{kernel.split('.', 1)[1]}` ({cells}; kept {kept})")
    return "candidates compiled (s) and benchmarked (µs) in the Kimi-K3 full cold warm: " + "; ".join(out) + "."


def floor_session_table() -> list[str]:
    """Issue 41's figures of each device session, per Triton release (files ``*_wave<N>.json``, one session each): the
    launch against the driver's floor, what first launches did, the autotuned example against its critical path and
    from its pack, and the Flash warm."""
    rows, parts = [], []
    for lf_path in sorted(RESULTS.glob("launch_floor_*_triton-*_wave*.json")):
        tag = lf_path.stem.removeprefix("launch_floor_")
        lf = json.loads(lf_path.read_text())
        keys, at, wt = (_load(f"{stem}_{tag}") for stem in ("gpu_all_keys", "autotune_warm", "warm_time"))
        med, paired = lf["median_us"], lf["paired_ratios"]
        work = keys["configs"][0].get("first_launch_work", {}) if keys else {}
        v = wt["variants"] if wt else {}
        kimi_pack = at.get("kimi_full_pack_s") if at else None
        cells = [
            f"{tag.rsplit('_', 1)[1]}: {lf['time'][:10]}, {lf['machine']['gpu']}, Triton {lf['machine']['triton']}",
            f"{med['driver']:.2f}", f"{med['fast']:.2f} ({paired['fast_over_driver']:.2f}x)",
            f"{med['fast_getters']:.2f} ({paired['fast_getters_over_driver']:.2f}x)", f"{med['floor']:.2f}",
            " / ".join(str(work.get(k, "-")) for k in ("compiles", "module_loads", "triton_run", "triton_launcher")),
            f"{at['kimi_full_cold_s']:.2f} / {at['kimi_full_critical_path_s']:.2f} ({at['cold_over_critical_path']:.2f}x)" if at else "-",
            f"{kimi_pack:.3f}" if kimi_pack is not None else "-",
            f"{v['cold_processes_prefetched']['wall']:.2f}" if v else "-",
            f"{v['warm_disk_cache_prefetched']['wall']:.2f}" if v else "-",
            f"{v['from_pack_prefetched']['wall']:.2f}" if "from_pack_prefetched" in v else "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
        if at:
            parts.append(f"- {tag}: {_candidate_line(at)}")
        if "driver_then_pack_minus_driver_us" in paired:
            shim = (
                f" (this run's C entry read them through torch's C shim: {med['fast']:.2f} µs; through the getters "
                f"{med['fast_python_context']:.2f} µs)" if "fast_python_context" in med else ""
            )
            parts.append(
                f"- {tag}: after each driver launch, the entry's guards and parameter packing alone (`Entry.pack`) took "
                f"{paired['driver_then_pack_minus_driver_us']:.2f} µs of the fast launch's {med['fast'] - med['driver']:.2f} µs above the "
                f"driver; torch's two Python getters of the current device and stream, called from Python, "
                f"{paired['driver_then_context_minus_driver_us']:.2f} µs{shim}."
            )
    if not rows:
        return []
    return ["Issue 41 on the device, one row per session and release (`launch_floor.py`, `gpu_all_keys.py`, `autotune_warm.py`, "
            "`warm_time.py --quick --rounds 3`; files `*_wave<N>.json`): host µs per launch of the fused Q/KV RMSNorm at T = 1, a bare "
            "`cuLaunchKernelEx` against warmreg's C launch reading tensors through torch's C shim and through torch.Tensor's getters, "
            "and Triton's prepared launcher; what the first launch of each of the Flash example's 75 keys did (compiles / module loads / "
            "`JITFunction.run` / the compiled kernel's launcher); the Kimi-K3 full example cold against its slowest key compiled alone, "
            "and from its pack (tuning choices from the pack); the Flash warm, cold, from the disk cache and from a pack, s (median of 3, "
            "after `prefetch()`). Targets: fast ≤ 1.3x the driver, Kimi cold ≤ 1.2x the critical path, Kimi pack ≤ 0.2 s, Flash cold "
            "≤ 1.0 s, cache ≤ 0.10 s, pack ≤ 0.08 s:", "",
            "| session, machine | driver µs | fast µs | fast, getters µs | Triton launcher µs | first launches | Kimi full cold / critical path s | Kimi pack s | Flash cold s | Flash cache s | Flash pack s |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |", *rows, "", *parts, *([""] if parts else [])]  # fmt: skip


def render() -> str:
    """The full results history: every table of every run, as ``docs/results.md`` holds it."""
    lines: list[str] = []
    gpus = gpu_runs()
    summary = _load("summary")
    if summary:
        lines += summary_table(summary)
    if (ROOT / "docs" / "warm_time.png").exists():
        lines += ["![warm time](warm_time.png)", ""]
    runs = [
        (f"H200 host, Triton {version}", result)
        for version, gpu in gpus
        for name, result in _steps(gpu).items()
        if name.startswith("warm_time:")
    ]
    cpu = _load("warm_time_cpu2core_cuda90")
    if cpu is not None:
        runs.append((f"CPU machine, 2 cores, cross cuda:90, Triton {cpu['machine']['triton']}", cpu))
    if len(gpus) > 1:
        lines += releases_table(gpus)
    if runs:
        lines += warm_table(runs)
    for version, gpu in gpus:
        steps = _steps(gpu)
        status = ", ".join(
            f"{name} {'ok' if st['rc'] == 0 else 'rc ' + str(st['rc'])} ({st['wall_s']:.0f} s)"
            for name, st in gpu["steps"].items()
        )
        commands = " and ".join(f"`{c}`" for c in gpu.get("commands", [gpu["command"]]))
        lines += [f"### H200, Triton {version}", "", f"GPU run: {commands} on {_machine(gpu)}; steps: {status}.", ""]
        for name, fn in (
            ("profile_warm", profile_lines),
            ("gpu_proof", proof_lines),
            ("sweep", sweep_table),
            ("gpu_all_keys", all_keys_table),
        ):
            if name in steps:
                lines += fn(steps[name])
        for name, title in (
            ("kernels_dsv4_index", "DeepSeek-V4 index and metadata kernels"),
            ("kernels_numeric", "Numeric kernels (DeepSeek-V4, shared Q/KV RMSNorm, Kimi-K3 KDA)"),
        ):
            if name in steps:
                lines += kernels_table(steps[name], title)
    fidelity = fidelity_lines()
    if fidelity:
        lines += ["### The ops against the engine's own kernels, H200", "", *fidelity]
    multi = _load("multi_gpu_h200x2")
    if multi is not None:
        lines += ["### Two H200s", "", *multi_gpu_lines(multi)]
    return "\n".join(lines)


def chart() -> Path | None:
    """A bar chart of the warm-time variants on both machines (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [
        (f"H200 host, 16 CPUs, Triton {version}", _steps(gpu).get("warm_time:deepseek_v4_flash"))
        for version, gpu in gpu_runs()
    ]
    runs += [("CPU machine, 2 cores (cross-compile cuda:90)", _load("warm_time_cpu2core_cuda90"))]
    runs = [(n, d) for n, d in runs if d is not None]
    if not runs:
        return None
    labels = ["cold, 1 worker", "cold, threads", "cold, processes", "warm disk cache", "from pack"]
    keys = ["cold_serial", "cold_threads", "cold_processes", "warm_disk_cache", "from_pack"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(runs)
    for i, (name, d) in enumerate(runs):
        values = [d["variants"].get(k, {}).get("wall", 0.0) for k in keys]
        bars = ax.bar([x + i * width for x in range(len(keys))], values, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(keys))], labels, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"warmreg warm time, DeepSeek-V4-Flash example ({runs[0][1]['variants']['cold_serial']['keys']} keys)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = ROOT / "docs" / "warm_time.png"
    fig.savefig(out, dpi=120)
    return out


def _release(path: Path) -> str:
    return path.stem.split("_triton-", 1)[1].split("_", 1)[0]


def _where(machine: dict[str, Any]) -> str:
    return f"{machine['gpu']}, {machine['cpus']} CPUs, Python {machine['python']}, torch {machine['torch']}"


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _vllm_rows(releases: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Summary rows of the ops against vLLM's own kernels (vLLM's time over warmreg's, above 1: warmreg
    faster), one cell per release, and the (file, machine) each came from."""
    rows: list[str] = []
    sources: list[tuple[str, str]] = []
    for pattern, label in (
        ("kernels_attn_res_h200_triton-*.json", "`kimi_k3.attn_res` against vLLM's `_attn_res_kernel`"),
        ("kernels_kda_recurrent_h200_triton-*.json", "`kimi_k3.kda_recurrent` against vLLM's `fused_recurrent_kda`"),
    ):
        cells = dict.fromkeys(releases, "-")
        for path in sorted(RESULTS.glob(pattern)):
            d = json.loads(path.read_text())
            if "num_sites" in d:  # attn_res: every call site at every token count, outputs compared bitwise
                ratios = [x for xs in _ratios(d["rows"], "vllm", "warmreg").values() for x in xs]
                same = sum(1 for r in d["rows"] if r.get("check", {}).get("warmreg_vs_vllm", {}).get("differing") == 0)
                shape = f"{d['num_sites']} call sites x {len(d['tokens'])} token counts"
            else:  # kda_recurrent: each step shape, outputs and state pool compared bitwise
                ratios = [r["vllm_over_warmreg"] for r in d["rows"]]
                checks = [r["check"] for r in d["rows"]]
                same = sum(1 for c in checks if c["o_vs_vllm"]["differing"] == c["pool_vs_vllm"]["differing"] == 0)
                shape = f"{len(d['rows'])} step shapes"
            cells[_release(path)] = f"{_range(ratios)} ({shape}; {same}/{len(d['rows'])} bitwise equal)"
            sources.append((f"`{path.name}` {d['time']}", _where(d["machine"])))
        rows.append(f"| {label}: vLLM's time / warmreg's | " + " | ".join(cells[r] for r in releases) + " |")
    return rows, sources


def readme_summary() -> str:
    """The README's summary table: a handful of figures per Triton release, each cell from a result file."""
    summary = _load("summary")
    if not summary:
        return "No summary run in `benchmarks/results/` yet: see [docs/results.md](docs/results.md)."
    entries = sorted(summary.items(), key=lambda kv: _release_key(Path(f"x_{kv[0]}")))
    releases = [name.removeprefix("triton-") for name, _ in entries]
    es = [e for _, e in entries]

    def row(label: str, cell: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | " + " | ".join(cell(e) for e in es) + " |"

    def launch(e: dict[str, Any], ours: str, theirs: str) -> str:
        return f"{e[ours]:.1f} / {e[theirs]:.1f} ({e[ours] / e[theirs]:.2f}x)"

    vllm, vllm_sources = _vllm_rows(releases)
    sources = [(f"`summary.json` {r} {e['time']}", _where(e["machine"])) for r, e in zip(releases, es)]
    machines = sorted({m for _, m in sources + vllm_sources})
    warms = [json.loads((RESULTS / e["files"]["warm"]).read_text()) for e in es]
    sweeps = [json.loads((RESULTS / e["files"]["sweep"]).read_text()) for e in es]
    warmed = sorted({f"`{Path(w['config']).name}` ({e['warm_keys']} keys)" for e, w in zip(es, warms)})
    rounds = "/".join(sorted({str(w["rounds"]) for w in warms}))
    swept = "/".join(sorted({str(len(s["configs"])) for s in sweeps}))
    out = [
        f"Measured on {' and on '.join(machines)}, from `benchmarks/results/` "
        f"({', '.join(s for s, _ in sources + vllm_sources)}). Warm: {', '.join(warmed)} after `warmreg.prefetch()` "
        f"as an engine calls it, each figure the median of {rounds} fresh processes.",
        "",
        "| | " + " | ".join(f"Triton {r}" for r in releases) + " |",
        "| --- |" + " ---: |" * len(releases),
        row("warm from a pack (installed by `prefetch(pack=...)`), s", lambda e: f"{e['warm_pack_s']:.3f}"),
        row("warm from the disk cache, s", lambda e: f"{e['warm_cache_s']:.3f}"),
        row(
            f"cold warm, every core ({'/'.join(sorted({str(e['warm_cpus']) for e in es}))} CPUs), s",
            lambda e: f"{e['warm_cold_s']:.2f}",
        ),
        row(
            f"runtime compiles after warm: sweep of {swept} example configs, monitor in `error` (misses / launches)",
            lambda e: f"**{e['sweep_misses']}** / {e['sweep_launches']}",
        ),
        row(
            "host µs per launch at T = 1, the whole Q/KV RMSNorm op / Triton's `kernel[grid](...)` allocating the same two outputs",
            lambda e: launch(e, "launch_op_us", "launch_triton_same_alloc_us"),
        ),
        row(
            "host µs per launch at T = 1, warmreg's guarded fast launch / Triton's `kernel[grid](...)`, outputs preallocated",
            lambda e: launch(e, "launch_fast_us", "launch_triton_prealloc_us"),
        ),
        *_issue41_rows(es, row, launch),
        *vllm,
        "",
        "Every run, kernel and table, with the targets each figure is held to: [docs/results.md](docs/results.md).",
    ]
    return "\n".join(out)


def _issue41_rows(es: list[dict[str, Any]], row: Callable[..., str], launch: Callable[..., str]) -> list[str]:
    """The README rows of the figures ``summary.py`` records since issue 41 (the launch against a bare
    ``cuLaunchKernelEx``, the autotuned Kimi-K3 full example), where some release's entry has them ("-" where not)."""
    out = []
    if any(e.get("launch_driver_us") for e in es):
        out.append(row(
            "host µs per launch at T = 1, warmreg's guarded fast launch / a bare `cuLaunchKernelEx` of the same kernel",
            lambda e: launch(e, "launch_fast_us", "launch_driver_us") if e.get("launch_driver_us") else "-",
        ))  # fmt: skip
    if any(e.get("kimi_full_cold_s") for e in es):
        def kimi(e: dict[str, Any]) -> str:
            if not e.get("kimi_full_cold_s"):
                return "-"
            pack = e.get("kimi_full_pack_s")
            return (f"{e['kimi_full_cold_s']:.2f} / {e['kimi_full_critical_path_s']:.2f}"
                    + (f" / {pack:.2f}" if pack is not None else " / -"))  # fmt: skip

        out.append(row("Kimi-K3 full example (autotuned), s: cold / its slowest key compiled alone / from its pack", kimi))
    return out


def results_doc() -> str:
    """The generated head of ``docs/results.md``: what generates it, then :func:`render`."""
    return "\n".join([
        "# Results",
        "",
        f"Generated by `{COMMAND}` from `benchmarks/results/*.json` (each file holds the command, the machine and "
        "the raw numbers); do not edit it between the `results` markers, rerun the command (`--check` fails while "
        "it is stale). The notes after the generated part are written by hand about the runs of their dates, and "
        "the render keeps them.",
        "",
        render(),
    ])  # fmt: skip


def _with_block(path: Path, block: str) -> str:
    """``path``'s text with the part between the markers replaced by ``block``; a missing file is the block alone.

    :raises SystemExit: the file exists without both markers.
    """
    if not path.exists():
        return f"{START}\n{block}\n{END}\n"
    text = path.read_text()
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not (start and end):
        raise SystemExit(f"{path}: no {START} ... {END} block to render into; add both markers where it goes")
    return f"{head}{START}\n{block}\n{END}{tail}"


def expected() -> dict[Path, str]:
    """What each generated file should hold, rendered from the result files now."""
    return {README: _with_block(README, readme_summary()), RESULTS_DOC: _with_block(RESULTS_DOC, results_doc())}


def stale() -> list[Path]:
    """The generated files whose text differs from what the result files render."""
    return [path for path, text in expected().items() if not path.exists() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    """Rewrite both files (``--check``: only report the stale ones). Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md or docs/results.md is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"{shown} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if old else 0
    chart()
    for path, text in expected().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
