"""The chunked KDA prefill (six stages) against the fp32 recurrence and each stage against its own reference,
under Triton's interpreter (CPU tensors); and which deployments plan the stages. (Bitwise equality with vLLM's
own kernels: ``tests/engines/test_vllm_kernels_kda_chunk.py``, in the vLLM venv.)

Everything here runs in fp32: Triton 3.8.0's interpreter multiplies bf16 ``tl.dot`` operands as their raw
uint16 bit patterns (``interpreter.py: create_dot`` converts only fp8), so bf16 runs only on the GPU
(``test_bf16_chain_on_gpu``). Sizes are small on purpose (K = V = 32, H <= 2): the interpreter runs every
program in numpy.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

import attrs
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
from warmreg.testing import OpCall, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAMES = [stage.name for stage in STAGES]
#: Keys planned per stage: one tuning key, four candidates each, but the L2 norm (untuned, as vLLM's).
PLANNED = {name: 1 if name == KDAChunkL2Norm.name else 4 for name in NAMES}
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
    """A varlen prefill batch as vLLM's layer passes it to ``chunk_kda_with_fused_gate``: ``[1, T, H, D]``
    activations, raw beta a column block of a wider projection, initial states ``[N, H, V, K]`` as
    ``gather_initial_states`` returns them (zeros for the sequences without one: every other, the first
    has one)."""
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    state = 0.1 * randn(n, heads, dim, dim)
    state[1::2] = 0.0
    return {
        "q": randn(1, t, heads, dim).to(dtype), "k": randn(1, t, heads, dim).to(dtype),
        "v": randn(1, t, heads, dim).to(dtype),
        # raw gate around -1 and exp(A_log) in [0.5, 2): decays mostly in (0.1, 1)
        "raw_g": (randn(1, t, heads, dim) - 1.0).to(dtype), "raw_beta": (2 * randn(1, t, heads + 3)).to(dtype)[..., :heads],
        "A_log": torch.log(0.5 + 1.5 * torch.rand(heads, generator=gen)), "g_bias": 0.5 * randn(heads * dim),
        "lower_bound": lower_bound, "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        "initial_state": state, "use_qk_l2norm_in_kernel": True,
    }  # fmt: skip


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _check_chain(batch: dict[str, Any], tol: dict[str, Any] = FP32) -> None:
    expected_o, expected_final = chunk_kda_reference(**batch)
    v = batch["v"].clone()
    o, final = chunk_kda_prefill(**{**batch, "v": v}, output_final_state=True)
    assert o is v  # no out: vLLM writes the output into (contiguous) v
    assert o.shape == batch["v"].shape and o.dtype == batch["v"].dtype and final is not None
    torch.testing.assert_close(o.float().cpu(), expected_o, **tol)
    assert final.dtype == torch.float32 and final.shape == expected_final.shape
    torch.testing.assert_close(final.cpu(), expected_final, **FP32 if tol is FP32 else BF16)


@pytest.mark.parametrize(
    ("lens", "heads", "lower_bound"),
    [([1, 63, 64, 65, 200], 2, None), ([65, 1, 200, 64, 63], 1, -5.0)],
    ids=["softplus-H2", "lower-bound-H1"],
)
def test_chain_matches_the_recurrence(lens: list[int], heads: int, lower_bound: float | None) -> None:
    """Lengths around the chunk size (1, 63, 64, 65) and several chunks (200) in one varlen batch, initial states
    mixed, both gates (the lower bound takes the intra stage's sub-chunk path)."""
    _check_chain(_batch(lens, heads=heads, lower_bound=lower_bound))


@pytest.mark.parametrize("config", range(4))
def test_every_candidate_matches(config: int) -> None:
    """Each autotune candidate of every tuned stage (all have four), forced with ``warmreg.use_config``."""
    assert all(len(stage.tune_configs) == 4 for stage in STAGES if stage is not KDAChunkL2Norm)
    assert KDAChunkL2Norm.tune_configs == ()  # vLLM's l2norm_fwd_kernel2 is not autotuned
    with warmreg.use_config(config):
        _check_chain(_batch([70], lower_bound=-5.0 if config % 2 else None, seed=config))


def test_no_initial_state_and_no_bias() -> None:
    """``initial_state=None`` (zeros, USE_INITIAL_STATE off) and a layer without dt_bias."""
    _check_chain({**_batch([40, 66]), "initial_state": None, "g_bias": None})


def test_out_is_written_and_returned_and_v_left_alone() -> None:
    """With ``out`` (the layer's ``core_attn_out`` slice) the output lands there and v keeps its values; without
    final states the second result is None; a non-contiguous v is copied (vLLM's ``v.contiguous()``) and the
    output lands in the copy."""
    b = _batch([3, 70], heads=2)
    expected_o, _ = chunk_kda_reference(**b)
    out, v = torch.full_like(b["v"], float("nan")), b["v"].clone()
    o, final = chunk_kda_prefill(**{**b, "v": v}, out=out)
    assert o is out and final is None and torch.equal(v, b["v"])
    torch.testing.assert_close(o, expected_o, **FP32)
    wide = torch.cat([b["v"], torch.zeros_like(b["v"])], -1)[..., :32]
    o, _ = chunk_kda_prefill(**{**b, "v": wide})
    assert o.is_contiguous() and o.data_ptr() != wide.data_ptr() and torch.equal(wide, b["v"])
    torch.testing.assert_close(o, expected_o, **FP32)


@pytest.mark.slow
def test_chain_at_the_real_head_dim() -> None:
    """K = V = 128 (Kimi-Linear's head_dim): two K tiles of 64 in the state stage, four in the output's."""
    _check_chain(_batch([65, 130], dim=128, lower_bound=-5.0))


def test_stages_match_their_references() -> None:
    """Each stage on the previous stage's real outputs, against its own reference (the chain test could hide
    two compensating errors)."""
    b = _batch([70, 64], heads=2)
    cu = b["cu_seqlens"]
    chunks, offsets = chunk_metadata(cu)
    q, k = KDAChunkL2Norm()(b["q"][0]), KDAChunkL2Norm()(b["k"][0])
    torch.testing.assert_close(q, l2norm_reference(b["q"][0]), **FP32)
    raw_g, raw_beta, v = b["raw_g"][0], b["raw_beta"][0], b["v"][0]
    g, beta = KDAChunkGate()(raw_g, raw_beta, b["A_log"], b["g_bias"], None, cu, chunks)
    g_ref, beta_ref = chunk_gate_reference(raw_g, raw_beta, b["A_log"], b["g_bias"], None, cu)
    torch.testing.assert_close(g, g_ref, **FP32)
    torch.testing.assert_close(beta, beta_ref, **FP32)
    aqk, akk = KDAChunkIntra()(q, k, g, beta, cu, chunks)
    aqk_ref, akk_ref = chunk_intra_reference(q, k, g, beta, cu)
    torch.testing.assert_close(torch.where(_on_or_below_diagonal(cu), aqk, 0.0), aqk_ref, **FP32)  # the rest unwritten
    torch.testing.assert_close(akk, akk_ref, **FP32)
    w, u, kg = KDAChunkWU()(k, v, beta, akk, g, cu, chunks)
    for got, want in zip((w, u, kg), chunk_wu_reference(k, v, beta, akk, g, cu), strict=True):
        torch.testing.assert_close(got, want, **FP32)
    h, v_new, final = KDAChunkH()(kg, w, u, g, cu, offsets, b["initial_state"], chunks.shape[0])
    for got, want in zip((h, v_new, final), chunk_h_reference(kg, w, u, g, cu, b["initial_state"]), strict=True):
        torch.testing.assert_close(got, want, **FP32)
    aqk = torch.where(_on_or_below_diagonal(cu), aqk, torch.nan)  # what the intra stage leaves unwritten: any bits
    o = KDAChunkO()(q, v_new, g, h, aqk, cu, chunks)
    assert not o.isnan().any(), "the output stage reads A_qk above the diagonal"
    torch.testing.assert_close(o, chunk_o_reference(q, v_new, g, h, aqk, cu), **FP32)


def test_lower_bound_intra_and_no_final_state() -> None:
    """The intra stage's sub-chunk path (a gate lower bound) against its reference; the state stage without
    initial or final states."""
    b = _batch([23, 64, 5], heads=2, lower_bound=-5.0, seed=3)
    cu = b["cu_seqlens"]
    chunks, offsets = chunk_metadata(cu)
    q, k = l2norm_reference(b["q"][0]), l2norm_reference(b["k"][0])
    g, beta = chunk_gate_reference(b["raw_g"][0], b["raw_beta"][0], b["A_log"], b["g_bias"], -5.0, cu)
    aqk, akk = KDAChunkIntra()(q, k, g, beta, cu, chunks, safe_gate=True)
    aqk_ref, akk_ref = chunk_intra_reference(q, k, g, beta, cu)
    torch.testing.assert_close(torch.where(_on_or_below_diagonal(cu), aqk, 0.0), aqk_ref, **FP32)
    torch.testing.assert_close(akk, akk_ref, **FP32)
    w, u, kg = chunk_wu_reference(k, b["v"][0], beta, akk_ref, g, cu)
    h, v_new, final = KDAChunkH()(kg, w, u, g, cu, offsets, None, chunks.shape[0], output_final_state=False)
    h_ref, v_new_ref, _ = chunk_h_reference(kg, w, u, g, cu, None)
    assert final is None
    torch.testing.assert_close(h, h_ref, **FP32)
    torch.testing.assert_close(v_new, v_new_ref, **FP32)


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
    o, final = chunk_kda_prefill(**b, output_final_state=True)
    assert o.shape == (1, 0, 1, 32) and final is not None and final.shape == (0, 1, 32, 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"initial_state": torch.zeros(2, 1, 32, 16)}, r"initial_state must be a contiguous float \[N, H, V, K\]"),
        ({"A_log": torch.zeros(2)}, "A_log must be float32 with 1"),
        ({"lower_bound": 1.0}, "lower_bound must be < 0"),
        ({"cu_seqlens": None}, "needs cu_seqlens"),
        ({"q": torch.zeros(2, 7, 1, 32)}, r"q of shape \[1, T, H, K\]"),
    ],
)
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    """Shapes the chain cannot take are refused, naming the stage (or the chain)."""
    with pytest.raises(warmreg.LaunchError, match=message):
        chunk_kda_prefill(**{**_batch([3, 4]), **change}, output_final_state=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 dots: see the module docstring)")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower-bound"])
def test_bf16_chain_on_gpu(lower_bound: float | None) -> None:
    """bf16 activations and intermediates, as vLLM runs the chain, every candidate, against the fp32
    recurrence of the same inputs; K = V = 128, H = 12 as one rank of the example deployment; both gates (the
    intra stage's two paths), the inverse's tf32 products on sm >= 80."""
    for config in range(4):
        batch = _to(
            _batch([1, 63, 64, 65, 1000], heads=12, dim=128, lower_bound=lower_bound, dtype=torch.bfloat16), "cuda"
        )
        expected_o, expected_final = chunk_kda_reference(**_to(batch, "cpu"))
        with warmreg.use_config(config):
            o, final = chunk_kda_prefill(**{**batch, "v": batch["v"].clone()}, output_final_state=True)
        assert final is not None
        torch.testing.assert_close(o.float().cpu(), expected_o, **BF16)
        torch.testing.assert_close(final.cpu(), expected_final, **BF16)


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
    assert _stage_keys(plan) == PLANNED
    gate = plan.kernel(KDAChunkGate.name)
    assert {key.fields()["use_lower_bound"] for key in gate.keys} == {True}  # gate_lower_bound -5.0
    assert sorted(key.fields()["config"] for key in gate.keys) == [0, 1, 2, 3]
    intra = plan.kernel(KDAChunkIntra.name)
    # the lower bound takes vLLM's sub-chunk path; sm90 its tf32 solve
    assert {attrs_fields(k) for k in intra.keys} == {("bfloat16", 12, 128, 64, 16, 128, True, "tf32")}
    (h,) = {attrs_evolve_none(k) for k in plan.kernel(KDAChunkH.name).keys}
    fields = h.fields()
    assert (fields["initial_state_dtype"], fields["initial_state_aligned"], fields["store_final_state"]) == (
        "float32",
        True,
        True,
    )


def attrs_fields(key: warmreg.CompileKey) -> tuple[Any, ...]:
    f = key.fields()
    return tuple(f[n] for n in ("dtype", "num_heads", "head_dim", "chunk_size", "sub_chunk", "block_k_diag",
                                "safe_gate", "solve_precision"))  # fmt: skip


def test_no_lower_bound_resolves_to_triton_under_auto() -> None:
    data = _example("kimi_k3.json")
    del data["model"]["text_config"]["linear_attn_config"]["gate_lower_bound"]
    plan = warmreg.plan(data, target="cuda:90")
    assert _stage_keys(plan) == PLANNED
    assert {key.fields()["use_lower_bound"] for key in plan.kernel(KDAChunkGate.name).keys} == {False}
    assert {key.fields()["safe_gate"] for key in plan.kernel(KDAChunkIntra.name).keys} == {False}


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "cuda:120"])
def test_flashkda_plans_no_stage(target: str) -> None:
    """examples/kimi_k3.json: a lower bound, head_dim 128, bf16: vLLM's "auto" picks FlashKDA (C++)."""
    assert _stage_keys(warmreg.plan(EXAMPLES / "kimi_k3.json", target=target)) == {}


def test_rocm_without_gluon_or_fused_runs_triton() -> None:
    """gfx942: neither aiter's Gluon kernel nor the fused op (gfx950 only), so vLLM's ROCm Triton chain."""
    plan = warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942")
    assert _stage_keys(plan) == PLANNED
    assert {key.fields()["solve_precision"] for key in plan.kernel(KDAChunkIntra.name).keys} == {"ieee"}
    assert _stage_keys(warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx950")) == {}


def test_runtime_shapes_are_planned() -> None:
    """The chain's launches on a prefill of the deployment's shapes (meta tensors) land on planned tuning keys:
    the layer's initial states (gather_initial_states' fresh fp32 [N, H, V, K]), the output written into v or
    the layer's out (aligned views of the activation dtype)."""
    plan = warmreg.plan(_example("kimi_k3.json", kda_prefill_backend="triton"), target="cuda:90")
    base = {kp.name: {attrs_evolve_none(k) for k in kp.keys} for kp in plan.kernels if kp.name in NAMES}
    t, h, d = 3000, 12, 128
    act = warmreg.meta((t, h, d), torch.bfloat16)
    state = warmreg.meta((37, h, d, d), torch.float32)
    out = warmreg.meta((1, t + 5, h, d), torch.bfloat16)[0, 5:]  # core_attn_out[:, non_spec_slice]
    keys = {
        KDAChunkL2Norm.name: KDAChunkL2Norm().dispatch(x=act),
        KDAChunkGate.name: KDAChunkGate().dispatch(
            raw_g=act,
            raw_beta=warmreg.meta((t, h), torch.bfloat16),
            dt_bias=warmreg.meta((h * d,), torch.float32),
            lower_bound=-5.0,
        ),
        KDAChunkIntra.name: KDAChunkIntra().dispatch(q=act, safe_gate=True, solve_precision="tf32"),
        KDAChunkWU.name: KDAChunkWU().dispatch(k=act, v=act),
        KDAChunkH.name: KDAChunkH().dispatch(u=act, kg=act, initial_state=state, output_final_state=True),
    }
    for name, key in keys.items():
        assert key in base[name], name
    for o in (act, out):
        assert KDAChunkO().dispatch(q=act, v_new=act, out=o) in base[KDAChunkO.name]


def attrs_evolve_none(key: warmreg.CompileKey) -> warmreg.CompileKey:
    if not hasattr(key, "config"):
        return key
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
    """Each stage compiles for SM90 through Triton's own path, each tuned stage i with its candidate i mod 4,
    so every candidate index and every stage is compiled once (6 binaries; compiling all 21 on this CPU
    takes about 90 s, and the H200 runs compile all 21 in every warm of examples/kimi_k3_full.json)."""
    config = _example("kimi_k3.json", kda_prefill_backend="triton")
    plan = warmreg.plan(config, target="cuda:90")
    assert sum(_stage_keys(plan).values()) == 21
    kernels = []
    for i, name in enumerate(NAMES):
        kernel = copy.copy(plan.kernel(name).kernel)
        if kernel.tune_configs:
            kernel.tune_configs = (type(kernel).tune_configs[i % 4],)  # type: ignore[misc]
        kernels.append(kernel)
    report = warmreg.warm(config, target="cuda:90", workers=2, plugins=[_Stages(kernels)], entry_points=False)
    assert report.ok and report.declared == 6 and {r.kernel for r in report.results} == set(NAMES)


# -- out= of the six stages (the kit's check_out), their inputs from the stage references ----------------------
def _stage_inputs() -> dict[str, Any]:
    """A two-sequence prefill (a full chunk and a partial one, two heads) and each stage's inputs, from the stage
    references; fp32 as above. Activations without vLLM's leading batch dim of 1, as the stages take them."""
    b = _batch([70, 3], heads=2, lower_bound=-5.0)
    b = {k: v[0] if k in ("q", "k", "v", "raw_g", "raw_beta") else v for k, v in b.items()}
    cu = b["cu_seqlens"]
    chunks, offsets = chunk_metadata(cu)
    q, k = l2norm_reference(b["q"]), l2norm_reference(b["k"])
    g, beta = chunk_gate_reference(b["raw_g"], b["raw_beta"], b["A_log"], b["g_bias"], -5.0, cu)
    aqk, akk = chunk_intra_reference(q, k, g, beta, cu)
    w, u, kg = chunk_wu_reference(k, b["v"], beta, akk, g, cu)
    h, v_new, _ = chunk_h_reference(kg, w, u, g, cu, b["initial_state"])
    return {**b, "qn": q, "kn": k, "g": g, "beta": beta, "aqk": aqk, "akk": akk, "w": w, "u": u, "kg": kg, "h": h,
            "v_new": v_new, "chunk_indices": chunks, "chunk_offsets": offsets}  # fmt: skip


def _l2norm_call() -> OpCall:
    return OpCall(KDAChunkL2Norm(), (_stage_inputs()["q"],))


def _gate_call() -> OpCall:
    c = _stage_inputs()
    return OpCall(KDAChunkGate(), (c["raw_g"], c["raw_beta"], c["A_log"], c["g_bias"], -5.0, c["cu_seqlens"], c["chunk_indices"]))


def _intra_call() -> OpCall:
    """A_qk is written on and below the diagonal of each chunk only; the fp32 scratch workspace comes with out."""
    c = _stage_inputs()
    args = (c["qn"], c["kn"], c["g"], c["beta"], c["cu_seqlens"], c["chunk_indices"])
    below = _on_or_below_diagonal(c["cu_seqlens"]).expand(-1, 2, -1)
    workspace = {"workspace": lambda out: torch.full((*out[0].shape[:2], 16), float("nan"))}
    return OpCall(KDAChunkIntra(), args, {"safe_gate": True}, masks=(below, None), scratch=workspace)


def _wu_call() -> OpCall:
    c = _stage_inputs()
    return OpCall(KDAChunkWU(), (c["kn"], c["v"], c["beta"], c["akk"], c["g"], c["cu_seqlens"], c["chunk_indices"]))


def _h_call() -> OpCall:
    c = _stage_inputs()
    args = (c["kg"], c["w"], c["u"], c["g"], c["cu_seqlens"], c["chunk_offsets"], c["initial_state"],
            c["chunk_indices"].shape[0])  # fmt: skip
    return OpCall(KDAChunkH(), args)


def _o_call() -> OpCall:
    c = _stage_inputs()
    return OpCall(KDAChunkO(), (c["qn"], c["v_new"], c["g"], c["h"], c["aqk"], c["cu_seqlens"], c["chunk_indices"]))


STAGE_CALLS = {"l2norm": _l2norm_call, "gate": _gate_call, "intra": _intra_call, "wu": _wu_call, "h": _h_call, "o": _o_call}


@pytest.mark.parametrize("stage", STAGE_CALLS)
def test_stage_out(stage: str) -> None:
    # the output stage stores into its out's float dtype, its alignment a key field (vLLM passes the layer's v)
    check_out(STAGE_CALLS[stage], accepts={"another dtype", "misaligned"} if stage == "o" else ())


def test_stage_out_tuples_and_the_workspace_are_checked() -> None:
    call = _intra_call()
    aqk, akk = call.launch_code().outputs
    with pytest.raises(warmreg.LaunchError, match=r"out must be a tuple of 2 tensors \(A_qk, A_kk\), got Tensor"):
        call(out=aqk)
    with pytest.raises(warmreg.LaunchError, match="got tuple of 1"):
        call(out=(aqk,))
    with pytest.raises(warmreg.LaunchError, match="workspace is "):
        call(out=(aqk, akk), workspace=torch.empty(aqk.shape, dtype=torch.bfloat16))


#: What building a tuning batch may run on its device: fresh byte buffers, their zero fill, copies of the metadata
#: built on the host, and views.
_TUNING_DEVICE_OPS = {"aten.zeros.default", "aten.empty.memory_format", "aten._to_copy.default", "aten.view.dtype",
                      "aten.view.default", "aten.slice.Tensor", "aten.select.int", "aten.detach.default"}  # fmt: skip


@pytest.mark.parametrize("stage", STAGES, ids=NAMES)
def test_the_tuning_batch_launches_the_tuning_key_from_byte_zeros_and_host_metadata(stage: Any) -> None:
    """A stage's tuning inputs (what warm benchmarks its candidates on, and what its rehearsal launches, the first
    use of them in a warm from a pack) give back its tuning key over the tuning batch's real chunk metadata, and
    run nothing on the device but byte fills, copies of that host-built metadata and views: torch loads each of
    its kernels at its first use in a process (randn, a cast, normalize, cumsum, repeat_interleave: 0.16 s in all
    on an H100, measured), which such a warm would otherwise pay."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class DeviceOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()
            self.fills: set[torch.dtype] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "meta"]
            if made:
                self.ops.add(str(func))
                if str(func) == "aten.zeros.default":
                    self.fills.update(t.dtype for t in made)
            return out

    plan = warmreg.plan(_example("kimi_k3.json", kda_prefill_backend="triton"), target="cuda:90")
    key = attrs_evolve_none(next(iter(plan.kernel(stage.name).keys)))
    kernel = plan.kernel(stage.name).kernel_for(key)
    with DeviceOps() as device:
        kernel.tuning_inputs(key, torch.device("meta"))
    assert device.ops <= _TUNING_DEVICE_OPS, device.ops - _TUNING_DEVICE_OPS
    assert device.fills <= {torch.uint8}
    inputs = kernel.tuning_inputs(key, torch.device("cpu"))
    lens = tuning_lengths(kernel.max_num_batched_tokens)
    if "cu_seqlens" in inputs:
        want_chunks, want_offsets = chunk_metadata(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32))
        assert inputs["cu_seqlens"].tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
        assert torch.equal(inputs.get("chunk_indices", want_chunks), want_chunks)
        assert torch.equal(inputs.get("chunk_offsets", want_offsets), want_offsets)
    data = [v for name, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and name != "out"]
    assert data and all(not v.any() for v in data)
    spec = inspect.unwrap(getattr(type(kernel), kernel.launcher))(kernel, **inputs)
    assert attrs_evolve_none(spec.key) == key
