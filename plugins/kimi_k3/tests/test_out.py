"""``out=`` on every allocating Kimi-K3 op, under Triton's interpreter (CPU tensors): with ``out`` the op returns
the caller's tensors themselves, writes every element it writes without ``out`` (the buffers start as garbage:
NaN, or 7777 for integers), allocates nothing in its launch code, and refuses a buffer of another shape or dtype
naming the parameter.

``kimi_k3.stage_spec_decode_metadata`` writes in place into the caller's graph buffers and allocates nothing, so
it takes no ``out``. Inputs come from each op's own test module (same helpers, small sizes); the chunked-prefill
stages take their inputs from the stage references (pure PyTorch) rather than from the kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import pytest
import test_attn_res
import test_causal_conv1d
import test_causal_conv1d_update
import test_gated_rmsnorm
import test_kda
import test_kda_chunk
import test_kda_packed_decode
import test_kda_state_indices
import torch
from warmreg_kimi_k3.causal_conv1d import conv1d_chunks
from warmreg_kimi_k3.gather_initial_states import GatherInitialStates
from warmreg_kimi_k3.kda import KDARecurrent
from warmreg_kimi_k3.kda_chunk_base import chunk_metadata
from warmreg_kimi_k3.kda_chunk_gate import KDAChunkGate, chunk_gate_reference
from warmreg_kimi_k3.kda_chunk_h import KDAChunkH, chunk_h_reference
from warmreg_kimi_k3.kda_chunk_intra import KDAChunkIntra, chunk_intra_reference
from warmreg_kimi_k3.kda_chunk_l2norm import KDAChunkL2Norm, l2norm_reference
from warmreg_kimi_k3.kda_chunk_o import KDAChunkO
from warmreg_kimi_k3.kda_chunk_wu import KDAChunkWU, chunk_wu_reference
from warmreg_kimi_k3.kda_packed_decode import KDAPackedDecode
from warmreg_kimi_k3.kda_state_indices import AlignedStateIndices

import warmreg

EXACT: dict[str, Any] = {"atol": 0, "rtol": 0}  # index ops


class Case(NamedTuple):
    """One op's launch: fresh inputs on every build (several ops update their inputs in place)."""

    kernel: warmreg.TritonKernel[Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tol: dict[str, Any]  # the op's own test tolerance (EXACT for index ops)
    masks: tuple[torch.Tensor | None, ...] = ()  # per output: where it is written (None: everywhere)

    def launch(self, **extra: Any) -> Any:
        return cast(Callable[..., Any], self.kernel)(*self.args, **self.kwargs, **extra)

    def launch_code(self, **extra: Any) -> warmreg.LaunchSpec[Any]:
        """The launcher's body alone (the method ``kernel_launcher`` wraps): the spec, nothing launched."""
        return type(self.kernel).__call__.__wrapped__(self.kernel, *self.args, **self.kwargs, **extra)  # type: ignore[attr-defined, no-any-return]


def _attn_res() -> Case:
    inputs = test_attn_res._inputs(3, 96, 6, delta=True, norm=True, seed=3)  # updates prefix and blocks in place
    return Case(test_attn_res._kernel(96), (), {**inputs, "num_blocks": 5, "block_write_idx": 2, "eps": 1e-5},
                test_attn_res.TOL)  # fmt: skip


def _causal_conv1d() -> Case:
    b = test_causal_conv1d._batch([3, 9, 2])  # no sequence on the null line: every row is written
    ci, hi = torch.tensor([3, 1, 7], dtype=torch.int32), torch.tensor([True, False, True])
    args = (b["x"], b["weight"], None, b["conv_states"], b["query_start_loc"], ci, hi)
    chunks = conv1d_chunks(b["query_start_loc"])  # passed, as an engine does: built here it would allocate
    return Case(test_causal_conv1d.KERNEL, args, {"chunks": chunks, "launch_pdl": False}, test_causal_conv1d.BF16)


def _causal_conv1d_update() -> Case:
    x, state, w = test_causal_conv1d_update._inputs(4, 3)
    ci = torch.tensor([4, 1, 2, 7], dtype=torch.int32)
    return Case(test_causal_conv1d_update.KERNEL, (x, state, w), {"conv_state_indices": ci, "launch_pdl": False},
                test_causal_conv1d_update.BF16)  # fmt: skip


def _gated_rmsnorm() -> Case:
    x, g, w = test_gated_rmsnorm._inputs(5, 3, 128, torch.bfloat16, seed=8)
    atol, rtol = test_gated_rmsnorm.TOL[torch.bfloat16]
    return Case(test_gated_rmsnorm.GatedRMSNorm(num_heads=3, head_dim=128), (x, g, w), {}, {"atol": atol, "rtol": rtol})


def _gather_initial_states() -> Case:
    # the inputs of test_gather_initial_states.test_matches_reference (built inline there too)
    state = torch.randn(6, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    indices, has = torch.tensor([3, 0, 5, 3], dtype=torch.int32), torch.tensor([True, False, True, True])
    kernel = GatherInitialStates(num_heads=2, head_dim=8, max_num_seqs=4)
    return Case(kernel, (state, indices, has), {"launch_pdl": False}, EXACT)


def _kda_recurrent() -> Case:
    # a speculative step with a null-slot sequence (zero rows for all its tokens): every row is written
    step = test_kda._step([1, 3, 2], heads=2, k_dim=16, v_dim=32, lower_bound=-5.0)
    indices = torch.tensor([[3, 4, 5], [0, 6, 7], [1, 2, 0]], dtype=torch.int32)
    kwargs = {**step, "initial_state": test_kda._pool(8, 2, 16, 32), "ssm_state_indices": indices,
              "num_accepted_tokens": torch.tensor([1, 1, 2], dtype=torch.int32), "launch_pdl": False}  # fmt: skip
    return Case(KDARecurrent(num_heads=2, head_k_dim=16, head_v_dim=32), (), kwargs, test_kda.TOLERANCES[torch.bfloat16])


def _kda_packed_decode() -> Case:
    m = test_kda_packed_decode
    inputs = m._inputs(4, 3 * m.H * m.D + 24)
    kwargs = {**inputs, "lower_bound": None, "state_indices": torch.tensor([4, 0, 2, 7], dtype=torch.int32),
              "launch_pdl": False}  # fmt: skip
    return Case(KDAPackedDecode(layout=m.LAYOUT), (), kwargs, m.BF16)


def _aligned_state_indices() -> Case:
    table = test_kda_state_indices._table(5, 12)
    seq_lens = torch.tensor([0, 1, 17, 40, 100], dtype=torch.int32)
    kernel = AlignedStateIndices(max_num_seqs=4, num_speculative_tokens=3)
    return Case(kernel, (table, seq_lens), {"block_size": 16, "num_state_slots": 3, "launch_pdl": False}, EXACT)


def _chunk_inputs() -> dict[str, Any]:
    """A two-sequence prefill (a full chunk and a partial one, two heads) and each stage's inputs, from the stage
    references; fp32 as the chunked-prefill tests (see test_kda_chunk's docstring). Activations without vLLM's
    leading batch dim of 1, as the stages take them."""
    b = test_kda_chunk._batch([70, 3], heads=2, lower_bound=-5.0)
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


def _chunk_l2norm() -> Case:
    return Case(KDAChunkL2Norm(), (_chunk_inputs()["q"],), {}, test_kda_chunk.FP32)


def _chunk_gate() -> Case:
    c = _chunk_inputs()
    args = (c["raw_g"], c["raw_beta"], c["A_log"], c["g_bias"], -5.0, c["cu_seqlens"], c["chunk_indices"])
    return Case(KDAChunkGate(), args, {}, test_kda_chunk.FP32)


def _chunk_intra() -> Case:
    c = _chunk_inputs()
    args = (c["qn"], c["kn"], c["g"], c["beta"], c["cu_seqlens"], c["chunk_indices"])
    below = test_kda_chunk._on_or_below_diagonal(c["cu_seqlens"]).expand(-1, 2, -1)  # A_qk's written part
    return Case(KDAChunkIntra(), args, {"safe_gate": True}, test_kda_chunk.FP32, masks=(below, None))


def _chunk_wu() -> Case:
    c = _chunk_inputs()
    args = (c["kn"], c["v"], c["beta"], c["akk"], c["g"], c["cu_seqlens"], c["chunk_indices"])
    return Case(KDAChunkWU(), args, {}, test_kda_chunk.FP32)


def _chunk_h() -> Case:
    c = _chunk_inputs()
    args = (c["kg"], c["w"], c["u"], c["g"], c["cu_seqlens"], c["chunk_offsets"], c["initial_state"],
            c["chunk_indices"].shape[0])  # fmt: skip
    return Case(KDAChunkH(), args, {}, test_kda_chunk.FP32)


def _chunk_o() -> Case:
    c = _chunk_inputs()
    args = (c["qn"], c["v_new"], c["g"], c["h"], c["aqk"], c["cu_seqlens"], c["chunk_indices"])
    return Case(KDAChunkO(), args, {}, test_kda_chunk.FP32)


CASES: dict[str, Callable[[], Case]] = {
    "attn_res": _attn_res,
    "causal_conv1d": _causal_conv1d,
    "causal_conv1d_update": _causal_conv1d_update,
    "gated_rmsnorm": _gated_rmsnorm,
    "gather_initial_states": _gather_initial_states,
    "kda_recurrent": _kda_recurrent,
    "kda_packed_decode": _kda_packed_decode,
    "aligned_state_indices": _aligned_state_indices,
    "kda_chunk_l2norm": _chunk_l2norm,
    "kda_chunk_gate": _chunk_gate,
    "kda_chunk_intra": _chunk_intra,
    "kda_chunk_wu": _chunk_wu,
    "kda_chunk_h": _chunk_h,
    "kda_chunk_o": _chunk_o,
}


def _as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, tuple | list) else (result,)


def _garbage_like(x: torch.Tensor) -> torch.Tensor:
    """A buffer shaped like x, filled with what no kernel writes: NaN, or 7777 for integers."""
    return torch.full_like(x, float("nan") if x.dtype.is_floating_point else 7777)


def _out_arg(buffers: tuple[torch.Tensor, ...]) -> Any:
    return buffers if len(buffers) > 1 else buffers[0]


def _extra(case: Case, buffers: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """``out=`` and, for the intra stage, its fp32 scratch ``workspace=`` (garbage too)."""
    extra: dict[str, Any] = {"out": _out_arg(buffers)}
    if isinstance(case.kernel, KDAChunkIntra):
        extra["workspace"] = torch.full((*buffers[0].shape[:2], 16), float("nan"))
    return extra


def test_every_launcher_is_covered() -> None:
    """Every allocating op of the plugin has a case here (the staging op writes in place: no out)."""
    names = {build().kernel.name for build in CASES.values()}
    assert len(names) == len(CASES) == 14
    assert "kimi_k3.stage_spec_decode_metadata" not in names


@pytest.mark.parametrize("op", CASES)
def test_out_is_returned_and_fully_written(op: str) -> None:
    want = _as_tuple(CASES[op]().launch())
    case = CASES[op]()  # fresh inputs: the first launch may have updated its own in place
    buffers = tuple(_garbage_like(x) for x in want)
    got = _as_tuple(case.launch(**_extra(case, buffers)))
    assert len(got) == len(buffers) and all(g is b for g, b in zip(got, buffers))
    masks = case.masks or (None,) * len(want)
    for g, w, mask in zip(got, want, masks, strict=True):
        if mask is not None:
            g, w = torch.where(mask, g, 0.0), torch.where(mask, w, 0.0)
        torch.testing.assert_close(g, w, **case.tol)


@pytest.mark.parametrize("op", CASES)
def test_launch_code_allocates_nothing_with_out(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch code alone (the method under ``kernel_launcher``, so nothing is launched), with every torch
    allocator refusing."""
    case = CASES[op]()
    extra = _extra(case, tuple(torch.empty_like(x) for x in _as_tuple(case.launch_code().outputs)))

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("allocated with out= given")

    for name in ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full", "full_like", "ones"):
        monkeypatch.setattr(torch, name, refuse)
    for name in ("new_empty", "new_zeros", "new_full", "new_ones"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    outputs = case.launch_code(**extra).outputs
    assert all(o is b for o, b in zip(_as_tuple(outputs), _as_tuple(extra["out"]), strict=True))


def _bad(want: tuple[torch.Tensor, ...]) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
    """One wrong buffer: the last output one element longer (one output) or of another dtype (several)."""
    *ok, last = (torch.empty_like(x) for x in want)
    if not ok:
        yield "out", (torch.empty((*last.shape[:-1], last.shape[-1] + 1), dtype=last.dtype),)
    else:
        other = torch.float64 if last.dtype.is_floating_point else torch.int16
        yield f"out[{len(ok)}]", (*ok, last.to(other))


@pytest.mark.parametrize("op", CASES)
def test_a_wrong_out_is_refused_naming_it(op: str) -> None:
    case = CASES[op]()
    for name, buffers in _bad(_as_tuple(case.launch_code().outputs)):
        with pytest.raises(warmreg.LaunchError, match=re.escape(name) + " is "):
            case.launch(**_extra(case, buffers))


def test_stage_out_tuples_and_the_workspace_are_checked() -> None:
    case = _chunk_intra()
    aqk, akk = case.launch_code().outputs
    with pytest.raises(warmreg.LaunchError, match=r"out must be a tuple of 2 tensors \(A_qk, A_kk\), got Tensor"):
        case.launch(out=aqk)
    with pytest.raises(warmreg.LaunchError, match="got tuple of 1"):
        case.launch(out=(aqk,))
    with pytest.raises(warmreg.LaunchError, match="workspace is "):
        case.launch(out=(aqk, akk), workspace=torch.empty(aqk.shape, dtype=torch.bfloat16))
