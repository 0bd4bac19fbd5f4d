"""The decode / speculative-decode conv1d against its reference in Triton's interpreter, and its planned keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from warmreg_kimi_k3.backends import KDALayout
from warmreg_kimi_k3.causal_conv1d_update import CausalConv1dUpdate, causal_conv1d_update_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NAME = CausalConv1dUpdate.name
LAYOUT = KDALayout(num_heads=1, head_dim=40, conv_width=4, lower_bound=None, tensor_parallel_size=1,
                   num_speculative_tokens=3, dtype="bfloat16")  # fmt: skip
KERNEL = CausalConv1dUpdate(layout=LAYOUT, plain_decode=True)
# fp32 sums in the same order on both sides; the interpreter truncates to bf16 where torch rounds to nearest,
# so outputs may differ by one bf16 step (2**-7 relative). States are copies: exact.
BF16 = {"atol": 1e-6, "rtol": 2**-7}
DIM = 120  # the packed q/k/v channels of the test layout; < BLOCK_N, so one masked channel block


def _inputs(tokens: int, rows: int, lines: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(tokens, DIM + 24, generator=g).bfloat16()  # the projection's rows: stride DIM + 24
    state = torch.randn(lines, rows, DIM, generator=g).bfloat16().transpose(1, 2)  # [lines, DIM, rows]
    return proj[:, :DIM], state, torch.randn(DIM, 4, generator=g)


def _check(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, indices: list[int], **kw: Any) -> None:
    ci, bias = torch.tensor(indices, dtype=torch.int32), kw.pop("bias", None)
    ref_y, ref_s = causal_conv1d_update_reference(
        x, state, weight, bias, ci, **{k: v for k, v in kw.items() if k != "max_query_len"}
    )
    got_s = state.clone()
    y = KERNEL(x, got_s, weight, bias, conv_state_indices=ci, launch_pdl=False, **kw)
    qsl = kw.get("query_start_loc")
    bounds = qsl.tolist() if qsl is not None else list(range(len(indices) + 1))
    live = [t for s, line in enumerate(indices) if line != 0 for t in range(bounds[s], bounds[s + 1])]
    torch.testing.assert_close(y[live], ref_y[live], **BF16)
    assert torch.equal(got_s, ref_s)


def test_plain_decode_with_null_block() -> None:
    """One token per sequence; line 0 (the null block of CUDA-graph padding) is skipped, its state untouched."""
    x, state, w = _inputs(5, 3)
    _check(x, state, w, [4, 0, 2, 7, 0])


def test_plain_decode_bias_no_silu() -> None:
    x, state, w = _inputs(3, 6, seed=1)
    _check(x, state, w, [1, 3, 5], bias=torch.randn(DIM), activation=None)


@pytest.mark.parametrize("accepted", [[1, 2, 3, 4], [4, 1, 1, 3]])
def test_spec_decode(accepted: list[int]) -> None:
    """Varlen steps of 4, 3, 1 and 4 tokens (3 drafts max), history from row accepted - 1, the state sliding."""
    lens = [4, 3, 1, 4]
    x, state, w = _inputs(sum(lens), 6, seed=2)
    qsl = torch.tensor([0, 4, 7, 8, 12], dtype=torch.int32)
    _check(x, state, w, [3, 6, 1, 8], num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
           query_start_loc=qsl, max_query_len=4)  # fmt: skip


def test_spec_decode_padding_rows() -> None:
    """CUDA-graph staging: padded requests on the null line with empty token ranges and accepted count 1."""
    x, state, w = _inputs(6, 6, seed=3)
    qsl = torch.tensor([0, 4, 6, 6, 6], dtype=torch.int32)
    _check(x, state, w, [5, 2, 0, 0], num_accepted_tokens=torch.tensor([2, 3, 1, 1], dtype=torch.int32),
           query_start_loc=qsl, max_query_len=4)  # fmt: skip


@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_two_speculative_steps_chain(accepted: int) -> None:
    """Step 2 continues from step 1's state with ``accepted`` of its tokens kept: its output equals the plain
    causal conv over the original history, the accepted tokens and step 2's tokens."""
    x1, state, w = _inputs(4, 6, seed=4)
    x2 = _inputs(4, 6, seed=5)[0]
    ci, qsl = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    hist = state[2, :, :3].float().clone()
    st = state.clone()
    KERNEL(x1, st, w, None, conv_state_indices=ci, num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
           query_start_loc=qsl, max_query_len=4, launch_pdl=False)  # fmt: skip
    y2 = KERNEL(x2, st, w, None, conv_state_indices=ci, num_accepted_tokens=torch.tensor([accepted], dtype=torch.int32),
                query_start_loc=qsl, max_query_len=4, launch_pdl=False)  # fmt: skip
    seq = torch.cat([hist, x1[:accepted].float().T, x2.float().T], dim=1)[:, accepted:]  # the last 3 kept, then x2
    acc = sum(w[:, j : j + 1] * seq[:, j : j + 4] for j in range(4))
    torch.testing.assert_close(y2, (acc / (1 + torch.exp(-acc))).T.bfloat16(), **BF16)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"conv_state_indices": None}, "conv_state_indices"),
        ({"query_start_loc": torch.tensor([0, 1], dtype=torch.int32)}, "go together"),
        ({"num_accepted_tokens": torch.ones(1, dtype=torch.int32), "query_start_loc": torch.tensor([0, 1], dtype=torch.int32),
          "max_query_len": 9}, "rows a line"),
    ],
)  # fmt: skip
def test_launch_errors(kw: dict[str, Any], message: str) -> None:
    x, state, w = _inputs(1, 3)
    args = {"conv_state_indices": torch.tensor([1], dtype=torch.int32), **kw}
    with pytest.raises(warmreg.LaunchError, match=message):
        KERNEL(x, state, w, None, launch_pdl=False, **args)


def _example(name: str = "kimi_k3.json", **serving: Any) -> dict[str, Any]:
    data = json.loads((EXAMPLES / name).read_text())
    data.pop("description")
    data["serving"].update(serving)
    return data


@pytest.mark.parametrize("example", ["kimi_k3.json", "kimi_k3_attn_res.json"])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_plan_keys_with_speculation(example: str, target: str) -> None:
    """One speculative key (4 tokens, 6 state rows); plain decode (vLLM resolves every decode backend to Triton
    with speculation): the projection's 6288-wide rows or the overlap path's 6144, times indices of stride 4 or 1."""
    keys = warmreg.plan(_example(example), target=target).kernel(NAME).keys
    spec = [k for k in keys if k.is_spec_decoding]
    assert [(k.seqlen, k.state_len, k.np2_statelen, k.stride_state_indices, k.is_varlen) for k in spec] == [
        (4, 6, 8, 4, True)
    ]
    plain = sorted((k.stride_x_seq, k.stride_state_indices) for k in keys if not k.is_spec_decoding)
    assert plain == [(6144, 1), (6144, 4), (6288, 1), (6288, 4)]
    assert {(k.dim, k.state_len if not k.is_spec_decoding else 3) for k in keys} == {(4608, 3)}


@pytest.mark.parametrize(
    ("target", "serving", "count"),
    [
        ("cuda:90", {"num_speculative_tokens": 0}, 0),  # the native fused decode takes every decode step
        ("cuda:90", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, 2),  # 6288 / 6144 rows
        ("cuda:120", {"num_speculative_tokens": 0, "kda_decode_backend": "triton"}, 1),  # no overlap path
        ("cuda:90", {"num_speculative_tokens": 0, "tensor_parallel_size": 4, "kda_decode_backend": "triton"}, 1),
        ("cuda:80", {"num_speculative_tokens": 0}, 1),  # no native decode on SM80
    ],
)
def test_plain_decode_registration(target: str, serving: dict[str, Any], count: int) -> None:
    plan = warmreg.plan(_example(**serving), target=target)
    names = [k.kernel.name for k in plan.kernels]
    assert (len(plan.kernel(NAME).keys) if NAME in names else 0) == count


def test_runtime_spec_shapes_are_planned() -> None:
    kp = warmreg.plan(_example(), target="cuda:90").kernel(NAME)
    p3 = 3 * 1536
    state = warmreg.meta((5000, 6, p3), torch.bfloat16, stride=(442368, p3, 1)).transpose(1, 2)
    w = warmreg.meta((p3, 4), torch.float32)
    for tokens, first, width in ((1024, 0, 6288), (40, 24, 6288), (4, 0, p3), (8, 0, 6144)):
        x = warmreg.meta((tokens + first, width), torch.bfloat16)[first:, :p3]
        key = kp.kernel.dispatch(
            x=x, weight=w, bias=None, conv_state=state, conv_state_indices=warmreg.meta((256, 4), torch.int32)[:, 0],
            num_accepted_tokens=warmreg.meta((256,), torch.int32), query_start_loc=warmreg.meta((257,), torch.int32),
            max_query_len=4, activation="silu", null_block_id=0, launch_pdl=True,
        )  # fmt: skip
        assert key in kp.keys


def test_warmup_inputs_reproduce_every_key() -> None:
    kp = warmreg.plan(_example(), target="cuda:90").kernel(NAME)
    extra = [attrs.evolve(k, x_aligned=False, bias_dtype="float32", null_block_id=None) for k in kp.keys]
    assert_warmup_inputs_reproduce(kp.kernel, [*kp.keys, *extra])


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        x, state, w = _inputs(4, 3)
        return OpCall(KERNEL, (x, state, w), {"conv_state_indices": torch.tensor([4, 1, 2, 7], dtype=torch.int32), "launch_pdl": False})

    check_out(build)
