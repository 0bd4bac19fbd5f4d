"""The fused Q/KV RMSNorm against its PyTorch reference (Triton interpreter on CPU), and warm parity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import warmreg
from warmreg.ops import FusedQKVRMSNorm, fused_qkv_rmsnorm_reference

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _inputs(tokens: int, q: int, kv: int, width: int, *, offset: int = 0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(tokens * width + offset, generator=gen).to(torch.bfloat16)[offset:].view(tokens, width)
    qw = (1 + 0.1 * torch.randn(q, generator=gen)).to(torch.bfloat16)
    kvw = (1 + 0.1 * torch.randn(kv, generator=gen)).to(torch.bfloat16)
    return proj[:, :q], proj[:, q : q + kv], qw, kvw


@pytest.mark.parametrize(
    ("tokens", "q", "kv", "width", "offset"),
    [
        (3, 64, 32, 96, 0),  # regular: views of one projection
        (1, 48, 24, 80, 0),  # T = 1, non-power-of-two sizes, a gap column block (Kimi's RoPE part)
        (5, 40, 33, 80, 3),  # odd sizes, misaligned base (offset view)
    ],
)
def test_matches_reference(tokens: int, q: int, kv: int, width: int, offset: int) -> None:
    qr, kv_in, qw, kvw = _inputs(tokens, q, kv, width, offset=offset)
    kernel = FusedQKVRMSNorm(q_size=q, kv_size=kv, proj_width=width)
    q_out, kv_out = kernel(qr, kv_in, qw, kvw, 1e-6)
    q_ref, kv_ref = fused_qkv_rmsnorm_reference(qr, kv_in, qw, kvw, 1e-6)
    # Both compute in fp32 and round once to bf16; the only difference is fp32 summation order,
    # which can flip the final bf16 rounding by one ulp (2**-7 relative).
    torch.testing.assert_close(q_out, q_ref, atol=0, rtol=2**-7)
    torch.testing.assert_close(kv_out, kv_ref, atol=0, rtol=2**-7)
    for out, x in ((q_out, qr), (kv_out, kv_in)):  # fresh outputs: contiguous, of the inputs' shape, dtype and device
        assert out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype and out.device == x.device


def test_empty_batch_launches_nothing_and_returns_empty_outputs() -> None:
    qr, kv_in, qw, kvw = _inputs(0, 64, 32, 96)
    q_out, kv_out = FusedQKVRMSNorm(q_size=64, kv_size=32, proj_width=96)(qr, kv_in, qw, kvw, 1e-6)
    assert q_out.shape == (0, 64) and kv_out.shape == (0, 32)


def test_bad_inputs_are_named() -> None:
    qr, kv_in, qw, kvw = _inputs(2, 64, 32, 96)
    kernel = FusedQKVRMSNorm(q_size=64, kv_size=32, proj_width=96)
    with pytest.raises(warmreg.LaunchError, match="weights"):
        kernel(qr, kv_in, kvw, kvw, 1e-6)
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        kernel(qr.t().contiguous().t(), kv_in, qw, kvw, 1e-6)  # same shape, column-major
    with pytest.raises(warmreg.LaunchError, match="one T"):
        kernel(qr[:1], kv_in, qw, kvw, 1e-6)
    # the weights' checks ride on the key memo: a good launch first, then each bad weight still fails
    kernel(qr, kv_in, qw, kvw, 1e-6, False)
    with pytest.raises(warmreg.LaunchError, match="weights must match"):
        kernel(qr, kv_in, qw[:63], kvw, 1e-6, False)
    with pytest.raises(warmreg.LaunchError, match="share one dtype"):
        kernel(qr, kv_in.half(), qw, kvw, 1e-6, False)
    with pytest.raises(warmreg.LaunchError, match="share one dtype"):
        kernel(qr, kv_in, qw, kvw.float(), 1e-6, False)


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3"])
def test_runtime_shapes_hit_a_warmed_key(example: str) -> None:
    """Parity: runtime-shaped meta inputs (T = 1, 16, 17, 4096) each dispatch to a warmed key."""
    plan = warmreg.plan(EXAMPLES / f"{example}.json", target="cuda:90")
    kp = plan.kernel(FusedQKVRMSNorm.name)
    text = plan.config.text
    q = text["q_lora_rank"]
    kv = text.get("kv_lora_rank") if example == "kimi_k3" else text["head_dim"]
    width = q + kv + (64 if example == "kimi_k3" else 0)
    for tokens in (1, 16, 17, 4096):
        proj = warmreg.meta((tokens, width), torch.bfloat16)
        key = kp.kernel.dispatch(
            qr=proj[:, :q], kv=proj[:, q : q + kv], q_weight=warmreg.meta((q,), torch.bfloat16),
            kv_weight=warmreg.meta((kv,), torch.bfloat16), launch_pdl=True,
        )  # fmt: skip
        assert key in kp.keys, key


def test_offset_view_is_a_different_key_and_the_diff_names_alignment() -> None:
    kernel = FusedQKVRMSNorm(q_size=1024, kv_size=512, proj_width=1536)
    base = warmreg.meta((8, 1536), torch.bfloat16)
    shifted = warmreg.meta((8, 1536), torch.bfloat16, offset=1)
    w_q, w_kv = warmreg.meta((1024,), torch.bfloat16), warmreg.meta((512,), torch.bfloat16)
    a = kernel.dispatch(qr=base[:, :1024], kv=base[:, 1024:], q_weight=w_q, kv_weight=w_kv, launch_pdl=True)
    b = kernel.dispatch(qr=shifted[:, :1024], kv=shifted[:, 1024:], q_weight=w_q, kv_weight=w_kv, launch_pdl=True)
    assert {d.field for d in a.diff(b)} == {"q_in_aligned", "kv_in_aligned"}


def test_dsv4_and_kimi_registrations_share_one_kernel(triton_cache: Path) -> None:
    """The shared op registered by two families is one kernel; equal keys compile once."""
    dsv4 = FusedQKVRMSNorm(q_size=1536, kv_size=512, proj_width=2048)
    kimi = FusedQKVRMSNorm(q_size=1536, kv_size=512, proj_width=2112)

    class Both:
        @warmreg.hookimpl
        def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
            registry.add(dsv4)
            registry.add(kimi)

    cfg = {"model": {"model_type": "mixed"}, "serving": {"max_num_batched_tokens": 256}}
    report = warmreg.warm(cfg, target="cuda:90", plugins=[Both()], entry_points=False)
    assert report.declared == 1 and report.compiled == 1


def test_memoized_dispatch_equals_the_computed_key_for_every_input_class() -> None:
    from warmreg.ops import FusedQKVRMSNorm

    op = FusedQKVRMSNorm(q_size=96, kv_size=64, proj_width=160)
    FusedQKVRMSNorm._keys.clear()  # shared by every instance
    for dtype in (torch.bfloat16, torch.float16):
        for offset in (0, 1, 8):
            for width in (160, 161):
                proj = torch.zeros(3 * width + offset, dtype=dtype)[offset:].view(3, width)
                qw, kvw = torch.ones(96, dtype=dtype), torch.ones(64, dtype=dtype)
                for pdl in (False, True):
                    args = dict(qr=proj[:, :96], kv=proj[:, 96:160], q_weight=qw, kv_weight=kvw, launch_pdl=pdl)
                    first = op.dispatch(**args)
                    assert first == op._dispatch(**args)
                    assert op.dispatch(**args) is first  # served from the memo
    # offsets 0 and 8 elements (16 bytes) share residues, so one memo entry: 2 dtypes x 2 x 2 widths x 2
    assert len({k.q_in_aligned for k in op._keys.values()}) == 2 and len(op._keys) == 16
    other = FusedQKVRMSNorm(q_size=96, kv_size=64, proj_width=160)  # an engine's own instance
    assert other.dispatch(**args) is op.dispatch(**args) and len(op._keys) == 16
