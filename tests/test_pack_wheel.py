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
from warmreg.stages import pack_wheel as _pack_wheel
from warmreg.stages import pack as packs
from warmreg.stages import build as packs_build
from warmreg._triton.release import RELEASE
from warmreg.runtime.launch import FAST_TABLES


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
    wheel, manifest = packs_build.build_wheel(CONFIG, tmp_path / "dist", label="scale", target="cuda:90", plugins=[Plugin(Scale())],
                                        entry_points=False, workers=2)  # fmt: skip
    assert wheel.name == "warmreg_pack_scale_cuda90-0.1.0-py3-none-any.whl" and len(manifest.entries) == 3
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        record = whl.read("warmreg_pack_scale_cuda90-0.1.0.dist-info/RECORD").decode()
    assert "warmreg_pack_scale_cuda90/pack/manifest.json" in names and all(n in record for n in names)
    _pip_install(wheel, site)
    report = _warm()
    assert report.compiled == 0 and report.from_cache == 3, report.summary()
    assert "3 installed" in (report.stage("pack").get("summary") or "") and "warmreg_pack_scale_cuda90" in (report.stage("pack").get("summary") or "")


def test_an_installed_pack_wheel_is_never_imported(tmp_path: Path, site: Path, triton_cache: Path) -> None:
    wheel, _ = packs_build.build_wheel(CONFIG, tmp_path / "dist", label="scale", target="cuda:90", plugins=[Plugin(Scale())],
                                 entry_points=False, workers=2)  # fmt: skip
    _pip_install(wheel, site)
    (site / "warmreg_pack_scale_cuda90" / "__init__.py").write_text("raise SystemExit('a pack wheel was imported')\n")
    assert _warm().compiled == 0 and "warmreg_pack_scale_cuda90" not in sys.modules


def test_pack_wheels_for_another_target_or_triton_release_are_skipped_with_the_reason(
    tmp_path: Path, site: Path, triton_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other, _ = packs_build.build_wheel(CONFIG, tmp_path / "dist", label="scale", target="cuda:80", plugins=[Plugin(Scale())],
                                 entry_points=False, workers=2)  # fmt: skip
    _pip_install(other, site)
    pack_dir = tmp_path / "old"
    packs_build.build(CONFIG, pack_dir, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    doc = Pack.of({"manifest.json": (pack_dir / "manifest.json").read_bytes()})
    doc.body["triton_version"] = "3.9.0" if RELEASE.series == "3.6" else "3.6.0"
    (pack_dir / "manifest.json").write_bytes(doc.final()["manifest.json"])
    _pip_install(_pack_wheel.write_wheel(pack_dir, packs.inspect_pack(pack_dir), tmp_path / "dist", "scale_old"), site)
    with caplog.at_level(logging.INFO, logger="warmreg.stages.pack"):
        report = _warm()
    assert report.compiled == 3 and report.stage("pack").get("summary") is None  # neither installed a file
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert "warmreg_pack_scale_cuda80 skipped: built for cuda:80, this warm is for cuda:90" in reasons
    assert f"warmreg_pack_scale_old_cuda90 skipped: built with Triton {doc.body['triton_version']}" in reasons


def test_cli_build_wheel(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "warmreg", "build", str(Path(__file__).parents[1] / "examples" / "kimi_k3.json"), "--target", "cuda:90",
         "-o", str(tmp_path / "dist"), "--wheel"], capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = tmp_path / "dist" / "warmreg_pack_kimi_k3_cuda90-0.1.0-py3-none-any.whl"
    keys = warmreg.plan(str(Path(__file__).parents[1] / "examples" / "kimi_k3.json"), target="cuda:90").num_keys
    assert wheel.exists() and f"wrote{wheel}:{keys}keys" in "".join(done.stdout.split())  # rich wraps long lines when piped
    with zipfile.ZipFile(wheel) as whl:
        entry_points = whl.read("warmreg_pack_kimi_k3_cuda90-0.1.0.dist-info/entry_points.txt").decode()
        manifest = json.loads(whl.read("warmreg_pack_kimi_k3_cuda90/pack/manifest.json"))
    assert entry_points.splitlines() == ["[warmreg.packs]", "warmreg_pack_kimi_k3_cuda90 = warmreg_pack_kimi_k3_cuda90"]
    assert manifest["body"]["model_type"] == "kimi_k3" and manifest["body"]["target"] == "cuda:90"
