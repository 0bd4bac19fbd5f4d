"""Bad packs are refused with a message that says which and why, and nothing is written to the cache;
a crash mid-install leaves no half-written entry visible."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs
from warmreg.stages import pack_install as _pack_install
from warmreg.stages.pack import PackError


@pytest.fixture
def built(tmp_path: Path) -> Path:
    out = tmp_path / "scale.tar"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    return out


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


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
    """a corrupt or mismatched pack is refused with a message saying which and why; nothing is written"""
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
    """a truncated archive is refused; nothing is written"""
    cut = tmp_path / "cut.tar.gz"
    packs_build.build(CONFIG, tmp_path / "full.tar.gz", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    data = (tmp_path / "full.tar.gz").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackError, match="truncated"):
        packs.install(cut)
    assert _entries(triton_cache) == []


def test_partial_install_refuses_only_the_bad_entry(built: Path, tmp_path: Path) -> None:
    """one corrupt entry is refused, the rest of the pack installs (without all_or_nothing)"""
    members = _members(built)
    _corrupt("flipped byte", members)
    bad = tmp_path / "one-bad.tar"
    _write(bad, members)
    report = packs.install(bad)
    assert report.installed == 2 and len(report.refused) == 1 and "sha256" in report.refused[0][1]


def test_changed_kernel_source_is_refused(built: Path, tmp_path: Path) -> None:
    """an entry whose kernel source changed since the build is refused"""
    members = _members(built)
    data = json.loads(members["manifest.json"])
    data["body"]["entries"][0]["source_hash"] = "0" * 64
    data["sha256"] = hashlib.sha256(json.dumps(data["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    members["manifest.json"] = json.dumps(data).encode()
    stale = tmp_path / "stale.tar"
    _write(stale, members)
    report = packs.install(stale)
    assert report.installed == 2 and "changed since the pack was built" in report.refused[0][1]




def test_crash_mid_install_leaves_no_half_written_entry_and_a_rerun_completes(
    built: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a crash mid-install leaves no half-written entry visible (others, published in parallel, are whole), and a re-run completes"""
    real_write = _pack_install.atomic_write
    calls = {"n": 0}

    def dying_write(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # after the first file of the first entry: before its group is published
            raise OSError("simulated crash")
        real_write(path, data)

    monkeypatch.setattr(_pack_install, "atomic_write", dying_write)
    with pytest.raises(warmreg.CacheError, match="simulated crash"):
        packs.install(built)
    # entries are published in parallel: others may be whole and visible, the one that died is not
    groups = list(triton_cache.rglob("__grp__*"))
    assert len(groups) < 3
    for group in groups:  # every entry Triton can see is whole
        children = json.loads(group.read_text())["child_paths"]
        assert children and all(Path(p).is_file() for p in children.values())
    monkeypatch.setattr(_pack_install, "atomic_write", real_write)
    rerun = packs.install(built)
    assert rerun.installed == 3 - len(groups) and rerun.present == len(groups)
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    assert report.compiled == 0 and report.from_cache == 3
