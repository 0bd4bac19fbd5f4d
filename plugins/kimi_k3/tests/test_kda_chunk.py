"""The chunked KDA prefill (six stages) against the fp32 recurrence and each stage against its own reference,
under Triton's interpreter (CPU tensors); and which deployments plan the stages.

Everything here runs in fp32: Triton 3.8.0's interpreter multiplies bf16 ``tl.dot`` operands as their raw
uint16 bit patterns (``interpreter.py: create_dot`` converts only fp8), so bf16 runs only on the GPU
(``test_bf16_chain_on_gpu``). Sizes are small on purpose (K = V = 32, H <= 2): the interpreter runs every
program in numpy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3.kda_chunk import STAGES, chunk_kda_prefill, chunk_kda_reference
from warmreg_kimi_k3.kda_chunk_base import CHUNK_SIZE, chunk_metadata, chunk_rows, tuning_lengths
from warmreg_kimi_k3.kda_chunk_gate import KDAChunkGate, chunk_gate_reference
from warmreg_kimi_k3.kda_chunk_h import KDAChunkH, chunk_h_reference
from warmreg_kimi_k3.kda_chunk_intra import KDAChunkIntra, chunk_intra_reference
from warmreg_kimi_k3.kda_chunk_l2norm import KDAChunkL2Norm, l2norm_reference
from warmreg_kimi_k3.kda_chunk_o import KDAChunkO, chunk_o_reference
from warmreg_kimi_k3.kda_chunk_wu import KDAChunkWU, chunk_wu_reference

import warmreg

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAMES = [stage.name for stage in STAGES]
# fp32 end to end: the chunked form and the recurrence differ only in summation order and exp vs exp2 of the
# cumulative gate (about 1e-7 relative on these sizes, measured); 1e-5 leaves room for other numpy builds
# while a wrong decay, mask or chunk boundary gives errors of order 1e-2 and more.
FP32: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
# bf16 on the GPU: q, k, v and every intermediate but g and beta are bf16 (as in vLLM) and the dots are bf16
# with fp32 accumulation, against the fp32 recurrence of the same bf16 inputs: a few bf16 ulps (2**-8
# relative) of each of the ~64-term dot products, accumulated over a handful of chunks.
BF16: dict[str, Any] = {"atol": 3e-2, "rtol": 5e-2}


def _batch(
    lens: list[int], *, heads: int = 1, dim: int = 32, lower_bound: float | None = None, seed: int = 0,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> dict[str, Any]:  # fmt: skip
    """A varlen prefill batch: raw projections, parameters, cu_seqlens, a pool with one slot per sequence after a
    padding slot 0, has_initial_state alternating (first sequence True)."""
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "q": randn(t, heads, dim).to(dtype), "k": randn(t, heads, dim).to(dtype), "v": randn(t, heads, dim).to(dtype),
        # raw gate around -1 and exp(A_log) in [0.5, 2): decays mostly in (0.1, 1)
        "raw_g": (randn(t, heads, dim) - 1.0).to(dtype), "raw_beta": (2 * randn(t, heads)).to(dtype),
        "A_log": torch.log(0.5 + 1.5 * torch.rand(heads, generator=gen)), "dt_bias": 0.5 * randn(heads * dim),
        "lower_bound": lower_bound, "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "state_pool": 0.1 * randn(n + 1, heads, dim, dim), "state_slots": torch.arange(1, n + 1, dtype=torch.int32),
        "has_initial_state": torch.arange(n) % 2 == 0,
    }  # fmt: skip


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _check_chain(batch: dict[str, Any], tol: dict[str, Any] = FP32) -> None:
    expected_o, expected_pool = chunk_kda_reference(**batch)
    pool = batch["state_pool"].clone()
    o = chunk_kda_prefill(**{**batch, "state_pool": pool})
    assert o.shape == batch["v"].shape and o.dtype == batch["v"].dtype
    torch.testing.assert_close(o.float().cpu(), expected_o.float(), **tol)
    torch.testing.assert_close(pool.cpu(), expected_pool, **FP32 if tol is FP32 else BF16)


@pytest.mark.parametrize(
    ("lens", "heads", "lower_bound"),
    [([1, 63, 64, 65, 200], 2, None), ([65, 1, 200, 64, 63], 1, -5.0)],
    ids=["softplus-H2", "lower-bound-H1"],
)
def test_chain_matches_the_recurrence(lens: list[int], heads: int, lower_bound: float | None) -> None:
    """Lengths around the chunk size (1, 63, 64, 65) and several chunks (200) in one varlen batch, initial states
    mixed, both gates."""
    _check_chain(_batch(lens, heads=heads, lower_bound=lower_bound))


@pytest.mark.parametrize("config", range(4))
def test_every_candidate_matches(config: int) -> None:
    """Each autotune candidate of every stage (all have four), forced with ``warmreg.use_config``."""
    assert all(len(stage.tune_configs) == 4 for stage in STAGES)
    with warmreg.use_config(config):
        _check_chain(_batch([70], lower_bound=-5.0, seed=config))


def test_no_state_slot_and_no_bias() -> None:
    """A negative slot reads and writes nothing; a layer without dt_bias."""
    batch = _batch([40, 66])
    batch.update(dt_bias=None, state_slots=torch.tensor([-1, 2], dtype=torch.int32))
    batch["has_initial_state"] = torch.tensor([True, True])
    _check_chain(batch)


@pytest.mark.slow
def test_chain_at_the_real_head_dim() -> None:
    """K = V = 128 (Kimi-Linear's head_dim): two K tiles in the intra and output stages."""
    _check_chain(_batch([65, 130], dim=128, lower_bound=-5.0))


def test_stages_match_their_references() -> None:
    """Each stage on the previous stage's real outputs, against its own reference (the chain test could hide
    two compensating errors)."""
    b = _batch([70, 64], heads=2)
    cu = b["cu_seqlens"]
    chunks, offsets = chunk_metadata(cu)
    q, k = KDAChunkL2Norm()(b["q"]), KDAChunkL2Norm()(b["k"])
    torch.testing.assert_close(q, l2norm_reference(b["q"]), **FP32)
    g, beta = KDAChunkGate()(b["raw_g"], b["raw_beta"], b["A_log"], b["dt_bias"], None, cu, chunks)
    g_ref, beta_ref = chunk_gate_reference(b["raw_g"], b["raw_beta"], b["A_log"], b["dt_bias"], None, cu)
    torch.testing.assert_close(g, g_ref, **FP32)
    torch.testing.assert_close(beta, beta_ref, **FP32)
    aqk, akk = KDAChunkIntra()(q, k, g, beta, cu, chunks)
    aqk_ref, akk_ref = chunk_intra_reference(q, k, g, beta, cu)
    torch.testing.assert_close(torch.where(_on_or_below_diagonal(cu), aqk, 0.0), aqk_ref, **FP32)  # the rest unwritten
    torch.testing.assert_close(akk, akk_ref, **FP32)
    w, u, kg = KDAChunkWU()(k, b["v"], beta, akk, g, cu, chunks)
    for got, want in zip((w, u, kg), chunk_wu_reference(k, b["v"], beta, akk, g, cu), strict=True):
        torch.testing.assert_close(got, want, **FP32)
    pool = b["state_pool"].clone()
    h, v_new = KDAChunkH()(kg, w, u, g, cu, offsets, pool, b["state_slots"], b["has_initial_state"], chunks.shape[0])
    h_ref, v_new_ref, pool_ref = chunk_h_reference(
        kg, w, u, g, cu, b["state_pool"], b["state_slots"], b["has_initial_state"]
    )
    for got, want in ((h, h_ref), (v_new, v_new_ref), (pool, pool_ref)):
        torch.testing.assert_close(got, want, **FP32)
    o = KDAChunkO()(q, v_new, g, h, aqk, cu, chunks)
    torch.testing.assert_close(o, chunk_o_reference(q, v_new, g, h, aqk, cu), **FP32)


def _on_or_below_diagonal(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, 1, 64]``: column ``j`` of token ``t``'s row is at or below the diagonal of t's chunk."""
    pos = torch.zeros(int(cu_seqlens[-1]), dtype=torch.long)
    for rows in chunk_rows(cu_seqlens):
        pos[rows] = torch.arange(rows.stop - rows.start)
    return (torch.arange(CHUNK_SIZE)[None, :] <= pos[:, None])[:, None, :]


def test_chunk_metadata() -> None:
    chunks, offsets = chunk_metadata(torch.tensor([0, 1, 66, 66, 194], dtype=torch.int32))  # 1, 65, 0, 128 tokens
    assert chunks.tolist() == [[0, 0], [1, 0], [1, 1], [3, 0], [3, 1]]
    assert offsets.tolist() == [0, 1, 3, 3, 5]  # the empty sequence has no chunk
    assert sum(tuning_lengths(8192)) == 4096 and sum(tuning_lengths(100)) == 100 and len(set(tuning_lengths(8192))) == 4


def test_empty_batch_launches_nothing() -> None:
    b = _batch([], heads=1)
    o = chunk_kda_prefill(**b)
    assert o.shape == (0, 1, 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state_pool": torch.zeros(3, 1, 32, 16)}, "state_pool must be float32"),
        ({"has_initial_state": torch.ones(2, dtype=torch.int32)}, "has_initial_state must be bool"),
        ({"A_log": torch.zeros(2)}, "A_log must be float32 with 1"),
        ({"lower_bound": 1.0}, "lower_bound must be < 0"),
    ],
)
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(warmreg.LaunchError, match=message):
        chunk_kda_prefill(**{**_batch([3, 4]), **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 dots: see the module docstring)")
def test_bf16_chain_on_gpu() -> None:
    """bf16 activations and intermediates, as vLLM runs the chain, every candidate, against the fp32
    recurrence of the same inputs; K = V = 128, H = 12 as one rank of the example deployment."""
    for config in range(4):
        batch = _to(_batch([1, 63, 64, 65, 1000], heads=12, dim=128, lower_bound=-5.0, dtype=torch.bfloat16), "cuda")
        expected_o, expected_pool = chunk_kda_reference(**_to(batch, "cpu"))
        pool = batch["state_pool"].clone()
        with warmreg.use_config(config):
            o = chunk_kda_prefill(**{**batch, "state_pool": pool})
        torch.testing.assert_close(o.float().cpu(), expected_o.float(), **BF16)
        torch.testing.assert_close(pool.cpu(), expected_pool, **BF16)


# -- plans ------------------------------------------------------------------------------------------------------
def _example(name: str, **serving: Any) -> dict[str, Any]:
    data = json.loads((EXAMPLES / name).read_text())
    data.pop("description")
    data["serving"].update(serving)
    return data


def _stage_keys(plan: warmreg.Plan) -> dict[str, int]:
    return {kp.name: len(kp.keys) for kp in plan.kernels if kp.name in NAMES}


def test_forced_triton_plans_every_stage_and_candidate() -> None:
    plan = warmreg.plan(_example("kimi_k3_attn_res.json", kda_prefill_backend="triton"), target="cuda:90")
    assert _stage_keys(plan) == dict.fromkeys(NAMES, 4)  # one tuning key per stage, four candidates each
    gate = plan.kernel(KDAChunkGate.name)
    assert {key.fields()["use_lower_bound"] for key in gate.keys} == {True}  # gate_lower_bound -5.0
    assert sorted(key.fields()["config"] for key in gate.keys) == [0, 1, 2, 3]
    intra = plan.kernel(KDAChunkIntra.name)
    assert {attrs_fields(k) for k in intra.keys} == {("bfloat16", 12, 128, 64, 16)}


def attrs_fields(key: warmreg.CompileKey) -> tuple[Any, ...]:
    f = key.fields()
    return (f["dtype"], f["num_heads"], f["head_dim"], f["chunk_size"], f["sub_chunk"])


def test_no_lower_bound_resolves_to_triton_under_auto() -> None:
    data = _example("kimi_k3.json")
    del data["model"]["text_config"]["linear_attn_config"]["gate_lower_bound"]
    plan = warmreg.plan(data, target="cuda:90")
    assert _stage_keys(plan) == dict.fromkeys(NAMES, 4)
    assert {key.fields()["use_lower_bound"] for key in plan.kernel(KDAChunkGate.name).keys} == {False}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "cuda:120"])
def test_flashkda_plans_no_stage(target: str) -> None:
    """examples/kimi_k3.json: a lower bound, head_dim 128, bf16: vLLM's "auto" picks FlashKDA (C++)."""
    assert _stage_keys(warmreg.plan(EXAMPLES / "kimi_k3.json", target=target)) == {}


def test_rocm_without_gluon_or_fused_runs_triton() -> None:
    """gfx942: neither aiter's Gluon kernel nor the fused op (gfx950 only), so vLLM's ROCm Triton chain."""
    assert _stage_keys(warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942")) == dict.fromkeys(NAMES, 4)
    assert _stage_keys(warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx950")) == {}


def test_runtime_shapes_are_planned() -> None:
    """The chain's launches on a prefill of the deployment's shapes (meta tensors) land on planned tuning keys."""
    plan = warmreg.plan(_example("kimi_k3.json", kda_prefill_backend="triton"), target="cuda:90")
    base = {kp.name: {attrs_evolve_none(k) for k in kp.keys} for kp in plan.kernels if kp.name in NAMES}
    t, h, d = 3000, 12, 128
    act = warmreg.meta((t, h, d), torch.bfloat16)
    pool = warmreg.meta((257, h, d, d), torch.float32)
    keys = {
        KDAChunkL2Norm.name: KDAChunkL2Norm().dispatch(x=act),
        KDAChunkGate.name: KDAChunkGate().dispatch(
            raw_g=act,
            raw_beta=warmreg.meta((t, h), torch.bfloat16),
            dt_bias=warmreg.meta((h * d,), torch.float32),
            lower_bound=-5.0,
        ),
        KDAChunkIntra.name: KDAChunkIntra().dispatch(q=act),
        KDAChunkWU.name: KDAChunkWU().dispatch(k=act, v=act),
        KDAChunkH.name: KDAChunkH().dispatch(u=act, kg=act, state_pool=pool),
        KDAChunkO.name: KDAChunkO().dispatch(q=act, v_new=act),
    }
    for name, key in keys.items():
        assert key in base[name], name


def attrs_evolve_none(key: warmreg.CompileKey) -> warmreg.CompileKey:
    import attrs

    return attrs.evolve(key, config=None)  # type: ignore[call-arg]


class _Stages:
    """A plugin registering the given stage instances only (no other Kimi-K3 kernel)."""

    def __init__(self, kernels: list[warmreg.TritonKernel[Any]]) -> None:
        self.kernels = kernels

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        for kernel in self.kernels:
            registry.add(kernel)


@pytest.mark.slow
def test_warm_cross_compiles_the_stages_candidates_for_sm90() -> None:
    """Each stage compiles for SM90 through Triton's own path, stage i with its candidate i mod 4, so
    every candidate index and every stage is compiled once (6 binaries; compiling all 24 on this CPU
    takes about 90 s, and the H200 runs compile all 24 in every warm of examples/kimi_k3_full.json)."""
    config = _example("kimi_k3.json", kda_prefill_backend="triton")
    plan = warmreg.plan(config, target="cuda:90")
    assert sum(_stage_keys(plan).values()) == 24
    kernels = []
    for i, name in enumerate(NAMES):
        kernel = copy.copy(plan.kernel(name).kernel)
        kernel.tune_configs = (type(kernel).tune_configs[i % 4],)  # type: ignore[misc]
        kernels.append(kernel)
    report = warmreg.warm(config, target="cuda:90", workers=2, plugins=[_Stages(kernels)], entry_points=False)
    assert report.ok and report.declared == 6 and {r.kernel for r in report.results} == set(NAMES)
