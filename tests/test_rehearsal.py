"""The rehearsal's choice of keys (``warmreg.stages.rehearsal``), without a GPU: a key the forked compile finished
early is rehearsed at once if it is loaded with its fast launch and its kernel is not tuned, and only once; the
launches themselves are replaced (the GPU tests in ``tests/test_cdispatch.py`` make them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch

from tests.helpers import CONFIG, Plugin, Scale
from warmreg.stages import compose, rehearsal
from warmreg.stages.processes import Processes


def _task(name: str, key: int, kernel: Any, *, module: Any = True, captured: Any = None) -> Any:
    return SimpleNamespace(
        kp=SimpleNamespace(name=name, kernel_for=lambda k: kernel), key=key, status="compiled",
        compiled=SimpleNamespace(module=object() if module else None), captured=captured,
    )  # fmt: skip


def test_a_key_finished_early_is_rehearsed_then_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(rehearsal._triton, "torch_device", lambda: "gpu0")
    monkeypatch.setattr(rehearsal, "runtime_platform", lambda: calls.append("platform"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))

    def launch(self: rehearsal.Rehearse, name: str, kernel: Any, key: Any, device: Any) -> None:
        calls.append((name, key, device))
        self.launched += 1

    monkeypatch.setattr(rehearsal.Rehearse, "_rehearse", launch)
    plain, tuned = SimpleNamespace(tune_configs=(), rehearse=True), SimpleNamespace(tune_configs=(0, 1), rehearse=True)
    ready = _task("a", 1, plain)
    unloaded = _task("a", 2, plain, module=False)  # its load waits for the forked compile's end (a C launcher)
    unprepared = _task("a", 3, plain, captured=("jit", (1,), {}, {}))  # no fast launch yet
    stage = rehearsal.Rehearse()
    for task in (ready, unloaded, unprepared, _task("b", 4, tuned)):  # a tuned kernel waits for its choice
        stage.rehearse_now(task)
    stage.rehearse_now(ready)  # once
    assert calls == ["platform", ("a", 1, "gpu0")] and stage.early == 1
    stage.after_load(None, [ready, unloaded, unprepared])  # type: ignore[arg-type]
    assert calls[2:] == [("a", 2, "gpu0"), ("a", 3, "gpu0"), ("synchronize", "gpu0")]
    section = stage.section()
    assert (section["launched"], section["early"]) == (3, 1) and section["seconds"] >= section["synchronize_seconds"]


def test_a_warm_wires_the_forked_compile_to_the_rehearsal() -> None:
    import warmreg
    from warmreg.values.platform import Platform

    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    local = attrs.evolve(plan, platform=Platform("cuda", 90, local=True))  # the stages a warm on an H100 host composes
    stages = compose.for_warm(local, workers=4, pack=None, shard=None, rehearse=True)
    (processes,) = [s for s in stages if isinstance(s, Processes)]
    (rehearse,) = [s for s in stages if isinstance(s, rehearsal.Rehearse)]
    assert processes.on_finished == rehearse.rehearse_now
    off = compose.for_warm(local, workers=4, pack=None, shard=None, rehearse=False)
    assert next(s for s in off if isinstance(s, Processes)).on_finished is None
