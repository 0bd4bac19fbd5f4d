"""The committed kernel lists of the vLLM coverage tables (``plugins/FAMILY/vllm_kernels.json``, issue 37) are the
installed vLLM's: ``scripts/vllm_kernel_coverage.py`` lists the same kernels from its source, so a vLLM upgrade that
adds, drops or renames a Triton kernel fails here until the table is regenerated and the kernel mapped.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips without vLLM, or with a vLLM
older than the one the table was generated from (the 0.33 venv).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "regenerate with build/engine-venvs/vllm-0.34/bin/python scripts/vllm_kernel_coverage.py, then map"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_kernel_coverage", ROOT / "scripts" / "vllm_kernel_coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vllm_kernel_coverage", module)
    spec.loader.exec_module(module)
    return module


cov = _script()


@pytest.fixture(scope="module")
def vllm() -> Path:
    """The installed vLLM's package directory, its version checked against the committed tables'."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM: bash scripts/engine-envs.sh test vllm-0.34")
    from packaging.version import Version

    installed = importlib.metadata.version("vllm")
    for family in cov.FAMILIES:
        committed = cov.load_kernels(family)["vllm"]
        if Version(installed) < Version(committed):
            pytest.skip(f"the coverage tables are of vLLM {committed}, this venv has {installed}")
        assert installed == committed, (
            f"plugins/{family}/vllm_kernels.json is of vLLM {committed}, not {installed}: {REGENERATE}"
        )
    return cov.vllm_dir()


@pytest.mark.parametrize("family", list(cov.FAMILIES))
def test_committed_kernels_are_the_installed_vllms(vllm: Path, family: str) -> None:
    committed = cov.load_kernels(family)
    prefixes = cov.FAMILIES[family]
    assert committed["packages"] == [p.relative_to(vllm).as_posix() for p in cov.model_packages(vllm, prefixes)]
    listed = cov.list_kernels(vllm, prefixes)
    added = sorted(set(listed) - set(committed["kernels"]))
    dropped = sorted(set(committed["kernels"]) - set(listed))
    assert listed == committed["kernels"], (
        f"vLLM {committed['vllm']}'s {family} kernels differ from plugins/{family}/vllm_kernels.json "
        f"(new: {added}; gone: {dropped}): {REGENERATE} the new ones in plugins/{family}/vllm_coverage.toml"
    )
    assert len(listed) > 50  # the walk found the packages at all
