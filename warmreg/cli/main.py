"""The ``warmreg`` command line: ``plugins``, ``plan``, ``warm`` here; ``build`` and ``pack`` from
:mod:`warmreg.cli.pack`, ``replay`` and ``report`` from :mod:`warmreg.cli.monitor`.

Errors warmreg raises on purpose, and disk errors (``OSError``), print as one line on stderr with
exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from rich.markup import escape

from ..values.errors import WarmregError
from . import monitor as cli_monitor
from . import pack as cli_pack
from .common import (
    add_common,
    add_json,
    all_missing_serving,
    check_json_output,
    emit_json,
    err,
    load_config,
    out,
    show_table,
)

__all__ = ["build_parser", "main"]


def _cmd_plugins(args: argparse.Namespace) -> int:
    from ..pipeline.plugins import load_plugins

    loaded = load_plugins(on_plugin_error="skip")
    if args.json and emit_json(args, "plugins", {"plugins": list(loaded.names), "distributions": _distributions(), "plugin_problems": [attrs.asdict(p) for p in loaded.problems]}):
        return 0
    show_table("warmreg plugins (entry-point group 'warmreg')", ["plugin"], [[name] for name in loaded.names])
    for problem in loaded.problems:
        err.print(f"[yellow]skipped[/] {problem}")
    return 0


def _distributions() -> list[dict[str, str | None]]:
    """Each plugin entry point with the distribution that installs it and its version."""
    from ..contract.hookspecs import PROJECT
    from ..support.entry_points import entry_points

    return [
        {"plugin": ep.name, "distribution": ep.dist.name if ep.dist else None, "version": ep.dist.version if ep.dist else None}
        for ep in entry_points(PROJECT)
    ]


def _cmd_plan(args: argparse.Namespace) -> int:
    check_json_output(args)
    config = load_config(args)
    from ..api.warm import plan

    p = plan(config, target=args.target, on_plugin_error="skip" if args.skip_broken_plugins else "raise")
    if args.json and emit_json(args, "plan", p.to_json()):
        return 0
    rows = [[k.name, str(len(k.keys)), ", ".join(k.plugins)] for k in p.kernels]
    show_table(f"plan for {p.config.model_type} on {p.platform}", ["kernel", "keys", "registered by"], rows)
    out.print(f"{p.num_keys} keys over {len(p.kernels)} kernels")
    for s in p.skipped:
        out.print(f"[dim]not registered: {s.kernel} ({s.plugin}): {s.reason}[/]")
    for problem in p.plugin_problems:
        err.print(f"[yellow]plugin skipped[/] {problem}")
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


def _cmd_warm(args: argparse.Namespace) -> int:
    check_json_output(args)
    args.config = load_config(args)
    from .._triton.cache import check_cache_writable

    check_cache_writable()
    from ..api.warm import warm

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
        err.print(f"[red]failed[/] {r.kernel} {r.key}: {r.error}")
    unserved = [p for p in report.stage("pack").get("packs", ()) if p["wheel"] is None and p["problem"]]
    for p in unserved:  # the pack asked for could not serve: exit 1 (an installed pack wheel's problem is only logged)
        line = f"pack {p['pack']} could not serve this warm: {p['problem']}"
        err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if not (args.json and emit_json(args, "warm", report.to_json())):
        rows = [
            [name, str(row["keys"]), str(row["compiled"]), str(row["cached"]), str(row["failed"]), f"{row['seconds']:.2f}"]
            for name, row in sorted(report.per_kernel().items())
        ]
        show_table(report.summary(), ["kernel", "keys", "compiled", "cached", "failed", "seconds"], rows)
    return 1 if report.failed or unserved else 0


def _version() -> str:
    """``warmreg 0.1.0 (Triton 3.8.0, torch 2.13.0+cpu)``, from the distributions' metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from ..support.version import __version__

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
    pl.set_defaults(func=_cmd_plugins)
    p = sub.add_parser("plan", help="list kernels and keys a config needs (no compiling)")
    add_common(p)
    add_json(p, "the plan, every key field by field,")
    p.set_defaults(func=_cmd_plan)
    w = sub.add_parser("warm", help="compile every key a config needs")
    add_common(w)
    w.add_argument("--workers", type=int, default=None, help="compile processes and threads (default: all CPUs)")
    add_json(w, "the WarmReport")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.add_argument("--pack", default=None, help="install this pack first (its keys become cache hits)")
    w.add_argument("--no-distributed", action="store_true", help="under torchrun, warm every key on every rank")
    w.set_defaults(func=_cmd_warm)
    cli_pack.add_commands(sub)
    cli_monitor.add_commands(sub)
    return parser


def _stop_on_interrupt() -> Callable[[], None]:
    """Make SIGINT (Ctrl-C) stop the command: the first raises KeyboardInterrupt, and the command's clean-up
    runs as it rises (compile processes ended, running compiles finished); any later one ends the process at
    once with exit code 130, whatever the clean-up waits for (a compile thread cannot be stopped), until it
    exits. Only in the main thread, over Python's own handler. Returns what puts Python's handler back
    where no interrupt came."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None

    def again(signum: int, frame: Any) -> None:
        os.write(2, b"interrupted\n")
        os._exit(130)

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, again)
        raise KeyboardInterrupt

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is first:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, first)
    return restore


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``warmreg`` console script.

    An interrupt (SIGINT, Ctrl-C) prints one line and gives exit code 130; a second one while the command
    stops ends it at once, also with 130.
    """
    args = build_parser().parse_args(argv)
    restore = _stop_on_interrupt()
    try:
        return int(args.func(args))
    except WarmregError as exc:
        shown = all_missing_serving(args, exc)  # a published config.json: every setting it lacks, in one line
        err.print(f"[red]error:[/] {escape(str(shown))}", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:  # a disk or path problem warmreg did not name itself: still one line
        where = f": {exc.filename}" if exc.filename else ""
        err.print(f"[red]error:[/] {escape(str(exc.strerror or exc))}{escape(where)}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130
    finally:
        restore()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
