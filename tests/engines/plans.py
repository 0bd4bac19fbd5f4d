"""Plan comparison shared by the engine tests."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from cases import TARGET

import warmreg


def planned_keys(config: Any, *, target: str = TARGET, **kwargs: Any) -> set[tuple[str, Any]]:
    """Every (kernel, key) ``warmreg.plan`` gives ``config`` for a CUDA target (no GPU needed; default :data:`TARGET`)."""
    plan = warmreg.plan(config, target=target, **kwargs)
    assert not plan.plugin_problems, plan.plugin_problems
    return {(kp.name, key) for kp, key in plan.items()}


def differences(got: set[tuple[str, Any]], want: set[tuple[str, Any]]) -> str:
    """A readable account of two key sets' differences (empty when equal)."""
    lines = [f"only from the engine object: {k}" for k in sorted(got - want, key=repr)[:10]]
    lines += [f"only from the example JSON: {k}" for k in sorted(want - got, key=repr)[:10]]
    return "\n".join(lines)


def engine_or_skip(engine: str, *modules: str) -> None:
    """Skip the calling test module, naming why, if one of the engine's ``modules`` does not import."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or an engine that breaks on import
            pytest.skip(
                f"{engine} does not import here ({type(exc).__name__}: {exc}); run in its venv: "
                f"bash scripts/engine-envs.sh test {engine.lower()}",
                allow_module_level=True,
            )


class StartupEvents:
    """What an engine's start-up did, in order, with whether warmreg's monitor was armed at each step, and the
    configs :func:`warmreg.warm` was called with; for the integration tests (``test_*_integration.py``)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bool]] = []
        self.configs: list[Any] = []

    def add(self, what: str) -> None:
        from warmreg import monitoring

        self.log.append((what, monitoring.current() is not None))

    def spy_on_warm(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``warmreg.api.startup`` fresh (nothing warmed or armed in this process) and its warm replaced by a spy that
        records the config and runs a real, empty warm (no plugin: nothing compiles)."""
        from warmreg.api import startup

        real_warm = warmreg.warm

        def warm(config: Any, **kwargs: Any) -> warmreg.WarmReport:
            self.add("warmreg.warm")
            self.configs.append(config)
            empty = {"model": {"model_type": "none"}, "serving": {}}
            return real_warm(empty, target="cuda:90", entry_points=False, **kwargs)

        monkeypatch.setattr(startup, "warm", warm)
        monkeypatch.setattr(startup, "_warmed", {})
        monkeypatch.setattr(startup, "_armed", {})

    @staticmethod
    def disarm_all() -> None:
        from warmreg import monitoring

        while (armed := monitoring.current()) is not None:
            monitoring.disarm(armed)
