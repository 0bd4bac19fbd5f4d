"""ROCm's KDA recurrent step: the PyTorch reference under Triton's interpreter (speculative steps, one sequence,
uniform lengths, plain decodes, null slots), vLLM's ROCm launch table, errors and the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_kimi_k3.kda import kda_recurrent_reference
from warmreg_kimi_k3.rocm_kda_recurrent import ROCmKDARecurrent, rocm_launch

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = ROCmKDARecurrent.name
H, D = 2, 16
# bf16 o from fp32 sums in another order (and rsqrt where the reference divides by sqrt): one bf16 step; the fp32
# pool within a few fp32 ulps (test_kda.py's tolerances)
O_TOL: dict[str, Any] = {"atol": 1e-2, "rtol": 1.6e-2}
STATE_TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}


def _kernel(spec: int = 3) -> ROCmKDARecurrent:
    return ROCmKDARecurrent(num_heads=H, head_k_dim=D, head_v_dim=D, lower_bound=-5.0, max_num_seqs=8,
                            num_speculative_tokens=spec)  # fmt: skip


def _step(lens: list[int], seed: int = 0, lower_bound: float | None = -5.0) -> dict[str, Any]:
    """q, k, v column slices of one ``[T, 3P]`` conv output, the raw gate rows, beta a projection column."""
    g = torch.Generator().manual_seed(seed)
    t, width = sum(lens), 3 * H * D
    conv = torch.randn(t, width, generator=g).bfloat16()
    q, k, v = (conv[:, c : c + H * D].view(1, t, H, D) for c in (0, H * D, 2 * H * D))
    proj = (2 * torch.randn(t, width + H + 3, generator=g)).bfloat16()
    return {
        "q": q, "k": k, "v": v, "raw_g": (torch.randn(1, t, H, D, generator=g) - 1.0).bfloat16(),
        "raw_beta": proj[:, width + 3 :].unsqueeze(0), "A_log": torch.log(0.5 + 1.5 * torch.rand(H, generator=g)),
        "dt_bias": 0.5 * torch.randn(H * D, generator=g), "lower_bound": lower_bound,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
    }  # fmt: skip


def _pool(slots: int = 24) -> torch.Tensor:
    return 0.1 * torch.randn(slots, H, D, D, generator=torch.Generator().manual_seed(1))


def _check(step: dict[str, Any], indices: torch.Tensor, accepted: torch.Tensor | None, uniform: int | None) -> None:
    pool = _pool()
    want_o, want_pool = kda_recurrent_reference(**step, initial_state=pool, ssm_state_indices=indices,
                                                num_accepted_tokens=accepted)  # fmt: skip
    got = _kernel()(**step, initial_state=pool, ssm_state_indices=indices, num_accepted_tokens=accepted,
                    uniform_sequence_length=uniform)  # fmt: skip
    torch.testing.assert_close(got, want_o, **O_TOL)
    torch.testing.assert_close(pool, want_pool, **STATE_TOL)


@pytest.mark.parametrize(
    ("lens", "uniform"),
    [([3], 3), ([4], None), ([4, 4, 4], 4), ([2, 4, 1, 3], None), ([1] * 5, None), ([2] * 13, 2)],
)  # one sequence (static T), uniform lengths (static L), varlen, one-token rows, 26 head-sequences
def test_spec_steps_match_reference(lens: list[int], uniform: int | None) -> None:
    n, cols = len(lens), 4
    indices = (torch.arange(n * cols, dtype=torch.int32).view(n, cols) + 1) % 24
    indices[0, 0] = 0 if n > 2 else indices[0, 0]  # a null column: no state written there
    accepted = torch.tensor([1 + i % cols for i in range(n)], dtype=torch.int32)
    _check(_step(lens, seed=n), indices, accepted, uniform)


def test_plain_decodes_and_null_slots() -> None:
    """A mixed batch's plain decodes: 1-D indices, one token a sequence; a padded row on slot 0 gets zeros."""
    indices = torch.tensor([3, 0, 7, 1, 5], dtype=torch.int32)
    step = _step([1] * 5, seed=7, lower_bound=None)
    _check(step, indices, None, None)
    got = _kernel()(**step, initial_state=_pool(), ssm_state_indices=indices)
    assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))


def test_launch_table_is_vllms() -> None:
    """vLLM ROCm's ``_get_static_sequence_length`` and ``_select_kda_launch_config`` at 12 heads a rank."""
    assert rocm_launch(heads=12, num_seqs=1, tokens=4, spec=True, uniform=None) == (4, 4, 1, 6)
    assert rocm_launch(heads=12, num_seqs=2, tokens=8, spec=True, uniform=4) == (4, 4, 1, 6)
    assert rocm_launch(heads=12, num_seqs=2, tokens=6, spec=True, uniform=3) == (3, 4, 1, 8)
    assert rocm_launch(heads=12, num_seqs=4, tokens=12, spec=True, uniform=3) == (3, 8, 1, 4)
    assert rocm_launch(heads=12, num_seqs=17, tokens=68, spec=True, uniform=4) == (0, 8, 1, 2)  # 204 > 192
    assert rocm_launch(heads=12, num_seqs=4, tokens=9, spec=True, uniform=None) == (0, 8, 1, 4)
    assert rocm_launch(heads=12, num_seqs=2, tokens=2, spec=True, uniform=1) == (0, 4, 1, 2)
    assert rocm_launch(heads=12, num_seqs=8, tokens=8, spec=True, uniform=None) == (0, 32, 4, 2)
    assert rocm_launch(heads=12, num_seqs=3, tokens=3, spec=False, uniform=None) == (0, 32, 4, 2)


def test_launch_errors() -> None:
    step, indices = _step([2, 2]), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(warmreg.LaunchError, match="uniform_sequence_length"):
        _kernel()(**step, initial_state=_pool(), ssm_state_indices=indices, num_accepted_tokens=accepted,
                  uniform_sequence_length=3)  # fmt: skip
    with pytest.raises(warmreg.LaunchError, match="uniform_sequence_length"):
        _kernel()(**step, initial_state=_pool(), ssm_state_indices=indices, uniform_sequence_length=2)
    with pytest.raises(warmreg.LaunchError, match="1-D ssm_state_indices"):
        _kernel()(**step, initial_state=_pool(), ssm_state_indices=indices[:, 0])


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter"])
def test_plan_keys(target: str) -> None:
    """The plain decodes' key and, speculating 3 tokens, vLLM's launch classes of 12 heads a rank."""
    keys = warmreg.plan(EXAMPLES / "kimi_k3.json", target=target).kernel(NAME).keys
    classes = {(k.is_spec_decoding, k.single_sequence, k.sequence_length, k.block_v, k.num_warps, k.num_stages)
               for k in keys}  # type: ignore[attr-defined]  # fmt: skip
    assert len(keys) == len(classes) == 16
    assert (False, False, 0, 32, 4, 2) in classes and (True, True, 4, 4, 1, 6) in classes
    plain = warmreg.plan(example_config("kimi_k3", num_speculative_tokens=0), target=target).kernel(NAME).keys
    assert [k.is_spec_decoding for k in plain] == [False]  # type: ignore[attr-defined]
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "kimi_k3.json", target="cuda:90").kernels}


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 16, 17, 100, 256])
def test_runtime_steps_are_planned(num_seqs: int) -> None:
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942").kernel(NAME)
    kernel: Any = kp.kernel
    for tokens, uniform in ((num_seqs, None), (4 * num_seqs, 4), (3 * num_seqs, None), (2 * num_seqs, 2)):
        for spec in (True, False):
            if not spec and tokens != num_seqs:
                continue
            key = kernel.dispatch(
                q=warmreg.meta((1, tokens, 12, 128), torch.bfloat16), raw_g=warmreg.meta((1, tokens, 12, 128), torch.bfloat16),
                raw_beta=warmreg.meta((1, tokens, 12), torch.bfloat16), dt_bias=warmreg.meta((1536,), torch.float32),
                lower_bound=-5.0, initial_state=warmreg.meta((300, 12, 128, 128), torch.float32),
                cu_seqlens=warmreg.meta((num_seqs + 1,), torch.int32),
                num_accepted_tokens=warmreg.meta((num_seqs,), torch.int32) if spec else None,
                uniform_sequence_length=uniform if spec else None,
            )  # fmt: skip
            assert key in kp.keys, key
    assert_warmup_inputs_reproduce(kp.kernel, sorted(kp.keys))


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        indices = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
        kw = {"initial_state": _pool(), "ssm_state_indices": indices,
              "num_accepted_tokens": torch.tensor([2, 1], dtype=torch.int32), "uniform_sequence_length": 3}  # fmt: skip
        return OpCall(_kernel(), (), {**_step([3, 3], seed=4), **kw})

    check_out(build)
