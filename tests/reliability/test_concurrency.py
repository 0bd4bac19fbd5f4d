"""Concurrency: 8 processes x 50 rounds of warm and pack install into one shared cache directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CONFIG, Plugin, Scale
from warmreg.stages import build as packs_build

ROOT = Path(__file__).resolve().parents[2]

_WORKER = """
import sys
sys.path.insert(0, {root!r})
import warmreg
from warmreg import _triton
from warmreg.stages import pack as packs
from warmreg.stages import build as packs_build
from tests.helpers import CONFIG, Plugin, Scale
plugin = Plugin(Scale(), Scale(block=128))
for round in range(50):
    packs.install({pack!r})
    _triton.forget_compiled()  # every round reads the shared cache again, as a fresh replica would
    r = warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False, workers=1)
    assert r.ok and r.compiled == 0, (round, r.summary())
print("ok")
"""


def test_eight_processes_fifty_rounds(tmp_path: Path, triton_cache: Path) -> None:
    """8 processes x 50 rounds of pack install and warm on one cache: zero errors, every entry read back is whole"""
    pack = tmp_path / "p.tar"
    packs_build.build(CONFIG, pack, target="cuda:90", plugins=[Plugin(Scale(), Scale(block=128))], entry_points=False)
    code = _WORKER.format(root=str(ROOT), pack=str(pack))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=900) for p in procs]
    failures = [o[1][-1500:] for p, o in zip(procs, outs) if p.returncode != 0]
    assert not failures, failures
    groups = list(triton_cache.rglob("__grp__*.json"))
    assert len(groups) == 6
    for group in groups:  # each group is one writer's whole set of files
        children = json.loads(group.read_text())["child_paths"]
        writers = {Path(p).name.rsplit(".", 2)[-2] for p in children.values()}
        assert len(writers) == 1 and all(Path(p).stat().st_size > 0 for p in children.values())


pytestmark = pytest.mark.slow
