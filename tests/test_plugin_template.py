"""The plugin template, installed like a published plugin: in a fresh virtual environment, found by
warmreg through its entry point, planned and cross-compiled through the ``warmreg`` command line.

The venv is made with ``--system-site-packages`` so that torch, Triton, warmreg (and pytest) come
from this interpreter's site-packages: nothing is downloaded, the test runs offline, and the only
thing the venv adds is the template itself, installed with pip exactly as a user would install a
``warmreg-<family>`` distribution (``--no-build-isolation --no-deps``: no index is consulted, the
system setuptools builds the wheel). pip itself also comes from the system site (``--without-pip``
saves the seconds ``ensurepip`` takes); run as ``<venv>/bin/python -m pip`` it installs into the
venv, whose prefix is the running interpreter's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugin_template"
KERNEL = "warmreg_template.scaled_add"
CONFIG = {
    "model": {"model_type": "template_llm", "hidden_size": 256},
    "serving": {"max_num_batched_tokens": 128, "dtype": "bfloat16"},
}


def _run(python: Path, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(python), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_template_installs_plans_and_warms_through_the_cli(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    source = tmp_path / "plugin_template"  # build from a copy: pip leaves build/ and *.egg-info behind
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)

    pip_install = ("-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps")
    _run(python, *pip_install, str(source), env=env, cwd=tmp_path)
    config = tmp_path / "template_llm.json"
    config.write_text(json.dumps(CONFIG))

    cli = ("-m", "warmreg")
    plan = json.loads(
        _run(python, *cli, "plan", str(config), "--target", "cuda:90", "--json", env=env, cwd=tmp_path).stdout
    )
    assert "template" in plan["plugins"]
    (kernel,) = [k for k in plan["kernels"] if k["name"] == KERNEL]
    assert kernel["plugins"] == ["template"]
    planned = [key["fields"] for key in kernel["keys"]]
    assert planned == [
        {
            "dtype": "bfloat16", "y_dtype": "bfloat16", "hidden": 256, "block_size": 1024, "y_row_stride": "div16",
            "x_aligned": True, "y_aligned": True, "num_warps": 4,
        }
    ]  # fmt: skip

    report_path = tmp_path / "report.json"
    warm_args = ("warm", str(config), "--target", "cuda:90", "--workers", "1", "--quiet", "--json", str(report_path))
    _run(python, *cli, *warm_args, env=env, cwd=tmp_path)
    report = json.loads(report_path.read_text())
    results = [r for r in report["results"] if r["kernel"] == KERNEL]
    assert [r["key"]["fields"] for r in results] == planned
    assert all(r["status"] == "compiled" and not r["error"] for r in results), results

    # The template's own tests (reference under the interpreter, coverage, warm) pass where it is installed.
    _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests"), env=env, cwd=source)
