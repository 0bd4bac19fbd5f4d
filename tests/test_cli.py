"""The command line's own answers: its version line, and a config path that is not a config file."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from warmreg.cli.main import main


def test_version_names_warmreg_triton_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"warmreg {version('warmreg')} (Triton {version('triton')}, torch {version('torch')})"


@pytest.mark.parametrize("kind", ["directory", "not UTF-8", "missing", "a JSON list"])
def test_a_config_path_that_is_not_a_config_file_is_one_line_naming_the_file(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "not UTF-8":
        path.write_bytes(b'\xff\xfe{"model": {}}')
    elif kind == "a JSON list":
        path.write_text("[1, 2]")
    assert main(["plan", str(path), "--target", "cuda:90"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: config file '{path}' "), err


def test_an_unknown_model_type_says_where_the_plugins_come_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "llama.json"
    path.write_text('{"model": {"model_type": "llama"}, "serving": {"max_num_batched_tokens": 64}}')
    assert main(["plan", str(path), "--target", "cuda:90"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'llama', which no installed plugin serves" in err and "plugins/" in err and "--find-links DIST warmreg-<family>" in err


def test_report_in_a_new_process_reads_the_key_types_of_installed_plugins(tmp_path: Path) -> None:
    """A warm report names its keys' types (``warmreg_kimi_k3.kda:KDARecurrentKey``); a fresh process
    knows them once the installed plugins are loaded."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    example = Path(__file__).resolve().parents[1] / "examples" / "kimi_k3.json"
    warm_report, records = tmp_path / "warm.json", tmp_path / "misses.jsonl"
    records.write_text("")

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "warmreg", *argv], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)

    assert cli("warm", str(example), "--target", "cuda:90", "--quiet", "--json", str(warm_report)).returncode == 0
    done = cli("report", str(records), "--warm-report", str(warm_report))
    assert done.returncode == 0 and "kimi_k3.kda_recurrent" in done.stdout, done.stderr[-2000:]


class _Typo:
    @__import__("warmreg").hookimpl
    def warmreg_register_kernel(self, registry: object) -> None:  # one letter short of the hook
        raise AssertionError("never called")


class _Unmarked:
    def warmreg_register_kernels(self, registry: object) -> None:  # no @warmreg.hookimpl
        raise AssertionError("never called")


@pytest.mark.parametrize(("plugin", "needle"), [
    (_Typo(), "defines warmreg_register_kernel, which is not a warmreg hook"),
    (_Unmarked(), "registers nothing: warmreg_register_kernels lacks @warmreg.hookimpl"),
    (object(), "registers nothing: it implements no warmreg hook"),
])  # fmt: skip
def test_a_plugin_whose_hooks_would_never_run_is_an_error_naming_it(plugin: object, needle: str) -> None:
    import warmreg
    from tests.helpers import CONFIG

    with pytest.raises(warmreg.PluginError, match=needle):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False)


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    import json

    assert main(["plan", *argv, "--target", "cuda:90", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plain_hugging_face_config_takes_its_serving_settings_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--serving FILE|JSON`` and ``--set key=value`` (VALUE read as JSON, else a string) over the
    config's serving settings; ``serving=`` on plan() and warm() does the same from Python."""
    import json

    import warmreg

    example = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v4_flash.json"
    doc = json.loads(example.read_text())
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(doc["model"]))  # a published config.json: no serving settings
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps(doc["serving"]))
    want = _plan_json(capsys, str(example))
    assert _plan_json(capsys, str(hf), "--serving", str(serving)) == want
    assert _plan_json(capsys, str(hf), "--serving", json.dumps(doc["serving"])) == want
    sets = [a for k, v in doc["serving"].items() for a in ("--set", f"{k}={v}")]
    assert _plan_json(capsys, str(hf), *sets) == want
    fewer = _plan_json(capsys, str(example), "--set", "max_model_len=262144")  # fewer C128 widths
    assert fewer != want and {"schema": "warmreg.plan/1", **warmreg.plan(example, target="cuda:90", serving={"max_model_len": 262144}).to_json()} == fewer
    assert main(["plan", str(hf), "--target", "cuda:90", "--set", "max_model_len=0"]) == 2
    assert "serving.max_model_len" in capsys.readouterr().err


def test_piped_output_keeps_every_name_and_number_whole(tmp_path: Path) -> None:
    """Not a terminal: no table cuts a kernel name, no line wraps mid-number."""
    import os
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v4_flash.json"
    done = subprocess.run([sys.executable, "-m", "warmreg", "plan", str(example), "--target", "cuda:90"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "40"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "warmreg.ops.indexer_prefill_chunk_metadata\t28\tdeepseek_v4" in lines and "75 keys over 21 kernels" in lines
    assert "…" not in done.stdout


def test_build_shows_progress_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib

    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.stages import build as packs_build

    pipeline = importlib.import_module("warmreg.pipeline.run")
    shown: list[tuple[str, int]] = []
    real = pipeline._progress
    monkeypatch.setattr(pipeline, "_progress", lambda show, title, total: (show and shown.append((title, total))) or real(show, title, total))
    packs_build.build(CONFIG, tmp_path / "p", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, progress=True)
    packs_build.build(CONFIG, tmp_path / "q", target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, progress=False)
    assert [total for _, total in shown] == [3] and shown[0][0].startswith("[bold]build[/] cuda:90")  # a build's bar says build


def test_json_means_one_thing_on_every_verb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--json``: the verb's result as JSON on stdout, nothing else there; ``--json FILE``: into FILE."""
    import json

    example = str(Path(__file__).resolve().parents[1] / "examples" / "kimi_k3.json")
    for argv, key in ((["plugins"], "plugins"), (["plan", example, "--target", "cuda:90"], "kernels")):
        assert main([*argv, "--json"]) == 0
        assert key in json.loads(capsys.readouterr().out)
        out = tmp_path / f"{argv[0]}.json"
        assert main([*argv, "--json", str(out)]) == 0
        assert key in json.loads(out.read_text()) and f"JSON written to {out}" in capsys.readouterr().err


def test_a_published_config_json_learns_every_missing_serving_setting_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A published config.json holds no serving settings: one run names every one the plan needs (not one a
    run) and says to give them on the command line, not to edit the published file."""
    import json

    example = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v4_flash.json"
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(json.loads(example.read_text())["model"]))
    assert main(["plan", str(hf), "--target", "cuda:90"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1
    for name in ("attention_backend", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
        assert f"serving.{name}" in lines[0] and f"--set {name}=VALUE" in lines[0]
    assert "config.json holds no serving settings" in lines[0] and "in the 'serving' section" not in lines[0]
    assert main(["plan", str(hf), "--target", "cuda:90", "--set", "max_num_seqs=0"]) == 2  # a wrong value given: itself
    assert "serving.max_num_seqs" in capsys.readouterr().err


def test_build_takes_quiet_as_warm_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from warmreg.stages import build as builds

    seen: list[object] = []
    monkeypatch.setattr(builds, "build", lambda config, output, **kw: seen.append(kw["progress"]) or __import__("sys").exit(0))
    example = str(Path(__file__).resolve().parents[1] / "examples" / "kimi_k3.json")
    for extra, want in (([], None), (["--quiet"], False)):
        with pytest.raises(SystemExit):
            main(["build", example, "--target", "cuda:90", "-o", str(tmp_path / "p.tar"), *extra])
        assert seen.pop() is want


def test_a_warm_after_warmreg_build_in_the_same_cache_compiles_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``warmreg build`` keeps what it built in the process's own Triton cache too (where it is missing)."""
    import json

    example = str(Path(__file__).resolve().parents[1] / "examples" / "kimi_k3.json")
    assert main(["build", example, "--target", "cuda:90", "-o", str(tmp_path / "k.tar"), "--no-launchers", "--quiet"]) == 0
    import warmreg

    warmreg.reset_state()  # as a new process: what the build compiled is on disk, not in memory
    report = tmp_path / "warm.json"
    assert main(["warm", example, "--target", "cuda:90", "--quiet", "--json", str(report)]) == 0
    statuses = {r["status"] for r in json.loads(report.read_text())["results"]}
    assert statuses == {"disk_cache"}, statuses


def test_pack_install_names_each_refused_entry_whole() -> None:
    """A key name longer than a line is printed whole (it was cut at 120 characters, mid-word)."""
    from warmreg.cli.pack import _refusal_lines

    what = "warmreg.ops.indexer_prefill_chunk_metadata " + ", ".join(f"field_{i}=value_{i}" for i in range(12))
    (line,) = _refusal_lines([(what, "source hash differs")])
    assert what in line and line.endswith("source hash differs") and len(what) > 120


@pytest.mark.parametrize(("example", "note"), [("kimi_k3_full.json", True), ("kimi_k3.json", False)])
def test_a_build_without_autotune_choices_says_what_a_warm_from_it_does(
    example: str, note: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cross build of a plan with tuned kernels records no choices unless given ``--tuning``: the build says that a
    warm from the pack will benchmark, and how to build one that carries them."""
    from types import SimpleNamespace

    import triton

    from warmreg.stages import build as builds

    built = SimpleNamespace(entries=(), launchers=(), tuning=(), target="cuda:90", triton_version=triton.__version__)
    monkeypatch.setattr(builds, "build", lambda config, output, **kw: built)
    path = str(Path(__file__).resolve().parents[1] / "examples" / example)
    assert main(["build", path, "--target", "cuda:90", "-o", str(tmp_path / "p.tar"), "--quiet"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert ("no autotune choices for its 5 tuned kernels" in printed and "without --target" in printed) == note
