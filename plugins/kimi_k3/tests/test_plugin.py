"""The Kimi-K3 plugin through its real entry point: plan, coverage of runtime shapes, dedup, warm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3.kda import KDARecurrent

import warmreg
from warmreg.ops import FusedQKVRMSNorm

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kimi_k3.json"
KDA = KDARecurrent.name
RMSNORM = FusedQKVRMSNorm.name
SLOTS = "warmreg.ops.block_table_slot_mapping"
RUNNER = "kimi_k3.scatter_num_accepted"
VISION = "kimi_k3.mm_input_norm"  # the vision tower's input norm (test_mm_input_norm.py)
KDA_EXTRAS = (
    "kimi_k3.aligned_state_indices",
    "kimi_k3.gated_rmsnorm",
    "kimi_k3.gather_initial_states",
    "kimi_k3.kda_packed_decode",
    "kimi_k3.stage_spec_decode_metadata",
)


@pytest.fixture(scope="module")
def kimi_plan() -> warmreg.Plan:
    return warmreg.plan(EXAMPLE, target="cuda:90")


def _example(**serving: Any) -> dict[str, Any]:
    data = json.loads(EXAMPLE.read_text())
    data.pop("description")
    data["serving"].update(serving)
    return data


def test_plan_has_the_kda_and_rmsnorm_keys(kimi_plan: warmreg.Plan) -> None:
    assert "kimi_k3" in kimi_plan.plugins
    # vLLM's three launch variants of the speculative step (BV, num_stages by head-sequences; test_kda.py)
    tiles = []
    for key in kimi_plan.kernel(KDA).keys:
        fields = key.fields()
        tiles.append((fields.pop("block_v"), fields.pop("num_stages")))
        assert fields == {
            "dtype": "bfloat16", "gate_dtype": "bfloat16", "beta_dtype": "bfloat16", "state_dtype": "float32",
            "num_heads": 12, "head_k_dim": 128, "head_v_dim": 128, "block_k": 128,
            "is_spec_decoding": True, "has_dt_bias": True, "use_lower_bound": True,  # gate_lower_bound -5.0 (example)
            "qkv_stride": "div16", "g_stride": "div16", "state_stride": "div16",
            "q_aligned": True, "k_aligned": True, "v_aligned": True, "g_aligned": True, "state_aligned": True,
            "num_warps": 1, "launch_pdl": True,
        }  # fmt: skip
    assert sorted(tiles) == [(4, 4), (8, 3), (16, 3)]
    assert len(kimi_plan.kernel(RMSNORM).keys) == 1
    (slots,) = kimi_plan.kernel(SLOTS).keys  # the MLA layers' paged cache
    assert slots.fields()["block_size"] == 768  # the block size vLLM runs (backends.kv_block_size), not --block-size 64
    # One key each for the KDA layers' gated RMSNorm, initial-state gather, packed plain-decode step, aligned state
    # indices and spec-decode staging (their own test files); the conv1d keys are in test_causal_conv1d.py (2) and
    # test_causal_conv1d_update.py (5); the example sets no attn_res_block_size: attn_res in test_attn_res.py.
    # Plus the model runner's accepted-count scatter (test_num_accepted.py) and the vision tower's input norm, one
    # key each.
    conv = {"kimi_k3.causal_conv1d": 2, "kimi_k3.causal_conv1d_update": 5}
    assert {kp.name: len(kp.keys) for kp in kimi_plan.kernels if kp.name not in (KDA, RMSNORM, SLOTS)} == {
        **dict.fromkeys(KDA_EXTRAS, 1), **conv, RUNNER: 1, VISION: 1
    }
    assert kimi_plan.num_keys == 10 + 7 + 1 + 1


@pytest.mark.parametrize("lens", [[1], [4, 1, 3, 2, 4], [4] * 256, [2] * 37 + [3] * 11])
def test_runtime_kda_shapes_are_planned(kimi_plan: warmreg.Plan, lens: list[int]) -> None:
    """dispatch of runtime-shaped speculative steps (meta tensors with the real sizes: q/k/v views of the conv
    update's [T, 3P] output, [N, 4] indices with accepted counts) lands on a planned key."""
    heads, dim, tokens = 96 // 8, 128, sum(lens)
    proj = warmreg.meta((tokens, 3 * heads * dim), torch.bfloat16)
    q, k, v = (proj[:, i * heads * dim : (i + 1) * heads * dim].view(1, tokens, heads, dim) for i in range(3))
    key = kimi_plan.kernel(KDA).kernel.dispatch(
        q=q, k=k, v=v, raw_g=warmreg.meta((1, tokens, heads, dim), torch.bfloat16),
        raw_beta=warmreg.meta((1, tokens, heads), torch.bfloat16), dt_bias=warmreg.meta((heads * dim,), torch.float32),
        lower_bound=-5.0, initial_state=warmreg.meta((1024, heads, dim, dim), torch.float32),
        cu_seqlens=warmreg.meta((len(lens) + 1,), torch.int32), num_accepted_tokens=warmreg.meta((len(lens),), torch.int32),
        launch_pdl=True,
    )  # fmt: skip
    assert key in kimi_plan.kernel(KDA).keys


@pytest.mark.parametrize("tokens", [0, 1, 7, 4096, 8192])
@pytest.mark.parametrize("width", [1536 + 512 + 64, 1536 + 512 + 64 + 12 * 128])
def test_runtime_rmsnorm_shapes_are_planned(kimi_plan: warmreg.Plan, tokens: int, width: int) -> None:
    proj = warmreg.meta((tokens, width), torch.bfloat16)
    key = kimi_plan.kernel(RMSNORM).kernel.dispatch(
        qr=proj[:, :1536],
        kv=proj[:, 1536:2048],
        q_weight=warmreg.meta((1536,), torch.bfloat16),
        kv_weight=warmreg.meta((512,), torch.bfloat16),
        launch_pdl=True,  # cuda:90 supports PDL
    )
    assert key in kimi_plan.kernel(RMSNORM).keys


class _OtherFamily:
    """A second family registering the shared RMSNorm with its own projection layout (in-test plugin)."""

    def __init__(self, q_size: int, kv_size: int) -> None:
        self.q_size, self.kv_size = q_size, kv_size

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        width = self.q_size + self.kv_size
        registry.add(FusedQKVRMSNorm(q_size=self.q_size, kv_size=self.kv_size, proj_width=width, plugin="other"))


def test_shared_rmsnorm_keys_are_deduplicated() -> None:
    """A DSv4-Pro-shaped registration (q 1536, kv 512, stride 2048) has the same key as Kimi's
    (stride 2112 or 3648): one key, credited to both plugins. A DSv4-Flash shape (q 1024) adds one."""
    pro = warmreg.plan(EXAMPLE, target="cuda:90", plugins=[_OtherFamily(1536, 512)])
    kp = pro.kernel(RMSNORM)
    assert len(kp.keys) == 1
    assert len(kp.plugins) == 2 and "kimi_k3" in kp.plugins
    flash = warmreg.plan(EXAMPLE, target="cuda:90", plugins=[_OtherFamily(1024, 512)])
    assert len(flash.kernel(RMSNORM).keys) == 2


def test_no_kda_layers_no_kda_kernel() -> None:
    data = _example()
    data["model"]["text_config"]["linear_attn_config"]["kda_layers"] = []
    names = [k.name for k in warmreg.plan(data, target="cuda:90").kernels]
    assert KDA not in names and RMSNORM in names


def test_kda_step_needs_speculation_and_tp_sets_heads() -> None:
    """vLLM's NVIDIA layer launches the recurrent step for speculative rows only; TP 4 gives 24 heads a rank and
    vLLM's three launch variants still (token counts reach no key field)."""
    assert KDA not in {kp.name for kp in warmreg.plan(_example(num_speculative_tokens=0), target="cuda:90").kernels}
    keys = warmreg.plan(_example(tensor_parallel_size=4), target="cuda:90").kernel(KDA).keys
    assert len(keys) == 3 and {key.num_heads for key in keys} == {24}  # type: ignore[attr-defined]


@pytest.mark.parametrize("bound", [None, "absent"])
def test_no_lower_bound_plans_the_softplus_gate(bound: str | None) -> None:
    """gate_lower_bound null or absent: the softplus gate (USE_LOWER_BOUND off), still vLLM's three variants."""
    data = _example()
    linear = data["model"]["text_config"]["linear_attn_config"]
    if bound == "absent":
        del linear["gate_lower_bound"]
    else:
        linear["gate_lower_bound"] = None
    keys = warmreg.plan(data, target="cuda:90").kernel(KDA).keys
    assert len(keys) == 3 and {(k.use_lower_bound, k.has_dt_bias) for k in keys} == {(False, True)}  # type: ignore[attr-defined]


@pytest.mark.parametrize("bound", [0.5, 0, True, "-5"])
def test_bad_lower_bound_is_a_config_error(bound: object) -> None:
    data = _example()
    data["model"]["text_config"]["linear_attn_config"]["gate_lower_bound"] = bound
    with pytest.raises(warmreg.ConfigError, match=r"linear_attn_config\.gate_lower_bound"):
        warmreg.plan(data, target="cuda:90")


def test_heads_not_divisible_by_tp_is_a_config_error() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"linear_attn_config\.num_heads"):
        warmreg.plan(_example(tensor_parallel_size=7), target="cuda:90")


def test_warm_cross_compiles_the_kimi_plan_for_sm90(kimi_plan: warmreg.Plan) -> None:
    report = warmreg.warm(EXAMPLE, target="cuda:90", workers=2, on_error="continue")
    assert report.ok, [r.error for r in report.failed]
    assert report.declared == kimi_plan.num_keys
    assert {r.kernel for r in report.results} == {
        KDA, RMSNORM, SLOTS, RUNNER, VISION, *KDA_EXTRAS, "kimi_k3.causal_conv1d", "kimi_k3.causal_conv1d_update"
    }


def test_the_full_example_plans_attn_res_and_every_chunked_prefill_stage_with_its_candidates() -> None:
    full = EXAMPLE.with_name("kimi_k3_full.json")
    plan = warmreg.plan(full, target="cuda:90")
    keys = {kp.name: kp.keys for kp in plan.kernels}
    assert len(keys["kimi_k3.attn_res"]) == 46  # 25 call sites, 21 of them at both tiles
    stages = [f"kimi_k3.kda_chunk_{s}" for s in ("l2norm", "gate", "intra", "wu", "h", "o")]
    assert len(keys[stages[0]]) == 1  # the L2 norm is untuned, as vLLM's l2norm_fwd_kernel2
    for stage in stages[1:]:  # one tuning key a stage, once per autotune candidate
        assert sorted(k.config for k in keys[stage]) == [0, 1, 2, 3], stage  # type: ignore[attr-defined]
    assert plan.num_keys == 19 + 46 + 21
    # the same deployment under vLLM's "auto" prefill backend takes FlashKDA (C++) on SM90: no stage planned
    data = json.loads(full.read_text())
    del data["serving"]["kda_prefill_backend"]
    assert not set(stages) & {kp.name for kp in warmreg.plan(data, target="cuda:90").kernels}
