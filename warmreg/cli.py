"""The ``warmreg`` command line: ``plugins``, ``plan``, ``warm`` (and more from later modules).

Errors warmreg raises on purpose, and disk errors (``OSError``), print as one line on stderr with
exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import WarmregError

__all__ = ["main"]

# Piped (not a terminal): lines are never wrapped and tables print as plain columns, whole.
_out = Console(soft_wrap=not sys.stdout.isatty())
_err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def show_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *, console: Console | None = None) -> None:
    """A table on a terminal; plain tab-separated lines (title, header, rows) when piped, so no
    name is cut and no number is wrapped. Cells are plain text, never rich markup."""
    out = console or _out
    if out.is_terminal:
        table = Table(*columns, title=escape(title) if title else None)
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        out.print(table)
        return
    lines = ([title] if title else []) + ["\t".join(line) for line in (columns, *rows)]
    out.file.write("".join(f"{line}\n" for line in lines))
Command = Callable[[argparse.Namespace], int]

#: ``--json`` alone: stdout.
STDOUT = "-"


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json [FILE]``, the same on every verb: the verb's result as JSON, on stdout (and nothing
    else there) or, with FILE, written whole into FILE beside the usual output."""
    p.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE", help=f"{what} as JSON: on stdout, or into FILE")


def check_json_output(args: argparse.Namespace) -> None:
    """Refuse, before any work, a ``--json FILE`` that could not be written."""
    if args.json not in (None, STDOUT):
        from ._output import check_output

        check_output(args.json, "--json")


def emit_json(args: argparse.Namespace, text: str) -> bool:
    """Write ``--json``'s JSON; returns whether it went to stdout (then print nothing else there).
    A file is written whole or not at all (under torchrun every rank writes the same path)."""
    if args.json == STDOUT:
        sys.stdout.write(text.rstrip("\n") + "\n")
        return True
    out = Path(args.json)
    staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    staged.write_text(text)
    os.replace(staged, out)
    _err.print(f"JSON written to {args.json}", markup=False, highlight=False)
    return False


def add_serving(p: argparse.ArgumentParser) -> None:
    """``--serving FILE|JSON`` and repeatable ``--set key=value``: serving settings over the config's."""
    p.add_argument("--serving", default=None, metavar="FILE|JSON", help="serving settings: a JSON file or a JSON object")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
        help="one serving setting (repeatable; VALUE is read as JSON, else as a string), e.g. max_num_batched_tokens=8192",
    )  # fmt: skip


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config.json of the model, or a warmreg config {model, serving}")
    p.add_argument("--target", default=None, help="cross-compile target, e.g. cuda:90, cuda:100, rocm:gfx942 (default: local GPU)")
    add_serving(p)
    p.add_argument("--skip-broken-plugins", action="store_true", help="skip a plugin that fails instead of stopping")


def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import load_plugins

    loaded = load_plugins(on_plugin_error="skip")
    if args.json and emit_json(args, json.dumps({"plugins": list(loaded.names), "problems": list(loaded.problems)}, indent=2)):
        return 0
    show_table("warmreg plugins (entry-point group 'warmreg')", ["plugin"], [[name] for name in loaded.names])
    for problem in loaded.problems:
        _err.print(f"[yellow]skipped[/] {problem}")
    return 0


def serving_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The serving settings of ``--serving`` and then ``--set`` (later ones win)."""
    from . import _json
    from .config import CONFIG_FILE_MAX
    from .errors import ConfigError

    out: dict[str, Any] = {}
    if args.serving is not None:
        text = args.serving.strip()
        try:
            raw = text if text.startswith("{") else _json.read_regular_file(text, limit=CONFIG_FILE_MAX)
            data = _json.loads(raw, max_depth=16)
        except (OSError, ValueError) as exc:
            raise ConfigError(args.serving, f"is neither a JSON object nor a readable JSON file ({exc})", fix="pass --serving '{\"max_num_seqs\": 256}' or a file", file=True) from exc
        if not isinstance(data, dict):
            raise ConfigError(args.serving, "must hold a JSON object of serving settings", fix="pass --serving '{\"max_num_seqs\": 256}'", file=True)
        out.update(data)
    for setting in args.settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {setting}", "is not KEY=VALUE", fix="write e.g. --set max_num_batched_tokens=8192")
        try:
            out[key.strip()] = _json.loads(value, max_depth=4)
        except ValueError:
            out[key.strip()] = value  # a bare string: --set kv_cache_dtype=fp8
    return out


def _config(args: argparse.Namespace) -> Any:
    """The config (with ``--serving``/``--set``) and target, checked before the pipeline (and torch)
    is imported: a bad one is one quick line."""
    from .config import WarmConfig
    from .platform import Platform

    if args.target is not None:
        Platform.parse(args.target)
    return WarmConfig.load(args.config, serving=serving_overrides(args))


def cmd_plan(args: argparse.Namespace) -> int:
    check_json_output(args)
    config = _config(args)
    from .warm import plan

    p = plan(config, target=args.target, on_plugin_error="skip" if args.skip_broken_plugins else "raise")
    if args.json and emit_json(args, json.dumps(p.to_json(), indent=2)):
        return 0
    rows = [[k.name, str(len(k.keys)), ", ".join(k.plugins)] for k in p.kernels]
    show_table(f"plan for {p.config.model_type} on {p.platform}", ["kernel", "keys", "registered by"], rows)
    _out.print(f"{p.num_keys} keys over {len(p.kernels)} kernels")
    for s in p.skipped:
        _out.print(f"[dim]not registered: {s.kernel} ({s.plugin}): {s.reason}[/]")
    for problem in p.plugin_problems:
        _err.print(f"[yellow]plugin skipped[/] {problem}")
    return 0


def _init_distributed(target: str | None) -> bool:
    """Under torchrun (WORLD_SIZE > 1): join the job's process group (gloo for a cross target)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    gpu = target is None and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpu else "gloo")
    return True


def cmd_warm(args: argparse.Namespace) -> int:
    check_json_output(args)
    args.config = _config(args)
    from ._triton_cache import check_cache_writable

    check_cache_writable()
    from .warm import warm

    started = _init_distributed(args.target) if not args.no_distributed else False
    try:
        return _warm_and_show(args, warm)
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()


def _warm_and_show(args: argparse.Namespace, warm: Callable[..., Any]) -> int:
    report = warm(  # on_error="continue": failures are listed below and give exit code 1
        args.config,
        target=args.target,
        workers=args.workers,
        on_error="continue",
        on_plugin_error="skip" if args.skip_broken_plugins else "raise",
        progress=not args.quiet,
        pack=args.pack,
        distributed=False if args.no_distributed else None,
    )
    for r in report.failed:
        _err.print(f"[red]failed[/] {r.kernel} {r.key}: {r.error}")
    if not (args.json and emit_json(args, report.dumps())):
        rows = [
            [name, str(row["keys"]), str(row["compiled"]), str(row["cached"]), str(row["failed"]), f"{row['seconds']:.2f}"]
            for name, row in sorted(report.per_kernel().items())
        ]
        show_table(report.summary(), ["kernel", "keys", "compiled", "cached", "failed", "seconds"], rows)
    return 1 if report.failed else 0


def _version() -> str:
    """``warmreg 0.1.0 (Triton 3.8.0, torch 2.13.0+cpu)``, from the distributions' metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"warmreg {__version__} (Triton {of('triton')}, torch {of('torch')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmreg", description="Warm Triton kernels before serving.")
    parser.add_argument("--version", action="version", version=_version(), help="warmreg's version and the Triton and torch it runs with")
    sub = parser.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plugins", help="list installed plugins")
    add_json(pl, "the plugins and the problems of those skipped")
    pl.set_defaults(func=cmd_plugins)
    p = sub.add_parser("plan", help="list kernels and keys a config needs (no compiling)")
    _add_common(p)
    add_json(p, "the plan, every key field by field,")
    p.set_defaults(func=cmd_plan)
    w = sub.add_parser("warm", help="compile every key a config needs")
    _add_common(w)
    w.add_argument("--workers", type=int, default=None, help="compile threads (default: all CPUs)")
    add_json(w, "the WarmReport")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.add_argument("--pack", default=None, help="install this pack first (its keys become cache hits)")
    w.add_argument("--no-distributed", action="store_true", help="under torchrun, warm every key on every rank")
    w.set_defaults(func=cmd_warm)
    for extend in _EXTENSIONS:
        extend(sub)
    return parser


#: Sub-command installers registered by other modules (monitor, pack), to keep this module small.
_EXTENSIONS: list[Callable[[Any], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``warmreg`` console script."""
    from . import cli_monitor, cli_pack  # noqa: F401 - they register their sub-commands

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except WarmregError as exc:
        _err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:  # a disk or path problem warmreg did not name itself: still one line
        where = f": {exc.filename}" if exc.filename else ""
        _err.print(f"[red]error:[/] {escape(str(exc.strerror or exc))}{escape(where)}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        _err.print("[red]interrupted[/]")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
