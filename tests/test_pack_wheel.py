"""Packs as wheels: ``warmreg build --wheel``, installed with pip, found and installed by ``warm()``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from tests.reliability.hostile import Pack
from warmreg import _triton
from warmreg._triton.release import RELEASE
from warmreg.runtime.launch import FAST_TABLES
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs
from warmreg.stages import pack_wheel as _pack_wheel


def _pip_install(wheel: Path, site: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory pip installs wheels into, on sys.path (as a venv's site-packages would be)."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def _warm(target: str = "cuda:90") -> warmreg.WarmReport:
    """A warm as a fresh process would do it: nothing the builds compiled is left in memory."""
    _triton.forget_compiled()
    FAST_TABLES.clear()
    return warmreg.warm(CONFIG, target=target, plugins=[Plugin(Scale())], entry_points=False)


def test_a_pip_installed_pack_wheel_makes_the_next_warm_compile_nothing(tmp_path: Path, site: Path, triton_cache: Path) -> None:
    wheel, manifest = packs_build.build_wheel(CONFIG, tmp_path / "dist", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    name, version = _pack_wheel.wheel_name(manifest), _pack_wheel.wheel_version(manifest)
    assert wheel.name == f"{name}-{version}-py3-none-any.whl" and name.startswith("warmreg_pack_test_cuda90_") and len(manifest.entries) == 3
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        record = whl.read(f"{name}-{version}.dist-info/RECORD").decode()
    assert f"{name}/pack/manifest.json" in names and all(n in record for n in names)
    _pip_install(wheel, site)
    report = _warm()
    assert report.compiled == 0 and report.from_cache == 3, report.summary()
    assert f"pack wheel {name}=={version}: 3 installed" in report.summary()


def test_an_installed_pack_wheel_is_never_imported(tmp_path: Path, site: Path, triton_cache: Path) -> None:
    wheel, manifest = packs_build.build_wheel(CONFIG, tmp_path / "dist", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    _pip_install(wheel, site)
    name = _pack_wheel.wheel_name(manifest)
    (site / name / "__init__.py").write_text("raise SystemExit('a pack wheel was imported')\n")
    assert _warm().compiled == 0 and name not in sys.modules


def test_pack_wheels_for_another_target_or_triton_release_are_skipped_with_the_reason(
    tmp_path: Path, site: Path, triton_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other, other_manifest = packs_build.build_wheel(CONFIG, tmp_path / "dist", target="cuda:80", plugins=[Plugin(Scale())],
                                                    entry_points=False, workers=2)  # fmt: skip
    _pip_install(other, site)
    pack_dir = tmp_path / "old"
    packs_build.build(CONFIG, pack_dir, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    doc = Pack.of({"manifest.json": (pack_dir / "manifest.json").read_bytes()})
    doc.body["triton_version"] = "3.9.0" if RELEASE.series == "3.6" else "3.6.0"
    (pack_dir / "manifest.json").write_bytes(doc.final()["manifest.json"])
    old = packs.inspect_pack(pack_dir)
    _pip_install(_pack_wheel.write_wheel(pack_dir, old, tmp_path / "dist"), site)
    with caplog.at_level(logging.INFO, logger="warmreg.stages.pack"):
        report = _warm()
    assert report.compiled == 3 and report.ok and report.stage("pack")["installed"] == 0  # neither installed a file
    other_name, old_name = _pack_wheel.wheel_name(other_manifest), _pack_wheel.wheel_name(old)
    for text in (" ".join(r.getMessage() for r in caplog.records), report.summary()):  # logged, and in the pack line
        assert f"{other_name}=={_pack_wheel.wheel_version(other_manifest)} skipped: built for cuda:80, this warm is for cuda:90" in text
        assert f"{old_name}=={_pack_wheel.wheel_version(old)} skipped: built with Triton {doc.body['triton_version']}" in text
    assert {s["wheel"].partition("==")[0] for s in report.stage("pack")["skipped"]} == {other_name, old_name}


def test_cli_build_wheel(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "warmreg", "build", str(Path(__file__).parents[1] / "examples" / "kimi_k3.json"), "--target", "cuda:90",
         "-o", str(tmp_path / "dist"), "--wheel"], capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("warmreg_pack_kimi_k3_cuda90_*-py3-none-any.whl")
    keys = warmreg.plan(str(Path(__file__).parents[1] / "examples" / "kimi_k3.json"), target="cuda:90").num_keys
    assert f"wrote{wheel}:{keys}keys" in "".join(done.stdout.split())  # rich wraps long lines when piped
    name, version = wheel.name.split("-")[:2]
    with zipfile.ZipFile(wheel) as whl:
        entry_points = whl.read(f"{name}-{version}.dist-info/entry_points.txt").decode()
        manifest = json.loads(whl.read(f"{name}/pack/manifest.json"))
    assert entry_points.splitlines() == ["[warmreg.packs]", f"{name} = {name}"]
    assert manifest["body"]["model_type"] == "kimi_k3" and manifest["body"]["target"] == "cuda:90"


def _write_wheel(path: Path, files: dict[str, bytes], name: str, version: str, entry_point: str) -> Path:
    """A wheel written by hand: ``files``, its metadata and a RECORD that lists them all."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[{_pack_wheel.GROUP}]\n{name} = {entry_point}\n".encode(),
    }  # fmt: skip
    record = "".join(f"{m},{_pack_wheel._record_hash(d)},{len(d)}\n" for m, d in files.items()) + f"{info}/RECORD,,\n"
    wheel = path / f"{name}-{version}-py3-none-any.whl"
    path.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as whl:
        for member, data in {**files, f"{info}/RECORD": record.encode()}.items():
            whl.writestr(member, data)
    return wheel


def test_an_entry_point_naming_a_subpackage_runs_none_of_its_parents_code(tmp_path: Path, site: Path, triton_cache: Path) -> None:
    """issue 40.11: the pack is found through the distribution's files; finding the spec of
    ``evilpack.sub`` would have executed ``evilpack/__init__.py``"""
    pack_dir = tmp_path / "pack"
    packs_build.build(CONFIG, pack_dir, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    marker = tmp_path / "executed"
    files = {f"evilpack/sub/pack/{p.relative_to(pack_dir).as_posix()}": p.read_bytes() for p in pack_dir.rglob("*") if p.is_file()}
    files["evilpack/__init__.py"] = f"open({str(marker)!r}, 'w').write('ran')\n".encode()
    files["evilpack/sub/__init__.py"] = f"open({str(marker)!r}, 'w').write('ran')\n".encode()
    _pip_install(_write_wheel(tmp_path / "dist", files, "evilpack", "1.0", "evilpack.sub"), site)
    report = _warm()
    assert not marker.exists() and "evilpack" not in sys.modules and "evilpack.sub" not in sys.modules
    assert report.compiled == 0 and "pack wheel evilpack==1.0: 3 installed" in report.summary()


def _break(kind: str, pack: Path) -> str:
    """Damage an installed pack wheel's pack in one way; returns what the reason says."""
    cubin = next(pack.rglob("*.cubin"))
    if kind == "link":
        (pack.parent / "elsewhere.cubin").write_bytes(cubin.read_bytes())
        cubin.unlink()
        cubin.symlink_to(pack.parent / "elsewhere.cubin")
        return "is a link"
    if kind == "truncated binary":
        cubin.write_bytes(cubin.read_bytes()[:10])
        return "the manifest says"
    if kind == "edited manifest":
        doc = json.loads((pack / "manifest.json").read_text())
        doc["body"]["python"] = "2.7"
        (pack / "manifest.json").write_text(json.dumps(doc))
        return "was edited"
    assert kind == "other triton"
    doc = Pack.of({"manifest.json": (pack / "manifest.json").read_bytes()})
    doc.body["triton_version"] = "3.9.0" if RELEASE.series == "3.6" else "3.6.0"
    (pack / "manifest.json").write_bytes(doc.final()["manifest.json"])
    return "built with Triton"


@pytest.mark.parametrize("kind", ["link", "truncated binary", "edited manifest", "other triton"])
def test_every_kind_of_bad_installed_pack_wheel_is_a_logged_skip_named_in_the_pack_line(
    kind: str, tmp_path: Path, site: Path, triton_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 40.14: one policy; a warm never fails for an installed pack wheel it was not asked for"""
    wheel, manifest = packs_build.build_wheel(CONFIG, tmp_path / "dist", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    _pip_install(wheel, site)
    name = f"{_pack_wheel.wheel_name(manifest)}=={_pack_wheel.wheel_version(manifest)}"
    needle = _break(kind, site / _pack_wheel.wheel_name(manifest) / "pack")
    with caplog.at_level(logging.WARNING, logger="warmreg.stages.pack"):
        report = _warm()
    assert report.ok and report.compiled >= 1 and report.stage("pack")["ok"] is True  # not asked for: not a failure
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(name in w and needle in w for w in warnings), warnings
    line = report.stage("pack")["summary"]
    assert f"pack wheel {name}" in line and needle in line, line


def test_pack_wheels_are_named_for_the_model_and_its_keys_and_a_rebuild_upgrades_the_old_one(tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 40.4: not the config file's stem (every HF config is ``config.json``), and a new version per build"""
    from packaging.version import Version

    hf = tmp_path / "hf" / "config.json"
    hf.parent.mkdir()
    hf.write_text(json.dumps(CONFIG))
    common = dict(target="cuda:90", entry_points=False, workers=2, launcher_pythons=[])
    first, m1 = packs_build.build_wheel(str(hf), tmp_path / "dist1", plugins=[Plugin(Scale())], **common)
    second, m2 = packs_build.build_wheel(str(hf), tmp_path / "dist2", plugins=[Plugin(Scale())], **common)
    _, m3 = packs_build.build_wheel(str(hf), tmp_path / "dist3", plugins=[Plugin(Scale(sizes=(16,)))], **common)
    name = _pack_wheel.wheel_name(m1)
    assert name.startswith("warmreg_pack_test_cuda90_") and "config" not in name
    assert _pack_wheel.wheel_name(m2) == name != _pack_wheel.wheel_name(m3)  # same keys, same name; other keys, another
    v1, v2 = _pack_wheel.wheel_version(m1), _pack_wheel.wheel_version(m2)
    assert str(Version(v1)) == v1 and Version(v2) > Version(v1)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True, timeout=120)
    for wheel in (first, second):  # as an image's pip does it: the second replaces the first
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    assert sorted(p.name for p in site_packages.glob(f"{name}-*.dist-info")) == [f"{name}-{v2}.dist-info"]
    monkeypatch.syspath_prepend(str(site_packages))
    report = _warm()
    assert report.compiled == 0 and f"pack wheel {name}=={v2}: 3 installed" in report.summary()
