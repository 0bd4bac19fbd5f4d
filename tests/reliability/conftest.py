"""Reliability suite: shared fixtures and the generated table of tried inputs and faults.

``python3 -m pytest tests/reliability --reliability-report docs/reliability.md`` rewrites the table
between the markers in that file: one row per test (what was tried, from the docstring's first
line, and the outcome of this run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_ROWS: list[tuple[str, str, str]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reliability-report", default=None, help="write the table of tried inputs and faults (markdown)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call" or (report.when == "setup" and report.skipped):
        doc = (getattr(item, "obj", None).__doc__ or item.name).strip().splitlines()[0]  # type: ignore[union-attr]
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            doc = f"{doc}: **{callspec.id}**"
        area = Path(str(item.fspath)).stem.removeprefix("test_").replace("_", " ")
        _ROWS.append((area, doc, report.outcome))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--reliability-report", default=None)
    if not path:
        return
    lines = ["| area | tried | outcome |", "| --- | --- | --- |"]
    lines += [f"| {area} | {doc} | {outcome} |" for area, doc, outcome in _ROWS]
    table = "\n".join(lines)
    target = Path(path)
    start, end = "<!-- table:start -->", "<!-- table:end -->"
    text = target.read_text() if target.exists() else f"{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    target.write_text(f"{head}{start}\n{table}\n{end}{tail}")
