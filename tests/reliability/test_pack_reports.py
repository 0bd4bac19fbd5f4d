"""What a pack did is one line of every warm's output and of ``summary()``, a structured ``pack``
section in the report, and (CLI) exit code 1 when the pack the user asked for could not serve."""

from __future__ import annotations

import functools
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg import _triton
from warmreg.api import warm as api_warm
from warmreg.cli.main import main
from warmreg.runtime.launch import FAST_TABLES
from warmreg.stages import build as packs_build
from warmreg.stages import pack as packs


@pytest.fixture
def built(tmp_path: Path) -> Path:
    out = tmp_path / "scale"
    packs_build.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2, launcher_pythons=[])
    return out


def _truncate_a_cubin(pack: Path) -> str:
    """Cut one binary in half (the manifest still names its full size); returns the entry's kernel."""
    cubin = next(pack.rglob("*.cubin"))
    cubin.write_bytes(cubin.read_bytes()[: cubin.stat().st_size // 2])
    return "tests.scale"


def _warm(pack: Path) -> warmreg.WarmReport:
    _triton.forget_compiled()
    FAST_TABLES.clear()
    return warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=pack)


def _cli_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], pack: Path, *more: str) -> tuple[int, str, str]:
    """``warmreg warm`` of the test config with the test plugin (not an installed entry point)."""
    monkeypatch.setattr(api_warm, "warm", functools.partial(api_warm.warm, plugins=[Plugin(Scale())], entry_points=False))
    config = tmp_path / "test-config.json"
    config.write_text(json.dumps(CONFIG))
    _triton.forget_compiled()
    FAST_TABLES.clear()
    capsys.readouterr()
    code = main(["warm", str(config), "--target", "cuda:90", "--quiet", "--pack", str(pack), *more])
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())  # rich wraps long lines when piped


def test_a_warm_says_what_its_pack_did_in_one_line_and_a_structured_section(built: Path, triton_cache: Path) -> None:
    first = _warm(built)
    assert first.compiled == 0 and first.from_cache == 3
    assert f"pack {built}: 3 installed, 0 present, 0 refused, serves 3 of 3 keys" in first.summary()
    section = first.stage("pack")
    assert section["ok"] is True and section["installed"] == 3 and section["present"] == 0 and section["refused"] == []
    (one,) = section["packs"]
    assert (one["pack"], one["wheel"], one["installed"], one["present"], one["refused"], one["serves"], one["problem"]) == (
        str(built), None, 3, 0, [], 3, None,
    )  # fmt: skip
    again = _warm(built)
    assert f"pack {built}: 0 installed, 3 present, 0 refused, serves 3 of 3 keys" in again.summary()
    json.dumps(again.to_json())  # the section is JSON values


def test_a_pack_with_a_truncated_binary_says_which_entry_and_why_and_fails_the_cli(
    built: Path, tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = _truncate_a_cubin(built)
    report = _warm(built)
    assert report.compiled == 1 and report.from_cache == 2 and report.ok  # the key it could not serve compiled
    assert "2 installed, 0 present, 1 refused, serves 2 of 3 keys" in report.summary()
    assert "refused 1 entry this warm needs" in report.summary() and "the manifest says" in report.summary()
    section = report.stage("pack")
    (refusal,) = section["packs"][0]["refused"]
    assert set(refusal) == {"entry", "reason"} and refusal["entry"].startswith(kernel) and "the manifest says" in refusal["reason"]
    assert not refusal["reason"].startswith("pack ")  # the pack is named once, beside the list
    assert section["ok"] is False and section["refused"] == [{"pack": str(built), **refusal}]
    shutil.rmtree(triton_cache)
    code, out, err = _cli_warm(tmp_path, monkeypatch, capsys, built)
    assert code == 1 and "1 refused" in out and f"pack {built} could not serve this warm: refused 1 entry this warm needs" in err, (out, err)
    code, out, _ = _cli_warm(tmp_path, monkeypatch, capsys, built, "--json")
    assert code == 1 and json.loads(out)["stages"]["pack"]["packs"][0]["refused"][0]["entry"] == refusal["entry"]


def test_a_pack_of_another_model_serves_none_and_fails_the_cli(
    tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """as a Kimi-K3 pack given to a warm of the Flash config: the shared kernel's entries install, none is a key of this warm"""
    other = tmp_path / "other"
    packs_build.build({**CONFIG, "model": {"model_type": "other"}}, other, target="cuda:90", plugins=[Plugin(Scale(block=128))],
                      entry_points=False, workers=2, launcher_pythons=[])  # fmt: skip
    report = _warm(other)
    assert report.compiled == 3 and report.stage("pack")["ok"] is False
    line = report.stage("pack")["summary"]
    assert "serves 0 of 3 keys" in line and "built for model_type 'other', this warm is for 'test'" in line
    code, out, err = _cli_warm(tmp_path, monkeypatch, capsys, other)
    assert code == 1 and "serves 0 of 3 keys" in out and "could not serve this warm" in err, (out, err)


def test_the_cli_shows_the_pack_line_and_exits_0_when_the_pack_served(
    built: Path, tmp_path: Path, triton_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _cli_warm(tmp_path, monkeypatch, capsys, built)
    assert code == 0 and f"pack {built}: 3 installed, 0 present, 0 refused, serves 3 of 3 keys" in out and "could not serve" not in err


def test_concurrent_forced_builds_of_one_directory_pack_both_succeed_and_leave_nothing_beside_it(built: Path, tmp_path: Path) -> None:
    """issue 40.13: publishers of two different packs racing on one output directory all succeed, a
    reader between them always reads one whole pack, and nothing is left beside the output"""
    other = tmp_path / "other"
    packs_build.build(CONFIG, other, target="cuda:90", plugins=[Plugin(Scale(block=128))], entry_points=False, workers=2, launcher_pythons=[])
    out = tmp_path / "site" / "pack"
    out.parent.mkdir()
    shutil.copytree(built, out)
    jits = {_triton.full_name(Scale.jit): Scale.jit}
    errors: list[BaseException] = []
    reads: list[int] = []
    done = threading.Event()

    def publish(n: int) -> None:
        try:
            for i in range(8):
                staged = tmp_path / f"staged-{n}"
                shutil.copytree(built if (n + i) % 2 else other, staged)
                packs_build._publish_pack(staged, out, force=True)
                shutil.rmtree(staged)
                time.sleep(0.01)  # a build takes seconds: readers get turns between publishes
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        while not done.is_set():
            try:
                assert len(packs.verify(out, jits=jits).entries) == 3
                reads.append(1)
            except BaseException as exc:
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    done.set()
    reader.join()
    assert not errors, errors[:3]
    assert len(reads) >= 5  # the reader read while the packs were replaced
    assert sorted(p.name for p in out.parent.iterdir()) == ["pack"]
    assert len(packs.inspect_pack(out).entries) == 3


def test_a_build_without_force_racing_another_is_refused_cleanly(built: Path, tmp_path: Path) -> None:
    """the output appeared after the build checked it (another build published it meanwhile)"""
    out = tmp_path / "o" / "pack"
    out.parent.mkdir()
    packs_build._publish_pack(built, out, force=False)
    with pytest.raises(packs.PackError, match="already exists"):
        packs_build._publish_pack(built, out, force=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["pack"] and len(packs.inspect_pack(out).entries) == 3
