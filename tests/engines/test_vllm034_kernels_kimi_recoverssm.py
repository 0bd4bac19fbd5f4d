"""Kimi-K3's RecoverSSM ops against vLLM 0.34's own kernels (issue 37): the verify, and the commit's plan, conv-state
compaction and SSM fold, on identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_recoverssm.py``); skips, naming why, elsewhere. The verify is called as
``KimiK3DeltaAttention._recoverssm_verify`` calls ``kda_recoverssm_verify`` (head views of the conv output, the gate
projection, a column of the packed projection for beta, the layer's SSM pool and records), the commit as
``KimiK3KDAMetadata.commit_recoverssm_state`` calls ``KDARecoverSSMCommitContext.commit`` (a context built by its own
``create`` from stand-in layers holding what it reads: ``kv_cache``, ``recoverssm_records``, ``A_log``, ``dt_bias``,
``local_num_heads``, ``head_dim``, ``gate_lower_bound``), with and without request indices and align mode. warmreg's
ops run on clones of the same seeded tensors; every output, record, plan buffer, conv state and checkpoint is
compared bitwise: both sides run the same fp32 operations in the same order, so no tolerance is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch

vllm_rssm = engine("vllm.models.kimi_k3.nvidia.ops.recoverssm")
from warmreg_kimi_k3.backends import KDALayout  # noqa: E402
from warmreg_kimi_k3.recoverssm import LayerTable  # noqa: E402
from warmreg_kimi_k3.recoverssm_commit import RecoverSSMCommitState, RecoverSSMCompactConv  # noqa: E402
from warmreg_kimi_k3.recoverssm_plan import RecoverSSMCommitPlan  # noqa: E402
from warmreg_kimi_k3.recoverssm_verify import RecoverSSMVerify  # noqa: E402


def _layout(heads: int, d: int, spec: int, bound: float | None, dtype: str = "bfloat16") -> KDALayout:
    return KDALayout(num_heads=heads, head_dim=d, conv_width=4, lower_bound=bound, tensor_parallel_size=1,
                     num_speculative_tokens=spec, dtype=dtype)  # fmt: skip


# -- the verify ---------------------------------------------------------------------------------------------------
def _verify_inputs(lens: list[int], heads: int, d: int, spec: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """One speculative step's layer inputs: the conv output ``[T, 3P]`` (q, k, v its head views), the gate
    projection ``[T, P]``, beta a column slice of a packed projection row, an fp32 SSM pool with padded pages, and
    records of 8 rows filled with garbage; request 1 on the null block."""
    g, p, n = seeded(seed), heads * d, len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens, s = int(qsl[-1]), 1 + spec
    conv_out = torch.randn(tokens, 3 * p, generator=g).to(dtype)
    packed = torch.randn(tokens, 5 * p + 16, generator=g).to(dtype)
    pages = torch.randn(n + 3, heads * d * d + 40, generator=g)
    slots = torch.zeros(8, 1, dtype=torch.int32)
    slots[:n, 0] = torch.randperm(n + 2, generator=g)[:n] + 1
    if n > 1:
        slots[1, 0] = 0
    return {
        "mixed": conv_out, "g1": torch.randn(tokens, p, generator=g).mul_(2).to(dtype),
        "beta": packed[:, 4 * p + 8 : 4 * p + 8 + heads], "A_log": torch.randn(heads, generator=g).mul_(0.5),
        "dt_bias": torch.randn(p, generator=g), "state": pages[:, : heads * d * d].view(n + 3, heads, d, d),
        "correction": torch.full((8, heads, s, d), float("nan")), "key_gate": torch.full((8, heads, s, 2 * d), 7.0).to(dtype),
        "qsl": qsl, "slots": slots, "out": torch.full((1, tokens + 2, heads, d), 5.0).to(dtype),
    }  # fmt: skip


def _views(t: dict[str, Any], heads: int, d: int) -> tuple[torch.Tensor, ...]:
    p = heads * d
    q, k, v = (x.view(x.shape[0], heads, d).unsqueeze(0) for x in t["mixed"].split(p, dim=-1))
    return q, k, v, t["g1"].view(1, -1, heads, d), t["beta"].unsqueeze(0)


@pytest.mark.parametrize(
    ("lens", "heads", "d", "spec", "bound", "dtype"),
    [
        ([4, 4, 2, 3], 2, 128, 3, -5.0, torch.bfloat16),  # Kimi-K3's head dim, a gate bound; a short request
        ([3, 1, 0, 3], 3, 32, 2, None, torch.float32),  # the softplus gate; an empty row
        ([2], 1, 48, 1, -2.0, torch.float16),  # K not a power of two (masked tiles)
    ],
)
def test_verify_equals_vllm(
    lens: list[int], heads: int, d: int, spec: int, bound: float | None, dtype: torch.dtype
) -> None:
    """``kda_recoverssm_verify(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, checkpoint_state, records,
    query_start_loc, state_indices, spec_query_len, out)`` with ``out`` the step's rows of ``core_attn_out``: the
    output, both records and the (unchanged) checkpoint pool bitwise."""
    t = _verify_inputs(lens, heads, d, spec, dtype, seed=sum(lens) + d)
    theirs, ours = clones(**t), clones(**t)
    n, tokens = len(lens), sum(lens)
    for side in (theirs, ours):
        side["rows"] = side["out"][:, 1 : 1 + tokens]
    q, k, v, g1, beta = _views(theirs, heads, d)
    records = vllm_rssm.KDARecoverSSMRecords(theirs["correction"], theirs["key_gate"])
    vllm_rssm.kda_recoverssm_verify(
        q=q, k=k, v=v, raw_g=g1, raw_beta=beta, A_log=theirs["A_log"], dt_bias=theirs["dt_bias"], lower_bound=bound,
        checkpoint_state=theirs["state"], records=records, query_start_loc=theirs["qsl"],
        state_indices=theirs["slots"][:n, 0], spec_query_len=1 + spec, out=theirs["rows"],
    )  # fmt: skip
    q, k, v, g1, beta = _views(ours, heads, d)
    RecoverSSMVerify(layout=_layout(heads, d, spec, bound), max_num_seqs=8)(
        q, k, v, g1, beta, ours["A_log"], ours["dt_bias"], ours["state"], ours["correction"], ours["key_gate"],
        ours["qsl"], ours["slots"][:n, 0], lower_bound=bound, spec_query_len=1 + spec, out=ours["rows"],
    )  # fmt: skip
    for name in ("out", "correction", "key_gate", "state"):
        assert_same(ours[name], theirs[name], name)


# -- the commit ---------------------------------------------------------------------------------------------------
def _commit_inputs(layers: int, heads: int, d: int, spec: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Each layer's conv state (vLLM's default ``[pages, L_state, D]``, page-padded) and SSM pool, verify records
    of 6 rows, gate parameters; 4 speculative requests of a 6-row batch (slots 1..4, one on the null block), the
    sampler's counts (0 and past the window included), a block table and computed counts for align mode."""
    g, p, s, pages = seeded(seed), heads * d, 1 + spec, 24
    state_len = 3 + spec
    out: dict[str, Any] = {}
    for i in range(layers):
        out[f"conv{i}"] = torch.randn(pages, state_len + 1, 3 * p, generator=g).to(dtype)[:, :state_len]
        out[f"ssm{i}"] = torch.randn(pages, heads, d, d, generator=g)
        out[f"corr{i}"] = torch.randn(6, heads, s, d, generator=g)
        out[f"kg{i}"] = torch.randn(6, heads, s, 2 * d, generator=g).to(dtype)
        out[f"A{i}"] = torch.randn(heads, generator=g).mul_(0.5)
        out[f"dt{i}"] = torch.randn(p, generator=g)
    out["slots"] = torch.tensor([[3], [0], [5], [7], [2], [9]], dtype=torch.int32)
    out["qsl"] = torch.tensor([0, s, 2 * s, 2 * s + 2, 3 * s + 2], dtype=torch.int32)
    out["accepted"] = torch.tensor([2, 3, 0, s + 4, 1, s], dtype=torch.int32)
    out["requests"] = torch.tensor([5, 0, 2, 4], dtype=torch.int32)
    out["table"] = (torch.arange(6 * 4, dtype=torch.int32).view(6, 4) % 20) + 4
    out["computed"] = torch.tensor([14, 7, 15, 1, 31, 16], dtype=torch.int32)
    return out


def _layers(t: dict[str, Any], layers: int, heads: int, d: int, bound: float | None) -> list[Any]:
    return [
        SimpleNamespace(kv_cache=(t[f"conv{i}"], t[f"ssm{i}"]), A_log=t[f"A{i}"], dt_bias=t[f"dt{i}"],
                        recoverssm_records=vllm_rssm.KDARecoverSSMRecords(t[f"corr{i}"], t[f"kg{i}"]),
                        local_num_heads=heads, head_dim=d, gate_lower_bound=bound)
        for i in range(layers)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("layers", "heads", "d", "spec", "bound", "mixed", "align"),
    [
        (2, 2, 128, 3, -5.0, False, False),  # every row speculative
        (3, 1, 64, 2, None, True, False),  # a mixed step: request indices; the softplus gate
        (2, 2, 32, 3, -1.0, True, True),  # align mode: final and boundary slots from the block table
    ],
)
def test_commit_equals_vllm(layers: int, heads: int, d: int, spec: int, bound: float | None, mixed: bool,
                            align: bool) -> None:  # fmt: skip
    """``KDARecoverSSMCommitContext.create(layers, spec_query_len, max_num_reqs, backend="triton").commit(
    num_accepted_tokens, state_indices, query_start_loc, request_indices, block_table, num_computed_tokens,
    mamba_block_size)``: the plan buffers and every layer's conv state and checkpoint pool bitwise."""
    t = _commit_inputs(layers, heads, d, spec, torch.bfloat16, seed=layers + d)
    theirs, ours = clones(**t), clones(**t)
    batch, s = 4, 1 + spec
    rows = slice(None) if mixed else slice(0, batch)

    def call_args(side: dict[str, Any]) -> dict[str, Any]:
        args = {"request_indices": side["requests"] if mixed else None}
        if align:
            args.update(block_table=side["table"], num_computed_tokens=side["computed"], mamba_block_size=8)
        return args

    context = vllm_rssm.KDARecoverSSMCommitContext.create(
        _layers(theirs, layers, heads, d, bound), spec_query_len=s, max_num_reqs=6, backend="triton"
    )
    context.commit(theirs["accepted"][rows], theirs["slots"][:batch, 0], theirs["qsl"], **call_args(theirs))

    plan = RecoverSSMCommitPlan(max_num_seqs=6, spec_query_len=s)(
        ours["accepted"][rows], ours["slots"][:batch, 0], ours["qsl"], spec_query_len=s, **call_args(ours)
    )
    lay = _layout(heads, d, spec, bound)
    conv = LayerTable.of([ours[f"conv{i}"].transpose(-1, -2) for i in range(layers)])
    RecoverSSMCompactConv(layout=lay, max_num_seqs=6)(
        conv, ours["slots"][:batch, 0], plan, conv_history_len=3, align=align
    )
    RecoverSSMCommitState(layout=lay, max_num_seqs=6)(
        LayerTable.of([ours[f"ssm{i}"] for i in range(layers)]),
        LayerTable.of([ours[f"corr{i}"] for i in range(layers)]),
        LayerTable.of([ours[f"kg{i}"] for i in range(layers)]),
        torch.stack([ours[f"A{i}"] for i in range(layers)]),
        torch.stack([ours[f"dt{i}"].view(heads, d) for i in range(layers)]),
        ours["slots"][:batch, 0], plan, lower_bound=bound, align=align,
    )  # fmt: skip
    want = (context.commit_lens, context.final_state_indices, context.boundary_state_indices,
            context.boundary_recovery_lens)  # fmt: skip
    for name, mine, engine_buf in zip(("commit_lens", "final", "boundary", "recovery"), plan, want):
        assert_same(mine, engine_buf[:batch], name)
    assert int(plan[0].gt(0).sum()) >= 2, "the step must commit tokens somewhere"
    assert not align or bool(plan[2].gt(0).any()), "align mode must cross a block boundary somewhere"
    for i in range(layers):
        assert_same(ours[f"conv{i}"], theirs[f"conv{i}"], f"conv state of layer {i}")
        assert_same(ours[f"ssm{i}"], theirs[f"ssm{i}"], f"SSM checkpoints of layer {i}")
