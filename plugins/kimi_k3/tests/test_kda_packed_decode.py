"""The packed KDA decode step against its reference in Triton's interpreter, and its planned keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import torch
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.kda_packed_decode import KDAPackedDecode, KDAPackedDecodeKey, kda_packed_decode_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAME = KDAPackedDecode.name
H, D = 2, 40  # a non-power-of-two head dim: K is masked in its 64-wide tile, V spans two 32-wide tiles
LAYOUT = KDALayout(num_heads=H, head_dim=D, conv_width=4, lower_bound=None, tensor_parallel_size=1,
                   num_speculative_tokens=0, dtype="bfloat16")  # fmt: skip
KERNEL = KDAPackedDecode(layout=LAYOUT)
# bf16 o from fp32 recurrences summed in different orders (as the recurrent step's tests); fp32 states likewise.
BF16: dict[str, Any] = {"atol": 1e-2, "rtol": 1.6e-2}
F32: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
SLOTS = 9


def _inputs(batch: int, row: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    p = H * D
    proj = torch.randn(batch, row, generator=g).bfloat16()  # the projection's rows: q | k | v | ... | beta
    return {
        "mixed_qkv": proj[:, : 3 * p],
        "raw_g": torch.randn(1, batch, H, D, generator=g).bfloat16(),
        "raw_beta": proj[:, row - H :].unsqueeze(0),  # a column block of the projection: token stride `row`
        "A_log": torch.rand(H, generator=g).mul(1.5).add(0.5).log(),
        "dt_bias": torch.randn(H * D, generator=g) * 0.5,
        "initial_state": torch.randn(SLOTS, H, D, D, generator=g) * 0.1,
    }


def _check(args: dict[str, Any], indices: list[int], lower_bound: float | None) -> None:
    ci = torch.tensor(indices, dtype=torch.int32)
    ref_o, ref_s = kda_packed_decode_reference(**args, lower_bound=lower_bound, state_indices=ci)
    got_s = args["initial_state"].clone()
    o = KERNEL(**{**args, "initial_state": got_s}, lower_bound=lower_bound, state_indices=ci, launch_pdl=False)
    assert o.shape == (1, len(indices), H, D) and o.dtype == torch.bfloat16
    torch.testing.assert_close(o, ref_o, **BF16)
    torch.testing.assert_close(got_s, ref_s, **F32)
    dead = [i for i in indices if i <= 0]
    assert not o[0, [n for n, i in enumerate(indices) if i <= 0]].any()  # padded rows: zeros
    untouched = [s for s in range(SLOTS) if s not in indices or s in dead]
    assert torch.equal(got_s[untouched], args["initial_state"][untouched])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(("indices", "row"), [([3], 3 * H * D), ([3], 288), ([4, 0, 2, 7, -1], 3 * H * D)])
def test_matches_reference(indices: list[int], row: int, lower_bound: float | None) -> None:
    """A batch of one (mixed rows contiguous, or a row of the wider projection) and of five with the null slot 0
    and a padded -1 (zeros out, no state read or written), softplus and lower-bounded gates."""
    _check(_inputs(len(indices), max(row, 3 * H * D + H)), indices, lower_bound)


def test_zero_dt_bias_and_strided_indices() -> None:
    """``dt_bias`` zero (the gate sees the raw projection alone) and a block-table column as the indices."""
    args = {**_inputs(3, 3 * H * D + H, seed=1)}
    args["dt_bias"] = torch.zeros(H * D)
    ci = torch.tensor([[1, 9], [5, 9], [8, 9]], dtype=torch.int32)[:, 0]
    ref_o, ref_s = kda_packed_decode_reference(**args, lower_bound=None, state_indices=ci)
    got_s = args["initial_state"].clone()
    o = KERNEL(**{**args, "initial_state": got_s}, lower_bound=None, state_indices=ci, launch_pdl=False)
    torch.testing.assert_close(o, ref_o, **BF16)
    torch.testing.assert_close(got_s, ref_s, **F32)


def test_empty_batch() -> None:
    args = _inputs(0, 3 * H * D + H)
    o = KERNEL(**args, lower_bound=None, state_indices=torch.zeros(0, dtype=torch.int32), launch_pdl=False)
    assert o.shape == (1, 0, H, D)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"initial_state": torch.zeros(2, H, D, D, dtype=torch.bfloat16)}, "float32"),
        ({"mixed_qkv": torch.zeros(1, 3 * H * D + 1, dtype=torch.bfloat16)}, "mixed_qkv"),
        ({"raw_g": torch.zeros(1, 1, H, D + 1, dtype=torch.bfloat16)}, "raw_g"),
        ({"dt_bias": torch.zeros(H, D).t()}, "dt_bias"),
        ({"lower_bound": 1.0}, "lower_bound"),
        ({"state_indices": torch.zeros(1, dtype=torch.int64)}, "state_indices"),
    ],
)  # fmt: skip
def test_launch_errors(change: dict[str, Any], message: str) -> None:
    args = {**_inputs(1, 3 * H * D + H), "lower_bound": None, "state_indices": torch.ones(1, dtype=torch.int32)}
    with pytest.raises(warmreg.LaunchError, match=message):
        KERNEL(**{**args, **change}, launch_pdl=False)


def _example(name: str = "kimi_k3.json", **serving: Any) -> dict[str, Any]:
    data = json.loads((EXAMPLES / name).read_text())
    data.pop("description")
    data["serving"].update(serving)
    return data


def _keys(kp: warmreg.KernelPlan) -> list[KDAPackedDecodeKey]:
    return [cast(KDAPackedDecodeKey, k) for k in kp.keys]


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_plan_keys(target: str) -> None:
    """One key: every mixed row stride (3P, the 6288-wide projection row, the overlap path's 6144) is one int class;
    PDL on both SMs; the example sets a gate lower bound."""
    (key,) = _keys(warmreg.plan(_example(), target=target).kernel(NAME))
    assert (key.num_heads, key.head_k_dim, key.head_v_dim, key.block_k, key.block_v) == (12, 128, 128, 128, 32)
    assert (key.use_lower_bound, key.launch_pdl, key.num_warps, key.num_stages) == (True, True, 4, 2)
    assert key.mixed_aligned and key.g_aligned and key.state_aligned


@pytest.mark.parametrize(
    ("target", "serving", "planned"),
    [
        ("cuda:90", {"num_speculative_tokens": 0}, False),  # the native fused decode takes every decode step
        ("cuda:90", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, True),
        ("cuda:80", {"num_speculative_tokens": 0}, True),  # no native decode on SM80
        ("rocm:gfx942", {}, True),  # ROCm's Triton decode (speculation: no HIP fused decode)
        ("rocm:gfx942", {"num_speculative_tokens": 0}, False),  # the HIP fused decode
        ("rocm:gfx950+aiter", {}, False),  # aiter's Gluon decode
        ("rocm:gfx950", {}, True),
    ],
)
def test_registration(target: str, serving: dict[str, Any], planned: bool) -> None:
    plan = warmreg.plan(_example(**serving), target=target)
    assert (NAME in {k.name for k in plan.kernels}) == planned


def test_rocm_plans_one_key_without_pdl_for_the_fresh_conv_output() -> None:
    """ROCm's layer hands the packed decode the conv update's fresh [B, 3P] output, even for one row."""
    kp = warmreg.plan(_example(), target="rocm:gfx942").kernel(NAME)
    (key,) = _keys(kp)
    assert (key.launch_pdl, key.num_warps, key.num_stages, key.block_v) == (False, 4, 2, 32)
    state = warmreg.meta((300, 12, 128, 128), torch.float32)
    for b in (1, 7, 256):
        key = kp.kernel.dispatch(
            mixed_qkv=warmreg.meta((b, 3 * 1536), torch.bfloat16), raw_g=warmreg.meta((1, b, 12, 128), torch.bfloat16),
            raw_beta=warmreg.meta((b, 6288), torch.bfloat16)[:, 6272:6284].unsqueeze(0), lower_bound=-5.0,
            initial_state=state, launch_pdl=False,
        )  # fmt: skip
        assert key in kp.keys


def test_runtime_shapes_are_planned() -> None:
    """vLLM's launches: the conv's [B, 3P] output or one projection row, gate rows sliced from a later token, beta
    a projection column (any stride: unspecialized), a padded KV page as the pool's slot stride."""
    kp = warmreg.plan(_example(), target="cuda:90").kernel(NAME)
    p, row = 1536, 6288
    state = warmreg.meta((5000, 12, 128, 128), torch.float32, stride=(128 * 128 * 12 + 1536, 128 * 128, 128, 1))
    for b, width in ((64, 3 * p), (1, row), (1, 4 * p)):
        mixed = warmreg.meta((b, width), torch.bfloat16)[:, : 3 * p]
        g = warmreg.meta((1, b + 5, 12, 128), torch.bfloat16)[:, 5:]
        beta = warmreg.meta((b, row), torch.bfloat16)[:, 4 * p + 128 : 4 * p + 140].unsqueeze(0)
        key = kp.kernel.dispatch(mixed_qkv=mixed, raw_g=g, raw_beta=beta, lower_bound=-5.0, initial_state=state,
                                 launch_pdl=True)  # fmt: skip
        assert key in kp.keys


def test_warmup_inputs_reproduce_every_key() -> None:
    kp = warmreg.plan(_example(), target="cuda:90").kernel(NAME)
    extra = [attrs.evolve(k, mixed_aligned=False, g_aligned=False, use_lower_bound=True) for k in _keys(kp)]
    assert_warmup_inputs_reproduce(kp.kernel, [*kp.keys, *extra])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        inputs = _inputs(4, 3 * H * D + 24)
        indices = torch.tensor([4, 0, 2, 7], dtype=torch.int32)
        return OpCall(KDAPackedDecode(layout=LAYOUT), (), {**inputs, "lower_bound": None, "state_indices": indices, "launch_pdl": False})

    check_out(build)
