"""CLI sub-commands of the monitor: ``warmreg replay FILE`` and ``warmreg report FILE``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import add_json, emit_json, out, show_table

__all__ = ["add_commands"]



def _cmd_replay(args: argparse.Namespace) -> int:
    from ..monitoring.replay import replay

    results = replay(args.file, target=args.target)
    for r in results:
        if r.skipped:
            out.print(f"[yellow]skipped[/] {r.jit_name}: {r.skipped}", highlight=False)
        else:
            out.print(f"{'[green]ok[/]' if r.ok else '[red]failed[/]'} {r.jit_name} for {r.target}{'' if r.ok else ': ' + str(r.error)}")
    compiled, skipped = sum(r.ok for r in results), sum(1 for r in results if r.skipped)
    failed = len(results) - compiled - skipped
    out.print(f"{compiled} of {len(results)} records compiled, {failed} failed, {skipped} skipped")
    return 0 if compiled and not failed else 1  # nothing replayed is a failure too


def _cmd_report(args: argparse.Namespace) -> int:
    from ..monitoring.coverage import coverage, load_observations
    from ..pipeline.plugins import load_plugins
    from ..pipeline.report import WarmReport

    load_plugins(on_plugin_error="skip")  # the plugins define the key types the files name

    used: dict[str, Any] = {}
    misses: list[Any] = []
    for path in args.files:
        u, m = load_observations(path)
        for k, v in u.items():
            used.setdefault(k, set()).update(v)
        misses.extend(m)
    warm_report = WarmReport.from_json(json.loads(Path(args.warm_report).read_text())) if args.warm_report else None
    cov = coverage(warm_report, used, misses)
    if not (args.json and emit_json(args, "coverage", cov.to_json())):
        rows = [
            [row.kernel, str(row.declared), str(row.compiled), str(row.hit), str(row.missed), str(row.unused), str(row.not_chosen)]
            for row in cov.kernels
        ]
        show_table("warmreg coverage", ["kernel", "declared", "compiled", "hit", "missed", "unused", "not chosen"], rows)
        for miss in cov.misses:
            out.print(miss.explain(), highlight=False)
    if args.require_complete and not cov.complete:
        return 1
    return 0


def add_commands(sub: Any) -> None:
    r = sub.add_parser("replay", help="compile the specializations in a record file")
    r.add_argument("file", help="JSON lines written by the monitor in record mode")
    r.add_argument("--target", default=None, help="compile for this target instead of the recorded one")
    r.set_defaults(func=_cmd_replay)
    p = sub.add_parser("report", help="coverage: declared / compiled / hit / missed / unused per kernel")
    p.add_argument("files", nargs="+", help="monitor snapshots (Monitor.save) or record files")
    p.add_argument("--warm-report", default=None, help="the WarmReport JSON of the warm (warmreg warm --json)")
    add_json(p, "the coverage")
    p.add_argument("--require-complete", action="store_true", help="exit 1 if anything missed (for CI)")
    p.set_defaults(func=_cmd_report)
