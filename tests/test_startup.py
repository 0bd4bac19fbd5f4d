"""``warmreg.api.startup``: the ``WARMREG_*`` settings the engine integrations read, one warm a process, the monitor
armed only after it (the integrations themselves are tested in the engines' venvs: tests/engines/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import warmreg
from warmreg import monitoring
from warmreg.api import startup
from warmreg.api.startup import StartupSettings


def test_off_unless_asked() -> None:
    for value in (None, "", "0", "false", "No", "off"):
        env = {} if value is None else {"WARMREG_WARM": value}
        assert StartupSettings.from_env(env) == StartupSettings(enabled=False)


def test_settings_read(tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    pack.mkdir()
    env = {"WARMREG_WARM": "yes", "WARMREG_PACK": str(pack), "WARMREG_MONITOR": "Record", "WARMREG_RECORD": "m.jsonl",
           "WARMREG_WORKERS": "4", "WARMREG_ON_ERROR": "continue"}  # fmt: skip
    assert StartupSettings.from_env(env) == StartupSettings(
        enabled=True, pack=str(pack), monitor="record", record="m.jsonl", workers=4, on_error="continue"
    )


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"WARMREG_WARM": "maybe"}, "WARMREG_WARM"),
        ({"WARMREG_WARM": "1", "WARMREG_PACK": "/nonexistent/pack"}, "WARMREG_PACK.*does not exist"),
        ({"WARMREG_WARM": "1", "WARMREG_MONITOR": "loud"}, "WARMREG_MONITOR.*off, warn, error, record"),
        ({"WARMREG_WARM": "1", "WARMREG_MONITOR": "record"}, "WARMREG_RECORD.*is needed"),
        ({"WARMREG_WARM": "1", "WARMREG_WORKERS": "0"}, "WARMREG_WORKERS"),
        ({"WARMREG_WARM": "1", "WARMREG_WORKERS": "many"}, "WARMREG_WORKERS"),
        ({"WARMREG_WARM": "1", "WARMREG_ON_ERROR": "ignore"}, "WARMREG_ON_ERROR"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(warmreg.ConfigError, match=names):
        StartupSettings.from_env(env)


def test_one_warm_a_process_and_the_monitor_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real_warm = warmreg.warm

    def warm(config: Any, **kwargs: Any) -> warmreg.WarmReport:
        calls.append((config, kwargs))
        return real_warm({"model": {"model_type": "none"}, "serving": {}}, target="cuda:90", entry_points=False)

    monkeypatch.setattr(startup, "warm", warm)
    monkeypatch.setattr(startup, "_warmed", {})
    monkeypatch.setattr(startup, "_armed", {})
    settings = StartupSettings(enabled=True, monitor="warn", workers=2)
    assert startup.arm_monitor(settings) is None  # nothing warmed in this process yet
    first = startup.warm_once("the engine's config", settings, engine="test")
    assert startup.warm_once("another", settings, engine="test") is first
    assert [c for c, _ in calls] == ["the engine's config"]
    assert calls[0][1] == {"pack": None, "workers": 2, "on_error": "raise", "progress": False}
    try:
        armed = startup.arm_monitor(settings)
        assert armed is not None and armed.mode == "warn" and monitoring.current() is armed
        assert startup.arm_monitor(settings) is armed  # once a process
    finally:
        monitoring.disarm(armed)
    assert startup.warm_once("x", StartupSettings(enabled=False), engine="test") is None
