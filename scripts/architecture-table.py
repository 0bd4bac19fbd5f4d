"""Regenerate the module table of docs/architecture.md: every module of ``warmreg/``, by layer (its first
folder), with the first line of its docstring. ``tests/test_architecture.py`` checks that the table is current.

    python3 scripts/architecture-table.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, DOCS = ROOT / "warmreg", ROOT / "docs" / "architecture.md"
START, END = "<!-- modules:start -->", "<!-- modules:end -->"
sys.path.insert(0, str(ROOT / "tests"))
from test_architecture import LAYERS, _layer  # noqa: E402  (the layers are the test's)


def table() -> str:
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip().splitlines()
        rows.append((LAYERS.index(_layer(module)), path.relative_to(PACKAGE).as_posix(), doc[0] if doc else ""))
    lines = ["| layer | module | what it is |", "| --- | --- | --- |"]
    last = None
    for rank, where, first in sorted(rows):
        lines.append(f"| {LAYERS[rank] if rank != last else ''} | `{where}` | {first} |")
        last = rank
    return "\n".join(lines)


def main() -> None:
    text = DOCS.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOCS.write_text(f"{head}{START}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    main()
