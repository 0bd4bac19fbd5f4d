"""The XPU attention's Q norm + RoPE and KV RoPE (``deepseek_v4.xpu_qnorm_rope``): against its reference under
Triton's interpreter, a hand-worked rotation, in-place ``q``, errors, out=, and its plan (XPU only, one key). vLLM
0.34's kernel is compared bitwise in ``tests/engines/test_vllm034_kernels_dsv4_xpu.py``.

Tolerance against the reference: one BF16 rounding (``rtol = 2**-7``, ``atol = 0``): both compute in fp32, but
Triton's interpreter truncates fp32 -> bf16 where torch rounds to nearest; the NoPE part of ``kv`` is copied, exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4.xpu_qnorm_rope import XPUQNormRope, xpu_qnorm_rope_reference

import warmreg
from warmreg.testing import OpCall, assert_allocates_nothing, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = XPUQNormRope.name
BF16 = torch.bfloat16


def _inputs(t: int, h: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, 512, generator=gen) * 3).to(BF16)
    kv = torch.randn(t, 512, generator=gen).to(BF16)
    angles = torch.rand(40, 32, generator=gen) * 6.28
    return q, kv, torch.randint(0, 40, (t,), generator=gen), torch.cat([angles.cos(), angles.sin()], 1)


@pytest.mark.parametrize(("t", "h"), [(1, 1), (5, 16), (3, 7)])
def test_matches_reference(t: int, h: int) -> None:
    q, kv, pos, cs = _inputs(t, h, seed=t * h)
    want_q, want_kv = xpu_qnorm_rope_reference(q, kv, pos, cs, 1e-6)
    got_q, got_kv = XPUQNormRope(num_heads=h)(q, kv, pos, cs, 1e-6)
    assert got_q is q  # in place, as vLLM
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=2**-7)
    torch.testing.assert_close(got_kv, want_kv, atol=0, rtol=2**-7)
    assert torch.equal(got_kv[:, :448], kv[:, :448])


def test_hand_worked_rotation() -> None:
    """A KV pair (1, 0) at angle pi/2 becomes (0, 1); a query head of ones is normed to ones (eps 0)."""
    q, kv = torch.ones(1, 1, 512, dtype=BF16), torch.zeros(1, 512, dtype=BF16)
    kv[0, 448] = 1.0
    cs = torch.cat([torch.zeros(1, 32), torch.ones(1, 32)], 1)  # cos 0, sin 1
    got_q, got_kv = XPUQNormRope()(q, kv, torch.zeros(1, dtype=torch.int64), cs, 0.0)
    assert got_kv[0, 448:450].tolist() == [0.0, 1.0] and got_q[0, 0, :448].eq(1).all()
    assert got_q[0, 0, 448:450].tolist() == [-1.0, 1.0]  # (1, 1) rotated: (1*0 - 1*1, 1*1 + 1*0)


def test_errors_name_the_argument() -> None:
    q, kv, pos, cs = _inputs(2, 3, seed=1)
    for args, match in (
        ((q[:, :, :256], kv, pos, cs), "q must be"),
        ((q, kv.float(), pos, cs), "kv must be"),
        ((q, kv, pos.int(), cs), "positions must be"),
        ((q, kv, pos, cs[:, :32]), "cos_sin_cache must be"),
    ):
        with pytest.raises(warmreg.LaunchError, match=match):
            XPUQNormRope()(*args, 1e-6)


def test_out() -> None:
    """``out`` is the ``kv_roped`` buffer (``q`` is normalized in place, not an out= buffer): given, the launch
    allocates nothing and fills it as a fresh launch does; a wrong one is refused."""
    q, kv, pos, cs = _inputs(3, 2, seed=4)
    assert_allocates_nothing(
        OpCall(XPUQNormRope(), (q.clone(), kv, pos, cs, 1e-6), {}), torch.empty(3, 512, dtype=BF16)
    )
    buf = torch.full((3, 512), 9.0, dtype=BF16)
    _, got = XPUQNormRope()(q.clone(), kv, pos, cs, 1e-6, out=buf)
    _, fresh = XPUQNormRope()(q.clone(), kv, pos, cs, 1e-6)
    assert got is buf and torch.equal(buf, fresh)
    with pytest.raises(warmreg.LaunchError, match="out"):
        XPUQNormRope()(q, kv, pos, cs, 1e-6, out=torch.empty(3, 512))


def test_plan() -> None:
    """On XPU: one key (the example's heads over its TP, its epsilon); nothing on CUDA or ROCm."""
    config = example_config("deepseek_v4_flash")
    kp = warmreg.plan(config, target="xpu:pvc").kernel(NAME)
    (key,) = kp.keys
    tp = int(config["serving"].get("tensor_parallel_size", 1))
    heads = int(config["model"]["num_attention_heads"]) // tp
    assert key.fields() == {"dtype": "bfloat16", "cos_sin_dtype": "float32", "num_heads": heads,
                            "eps": float(config["model"]["rms_norm_eps"]), "num_warps": 4}  # fmt: skip
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    for target in ("cuda:90", "cuda:100", "rocm:gfx942"):
        assert NAME not in {k.name for k in warmreg.plan(config, target=target).kernels}
