"""Distributed warm over gloo on the CPU (cross-compiling for cuda:90): 2 and 4 ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from warmreg import WarmregError
from warmreg._triton.release import RELEASE

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
if {fake_launchers}:  # as a GPU rank would: hand over the launchers its loads built (a cross warm builds none)
    from triton.runtime.cache import get_cache_manager
    from warmreg._triton import launchers as tl
    from warmreg.stages import distributed
    name = "__triton_launcher" + tl.local_abi().ext_suffix
    mine = tl.Launcher("%064x" % ({rank} + 1), tl.platform_key(), tl.local_abi().version, name, b"launcher of rank {rank}")
    odd = tl.Launcher("%064x" % ({rank} + 101), tl.platform_key(), "3.99", "__triton_launcher.cpython-399-x.so", b"other abi")
    distributed._shard_launchers = lambda shard, plan: [mine, odd]
out = []
for _ in range(2):  # the second warm finds every key cached on every rank: nothing is exchanged
    r = warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False, workers=1, on_error="continue")
    out.append({{"ok": r.ok, "declared": r.declared, "compiled": r.compiled, "from_cache": r.from_cache,
                "shard_compiled": r.stage("shard").get("compiled"), "shard_received": r.stage("shard").get("received"), "world": r.stage("shard").get("world_size", 1),
                "failed": [f.error for f in r.failed], "launchers_received": r.stage("shard").get("launchers_received")}})
if {fake_launchers}:
    out.append({{r: (open(p, "rb").read().decode() if (p := get_cache_manager("%064x" % (r + 1)).get_file(name)) else None)
                for r in range({world})}})
    out.append(any(get_cache_manager("%064x" % (r + 101)).get_file("__triton_launcher.cpython-399-x.so") for r in range({world}) if r != {rank}))
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


def _run_ranks(world: int, tmp_path: Path, *, broken: bool = False, fake_launchers: bool = False) -> tuple[list[Path], list[list[Any]]]:
    port = _free_port()
    caches = [tmp_path / f"rank{r}" for r in range(world)]  # one cache per rank: as on separate nodes
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK.format(root=str(ROOT), port=port, rank=r, world=world, broken=broken, fake_launchers=fake_launchers)],
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
    # a rank compiles its shard and takes every other key from the cache the exchange filled
    assert all(r["compiled"] == r["shard_compiled"] and r["from_cache"] == 12 - r["compiled"] for r in first)
    assert all(r["shard_compiled"] == 0 and r["shard_received"] == 0 for r in second)  # fast path

    single = tmp_path / "single"
    subprocess.run([sys.executable, "-c", _SINGLE.format(root=str(ROOT))], env={**os.environ, "TRITON_CACHE_DIR": str(single)}, check=True)
    expected = _entries(single)
    assert len(expected) == 12
    for cache in caches:
        assert _entries(cache) == expected


def test_ranks_hand_each_other_the_c_launchers_that_fit_their_python(tmp_path: Path) -> None:
    _, runs = _run_ranks(3, tmp_path, fake_launchers=True)
    for rank, (first, second, caches, foreign_abi) in enumerate(runs):
        assert first["ok"] and first["launchers_received"] == 2  # one from each other rank
        assert second["launchers_received"] == 0  # fast path: nothing exchanged
        # installed where Triton looks (a rank's own is faked: a GPU rank has it in its cache already)
        assert caches == {str(r): None if r == rank else f"launcher of rank {r}" for r in range(3)}
        assert not foreign_abi  # another Python's launcher is not written


_GPU_RANK = """
import json, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import triton.runtime.build as tb
import warmreg
import warmreg.stages.distributed as wd
from tests.helpers import CONFIG, Plugin, Scale
builds = {{"before": [], "after": []}}
phase = ["before"]
real_build, real_gather, real_sent = tb._build, wd._all_gather_bytes, wd._shard_launchers
sent = []
def build(name, *a, **k):
    builds[phase[0]].append(name)
    return real_build(name, *a, **k)
def shard_launchers(*a, **k):
    sent.extend(real_sent(*a, **k))
    return sent
def gather(*a, **k):
    phase[0] = "after"
    return real_gather(*a, **k)
tb._build, wd._all_gather_bytes, wd._shard_launchers = build, gather, shard_launchers
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank={rank}, world_size=2)
# keys in plan order: (32, n=1), (32, n=17), (64, n=1), (64, n=17); rank 0 gets both n=1 keys, rank 1
# both others; n == 1 is a constant, so each rank's keys need one launcher, not the other rank's
r = warmreg.warm(CONFIG, plugins=[Plugin(*(Scale(block=b, sizes=(1, 17)) for b in (32, 64)))], entry_points=False, workers=2)
dist.destroy_process_group()
print(json.dumps({{"ok": r.ok, "shard": r.stage("shard").get("compiled"), "received": r.stage("shard").get("launchers_received"), "sent": [x.cache_key for x in sent], **builds}}))
"""


@pytest.mark.gpu
def test_gpu_ranks_on_separate_caches_build_only_their_own_launchers(tmp_path: Path) -> None:
    """Two ranks on the local GPU, each with its own cache (as on two hosts): after the exchange no
    rank runs the C compiler, since the others' launchers came with their binaries."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GPU_RANK.format(root=str(ROOT), port=port, rank=r)],
            env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / f"rank{r}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    ranks = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    if not RELEASE.per_signature_launcher:  # 3.7+: one generic launcher, nothing per kernel to build or send
        assert all(r["ok"] and r["shard"] == 2 and r["sent"] == [] and r["received"] == 0 for r in ranks), ranks
        assert all("__triton_launcher" not in r["before"] + r["after"] for r in ranks), ranks
        return
    assert all(r["ok"] and r["shard"] == 2 and r["before"].count("__triton_launcher") == 1 for r in ranks), ranks
    assert ranks[0]["sent"] != ranks[1]["sent"], ranks  # two different launchers, one per rank
    assert all(r["received"] == 1 and r["after"] == [] for r in ranks), ranks  # no C compiler after the exchange


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
    assert data["stages"]["shard"]["world_size"] == 2 and not data["summary"]["failed"]


def test_a_launcher_corrupted_in_transit_is_refused_by_name() -> None:
    from warmreg._triton import launchers as tl
    from warmreg.stages.distributed import _Decoded, _encode

    launcher = tl.Launcher("ab" * 32, tl.platform_key(), "3.11", "__triton_launcher.so", b"\x7fELF" + bytes(range(60)))
    raw = _encode([], [], [launcher])
    assert _Decoded(raw).launchers == [launcher]
    broken = raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
    with pytest.raises(WarmregError, match=r"__triton_launcher.so \(abababababab\) arrived corrupt"):
        _Decoded(broken)
