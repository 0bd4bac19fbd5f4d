"""The DSA indexer query quant with folded weights: the PyTorch reference under Triton's interpreter, the scale
math, padding heads, strided views, errors, the plan and ``out=``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.dsa import DSALayout
from warmreg_kimi_k3.dsa_q_quant import DSAQQuantFoldWeights, dsa_q_quant_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = DSAQQuantFoldWeights.name
LAYOUT = DSALayout(
    layers=(4,), index_topk=64, index_head_dim=128, index_num_heads=3, index_k_norm_type="layernorm",
    indexer_fp4=False, fused_k_insert=True, fused_prologue=True, q_lora_rank=96, kv_lora_rank=256,
    qk_rope_head_dim=64, eps=1e-5, dtype="bfloat16",
)  # fmt: skip
KERNEL = DSAQQuantFoldWeights(layout=LAYOUT, max_num_batched_tokens=8)


def _inputs(t: int, h: int, d: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``index_q`` and the weights as vLLM's fused path has them: column views of two projection outputs."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, 40 + h * d, generator=g) * 4).bfloat16()[:, 40:].view(t, h, d)
    w = torch.randn(t, 3 + h, generator=g).bfloat16()[:, 3:]
    return q, w


def _codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3fn bytes equal up to Triton 3.8's interpreter, whose fp32 -> e4m3fn conversion is not round-to-nearest-
    even: a code may be one step off, and a value that rounds up into the next binade loses the carry (code - 8
    where the reference's mantissa is 0). The GPU's conversion rounds to nearest even, and the differential test
    against vLLM's kernel (tests/engines/test_vllm034_kernels_kimi_dsa.py) is exact."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    same_sign = (g & 0x80) == (w & 0x80)
    bad = ~(same_sign & (((g - w).abs() <= 1) | (((w & 0x7) == 0) & (w - g == 8))))
    assert not bad.any(), f"{int(bad.sum())} codes differ: got {g[bad][:8].tolist()}, want {w[bad][:8].tolist()}"


@pytest.mark.parametrize(("t", "h", "padded"), [(1, 32, 32), (5, 3, 32), (3, 33, 64)])  # none, 29 and 31 pad heads
def test_matches_reference(t: int, h: int, padded: int) -> None:
    q, w = _inputs(t, h, seed=h)
    got_q, got_w = KERNEL(q, w, 0.125 * 64**-0.5, padded)
    want_q, want_w = dsa_q_quant_reference(q, w, 0.125 * 64**-0.5, padded)
    assert got_q.shape == (t, padded, 128) and got_q.dtype == torch.float8_e4m3fn and got_w.dtype == torch.float32
    _codes_close(got_q, want_q)
    assert torch.equal(got_w, want_w)  # exact: a product of powers of two and the weight
    assert (got_q.view(torch.uint8)[:, h:] == 0).all() and (got_w[:, h:] == 0).all()


def test_scale_math() -> None:
    """amax 3 -> scale 2**ceil(log2(3/448)) = 2**-7, so q = x * 128; a zero head takes the 1e-10 floor."""
    q = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    q[0, 0, :3] = torch.tensor([3.0, -1.5, 0.25])
    got_q, got_w = KERNEL(q, torch.tensor([[2.0, 5.0]], dtype=torch.bfloat16), 0.5, 2)
    assert got_q[0, 0, :4].float().tolist() == [384.0, -192.0, 32.0, 0.0]
    assert got_w[0, 0].item() == 2.0 * 2.0**-7 * 0.5
    assert got_w[0, 1].item() == 5.0 * 2.0**-42 * 0.5  # ceil(log2(1e-10 / 448)) = -42
    assert (got_q[0, 1].float() == 0).all()


def test_strided_and_empty() -> None:
    q, w = _inputs(4, 3)
    keys = {KERNEL.dispatch(index_q=x, index_weights=y) for x, y in ((q, w), (q.contiguous(), w.contiguous()))}
    assert len(keys) == 1
    a, b = KERNEL(q, w, 1.0, 32), KERNEL(q.contiguous(), w.contiguous(), 1.0, 32)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    empty_q, empty_w = KERNEL(q[:0], w[:0], 1.0, 32)
    assert empty_q.shape == (0, 32, 128) and empty_w.shape == (0, 32)


def test_launch_errors() -> None:
    q, w = _inputs(2, 3)
    for match, args in (
        ("index_q", (q[..., :100], w, 1.0, 32)),
        ("index_q", (q.transpose(1, 2), w, 1.0, 32)),
        ("index_weights", (q, w[:, :2], 1.0, 32)),
        ("padded_num_heads", (q, w, 1.0, 2)),
    ):
        with pytest.raises(warmreg.LaunchError, match=match):
            KERNEL(*args)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])  # fused prologue or not: scored either way
def test_one_key(target: str, kv_cache_dtype: str) -> None:
    kp = warmreg.plan(example_config("kimi_k3_dsa", kv_cache_dtype=kv_cache_dtype), target=target).kernel(NAME)
    (key,) = kp.keys
    assert key.fields() == {"q_dtype": "bfloat16", "weights_dtype": "bfloat16", "head_dim": 128, "num_warps": 1}
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_not_planned() -> None:
    """MXFP4 queries have their own kernel; no DSA layers, or a non-CUDA target: nothing."""
    for example, target, serving in (
        ("kimi_k3_dsa", "cuda:100", {"indexer_kv_dtype": "mxfp4"}), ("kimi_k3", "cuda:90", {}),
        ("kimi_k3_dsa", "rocm:gfx942", {}),
    ):  # fmt: skip
        names = {k.name for k in warmreg.plan(example_config(example, **serving), target=target).kernels}
        assert NAME not in names


def test_out() -> None:
    def build() -> OpCall:
        q, w = _inputs(3, 5, seed=1)
        return OpCall(DSAQQuantFoldWeights(layout=LAYOUT, max_num_batched_tokens=8), (q, w, 0.25, 32))

    check_out(build, tuple_error=r"out must be a tuple of 2 buffers")
