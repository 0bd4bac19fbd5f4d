"""The DCP correction of the MLA decode: the PyTorch reference under Triton's interpreter, the special lses (NaN,
+inf, every rank empty), views and errors, and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.dcp_correct_attn_out import DCPCorrectAttnOut, dcp_correct_attn_out_reference, lse_base_on_e

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = DCPCorrectAttnOut.name
INF = float("inf")


def _kernel(n: int = 4) -> DCPCorrectAttnOut:
    return DCPCorrectAttnOut(dtype="bfloat16", head_dim=64, world_size=n, is_base_e=True)


def _inputs(tokens: int, heads: int, n: int, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, d, generator=g).bfloat16(), torch.randn(n, tokens, heads, generator=g) * 3


def test_hand_picked_lses() -> None:
    """Two ranks of equal lse: each output halves and the lse grows by log 2; a rank with lse -inf (an empty shard)
    gets a zero factor; every rank empty: zero output (the NaN of -inf - -inf taken as -inf), lse -inf."""
    out = torch.ones(3, 1, 4, dtype=torch.float32)
    lses = torch.tensor([[[0.0], [-INF], [-INF]], [[0.0], [1.0], [-INF]]])
    lse = DCPCorrectAttnOut(dtype="float32", head_dim=4, world_size=2, is_base_e=True)(out, lses, 0)
    assert out[0].tolist() == [[0.5] * 4] and out[1].tolist() == [[0.0] * 4] and out[2].tolist() == [[0.0] * 4]
    assert lse[0, 0].item() == pytest.approx(0.6931472) and lse[1, 0].item() == 1.0 and lse[2, 0].item() == -INF


@pytest.mark.parametrize("base_e", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "n", "rank"), [(1, 1, 2, 1), (5, 3, 4, 2), (7, 16, 8, 0)])
def test_matches_reference(base_e: bool, tokens: int, heads: int, n: int, rank: int) -> None:
    out, lses = _inputs(tokens, heads, n, seed=tokens)
    lses[0, 0, 0] = float("nan")  # a NaN and a +inf lse count as -inf
    lses[-1, -1, -1] = INF
    lses[:, tokens // 2, 0] = -INF  # a row no rank attended to
    want_out, want_lse = dcp_correct_attn_out_reference(out, lses, rank, is_lse_base_on_e=base_e)
    got_lse = _kernel(n)(out, lses, rank, is_lse_base_on_e=base_e)
    # the lse: the same fp32 operations; the output: the interpreter truncates fp32 -> bf16 (one bf16 step)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2**-7, atol=2**-7)


def test_views_of_vllm_call_sites() -> None:
    """``out [B, 1, H, D]`` and ``lses [N, B, H, 1]`` (vLLM's normalisation), a head-strided output slice, and a
    transposed lses view: one binary."""
    kernel, keys = _kernel(2), set()
    base, lses = _inputs(4, 6, 2, seed=3)
    for out, ls in (
        (base.clone().unsqueeze(1), lses.unsqueeze(-1)),
        (base.clone()[:, ::2], lses[:, :, ::2]),
        (base.clone(), lses.transpose(1, 2).contiguous().transpose(1, 2)),
    ):
        want_out, want_lse = dcp_correct_attn_out_reference(out, ls, 1)
        got_lse = kernel(out, ls, 1)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.float().reshape(want_out.shape), want_out.float(), rtol=2**-7, atol=2**-7)
        flat = out.squeeze(1) if out.ndim == 4 else out
        keys.add(kernel.dispatch(attn_out=flat, lses=ls.squeeze(-1) if ls.ndim == 4 else ls, is_lse_base_on_e=True))
    assert len(keys) == 1


def test_empty_batch_and_launch_errors() -> None:
    kernel, (out, lses) = _kernel(4), _inputs(3, 2, 4)
    assert kernel(out[:0], lses[:, :0], 0).shape == (0, 2)
    with pytest.raises(warmreg.LaunchError, match="cp_rank"):
        kernel(out, lses, 4)
    with pytest.raises(warmreg.LaunchError, match="power of two"):
        kernel(out, lses[:3], 0)
    with pytest.raises(warmreg.LaunchError, match="lses must be"):
        kernel(out, lses[:, :2], 0)
    with pytest.raises(warmreg.LaunchError, match="unit stride over D"):
        kernel(out.transpose(1, 2).contiguous().transpose(1, 2), lses, 0)
    with pytest.raises(warmreg.LaunchError, match="D a power of two"):
        kernel(out[..., :48], lses, 0)


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
@pytest.mark.parametrize("dcp", [2, 8])
def test_one_key_with_dcp(target: str, dcp: int) -> None:
    (key,) = warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=dcp), target=target).kernel(NAME).keys
    assert key.fields() == {
        "out_dtype": "bfloat16", "lse_dtype": "float32", "head_dim": 512, "world_size": dcp, "is_base_e": True,
        "num_warps": 4,
    }  # fmt: skip


def test_not_planned_without_dcp_or_off_cuda() -> None:
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernels}
    dcp = example_config("kimi_k3", decode_context_parallel_size=4)
    assert NAME not in {k.name for k in warmreg.plan(dcp, target="rocm:gfx942").kernels}
    with pytest.raises(warmreg.ConfigError, match="power of two"):
        warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=3), target="cuda:90")


@pytest.mark.parametrize("backend", ["FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "TRITON_MLA"])
def test_every_dense_mla_backend_has_natural_log_lses(backend: str) -> None:
    """Kimi-K3's MLA backends all keep vLLM's default ``lse_base_on_e = True`` (FlashInfer's dense MLA sets it
    too); only the sparse FlashInfer and TokenSpeed backends are base 2."""
    config = warmreg.WarmConfig.load(example_config("kimi_k3", attention_backend=backend))
    assert lse_base_on_e(config)
    assert not lse_base_on_e(warmreg.WarmConfig.load(example_config("kimi_k3", attention_backend="TOKENSPEED_MLA")))


@pytest.mark.parametrize("tokens", [1, 37, 8192])
def test_runtime_shapes_are_planned(tokens: int) -> None:
    """The decode's latent output ``[T, H, 512]`` at any token and head count, the all-gathered ``[N, T, H]``."""
    kp = warmreg.plan(example_config("kimi_k3", decode_context_parallel_size=8), target="cuda:90").kernel(NAME)
    for heads in (12, 96):
        out = warmreg.meta((tokens, heads, 512), torch.bfloat16)
        lses = warmreg.meta((8, tokens, heads), torch.float32)
        assert kp.kernel.dispatch(attn_out=out, lses=lses, is_lse_base_on_e=True) in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, [next(iter(kp.keys))])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        out, lses = _inputs(3, 5, 4, seed=9)
        return OpCall(_kernel(4), (out, lses, 3), {})

    check_out(build)
