"""The README's table of the examples' key counts is the plans': a plan that changes fails here until the table does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import warmreg

ROOT = Path(__file__).resolve().parents[3]
README = Path(__file__).resolve().parents[1] / "README.md"
_ROW = re.compile(r"^\| `(examples/[\w.]+\.json)` [^|]*((?:\| \d+ )+)\|$")


def _table() -> tuple[list[str], dict[str, list[int]]]:
    lines = README.read_text().split("## Key counts of the examples", 1)[1].splitlines()
    header = next(line for line in lines if line.startswith("| example |"))
    targets = ["xpu:pvc" if t == "xpu" else t for t in (c.strip() for c in header.strip("|").split("|")[1:])]
    rows = {m[1]: [int(v) for v in m[2].split("|") if v.strip()] for line in lines if (m := _ROW.match(line))}
    return targets, rows


def test_the_table_has_every_dsv4_example() -> None:
    targets, rows = _table()
    assert targets == ["cuda:90", "cuda:100", "rocm:gfx942", "rocm:gfx950", "xpu:pvc"]
    assert set(rows) == {"examples/deepseek_v4_flash.json", "examples/deepseek_v4_pro.json", "examples/deepseek_v4_flash_0731_dspark.json"}


@pytest.mark.parametrize("example", sorted(_table()[1]))
def test_readme_key_counts_are_the_plans(example: str) -> None:
    targets, rows = _table()
    got = [warmreg.plan(str(ROOT / example), target=t).num_keys for t in targets]
    assert got == rows[example], f"{example}: the plans have {got} keys on {targets}; update the README's table"
