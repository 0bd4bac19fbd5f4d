"""The prefill conv1d against its reference in Triton's interpreter, and its keys in the examples' plans."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.causal_conv1d import (
    PAD_SLOT_ID,
    CausalConv1d,
    ConvChunks,
    causal_conv1d_reference,
    conv1d_chunks,
    projection_row_stride,
)

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAME = CausalConv1d.name
LAYOUT = KDALayout(num_heads=1, head_dim=40, conv_width=4, lower_bound=None, tensor_parallel_size=1,
                   num_speculative_tokens=0, dtype="bfloat16")  # fmt: skip
KERNEL = CausalConv1d(layout=LAYOUT)
# Both sides sum in fp32 in the same order; the interpreter casts fp32 to bf16 by truncation where torch rounds
# to nearest, so outputs may differ by one bf16 step (2**-7 relative). States are copies: exact.
BF16 = {"atol": 1e-6, "rtol": 2**-7}


def _batch(lens: list[int], dim: int = 40, lines: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    proj = torch.randn(tokens, 3 * dim + 8, generator=g).bfloat16()  # a packed projection, row stride 3D + 8
    packed_state = torch.randn(lines, 5, 3 * dim, generator=g).bfloat16()  # (state_len, dim) rows, 2 spare
    return {
        "x": proj[:, dim : 2 * dim],  # k: a column slice, offset D
        "weight": torch.randn(3 * dim, 4, generator=g)[dim : 2 * dim],  # float32, a row slice
        "conv_states": packed_state.transpose(1, 2)[:, dim : 2 * dim],  # [lines, D, 5], strides (5*3D, 1, 3D)
        "query_start_loc": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
    }


def _run(b: dict[str, torch.Tensor], indices: list[int], init: list[bool], **kw: object) -> None:
    ci = torch.tensor(indices, dtype=torch.int32)
    hi = torch.tensor(init)
    bias = kw.pop("bias", None)
    ref_y, ref_s = causal_conv1d_reference(
        b["x"], b["weight"], bias, b["conv_states"], b["query_start_loc"], ci, hi, **kw
    )  # type: ignore[arg-type]
    state = b["conv_states"].clone()
    y = KERNEL(b["x"], b["weight"], bias, state, b["query_start_loc"], ci, hi, launch_pdl=False, **kw)  # type: ignore[arg-type]
    bounds = b["query_start_loc"].tolist()
    live = [
        t
        for s, line in enumerate(indices)
        if line != kw.get("null_block_id", 0)
        for t in range(bounds[s], bounds[s + 1])
    ]
    torch.testing.assert_close(y[live], ref_y[live], **BF16)
    assert torch.equal(state, ref_s)


def test_varlen_mixed_initial_states() -> None:
    """Lengths 1, 2, 3 (shorter than the history: the state shifts), 5 and 65 (9 chunks of 8), mixed
    has_initial_state, and a null-line sequence (index 0) that must be skipped and its state untouched."""
    b = _batch([1, 2, 3, 5, 65, 2])
    _run(b, [3, 1, 7, 5, 2, 0], [True, False, True, False, True, True])


def test_silu_off_with_bias_and_no_null_block() -> None:
    b = _batch([4, 1, 9], seed=1)
    bias = torch.randn(40)
    _run(b, [0, 4, 6], [False, True, True], bias=bias, activation=None, null_block_id=None)


def test_padding_programs_are_skipped() -> None:
    """A chunk table longer than the batch (a CUDA-graph buffer): PAD_SLOT_ID programs write nothing."""
    b = _batch([3, 9], seed=2)
    ci, hi = torch.tensor([2, 5], dtype=torch.int32), torch.tensor([True, False])
    chunks = conv1d_chunks(b["query_start_loc"])
    padded = ConvChunks(
        torch.cat([chunks.seq_ids, torch.full((3,), PAD_SLOT_ID, dtype=torch.int32)]),
        torch.cat([chunks.chunk_ids, torch.full((3,), PAD_SLOT_ID, dtype=torch.int32)]),
        chunks.num_programs + 3,
    )
    state = b["conv_states"].clone()
    y = KERNEL(b["x"], b["weight"], None, state, b["query_start_loc"], ci, hi, chunks=padded, launch_pdl=False)
    ref_y, ref_s = causal_conv1d_reference(b["x"], b["weight"], None, b["conv_states"], b["query_start_loc"], ci, hi)
    torch.testing.assert_close(y, ref_y, **BF16)
    assert torch.equal(state, ref_s)


def test_chunk_table() -> None:
    chunks = conv1d_chunks([0, 1, 9, 26])
    assert chunks.seq_ids.tolist() == [0, 1, 2, 2, 2] and chunks.chunk_ids.tolist() == [0, 0, 0, 1, 2]
    assert chunks.num_programs == 5 and conv1d_chunks([0]).num_programs == 0


def test_empty_batch_launches_nothing() -> None:
    b = _batch([1])
    x = b["x"][:0]
    qsl = torch.zeros(1, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int32)
    out = KERNEL(x, b["weight"], None, b["conv_states"], qsl, none, torch.zeros(0, dtype=torch.bool), launch_pdl=False)
    assert out.shape == (0, 40)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": "strided"}, "contiguous channels"),
        ({"weight": "wide"}, "W in"),
        ({"state": "fp32"}, "x's dtype"),
        ({"indices": "int64"}, "cache_indices must be int32"),
        ({"activation": "gelu"}, "activation"),
    ],
)
def test_launch_errors(change: dict[str, str], message: str) -> None:
    b = _batch([2])
    x, w, st = b["x"], b["weight"], b["conv_states"]
    ci, hi, act = torch.tensor([1], dtype=torch.int32), torch.tensor([False]), "silu"
    if "x" in change:
        x = x.T.contiguous().T
    if "weight" in change:
        w = torch.randn(40, 5)
    if "state" in change:
        st = st.float()
    if "indices" in change:
        ci = ci.long()
    if "activation" in change:
        act = change["activation"]
    with pytest.raises(warmreg.LaunchError, match=message):
        KERNEL(x, w, None, st, b["query_start_loc"], ci, hi, activation=act, launch_pdl=False)


def _plan(name: str, target: str) -> warmreg.Plan:
    return warmreg.plan(EXAMPLES / name, target=target)


@pytest.mark.parametrize("example", ["kimi_k3.json", "kimi_k3_attn_res.json"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_plan_keys(example: str, target: str) -> None:
    """One binary for q, k and v; two for the cache-index stride: block_table[:, 0] (1 + 3 draft slots wide)
    and the gathered copy of a batch that mixes prefills with speculative rows."""
    keys = _plan(example, target).kernel(NAME).keys
    assert sorted(k.stride_cache_indices for k in keys) == [1, 4]
    assert {(k.dim, k.stride_state_token, k.kernel_width, k.weight_dtype, k.launch_pdl) for k in keys} == {
        (1536, 4608, 4, "float32", True)
    }


def test_not_planned_on_rocm() -> None:
    plan = _plan("kimi_k3.json", "rocm:gfx942")
    assert NAME not in [k.kernel.name for k in plan.kernels]


def test_runtime_shapes_are_planned() -> None:
    """Real call-site views (meta tensors at the deployment's sizes, batches the domains did not sample)."""
    plan = _plan("kimi_k3.json", "cuda:90")
    kp = plan.kernel(NAME)
    data = json.loads((EXAMPLES / "kimi_k3.json").read_text())
    cfg = warmreg.WarmConfig.load(data)
    lay = KDALayout(num_heads=12, head_dim=128, conv_width=4, lower_bound=-5.0, tensor_parallel_size=8,
                    num_speculative_tokens=3, dtype="bfloat16")  # fmt: skip
    assert cfg.serving["tensor_parallel_size"] == 8
    row, p = projection_row_stride(lay), 1536
    assert row == 6288  # vLLM's packed TP8 projection (low_latency_gemm.py: _KDA_PACKED_SIZE)
    state = warmreg.meta((3000, 6, 3 * p), torch.bfloat16, stride=(442368, 3 * p, 1)).transpose(1, 2)
    weight = warmreg.meta((3 * p, 4), torch.float32)
    for tokens, first, width in ((8191, 0, row), (37, 5, row), (100, 0, 3 * p)):
        proj = warmreg.meta((tokens + first, width), torch.bfloat16)[first:]
        for c in range(3):
            for indices in (warmreg.meta((37, 4), torch.int32)[:, 0], warmreg.meta((37,), torch.int32)):
                key = kp.kernel.dispatch(
                    x=proj[:, c * p : (c + 1) * p], weight=weight[c * p : (c + 1) * p], bias=None,
                    conv_states=state[:, c * p : (c + 1) * p], cache_indices=indices, activation="silu",
                    pad_slot_id=-1, null_block_id=0, launch_pdl=True,
                )  # fmt: skip
                assert key in kp.keys


def test_warmup_inputs_reproduce_every_key() -> None:
    """warm compiles each key from warmup_inputs (the Kimi plan's warm is in test_plugin.py); they must lead back
    to the key, also for keys with unusual fields."""
    kp = _plan("kimi_k3.json", "cuda:90").kernel(NAME)
    extra = [
        attrs.evolve(k, x_aligned=False, stride_x_token="other", bias_dtype="float32", null_block_id=None)
        for k in kp.keys
    ]
    assert_warmup_inputs_reproduce(kp.kernel, [*kp.keys, *extra])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:  # no sequence on the null line: every row is written
        b = _batch([3, 9, 2])
        ci, hi = torch.tensor([3, 1, 7], dtype=torch.int32), torch.tensor([True, False, True])
        args = (b["x"], b["weight"], None, b["conv_states"], b["query_start_loc"], ci, hi)
        chunks = conv1d_chunks(b["query_start_loc"])  # passed, as an engine does: built here it would allocate
        return OpCall(KERNEL, args, {"chunks": chunks, "launch_pdl": False})

    check_out(build)
