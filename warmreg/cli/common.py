"""What the CLI's verbs share: output (terminal or piped), ``--json``, the config and serving flags."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = [
    "SCHEMA", "STDOUT", "Command", "add_common", "all_missing_serving", "add_json", "add_serving", "check_json_output", "emit_json", "err", "load_config", "out",
    "serving_overrides", "show_table",
]  # fmt: skip

# Piped (not a terminal): lines are never wrapped and tables print as plain columns, whole.
out = Console(soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def show_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *, console: Console | None = None) -> None:
    """A table on a terminal; plain tab-separated lines (title, header, rows) when piped, so no
    name is cut and no number is wrapped. Cells are plain text, never rich markup."""
    console = console or out
    if console.is_terminal:
        table = Table(*columns, title=escape(title) if title else None)
        for row in rows:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)
        return
    lines = ([title] if title else []) + ["\t".join(line) for line in (columns, *rows)]
    console.file.write("".join(f"{line}\n" for line in lines))
Command = Callable[[argparse.Namespace], int]

#: ``--json`` alone: stdout.
STDOUT = "-"


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json [FILE]``, the same on every verb: the verb's result as JSON, on stdout (and nothing
    else there) or, with FILE, written whole into FILE beside the usual output."""
    p.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE", help=f"{what} as JSON: on stdout, or into FILE")


#: The ``schema`` of every ``--json`` document: ``warmreg.<verb>/<version>`` (docs/guide.md, "JSON output").
SCHEMA = "warmreg.{verb}/1"


def check_json_output(args: argparse.Namespace) -> None:
    """Refuse, before any work, a ``--json FILE`` that could not be written, that is one of the command's
    inputs (``warmreg plan --json a.json b.json`` must not replace the config ``a.json``), or that exists and
    is not a warmreg JSON document (only an earlier output, with its ``schema``, is replaced)."""
    if args.json in (None, STDOUT):
        return
    from ..support.outputs import check_output
    from ..values.errors import WarmregError

    out = Path(args.json)
    inputs = [getattr(args, name, None) for name in ("config", "serving", "pack")]
    if out.is_file() and any(isinstance(i, str) and Path(i).exists() and out.samefile(i) for i in inputs):
        raise WarmregError(f"--json {args.json} is an input of this command: not overwritten", fix="pass --json a new path")
    if out.is_file() and not _is_warmreg_json(out):
        raise WarmregError(f"--json {args.json} exists and is not a warmreg JSON output: not overwritten", fix="pass a new path, or remove the file")
    check_output(args.json, "--json")


def _is_warmreg_json(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return head.lstrip().startswith("{") and '"schema": "warmreg.' in head


def emit_json(args: argparse.Namespace, verb: str, data: dict[str, Any]) -> bool:
    """Write ``--json``'s document, ``{"schema": "warmreg.<verb>/1", ...data}``; returns whether it went to
    stdout (then print nothing else there). A file is written whole or not at all (under torchrun every
    rank writes the same path)."""
    import json

    text = json.dumps({"schema": SCHEMA.format(verb=verb), **data}, indent=2)
    if args.json == STDOUT:
        sys.stdout.write(text.rstrip("\n") + "\n")
        return True
    out = Path(args.json)
    staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    staged.write_text(text)
    os.replace(staged, out)
    err.print(f"JSON written to {args.json}", markup=False, highlight=False)
    return False


def add_serving(p: argparse.ArgumentParser) -> None:
    """``--serving FILE|JSON`` and repeatable ``--set key=value``: serving settings over the config's."""
    p.add_argument("--serving", default=None, metavar="FILE|JSON", help="serving settings: a JSON file or a JSON object")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
        help="one serving setting (repeatable; VALUE is read as JSON, else as a string), e.g. max_num_batched_tokens=8192",
    )  # fmt: skip


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config.json of the model, or a warmreg config {model, serving}")
    p.add_argument("--target", default=None, help="cross-compile target, e.g. cuda:90, cuda:100, rocm:gfx942 (default: local GPU)")
    add_serving(p)
    p.add_argument("--skip-broken-plugins", action="store_true", help="skip a plugin that fails instead of stopping")


def serving_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The serving settings of ``--serving`` and then ``--set`` (later ones win)."""
    from ..contract.config import CONFIG_FILE_MAX
    from ..support import bounded_json as _json
    from ..values.errors import ConfigError

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
            parsed = _json.loads(value, max_depth=4)
        except ValueError:
            parsed = value  # a bare string: --set kv_cache_dtype=fp8
        out[key.strip()] = _checked_setting(key.strip(), parsed, setting)
    return out


def _checked_setting(name: str, value: Any, setting: str) -> Any:
    """``value`` of ``--set NAME=...`` if the config would take it; else the error names ``--set NAME``, not
    the config file, and says how to write it there."""
    from ..contract.config import SERVING_FIELDS
    from ..values.errors import ConfigError

    if name not in SERVING_FIELDS:
        fix = f"write --set NAME=VALUE, NAME one of {', '.join(SERVING_FIELDS)}"
        raise ConfigError(f"serving.{name}", f"is not a serving setting (--set {setting})", fix=fix)
    check, meaning = SERVING_FIELDS[name]
    problem = check(value)
    if problem:
        raise ConfigError(f"serving.{name}", f"{problem} (--set {setting})", fix=f"write --set {name}=VALUE, VALUE the {meaning}")
    return value


def load_config(args: argparse.Namespace) -> Any:
    """The config (with ``--serving``/``--set``) and target, checked before the pipeline (and torch)
    is imported: a bad one is one quick line. A plugin's error about a ``--set`` value names it."""
    import attrs

    from ..contract.config import WarmConfig
    from ..values.errors import ConfigError
    from ..values.platform import Platform

    if args.target is not None:
        Platform.parse(args.target)
    overrides = serving_overrides(args)
    given = {name: f"--serving {args.serving}" for name in overrides} if args.serving is not None else {}
    given |= {s.partition("=")[0].strip(): f"--set {s}" for s in args.settings}  # the last --set of a name wins
    try:
        config = WarmConfig.load(args.config, serving=overrides)
    except ConfigError as exc:  # a value the core refuses: name where it was given
        name = (exc.field or "").removeprefix("serving.")
        if name in given and given[name] not in str(exc):
            raise ConfigError(exc.field, f"{exc.problem} ({given[name]})", plugin=exc.plugin, fix=f"correct it in {given[name]}") from exc
        raise
    return attrs.evolve(config, origins={**config.origins, **given}) if given else config


#: What a probe gives a missing serving setting to find the next one a plan needs (never served: the error
#: that lists them all is the only outcome). Where the reader named the accepted values (``ConfigError.accepted``,
#: or a plugin's fix that lists them), the first is taken instead.
_PROBE = {
    "max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 8192, "block_size": 64, "kv_cache_dtype": "auto",
    "dtype": "bfloat16", "tensor_parallel_size": 1, "num_speculative_tokens": 0, "decode_context_parallel_size": 1,
    "cp_kv_cache_interleave_size": 1,
}  # fmt: skip
_LISTED = re.compile(r"\([^():]*: ([A-Za-z0-9_]+)[,)]")  # a fix's "(... backends: FLASHMLA_SPARSE_DSV4, ...)"


def all_missing_serving(args: argparse.Namespace, exc: Exception) -> Exception:
    """For a serving setting a plugin found missing (a published ``config.json`` holds none): the error naming
    every serving setting the plan needs and lacks, found by planning again with stand-ins (at most one plan a
    setting), and how to give them on the command line; any other error as it is."""
    from ..values.errors import ConfigError

    if not (isinstance(exc, ConfigError) and exc.problem == "is missing" and exc.field.startswith("serving.")):
        return exc
    first = exc
    if not getattr(args, "config", None) or args.func.__name__ not in ("_cmd_plan", "_cmd_warm", "_cmd_build"):
        return exc
    from ..api.warm import plan

    given, missing = serving_overrides(args), list[str]()
    while isinstance(exc, ConfigError) and exc.field.startswith("serving.") and len(missing) < len(_PROBE) + 8:
        name = exc.field.removeprefix("serving.")
        listed = _LISTED.search(exc.fix or "")  # a plugin's own fix that lists valid values
        accepted = exc.accepted[0] if exc.accepted else listed.group(1) if listed else None
        if exc.problem == "is missing":
            missing.append(name)
        elif accepted is None or name not in missing:
            break  # a value given, not a stand-in, is wrong: the missing ones found so far are the answer
        given[name] = accepted if accepted is not None else _PROBE.get(name, "auto")
        try:
            plan(args.config, target=args.target, serving=given)
            break
        except ConfigError as again:
            exc = again
        except Exception:
            break
    if len(missing) < 2:
        return first
    sets = " ".join(f"--set {n}=VALUE" for n in missing)
    return ConfigError(
        ", ".join(f"serving.{n}" for n in missing), "are missing (a published config.json holds no serving settings)",
        plugin=first.plugin, fix=f"give them on the command line: {sets}, or --serving FILE with all of them",
    )
