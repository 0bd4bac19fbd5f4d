"""Faults: interrupted warms, a read-only cache, a full disk. The cache always holds whole entries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, SIGINT_AS_IN_A_TERMINAL, Plugin, Scale
from warmreg.stages import fork_pool, remember

ROOT = Path(__file__).resolve().parents[2]
FLASH = str(ROOT / "examples" / "deepseek_v4_flash.json")


def _whole_entries_only(cache: Path) -> int:
    """Every group file Triton would read points at whole, non-empty files; returns how many groups."""
    groups = list(cache.rglob("__grp__*.json"))
    for group in groups:
        children = json.loads(group.read_text())["child_paths"]
        for path in children.values():
            assert Path(path).is_file() and Path(path).stat().st_size > 0, (group, path)
    return len(groups)


def _start_warm(cache: Path, temp: Path) -> subprocess.Popen[str]:
    cli = SIGINT_AS_IN_A_TERMINAL + "import sys\nfrom warmreg.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.Popen(
        [sys.executable, "-c", cli, "warm", FLASH, "--target", "cuda:90", "--quiet", "--workers", "2"],
        env={**os.environ, "TRITON_CACHE_DIR": str(cache), "TMPDIR": str(temp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # exited while listed
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _state(pid: int) -> str:
    """A process's state letter (``Z`` also for one that is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def _count_groups(cache: Path) -> int:
    """Group files under a cache another process is writing (os.walk skips the temporary directories
    Triton removes while it is listed; ``Path.rglob`` raises on them)."""
    return sum(1 for _, _, files in os.walk(cache) for f in files if f.startswith("__grp__") and f.endswith(".json"))


def _wait_for_some_entries(cache: Path, proc: subprocess.Popen[str], at_least: int = 3, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _count_groups(cache) >= at_least:
            return
        time.sleep(0.05)
    pytest.fail("the warm finished or stalled before it could be interrupted")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_warm_then_rerun(sig: signal.Signals, tmp_path: Path) -> None:
    """a warm interrupted half way (SIGINT, SIGKILL) leaves only whole entries and none of its
    compile processes; a re-run completes, and leaves nothing in the temporary directory (a SIGKILL can leave the
    ptxas files of the compiles it cut short there, in the compile processes' own folder: the re-run removes it)"""
    cache, temp = tmp_path / "cache", tmp_path / "tmp"
    temp.mkdir()
    proc = _start_warm(cache, temp)
    _wait_for_some_entries(cache, proc)
    children = _children(proc.pid)
    assert children, "the warm compiles its misses in forked processes"
    proc.send_signal(sig)
    proc.communicate(timeout=300)  # its standard streams close only when no child holds them
    assert proc.returncode in ((130, 1) if sig == signal.SIGINT else (-9,))
    deadline = time.monotonic() + 10
    while (alive := [c for c in children if _state(c) != "Z"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"compile processes outlived the warm: {alive}"
    partial = _whole_entries_only(cache)
    plan_keys = warmreg.plan(FLASH, target="cuda:90").num_keys
    assert 0 < partial < plan_keys + 5
    rerun = subprocess.run(
        [sys.executable, "-m", "warmreg", "warm", FLASH, "--target", "cuda:90", "--quiet", "--json", str(tmp_path / "r.json")],
        env={**os.environ, "TRITON_CACHE_DIR": str(cache), "TMPDIR": str(temp)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    written = json.loads((tmp_path / "r.json").read_text())
    report = written["summary"]
    assert report["failed"] == 0 and report["from_cache"] >= 1 and report["compiled"] + report["from_cache"] == plan_keys
    _whole_entries_only(cache)
    assert written["stages"]["processes"]["started"] > 0, "the re-run forks"
    assert not (left := [str(p.relative_to(temp)) for p in temp.rglob("*")]), f"left in the temporary directory: {left}"


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A tiny tmpfs the test mounts itself (needs root and mount rights; skipped with the reason otherwise)."""
    target = tmp_path / "mnt"
    target.mkdir()
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount  # type: ignore[misc]
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_read_only_cache_directory(small_mount, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """a read-only Triton cache directory is refused up front with one clear error"""
    cache = small_mount("ro,size=64k")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    with pytest.raises(warmreg.WarmregError, match="not writable") as info:
        warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    assert "TRITON_CACHE_DIR" in str(info.value)


@pytest.mark.parametrize("slow_exits", [False, True], ids=["exits-at-once", "slow-exits"])
def test_full_disk(small_mount, monkeypatch: pytest.MonkeyPatch, slow_exits: bool) -> None:  # type: ignore[no-untyped-def]
    """a full disk under the cache gives a clear error per key and leaves only whole entries (also where the
    compile processes take their time to exit, as on a loaded machine: their failed writes' temporary
    directories are theirs while they live)"""
    if slow_exits:
        live = fork_pool.ForkPool._live

        def live_then_linger(self: fork_pool.ForkPool, lo: int, hi: int, forker: int) -> int:
            code = live(self, lo, hi, forker)
            time.sleep(0.5)
            return code

        monkeypatch.setattr(fork_pool.ForkPool, "_live", live_then_linger)
    cache = small_mount("size=48k")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    with pytest.raises(warmreg.CompileFailed) as info:
        warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(1, 16, 17), block=64), Scale(block=128))], entry_points=False)
    errors = [r.error or "" for r in info.value.report.failed]  # type: ignore[attr-defined]
    assert errors and all("no space left" in e and "TRITON_CACHE_DIR" in e for e in errors)
    _whole_entries_only(cache)
    kept = remember.index_path(str(cache)).parent
    unfinished = [d for d in cache.iterdir() if d.is_dir() and d != kept and not any(d.glob("__grp__*.json"))]
    assert not unfinished, f"failed entries left files behind (their failed writes' temporary directories too): {unfinished}"
