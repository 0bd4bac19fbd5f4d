"""Packs: build on this CPU-only machine, verify, refuse bad packs without writing, install, warm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs
from warmreg.stages.pack import PackError


@pytest.fixture
def built(tmp_path: Path) -> Path:
    out = tmp_path / "scale.tar"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    return out


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


def test_build_install_then_warm_compiles_nothing(built: Path, triton_cache: Path) -> None:
    manifest = packs.verify(built, target="cuda:90")
    assert len(manifest.entries) == 3 and manifest.triton_version and manifest.ptxas_version
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    assert report.compiled == 0 and report.from_cache == 3 and "3 installed" in (report.stage("pack").get("summary") or "")
    again = packs.install(built)
    assert again.installed == 0 and again.present == 3


@pytest.mark.parametrize("fmt", ["dir", "scale.zip", "scale.tar.gz"])
def test_formats(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / ("pack" if fmt == "dir" else fmt)
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False)
    assert packs.install(out).installed == 1
    with pytest.raises(PackError, match="already exists"):
        packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False)


def test_a_pack_prefetched_is_installed_before_the_warm_and_the_warm_installs_nothing(
    built: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmreg.prefetch(pack=built)  # as an engine does at start-up, before loading its weights
    monkeypatch.setattr(packs, "install", lambda *a, **k: pytest.fail("the warm installed the pack again"))
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    assert report.compiled == 0 and report.from_cache == 3
    assert "3 installed, 0 present, 0 refused" in (report.stage("pack").get("summary") or "") and "(at prefetch)" in (report.stage("pack").get("summary") or "")
    assert len(list(triton_cache.rglob("__grp__*.json"))) == 3


def test_a_prefetched_pack_makes_the_binders_its_warm_binds_with(built: Path, triton_cache: Path) -> None:
    """The prefetch makes Triton's binder of the pack's functions for the pack's target; the warm's binding takes it
    (the function had none for that device), as ``create_binder`` would have made it."""
    from tests.helpers import _scale_kernel
    from warmreg import _triton
    from warmreg._triton import compiler as _compiler
    from warmreg._triton.target import _device_id
    from warmreg.values.platform import Platform

    sm90, device = _triton.gpu_target(Platform.parse("cuda:90")), _device_id(Platform.parse("cuda:90"))
    saved = _scale_kernel.device_caches.pop(device, None)  # as in a fresh process: no binder for the device yet
    try:
        warmreg.prefetch(pack=built)
        for pending in list(packs._PREFETCHED.values()):  # the install (and the binders) done, as while an engine loads
            assert pending.exception() is None, f"the prefetch did not install the pack: {pending.exception()!r}"
        backend, binder = _compiler._binders[(_scale_kernel, sm90)]
        report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
        assert report.compiled == 0 and report.from_cache == 3
        assert _scale_kernel.device_caches[device][2:] == (sm90, backend, binder) and (_scale_kernel, sm90) not in _compiler._binders
    finally:
        _compiler._binders.pop((_scale_kernel, sm90), None)
        if saved is not None:
            _scale_kernel.device_caches[device] = saved


def test_binders_that_cannot_be_made_cost_the_prefetch_nothing(built: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("no binder")

    monkeypatch.setattr(packs._triton, "prepare_binders", fail)
    warmreg.prefetch(pack=built)
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    assert report.compiled == 0 and "(at prefetch)" in (report.stage("pack").get("summary") or "")


def test_a_prefetched_pack_is_not_taken_for_another_cache_or_target(
    built: Path, triton_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warmreg.prefetch(pack=built)  # into triton_cache, for the pack's own target (cuda:90)
    with pytest.raises(PackError, match="targets cuda:90, this warm targets cuda:80"):  # as without the prefetch
        warmreg.warm(CONFIG, target="cuda:80", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    warmreg.prefetch(pack=built)  # a prefetch is used once: the next warm waits for this one
    other = tmp_path / "other-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(other))  # the engine moved its cache after the prefetch
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    # the warm waited for the prefetch (which wrote nowhere, or whole entries, wherever the variable
    # pointed as it went), then installed the pack into the cache it uses
    assert report.compiled == 0 and "(at prefetch)" not in (report.stage("pack").get("summary") or "") and "0 refused" in (report.stage("pack").get("summary") or "")
    assert len(list(other.rglob("__grp__*.json"))) == 3 and not list(other.rglob("*.tmp.*"))


def test_a_pack_the_prefetch_cannot_install_fails_the_warm_as_without_it(tmp_path: Path, triton_cache: Path) -> None:
    missing = tmp_path / "nowhere.tar.gz"
    warmreg.prefetch(pack=missing)  # returns at once; the error is the warm's to report
    with pytest.raises(PackError, match=r"nowhere\.tar\.gz"):
        warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=missing)
    assert not _entries(triton_cache)


_WORKER = """
import sys, warmreg
sys.path.insert(0, {root!r})
from tests.helpers import CONFIG, Plugin, Scale
for _ in range(3):
    from warmreg.stages import pack as packs
    from warmreg.stages import build as packs_build
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
    from warmreg.cli.main import main

    cfg = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v4_flash.json"
    out = tmp_path / "flash.tar"
    assert main(["build", str(cfg), "--target", "cuda:90", "-o", str(out)]) == 0
    assert main(["pack", "verify", str(out), "--target", "cuda:90"]) == 0
    assert main(["pack", "inspect", str(out)]) == 0
    assert main(["pack", "verify", str(out), "--target", "rocm:gfx942"]) == 2
    assert "targets cuda:90" in capsys.readouterr().err


def test_a_pack_of_another_triton_release_is_refused_in_one_line_naming_both(tmp_path: Path, triton_cache: Path) -> None:
    import triton

    from warmreg.stages import pack_format as _pack_format

    out = tmp_path / "pack"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False, launcher_pythons=[])
    doc = json.loads((out / "manifest.json").read_text())
    other = "3.7.1" if not triton.__version__.startswith("3.7") else "3.8.0"
    body = {**doc["body"], "triton_version": other}
    (out / "manifest.json").write_text(json.dumps({"body": body, "sha256": _pack_format._sha256(_pack_format._canonical(body))}))
    for action in (packs.install, packs.verify):
        with pytest.raises(PackError) as info:
            action(out)
        assert f"was built with Triton {other}, this machine has {triton.__version__}" in str(info.value)
        assert "\n" not in str(info.value)
    assert not _entries(triton_cache)


def test_build_of_a_config_no_kernel_serves_names_the_model_type_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "p.tar.gz"
    with pytest.raises(PackError, match="no kernel declares a key for model_type 'nobody'") as info:
        packs_build.build({**CONFIG, "model": {"model_type": "nobody"}}, out, target="cuda:90", entry_points=False)
    assert "warmreg plugins" in str(info.value) and not out.exists()


def test_a_build_after_a_warm_compiles_nothing_the_warm_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build seeds its empty cache with the process cache's entries (stages/seed.py): nothing compiles
    again, and the pack is as whole as a cold build's (a fresh cache warms from it compiling nothing)."""
    import triton

    warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    misses: list[bool] = []
    previous = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = lambda *, cache_hit, **_: misses.append(cache_hit)
    try:
        warmreg.reset_state()
        manifest = packs_build.build(CONFIG, tmp_path / "p", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, launcher_pythons=[])
    finally:
        triton.knobs.compilation.listener = previous
    assert len(manifest.entries) == 3 and misses == [True, True, True]  # three keys, each a hit: none compiled
    warmreg.reset_state()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=tmp_path / "p")
    assert report.compiled == 0 and report.from_cache == 3 and "3 installed" in report.stage("pack")["summary"]
