"""The forked compile of a warm's misses (``warmreg.stages.processes``): the children fill Triton's disk
cache, this process then finds every key there, and the results are those of a warm on threads."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import triton
import triton.language as tl

import warmreg
from tests.helpers import CONFIG, Broken, Plugin, Scale
from warmreg.pipeline import compile as compile_module
from warmreg.stages import processes

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="compile processes are forked on Linux only"
)


def _warm(cache: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> warmreg.WarmReport:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    warmreg.reset_state()
    plugins = kwargs.pop("plugins", [Plugin(Scale(), Broken())])
    return warmreg.warm(CONFIG, target="cuda:90", plugins=plugins, entry_points=False, on_error="continue", **kwargs)


def _outcomes(report: warmreg.WarmReport) -> list[tuple[str, str, str, str | None]]:
    return [(r.kernel, repr(r.key), r.status, r.binary_hash) for r in report.results]


def test_the_misses_compile_in_processes_and_this_process_only_finds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    misses_here: list[str] = []
    previous = triton.knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if not cache_hit:
            misses_here.append(str(getattr(src, "name", src)))

    triton.knobs.compilation.listener = listener
    try:
        forked = _warm(tmp_path / "forked", monkeypatch, workers=2)
    finally:
        triton.knobs.compilation.listener = previous
    section = forked.stage("processes")
    assert section["processes"] == section["started"] == 2 and section["seconds"] > 0
    line = section["timeline"]  # from the stage's start, on the one monotonic clock of the parent and the children
    assert 0 < line["forked"] < section["seconds"] and 0 < line["first_key"] <= line["last_key_start"] < line["last_key_end"] <= section["seconds"]
    assert 0 < line["busy"] <= section["seconds"] * section["processes"]
    assert misses_here == [], "every binary this process compiled was a hit: a child had compiled it"
    statuses = {(r.kernel, r.status) for r in forked.results}
    assert statuses == {("tests.scale", "compiled"), ("tests.broken", "failed")}
    (broken,) = forked.failed
    assert "undefined_name" in (broken.error or ""), "the error comes from compiling the key here"

    monkeypatch.setattr(processes, "ENABLED", False)
    threads = _warm(tmp_path / "threads", monkeypatch, workers=2)
    assert threads.stage("processes").get("processes", 0) == 0
    assert _outcomes(forked) == _outcomes(threads), "the same keys, statuses and binaries as a warm on threads"


def test_each_key_is_finished_here_as_its_child_reports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """this process compiles a key from the cache as soon as a child reports it, while the children still compile
    the rest (not all after the last), and the compile step then has nothing left of those keys"""
    events: list[str] = []
    results, compile_one = processes.ForkPool.results, compile_module._compile

    def reported(self: processes.ForkPool) -> Any:
        for result in results(self):
            events.append("reported")
            yield result

    def compiled_here(task: Any, platform: Any) -> None:
        events.append("hit" if task.in_cache else "compile")
        compile_one(task, platform)

    monkeypatch.setattr(processes.ForkPool, "results", reported)
    monkeypatch.setattr(compile_module, "_compile", compiled_here)
    report = _warm(tmp_path / "cache", monkeypatch, workers=2, plugins=[Plugin(Scale(sizes=(1, 16, 17), block=64), Scale(block=128))])
    assert report.stage("processes")["compiled"] == len(report.results) == report.compiled >= processes.MIN_MISSES
    assert events.count("reported") == events.count("hit") == len(report.results) and "compile" not in events
    assert events == ["reported", "hit"] * len(report.results), "each hit right after its report, before the next"


@pytest.mark.gpu
def test_gpu_a_forked_cold_warm_leaves_every_key_loaded_with_its_fast_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """on the local GPU, the keys the children compiled are each loaded here with their fast launch as they come
    back (``Stage.finish``), so a first launch after the warm skips Triton"""
    import torch
    from triton.runtime.jit import JITFunction

    from warmreg.runtime.launch import FAST_TABLES

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    warmreg.reset_state()
    report = warmreg.warm(CONFIG, plugins=[Plugin(Scale(block=64), Scale(block=128))], entry_points=False, workers=2)
    assert report.stage("processes")["compiled"] == report.compiled == report.declared == 6
    rehearsed = report.stage("rehearsal")  # the keys finished early rehearsed then (a 3.6 load left to the end: after)
    assert rehearsed["launched"] == 6 and 1 <= rehearsed["early"] <= 6
    entries = FAST_TABLES[Scale.name]
    assert len(entries) == 6 and all(entry.compiled.module is not None for entry in entries.values())
    runs: list[int] = []
    real_run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k))
    x = torch.randn(48, device="cuda", dtype=torch.float16)
    with warmreg.monitor("error") as mon:
        out = Scale()(x, 2.0, block=128)
    torch.testing.assert_close(out, x * 2.0)
    assert runs == [] and not mon.misses


def test_nothing_is_forked_for_a_warm_cache_or_a_handful_of_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    assert _warm(cache, monkeypatch, workers=2).stage("processes")["processes"] == 2
    again = _warm(cache, monkeypatch, workers=2)
    assert again.stage("processes").get("processes", 0) == 0 and {r.status for r in again.results} == {"disk_cache", "failed"}
    few = _warm(tmp_path / "few", monkeypatch, workers=2, plugins=[Plugin(Scale(sizes=(16, 17)))])
    assert few.stage("processes").get("processes", 0) == 0 and few.compiled == 2, f"fewer than {processes.MIN_MISSES} misses compile on threads"
    assert _warm(tmp_path / "one", monkeypatch, workers=1).stage("processes").get("processes", 0) == 0, "one worker forks nothing"


def _dies_on_first(index: int) -> tuple[str | None, float, float]:
    if index == 0:
        os._exit(3)  # a child killed mid-warm (the OOM killer, a crash in the compiler)
    return _child_compile(index)


_child_compile = processes._child_compile


def test_a_child_that_dies_leaves_the_rest_to_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(processes, "_child_compile", _dies_on_first)  # forked children inherit it
    with caplog.at_level(logging.WARNING, logger="warmreg.pipeline.compile"):
        report = _warm(tmp_path / "cache", monkeypatch, workers=2)
    assert "compiling in processes left" in caplog.text and "(a compile process died)" in caplog.text
    assert {(r.kernel, r.status) for r in report.results} == {("tests.scale", "compiled"), ("tests.broken", "failed")}


def test_the_children_forked_are_what_the_resident_memory_affords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "_resident_gib", lambda: 30.0)  # 71 ms a fork: 3 in a row fit in 0.25 s
    # the tree: the warm forks one child, which bears the others in two generations (1 + 1 + 2)
    assert _warm(tmp_path / "some", monkeypatch, workers=8).stage("processes")["processes"] == 4
    monkeypatch.setattr(processes, "TREE", False)  # the warm forking each: one child a fork
    assert _warm(tmp_path / "flat", monkeypatch, workers=8).stage("processes")["processes"] == 3
    monkeypatch.setattr(processes, "TREE", True)
    monkeypatch.setattr(processes, "_resident_gib", lambda: 100.0)  # 225 ms a fork: one child, not worth forking
    assert _warm(tmp_path / "one", monkeypatch, workers=8).stage("processes").get("processes", 0) == 0
    monkeypatch.setattr(processes, "_resident_gib", lambda: 200.0)  # 445 ms a fork: none
    report = _warm(tmp_path / "none", monkeypatch, workers=8)
    assert report.stage("processes").get("processes", 0) == 0
    assert {(r.kernel, r.status) for r in report.results} == {("tests.scale", "compiled"), ("tests.broken", "failed")}


def test_the_ranks_on_one_host_share_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # as torchrun sets it: 4 ranks warm at once here
    assert _warm(tmp_path / "a", monkeypatch, workers=8).stage("processes")["processes"] == 2
    assert _warm(tmp_path / "b", monkeypatch, workers=4).stage("processes").get("processes", 0) == 0, "one core each: threads"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert _warm(tmp_path / "c", monkeypatch, workers=2).stage("processes")["processes"] == 2


def test_a_launcher_is_claimed_once_across_forked_children(monkeypatch: pytest.MonkeyPatch) -> None:
    claims = processes._Claims()  # what the children of one forked compile inherit
    keys = [f"{i:064x}" for i in range(5)]
    read, write = os.pipe()
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # a child: how many of the keys it was the first to claim (it never returns into the suite)
            try:
                os.write(write, bytes([sum(claims.claim(k) for k in keys)]))
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    assert sum(os.read(read, 4)) == 5, "each launcher built by exactly one child"
    assert not any(claims.claim(k) for k in keys) and claims.claim("f" * 64)
    monkeypatch.setattr(processes._Claims, "SLOTS", 1)
    full = processes._Claims()
    assert full.claim(keys[0]) and full.claim(keys[1]) and full.claim(keys[1]), (
        "past its slots a child builds unclaimed"
    )
    assert not full.claim(keys[0])


@triton.jit
def _leaf(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


@triton.jit
def _caller(x_ptr):
    _leaf(x_ptr)


def test_a_kernels_source_size_counts_the_jit_functions_it_calls() -> None:
    assert processes._source_size(_caller) == len(_caller.src) + len(_leaf.src)
    assert processes._source_size(_leaf) == len(_leaf.src)


def test_the_longest_sources_are_handed_to_the_children_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The children take keys in order: the key likely to compile longest goes first, so it does not start last."""
    sizes: list[int] = []  # of the keys in the order handed out (the compile step here then compiles them)
    monkeypatch.setattr(
        processes.Processes, "_fork", lambda self, misses, plan, start: sizes.extend(processes._source_size(t.launch[0]) for t in misses)
    )
    report = _warm(tmp_path, monkeypatch, workers=2)
    assert len(sizes) >= processes.MIN_MISSES and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert {(r.kernel, r.status) for r in report.results} == {("tests.scale", "compiled"), ("tests.broken", "failed")}
