"""``kimi_k3.kda_recurrent`` against vLLM 0.33's ``fused_recurrent_kda``, on identical engine-shaped inputs, under the
interpreter.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere. vLLM's entry point
is called as ``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention._forward`` calls it for the speculative rows
of a step (q/k/v rearranged column slices of the conv update's ``[T, 3P]`` output, the gate projection's rows, beta
a column of the packed projection, the recurrent pool inside its KV pages, ``[N, 1 + spec]`` block-table indices with
accepted counts, ``out=core_attn_out[:, :T]``), and with ``[N]`` indices for one-token steps. Outputs of live rows and
every byte of the KV pages (every slot, the null slot 0 included, and the conv states beside the recurrent states)
must be bitwise equal; a null-slot sequence's rows are zeros on both sides where vLLM writes them (its first token)
and zeros on warmreg's alone for the others, which vLLM leaves as they were (the documented difference).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, engine, seeded  # isort: skip

import pytest
import torch

FUSED_RECURRENT = "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent"
vllm_fr = engine(FUSED_RECURRENT)

from warmreg_kimi_k3.kda import KDARecurrent  # noqa: E402

H, D = 2, 128  # Kimi-K3's KDA head dim (linear_attn_config.head_dim), two heads on this rank
P = H * D  # local_projection_size
ROW = 4 * P + D + H + 14  # the packed projection's row: q | k | v | g | f_a | beta, padded to 16
CONV_ROWS = 3 + 3  # conv_width - 1 + num_speculative_tokens: the conv state's rows in each KV page
PAGES = 24
SENTINEL = 7.0  # what `out` holds before a launch: rows nobody writes keep it


def _kv_pages(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA layer's KV pages as vLLM lays them out: each page the bf16 conv state ``[CONV_ROWS, 3P]`` then the fp32
    recurrent state ``[H, V, K]``; returns the raw page bytes and the recurrent pool ``[PAGES, H, V, K]`` viewed in
    them (slot stride: the page)."""
    conv_bytes, state_bytes = CONV_ROWS * 3 * P * 2, H * D * D * 4
    raw = torch.empty(PAGES * (conv_bytes + state_bytes), dtype=torch.uint8)
    pages = raw.view(PAGES, conv_bytes + state_bytes)
    pages[:, :conv_bytes].view(torch.bfloat16).copy_(torch.randn(PAGES, conv_bytes // 2, generator=g))
    pages[:, conv_bytes:].view(torch.float32).copy_(0.1 * torch.randn(PAGES, state_bytes // 4, generator=g))
    page = (conv_bytes + state_bytes) // 4
    pool = raw.view(torch.float32).as_strided((PAGES, H, D, D), (page, D * D, D, 1), conv_bytes // 4)
    return raw, pool


def _inputs(
    lens: list[int], *, dt_bias: bool, lower_bound: float | None, seed: int, row: int | None = None
) -> dict[str, Any]:
    """A step's arguments as the layer passes them, plus ``pages`` (the KV pages the pool lives in) and ``conv`` (the
    conv update's output q/k/v are views of). Each call with a seed builds equal tensors in equal layouts: one
    call per side of a comparison (``clones`` would make the views contiguous)."""
    g = seeded(seed)
    t = sum(lens)
    proj = torch.randn(t, ROW, generator=g).bfloat16()
    conv = torch.randn(t, row or 3 * P, generator=g).bfloat16()  # the conv update's empty_like output
    q, k, v = (conv[:, i * P : (i + 1) * P].view(1, t, H, D) for i in range(3))
    pages, pool = _kv_pages(g)
    return {
        "q": q, "k": k, "v": v,
        "raw_g": torch.randn(1, t + 1, H, D, generator=g).bfloat16()[:, 1:],  # the gate projection's rows
        "raw_beta": proj[:, 4 * P + D : 4 * P + D + H].unsqueeze(0),  # a column block: token stride ROW
        "A_log": torch.rand(H, generator=g).mul(1.5).add(0.5).log(),
        "dt_bias": torch.randn(H * D, generator=g) * 0.5 if dt_bias else None,
        "lower_bound": lower_bound, "initial_state": pool, "pages": pages, "conv": conv,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
    }  # fmt: skip


def _compare(
    make: Callable[[], dict[str, Any]], indices: torch.Tensor, accepted: torch.Tensor | None, out: bool
) -> None:
    """vLLM's entry point and warmreg's op, each on its own ``make()`` (equal inputs, own KV pages); live rows and
    all page bytes bitwise."""
    theirs, ours = make(), make()
    pages_theirs, pages_ours = theirs.pop("pages"), ours.pop("pages")
    del theirs["conv"], ours["conv"]
    t = theirs["q"].shape[1]
    bufs = [torch.full((1, t + 3, H, D), SENTINEL, dtype=torch.bfloat16) for _ in range(2)]  # core_attn_out
    kw = {"ssm_state_indices": indices, "num_accepted_tokens": accepted}
    want, _ = vllm_fr.fused_recurrent_kda(**theirs, **kw, out=bufs[0][:, :t] if out else None)
    got = KDARecurrent(num_heads=H, head_k_dim=D, head_v_dim=D)(
        **ours, **kw, out=bufs[1][:, :t] if out else None, launch_pdl=False)  # fmt: skip
    rows = (indices if indices.ndim == 2 else indices[:, None]).tolist()
    firsts = [r[a - 1] for r, a in zip(rows, [1] * len(rows) if accepted is None else accepted.tolist())]
    bounds = theirs["cu_seqlens"].tolist()
    live = torch.zeros(t, dtype=torch.bool)
    for n, first in enumerate(firsts):
        bos, eos = bounds[n], bounds[n + 1]
        live[bos:eos] = first > 0
        if first <= 0 and eos > bos:
            assert not got[0, bos:eos].any(), "warmreg writes zeros for every token of a null-slot sequence"
            assert_same(got[:, bos], want[:, bos], "o of a null-slot sequence's first token (both zero it)")
            if out:  # vLLM leaves the sequence's later rows as they were: the documented difference
                assert (want[:, bos + 1 : eos] == SENTINEL).all()
    assert live.any(), "a comparison without a live row could not fail"
    assert_same(got[:, live], want[:, live], "o (live rows)")
    assert_same(pages_ours, pages_theirs, "KV pages (every slot, slot 0 and the conv states included)")
    if out:
        assert_same(bufs[1][:, t:], bufs[0][:, t:], "core_attn_out past the step's rows (untouched)")


@pytest.mark.parametrize(
    ("lower_bound", "dt_bias", "out"),
    [(None, True, True), (-5.0, True, False), (-5.0, False, True), (None, False, False)],
)
def test_speculative_step_equals_vllm(lower_bound: float | None, dt_bias: bool, out: bool) -> None:
    """Five speculative sequences of 4, 2, 1, 3 and 4 tokens (3 draft tokens: ``[N, 4]`` indices, a view of a block
    table 7 wide), accepted counts 2, 1, 1, 4, 3 (the initial state at column a - 1), a null first slot (sequence 1:
    zeros, nothing read or written although its other columns are live), zero write columns (no write), slot 0 in
    a written column; softplus and bounded gates, with and without dt_bias, ``out`` a view of core_attn_out or not."""
    table = torch.tensor([[1, 2, 3, 4, 9, 9, 9], [0, 5, 6, 7, 9, 9, 9], [8, 10, 0, 0, 9, 9, 9],
                          [11, 0, 12, 13, 9, 9, 9], [14, 15, 16, 0, 9, 9, 9]], dtype=torch.int32)  # fmt: skip

    def make() -> dict[str, Any]:
        return _inputs([4, 2, 1, 3, 4], dt_bias=dt_bias, lower_bound=lower_bound, seed=1)

    _compare(make, table[:, :4], torch.tensor([2, 1, 1, 4, 3], dtype=torch.int32), out)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(
    ("indices", "row"),
    [
        ([3], 4 * P),  # one sequence: the conv output keeps the projection-overlap path's 4P row
        ([4, 0, 2, 6, 0, -1, 17], 3 * P),  # null slot 0, CUDA-graph padding (0), a negative pad, [T, 3P] rows
    ],
)
def test_one_token_decode_with_1d_indices_equals_vllm(indices: list[int], row: int, lower_bound: float | None) -> None:
    """One token a sequence, ``[N]`` indices (``T == N``, no accepted counts): vLLM's NVIDIA layer does not launch
    this kernel for plain decode (it runs the packed decode), but ``fused_recurrent_kda`` takes it."""

    def make() -> dict[str, Any]:
        return _inputs([1] * len(indices), dt_bias=True, lower_bound=lower_bound, seed=2, row=row)

    _compare(make, torch.tensor(indices, dtype=torch.int32), None, out=True)


def test_adaptive_step_with_graph_padding_equals_vllm() -> None:
    """The staged CUDA-graph batch: two real speculative sequences (3 and 1 tokens) then padding requests with no
    tokens, the NULL slot (0) and one accepted token, as ``stage_spec_decode_metadata`` leaves them."""
    indices = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)

    def make() -> dict[str, Any]:
        return _inputs([3, 1, 0, 0], dt_bias=True, lower_bound=-5.0, seed=3)

    _compare(make, indices, torch.tensor([3, 1, 1, 1], dtype=torch.int32), out=True)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_plain_decode_equals_vllm_packed_decode(lower_bound: float | None) -> None:
    """A plain-decode batch through warmreg's op (``[N]`` indices) and vLLM's ``fused_recurrent_kda_packed_decode``
    (what its layer runs for it), on the same packed rows: the same recurrence, so the same bytes under the
    interpreter, whose per-row sums do not depend on the tile (BV 4, one warp here; BV 32, four warps there). On a
    GPU the two reduce in different trees: there they agree to fp32 rounding, not bitwise."""
    indices = torch.tensor([4, 0, 2, 6, 0], dtype=torch.int32)
    theirs, ours = (_inputs([1] * 5, dt_bias=True, lower_bound=lower_bound, seed=4) for _ in range(2))
    pages_theirs, pages_ours = theirs.pop("pages"), ours.pop("pages")
    want, _ = vllm_fr.fused_recurrent_kda_packed_decode(
        mixed_qkv=theirs["conv"], raw_g=theirs["raw_g"], raw_beta=theirs["raw_beta"], A_log=theirs["A_log"],
        dt_bias=theirs["dt_bias"], lower_bound=lower_bound, initial_state=theirs["initial_state"], state_indices=indices,
    )  # fmt: skip
    del ours["conv"]
    got = KDARecurrent(num_heads=H, head_k_dim=D, head_v_dim=D)(**ours, ssm_state_indices=indices, launch_pdl=False)
    assert_same(got, want, "o")
    assert_same(pages_ours, pages_theirs, "KV pages")
