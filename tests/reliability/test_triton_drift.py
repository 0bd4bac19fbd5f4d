"""Triton version drift: the newest Triton on PyPI, in a virtual environment beside this one (asks the
package index: run with ``--network``, as CI does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import venv_beside

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.network]


@pytest.fixture(scope="module")
def newest_triton(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    python = venv_beside(tmp_path_factory.mktemp("drift") / "venv")
    got = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "--no-deps", "triton"], capture_output=True, text=True, timeout=600
    )
    if got.returncode != 0:
        pytest.skip(f"cannot install the newest Triton here: {got.stderr.strip().splitlines()[-1:]}")
    version = subprocess.run([str(python), "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True, check=True)
    return python, version.stdout.strip()


def test_newest_triton_plans_if_supported_else_is_refused_in_one_line(newest_triton: tuple[Path, str]) -> None:
    """the newest Triton release plans if supported, else is refused in one line (CLI exit 2)"""
    from warmreg._triton.release import SUPPORTED_TRITON

    python, version = newest_triton
    done = subprocess.run(
        [str(python), "-m", "warmreg", "plan", str(ROOT / "examples" / "deepseek_v4_flash.json"), "--target", "cuda:90"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "WARMREG_ALLOW_UNSUPPORTED_TRITON": "0"},
    )  # fmt: skip
    if ".".join(version.split(".")[:2]) in SUPPORTED_TRITON:
        assert done.returncode == 0, done.stderr
        return
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"Triton {version} is not supported" in lines[0] and "Traceback" not in done.stderr


def test_adapter_internals_on_the_newest_triton(newest_triton: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    """the adapter's per-internal tests run on the newest Triton release too, naming what moved (informational)"""
    python, version = newest_triton
    done = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_triton_adapter.py")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    moved = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    with capsys.disabled():
        print(f"\nTriton {version}: {len(moved)} adapter checks moved: {moved}")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    assert "passed" in summary or "failed" in summary, summary  # the suite ran; what moved is reported above
