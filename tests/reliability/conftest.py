"""Reliability suite: shared fixtures and the generated table of tried inputs and faults.

``python3 -m pytest tests/reliability --reliability-report docs/reliability.md`` rewrites the table
between the markers in that file: one row per test (what was tried, from the docstring's first
line, and the outcome of this run), and the figures per class of cases (tried, handled, failures;
a generator's class is the part of its case name before ": ").
"""

from __future__ import annotations

from pathlib import Path

import pytest

_ROWS: list[tuple[str, str, str]] = []
_FIGURES: dict[tuple[str, str], list[int]] = {}  # (area, what was tried) -> [cases, handled, failures]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reliability-report", default=None, help="write the table of tried inputs and faults (markdown)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call" or (report.when == "setup" and report.skipped):
        doc = (getattr(item, "obj", None).__doc__ or item.name).strip().splitlines()[0]  # type: ignore[union-attr]
        area = Path(str(item.fspath)).stem.removeprefix("test_").replace("_", " ")
        callspec = getattr(item, "callspec", None)
        kind = doc
        if callspec is not None and "name" in callspec.params and ": " in str(callspec.params["name"]):
            kind = str(callspec.params["name"]).split(": ")[0]  # a generator's class of cases
        row = _FIGURES.setdefault((area, kind), [0, 0, 0])
        row[0] += 1
        if report.outcome == "passed":
            row[1] += 1
        elif report.outcome == "failed":
            row[2] += 1
        if callspec is not None:
            doc = f"{doc}: **{callspec.id}**"
        _ROWS.append((area, doc, report.outcome))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--reliability-report", default=None)
    if not path:
        return
    lines = ["| area | tried | outcome |", "| --- | --- | --- |"]
    lines += [f"| {area} | {doc} | {outcome} |" for area, doc, outcome in _ROWS]
    table = "\n".join(lines)
    figures = ["| area | class of cases | cases | handled | failures |", "| --- | --- | ---: | ---: | ---: |"]
    figures += [f"| {area} | {kind} | {n} | {ok} | {bad} |" for (area, kind), (n, ok, bad) in _FIGURES.items()]
    total = [sum(v[i] for v in _FIGURES.values()) for i in range(3)]
    figures.append(f"| **all** | | **{total[0]}** | **{total[1]}** | **{total[2]}** |")
    target = Path(path)
    text = target.read_text() if target.exists() else ""
    text = _between(text, "<!-- figures:start -->", "<!-- figures:end -->", "\n".join(figures))
    target.write_text(_between(text, "<!-- table:start -->", "<!-- table:end -->", table))


def _between(text: str, start: str, end: str, body: str) -> str:
    if start not in text:
        text += f"\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{body}\n{end}{tail}"
