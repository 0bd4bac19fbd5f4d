"""Save partial states (compressor state cache): exact against its reference, and warm coverage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_deepseek_v4 import DSV4
from warmreg_deepseek_v4.state_cache import SavePartialStates, register, save_partial_states_reference

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FLASH, PRO = EXAMPLES / "deepseek_v4_flash.json", EXAMPLES / "deepseek_v4_pro.json"
NAME = SavePartialStates.name


def _Plugin() -> RegisterPlugin:
    return RegisterPlugin(register, model=DSV4.from_config)


def _inputs(
    tokens: int, head: int, ratio: int, page_bs: int, *, offset: int = 0, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    kv_score = torch.randn(tokens * 2 * head + offset, generator=gen)[offset:].view(tokens, 2 * head)
    ape = torch.randn(ratio, head, generator=gen)
    positions = torch.randint(0, 1000, (tokens,), generator=gen)
    state = torch.full((3, page_bs, 2 * head), -5.0)
    return kv_score[:, :head], kv_score[:, head:], ape, positions, state


@pytest.mark.parametrize(
    ("tokens", "head", "ratio", "page_bs", "offset", "slots"),
    [
        (5, 64, 4, 4, 0, [0, 5, -1, 11, 2]),  # regular (a C4 stand-in)
        (4, 40, 128, 8, 3, [23, -1, 9]),  # non-pow2 head, cr 128, misaligned kv/score views, S < T (DP padding)
        (1, 48, 4, 4, 0, [7]),  # T = 1
    ],
)
def test_matches_reference(tokens: int, head: int, ratio: int, page_bs: int, offset: int, slots: list[int]) -> None:
    """Copies and one fp32 add: the kernel must be bit-exact, and untouched rows stay untouched."""
    kv, score, ape, positions, state = _inputs(tokens, head, ratio, page_bs, offset=offset)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    ref = state.clone()
    kernel = SavePartialStates(head_size=head, compress_ratio=ratio, state_block_size=page_bs)
    assert kernel(kv, score, ape, positions, slot_mapping, state) is state
    save_partial_states_reference(kv, score, ape, positions, slot_mapping, ref)
    torch.testing.assert_close(state, ref, atol=0, rtol=0)
    assert state.eq(-5.0).sum() == state.numel() - 2 * head * sum(s >= 0 for s in slots)


def test_empty_batch_launches_nothing() -> None:
    kv, score, ape, positions, state = _inputs(0, 64, 4, 4)
    kernel = SavePartialStates(head_size=64, compress_ratio=4, state_block_size=4)
    kernel(kv, score, ape, positions, torch.empty(0, dtype=torch.int64), state)
    assert state.eq(-5.0).all()


def test_bad_inputs_are_named() -> None:
    kv, score, ape, positions, state = _inputs(2, 64, 4, 4)
    kernel = SavePartialStates(head_size=64, compress_ratio=4, state_block_size=4)
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(warmreg.LaunchError, match="fp32"):
        kernel(kv.half(), score, ape, positions, slots, state)
    with pytest.raises(warmreg.LaunchError, match="state_cache"):
        kernel(kv, score, ape, positions, slots, state[..., :64])
    with pytest.raises(warmreg.LaunchError, match="slot_mapping"):
        kernel(kv, score, ape, positions, torch.zeros(3, dtype=torch.int64), state)


@pytest.mark.parametrize("example", [FLASH, PRO])
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_runtime_saves_hit_warmed_keys(example: Path, target: str) -> None:
    """Main C4 (1024), indexer C4 (256), main C128 (512): kv/score are views of the fp32 kv_score GEMM output,
    for any token count and any slot-mapping length S <= T; PDL is off on every platform."""
    plan = warmreg.plan(example, target=target, plugins=[_Plugin()], entry_points=False)
    kp = plan.kernel(NAME)
    model = DSV4.from_config(plan.config)
    compressors = [(2 * model.head_dim, 4, 4), (2 * model.index_head_dim, 4, 4), (model.head_dim, 128, 8)]
    assert {(k.head_size, k.compress_ratio, k.state_block_size) for k in kp.keys} == set(compressors)
    assert not any(k.launch_pdl for k in kp.keys) and all(not k.launch_options().get("launch_pdl") for k in kp.keys)
    for head, ratio, page_bs in compressors:
        for tokens in (1, 3, 16, 100, 8192):
            kv_score = warmreg.meta((tokens, 2 * head), torch.float32)
            key = kp.kernel.dispatch(
                kv=kv_score[:, :head], score=kv_score[:, head:], ape=warmreg.meta((ratio, head), torch.float32),
                state_cache=warmreg.meta((5000, page_bs, 2 * head), torch.float32),
            )  # fmt: skip
            assert key in kp.keys, key


def test_warmup_inputs_reproduce_keys_of_offset_views() -> None:
    kernel = SavePartialStates(head_size=36, compress_ratio=128, state_block_size=8)
    kv, score, ape, _, state = _inputs(3, 36, 128, 8, offset=3)  # row stride 72: class 'other'; 12-byte offset
    key = kernel.dispatch(kv=kv, score=score, ape=ape, state_cache=state)
    assert not key.kv_aligned and key.kv_stride == "other"
    assert_warmup_inputs_reproduce(kernel, [key])


def test_warm_cross_compiles_for_cuda_and_gfx942() -> None:
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(
            FLASH, target=target, plugins=[_Plugin()], entry_points=False, workers=2, on_error="continue"
        )
        assert report.ok, [(r.key, r.error) for r in report.failed]
        assert report.compiled == 3
