"""The forked compile's pool (``warmreg.stages.fork_pool``): workers that fork one another, every index taken
once and in order, results that never interleave, and no worker that outlives the warm or an interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from warmreg._triton.cache import HOST
from warmreg.stages.fork_pool import ForkPool, remove_temporaries

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and PR_SET_PDEATHSIG: Linux")


def _whose(index: int) -> tuple[str | None, float, float]:
    """A result naming the worker that took ``index`` and the process that forked it."""
    return f"{os.getpid()} {os.getppid()}", time.perf_counter(), 0.0


def _run(pool: ForkPool) -> list[tuple[int, str | None, float, float]]:
    pool.start()
    try:
        return list(pool.results())
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _all_gone(pids: set[int] | list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` (a process closes its files, so the pipe's end of file arrives,
    a little before it is gone)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "flat"])
@pytest.mark.parametrize("workers", [1, 2, 5, 16])
def test_the_workers_fork_one_another_and_take_every_index_once(workers: int, tree: bool) -> None:
    pool = ForkPool(workers, 40, lambda: None, _whose, tree=tree)
    results = _run(pool)
    assert sorted(r[0] for r in results) == list(range(40))
    forked_by = dict(tuple(map(int, r[1].split())) for r in results)  # type: ignore[union-attr]
    assert len(pool.born) == workers and len(pool.pids) == workers and set(forked_by) <= pool.pids
    roots = [pid for pid, parent in forked_by.items() if parent == os.getpid()]
    if tree:
        assert len(roots) <= 1, "the warm forks one worker; the workers fork the rest"
        assert all(parent in pool.pids or parent == os.getpid() for parent in forked_by.values())
    else:
        assert set(forked_by.values()) == {os.getpid()}
    assert not _all_gone(pool.pids)


def test_one_worker_takes_the_indices_in_order() -> None:
    assert [r[0] for r in _run(ForkPool(1, 12, lambda: None, _whose))] == list(range(12))


def test_errors_come_back_whole_or_cut_to_one_atomic_write() -> None:
    def work(index: int) -> tuple[str | None, float, float]:
        if index % 3 == 0:
            raise ValueError(f"bad {index}")
        return (None if index % 3 == 1 else f"{index}:" + "x" * 10_000), 1.0, 2.0

    results = {r[0]: r for r in _run(ForkPool(8, 300, lambda: None, work))}
    assert sorted(results) == list(range(300))
    for index, (_, error, start, seconds) in results.items():
        if index % 3 == 0:
            assert error == f"ValueError: bad {index}"
        elif index % 3 == 1:
            assert error is None and (start, seconds) == (1.0, 2.0)
        else:  # many workers sending long messages at once: each one whole, cut to PIPE_BUF
            assert error is not None and error.startswith(f"{index}:x") and 1000 < len(error) < 4096


def test_a_worker_that_cannot_start_leaves_its_share_to_the_others() -> None:
    def init() -> None:
        if os.getppid() == parent:  # the first worker fails; it forks nothing, so only it runs
            raise RuntimeError("no driver")

    parent = os.getpid()
    pool = ForkPool(4, 10, init, _whose)
    assert _run(pool) == [] and pool.init_errors == ["RuntimeError: no driver"]
    pool = ForkPool(4, 10, lambda: None, _whose)
    assert len(_run(pool)) == 10 and pool.init_errors == []


def _sleeps(index: int) -> tuple[str | None, float, float]:
    tempfile.mkstemp(suffix=".ptx")  # as Triton's make_cubin does before ptxas runs
    time.sleep(60)
    return None, 0.0, 0.0


def _reading(pool: ForkPool, born: int) -> tuple[threading.Thread, list[Any]]:
    """Read the pool's pipe on a thread (births and results) until ``born`` workers were born."""
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(pool.results()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while len(pool.born) < born and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pool.born) == born
    return reader, got


def test_terminate_ends_every_worker_mid_work() -> None:
    pool = ForkPool(6, 100, lambda: None, _sleeps)
    pool.start()
    reader, got = _reading(pool, 6)
    assert len(pool.pids) == 6 and all(_alive(pid) for pid in pool.pids)
    pool.terminate()
    reader.join(timeout=20)
    assert not reader.is_alive() and got == [], "every worker gone (end of file), none finished a key"
    pool.close()
    assert not _all_gone(pool.pids)


def test_close_without_waiting_returns_with_every_result_and_reaps_the_workers_later() -> None:
    """Once every index's result is in, ``close(wait=False)`` leaves the workers' exits to a thread: here the second
    worker is still starting (its ``init`` takes a second) when the first has done every index; the first waits
    for it before it exits, and the thread reaps the first (no zombie is left in /proc)."""
    warm = os.getpid()

    def init() -> None:
        if os.getppid() != warm:  # the worker the first one forks
            time.sleep(1.0)

    pool = ForkPool(2, 3, init, _whose)
    pool.start()
    assert sorted(r[0] for r in pool.results()) == [0, 1, 2]
    start = time.monotonic()
    pool.close(wait=False)
    assert time.monotonic() - start < 0.5
    first = next(pid for pid in pool.pids if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1] == str(warm))
    assert _alive(first), "the first worker waits for the one it forked"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{first}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(f"/proc/{first}").exists(), "the first worker was reaped"
    assert not _all_gone(pool.pids)
    pool.close()  # already closed: nothing to do


def test_close_without_waiting_waits_where_a_result_is_missing() -> None:
    """A worker that died took its keys' results with it: the pool is not complete, so ``close(wait=False)`` waits for
    the end of file as ``close()`` does (the warm then compiles the rest itself)."""
    pool = ForkPool(1, 4, lambda: None, lambda index: os._exit(3) if index == 2 else _whose(index))
    pool.start()
    assert [r[0] for r in pool.results()] == [0, 1]
    pool.close(wait=False)
    assert not _all_gone(pool.pids, timeout=0.5)


def _temporaries(index: int) -> tuple[str | None, float, float]:
    """A result naming where this worker's temporary files go (a file is left there, as a killed compiler leaves it)."""
    tempfile.mkstemp(suffix=".ptx")
    return f"{tempfile.gettempdir()} {os.environ.get('TMPDIR')}", time.perf_counter(), 0.0


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "no-wait"])
def test_the_workers_write_their_temporaries_in_the_pools_directory_which_goes_with_them(
    wait: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = tmp_path / "tmp"  # (the suite's Triton cache is in the test's own)
    tmp_path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pool = ForkPool(3, 9, lambda: None, _temporaries)
    pool.start()
    assert pool.temp is not None
    temp = Path(pool.temp)
    assert temp.parent == tmp_path and temp.name.startswith(f"warmreg-fork-{HOST}-{os.getpid()}-")
    results = list(pool.results())
    assert {r[1] for r in results} == {f"{temp} {temp}"} and len(list(temp.glob("*.ptx"))) == 9
    pool.close(wait=wait)
    assert not temp.exists() and pool.temp is None and not _all_gone(pool.pids)
    assert tempfile.gettempdir() == str(tmp_path) and os.environ.get("TMPDIR") != str(temp), "this process's are its own"
    assert list(tmp_path.iterdir()) == []


def test_the_workers_die_with_the_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL to the process that started the pool: every worker dies with it (the first with the warm, each
    other with the worker that forked it). What the workers had written in their temporary directory stays
    there, and the next pool on this host removes that directory (not that of a live process)."""
    tmp_path = tmp_path / "tmp"
    tmp_path.mkdir()
    script = textwrap.dedent(
        """
        import time
        from tests.test_fork_pool import ForkPool, _reading, _sleeps
        pool = ForkPool(6, 100, lambda: None, _sleeps)
        pool.start()
        _reading(pool, 6)
        print(" ".join(map(str, sorted(pool.pids))), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 6 and all(_alive(p) for p in pids)
    proc.kill()
    proc.wait(timeout=30)
    assert not (alive := _all_gone(pids)), f"workers outlived the warm: {alive}"
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(f"warmreg-fork-{HOST}-{proc.pid}-") and len(list(left.glob("*.ptx"))) == 6
    live = tmp_path / f"warmreg-fork-{HOST}-{os.getpid()}-x"
    live.mkdir()
    other_host = tmp_path / f"warmreg-fork-elsewhere-{proc.pid}-x"
    other_host.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert len(_run(ForkPool(2, 4, lambda: None, _whose))) == 4
    assert sorted(tmp_path.iterdir()) == sorted([live, other_host])
    assert remove_temporaries() == 0
