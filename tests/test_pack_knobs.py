"""Packs that survive Triton's next release: a pack records the environment knobs that enter Triton's cache
key (``TRITON_DEFAULT_FP_FUSION`` first: on by default through Triton 3.9, off from 3.10), and a process
whose knobs differ is refused, naming the knob and the fix, instead of installing a pack of misses; plugin
kernels use no construct a supported or announced Triton release removes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg.stages import build as builds
from warmreg.stages import pack as packs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    out = tmp_path / "pack"
    builds.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, launcher_pythons=[])
    return out


def test_a_pack_records_the_knobs_of_its_build(built: Path) -> None:
    manifest = packs.inspect_pack(built)
    assert manifest.knobs == {"default_fp_fusion": "1"}  # Triton's default through 3.9, nothing else set
    assert json.loads((built / "manifest.json").read_text())["body"]["knobs"] == {"default_fp_fusion": "1"}


@pytest.mark.parametrize("value", ["0", "1", "true"])
def test_a_process_with_other_knobs_is_refused_naming_the_knob(built: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Triton keys its cache on every cache-invalidating variable that is set, so even ``=1`` (fusion on, as
    the unset default) is another key than unset: the refusal names the variable, both states and the fix."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", value)
    shown = {"0": "false", "1": "true"}.get(value, value)  # as Triton reads the variable
    pattern = rf"TRITON_DEFAULT_FP_FUSION unset, this process has TRITON_DEFAULT_FP_FUSION={shown}.*fix: set TRITON_DEFAULT_FP_FUSION"
    with pytest.raises(warmreg.WarmregError, match=pattern):
        packs.install(built, target="cuda:90")
    with pytest.raises(warmreg.WarmregError, match="TRITON_DEFAULT_FP_FUSION"):
        warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)


def test_a_pack_built_with_the_knob_set_serves_the_same_setting_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # Triton 3.10's default, chosen early
    out = tmp_path / "pack"
    builds.build(CONFIG, out, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, launcher_pythons=[])
    assert packs.inspect_pack(out).knobs == {"TRITON_DEFAULT_FP_FUSION": "false", "default_fp_fusion": "0"}
    warmreg.reset_state()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=out)
    assert report.compiled == 0 and report.from_cache == report.declared  # the pack serves every key
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    with pytest.raises(warmreg.WarmregError, match="TRITON_DEFAULT_FP_FUSION=false, this process has TRITON_DEFAULT_FP_FUSION unset"):
        packs.install(out, target="cuda:90")


def test_the_same_knobs_install_and_serve_every_key(built: Path) -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, pack=built)
    assert report.compiled == 0 and report.from_cache == report.declared


def test_a_pack_of_an_older_warmreg_without_knobs_still_installs(built: Path) -> None:
    """Older packs recorded no knobs: their manifest (re-digested without the field) reads and installs."""
    from warmreg.stages.pack_format import Manifest

    path = built / "manifest.json"
    manifest = Manifest.from_json(json.loads(path.read_text()), str(built))
    import attrs

    path.write_text(json.dumps(attrs.evolve(manifest, knobs={}).to_json()))
    assert "knobs" not in json.loads(path.read_text())["body"]
    assert packs.install(built, target="cuda:90").installed == len(manifest.entries)


def test_no_plugin_kernel_uses_what_a_triton_release_removes() -> None:
    """Triton 3.10 removes ``can_reorder=True`` from ``tl.cat``/``tl.reshape``: no kernel of warmreg, its plugins or
    the template may use it (checked in the source, so a new kernel cannot bring it back unseen)."""
    removed = {r"can_reorder\s*=\s*True": "can_reorder=True (removed from tl.cat / tl.reshape in Triton 3.10)"}
    roots = [ROOT / "warmreg", ROOT / "plugins", ROOT / "examples" / "plugin_template"]
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {why}"
        for root in roots for path in root.rglob("*.py") for pattern, why in removed.items()
        for text in [path.read_text()] for m in re.finditer(pattern, text)
    ]  # fmt: skip
    assert found == []
