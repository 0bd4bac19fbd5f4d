"""Distributed warm over gloo on the CPU (cross-compiling for cuda:90): 2 and 4 ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_RANK = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import warmreg
from tests.helpers import CONFIG, Broken, Plugin, Scale
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank={rank}, world_size={world})
kernels = [Scale(block=b) for b in (32, 64, 128, 256)] + ([Broken()] if {broken} else [])
plugin = Plugin(*kernels)
out = []
for _ in range(2):  # the second warm finds every key cached on every rank: nothing is exchanged
    r = warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False, workers=1, on_error="continue")
    out.append({{"ok": r.ok, "declared": r.declared, "compiled": r.compiled, "from_cache": r.from_cache,
                "shard_compiled": r.shard_compiled, "shard_received": r.shard_received, "world": r.world_size,
                "failed": [f.error for f in r.failed]}})
dist.destroy_process_group()
print(json.dumps(out))
"""

_SINGLE = """
import sys
sys.path.insert(0, {root!r})
import warmreg
from tests.helpers import CONFIG, Plugin, Scale
r = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(*(Scale(block=b) for b in (32, 64, 128, 256)))], entry_points=False, distributed=False)
assert r.ok and r.compiled == 12, r.summary()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(world: int, tmp_path: Path, *, broken: bool = False) -> tuple[list[Path], list[list[dict]]]:
    port = _free_port()
    caches = [tmp_path / f"rank{r}" for r in range(world)]  # one cache per rank: as on separate nodes
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK.format(root=str(ROOT), port=port, rank=r, world=world, broken=broken)],
            env={**os.environ, "TRITON_CACHE_DIR": str(caches[r])},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    return caches, [json.loads(o[0].strip().splitlines()[-1]) for o in outs]


def _entries(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)).split("/")[0] for p in cache.rglob("__grp__*.json") if "_scale_kernel" in p.name)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_split_the_keys_and_end_with_the_single_process_cache(world: int, tmp_path: Path) -> None:
    caches, runs = _run_ranks(world, tmp_path)
    first, second = [r[0] for r in runs], [r[1] for r in runs]
    assert all(r["ok"] and r["declared"] == 12 and r["world"] == world for r in first)
    assert sum(r["shard_compiled"] for r in first) == 12  # each key compiled exactly once across the job
    assert all(r["compiled"] == 0 and r["from_cache"] == 12 for r in first)  # the final pass only loads
    assert all(r["shard_compiled"] == 0 and r["shard_received"] == 0 for r in second)  # fast path

    single = tmp_path / "single"
    subprocess.run([sys.executable, "-c", _SINGLE.format(root=str(ROOT))], env={**os.environ, "TRITON_CACHE_DIR": str(single)}, check=True)
    expected = _entries(single)
    assert len(expected) == 12
    for cache in caches:
        assert _entries(cache) == expected


def test_distributed_true_without_a_group_says_what_to_do() -> None:
    import warmreg
    from tests.helpers import CONFIG

    with pytest.raises(warmreg.WarmregError, match="init_process_group"):
        warmreg.warm(CONFIG, target="cuda:90", entry_points=False, distributed=True)


def test_one_ranks_compile_failure_is_reported_on_every_rank(tmp_path: Path) -> None:
    _, runs = _run_ranks(2, tmp_path, broken=True)
    for first, _second in runs:
        assert first["declared"] == 13 and len(first["failed"]) == 1
        assert first["failed"][0].startswith("failed on rank") and "undefined_name" in first["failed"][0]


def test_torchrun_cli(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m warmreg warm CONFIG --target cuda:90`` shards across the ranks."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "warmreg", "warm", str(ROOT / "examples" / "kimi_k3.json"), "--target", "cuda:90", "--quiet", "--json", str(report)]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and not data["summary"]["failed"]
