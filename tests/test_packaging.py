"""The distributions as a user gets them: wheels built with ``python -m build``, installed with pip into
a bare virtual environment that has nothing but torch, and used from outside the repository.

The bare environment sees no site packages of this one: pip resolves every other dependency (Triton,
attrs, pluggy, rich, numpy) from the distributions' own metadata, so a dependency the code imports
but does not declare fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [ROOT, ROOT / "plugins" / "deepseek_v4", ROOT / "plugins" / "kimi_k3"]
FLASH = ROOT / "examples" / "deepseek_v4_flash.json"
pytestmark = [pytest.mark.slow, pytest.mark.network]  # pip asks the index for torch and build deps


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    for project in DISTRIBUTIONS:
        _run(sys.executable, "-m", "build", "-q", "--outdir", out, project, cwd=out)
    return out


def test_every_distribution_builds_a_wheel_and_an_sdist(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    import sysconfig

    # warmreg carries its C launch path (warmreg/runtime/_cdispatch.c): a wheel for this Python and platform
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert f"warmreg-0.1.0-{tag}-{tag}-{platform}.whl" in names and "warmreg-0.1.0.tar.gz" in names, names
    for stem in ("warmreg_deepseek_v4-0.1.0", "warmreg_kimi_k3-0.1.0"):
        assert f"{stem}-py3-none-any.whl" in names and f"{stem}.tar.gz" in names, names


def test_a_bare_venv_takes_the_plugin_and_runs_the_main_job(dist: Path, tmp_path: Path) -> None:
    """``pip install torch`` then ``pip install --find-links DIST warmreg-deepseek-v4``, nothing else;
    then ``warmreg plugins``, ``plan`` and ``warm`` of the Flash example from the installed files;
    then its pack wheel, pip-installed, makes a warm into a fresh cache compile nothing."""
    import torch

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    py, bindir = venv / "bin" / "python", venv / "bin"
    _run(py, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}", cwd=tmp_path)
    _run(py, "-m", "pip", "install", "-q", "--find-links", dist, "warmreg-deepseek-v4", cwd=tmp_path)
    _run(py, "-m", "pip", "check", cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    where = _run(py, "-c", "import sys, warmreg; print(warmreg.__file__, 'torch' in sys.modules)", cwd=tmp_path, env=env).split()
    assert where[0].startswith(str(venv)) and where[1] == "False"  # the installed files, and no torch for `import warmreg`
    assert "deepseek_v4" in _run(bindir / "warmreg", "plugins", cwd=tmp_path, env=env)
    assert "75 keys over 21 kernels" in _run(bindir / "warmreg", "plan", FLASH, "--target", "cuda:90", cwd=tmp_path, env=env)
    report = tmp_path / "flash.json"
    _run(bindir / "warmreg", "warm", FLASH, "--target", "cuda:90", "--quiet", "--json", report, cwd=tmp_path, env=env)
    results = json.loads(report.read_text())["results"]
    assert len(results) == 75 and all(r["status"] == "compiled" for r in results)
    # the same job from a pack wheel, installed the same way: a fresh cache, nothing compiles
    _run(bindir / "warmreg", "build", FLASH, "--target", "cuda:90", "-o", tmp_path / "packs", "--wheel", cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "packs").glob("warmreg_pack_deepseek_v4_cuda90_*.whl")  # model type, target, digest of the keys
    _run(py, "-m", "pip", "install", "-q", wheel, cwd=tmp_path)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "fresh-cache")
    _run(bindir / "warmreg", "warm", FLASH, "--target", "cuda:90", "--quiet", "--json", report, cwd=tmp_path, env=env)
    results = json.loads(report.read_text())["results"]
    assert len(results) == 75 and all(r["status"] == "disk_cache" for r in results), {r["status"] for r in results}
    # the plugin template installs the same way, its core from the same wheelhouse
    template = tmp_path / "plugin_template"  # a copy: pip leaves build/ and *.egg-info in what it builds
    shutil.copytree(ROOT / "examples" / "plugin_template", template, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    _run(py, "-m", "pip", "install", "-q", "--find-links", dist, template, cwd=tmp_path)
    _run(py, "-m", "pip", "check", cwd=tmp_path)
    assert "template" in _run(bindir / "warmreg", "plugins", cwd=tmp_path, env=env)
