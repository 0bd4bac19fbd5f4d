"""pytest plugin (entry point ``pytest11``): prove in tests that nothing compiles.

- ``--warmreg-monitor=warn|error|record`` arms a monitor for the whole session
  (``--warmreg-record=FILE`` for record mode; a coverage snapshot is written next to it).
- fixture ``warmreg_monitor``: an armed monitor (record mode, in memory) for one test; read
  ``.misses`` and ``.counters()``.
- fixture ``warmreg_isolated``: a fresh, empty Triton cache (``TRITON_CACHE_DIR``) for one test and
  warmreg's process state reset before and after it (:func:`warmreg.reset_state`); plugin test suites
  make it autouse in their ``conftest.py``.
- marker ``@pytest.mark.warmreg_no_jit``: the test fails if its code compiles, loads or autotunes
  a Triton kernel; the failure lists each miss with its explanation.

Imports warmreg (and so torch and Triton) only when one of these is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "pytest_addoption", "pytest_configure", "pytest_runtest_call", "pytest_unconfigure", "warmreg_isolated", "warmreg_monitor",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("warmreg", "warmreg JIT monitor")
    group.addoption(
        "--warmreg-monitor",
        choices=("warn", "error", "record"),
        default=None,
        help="arm the warmreg JIT monitor for the whole session in this mode",
    )
    group.addoption("--warmreg-record", default="warmreg-misses.jsonl", help="record file for --warmreg-monitor=record")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "warmreg_no_jit: fail the test if it compiles, loads or autotunes a Triton kernel")
    mode = config.getoption("--warmreg-monitor", default=None)
    if mode:
        from .monitoring import arm

        record = config.getoption("--warmreg-record") if mode == "record" else None
        config.stash[_SESSION] = arm(mode, record=record)


def pytest_unconfigure(config: pytest.Config) -> None:
    mon = config.stash.get(_SESSION, None)
    if mon is not None:
        from .monitoring import disarm

        if mon.record_path is not None:
            mon.save(mon.record_path.with_suffix(".snapshot.json"))
        disarm(mon)


_SESSION: pytest.StashKey[Any] = pytest.StashKey()


@pytest.fixture
def warmreg_monitor() -> Iterator[Any]:
    """An armed :class:`warmreg.Monitor` (record mode, in memory) for the duration of one test."""
    from .monitoring import monitor

    with monitor("record") as mon:
        yield mon


@pytest.fixture
def warmreg_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty Triton cache directory (``TRITON_CACHE_DIR``, under ``tmp_path``) for one test,
    with :func:`warmreg.reset_state` before and after it; yields the cache directory.

    Make it autouse in a plugin's ``conftest.py``::

        @pytest.fixture(autouse=True)
        def isolated(warmreg_isolated): ...
    """
    from warmreg import reset_state

    cache = tmp_path / "triton-cache"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    reset_state()
    yield cache
    reset_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("warmreg_no_jit") is None:
        return (yield)
    from .monitoring import monitor

    with monitor("record") as mon:
        result = yield
    if mon.misses:
        details = "\n".join(m.explain() for m in mon.misses)
        pytest.fail(f"{len(mon.misses)} runtime JIT event(s) in a warmreg_no_jit test:\n{details}", pytrace=False)
    return result
