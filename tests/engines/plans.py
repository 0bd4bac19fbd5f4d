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
