"""ROCm's in-tree sparse MLA prefill on ragged indices: the reference under Triton's interpreter, hand-picked softmax
cases (one key, the sink, skipped entries, an empty stretch), chunk slices, the interpreter's bf16 dot fix, errors, the plan (ROCm without aiter's
sparse MLA prefill), out=, and real cross-compiles for gfx942 and gfx950."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import rocm_sparse_attn_prefill
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.rocm_sparse_attn_prefill import RocmSparseAttnPrefill, rocm_sparse_attn_prefill_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
BF16, I32 = torch.bfloat16, torch.int32


@pytest.fixture(autouse=True)
def _bf16_dot() -> Iterator[None]:
    """Triton 3.8's interpreter multiplies bf16 ``tl.dot`` operands as raw bits: by value here (see
    :mod:`warmreg_deepseek_v4._interpreter_dot`); compiled kernels are untouched."""
    with bf16_dot_by_value():
        yield


def _inputs(seed: int, tokens: int, heads: int, dim: int, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """Queries, a workspace, a ragged stream (some entries -1 or past the workspace) and fp32 sinks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g).to(BF16)
    kv = torch.randn(rows, dim, generator=g).to(BF16)
    lens = torch.randint(0, width + 1, (tokens,), generator=g)
    indptr = torch.zeros(tokens + 1, dtype=I32)
    indptr[1:] = lens.cumsum(0)
    indices = torch.randint(-1, rows + 2, (int(indptr[-1]) + 3,), generator=g, dtype=I32)
    sink = torch.randn(heads, generator=g)
    return q, kv, indices, indptr, sink


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # The kernel rounds each tile's probabilities to bf16 before the second dot (a relative 2**-9 a term) and
    # accumulates in another order; outputs are averages of N(0, 1) rows: within 2e-2 absolute of the exact softmax.
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2**-6)


@pytest.mark.parametrize(
    ("tokens", "heads", "dim", "rows", "width", "sink"),
    [(4, 8, 512, 70, 40, True), (3, 19, 72, 30, 50, True), (5, 3, 64, 20, 9, False)],
)
def test_matches_reference(tokens: int, heads: int, dim: int, rows: int, width: int, sink: bool) -> None:
    """DeepSeek-V4's 512 lanes with a sink; 19 heads (two head blocks, the second partial) on 72 lanes (a masked
    block of 128) with stretches past a tile of 32 keys; no sink."""
    q, kv, indices, indptr, sinks = _inputs(dim + heads, tokens, heads, dim, rows, width)
    s = sinks if sink else None
    scale = dim**-0.5
    got = RocmSparseAttnPrefill()(q, kv, indices, indptr, s, scale=scale)
    _close(got, rocm_sparse_attn_prefill_reference(q, kv, indices, indptr, s, scale=scale))


def test_one_key_sink_and_skipped_entries() -> None:
    """One live key of value v: out = v / (1 + exp(z - s)) with the sink, v without; -1 and out-of-range entries
    add nothing; an empty stretch writes 0."""
    kv = torch.tensor([[1.0, 2.0], [0.5, -4.0]], dtype=BF16)
    q = torch.tensor([[[2.0, 0.0]], [[1.0, 1.0]]], dtype=BF16)  # s = (q . kv[1]) * 0.5 = 0.5 for token 0
    indices = torch.tensor([-1, 1, 7], dtype=I32)
    indptr = torch.tensor([0, 3, 3], dtype=I32)
    sink = torch.tensor([0.25])
    out = RocmSparseAttnPrefill()(q, kv, indices, indptr, sink, scale=0.5)
    factor = 1 / (1 + math.exp(0.25 - 0.5))
    torch.testing.assert_close(out[0, 0].float(), torch.tensor([0.5, -4.0]) * factor, atol=1e-2, rtol=2**-7)
    assert out[1].tolist() == [[0.0, 0.0]]
    plain = RocmSparseAttnPrefill()(q, kv, indices, indptr, scale=0.5)
    assert plain[0, 0].tolist() == [0.5, -4.0] and plain[1].tolist() == [[0.0, 0.0]]


def test_chunk_slice_of_the_layer_output() -> None:
    """``q[start:end]`` and ``output[start:end]`` of the layer's buffers: rows outside the slice untouched."""
    q, kv, indices, indptr, sink = _inputs(9, 6, 4, 512, 40, 20)
    output = torch.full((8, 4, 512), 7.0, dtype=BF16)
    RocmSparseAttnPrefill()(q[1:4], kv, indices, indptr[:4], sink, scale=0.125, out=output[2:5])
    want = rocm_sparse_attn_prefill_reference(q[1:4], kv, indices, indptr[:4], sink, scale=0.125)
    _close(output[2:5], want)
    assert (output[:2] == 7).all() and (output[5:] == 7).all()


def test_launch_errors() -> None:
    q, kv, indices, indptr, sink = _inputs(1, 2, 2, 64, 8, 4)
    kernel = RocmSparseAttnPrefill()
    with pytest.raises(warmreg.LaunchError, match="q must be"):
        kernel(q.transpose(1, 2), kv, indices, indptr, sink, scale=1.0)
    with pytest.raises(warmreg.LaunchError, match="kv must be"):
        kernel(q, kv[:, :32], indices, indptr, sink, scale=1.0)
    with pytest.raises(warmreg.LaunchError, match="indptr must be"):
        kernel(q, kv, indices, indptr[:2], sink, scale=1.0)
    with pytest.raises(warmreg.LaunchError, match="indices must be"):
        kernel(q, kv, indices.long(), indptr, sink, scale=1.0)
    with pytest.raises(warmreg.LaunchError, match="attn_sink must be"):
        kernel(q, kv, indices, indptr, sink[:1], scale=1.0)


def _plan(target: str, example: str = "deepseek_v4_flash") -> warmreg.Plan:
    plugin = RegisterPlugin(rocm_sparse_attn_prefill.register, model=DSV4.from_config)
    return warmreg.plan(example_config(example), target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "rocm:gfx950+aiter"])
def test_planned_one_key_for_the_in_tree_prefill(target: str) -> None:
    keys = _plan(target).kernel(RocmSparseAttnPrefill.name).keys
    assert [(k.q_dtype, k.kv_dtype, k.has_sink, k.out_dv, k.block_h, k.block_d, k.block_k) for k in keys] == [
        ("bfloat16", "bfloat16", True, 512, 16, 512, 16)
    ]
    assert_warmup_inputs_reproduce(RocmSparseAttnPrefill(), keys)


@pytest.mark.parametrize("target", ["rocm:gfx950+aiter+aiter_sparse_mla", "cuda:90", "cuda:100"])
def test_not_planned_with_aiter_prefill_or_off_rocm(target: str) -> None:
    assert not _plan(target).kernels


def test_warm_cross_compiles_for_gfx942_and_gfx950() -> None:
    plugin = RegisterPlugin(rocm_sparse_attn_prefill.register, model=DSV4.from_config)
    for target in ("rocm:gfx942", "rocm:gfx950"):
        report = warmreg.warm(
            example_config("deepseek_v4_flash"), target=target, plugins=[plugin], entry_points=False, workers=1
        )
        assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    def build() -> OpCall:
        q, kv, indices, indptr, sink = _inputs(4, 3, 2, 64, 10, 6)
        return OpCall(RocmSparseAttnPrefill(), (q, kv, indices, indptr, sink), {"scale": 0.125})

    check_out(build)


def test_the_interpreter_fix_restores_the_builder() -> None:
    """Outside :func:`bf16_dot_by_value` the interpreter's own dot is back (nested: the fixture's is active here)."""
    from triton.runtime import interpreter

    before = interpreter.InterpreterBuilder.create_dot
    with bf16_dot_by_value():
        assert interpreter.InterpreterBuilder.create_dot is not before
    assert interpreter.InterpreterBuilder.create_dot is before
