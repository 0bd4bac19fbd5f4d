"""Interrupts: a SIGINT stops a warm quietly (exit 130, one line), is never lost, a second one ends the
warm at once, and the cache is consistent after either.

The warms run as ``warmreg warm examples/kimi_k3.json --target cuda:90 --workers 4`` in a process group of
their own (``start_new_session``), so that a test can send SIGINT to the whole group as a terminal's
Ctrl-C does (the warm, its compile processes and the compilers they run) or to the warm alone as an
engine stopping its workers does. Two stand-ins make the interrupt land at a known point: an at-fork hook
that sends SIGINT when the warm forks its first compile process, and a ``ptxas`` (``TRITON_PTXAS_PATH``)
that logs its pid and sleeps before it runs the real one, dying of SIGINT as ptxas does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import triton

import warmreg
from tests.helpers import CONFIG, SIGINT_AS_IN_A_TERMINAL, Broken, Plugin, Scale, sigint_as_in_a_terminal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "examples" / "kimi_k3.json")

#: The CLI, with an at-fork hook that sends this process SIGINT at its first fork when asked to.
_CLI = SIGINT_AS_IN_A_TERMINAL + """
import os, signal, sys
if os.environ.get("WARMREG_TEST_INTERRUPT_AT_FORK"):
    fired = []
    def interrupt():
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
    os.register_at_fork(after_in_parent=interrupt)
from warmreg.cli.main import main
sys.exit(main(sys.argv[1:]))
"""

#: A ptxas that takes its time: logs its pid, sleeps, then becomes the real ptxas. Like ptxas it dies of
#: a SIGINT it does not block (a shell would not do: dash unblocks every signal when it starts).
_SLOW_PTXAS = """#!{python} -S
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_DFL)
real = os.environ["WARMREG_TEST_REAL_PTXAS"]
if "--version" not in sys.argv:
    with open(os.environ["WARMREG_TEST_PTXAS_LOG"], "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    time.sleep(float(os.environ["WARMREG_TEST_PTXAS_SLEEP"]))
os.execv(real, [real, *sys.argv[1:]])
"""


class _Warm:
    """A warm started by :func:`_warm_process`; its standard streams go to files (a stand-in ptxas the
    warm leaves behind keeps them open)."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.proc, self.pid, self.out_path, self.err_path = proc, proc.pid, out, err

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the warm to exit; its exit code, stdout and stderr."""
        self.proc.wait(timeout=timeout)
        return self.proc.returncode, self.out_path.read_text(), self.err_path.read_text()


@contextlib.contextmanager
def _warm_process(
    tmp_path: Path, *, interrupt_at_fork: bool = False, ptxas_sleep: float | None = None, threads_only: bool = False
) -> Iterator[_Warm]:
    """A cold warm of Kimi-K3 for cuda:90 on 4 workers, in a process group of its own; whatever is left
    of the group (a stand-in ptxas still sleeping) is killed on exit."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(_dir(tmp_path / "tmp"))}
    if interrupt_at_fork:
        env["WARMREG_TEST_INTERRUPT_AT_FORK"] = "1"
    if threads_only:  # the 4 ranks of a job on this host share the 4 workers: one each, nothing forked
        env["LOCAL_WORLD_SIZE"] = "4"
    if ptxas_sleep is not None:
        stand_in = tmp_path / "ptxas"
        stand_in.write_text(_SLOW_PTXAS.format(python=sys.executable))
        stand_in.chmod(0o755)
        env |= {
            "TRITON_PTXAS_PATH": str(stand_in), "WARMREG_TEST_REAL_PTXAS": triton.knobs.nvidia.ptxas.path,
            "WARMREG_TEST_PTXAS_LOG": str(tmp_path / "ptxas.log"), "WARMREG_TEST_PTXAS_SLEEP": str(ptxas_sleep),
        }  # fmt: skip
    command = [sys.executable, "-c", _CLI, "warm", KIMI, "--target", "cuda:90", "--workers", "4", "--quiet"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        yield _Warm(proc, out, err)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _dir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


def _wait_for_a_compiler(tmp_path: Path, warm: _Warm, timeout: float = 120) -> None:
    """Until a stand-in ptxas runs (it logs its pid before it sleeps)."""
    log = tmp_path / "ptxas.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and warm.proc.poll() is None:
        if log.exists() and log.read_text().strip():
            return
        time.sleep(0.02)
    pytest.fail(f"no compiler ran before the warm ended (exit {warm.proc.returncode})")


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not exited (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _ppid, group = stat.read_text().rpartition(")")[2].split()[:3]
            if int(group) == pgid and state != "Z":
                found.append(int(stat.parent.name))
    return found


def _assert_quiet_interrupt(code: int, out: str, err: str) -> None:
    assert code == 130, f"exit {code}; stderr:\n{err[-3000:]}"
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    assert "reproducer" not in out + err and "ptxas" not in out + err, "a compiler's dump: " + (out + err)[:3000]
    assert err.strip().splitlines() == ["interrupted"], err[-3000:]


def _whole_entries_only(cache: Path) -> int:
    """Every group file Triton would read points at whole, non-empty files; returns how many groups."""
    groups = list(cache.rglob("__grp__*.json"))
    for group in groups:
        for path in json.loads(group.read_text())["child_paths"].values():
            assert Path(path).is_file() and Path(path).stat().st_size > 0, (group, path)
    return len(groups)


def _warm_again_completes(tmp_path: Path) -> None:
    """A warm after the interrupt loads what the interrupted one finished and compiles the rest: 0 failed."""
    _whole_entries_only(tmp_path / "cache")
    report_path = tmp_path / "again.json"
    again = subprocess.run(
        [sys.executable, "-m", "warmreg", "warm", KIMI, "--target", "cuda:90", "--quiet", "--workers", "4", "--json", str(report_path)],
        env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(report_path.read_text())["summary"]
    keys = warmreg.plan(KIMI, target="cuda:90").num_keys
    assert summary["failed"] == 0 and summary["compiled"] + summary["from_cache"] == keys, summary
    assert _whole_entries_only(tmp_path / "cache") >= keys


def test_sigint_while_the_warm_forks_is_not_lost(tmp_path: Path) -> None:
    """SIGINT while the warm forks its compile processes (from an at-fork hook): exit 130 with one line,
    no compile process left, and a warm afterwards completes"""
    with _warm_process(tmp_path, interrupt_at_fork=True) as warm:
        code, out, err = warm.finish(timeout=300)
        _assert_quiet_interrupt(code, out, err)
        assert "kimi_k3" not in out, "the warm ran on after the interrupt"
        deadline = time.monotonic() + 10
        while (left := _group(warm.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"compile processes outlived the warm: {left}"
    _warm_again_completes(tmp_path)


@pytest.mark.parametrize("where", ["processes", "threads"])
def test_ctrl_c_while_a_compiler_runs_prints_no_dump(where: str, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the process group) while ptxas runs in a compile process or a compile thread:
    exit 130 with one line, no compiler killed (no PTX dump, "please share the reproducer")"""
    with _warm_process(tmp_path, ptxas_sleep=3, threads_only=where == "threads") as warm:
        _wait_for_a_compiler(tmp_path, warm)
        os.killpg(warm.pid, signal.SIGINT)
        _assert_quiet_interrupt(*warm.finish(timeout=120))
    _whole_entries_only(tmp_path / "cache")


def test_a_second_sigint_ends_the_warm_at_once(tmp_path: Path) -> None:
    """a second SIGINT while the warm stops (its compile threads finishing a long compile) ends it at
    once with 130, and a warm afterwards completes"""
    with _warm_process(tmp_path, ptxas_sleep=120, threads_only=True) as warm:
        _wait_for_a_compiler(tmp_path, warm)
        warm.proc.send_signal(signal.SIGINT)  # to the warm alone, as an engine stops its workers
        with contextlib.suppress(subprocess.TimeoutExpired):
            warm.proc.wait(timeout=1)
        if warm.proc.poll() is None:  # (else the first one already stopped it)
            warm.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                warm.proc.wait(timeout=10)
            assert warm.proc.poll() is not None, "the second SIGINT did not end the warm at once"
        _assert_quiet_interrupt(*warm.finish(timeout=1))
    _warm_again_completes(tmp_path)


_ARMED: list[bool] = []  # os.register_at_fork has no unregister: the hook below acts only while armed


def _interrupt_when_armed() -> None:
    if _ARMED:
        _ARMED.clear()
        os.kill(os.getpid(), signal.SIGINT)


os.register_at_fork(after_in_parent=_interrupt_when_armed)


def test_an_interrupt_while_forking_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """warmreg.warm() raises the KeyboardInterrupt of a SIGINT that arrives while it forks, leaves no
    compile process, and the next warm completes"""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))

    def warm() -> warmreg.WarmReport:
        warmreg.reset_state()
        plugins = [Plugin(Scale(), Broken())]
        return warmreg.warm(
            CONFIG, target="cuda:90", plugins=plugins, entry_points=False, on_error="continue", workers=2
        )

    _ARMED.append(True)
    try:
        with sigint_as_in_a_terminal(), pytest.raises(KeyboardInterrupt):
            warm()
    finally:
        _ARMED.clear()
    assert not _children(os.getpid()), "a compile process outlived the warm"
    report = warm()
    assert {(r.kernel, r.status in ("compiled", "disk_cache")) for r in report.results} == {
        ("tests.scale", True),
        ("tests.broken", False),
    }
    _whole_entries_only(tmp_path / "cache")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` that have not exited (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, ppid = stat.read_text().rpartition(")")[2].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(stat.parent.name))
    return found
