"""The prefill's initial-state gather: exact equality with the PyTorch reference under Triton's interpreter, and
its plan. States are small (a row of 2 x 8 x 8 or 3 x 10 x 10 elements): the interpreter runs each program in
numpy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.gather_initial_states import GatherInitialStates, gather_initial_states_reference

import warmreg
from warmreg.testing import OpCall, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAME = GatherInitialStates.name


def _kernel() -> GatherInitialStates:
    return GatherInitialStates(num_heads=2, head_dim=8, max_num_seqs=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(6, 2, 8, 8, generator=gen).to(dtype)
    indices = torch.tensor([3, 0, 5, 3], dtype=index_dtype)  # slot 3 twice: two requests may share a prefix
    has = torch.tensor([True, False, True, True])
    got = _kernel()(state, indices, has)
    assert got.dtype == dtype and torch.equal(got, gather_initial_states_reference(state, indices, has))
    assert torch.equal(got[1], torch.zeros(2, 8, 8, dtype=dtype))


def test_padded_slots_column_indices_and_garbage_without_state() -> None:
    """A pool whose slot stride is padded (odd, 313 > 300), indices a block-table column, a row of 300 elements
    (two tiles of 256, the second masked), and out-of-range indices where there is no initial state (never read)."""
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(5, 313, generator=gen)
    state = pool[:, :300].view(5, 3, 10, 10)
    table = torch.tensor([[4, 9], [-1, 9], [2, 9], [10**6, 9]], dtype=torch.int32)
    has = torch.tensor([True, False, True, False])
    kernel = _kernel()
    got = kernel(state, table[:, 0], has, launch_pdl=False)
    assert torch.equal(got, gather_initial_states_reference(state, table[:, 0], has))
    key = kernel.dispatch(state=state, indices=table[:, 0], launch_pdl=False)
    assert (key.row_size, key.block, key.state_stride) == (300, 512, "other")


def test_empty_batch_and_launch_errors() -> None:
    kernel, state = _kernel(), torch.zeros(3, 2, 8, 8)
    none = torch.zeros(0, dtype=torch.int32)
    assert kernel(state, none, none.bool()).shape == (0, 2, 8, 8)
    idx, has = torch.tensor([0], dtype=torch.int32), torch.tensor([True])
    with pytest.raises(warmreg.LaunchError, match="int32 or int64"):
        kernel(state, idx.float(), has)
    with pytest.raises(warmreg.LaunchError, match="bool"):
        kernel(state, idx, has.int())
    with pytest.raises(warmreg.LaunchError, match="slot of state must be contiguous"):
        kernel(state.transpose(2, 3), idx, has)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["kimi_k3", "kimi_k3_attn_res"])
@pytest.mark.parametrize(("target", "pdl"), [("cuda:90", True), ("cuda:100", True), ("xpu:pvc", False)])
def test_one_key_per_pool(example: str, target: str, pdl: bool) -> None:
    (key,) = warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernel(NAME).keys
    assert key.fields() == {
        "dtype": "float32", "index_dtype": "int32", "row_size": 12 * 128 * 128, "block": 1024,
        "state_stride": "div16", "state_aligned": True, "launch_pdl": pdl, "num_warps": 8,
    }  # fmt: skip


def test_planned_on_rocm_where_its_triton_prefill_gathers() -> None:
    """ROCm's chunk_kda_prefill gathers on its Triton path (gfx942: neither Gluon nor the fused op), not on
    gfx950's fused one, which reads the pool itself."""
    assert NAME in {k.name for k in warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942").kernels}
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx950").kernels}


@pytest.mark.parametrize("requests", [1, 37, 256])
def test_runtime_shapes_are_planned(requests: int) -> None:
    """The builder's index tensors: a column of the block table (stride = its width), or a fresh masked copy."""
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernel(NAME)
    state = warmreg.meta((257, 12, 128, 128), torch.float32)
    for indices in (warmreg.meta((requests, 4097), torch.int32)[:, 0], warmreg.meta((requests,), torch.int32)):
        assert kp.kernel.dispatch(state=state, indices=indices, launch_pdl=True) in kp.keys
    key = kp.kernel.warmup_inputs(next(iter(kp.keys)))
    assert kp.kernel.dispatch(**{p: key[p] for p in kp.kernel.dispatch_params()}) in kp.keys


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:  # the inputs of test_matches_reference
        state = torch.randn(6, 2, 8, 8, generator=torch.Generator().manual_seed(0))
        indices, has = torch.tensor([3, 0, 5, 3], dtype=torch.int32), torch.tensor([True, False, True, True])
        return OpCall(GatherInitialStates(num_heads=2, head_dim=8, max_num_seqs=4), (state, indices, has), {"launch_pdl": False})

    check_out(build)
