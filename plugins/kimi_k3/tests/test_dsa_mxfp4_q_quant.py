"""The MXFP4 query quant of the DSA indexer under Triton's interpreter: bit-exact against the PyTorch reference
(E2M1 by nearest grid point in float64, the scale in fp32), the E2M1 / UE8M0 rules on hand-picked blocks, padded
heads, strided views, errors and ``out=``. The plan is in ``test_dsa_mxfp4_plan.py``."""

from __future__ import annotations

import pytest
import torch
from warmreg_kimi_k3.dsa_mxfp4_q_quant import MXFP4QQuant, heads_per_program, mxfp4_q_quant_reference

import warmreg
from warmreg.testing import OpCall, check_out


def _inputs(tokens: int, heads: int, *, extra: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``index_q [T, H, 128]`` and ``index_weights [T, H]`` as column views of one bf16 projection output (the
    fused forward's packed query GEMM and the indexer's weights): strided rows."""
    gen = torch.Generator().manual_seed(seed)
    proj = (torch.randn(tokens, heads * 128 + extra + heads, generator=gen) * 2).to(torch.bfloat16)
    return proj[:, : heads * 128].view(tokens, heads, 128), proj[:, -heads:]


def _run(index_q: torch.Tensor, weights: torch.Tensor, padded: int) -> None:
    scale = 128**-0.5 * index_q.shape[1] ** -0.5
    got = MXFP4QQuant()(index_q, weights, scale, padded)
    want = mxfp4_q_quant_reference(index_q, weights, scale, padded)
    for name, g, w in zip(("q_packed", "q_scale", "weights"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name  # exact: the same fp32 products and codes


@pytest.mark.parametrize(
    ("tokens", "heads", "padded"),
    [(3, 32, 32), (2, 3, 32), (4, 16, 32), (2, 40, 64)],
    ids=["full", "odd-heads", "padded", "padded-64"],
)
def test_matches_reference(tokens: int, heads: int, padded: int) -> None:
    _run(*_inputs(tokens, heads, seed=heads), padded)


def test_e2m1_and_ue8m0_rules() -> None:
    """Per block of 32: the E2M1 grid as is at amax 6 (scale byte 127) and each tie to the even code; all zeros
    at the floor (byte 1); one bf16 step above 6 doubles the scale (byte 128); 3e38 gives byte 253; -0.0 keeps
    its sign bit; the padding heads are zero everywhere."""
    q = torch.zeros(1, 2, 128)
    q[0, 0, :32] = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0] * 2)
    q[0, 0, 64:96] = torch.tensor([6.03125, -3.0] * 16)  # k = 1: 3.015625 -> 3 (code 5), -1.5 (code 8 | 3)
    q[0, 0, 96:128] = torch.tensor([3.0e38, 1.0] * 16)  # bf16 3.004e38, k = 126: 3.53 -> 4 (code 6); 1.0 -> 0
    q[0, 1] = torch.linspace(-0.5, 0.5, 128)  # blocks of amax 0.5 (k = -3) and about 0.25 (k = -4)
    q = q.to(torch.bfloat16)
    packed, scale, weights = MXFP4QQuant()(q, torch.ones(1, 2, dtype=torch.bfloat16), 0.5, 4)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)  # element order
    assert codes[0, 0, :16].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 2, 4, 4, 6, 6, 8]
    assert codes[0, 0, 32:64].eq(0).all()
    assert codes[0, 0, 64:66].tolist() == [5, 8 | 3] and codes[0, 0, 96:98].tolist() == [6, 0]
    assert scale.view(torch.uint8)[0, :8].tolist() == [127, 1, 128, 253, 124, 123, 123, 124]
    assert (codes[0, 1, 0], codes[0, 1, 127]) == (8 | 6, 6)  # -0.5 and 0.5 at k = -3: -4 and 4
    assert weights[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert not packed[0, 2:].any() and not scale[0, 2:].any()
    assert torch.equal(packed, mxfp4_q_quant_reference(q, torch.ones(1, 2), 0.5, 4)[0])


def test_heads_per_program_by_step_size() -> None:
    assert [heads_per_program(t, 32) for t in (1, 127, 128, 1023, 1024, 16384)] == [2, 2, 8, 8, 16, 16]
    assert [heads_per_program(t, 3) for t in (1, 128, 1024)] == [2, 4, 4]  # at most next_pow2(H)
    kernel = MXFP4QQuant()
    q, w = _inputs(1, 32)
    assert kernel.dispatch(index_q=q, index_weights=w, padded_num_heads=32).fields()["full"]
    assert not kernel.dispatch(index_q=q, index_weights=w, padded_num_heads=64).fields()["full"]
    q3, w3 = _inputs(1, 3)
    assert not kernel.dispatch(index_q=q3, index_weights=w3, padded_num_heads=3).fields()["full"]


def test_layouts_share_one_binary() -> None:
    """A contiguous query, a column view of a wider projection and a head-strided view: the same key and results
    equal to the reference."""
    kernel, keys = MXFP4QQuant(), set()
    q, w = _inputs(3, 8)
    wide = torch.zeros(3, 8, 256, dtype=torch.bfloat16)
    wide[..., 64:192] = q
    for view in (q.contiguous(), q, wide[..., 64:192]):
        _run(view, w, 32)
        keys.add(kernel.dispatch(index_q=view, index_weights=w, padded_num_heads=32))
    assert len(keys) == 1


def test_empty_batch_and_errors() -> None:
    kernel = MXFP4QQuant()
    q, w = _inputs(2, 4)
    packed, scale, weights = kernel(q[:0], w[:0], 1.0, 32)
    assert packed.shape == (0, 32, 64) and scale.shape == (0, 32) and weights.shape == (0, 32)
    with pytest.raises(warmreg.LaunchError, match="index_q must be"):
        kernel(q[..., :64], w, 1.0, 32)  # D = 64: vLLM asserts four MXFP4 blocks
    with pytest.raises(warmreg.LaunchError, match="index_weights must be"):
        kernel(q, w[:1], 1.0, 32)
    with pytest.raises(warmreg.LaunchError, match="padded_num_heads"):
        kernel(q, w, 1.0, 2)
    with pytest.raises(warmreg.LaunchError, match="index_q must be"):
        kernel(q.int(), w, 1.0, 32)


def test_out() -> None:
    def build() -> OpCall:
        q, w = _inputs(3, 5)
        return OpCall(MXFP4QQuant(), (q, w, 0.25, 32))

    check_out(build)
