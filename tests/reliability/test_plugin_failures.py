"""Broken plugins, per the documented policy: ImportError skips with a reason; anything else raises
PluginError naming the plugin unless on_plugin_error="skip"; the others still warm."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

import warmreg
from tests.helpers import CONFIG, Broken, Plugin, Scale
from warmreg.pipeline import plugins as plugin_mod


class _FakeEntryPoint:
    def __init__(self, name: str, load: Any) -> None:
        self.name, self._load, self.dist = name, load, None

    def load(self) -> Any:
        return self._load()


def _with_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: _FakeEntryPoint) -> None:
    real = importlib.metadata.entry_points

    def entry_points(group: str | None = None, **kw: Any) -> Any:
        return list(eps) if group == "warmreg" else real(group=group, **kw)

    monkeypatch.setattr(plugin_mod.importlib.metadata, "entry_points", entry_points)


def _good() -> Any:
    return Plugin(Scale(sizes=(16,)))


def _missing_dependency() -> Any:
    raise ImportError("No module named 'flashinfer'")


def _crashes_on_import() -> Any:
    raise RuntimeError("plugin bug at import")


def test_plugin_with_missing_dependency_is_skipped_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """a plugin whose import fails (ImportError) is skipped with its reason; the others still warm"""
    _with_entry_points(monkeypatch, _FakeEntryPoint("good", _good), _FakeEntryPoint("needs_flashinfer", _missing_dependency))
    report = warmreg.warm(CONFIG, target="cuda:90")
    assert report.ok and report.compiled == 1
    assert any("needs_flashinfer" in p["plugin"] and "flashinfer" in p["reason"] for p in report.plugin_problems)


def test_plugin_that_raises_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """a plugin that raises something else at import stops the warm with PluginError, or is skipped on request"""
    _with_entry_points(monkeypatch, _FakeEntryPoint("good", _good), _FakeEntryPoint("buggy", _crashes_on_import))
    with pytest.raises(warmreg.PluginError, match="buggy") as info:
        warmreg.warm(CONFIG, target="cuda:90")
    assert info.value.plugin == "buggy"
    report = warmreg.warm(CONFIG, target="cuda:90", on_plugin_error="skip")
    assert report.ok and report.compiled == 1 and any("buggy" in p["plugin"] for p in report.plugin_problems)


class _HookRaises:
    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        registry.add(Scale(sizes=(17,)))  # registered before the failure: must not survive a skip
        raise ValueError("hook bug")


def test_plugin_whose_hook_raises() -> None:
    """a plugin whose hook raises is named in a PluginError, or skipped whole (none of its kernels kept)"""
    with pytest.raises(warmreg.PluginError, match="hook bug"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[_good(), _HookRaises()], entry_points=False)
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[_good(), _HookRaises()], entry_points=False, on_plugin_error="skip")
    assert [k.n_class for k in plan.kernel("tests.scale").keys] == ["div16"]  # the skipped plugin's 17 is gone
    assert any("hook bug" in p.reason for p in plan.plugin_problems)


def test_kernel_whose_compile_fails() -> None:
    """a registered kernel whose compile fails is reported with its error; every other key still warms"""
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[_good(), Plugin(Broken())], entry_points=False, on_error="continue")
    assert report.compiled == 1 and [r.kernel for r in report.failed] == ["tests.broken"]


def test_two_plugins_register_conflicting_kernels_under_one_name() -> None:
    """two plugins registering different kernel classes under one name: PluginError naming both"""

    class Impostor(Scale):
        pass

    Impostor.name = "tests.scale"
    with pytest.raises(warmreg.PluginError, match="Impostor"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[_good(), Plugin(Impostor())], entry_points=False)


class _Serving(Plugin):
    """A plugin that declares the model types it serves, and counts the calls of its register hook."""

    def __init__(self, types: list[str]) -> None:
        super().__init__(Scale(sizes=(16,)))
        self.types, self.calls = types, 0

    @warmreg.hookimpl
    def warmreg_model_types(self) -> list[str]:
        return self.types

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        self.calls += 1
        super().warmreg_register_kernels(registry)


def test_the_core_calls_a_plugin_only_for_the_model_types_it_serves() -> None:
    """No model-type guard in a plugin: the core filters its register hook by its ``warmreg_model_types``;
    a plugin that declares none is called for every config."""
    mine, other, any_type = _Serving(["test"]), _Serving(["other_llm"]), Plugin(Scale(sizes=(16,)))
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[mine, other, any_type], entry_points=False)
    assert (mine.calls, other.calls) == (1, 0)
    assert plan.num_keys >= 1 and len(plan.kernels) == 1
