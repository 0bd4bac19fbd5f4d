"""The command line's own answers: its version line, and a config path that is not a config file."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from warmreg.cli import main


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
