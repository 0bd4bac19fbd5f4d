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

The last section checks the keys RecoverSSM changes elsewhere in the plan against vLLM's own choice of shapes and
strides: vLLM's ``KimiK3KDAMetadataBuilder`` (its real ``__init__`` and ``build``) builds a step's metadata from a
block table as wide as vLLM sizes it (``MambaBase.get_kv_cache_spec``, ``MambaSpec.max_num_blocks_per_req``,
``get_block_table_width``), with RecoverSSM on and off; the conv update is then called as the layer calls it
(``_recoverssm_verify`` or ``_forward``'s speculative path) and the staging as the builder calls it, each by vLLM and
by warmreg, bitwise, and warmreg's key of each call must be one the plan of ``examples/kimi_k3.json`` warms.
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
vllm_meta = engine("vllm.models.kimi_k3.nvidia.kda_metadata")
vllm_conv_cpu = engine("vllm.model_executor.layers.mamba.ops.causal_conv1d")
import importlib.util  # noqa: E402
from unittest import mock  # noqa: E402

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import get_block_table_width  # noqa: E402
from warmreg_kimi_k3.backends import KDALayout, kda_layout  # noqa: E402
from warmreg_kimi_k3.causal_conv1d import projection_row_stride  # noqa: E402
from warmreg_kimi_k3.causal_conv1d_update import CausalConv1dUpdate  # noqa: E402
from warmreg_kimi_k3.kda_spec_metadata import StageSpecDecodeMetadata  # noqa: E402
from warmreg_kimi_k3.model import KimiK3  # noqa: E402
from warmreg_kimi_k3.recoverssm import LayerTable  # noqa: E402
from warmreg_kimi_k3.recoverssm_commit import RecoverSSMCommitState, RecoverSSMCompactConv  # noqa: E402
from warmreg_kimi_k3.recoverssm_plan import RecoverSSMCommitPlan  # noqa: E402
from warmreg_kimi_k3.recoverssm_verify import RecoverSSMVerify  # noqa: E402

import warmreg  # noqa: E402
from warmreg.testing import config_loader  # noqa: E402


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


# -- the metadata builder's state slots: the conv update's and the staging's keys, RecoverSSM on and off -----------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPEC, HEADS, D, MAX_SEQS, LINES = 3, 12, 128, 8, 14  # examples/kimi_k3.json on one TP-8 rank
P = HEADS * D
CONV_ROWS, ROW = 3 + SPEC, 4 * P + D + HEADS + 4  # the conv state's W - 1 + spec rows; the packed projection row


def _triton_conv_module() -> Any:
    """vLLM's ``causal_conv1d.py`` as a GPU imports it: on its CPU platform the module rebinds
    ``causal_conv1d_update`` to a C++ CPU op at import (``if current_platform.is_cpu(): ...``), so it is executed
    again, under another name, with ``is_cpu`` answering False for that import only; its kernels are unchanged."""
    spec = importlib.util.spec_from_file_location("vllm_causal_conv1d_on_gpu", vllm_conv_cpu.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(vllm_conv_cpu.current_platform, "is_cpu", return_value=False):
        spec.loader.exec_module(module)
    return module


vllm_conv = _triton_conv_module()


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: ``stage_spec_decode_metadata`` asserts ``state_indices.is_cuda``
    before its Triton launch, which the interpreter runs on CPU tensors. It changes no kernel and no math."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _engine_config(recoverssm: bool, graphs: bool) -> SimpleNamespace:
    """The ``VllmConfig`` fields the builder, the Mamba spec and the commit context read: what
    ``validate_mamba_cached_kernel`` leaves for Kimi-K3 with 3 drafts (``use_kda_recoverssm = use_replayssm``)."""
    mode = CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    return SimpleNamespace(
        cache_config=SimpleNamespace(use_replayssm=recoverssm, use_kda_recoverssm=recoverssm, mamba_block_size=16,
                                     mamba_page_size_padded=None, mamba_cache_mode="none"),
        speculative_config=SimpleNamespace(num_speculative_tokens=SPEC, enable_adaptive_verification=False,
                                           max_num_new_slots_for_drafting=0, use_eagle_block_drop=lambda: False),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=None,
                                           static_forward_context={}),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS), parallel_config=SimpleNamespace(
            decode_context_parallel_size=1), model_config=SimpleNamespace(hf_text_config=SimpleNamespace()),
        num_speculative_tokens=SPEC, num_hash_lookahead_tokens=0, additional_config={},
    )  # fmt: skip


def _builder(config: SimpleNamespace, pages: torch.Tensor) -> tuple[Any, int]:
    """vLLM's builder for one KDA group, and the group's block-table width as the V2 runner sizes it
    (``v1/worker/gpu/model_runner.py``: ``get_block_table_width(spec.max_num_blocks_per_req(...), ...)``). The
    group's one layer is a stand-in holding what ``KDARecoverSSMCommitContext.create`` reads."""
    layer = SimpleNamespace(
        get_state_shape=lambda: ((CONV_ROWS, 3 * P), (HEADS, D, D)),
        get_state_dtype=lambda: (torch.bfloat16, torch.float32), state_alignment=1,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN, is_kv_cache_tp_replicated=False,
    )  # fmt: skip
    spec = MambaBase.get_kv_cache_spec(layer, config)
    width = get_block_table_width(spec.max_num_blocks_per_req(config, 4096), spec.block_size,
                                  token_alignment=spec.block_table_token_alignment)  # fmt: skip
    conv, ssm = _conv_state(pages).transpose(-1, -2), pages[:, CONV_ROWS * 3 * P :].view(torch.float32)
    s = 1 + SPEC
    config.compilation_config.static_forward_context["kda.0"] = SimpleNamespace(
        kv_cache=(conv, ssm[:, : HEADS * D * D].unflatten(1, (HEADS, D, D))), recoverssm_backend="triton",
        recoverssm_records=vllm_rssm.KDARecoverSSMRecords(torch.zeros(MAX_SEQS, HEADS, s, D),
                                                          torch.zeros(MAX_SEQS, HEADS, s, 2 * D).bfloat16()),
        A_log=torch.zeros(HEADS), dt_bias=torch.zeros(P), local_num_heads=HEADS, head_dim=D, gate_lower_bound=-5.0,
    )  # fmt: skip
    return vllm_meta.KimiK3KDAMetadataBuilder(spec, ["kda.0"], config, torch.device("cpu")), width


def _conv_state(pages: torch.Tensor) -> torch.Tensor:
    """The layer's conv state as the conv kernels take it, ``[lines, 3P, W - 1 + spec]``, at the start of each page."""
    return pages[:, : CONV_ROWS * 3 * P].unflatten(1, (CONV_ROWS, 3 * P)).transpose(-1, -2)


def _step(case: str, width: int, g: torch.Generator) -> tuple[CommonAttentionMetadata, dict[str, torch.Tensor]]:
    """Three requests as the V2 runner hands them to the builder: all verifying drafts (``"spec"``), or a prefill
    chunk first (``"mixed"``); each row of the block table a distinct page."""
    lens = [4, 2, 4] if case == "spec" else [5, 4, 3]
    prefill = [False] * 3 if case == "spec" else [True, False, False]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([40 + n for n in lens], dtype=torch.int32)
    table = (torch.randperm(LINES - 1, generator=g)[: 3 * width] + 1).int().view(3, width).as_subclass(_OnCuda)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=3,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor(prefill), seq_lens_cpu_upper_bound=seq_lens.clone(),
    )  # fmt: skip
    drafts = torch.tensor([-1 if p else n - 1 for p, n in zip(prefill, lens)], dtype=torch.int32)
    return common, {"num_accepted_tokens": torch.tensor([2, 1, 4], dtype=torch.int32), "drafts": drafts}


def _planned(recoverssm: bool) -> dict[str, set[Any]]:
    config = config_loader(EXAMPLES)("kimi_k3", use_replayssm=recoverssm)
    return {kp.name: set(kp.keys) for kp in warmreg.plan(config, target="cuda:90").kernels}


@pytest.mark.parametrize(("case", "graphs"), [("spec", True), ("spec", False), ("mixed", True)])
@pytest.mark.parametrize("recoverssm", [False, True])
def test_builder_state_slots_are_planned(recoverssm: bool, case: str, graphs: bool) -> None:
    """``KimiK3KDAMetadataBuilder.build`` for a step of speculative rows (staged into the graph buffers, or not) or a
    prefill beside them; then ``causal_conv1d_update`` on the speculative rows as ``_recoverssm_verify`` calls it
    (``conv_state_indices=m.spec_state_indices_tensor[:n, 0]``, ``max_query_len=spec_query_len``) or, RecoverSSM
    off, as ``_forward`` does (``spec_state_indices_tensor[:, 0][:n]``, ``max_query_len=
    spec_state_indices_tensor.size(-1)``), and the staging as the builder calls it. Both bitwise against vLLM, and
    each warmreg key (cuda:90: PDL) among the keys the example's plan warms; the index stride is 1 with RecoverSSM
    (the block table is one slot wide, the staged buffer ``[max_num_seqs, 1]``), ``1 + spec`` without."""
    g = seeded(17 + recoverssm)
    config = _engine_config(recoverssm, graphs)
    pages = torch.randn(LINES, CONV_ROWS * 3 * P + 2 * HEADS * D * D, generator=g).bfloat16()
    builder, width = _builder(config, pages)
    assert width == (1 if recoverssm else 1 + SPEC)
    common, step = _step(case, width, g)
    planned, staged = _planned(recoverssm), []
    real_stage = vllm_meta.stage_spec_decode_metadata

    def stage(*, num_spec_decodes: int, **args: torch.Tensor) -> None:  # the builder passes keywords
        ours = {name: x.as_subclass(torch.Tensor).clone() for name, x in args.items()}
        real_stage(**args, num_spec_decodes=num_spec_decodes)
        op = StageSpecDecodeMetadata(max_num_seqs=MAX_SEQS, num_speculative_tokens=SPEC)
        op(**ours, num_spec_decodes=num_spec_decodes, launch_pdl=False)
        for name in args:
            assert_same(ours[name], args[name].as_subclass(torch.Tensor), name)
        staged.append(op.dispatch(staged_state_indices=ours["staged_state_indices"],
                                  query_start_loc=ours["query_start_loc"],
                                  num_accepted_tokens=ours["num_accepted_tokens"], launch_pdl=True))  # fmt: skip

    with mock.patch.object(vllm_meta, "stage_spec_decode_metadata", stage):
        m = builder.build(0, common, num_accepted_tokens=step["num_accepted_tokens"],
                          num_decode_draft_tokens_cpu=step["drafts"])  # fmt: skip
    assert m.num_spec_decodes == (3 if case == "spec" else 2) and (m.recoverssm_commit is not None) == recoverssm
    assert len(staged) == (graphs and case == "spec") and all(
        k in planned[StageSpecDecodeMetadata.name] for k in staged
    )
    assert all(k.num_state_slots == (1 if recoverssm else 1 + SPEC) for k in staged)

    n, slots = m.num_spec_decodes, m.spec_state_indices_tensor
    indices = slots[:n, 0] if recoverssm else slots[:, 0][:n]
    indices = indices.as_subclass(torch.Tensor)
    rows = torch.randn(common.num_actual_tokens, ROW, generator=g).bfloat16()
    start = 0 if m.spec_token_start is None else m.spec_token_start
    args = {
        "x": rows[start : start + m.num_spec_decode_tokens, : 3 * P],
        "weight": torch.randn(3 * P, 4, generator=g), "bias": None, "activation": "silu",
        "conv_state_indices": indices, "num_accepted_tokens": m.num_accepted_tokens.as_subclass(torch.Tensor),
        "query_start_loc": m.spec_query_start_loc[: n + 1].as_subclass(torch.Tensor),
        "max_query_len": 1 + SPEC if recoverssm else slots.size(-1),
    }  # fmt: skip
    theirs, ours = pages.clone(), pages.clone()
    want = vllm_conv.causal_conv1d_update(conv_state=_conv_state(theirs), **args, validate_data=False,
                                          out=torch.empty_like(args["x"]))  # fmt: skip
    config_kimi = warmreg.WarmConfig.load(config_loader(EXAMPLES)("kimi_k3", use_replayssm=recoverssm))
    layout = kda_layout(KimiK3.from_config(config_kimi), config_kimi)
    assert layout is not None and (layout.num_heads, layout.head_dim, projection_row_stride(layout)) == (HEADS, D, ROW)
    op = CausalConv1dUpdate(layout=layout, plain_decode=True, max_num_seqs=MAX_SEQS)
    got = op(conv_state=_conv_state(ours), **args, launch_pdl=False, out=torch.full_like(args["x"], 3.0))
    assert_same(got, want, "conv output")
    assert_same(ours, theirs, "KV pages (conv states)")
    key = op.dispatch(conv_state=_conv_state(ours), null_block_id=0, launch_pdl=True,
                      **{k: v for k, v in args.items() if k != "out"})  # fmt: skip
    assert key.stride_state_indices == (1 if recoverssm else 1 + SPEC)
    assert key in planned[CausalConv1dUpdate.name], key
