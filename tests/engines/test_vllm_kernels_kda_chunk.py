"""The chunked KDA prefill against vLLM 0.33's own kernels, on identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere. End to end, the
layer's three calls (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward``, the Triton prefill
branch): ``gather_initial_states`` from a ``[S, H, V, K]`` pool, ``chunk_kda_with_fused_gate`` with the layer's
arguments, the scatter ``recurrent_state[idx] = final_state``; then each stage against the vLLM function it
replaces, on the same inputs. Everything is compared bitwise.

What the interpreter can and cannot say (Triton 3.8.0, numpy on the CPU):

- fp32 only: the interpreter multiplies bf16 ``tl.dot`` operands as raw uint16 bits (``interpreter.py:
  create_dot`` converts fp8 alone), on both sides alike, so bf16 results would be garbage compared with garbage.
- A float argument stays a Python float (a weak scalar) where a GPU passes an fp32 value: the same for fp32
  tensors, so nothing here depends on it (the output stage casts q to fp32 before its scale so that bf16 runs
  there at all, which is what the GPU's promotion does).
- ``input_precision`` (tf32 / ieee) is ignored: every dot is a numpy float32 matmul. The stages pass the same
  precisions as vLLM (checked by reading), which only a GPU run distinguishes.
- Equal bits here mean equal operations on equal operands in the same order, tile shapes included (a numpy
  matmul's sum order follows its shapes). On a GPU the reductions' trees also follow the launch configuration,
  so warmreg matches vLLM's bits for the candidate vLLM's autotuner picked; the test pins each vLLM autotuner to
  the configuration of the warmreg candidate under test.

Two shims let vLLM's kernels run under the interpreter, neither changing what they compute:
``chunk_delta_h``'s ``for i_t in range(NT)`` calls ``i_t.to(...)`` (a plain int there), so its ``range`` yields
interpreter int32 scalars; ``chunk_intra``'s ``gather = tl.gather`` alias gets a ``@triton.jit`` wrapper (as
``engine`` does for ``exp``). ``gather_initial_states`` asserts CUDA tensors: it gets tensors that say they are.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import TensorHandle

KDA = "vllm.models.kimi_k3.nvidia.ops.third_party.kda."
FLA = "vllm.third_party.flash_linear_attention.ops."
vllm_chunk = engine(KDA + "chunk")
vllm_intra = engine(KDA + "chunk_intra")
vllm_token_parallel = engine(KDA + "chunk_intra_token_parallel")
vllm_delta_h = engine(FLA + "chunk_delta_h")
vllm_l2norm = engine(FLA + "l2norm")
vllm_index = engine(FLA + "index")
vllm_gather = engine("vllm.model_executor.layers.mamba.ops.gather_initial_states")

from warmreg_kimi_k3.gather_initial_states import GatherInitialStates  # noqa: E402
from warmreg_kimi_k3.kda_chunk import chunk_kda_prefill, chunk_kda_reference  # noqa: E402
from warmreg_kimi_k3.kda_chunk_base import chunk_metadata  # noqa: E402
from warmreg_kimi_k3.kda_chunk_gate import KDAChunkGate  # noqa: E402
from warmreg_kimi_k3.kda_chunk_h import KDAChunkH  # noqa: E402
from warmreg_kimi_k3.kda_chunk_intra import KDAChunkIntra  # noqa: E402
from warmreg_kimi_k3.kda_chunk_l2norm import KDAChunkL2Norm  # noqa: E402
from warmreg_kimi_k3.kda_chunk_o import KDAChunkO  # noqa: E402
from warmreg_kimi_k3.kda_chunk_wu import KDAChunkWU  # noqa: E402

import warmreg  # noqa: E402


def _int_range(*args: Any) -> Iterator[tl.tensor]:
    for i in builtins.range(*args):
        yield tl.core.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


@triton.jit
def _gather(src, index, axis: tl.constexpr):  # type: ignore[no-untyped-def]
    return tl.gather(src, index, axis)


vllm_delta_h.range = _int_range  # type: ignore[attr-defined]
vllm_intra.gather = _gather  # type: ignore[attr-defined]

H, D = 2, 32  # K = V = 32: every vLLM kernel masks its 64-wide tiles, so no kernel needs Kimi's 128
SLOTS = 7
LENS = [5, 70, 64, 1]  # shorter than a chunk, two chunks (the second partial), exactly one, one token
# vLLM's autotuned kernels and the warmreg stage whose candidate each one is pinned to
TUNED = [
    (vllm_chunk.kda_gate_chunk_cumsum_vector_kernel, KDAChunkGate),
    (vllm_intra.chunk_kda_fwd_kernel_inter_solve_fused, KDAChunkIntra),
    (vllm_intra.chunk_kda_fwd_kernel_intra_sub_chunk, None),
    (vllm_token_parallel.chunk_kda_fwd_kernel_intra_token_parallel, None),
    (vllm_chunk.recompute_w_u_fwd_kernel, KDAChunkWU),
    (vllm_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64, KDAChunkH),
    (vllm_chunk.chunk_gla_fwd_kernel_o, KDAChunkO),
]


def _autotuner(kernel: Any) -> Autotuner:
    while not isinstance(kernel, Autotuner):
        kernel = kernel.fn
    return kernel


@contextlib.contextmanager
def pinned(candidate: int) -> Iterator[None]:
    """warmreg's candidate ``candidate`` for every stage, and each vLLM autotuner pinned to the configuration
    with the same tuned constexprs (and launch options where it has them): one config, so no benchmarking."""
    saved = []
    for kernel, stage in TUNED:
        tuner = _autotuner(kernel)
        saved.append((tuner, tuner.configs))
        configs = tuner.configs
        if stage is not None:
            want = stage.tune_configs[candidate]
            same = [c for c in configs if all(c.kwargs.get(k, v) == v for k, v in want.constexprs)]
            assert same, f"no configuration of {tuner.base_fn.__name__} has {dict(want.constexprs)}"
            configs = [c for c in same if (c.num_warps, c.num_stages) == (want.num_warps, want.num_stages)] or same
        tuner.configs = configs[:1]
        tuner.cache.clear()
    try:
        with warmreg.use_config(candidate):
            yield
    finally:
        for tuner, configs in saved:
            tuner.configs = configs
            tuner.cache.clear()


class _OnGpu(torch.Tensor):
    """A CPU tensor that answers ``is_cuda``: vLLM's ``gather_initial_states`` asserts it before launching."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def vllm_gather_initial_states(pool: torch.Tensor, indices: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    out = vllm_gather.gather_initial_states(
        pool.as_subclass(_OnGpu), indices.as_subclass(_OnGpu), has.as_subclass(_OnGpu)
    )
    return out.as_subclass(torch.Tensor)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _layer_inputs(lens: list[int], lower_bound: float | None, seed: int) -> dict[str, Any]:
    """What the layer hands the prefill, engine-shaped: q, k, v ``[1, T, H, D]`` (the convolutions' dense
    outputs), g1 ``[1, T, H, D]`` (f_b_proj's fresh output), beta a column block of the fused projection
    ``[1, T, H]`` (token stride its width), fp32 A_log and dt_bias, a ``[S, H, V, K]`` pool whose slot stride is
    padded, the state indices a block-table column and has_initial_state mixed (a request without a state
    still has its slot, written after the prefill)."""
    gen = seeded(seed)
    t, n = sum(lens), len(lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    width = 3 * H * D + H * D + D + H + 5  # qkv, g_proj, f_a, beta, padding
    proj = randn(t, width)
    row = H * D * D
    pool = (0.1 * randn(SLOTS, row + 8))[:, :row].view(SLOTS, H, D, D)
    table = torch.tensor([[6, 1], [2, 1], [5, 1], [3, 1], [1, 1]][:n], dtype=torch.int32)
    return {
        "q": randn(1, t, H, D), "k": randn(1, t, H, D), "v": randn(1, t, H, D),
        "raw_g": randn(1, t, H, D) - 1.0, "raw_beta": proj[:, width - 5 - H : width - 5].unsqueeze(0),
        "A_log": torch.rand(H, generator=gen).mul(1.5).add(0.5).log(), "g_bias": 0.5 * randn(H * D),
        "lower_bound": lower_bound, "cu_seqlens": _cu(lens), "pool": pool, "indices": table[:, 0],
        "has_initial_state": torch.tensor([True, False, True, True, False][:n]),
    }  # fmt: skip


def _prefill(
    chunk_kda: Any, gather: Any, x: dict[str, Any], out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's Triton prefill branch, with ``chunk_kda`` and ``gather`` either vLLM's or warmreg's."""
    initial_state = gather(x["pool"], x["indices"], x["has_initial_state"])
    o, final_state = chunk_kda(
        q=x["q"], k=x["k"], v=x["v"], raw_g=x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"],
        g_bias=x["g_bias"], lower_bound=x["lower_bound"], initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"], out=out,
    )  # fmt: skip
    x["pool"][x["indices"]] = final_state.to(x["pool"].dtype)
    return initial_state, o, final_state


@pytest.mark.parametrize(
    ("lower_bound", "candidate", "out"),
    [(None, 0, False), (None, 3, True), (-5.0, 1, False), (-5.0, 2, True)],
    ids=["softplus-c0-into-v", "softplus-c3-out", "lower-bound-c1-into-v", "lower-bound-c2-out"],
)
def test_prefill_equals_vllm(lower_bound: float | None, candidate: int, out: bool) -> None:
    """The whole branch: the gathered initial states, the output (written into ``v`` without ``out``, as
    vLLM's ``o=v if out is None``), the final states and the pool after the scatter, all bitwise; both also
    within fp32 rounding of the token-by-token recurrence."""
    x = _layer_inputs(LENS, lower_bound, seed=candidate)
    t = x["q"].shape[1]
    theirs, ours = clones(**x), clones(**x)
    buffers = (torch.full((1, t, H, D), float("nan")), torch.full((1, t, H, D), float("nan"))) if out else (None, None)
    with pinned(candidate):
        s0, o_vllm, final_vllm = _prefill(
            vllm_chunk.chunk_kda_with_fused_gate, vllm_gather_initial_states, theirs, buffers[0]
        )
        s1, o_ours, final_ours = _prefill(
            chunk_kda_prefill, GatherInitialStates(num_heads=H, head_dim=D, max_num_seqs=SLOTS), ours, buffers[1]
        )
    assert_same(s1, s0, "initial_state")
    assert o_vllm is (buffers[0] if out else theirs["v"])
    assert o_ours is (buffers[1] if out else ours["v"])
    assert_same(o_ours, o_vllm, "o")
    assert_same(ours["v"], theirs["v"], "v after the call")
    assert_same(final_ours, final_vllm, "final_state")
    assert_same(ours["pool"], theirs["pool"], "state pool after the scatter")
    ref_args = {k: x[k] for k in ("q", "k", "v", "raw_g", "raw_beta", "A_log", "g_bias", "lower_bound", "cu_seqlens")}
    ref_o, ref_final = chunk_kda_reference(**ref_args, initial_state=s0, use_qk_l2norm_in_kernel=True)
    # fp32 chunked form against the fp32 recurrence: summation order and exp2 of chunk-local sums (about 1e-7)
    torch.testing.assert_close(o_ours, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_ours, ref_final, atol=1e-5, rtol=1e-5)


def test_a_strided_v_is_copied_and_left_alone() -> None:
    """v a view of a wider tensor (not contiguous): vLLM's ``v.contiguous()`` is a copy, the output lands in
    it and the caller's v keeps its values; no initial state, no final state."""
    x = _layer_inputs([3, 17], None, seed=9)
    wide = torch.randn(1, 20, H, D + 8, generator=seeded(10))
    before = wide[..., :D].clone()
    theirs, ours = clones(**x), clones(**x)
    theirs["v"], ours["v"] = wide.clone()[..., :D], wide.clone()[..., :D]
    args = ("q", "k", "v", "raw_g", "raw_beta", "A_log", "g_bias", "lower_bound", "cu_seqlens")
    with pinned(0):
        o_vllm, f_vllm = vllm_chunk.chunk_kda_with_fused_gate(
            **{a: theirs[a] for a in args}, use_qk_l2norm_in_kernel=True
        )
        o_ours, f_ours = chunk_kda_prefill(**{a: ours[a] for a in args}, use_qk_l2norm_in_kernel=True)
    assert f_vllm is None and f_ours is None
    assert o_ours.is_contiguous() and o_ours.data_ptr() != ours["v"].data_ptr()
    assert_same(o_ours, o_vllm, "o")
    assert_same(theirs["v"], before, "the caller's v (vLLM)")
    assert_same(ours["v"], before, "the caller's v")


# -- stage by stage ---------------------------------------------------------------------------------------------
def _vllm_stages(x: dict[str, Any], initial_state: torch.Tensor | None) -> dict[str, Any]:
    """vLLM's own intermediates, function by function, as ``chunk_kda_with_fused_gate`` chains them."""
    cu = x["cu_seqlens"]
    chunk_indices = vllm_index.prepare_chunk_indices(cu, 64)
    q, k = vllm_l2norm.l2norm_fwd(x["q"].contiguous()), vllm_l2norm.l2norm_fwd(x["k"].contiguous())
    g, beta = vllm_chunk.fused_kda_gate_chunk_cumsum(
        x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"], g_bias=x["g_bias"], cu_seqlens=cu,
        chunk_indices=chunk_indices, chunk_size=64, lower_bound=x["lower_bound"],
    )  # fmt: skip
    aqk, akk = vllm_intra.chunk_kda_fwd_intra(
        q=q, k=k, gk=g, beta=beta, scale=D**-0.5, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=64,
        safe_gate=x["lower_bound"] is not None,
    )  # fmt: skip
    w, u, _, kg = vllm_chunk.recompute_w_u_fwd(
        k=k, v=x["v"], beta=beta, A=akk, gk=g, cu_seqlens=cu, chunk_indices=chunk_indices
    )
    h, v_new, final = vllm_delta_h.chunk_gated_delta_rule_fwd_h(
        k=kg, w=w, u=u, gk=g, initial_state=initial_state, output_final_state=True, cu_seqlens=cu,
        chunk_indices=chunk_indices, use_exp2=True,
    )  # fmt: skip
    o = vllm_chunk.chunk_gla_fwd_o_gk(
        q=q, v=v_new, g=g, A=aqk, h=h, o=torch.empty_like(x["v"]), scale=D**-0.5, cu_seqlens=cu,
        chunk_indices=chunk_indices,
    )  # fmt: skip
    return {"q": q, "k": k, "g": g, "beta": beta, "aqk": aqk, "akk": akk, "w": w, "u": u, "kg": kg, "h": h,
            "v_new": v_new, "final": final, "o": o, "chunk_indices": chunk_indices}  # fmt: skip


def _lower_triangle(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[1, T, 1, 64]``: column ``j`` of token ``t``'s row is on or below the diagonal of t's chunk (where
    vLLM writes ``Aqk``; the rest of its ``torch.empty`` is never read)."""
    pos = torch.cat([torch.arange(int(n)) % 64 for n in cu_seqlens.diff()])
    return (torch.arange(64)[None, :] <= pos[:, None])[None, :, None, :]


@pytest.mark.parametrize(
    ("lower_bound", "candidate", "with_state"),
    [(None, 0, True), (-5.0, 2, True), (None, 3, False)],
    ids=["softplus-c0", "lower-bound-c2", "softplus-c3-no-initial-state"],
)
def test_each_stage_equals_vllm(lower_bound: float | None, candidate: int, with_state: bool) -> None:
    """Each warmreg stage on vLLM's own inputs to the function it replaces, every output bitwise: the chunk
    metadata, l2norm_fwd, fused_kda_gate_chunk_cumsum (g, beta), chunk_kda_fwd_intra (Aqk on and below the
    diagonal, Akk whole), recompute_w_u_fwd (w, u, kg), chunk_gated_delta_rule_fwd_h (h, v_new, the final
    states; with and without initial states), chunk_gla_fwd_o_gk."""
    x = _layer_inputs(LENS, lower_bound, seed=20 + candidate)
    cu = x["cu_seqlens"]
    state = vllm_gather_initial_states(x["pool"], x["indices"], x["has_initial_state"]) if with_state else None
    with pinned(candidate):
        want = _vllm_stages(clones(**x), state)
        chunks, offsets = chunk_metadata(cu)
        assert_same(chunks, want["chunk_indices"], "chunk_indices")
        assert_same(offsets.long(), vllm_index.prepare_chunk_offsets(cu, 64), "chunk_offsets")
        for name in ("q", "k"):
            assert_same(KDAChunkL2Norm()(x[name]), want[name], f"l2norm({name})")
        g, beta = KDAChunkGate()(x["raw_g"][0], x["raw_beta"][0], x["A_log"], x["g_bias"], lower_bound, cu, chunks)
        assert_same(g[None], want["g"], "g")
        assert_same(beta[None], want["beta"], "beta")
        q, k = want["q"][0], want["k"][0]
        aqk, akk = KDAChunkIntra()(q, k, want["g"][0], want["beta"][0], cu, chunks, safe_gate=lower_bound is not None)
        tri = _lower_triangle(cu)
        assert_same(torch.where(tri, aqk[None], 0.0), torch.where(tri, want["aqk"], 0.0), "A_qk")
        assert_same(akk[None], want["akk"], "A_kk")
        w, u, kg = KDAChunkWU()(k, x["v"][0], want["beta"][0], want["akk"][0], want["g"][0], cu, chunks)
        for name, got in (("w", w), ("u", u), ("kg", kg)):
            assert_same(got[None], want[name], name)
        h, v_new, final = KDAChunkH()(
            want["kg"][0], want["w"][0], want["u"][0], want["g"][0], cu, offsets, state, chunks.shape[0]
        )
        assert_same(h[None], want["h"], "h")
        assert_same(v_new[None], want["v_new"], "v_new")
        assert_same(final, want["final"], "final_state")
        o = KDAChunkO()(q, want["v_new"][0], want["g"][0], want["h"][0], want["aqk"][0], cu, chunks, scale=D**-0.5)
        assert_same(o[None], want["o"], "o")


def test_gather_initial_states_equals_vllm() -> None:
    """``gather_initial_states`` (vLLM's entry point) and warmreg's op: a pool with a padded slot stride,
    int32 and int64 indices (a block-table column), slots shared and out of range where there is no state."""
    gen = seeded(3)
    row = H * D * D
    pool = torch.randn(SLOTS, row + 24, generator=gen)[:, :row].view(SLOTS, H, D, D)
    table = torch.tensor([[4, 9], [10**6, 9], [2, 9], [4, 9], [0, 9]], dtype=torch.int32)
    has = torch.tensor([True, False, True, True, False])
    op = GatherInitialStates(num_heads=H, head_dim=D, max_num_seqs=SLOTS)
    for indices in (table[:, 0], table[:, 0].long()):
        want = vllm_gather_initial_states(pool, indices, has)
        assert_same(op(pool, indices, has, launch_pdl=False), want, f"gathered states ({indices.dtype})")
    assert_same(op(pool, table[:0, 0], has[:0]), vllm_gather_initial_states(pool, table[:0, 0], has[:0]), "empty")
