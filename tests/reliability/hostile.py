"""Builders and a runner for the hostile-input generators (``test_hostile_*.py``).

A case is a pack (or config) made hostile in one way; :func:`run_cli` runs the real CLI in-process
under a deadline and :func:`assert_refused` checks the promise of issue 18: exit 2, one line naming
the problem, under 2 s, nothing written outside ``TRITON_CACHE_DIR`` and nothing inside it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import re
import signal
import stat
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from warmreg.cli.main import main

Members = dict[str, bytes]


def digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@attrs.define
class Pack:
    """A pack's members, with its manifest parsed for editing (the digest is recomputed on write)."""

    members: Members
    doc: dict[str, Any]
    redigest: bool = True

    @classmethod
    def of(cls, members: Members) -> Pack:
        return cls(dict(members), json.loads(members["manifest.json"]))

    @property
    def body(self) -> dict[str, Any]:
        return self.doc["body"]  # type: ignore[no-any-return]

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.body["entries"]  # type: ignore[no-any-return]

    def member_of(self, entry: dict[str, Any], suffix: str) -> tuple[dict[str, Any], str]:
        f = next(f for f in entry["files"] if f["name"].endswith(suffix))
        return f, f"files/{entry['binary_hash']}/{f['name']}"

    def replace_file(self, entry: dict[str, Any], suffix: str, data: bytes) -> None:
        """Give one file new content, with its size and sha256 updated in the manifest (a consistent lie)."""
        f, member = self.member_of(entry, suffix)
        self.members[member] = data
        f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()

    def rename_file(self, entry: dict[str, Any], suffix: str, name: str) -> None:
        f, member = self.member_of(entry, suffix)
        data = self.members.pop(member)
        f["name"] = name
        self.members[f"files/{entry['binary_hash']}/{name}"] = data

    def final(self) -> Members:
        out = dict(self.members)
        if self.redigest:
            self.doc["sha256"] = digest(self.body)
        if "manifest.json" in out:
            out["manifest.json"] = json.dumps(self.doc).encode()
        return out


def edited(base: Members, change: Callable[[Pack], None]) -> Members:
    pack = Pack.of(copy.deepcopy(base))
    change(pack)
    return pack.final()


def write_tar(path: Path, members: Members, *, gz: bool = False, extra: Callable[[tarfile.TarFile], None] | None = None) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if extra is not None:
            extra(tar)
    return path


def write_zip(path: Path, members: Members, *, links: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            if links and name in links:
                continue
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return path


def write_dir(path: Path, members: Members) -> Path:
    for name, data in members.items():
        dest = path / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    return path


def files_under(root: Path) -> set[Path]:
    return {Path(d) / f for d, _, fs in os.walk(root) for f in fs}


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the body runs longer than ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no answer within {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@attrs.frozen
class Outcome:
    code: int
    lines: list[str]
    seconds: float
    text: str


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str, timeout: float = 15) -> Outcome:
    """The ``warmreg`` CLI, in-process (an exception other than a clean exit escapes: a traceback)."""
    capsys.readouterr()
    start = time.perf_counter()
    with deadline(timeout):
        code = main(list(argv))
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    return Outcome(code, [line for line in err.splitlines() if line.strip()], seconds, out + err)


def assert_refused(outcome: Outcome, needle: str) -> None:
    """Exit 2, one line on stderr naming the problem (``needle``, a regex), no traceback. (``run_cli``'s
    deadline turns a hang into a failure; how fast a refusal answers is ``benchmarks/cli_refusals.py``'s.)"""
    assert outcome.code == 2, outcome.text
    assert len(outcome.lines) == 1, outcome.text
    assert re.search(needle, outcome.lines[0], re.IGNORECASE), outcome.lines[0]
    assert "Traceback" not in outcome.text


def assert_nothing_written(root: Path, before: set[Path], cache: Path) -> None:
    """No file appeared anywhere under ``root`` (the sandbox holding the pack, the cache and any
    path a hostile pack aims at), and the cache holds nothing."""
    assert files_under(root) - before == set()
    assert files_under(cache) == set()
