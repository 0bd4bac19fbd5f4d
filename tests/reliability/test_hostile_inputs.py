"""Hostile inputs other than pack contents (issue 18): paths that hang a reader, absurd config values,
broken disks and impossible outputs. Each is exit 2 and one line naming the problem (how fast: benchmarks/cli_refusals.py),
with nothing written outside the Triton cache and nothing unverified inside it."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from tests.reliability.hostile import assert_nothing_written, assert_refused, files_under, run_cli
from warmreg.contract.config import SERVING_FIELDS
from warmreg.stages import build as packs_build

ROOT = Path(__file__).resolve().parents[2]
FLASH = json.loads((ROOT / "examples" / "deepseek_v4_flash.json").read_text())
KIMI = json.loads((ROOT / "examples" / "kimi_k3.json").read_text())


@pytest.fixture(scope="module")
def good_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good") / "scale.tar"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2, launcher_pythons=[])
    return out


# -- hangs: only regular files and directories are read -------------------------------------------


def _fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "fifo")
    return str(tmp / "fifo")


def _config_file(text: str | bytes) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        path = tmp / "config.json"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return str(path)

    return make


_DEEP_MODEL = '{"model": {"model_type": "test", "x": ' + "[" * 5000 + "]" * 5000 + "}}"
HANGS: dict[str, tuple[list[str], Callable[[Path], str], str]] = {
    "pack verify /dev/zero": (["pack", "verify"], lambda tmp: "/dev/zero", "not a regular file"),
    "pack install /dev/zero": (["pack", "install"], lambda tmp: "/dev/zero", "not a regular file"),
    "pack inspect /dev/urandom": (["pack", "inspect"], lambda tmp: "/dev/urandom", "not a regular file"),
    "pack verify of a FIFO": (["pack", "verify"], _fifo, "not a regular file"),
    "pack install of a FIFO": (["pack", "install"], _fifo, "not a regular file"),
    "plan of a FIFO config": (["plan"], _fifo, "not a regular file"),
    "warm of a FIFO config": (["warm", "--target", "cuda:90", "--quiet"], _fifo, "not a regular file"),
    "plan of /dev/zero as config": (["plan"], lambda tmp: "/dev/zero", "not a regular file"),
    "plan of a directory as config": (["plan"], lambda tmp: str(tmp), "directory"),
    "plan of a 100,000-deep config": (["plan"], _config_file("[" * 100_000 + "]" * 100_000), "levels deep"),
    "plan of a config nested 5,000 deep in the model": (["plan"], _config_file(_DEEP_MODEL), "levels deep"),
    "plan of a 17 MiB config": (["plan"], _config_file(b" " * (17 << 20)), "more than"),
    "plan of a config that is not UTF-8": (["plan"], _config_file(b"\xff\xfe{}"), "not a JSON config"),
    "plan of a config that is a JSON list": (["plan"], _config_file("[1]"), "JSON object"),
}


@pytest.mark.parametrize("name", sorted(HANGS))
def test_paths_that_could_hang(name: str, tmp_path: Path, triton_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """a device, FIFO, directory or bloated file where a pack or config is expected: one line, at once"""
    command, make, needle = HANGS[name]
    path = make(tmp_path)
    before = files_under(tmp_path)
    assert_refused(run_cli(capsys, *command, path, timeout=10), needle)
    assert_nothing_written(tmp_path, before, triton_cache)


# -- absurd configs: every int setting has a range -------------------------------------------------

_ABSURD = {"2**1000": 2**1000, "2**62": 2**62, "-1": -1, "True": True, "1.5": 1.5, "'8'": "8", "None-like []": []}
_INT_FIELDS = sorted(n for n, (check, _) in SERVING_FIELDS.items() if check(1) is None)


def _with(base: dict[str, Any], section: str, name: str, value: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(base))
    cfg[section][name] = value
    return cfg


@pytest.mark.parametrize("value", sorted(_ABSURD))
@pytest.mark.parametrize("field", _INT_FIELDS)
def test_absurd_serving_int(field: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """an absurd value for an int serving setting (huge, negative, bool, float, string) is one line naming the field"""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_with(FLASH, "serving", field, _ABSURD[value])))
    assert_refused(run_cli(capsys, "plan", str(path), "--target", "cuda:90"), f"serving\\.{field}")


@pytest.mark.parametrize("edge", ["min", "max", "max+1"])
@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("family", ["deepseek_v4_flash", "kimi_k3"])
def test_serving_int_at_the_edges_of_its_range(family: str, field: str, edge: str) -> None:
    """an int setting at either end of its documented range plans or is a ConfigError; one past it is a ConfigError naming it"""
    check = SERVING_FIELDS[field][0]
    low = next(v for v in (0, 1) if check(v) is None)
    high = next(2**k for k in range(40, 0, -1) if check(2**k) is None)
    assert check(high + 1) is not None  # the documented maximum is a power of two
    value = {"min": low, "max": high, "max+1": high + 1}[edge]
    base = FLASH if family == "deepseek_v4_flash" else KIMI
    try:
        warmreg.plan(_with(base, "serving", field, value), target="cuda:90")
    except warmreg.ConfigError as exc:
        assert edge != "max+1" or exc.field == f"serving.{field}"
    else:
        assert edge != "max+1", "a value past the range was accepted"


@pytest.mark.parametrize("field", ["head_dim", "num_attention_heads", "hidden_size", "q_lora_rank"])
def test_absurd_model_int(field: str) -> None:
    """a model field of 2**1000 is a ConfigError naming it, not an overflow in torch"""
    with pytest.raises(warmreg.ConfigError) as info:
        warmreg.plan(_with(FLASH, "model", field, 2**1000), target="cuda:90")
    assert field in info.value.field


# -- broken disks and impossible outputs -----------------------------------------------------------


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """A tiny tmpfs the test mounts itself (needs root and mount rights; skipped otherwise)."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def _whole_only(cache: Path) -> None:
    """Every file in the cache is a group file or one of a group's children; no temporary files."""
    referenced: set[str] = set()
    groups = list(cache.rglob("__grp__*.json"))
    for group in groups:
        referenced |= set(json.loads(group.read_text())["child_paths"].values())
    for path in files_under(cache):
        assert path in groups or str(path) in referenced, f"unreferenced {path}"


DISKS: dict[str, tuple[Callable[[Path, Callable[[str], Path]], Path], str]] = {
    "TRITON_CACHE_DIR is a file": (lambda tmp, mount: (tmp / "f").write_text("x") and tmp / "f", "not a directory"),
    "TRITON_CACHE_DIR under a file": (lambda tmp, mount: (tmp / "f").write_text("x") and tmp / "f" / "cache", "cache directory"),
    "read-only cache directory": (lambda tmp, mount: mount("ro,size=64k"), "not writable"),
    "full cache directory": (lambda tmp, mount: mount("size=12k"), "no space left"),
}


@pytest.mark.parametrize("name", sorted(DISKS))
@pytest.mark.parametrize("command", ["pack install", "warm --pack"])
def test_broken_cache_directory(
    name: str, command: str, good_pack: Path, tmp_path: Path, mount: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """a cache directory that is a file, read-only or full: one line naming it; only whole entries, no temporary files"""
    make, needle = DISKS[name]
    cache = make(tmp_path, mount)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    argv = ["pack", "install", str(good_pack)] if command == "pack install" else ["warm", str(ROOT / "examples" / "kimi_k3.json"), "--target", "cuda:90", "--quiet", "--pack", str(good_pack)]
    outcome = run_cli(capsys, *argv)
    if command == "pack install":
        assert_refused(outcome, needle)
    else:  # warm refuses an unwritable cache up front (exit 2), and a full one per failed key (exit 1)
        assert outcome.code in (1, 2) and "Traceback" not in outcome.text and needle in " ".join(outcome.text.lower().split()), outcome.text
    if cache.is_dir() and command == "pack install":  # (a full disk mid-compile is Triton's own to clean)
        _whole_only(cache)


def test_failing_fsync_leaves_nothing(good_pack: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """a disk error while an entry is written (ENOSPC at fsync): one line; the cache keeps no file of it, no temporary file"""

    from warmreg.stages import pack_install as _pack_install

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_pack_install.os, "fsync", full)
    assert_refused(run_cli(capsys, "pack", "install", str(good_pack)), "no space left")
    assert files_under(triton_cache) == set()


OUTPUTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "warm --json into a missing directory": (lambda tmp: ["warm", "{config}", "--target", "cuda:90", "--quiet", "--json", str(tmp / "nope" / "r.json")], "does not exist"),
    "warm --json under a file": (lambda tmp: ["warm", "{config}", "--target", "cuda:90", "--quiet", "--json", str(tmp / "f" / "r.json")], "not a directory"),
    "warm --json onto a directory": (lambda tmp: ["warm", "{config}", "--target", "cuda:90", "--quiet", "--json", str(tmp)], "is a directory"),
    "build -o under a file": (lambda tmp: ["build", "{config}", "--target", "cuda:90", "-o", str(tmp / "f" / "x" / "p.tar")], "not a directory"),
    "build -o into /proc": (lambda tmp: ["build", "{config}", "--target", "cuda:90", "-o", "/proc/warmreg/p.tar"], "not writable"),
}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_impossible_output_is_refused_before_the_work(name: str, tmp_path: Path, triton_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """an output that cannot be written is refused before anything compiles (one line, empty cache)"""
    (tmp_path / "f").write_text("x")
    make, needle = OUTPUTS[name]
    argv = [a.format(config=ROOT / "examples" / "kimi_k3.json") for a in make(tmp_path)]
    before = files_under(tmp_path)
    assert_refused(run_cli(capsys, *argv), needle)
    assert_nothing_written(tmp_path, before, triton_cache)
