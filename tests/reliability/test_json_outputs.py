"""``--json``: one vocabulary on every verb, and an output that never replaces an input or a file that is not
warmreg's (issue 40: ``warmreg plan --json a.json b.json`` replaced the config ``a.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.hostile import assert_refused, run_cli

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "examples" / "kimi_k3.json"


def test_json_never_replaces_the_config_it_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "a.json"
    config.write_text(KIMI.read_text())
    before = config.read_bytes()
    assert_refused(run_cli(capsys, "plan", str(config), "--target", "cuda:90", "--json", str(config)), r"--json .*a\.json is an input")
    assert config.read_bytes() == before


def test_json_never_replaces_a_file_that_is_not_a_warmreg_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --json a.json b.json``: argparse takes a.json as the output; it is someone's file, kept."""
    other = tmp_path / "a.json"
    other.write_text('{"model": {"model_type": "kimi_k3"}}')
    before = other.read_bytes()
    assert_refused(run_cli(capsys, "plan", "--json", str(other), str(KIMI), "--target", "cuda:90"), "not a warmreg JSON output")
    assert other.read_bytes() == before


def test_json_replaces_an_earlier_warmreg_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert run_cli(capsys, "plan", str(KIMI), "--target", "cuda:90", "--json", str(out)).code == 0
    assert run_cli(capsys, "plan", str(KIMI), "--target", "cuda:90", "--json", str(out)).code == 0
    assert json.loads(out.read_text())["schema"] == "warmreg.plan/1"


def _doc(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    outcome = run_cli(capsys, *argv, "--json")
    assert outcome.code == 0, outcome.text
    return json.loads(outcome.text[: outcome.text.rindex("}") + 1])


def test_every_verb_speaks_one_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``schema`` names the verb; ``plugins`` are names, ``plugin_problems`` ``{plugin, reason}``, ``skipped``
    ``{kernel, plugin, reason}`` wherever they appear; ``plugins`` also names each distribution and version."""
    plugins = _doc(capsys, "plugins")
    assert plugins["schema"] == "warmreg.plugins/1" and "problems" not in plugins and plugins["plugin_problems"] == []
    dists = {d["plugin"]: d for d in plugins["distributions"]}  # type: ignore[union-attr,index]
    assert dists["kimi_k3"]["distribution"] == "warmreg-kimi-k3" and dists["kimi_k3"]["version"]
    plan = _doc(capsys, "plan", str(ROOT / "examples" / "deepseek_v4_pro.json"), "--target", "cuda:90")
    warm = _doc(capsys, "warm", str(ROOT / "examples" / "deepseek_v4_pro.json"), "--target", "cuda:90", "--quiet")
    assert plan["schema"] == "warmreg.plan/1" and warm["schema"] == "warmreg.warm/1"
    for doc in (plan, warm):
        assert all(isinstance(p, str) for p in doc["plugins"])  # type: ignore[union-attr]
        assert doc["skipped"] and all(set(s) == {"kernel", "plugin", "reason"} for s in doc["skipped"])  # type: ignore[union-attr]
        assert all(set(p) == {"plugin", "reason"} for p in doc["plugin_problems"])  # type: ignore[union-attr]
    pack = tmp_path / "kimi.tar"
    assert run_cli(capsys, "build", str(KIMI), "--target", "cuda:90", "-o", str(pack), "--no-launchers", timeout=120).code == 0
    inspected = _doc(capsys, "pack", "inspect", str(pack))
    assert inspected["schema"] == "warmreg.pack/1" and inspected["model_type"] == "kimi_k3" and "body" not in inspected
    assert inspected["target"] == "cuda:90" and len(inspected["entries"]) == 19 and inspected["sha256"]  # type: ignore[arg-type]
