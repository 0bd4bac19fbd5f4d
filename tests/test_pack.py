"""Packs: build on this CPU-only machine, verify, refuse bad packs without writing, install, warm."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg import pack as packs
from warmreg.pack import PackError


@pytest.fixture
def built(tmp_path: Path) -> Path:
    out = tmp_path / "scale.tar"
    packs.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    return out


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


def test_build_install_then_warm_compiles_nothing(built: Path, triton_cache: Path) -> None:
    manifest = packs.verify(built, target="cuda:90")
    assert len(manifest.entries) == 3 and manifest.triton_version and manifest.ptxas_version
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    assert report.compiled == 0 and report.from_cache == 3 and "3 installed" in (report.pack or "")
    again = packs.install(built)
    assert again.installed == 0 and again.present == 3


@pytest.mark.parametrize("fmt", ["dir", "scale.zip", "scale.tar.gz"])
def test_formats(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / ("pack" if fmt == "dir" else fmt)
    packs.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False)
    assert packs.install(out).installed == 1
    with pytest.raises(PackError, match="already exists"):
        packs.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _write(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _edit_manifest(members: dict[str, bytes], change: dict, *, redigest: bool) -> None:
    data = json.loads(members["manifest.json"])
    data["body"].update(change)
    if redigest:
        data["sha256"] = hashlib.sha256(json.dumps(data["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    members["manifest.json"] = json.dumps(data).encode()


def _corrupt(kind: str, members: dict[str, bytes]) -> None:
    binary = next(n for n in members if n.endswith(".cubin"))
    if kind == "flipped byte":
        blob = bytearray(members[binary])
        blob[len(blob) // 2] ^= 0xFF
        members[binary] = bytes(blob)
    elif kind == "zero-byte file":
        members[binary] = b""
    elif kind == "missing file":
        del members[binary]
    elif kind == "edited manifest":
        _edit_manifest(members, {"target": "cuda:100"}, redigest=False)
    elif kind == "other target":
        _edit_manifest(members, {"target": "cuda:100"}, redigest=True)
    elif kind == "other triton":
        _edit_manifest(members, {"triton_version": "3.5.1"}, redigest=True)
    elif kind == "newer warmreg":
        _edit_manifest(members, {"format": 99}, redigest=True)
    elif kind == "dotdot member":
        members["files/../../escape.cubin"] = b"x"
    elif kind == "absolute member":
        members["/etc/evil.cubin"] = b"x"
    elif kind == "no manifest":
        del members["manifest.json"]
    elif kind == "duplicate entries":
        data = json.loads(members["manifest.json"])
        data["body"]["entries"].append(data["body"]["entries"][0])
        data["sha256"] = hashlib.sha256(json.dumps(data["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        members["manifest.json"] = json.dumps(data).encode()


CORRUPTIONS = {
    "flipped byte": "sha256",
    "zero-byte file": "bytes",
    "missing file": "missing",
    "edited manifest": "edited",
    "other target": "targets cuda:100",
    "other triton": "Triton 3.5.1",
    "newer warmreg": "newer warmreg",
    "dotdot member": "unsafe path",
    "absolute member": "unsafe path",
    "no manifest": "no manifest",
    "duplicate entries": "twice",
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_bad_packs_are_refused_and_nothing_is_written(kind: str, built: Path, tmp_path: Path, triton_cache: Path) -> None:
    members = _members(built)
    _corrupt(kind, members)
    bad = tmp_path / "bad.tar"
    _write(bad, members)
    with pytest.raises(PackError, match=CORRUPTIONS[kind]):
        packs.verify(bad, target="cuda:90")
    try:
        report = packs.install(bad, target="cuda:90", all_or_nothing=True)
    except PackError:
        pass
    else:  # pragma: no cover - every corruption above must be refused
        pytest.fail(f"install accepted a pack with a {kind}: {report}")
    assert _entries(triton_cache) == []


def test_truncated_archive(built: Path, tmp_path: Path, triton_cache: Path) -> None:
    cut = tmp_path / "cut.tar.gz"
    packs.build(CONFIG, tmp_path / "full.tar.gz", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    data = (tmp_path / "full.tar.gz").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackError, match="truncated"):
        packs.install(cut)
    assert _entries(triton_cache) == []


def test_partial_install_refuses_only_the_bad_entry(built: Path, tmp_path: Path) -> None:
    members = _members(built)
    _corrupt("flipped byte", members)
    bad = tmp_path / "one-bad.tar"
    _write(bad, members)
    report = packs.install(bad)
    assert report.installed == 2 and len(report.refused) == 1 and "sha256" in report.refused[0][1]


def test_changed_kernel_source_is_refused(built: Path, tmp_path: Path) -> None:
    members = _members(built)
    data = json.loads(members["manifest.json"])
    data["body"]["entries"][0]["source_hash"] = "0" * 64
    data["sha256"] = hashlib.sha256(json.dumps(data["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    members["manifest.json"] = json.dumps(data).encode()
    stale = tmp_path / "stale.tar"
    _write(stale, members)
    report = packs.install(stale)
    assert report.installed == 2 and "changed since the pack was built" in report.refused[0][1]


_WORKER = """
import sys, warmreg
sys.path.insert(0, {root!r})
from tests.helpers import CONFIG, Plugin, Scale
for _ in range(3):
    from warmreg import pack as packs
    packs.install({pack!r})
    r = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=1)
    assert r.ok and r.compiled == 0, r.summary()
print("ok")
"""


def test_eight_processes_install_and_warm_one_cache(built: Path, triton_cache: Path) -> None:
    root = str(Path(__file__).resolve().parents[1])
    code = _WORKER.format(root=root, pack=str(built))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    groups = list(triton_cache.rglob("__grp__*.json"))
    assert len(groups) == 3
    for g in groups:  # every group points at whole files of one writer
        children = json.loads(g.read_text())["child_paths"]
        writers = {Path(p).name.split(".")[-2] for p in children.values()}
        assert len(writers) == 1 and all(Path(p).is_file() and Path(p).stat().st_size > 0 for p in children.values())


def test_cli_build_verify_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from warmreg.cli import main

    cfg = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v4_flash.json"
    out = tmp_path / "flash.tar"
    assert main(["build", str(cfg), "--target", "cuda:90", "-o", str(out)]) == 0
    assert main(["pack", "verify", str(out), "--target", "cuda:90"]) == 0
    assert main(["pack", "inspect", str(out)]) == 0
    assert main(["pack", "verify", str(out), "--target", "rocm:gfx942"]) == 2
    assert "targets cuda:90" in capsys.readouterr().err


def test_crash_mid_install_leaves_no_visible_entry_and_a_rerun_completes(
    built: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = packs._atomic_write
    calls = {"n": 0}

    def dying_write(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # after the first file of the first entry: before its group is published
            raise OSError("simulated crash")
        real_write(path, data)

    monkeypatch.setattr(packs, "_atomic_write", dying_write)
    with pytest.raises(OSError, match="simulated crash"):
        packs.install(built)
    assert list(triton_cache.rglob("__grp__*")) == []  # Triton sees no entry, so nothing half-written
    monkeypatch.setattr(packs, "_atomic_write", real_write)
    assert packs.install(built).installed == 3
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    assert report.compiled == 0 and report.from_cache == 3
