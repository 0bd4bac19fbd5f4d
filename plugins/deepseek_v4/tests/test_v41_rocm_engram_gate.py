"""DeepSeek-V4.1's TP-sharded engram gate of gfx942 / gfx950 (the partials and the finish) against their PyTorch
references under Triton's interpreter (hand-picked math, the two kernels end to end against the unsharded CUDA
gate, views, an empty step, errors, out=, warmup inputs), and the plan: which targets and TP sizes plan which keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.v41_engram_gate import engram_gate_reference
from warmreg_deepseek_v4.v41_rocm_engram_gate import (
    EngramGateFinish,
    EngramGatePartials,
    gate_finish_reference,
    gate_partials_reference,
    unpack_partials,
)

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader
from warmreg.testing.sweep import run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16 = torch.bfloat16
PARTIALS, FINISH = EngramGatePartials.name, EngramGateFinish.name


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ops(d: int, c: int, p: int) -> tuple[EngramGatePartials, EngramGateFinish]:
    dims: dict[str, Any] = dict(hidden_size=d, hc_mult=c, tp_size=p, dtype="bfloat16")
    return EngramGatePartials(**dims), EngramGateFinish(**dims)


def _shard(kv_full: torch.Tensor, c: int, p: int, r: int) -> torch.Tensor:
    """Rank ``r``'s ``MergedColumnParallelLinear`` output: its slice of each of the ``c + 1`` column blocks."""
    t, d = kv_full.shape[0], kv_full.shape[1] // (c + 1)
    w = d // p
    return kv_full.reshape(t, c + 1, p, w)[:, :, r].reshape(t, (c + 1) * w)


def _sharded_gate(
    hidden: torch.Tensor, kv_full: torch.Tensor, mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, p: int
) -> torch.Tensor:
    """Every rank's partials, the all-gather (a concatenation along tokens) and the finish."""
    _, c, d = hidden.shape
    partials, finish = _ops(d, c, p)
    sends = [partials(hidden, _shard(kv_full, c, p, r), r * (d // p), q_weight=q, k_weight=k) for r in range(p)]
    return finish(hidden, torch.cat(sends), mask, tp_size=p, eps=1e-6)


def test_partials_by_hand() -> None:
    """Two ranks of D = 8 (W = 4): key 2 everywhere, x = q = k = 1: ``sum key^2 = 4 * 4`` and ``sum x*q*k*key = 2 *
    4`` on each rank; the value slice is copied bitwise (rank 1's from column 4)."""
    c, d, p = 2, 8, 2
    hidden, ones = torch.ones(1, c, d, dtype=BF16), torch.ones(c, d, dtype=BF16)
    kv_full = torch.full((1, (c + 1) * d), 2.0, dtype=BF16)
    kv_full[0, c * d :] = torch.arange(d, dtype=BF16)
    partials, _ = _ops(d, c, p)
    value, pairs = unpack_partials(partials(hidden, _shard(kv_full, c, p, 1), 4, q_weight=ones, k_weight=ones), c)
    assert value.tolist() == [[4.0, 5.0, 6.0, 7.0]] and pairs.tolist() == [[[16.0, 8.0], [16.0, 8.0]]]


def test_finish_by_hand_is_the_cuda_gate() -> None:
    """x, keys and weights 1: ``dot = sqrt(D)``, the gate ``sigmoid(D^(1/4))``; the value is reassembled from both
    ranks' slices; a masked token passes through."""
    c, d, p = 2, 16, 2
    hidden, ones = torch.ones(2, c, d, dtype=BF16), torch.ones(c, d, dtype=BF16)
    kv_full = torch.ones(2, (c + 1) * d, dtype=BF16)
    kv_full[:, c * d :] = torch.arange(d, dtype=BF16) / 8
    got = _sharded_gate(hidden, kv_full, torch.tensor([True, False]), ones, ones, p)
    gate = torch.sigmoid(torch.tensor(d**0.25)).item()
    want = (1 + gate * torch.arange(d) / 8).expand(c, d)
    torch.testing.assert_close(got[0].float(), want, atol=0.0, rtol=2**-7)  # one bf16 rounding of the output
    assert torch.equal(got[1], hidden[1])


@pytest.mark.parametrize(("t", "d", "p"), [(5, 40, 2), (3, 48, 4), (0, 16, 2)])
def test_both_kernels_match_their_references_and_the_cuda_gate(t: int, d: int, p: int) -> None:
    """Slices of 20 and 12 (not powers of two), an empty step; offset views, a transposed weight, a strided mask.
    Partials: the value slice bitwise, the fp32 sums to fp32 summation order (2^-20 relative). Finish and the whole
    pipeline against the unsharded CUDA reference: one bf16 rounding (the interpreter truncates fp32 -> bf16)."""
    c = 4
    hidden = torch.randn(t, c, d + 8, generator=_gen(t)).to(BF16)[:, :, 8:]
    kv_full = torch.randn(t, (c + 1) * d, generator=_gen(t + 1)).to(BF16)
    q = torch.randn(d, c, generator=_gen(2)).to(BF16).t()
    k = torch.randn(c, d, generator=_gen(3)).to(BF16)
    mask = (torch.rand(2 * t, generator=_gen(4)) < 0.7)[::2]
    partials, finish = _ops(d, c, p)
    sends = []
    for r in range(p):
        kv = _shard(kv_full, c, p, r)
        got = partials(hidden, kv, r * (d // p), q_weight=q, k_weight=k)
        want = gate_partials_reference(hidden, kv, r * (d // p), q_weight=q, k_weight=k)
        assert torch.equal(unpack_partials(got, c)[0], unpack_partials(want, c)[0])
        torch.testing.assert_close(unpack_partials(got, c)[1], unpack_partials(want, c)[1], atol=1e-5, rtol=2**-20)
        sends.append(got)
    gathered = torch.cat(sends)
    out = finish(hidden, gathered, mask, tp_size=p, eps=1e-6)
    ref = gate_finish_reference(hidden, gathered, mask, tp_size=p, eps=1e-6)
    torch.testing.assert_close(out.float(), ref.float(), atol=2**-6, rtol=2**-7)
    cuda = engram_gate_reference(hidden, kv_full, mask, q_weight=q, k_weight=k, eps=1e-6)
    torch.testing.assert_close(out.float(), cuda.float(), atol=2**-6, rtol=2**-7)


def test_errors_and_out() -> None:
    c, d, p = 2, 16, 2
    partials, finish = _ops(d, c, p)
    hidden, w = torch.zeros(3, c, d, dtype=BF16), torch.zeros(c, d, dtype=BF16)
    kv = torch.zeros(3, (c + 1) * 8, dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="kv must be"):
        partials(hidden, kv[:, :-1], 0, q_weight=w, k_weight=w)
    with pytest.raises(warmreg.LaunchError, match="kv must be a 16-bit float"):
        partials(hidden, kv.float(), 0, q_weight=w, k_weight=w)
    with pytest.raises(warmreg.LaunchError, match="dim_start"):
        partials(hidden, kv, 9, q_weight=w, k_weight=w)
    with pytest.raises(warmreg.LaunchError, match="k_weight"):
        partials(hidden, kv, 0, q_weight=w, k_weight=w.float())
    gathered = torch.zeros(6, 8 + 4 * c, dtype=BF16)
    with pytest.raises(warmreg.LaunchError, match="gathered must be"):
        finish(hidden, gathered[:5], tp_size=p, eps=1e-6)
    with pytest.raises(warmreg.LaunchError, match="tp_size"):
        finish(hidden, gathered, tp_size=3, eps=1e-6)
    with pytest.raises(warmreg.LaunchError, match="token_mask"):
        finish(hidden, gathered, torch.ones(3, dtype=torch.int32), tp_size=p, eps=1e-6)
    dims: dict[str, Any] = dict(hidden_size=d, hc_mult=c, tp_size=p, dtype="bfloat16")
    check_out(lambda: OpCall(EngramGatePartials(**dims), (hidden, kv, 8), dict(q_weight=w, k_weight=w)))
    mask = torch.ones(3, dtype=torch.bool)
    check_out(lambda: OpCall(EngramGateFinish(**dims), (hidden, gathered, mask), dict(tp_size=p, eps=1e-6)))


# -- the plan --------------------------------------------------------------------------------------------------------
def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", **serving})
    return config


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "rocm:gfx950+aiter"])
def test_example_plans_one_key_each_on_cdna3_and_cdna4(target: str) -> None:
    """Flash at TP 8: slices of 640 (tile 1024); the finish sums 8 ranks over the 5120 row (tile 8192, 8 warps)."""
    plan = warmreg.plan(_config(), target=target)
    (pk,) = plan.kernel(PARTIALS).keys
    (fk,) = plan.kernel(FINISH).keys
    assert pk.fields() == dict(
        width=640, hc_mult=4, block=1024, dtype="bfloat16", kv_dtype="bfloat16", weight_dtype="bfloat16", num_warps=4
    )
    assert fk.fields() == dict(
        dim=5120, width=640, tp_size=8, hc_mult=4, block=8192, has_mask=True, dtype="bfloat16",
        gathered_dtype="bfloat16", num_warps=8,
    )  # fmt: skip
    assert_warmup_inputs_reproduce(plan.kernel(PARTIALS).kernel, [pk])
    assert_warmup_inputs_reproduce(plan.kernel(FINISH).kernel, [fk])


@pytest.mark.parametrize(
    ("target", "serving"),
    [("rocm:gfx942", {"tensor_parallel_size": 1}), ("rocm:gfx90a", {}), ("cuda:90", {"attention_backend": None})],
)
def test_nothing_where_the_wkv_is_not_sharded(target: str, serving: dict[str, Any]) -> None:
    """TP 1 and CDNA2 keep the whole ``wkv`` (the unsharded gate runs); CUDA has no ``RocmEngram``."""
    config = _config(**{k: v for k, v in serving.items() if v is not None})
    if "attention_backend" in serving:
        config["serving"]["attention_backend"] = "FLASHMLA_SPARSE_DSV41"
    names = {k.name for k in warmreg.plan(config, target=target).kernels}
    assert not {PARTIALS, FINISH} & names


def test_nothing_without_engram_layers() -> None:
    config = _config()
    del config["model"]["text_config"]["engram_layer_ids"]
    assert not {PARTIALS, FINISH} & {k.name for k in warmreg.plan(config, target="rocm:gfx942").kernels}


# -- the sweep -------------------------------------------------------------------------------------------------------
def test_sweep_drives_both_kernels() -> None:
    """Three CPU sweep steps on gfx950 at TP 8: every rank's partials and the finish launch for both engram layers
    under the monitor in ``error`` mode, and match their references."""
    plan = warmreg.plan(_config(max_num_seqs=2), target="rocm:gfx950")
    run = run_steps(plan, 37)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    for name in (PARTIALS, FINISH):
        k = run["kernels"][name]
        assert k["launches"] >= 2 and k["failures"] == 0 and k["misses"] == 0, (name, k)
        assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
