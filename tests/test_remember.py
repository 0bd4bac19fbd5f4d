"""What a cache's warms specialized, kept in it (``warmreg.stages.remember``): written once per new specialization,
decoded by the next process's prefetch for the local GPUs' targets, taken by binding in place of Triton's argument
packing, and never in the way: an unreadable or unwritable file costs the warm nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale, _scale_kernel
from warmreg import _triton
from warmreg._triton import cache as _triton_cache
from warmreg._triton import compiler as _compiler
from warmreg.stages import pack_install as _pack_install
from warmreg.stages import remember
from warmreg.values.platform import Platform

SM90, SM80 = _triton.gpu_target(Platform.parse("cuda:90")), _triton.gpu_target(Platform.parse("cuda:80"))
NAME = _triton.full_name(_scale_kernel)


def _warm() -> warmreg.WarmReport:
    warmreg.reset_state()
    return warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=1)


def _entries(cache: Path) -> list[list[str]]:
    return json.loads(remember.index_path(str(cache)).read_text())["entries"]  # type: ignore[no-any-return]


def _forget_decoded() -> None:
    """As in a fresh process: nothing decoded, hashed or read yet (the memos only save work)."""
    for memo in (_triton_cache._decoded, _triton_cache._hashes, _triton_cache._sources, remember._known):
        memo.clear()


def test_a_warm_keeps_its_specializations_once(triton_cache: Path) -> None:
    _forget_decoded()  # as in a fresh process
    first = _warm()
    assert first.compiled == 3 and first.stage("remember") == {"kept": 3}
    assert _entries(triton_cache) == [["cuda:90", NAME, r.specialization_data] for r in first.results]
    written = remember.index_path(str(triton_cache)).stat().st_mtime_ns
    again = _warm()  # from the disk cache, the same keys: nothing new to keep
    assert again.from_cache == 3 and again.stage("remember") == {}
    assert remember.index_path(str(triton_cache)).stat().st_mtime_ns == written
    assert not list(remember.index_path(str(triton_cache)).parent.glob("*.tmp.*"))


def test_the_prefetch_decodes_them_and_binding_takes_them(triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _warm()
    _forget_decoded()
    assert remember.decode({NAME: _scale_kernel}, [SM80], stop=lambda: False) == 0  # another target's GPUs
    assert remember.decode({NAME: _scale_kernel}, [SM90], stop=lambda: True) == 0  # a warm started binding
    assert remember.decode({"other.kernel": _scale_kernel}, [SM90], stop=lambda: False) == 0  # no such function here
    assert remember.decode({NAME: _scale_kernel}, [SM90], stop=lambda: False) == 3

    def packed(*args: Any) -> Any:
        pytest.fail("binding packed and serialized a launch the cache's file held")

    monkeypatch.setattr(_compiler, "pack_bound", packed)
    again = _warm()
    assert again.from_cache == 3 and again.stage("remember") == {}
    assert [r.specialization_data for r in again.results] == [r.specialization_data for r in first.results]


def test_the_prefetch_reads_their_cache_groups_and_the_hits_skip_tritons_read(triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoded specialization's group file is read by the prefetch (off the warm's path), so the warm's hits call
    no ``get_group``; an entry in part removed since its warm is not taken, and its hit reads the group as Triton does."""
    from triton.runtime.cache import FileCacheManager

    from warmreg._triton import hits

    _forget_decoded()  # as in a fresh process: the warm keeps its specializations
    first = _warm()
    _forget_decoded()
    hits._published.clear()
    meta = f"{_scale_kernel.fn.__name__}.json"  # the metadata file of each entry (named after the jit function)
    one = first.results[0]
    cubin = next(p for p in one.cache_files.values() if p.endswith(".cubin"))
    os.rename(cubin, cubin + ".aside")  # one entry not whole: not remembered
    created = sorted(str(p) for p in triton_cache.rglob("*"))
    assert remember.decode({NAME: _scale_kernel}, [SM90], stop=lambda: False) == 3
    assert sorted(str(p) for p in triton_cache.rglob("*")) == created  # the reads create nothing
    remembered = {(h, n) for c, h, n in hits._published if c == str(triton_cache)}
    assert remembered == {(r.binary_hash, meta) for r in first.results[1:]}
    os.rename(cubin + ".aside", cubin)
    reads: list[str] = []
    real = FileCacheManager.get_group
    monkeypatch.setattr(FileCacheManager, "get_group", lambda self, name: reads.append(name) or real(self, name))
    again = _warm()
    assert again.from_cache == 3 and len(reads) == 1  # only the entry the prefetch found in part removed
    assert {r.binary_hash for r in again.results} == {r.binary_hash for r in first.results}
    assert not hits._published  # each remembered group served its hit once


def test_an_unreadable_file_is_ignored_and_written_anew(triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_decoded()  # as in a fresh process
    path = remember.index_path(str(triton_cache))
    path.parent.mkdir()
    deep = json.dumps({"format": 1, "entries": [[[[["x"]]]]]})  # nested past a file of entries: not parsed
    for text in ("{not json", json.dumps({"format": 99, "entries": []}), json.dumps({"format": 1, "entries": [[1, 2]]}), deep):
        path.write_text(text)
        _forget_decoded()
        assert remember.decode({NAME: _scale_kernel}, [SM90], stop=lambda: False) == 0
    report = _warm()
    assert report.compiled == 3 and len(_entries(triton_cache)) == 3


def test_a_file_that_cannot_be_written_costs_the_warm_nothing(triton_cache: Path) -> None:
    (triton_cache / "warmreg").write_text("a file where the folder goes")
    report = _warm()
    assert report.ok and report.compiled == 3 and report.stage("remember") == {}
    assert (triton_cache / "warmreg").read_text() == "a file where the folder goes"


def test_a_writer_killed_mid_write_leaves_a_file_the_next_write_removes(triton_cache: Path) -> None:
    _forget_decoded()  # as in a fresh process
    path = remember.index_path(str(triton_cache))
    path.parent.mkdir()
    host = _pack_install._HOST
    dead = path.with_name(f"{path.name}.tmp.{host}-{2**22 + 7}.0")  # above Linux's default pid_max: no such process
    mine = path.with_name(f"{path.name}.tmp.{host}-{os.getpid()}x.0")  # not a pid: left alone
    dead.write_text("{")
    mine.write_text("{")
    _warm()
    assert len(_entries(triton_cache)) == 3 and not dead.exists() and mine.exists()


def test_past_its_limit_the_file_keeps_the_last_warms_then_the_earliest(triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_decoded()  # as in a fresh process
    path = remember.index_path(str(triton_cache))
    path.parent.mkdir()
    older = [["cuda:80", f"old.kernel{i}", f"{{\"key\": \"{i}\"}}"] for i in range(5)]
    path.write_text(json.dumps({"format": 1, "entries": older}))
    monkeypatch.setattr(remember, "LIMIT", 4)
    report = _warm()
    assert _entries(triton_cache) == [older[0], *(["cuda:90", NAME, r.specialization_data] for r in report.results)]


def test_a_warm_from_a_pack_leaves_its_specializations_to_the_pack(tmp_path: Path, triton_cache: Path) -> None:
    from warmreg.stages import build as packs_build

    pack = tmp_path / "scale.tar"
    packs_build.build(CONFIG, pack, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    warmreg.reset_state()
    _forget_decoded()  # the pack built in another process
    warmreg.prefetch(pack=pack)  # as an engine starts: the pack's specializations decoded before the warm binds
    from warmreg.api.prefetch import wait_for_prefetch

    wait_for_prefetch()
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=pack)
    assert report.from_cache == 3 and report.stage("remember") == {}
    assert not remember.index_path(str(triton_cache)).exists()


def test_a_warm_whose_specializations_the_file_holds_does_not_write_it(triton_cache: Path) -> None:
    _forget_decoded()  # as in a fresh process
    _warm()
    written = remember.index_path(str(triton_cache)).stat().st_mtime_ns
    remember._known.clear()  # another process, which read nothing ahead (no local GPU, say)
    again = _warm()
    assert again.from_cache == 3 and again.stage("remember") == {}
    assert remember.index_path(str(triton_cache)).stat().st_mtime_ns == written


def test_writers_in_two_processes_lose_none_of_each_others_entries(triton_cache: Path) -> None:
    """Ranks on one host share a cache: each read, merge and write holds the directory's lock, so what one process
    merged is never replaced by the other's rename of an older read (40 entries each, one write per entry, at once)."""
    _forget_decoded()
    remember.index_path(str(triton_cache)).parent.mkdir()
    mine = [("cuda:90", f"tests.k{i}", f'{{"key": "{i}"}}') for i in range(80)]
    pids = []
    for half in (mine[:40], mine[40:]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                remember._known.clear()
                code = 0 if all(remember._keep(str(triton_cache), [e]) for e in half) else 2
            finally:
                os._exit(code)
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids] == [0, 0]
    assert sorted(map(tuple, _entries(triton_cache))) == sorted(mine)
