"""Kimi-K3 ops against vLLM 0.34's own kernels (issue 37): the packed prefill conv, the model runner's accepted-count
stores and the MTP draft layer's input norms, on identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_runner.py``); skips, naming why, elsewhere. Each test calls the engine's
Python entry point as its call site does (``KimiK3DeltaAttention._forward``, ``MambaHybridModelState.postprocess_state``,
``KimiK3MultiTokenPredictorLayer.forward``) and warmreg's op on clones of the same seeded tensors, then compares every
output and every buffer either side writes, bitwise: both sides run the same fp32 operations in the same order
(explicit FMAs oldest tap first, one-tile row sums), so no tolerance is needed. The only stand-in is ``_OnCuda``,
a CPU tensor that reports ``is_cuda``, handed to ``packed_causal_conv1d_supported`` (vLLM's switch asks for CUDA
tensors); it changes no kernel and no math.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_conv = engine("vllm.models.kimi_k3.nvidia.ops.kda_conv")
vllm_mtp = engine("vllm.models.kimi_k3.common.mtp")
vllm_hybrid = engine("vllm.v1.worker.gpu.model_states.mamba_hybrid")
from warmreg_kimi_k3.backends import KDALayout  # noqa: E402
from warmreg_kimi_k3.causal_conv1d import packed_prefill_conv  # noqa: E402
from warmreg_kimi_k3.mtp_input import FusedMTPInput  # noqa: E402
from warmreg_kimi_k3.num_accepted import FillNumAccepted, ScatterNumAccepted  # noqa: E402
from warmreg_kimi_k3.packed_causal_conv1d import PackedCausalConv1d  # noqa: E402


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, for ``packed_causal_conv1d_supported``'s ``x.is_cuda``."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _layout(p: int, dtype: str, width: int = 4) -> KDALayout:
    return KDALayout(num_heads=1, head_dim=p, conv_width=width, lower_bound=-5.0, tensor_parallel_size=1,
                     num_speculative_tokens=3, dtype=dtype)  # fmt: skip


# -- the packed prefill conv ------------------------------------------------------------------------------------
def _prefill(lens: list[int], p: int, dtype: torch.dtype, seed: int, dim_first: bool) -> dict[str, Any]:
    """The layer's inputs at a prefill step: ``mixed_qkv_ns`` the first 3P columns of the packed projection rows
    (one row further on: the slice after the speculative rows), the conv weight ``[3P, 1, 4] -> [3P, 4]``, the fp32
    conv state ``[lines, 3 + 3, 3P]`` transposed to ``(..., dim, state_len)`` (or the dim-first pool), the builder's
    non-speculative offsets, state indices (``block_table[:, 0]`` of a 4-wide table, 0 the null block) and initial
    state flags."""
    g, d, n = seeded(seed), 3 * p, len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1])
    proj = torch.randn(tokens + 1, 4 * p + 40, generator=g).mul_(2).to(dtype)
    weight = torch.randn(d, 1, 4, generator=g).mul_(0.5)
    pool = torch.randn(n + 3, d, 6, generator=g) if dim_first else torch.randn(n + 3, 6, d, generator=g).transpose(1, 2)
    table = torch.zeros(n, 4, dtype=torch.int32)
    table[:, 0] = torch.randperm(n + 2, generator=g)[:n] + 1
    table[n // 2, 0] = 0  # a padded request on the null block
    init = torch.rand(n, generator=g) < 0.6
    return {"x": proj[1:, :d], "weight": weight.view(d, 4), "state": pool, "qsl": qsl, "indices": table[:, 0],
            "init": init}  # fmt: skip


@pytest.mark.parametrize(
    ("lens", "p", "dtype", "dim_first"),
    [
        ([5, 70, 1, 130], 64, torch.bfloat16, False),  # chunk boundaries, a one-token prefill
        ([3, 0, 9], 128, torch.float32, True),  # an empty sequence; BLOCK_N 128; the dim-first pool
        ([2] * 30 + [66] * 6, 64, torch.float16, False),  # 36 sequences: two levels of the program search
    ],
)
def test_packed_conv_equals_vllm(lens: list[int], p: int, dtype: torch.dtype, dim_first: bool) -> None:
    """``packed_causal_conv1d_fn(mixed_qkv_ns, conv_weights, None, conv_state, non_spec_query_start_loc,
    non_spec_state_indices_tensor, has_initial_state, local_projection_size).unbind(0)``: the three planes of every
    sequence not on the null block bitwise, and the whole fp32 state pool (the null block's line included)."""
    t = _prefill(lens, p, dtype, seed=len(lens) + p, dim_first=dim_first)
    theirs, ours = clones(**t), clones(**t)
    q, k, v = vllm_conv.packed_causal_conv1d_fn(
        theirs["x"], theirs["weight"], None, theirs["state"], theirs["qsl"], theirs["indices"], theirs["init"], p
    ).unbind(0)
    got = PackedCausalConv1d(layout=_layout(p, "float32"))(
        ours["x"], ours["weight"], None, ours["state"], ours["qsl"], ours["indices"], ours["init"], p
    )
    live = torch.ones(t["x"].shape[0], dtype=torch.bool)
    bounds = t["qsl"].tolist()
    for s, line in enumerate(t["indices"].tolist()):
        live[bounds[s] : bounds[s + 1]] &= line != 0
    for name, mine, vllm_plane in zip("qkv", got.unbind(0), (q, k, v)):
        assert_same(mine[live], vllm_plane[live], f"{name} plane")
    assert_same(ours["state"], theirs["state"], "conv state pool")


@pytest.mark.parametrize(
    ("model_dtype", "width", "p"),
    [("float32", 4, 1536), ("bfloat16", 4, 1536), ("float16", 4, 1536), ("float32", 3, 1536), ("float32", 4, 96)],
)
def test_the_plan_picks_the_conv_vllm_picks(model_dtype: str, width: int, p: int) -> None:
    """``packed_causal_conv1d_supported`` on the layer's tensors (the conv state in the model dtype, vLLM's
    ``mamba_cache_dtype`` auto; Kimi-K3's fp32 conv weight) agrees with :func:`packed_prefill_conv`, which decides
    whether the plan holds the packed conv or the stock one."""
    dt = getattr(torch, model_dtype)
    x = torch.zeros(4, 4 * p + 16, dtype=dt)[:, : 3 * p].as_subclass(_OnCuda)
    weight = torch.zeros(3 * p, width)
    state = torch.zeros(2, width - 1 + 3, 3 * p, dtype=dt).transpose(1, 2)
    supported = vllm_conv.packed_causal_conv1d_supported(x, weight, state, p)
    assert supported == packed_prefill_conv(_layout(p, model_dtype, width))


# -- the model runner's accepted counts ---------------------------------------------------------------------------
def _runner_state(max_reqs: int, g: torch.Generator) -> Any:
    """A ``MambaHybridModelState`` with what ``postprocess_state`` reads: the accepted counts (garbage to start
    with, so every store shows), no RecoverSSM, no align mode, no FlashInfer ReplaySSM."""
    state = vllm_hybrid.MambaHybridModelState.__new__(vllm_hybrid.MambaHybridModelState)
    state.num_accepted_tokens_gpu = torch.randint(50, 90, (max_reqs,), generator=g, dtype=torch.int32)
    state.recoverssm, state._align_mode, state._use_flashinfer_replayssm = None, False, False
    return state


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_scatter_num_accepted_equals_vllm(rows: int) -> None:
    """``postprocess_state(idx_mapping, num_sampled, num_computed_tokens)`` on the last pipeline stage: int64
    ``idx_mapping`` (distinct slots, -1 for filtered rows), int32 ``num_sampled`` (0 for chunked prefills); the
    whole counts buffer exactly."""
    g = seeded(rows)
    idx = torch.randperm(64, generator=g)[:rows].to(torch.int64)
    idx[torch.rand(rows, generator=g) < 0.25] = -1
    sampled = torch.randint(0, 5, (rows,), generator=g, dtype=torch.int32)
    state = _runner_state(64, g)
    mine = state.num_accepted_tokens_gpu.clone()
    state.postprocess_state(idx, sampled, torch.zeros(64, dtype=torch.int32))
    ScatterNumAccepted(max_num_seqs=64)(idx, sampled, mine)
    assert_same(mine, state.num_accepted_tokens_gpu, "num_accepted_tokens")


@pytest.mark.parametrize("num_sampled", [0, 3])
def test_fill_num_accepted_equals_vllm(num_sampled: int) -> None:
    """``postprocess_state(idx_mapping, 0)`` on a non-last pipeline stage (and an int count of 3): the op stores
    ``max(num_sampled, 1)`` as vLLM's entry point passes it."""
    g = seeded(10 + num_sampled)
    idx = torch.tensor([7, -1, 2, 30, 0], dtype=torch.int64)
    state = _runner_state(32, g)
    mine = state.num_accepted_tokens_gpu.clone()
    state.postprocess_state(idx, num_sampled)
    FillNumAccepted(max_num_seqs=32)(idx, mine, max(num_sampled, 1))
    assert_same(mine, state.num_accepted_tokens_gpu, "num_accepted_tokens")


# -- the MTP draft layer's input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "hidden", "dtype"), [(1, 7168, torch.bfloat16), (6, 100, torch.float32)])
def test_fused_mtp_input_equals_vllm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    """``fused_mtp_input(positions, inputs_embeds, previous_hidden_states, enorm.weight, hnorm.weight,
    enorm.variance_epsilon)``: int64 positions with zeros (masked embeddings), the embeddings fresh, the previous
    hidden states the leading rows of a persistent buffer; the ``[T, 2H]`` output bitwise."""
    g = seeded(tokens)
    t = {
        "positions": torch.randint(0, 3, (tokens,), generator=g),
        "embeds": torch.randn(tokens, hidden, generator=g).mul_(3).to(dtype),
        "hidden": torch.randn(tokens + 4, hidden, generator=g).to(dtype)[:tokens],
        "enorm": torch.randn(hidden, generator=g).mul_(0.2).add_(1).to(dtype),
        "hnorm": torch.randn(hidden, generator=g).mul_(0.2).add_(1).to(dtype),
    }
    t["positions"][0] = 0
    theirs, ours = clones(**t), clones(**t)
    want = vllm_mtp.fused_mtp_input(theirs["positions"], theirs["embeds"], theirs["hidden"], theirs["enorm"],
                                    theirs["hnorm"], 1e-5)  # fmt: skip
    got = FusedMTPInput(hidden_size=hidden)(ours["positions"], ours["embeds"], ours["hidden"], ours["enorm"],
                                            ours["hnorm"], 1e-5)  # fmt: skip
    assert_same(got, want, "MTP input")
