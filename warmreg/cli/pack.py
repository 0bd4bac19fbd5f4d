"""CLI sub-commands of packs: ``warmreg build`` and ``warmreg pack inspect|verify|install``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from rich.markup import escape

from .._triton.release import release_of
from .common import add_json, add_serving, emit_json, load_config, out, show_table

__all__ = ["add_commands"]



def _cmd_build(args: argparse.Namespace) -> int:
    from ..stages.build import build, build_wheel

    pythons = [] if args.no_launchers else args.launcher_python  # None: this interpreter, if it can
    config = load_config(args)  # config, --serving/--set and target, checked before anything compiles
    options = {
        "target": args.target, "workers": args.workers, "launcher_pythons": pythons, "tuning_choices": args.tuning,
        "progress": False if args.quiet else None,  # None: a bar when stderr is a terminal
        "keep_in_cache": True,  # a warm here after the build compiles nothing
    }  # fmt: skip
    if args.wheel:
        wrote, manifest = build_wheel(config, args.output, **options)
    else:
        wrote, manifest = args.output, build(config, args.output, force=args.force, **options)
    kernels = {e.kernel for e in manifest.entries}
    out.print(f"wrote {wrote}: {len(manifest.entries)} keys over {len(kernels)} kernels for {manifest.target} (Triton {manifest.triton_version})")
    if manifest.launchers:
        versions = sorted({x.python for x in manifest.launchers})
        out.print(f"  with {len(manifest.launchers)} prebuilt C launchers for Python {', '.join(versions)}")
    elif not release_of(manifest.triton_version).per_signature_launcher:
        out.print(f"  no C launchers needed: Triton {manifest.triton_version} builds none per kernel")
    if manifest.tuning:
        out.print(f"  with {len(manifest.tuning)} autotune choices made on {', '.join(sorted({c.device for c in manifest.tuning}))}")
    elif tuned := _tuned_kernels(config, args.target):
        out.print(
            f"  [yellow]no autotune choices[/] for its {len(tuned)} tuned kernels ({', '.join(tuned)}): a warm from it "
            "benchmarks their candidates on the GPU; build it there without --target, or pass --tuning with the "
            "choice file a warm on that GPU model kept"
        )
    return 0


def _tuned_kernels(config: Any, target: str | None) -> list[str]:
    """The kernels with autotune candidates in the plan a build of ``config`` compiled (planning again: ~10 ms)."""
    from ..api.warm import plan

    return [k.name for k in plan(config, target=target).kernels if k.kernel.tune_configs]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..stages.pack import inspect_pack

    m = inspect_pack(args.pack)
    if args.json and emit_json(args, "pack", {"pack": args.pack, **m.to_json()["body"], "sha256": m.to_json()["sha256"]}):
        return 0
    head = f"pack {args.pack}: format {m.format}, warmreg {m.warmreg_version}, Triton {m.triton_version}, target {m.target}, ptxas {m.ptxas_version}, built on Python {m.python}, model {m.model_type}"
    out.print(escape(head))  # every string of a manifest is the pack's: never rich markup
    rows: dict[str, list[int]] = {}
    for e in m.entries:
        row = rows.setdefault(e.kernel, [0, 0])
        row[0] += 1
        row[1] += sum(f.size for f in e.files)
    show_table(None, ["kernel", "keys", "bytes"], [[name, str(n), str(size)] for name, (n, size) in sorted(rows.items())], console=out)
    if m.launchers:
        by_python: dict[str, int] = {}
        for x in m.launchers:
            by_python[x.python] = by_python.get(x.python, 0) + 1
        out.print(escape("prebuilt C launchers: " + ", ".join(f"{n} for Python {v}" for v, n in sorted(by_python.items()))))
    elif not release_of(m.triton_version).per_signature_launcher:
        out.print(escape(f"no C launchers: Triton {m.triton_version} builds none per kernel (one generic launcher serves every kernel)"))
    else:
        out.print("no prebuilt C launchers: the serving host builds them at warm (Triton 3.6 needs a C compiler there)")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..stages.pack import verify

    m = verify(args.pack, target=args.target)
    out.print(f"[green]ok[/] {escape(args.pack)}: {len(m.entries)} entries, every file matches its sha256; fits Triton {m.triton_version} and {m.target}")
    return 0


def _refusal_lines(refused: Sequence[tuple[str, str]], *, most: int = 5) -> list[str]:
    """Refusals summarized by reason: one line per distinct reason (at most ``most``), with a count."""
    by_reason: dict[str, list[str]] = {}
    for what, why in refused:  # hashes and paths differ per entry, the reason does not
        by_reason.setdefault(re.sub(r"[0-9a-f]{16,}", "<hash>", why), []).append(what)
    lines = []
    for why, whats in sorted(by_reason.items(), key=lambda item: -len(item[1]))[:most]:
        count = f"{len(whats)} entries, e.g. " if len(whats) > 1 else ""
        lines.append(f"refused {count}{whats[0]}: {why}")  # whole: a cut key name reads as another key
    if len(by_reason) > most:
        lines.append(f"refused {sum(len(w) for _, w in sorted(by_reason.items(), key=lambda i: -len(i[1]))[most:])} more entries for {len(by_reason) - most} other reasons")
    return lines


def _cmd_install(args: argparse.Namespace) -> int:
    from ..stages.pack import PackError, install

    r = install(args.pack, target=args.target, all_or_nothing=args.all_or_nothing)
    if r.refused and not r.installed and not r.present:  # the pack did nothing here: one error line
        lines = _refusal_lines(r.refused, most=1)
        raise PackError(args.pack, f"none of its {len(r.refused)} entries was installed; {lines[0]}")
    out.print(
        f"{args.pack}: {r.installed} installed, {r.present} already present, {len(r.refused)} refused, "
        f"{r.launchers} C launchers in {r.seconds:.2f} s", soft_wrap=True,
    )  # fmt: skip
    for line in _refusal_lines(r.refused):
        out.print(f"[yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)
    return 1 if r.refused else 0


def add_commands(sub: Any) -> None:
    b = sub.add_parser("build", help="compile a config's keys into a pack (no GPU needed with --target)")
    b.add_argument("config")
    add_serving(b)
    b.add_argument("--target", default=None, help="e.g. cuda:90 (default: local GPU)")
    b.add_argument("-o", "--output", required=True, help="a directory, or a .tar / .tar.gz / .zip file")
    b.add_argument("--workers", type=int, default=None, help="compile processes and threads (default: all CPUs)")
    b.add_argument("--force", action="store_true", help="replace an existing output")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument(
        "--launcher-python", action="append", default=None, metavar="PYTHON",
        help="CUDA targets: also carry Triton's C launchers built for this interpreter's ABI (name or path; "
        "repeatable; default: this interpreter), e.g. the serving host's python3.12",
    )  # fmt: skip
    b.add_argument("--no-launchers", action="store_true", help="carry no prebuilt C launchers")
    b.add_argument(
        "--tuning", default=None, metavar="FILE",
        help="a cross build: record the autotune choices a warm on the serving GPU kept (its Triton cache's "
        "warmreg-tuning/<device>-triton-<release>.json), so the serving host benchmarks nothing",
    )  # fmt: skip
    b.add_argument(
        "--wheel", action="store_true",
        help="write an installable wheel into the directory -o names; warm installs an installed pack wheel first",
    )  # fmt: skip
    b.set_defaults(func=_cmd_build)
    p = sub.add_parser("pack", help="inspect, verify or install a pack")
    psub = p.add_subparsers(dest="pack_command", required=True)
    i = psub.add_parser("inspect", help="show a pack's manifest")
    i.add_argument("pack")
    add_json(i, "the manifest")
    i.set_defaults(func=_cmd_inspect)
    v = psub.add_parser("verify", help="check every file and the fit to this machine")
    v.add_argument("pack")
    v.add_argument("--target", default=None)
    v.set_defaults(func=_cmd_verify)
    n = psub.add_parser("install", help="install into Triton's cache under local keys")
    n.add_argument("pack")
    n.add_argument("--target", default=None)
    n.add_argument("--all-or-nothing", action="store_true")
    n.set_defaults(func=_cmd_install)
