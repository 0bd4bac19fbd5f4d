"""warmreg-sglang started by SGLang itself: its ``sglang.srt.plugins`` entry point loaded by SGLang's own
``load_plugins`` and applied by ``HookRegistry``, warm called once with the runner's real ``ServerArgs`` before
SGLang's graph capture, the monitor after it, a draft model's runner skipped.

Runs in the SGLang venv (``bash scripts/engine-envs.sh test sglang``, which installs warmreg-sglang there); skips,
naming why, elsewhere. No GPU here: the runner's ``init_cuda_graphs`` and ``load_model`` are replaced by recorders
before the hooks wrap them, and warm plans the real config and compiles nothing (a real, empty warm).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
from plans import StartupEvents, differences, engine_or_skip, planned_keys

os.environ.setdefault("WARMREG_ENGINE", "sglang")
engine_or_skip("SGLang", "sglang.srt.server_args", "sglang.srt.model_executor.model_runner", "warmreg_sglang.plugin")

import sglang.srt.plugins as sglang_plugins  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

import warmreg  # noqa: E402
from warmreg import monitoring  # noqa: E402


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    ev = StartupEvents()

    def load_model(self: Any) -> None:
        ev.add("load_model")

    def init_cuda_graphs(self: Any, capture_decode_cuda_graph: bool = True) -> None:
        ev.add("capture" + ("(draft)" if self.is_draft_worker else ""))

    monkeypatch.setattr(ModelRunner, "load_model", load_model)
    monkeypatch.setattr(ModelRunner, "init_cuda_graphs", init_cuda_graphs)
    ev.spy_on_warm(monkeypatch)
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setenv("WARMREG_WARM", "1")
    monkeypatch.setenv("WARMREG_MONITOR", "warn")
    yield ev
    ev.disarm_all()


def _runner(server_args: Any, *, draft: bool = False) -> Any:
    runner = ModelRunner.__new__(ModelRunner)  # the GPU-free part of a runner: its arguments
    runner.server_args, runner.is_draft_worker = server_args, draft
    return runner


def test_the_entry_point_is_in_sglangs_group() -> None:
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "warmreg"]
    assert ep.value == "warmreg_sglang.plugin:register"


def test_sglang_loads_the_plugin_which_warms_once_before_capture(events: StartupEvents, tmp_path: Path) -> None:
    sglang_plugins.load_plugins()  # discovers the entry point, runs it, applies the hooks
    server_args = cases.build_sglang("flash_eagle", tmp_path)
    draft, target = _runner(server_args, draft=True), _runner(server_args)
    target.load_model()
    assert warmreg.api.prefetch._plugins_thread is not None  # the prefetch started with the weights' load
    target.init_cuda_graphs()
    draft.init_cuda_graphs()  # the draft model's runner: no second warm
    target.init_cuda_graphs()
    assert events.log == [
        ("load_model", False),
        ("warmreg.warm", False),
        ("capture", False),
        ("capture(draft)", True),
        ("capture", True),
    ]
    (config,) = events.configs
    assert config is server_args  # the runner's own arguments
    got, want = planned_keys(config), planned_keys(cases.expected_sglang("flash_eagle"))
    assert got == want, differences(got, want)
    armed = monitoring.current()
    assert armed is not None and armed.mode == "warn"


def test_off_unless_asked(events: StartupEvents, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARMREG_WARM")
    sglang_plugins.load_plugins()
    _runner(None).init_cuda_graphs()
    assert events.log == [("capture", False)]


def test_a_bad_setting_stops_the_start_naming_it(events: StartupEvents, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang swallows a plugin's exception while loading; the hook raises it where it stops the start-up."""
    monkeypatch.setenv("WARMREG_WARM", "yes please")
    sglang_plugins.load_plugins()
    with pytest.raises(warmreg.ConfigError, match="WARMREG_WARM"):
        _runner(None).init_cuda_graphs()
    assert events.log == []
