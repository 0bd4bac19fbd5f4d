"""DeepSeek-V4.1 on ROCm: the one-launch decode top-k pack and SWA decode metadata (references under Triton's
interpreter, hand-picked rows, views, errors, out=), V4.1's ROCm planning per target and ``serving.monokernel``, real
cross-compiles for gfx942 and gfx950, and the V4.1 sweep on ROCm plans (every planned kernel driven and checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_decode_topk import global_topk_ragged_reference
from warmreg_deepseek_v4.sweep import DSV4Sweep
from warmreg_deepseek_v4.v41_rocm_swa_decode_meta import V41RocmSwaDecodeMeta, swa_decode_meta_reference
from warmreg_deepseek_v4.v41_rocm_topk_pack import V41RocmTopkPack

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader
from warmreg.testing.sweep import driver_for, run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
PACK, META = V41RocmTopkPack.name, V41RocmSwaDecodeMeta.name
LENS, PACK2 = "deepseek_v4.rocm_topk_lens", "deepseek_v4.rocm_pack_topk_ragged"
SEAM, COLLAPSE = "deepseek_v4.v41_rocm_mhc_post_collapse_rmsnorm", "deepseek_v4.v41_hc_collapse"


# -- the one-launch top-k pack ------------------------------------------------------------------------------------------
def test_pack_of_hand_picked_rows() -> None:
    """Page size 4: local 5 is page 1 offset 1; an invalid token has no entries; -1 tails are dropped."""
    topk = torch.tensor([[5, 0, -1, -1], [2, 3, 9, -1], [1, 1, 1, 1]], dtype=I32)
    table = torch.tensor([[10, 20, 30], [40, 50, 60]], dtype=I32)
    ragged, indptr, lens = V41RocmTopkPack()(
        topk, torch.tensor([1, 0, 0], dtype=I32), table, 4, torch.tensor([True, True, False])
    )
    assert lens.tolist() == [2, 3, 0] and indptr.tolist() == [0, 2, 5, 5]
    assert ragged[:5].tolist() == [201, 160, 42, 43, 121]


@pytest.mark.parametrize(("tokens", "topk"), [(1, 512), (6, 512), (16, 512), (5, 37)])
def test_pack_matches_reference(tokens: int, topk: int) -> None:
    """Tiles of 1, 8 and 16 rows of Flash's top-k, a non-power-of-two width; a -1 inside a row (the first ``lens``
    columns are taken, as vLLM's); views of a larger buffer and table."""
    g = torch.Generator().manual_seed(tokens + topk)
    buffer = torch.randint(0, 128 * 7, (tokens + 2, topk), generator=g, dtype=I32)
    buffer[0, topk // 2 :] = -1
    buffer[min(1, tokens - 1), 3] = -1
    table = torch.randint(0, 1000, (6, 7), generator=g, dtype=I32)[:4]
    t2r, valid = torch.randint(0, 4, (tokens,), generator=g, dtype=I32), torch.rand(tokens, generator=g) > 0.2
    ragged, indptr, lens = V41RocmTopkPack()(buffer[:tokens], t2r, table, 128, valid)
    want = global_topk_ragged_reference(buffer[:tokens], t2r, table, 128, valid)
    assert torch.equal(lens, want[2]) and torch.equal(indptr, want[1])
    assert torch.equal(ragged[: int(indptr[-1])], want[0]) and ragged.shape == (tokens * topk,)


def test_pack_errors() -> None:
    topk, t2r, table, valid = (
        torch.zeros(3, 8, dtype=I32),
        torch.zeros(3, dtype=I32),
        torch.zeros(1, 4, dtype=I32),
        torch.ones(3, dtype=torch.bool),
    )
    op = V41RocmTopkPack()
    with pytest.raises(warmreg.LaunchError, match=r"1\.\.16 rows"):
        op(torch.zeros(17, 8, dtype=I32), torch.zeros(17, dtype=I32), table, 64, torch.ones(17, dtype=torch.bool))
    with pytest.raises(warmreg.LaunchError, match="is_valid_token must be"):
        op(topk, t2r, table, 64, valid.int())
    with pytest.raises(warmreg.LaunchError, match="topk_indices must be"):
        op(topk.t(), t2r, table, 64, valid)
    with pytest.raises(warmreg.LaunchError, match="block_size"):
        op(topk, t2r, table, 0, valid)


def test_pack_out() -> None:
    """Full rows of valid tokens, so every buffer is written whole."""

    def build() -> OpCall:
        topk = torch.tensor([[3, 0, 4], [1, 5, 9]], dtype=I32)
        table = torch.arange(20, dtype=I32).reshape(2, 10)
        return OpCall(
            V41RocmTopkPack(), (topk, torch.tensor([0, 1], dtype=I32), table, 2, torch.tensor([True, True])), {}
        )

    check_out(build)


# -- the one-launch SWA decode metadata ---------------------------------------------------------------------------------
def _meta_inputs(tokens: int, width: int) -> dict[str, Any]:
    """Three requests (1 token, 2 tokens, the rest), a padded token, a replay start; buffers of 40 rows poisoned."""
    qsl = torch.cummax(torch.tensor([0, 1, min(3, tokens), tokens]), 0).values.to(I32)
    t2r = torch.bucketize(torch.arange(tokens), qsl[1:].long(), right=True).clamp(max=2).to(I32)
    slots = torch.arange(tokens, dtype=torch.int64) * 7
    slots[tokens // 2] = -1
    g = torch.Generator().manual_seed(tokens * width)
    return {
        "slot_mapping": slots, "is_valid": torch.zeros(40, dtype=torch.bool),
        "indices": torch.full((40, 1, width), -7, dtype=I32), "lens": torch.full((40,), -7, dtype=I32),
        "ragged": torch.full((40 * width,), -7, dtype=I32), "indptr": torch.full((41,), -7, dtype=I32),
        "query_start_loc": qsl, "seq_lens": torch.tensor([300, 7, 190], dtype=I32), "token_to_req": t2r,
        "block_table": torch.randint(0, 900, (4, 16), generator=g, dtype=I32),
        "replay_start": torch.tensor([0, 0, 120, 0], dtype=I32),
    }  # fmt: skip


def test_meta_of_a_hand_picked_token() -> None:
    """One token at position 9 (seq 10), window 4, blocks of 4: positions 6..9 are pages 1 (6, 7) and 2 (8, 9)."""
    d = _meta_inputs(1, 8)
    d["query_start_loc"], d["seq_lens"] = torch.tensor([0, 1], dtype=I32), torch.tensor([10], dtype=I32)
    d["block_table"] = torch.tensor([[100, 101, 102, 103]], dtype=I32)
    d["slot_mapping"] = torch.tensor([5])
    V41RocmSwaDecodeMeta()(*d.values(), 1, 4, 4)
    assert d["is_valid"][0] and d["lens"].tolist() == [4] + [0] * 39
    assert d["indices"][0, 0].tolist() == [406, 407, 408, 409, -1, -1, -1, -1]
    assert d["indptr"][:2].tolist() == [0, 4] and d["ragged"][:4].tolist() == [406, 407, 408, 409]


@pytest.mark.parametrize(("tokens", "width", "noncausal"), [(1, 128, False), (7, 128, False), (32, 128, False),
                                                            (5, 100, False), (4, 192, True)])  # fmt: skip
def test_meta_matches_reference(tokens: int, width: int, noncausal: bool) -> None:
    """Tiles of 1, 8 and 32 rows; a non-power-of-two width; the DSpark draft block. Every buffer: the rows past the
    batch untouched, ``lens`` zeroed past it."""
    d = _meta_inputs(tokens, width)
    V41RocmSwaDecodeMeta()(*d.values(), tokens, 128, 32, noncausal)
    keys = ("slot_mapping", "query_start_loc", "seq_lens", "token_to_req", "block_table", "replay_start")
    valid, indices, lens, ragged, indptr = swa_decode_meta_reference(
        *(d[k] for k in keys), tokens, 128, 32, width, noncausal
    )
    assert torch.equal(d["is_valid"][:tokens], valid) and not d["is_valid"][tokens:].any()
    assert torch.equal(d["indices"][:tokens, 0], indices) and (d["indices"][tokens:] == -7).all()
    assert torch.equal(d["lens"][:tokens], lens) and (d["lens"][tokens:] == 0).all()
    assert torch.equal(d["indptr"][: tokens + 1], indptr) and torch.equal(d["ragged"][: int(indptr[-1])], ragged)


def test_meta_errors() -> None:
    d = _meta_inputs(3, 128)
    with pytest.raises(warmreg.LaunchError, match=r"num_tokens must be 1\.\.32"):
        V41RocmSwaDecodeMeta()(*d.values(), 33, 128, 32)
    with pytest.raises(warmreg.LaunchError, match="indices must be"):
        V41RocmSwaDecodeMeta()(*{**d, "indices": d["indices"].transpose(0, 2)}.values(), 3, 128, 32)
    with pytest.raises(warmreg.LaunchError, match="slot_mapping must be"):
        V41RocmSwaDecodeMeta()(*{**d, "slot_mapping": d["slot_mapping"].int()}.values(), 3, 128, 32)
    with pytest.raises(warmreg.LaunchError, match="ragged must be"):
        V41RocmSwaDecodeMeta()(*{**d, "ragged": d["ragged"][:100]}.values(), 3, 128, 32)


# -- planning -----------------------------------------------------------------------------------------------------------
def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    return config


def _keys(plan: warmreg.Plan, name: str) -> list[dict[str, Any]]:
    return [k.fields() for k in plan.kernel(name).keys]


def test_gfx942_monokernel_plans_both_one_launch_ops_and_the_two_launch_path() -> None:
    """max_num_seqs 256 with one MTP token: decode steps reach 512 tokens, so the pack's five row tiles (1..16), the
    metadata's six (1..32), and the count and pack for the larger batches."""
    plan = warmreg.plan(_config(monokernel=True), target="rocm:gfx942")
    assert _keys(plan, PACK) == [{"rows": r, "block": 512, "num_warps": 8} for r in (1, 2, 4, 8, 16)]
    assert _keys(plan, META) == [
        {"rows": r, "width": 128, "noncausal": False, "num_warps": 4} for r in (1, 2, 4, 8, 16, 32)
    ]
    assert _keys(plan, LENS) == [{"tile": 1024, "num_warps": 4}] and _keys(plan, PACK2) == [
        {"tile": 128, "num_warps": 4}
    ]
    assert_warmup_inputs_reproduce(V41RocmTopkPack(), plan.kernel(PACK).keys)
    assert_warmup_inputs_reproduce(V41RocmSwaDecodeMeta(), plan.kernel(META).keys)


def test_small_steps_under_monokernel_leave_the_two_launch_path_to_gfx950() -> None:
    """Steps of at most 6 decode tokens: on gfx942 every decode batch takes the pack (tiles 1..8), so the count and
    pack are not planned; gfx950 has no one-launch pack (``ops.enabled`` is gfx942 only) but the metadata."""
    serving = {"monokernel": True, "max_num_seqs": 3}
    gfx942 = warmreg.plan(_config(**serving), target="rocm:gfx942")
    assert [k["rows"] for k in _keys(gfx942, PACK)] == [1, 2, 4, 8] and LENS not in {k.name for k in gfx942.kernels}
    gfx950 = {k.name for k in warmreg.plan(_config(**serving), target="rocm:gfx950").kernels}
    assert PACK not in gfx950 and {META, LENS, PACK2} <= gfx950


def test_dspark_plans_the_draft_block_rows() -> None:
    """``speculative_method`` dspark with 3 draft tokens: the draft block's non-causal rows, ``round_up(128 + 3, 64)``."""
    plan = warmreg.plan(
        _config(monokernel=True, speculative_method="dspark", num_speculative_tokens=3), target="rocm:gfx950"
    )
    assert {(k["width"], k["noncausal"]) for k in _keys(plan, META)} == {(128, False), (192, True)}


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950"])
def test_without_monokernel_only_the_two_launch_path(target: str) -> None:
    """And the shared head collapse, every ROCm step, at the CUDA key (fresh contiguous streams and pre-mix)."""
    plan = warmreg.plan(_config(), target=target)
    names = {k.name for k in plan.kernels}
    assert {LENS, PACK2} <= names and not {PACK, META, SEAM} & names
    cuda = warmreg.plan(example_config("deepseek_v41"), target="cuda:90")
    assert plan.kernel(COLLAPSE).keys == cuda.kernel(COLLAPSE).keys and len(plan.kernel(COLLAPSE).keys) == 1


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_nothing_rocm_on_cuda(target: str) -> None:
    config = example_config("deepseek_v41")
    config["serving"]["monokernel"] = True
    names = {k.name for k in warmreg.plan(config, target=target).kernels}
    assert not {PACK, META, LENS, PACK2} & names


def test_refusals() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"serving\.attention_backend"):
        warmreg.plan(_config(attention_backend="FLASHMLA_SPARSE_DSV41"), target="rocm:gfx942")
    with pytest.raises(warmreg.ConfigError, match=r"serving\.monokernel"):
        warmreg.plan(_config(monokernel=True, tensor_parallel_size=1), target="rocm:gfx942")
    with pytest.raises(warmreg.ConfigError, match=r"serving\.monokernel"):
        warmreg.plan(_config(monokernel=True), target="rocm:gfx90a")
    with pytest.raises(warmreg.ConfigError, match=r"serving\.monokernel"):
        warmreg.plan(_config(monokernel="yes"), target="rocm:gfx942")


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    """Every key of V4.1's ROCm ops compiles for both targets (steps of <= 4 tokens: on gfx942 three pack and three
    metadata tiles; on gfx950 the metadata's three and the two-launch count and pack; the head collapse and the TP-8
    engram gate's partials and finish on both, with the common engram hash and lookup, the decode SWA rows and their
    compaction; gfx950's MXFP8 prefill rows; gfx942's sparse decode partial pass for SWA-only and compressed layers,
    its reduce and the inverse RoPE of the unrotated rows; the in-tree prefill's compressed and SWA K gathers on
    both)."""
    plugin = RegisterPlugin(*(m.register for m in v41.ROCM_OP_MODULES), model=DSV4.from_config)
    config = _config(monokernel=True, max_num_seqs=2)
    for target, n in (("rocm:gfx942", 27), ("rocm:gfx950", 23)):
        report = warmreg.warm(config, target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == n, [(r.kernel, r.error) for r in report.failed]


# -- the sweep ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "mono"),
    [("rocm:gfx942", True), ("rocm:gfx950", True), ("rocm:gfx942", False), ("rocm:gfx950+aiter", False)],
)
def test_sweep_drives_every_planned_kernel(target: str, mono: bool) -> None:
    """Three steps (decode, prefill, mixed) of at most three tokens, under the monitor in ``error`` mode, as the CPU
    sweep runs them: every planned kernel launched, none missed, the ROCm ones matching their references. Steps of
    at most 16 decode tokens (8 requests, one MTP token each): on gfx942 under ``--monokernel`` every decode batch
    takes the one-launch pack, so the two-launch path is not planned there."""
    plan = warmreg.plan(_config(monokernel=mono, max_num_seqs=8), target=target)
    assert issubclass(driver_for(plan), DSV4Sweep)
    run = run_steps(plan, 41)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    rocm = {k.name for k in plan.kernels} & {PACK, META, LENS, PACK2, SEAM}
    want = {PACK, META} if target == "rocm:gfx942" and mono else {META, LENS, PACK2} if mono else {LENS, PACK2}
    assert rocm == want | ({SEAM} if target.endswith("+aiter") else set())
    for name in rocm:
        k = run["kernels"][name]
        assert k["launches"] >= 1 and k["failures"] == 0 and k["misses"] == 0, (name, k)
        assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
