"""DeepSeek-V4.1 on ROCm plans the common ops its ``amd`` model launches (``v41_rocm_shared``): the SWA builder's decode
rows and their ragged compaction, the engram n-gram hash and table lookup everywhere, the unsharded gate where
``RocmEngram`` keeps ``wkv`` whole (TP 1, or off gfx942 / gfx950), with CUDA's keys; and the sweep drives them on
ROCm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import warmreg
from warmreg.testing import config_loader
from warmreg.testing.sweep import run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
HASH, LOOKUP, GATE = (f"deepseek_v4.v41_engram_{n}" for n in ("hash", "lookup", "gate"))
SWA, COUNT, COMPACT = (f"deepseek_v4.{n}" for n in ("decode_swa_indices", "rocm_ragged_count", "rocm_ragged_compact"))
SHARDED = {"deepseek_v4.v41_rocm_engram_gate_partials", "deepseek_v4.v41_rocm_engram_gate_finish"}


def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    return config


def _keys(config: dict[str, Any], target: str) -> dict[str, list[warmreg.CompileKey]]:
    return {kp.name: list(kp.keys) for kp in warmreg.plan(config, target=target).kernels}


@pytest.mark.parametrize(
    ("target", "tp", "gate"),
    [
        ("rocm:gfx942", 8, False), ("rocm:gfx950+aiter", 4, False), ("rocm:gfx942", 1, True),
        ("rocm:gfx950", 1, True), ("rocm:gfx90a", 8, True),
    ],
)  # fmt: skip
def test_rocm_plans_cudas_engram_keys(target: str, tp: int, gate: bool) -> None:
    """The hash and lookup keys are CUDA's (the same common code); the gate is planned exactly where the sharded
    partials / finish are not."""
    rocm = _keys(_config(tensor_parallel_size=tp), target)
    cuda = _keys(example_config("deepseek_v41", tensor_parallel_size=tp), "cuda:90")
    assert rocm[HASH] == cuda[HASH] and rocm[LOOKUP] == cuda[LOOKUP]
    assert (GATE in rocm) is gate
    if gate:
        assert rocm[GATE] == cuda[GATE]
    assert bool(SHARDED & set(rocm)) is (not gate)


@pytest.mark.parametrize(
    "target", ["rocm:gfx942", "rocm:gfx950+aiter", "rocm:gfx950+aiter_sparse_mla", "rocm:gfx950+aiter+aiter_sparse_mla"]
)
def test_swa_builder_rows_and_their_compaction(target: str) -> None:
    """CUDA's decode SWA keys; the compaction of 128-wide rows (one 128-column tile, 8 rows a program), plus DSpark's
    non-causal width (5 drafts: 192 wide, a 256-column tile) under DSpark; where prefill attends in-tree (not aiter's
    sparse MLA, which needs both features) also the combined prefill rows of the compressed layers (512 + 128 = 640
    wide: one 1024-column tile, one row a program; an SWA-only layer's are 128 wide)."""
    rocm = _keys(_config(), target)
    in_tree = not target.endswith("+aiter+aiter_sparse_mla")
    assert rocm[SWA] == _keys(example_config("deepseek_v41"), "cuda:90")[SWA]
    wide = [{"block_r": 1, "block_w": 1024, "num_warps": 4}] if in_tree else []
    assert sorted((k.fields() for k in rocm[COUNT]), key=lambda f: f["block_w"]) == [
        {"block_r": 8, "block_w": 128, "num_warps": 4},
        *wide,
    ]
    assert {k.fields()["block_w"] for k in rocm[COMPACT]} == ({128, 1024} if in_tree else {128})
    dspark = _config(speculative_method="dspark", num_speculative_tokens=5)
    dspark["model"]["text_config"].update(vocab_size=129280, dspark_markov_rank=256)
    assert {k.block_w for k in _keys(dspark, target)[COMPACT]} == ({128, 256, 1024} if in_tree else {128, 256})


def test_nothing_without_engram_layers() -> None:
    config = _config(tensor_parallel_size=1)
    del config["model"]["text_config"]["engram_layer_ids"]
    assert not {HASH, LOOKUP, GATE} & set(_keys(config, "rocm:gfx90a"))


def test_sweep_drives_the_engram_ops_on_rocm() -> None:
    """Three CPU sweep steps on gfx942 at TP 1: the decode SWA rows and their compaction, the hash, both layers'
    lookups and gates launch under the monitor in ``error`` mode and match their references."""
    plan = warmreg.plan(_config(max_num_seqs=2, tensor_parallel_size=1), target="rocm:gfx942")
    run = run_steps(plan, 41)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    for name in (SWA, COUNT, COMPACT, HASH, LOOKUP, GATE):
        k = run["kernels"][name]
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0, (name, k)


def test_out_of_the_v41_ragged_ops() -> None:
    """V4.1's SWA-row compaction ops are DeepSeek-V4's with V4.1's widths: the same ``out=`` contract."""
    from warmreg_deepseek_v4.v41_rocm_shared import V41RocmRaggedCount

    from warmreg.testing import OpCall, check_out

    def build() -> OpCall:
        indices = torch.tensor([[3, -1, 4], [1, 5, 9]], dtype=torch.int32)
        return OpCall(
            V41RocmRaggedCount(),
            (indices, torch.tensor([3, 2], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)),
            {},
        )

    check_out(build)
