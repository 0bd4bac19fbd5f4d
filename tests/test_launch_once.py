"""A key's launch code runs once per warm, on every branch: local, with a pack, distributed, pack build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import warmreg
from tests.helpers import CONFIG, CountedScale, Plugin
from warmreg.stages import build as packs_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def counted() -> type[CountedScale]:
    CountedScale.calls.clear()
    return CountedScale


def _plugin() -> Plugin:
    return Plugin(CountedScale(block=32), CountedScale(block=64))


def test_local_warm_runs_each_launch_code_once(counted: type[CountedScale]) -> None:
    for workers in (1, 2):
        counted.calls.clear()
        report = warmreg.warm(CONFIG, target="cuda:90", plugins=[_plugin()], entry_points=False, workers=workers)
        assert report.declared == 6 and sorted(counted.calls.values()) == [1] * 6


def test_pack_build_and_a_warm_from_it_run_each_launch_code_once(counted: type[CountedScale], tmp_path: Path) -> None:
    packs_build.build(CONFIG, tmp_path / "p", target="cuda:90", plugins=[_plugin()], entry_points=False, workers=2)
    assert sorted(counted.calls.values()) == [1] * 6
    counted.calls.clear()
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[_plugin()], entry_points=False, pack=tmp_path / "p")
    assert report.from_cache == 6 and "6 installed" in (report.stage("pack").get("summary") or "")
    assert sorted(counted.calls.values()) == [1] * 6


_RANK = """
import json, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import warmreg
from tests.helpers import CONFIG, CountedScale, Plugin
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank={rank}, world_size=2)
runs = []
for _ in range(2):  # the exchange, then the fast path (every key cached on every rank)
    CountedScale.calls.clear()
    r = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(CountedScale(block=32), CountedScale(block=64))],
                     entry_points=False, workers=1)
    runs.append({{"ok": r.ok, "world": r.stage("shard").get("world_size", 1), "calls": sorted(CountedScale.calls.values())}})
dist.destroy_process_group()
print(json.dumps(runs))
"""


def test_distributed_warm_runs_each_launch_code_once_on_every_rank(tmp_path: Path) -> None:
    from tests.test_distributed import _free_port

    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK.format(root=str(ROOT), port=port, rank=r)],
            env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"rank{r}")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    for out, _err in outs:
        for run in json.loads(out.strip().splitlines()[-1]):
            assert run["ok"] and run["world"] == 2 and run["calls"] == [1] * 6
