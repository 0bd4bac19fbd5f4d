"""Kimi-K3 specialized-decode ops against vLLM 0.34's own kernels (issue 37): the DSpark Markov drafter's noise, step
and select launches, the draft attention's balanced tables (plan + row copies) and the KV-balanced MLA plan, on
identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_specialized.py``); skips, naming why, elsewhere. Every comparison is bitwise:
the same integer, uint32 and fp32 operations in the same order on both sides, the random draws included (vLLM's
murmur3 Gumbel noise is a pure function of seed, position and token id, so both sides draw the same bits).

Stand-ins, none of which touches a kernel or its math:

- ``FusedMarkov.fork_noise`` runs its launch under ``torch.cuda.Stream`` / ``torch.cuda.stream`` /
  ``torch.cuda.current_stream``; ``_Streams`` replaces those three with no-ops (one CPU stream).
- vLLM's Markov step adds the logits with inline PTX (``_add_rn``: ``add.rn.f32``), which the interpreter cannot
  run; ``_add_rn`` here is the same instruction's semantics, a round-to-nearest fp32 add.
- Triton 3.8's interpreter multiplies bf16 ``tl.dot`` operands as raw uint16 bits; ``bf16_dot`` makes it multiply
  their values (an interpreter fix applied to both sides; without it both sides agree on garbage logits).
- ``kv_balanced_mla/core.py`` imports CuTe DSL (``cutlass``), ``tvm_ffi`` and its CuTe kernel module at the top for
  its decode; none is installed on CPU, so empty modules stand in for them while it imports (the planner is plain
  Triton). ``KvBalancedMla.__init__`` asks the GPU for its capability and cluster count; the core is built with
  ``object.__new__`` and given the attributes ``__init__`` derives, through the module's own functions.
- ``balanced_decode`` launches FlashInfer; ``_balanced_tables`` (the plan and the block-table copy) and
  ``_row_copy`` (the query gather, the output scatters) are called directly, as ``balanced_decode`` calls them.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import triton
import triton.language as tl

vllm_markov = engine("vllm.models.kimi_k3.nvidia.specialized_decode.drafter.markov")
vllm_attn = engine("vllm.models.kimi_k3.nvidia.specialized_decode.drafter.attention")
from warmreg_kimi_k3.markov_noise import MarkovNoise  # noqa: E402
from warmreg_kimi_k3.markov_select import MarkovSelect  # noqa: E402
from warmreg_kimi_k3.markov_step import MarkovStep  # noqa: E402


@triton.jit
def _add_rn(a, b):  # type: ignore[no-untyped-def]
    """``add.rn.f32 $0, $1, $2``: one fp32 add, rounded to nearest even (what the interpreter's numpy add does)."""
    return a + b


class _Streams:
    """``torch.cuda``'s stream API as no-ops (``fork_noise`` / ``join``)."""

    class Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, other: Any) -> None:
            pass

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: Any) -> None:
            pass

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return _Streams.Stream()

    @staticmethod
    def stream(s: Any) -> Any:
        return s


@pytest.fixture
def ptx(monkeypatch: pytest.MonkeyPatch, bf16_dot: None) -> None:
    """vLLM's PTX add emulated, its side streams as no-ops, bf16 dots multiplied by value (``bf16_dot``)."""
    monkeypatch.setattr(vllm_markov, "_add_rn", _add_rn)
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(_Streams, name))


def _bf16_as_f32(handle: Any) -> Any:
    """A bf16 operand's numpy bits (uint16) as the fp32 values they are (exact)."""
    import numpy as np

    if handle.dtype.scalar == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.8's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits
    (``interpreter.py: InterpreterBuilder.create_dot`` converts only fp8): multiply their values (bf16 -> fp32 is
    exact; numpy accumulates in fp32, the dot's accumulator). A fix to the interpreter, not to any kernel."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar != interpreter.tl.bfloat16 and b.dtype.scalar != interpreter.tl.bfloat16:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = interpreter.np.matmul(_bf16_as_f32(a), _bf16_as_f32(b), dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# -- the Markov drafter -----------------------------------------------------------------------------------------
def _spec(reqs: int, k: int, vocab: int, states: int, seed: int, dtype: torch.dtype) -> types.SimpleNamespace:
    """The speculator fields the fused Markov launches read: its persistent int64 index/position buffers (a few -1
    rows), temperatures (greedy 0 included) and seeds of ``states`` request states, the replicated draft-logits
    cache, int64 draft tokens, int32 input ids and the anchor indices."""
    g = seeded(seed)
    idx = torch.randperm(states, generator=g)[:reqs].repeat_interleave(k)
    idx[torch.rand(reqs * k, generator=g) < 0.1] = -1
    pos = torch.randint(1, 1 << 20, (reqs,), generator=g).repeat_interleave(k) + torch.arange(k).repeat(reqs)
    temp = torch.rand(states, generator=g) * 1.5
    temp[0] = 0.0
    cache = torch.full((states, k, vocab + 8), 7.0, dtype=dtype)
    return types.SimpleNamespace(
        sample_idx_mapping=torch.cat([idx, torch.full((8,), -1)]), sample_pos=torch.cat([pos, torch.zeros(8).long()]),
        temperature=temp, seeds=torch.randint(-(1 << 62), 1 << 62, (states,), generator=g),
        draft_logits=types.SimpleNamespace(values=cache, row_mapping=None),
        draft_tokens=torch.zeros(states, k, dtype=torch.int64),
        input_buffers=types.SimpleNamespace(input_ids=torch.randint(0, vocab, (reqs * (k + 1),), generator=g,
                                                                    dtype=torch.int32)),
        _anchor_idx=torch.arange(states, dtype=torch.int64) * k,
    )  # fmt: skip


def _warmreg_run(spec: Any, fused: Any, reqs: int, base: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 noise: torch.Tensor | None) -> None:  # fmt: skip
    """``FusedMarkov.run`` with warmreg's ops: per step, the step launch then the select launch."""
    k = base.shape[1]
    idx = spec.sample_idx_mapping[: reqs * k].view(reqs, k)
    pos = spec.sample_pos[: reqs * k].view(reqs, k)
    out_max, out_arg = fused.bufs
    for step in range(k):
        MarkovStep(num_speculative_tokens=k, max_num_seqs=reqs, vocab_size=base.shape[2], rank=w1.shape[1],
                   dtype="bfloat16")(
            fused.prev, spec.input_buffers.input_ids, spec._anchor_idx, w1, w2, base[:, step],
            spec.draft_logits.values, idx, pos, spec.temperature, spec.seeds, out_max, out_arg, noise, step=step,
        )  # fmt: skip
        MarkovSelect(vocab_size=base.shape[2])(
            out_max, out_arg, fused.prev, spec.draft_tokens, num_rows=reqs, step=step
        )


@pytest.mark.parametrize(
    ("reqs", "k", "vocab", "rank", "dtype", "noise"),
    [
        (2, 3, 700, 16, torch.bfloat16, True),  # a partial 256-block and 64-tile; the precomputed noise
        (3, 2, 520, 32, torch.float32, False),  # fp32 logits; the noise drawn in the step
        (17, 2, 300, 16, torch.bfloat16, False),  # two row blocks of 16
    ],
)
def test_markov_draft_matches_vllm(ptx: None, reqs: int, k: int, vocab: int, rank: int, dtype: torch.dtype,
                                   noise: bool) -> None:  # fmt: skip
    """``FusedMarkov.fork_noise`` + ``FusedMarkov.run`` against the noise, step and select ops: the noise, the
    draft tokens, the draft-logits cache (every row, the untouched ones too), the previous tokens and the maxima."""
    g, states = seeded(reqs + k), reqs + 5
    w1 = torch.randn(vocab, rank, generator=g).to(torch.bfloat16)
    w2 = torch.randn(vocab, rank, generator=g).to(torch.bfloat16)
    base = (torch.randn(reqs, k, vocab, generator=g) * 3).to(dtype)
    theirs, ours = _spec(reqs, k, vocab, states, reqs, dtype), _spec(reqs, k, vocab, states, reqs, dtype)
    fused_v = vllm_markov.FusedMarkov(vocab, rank, states, torch.device("cpu"), False)
    fused_w = vllm_markov.FusedMarkov(vocab, rank, states, torch.device("cpu"), False)
    for fused in (fused_v, fused_w):  # the scratch starts with the same garbage
        fused.bufs[0].copy_(torch.randn(fused.bufs[0].shape, generator=seeded(1)))
        fused.bufs[1].copy_(torch.randint(0, 9, fused.bufs[1].shape, generator=seeded(2)))
    noise_v = fused_v.fork_noise(theirs, reqs, k) if noise else None
    noise_w = None
    if noise:
        idx = ours.sample_idx_mapping[: reqs * k].view(reqs, k)
        noise_w = MarkovNoise(num_speculative_tokens=k)(idx, ours.sample_pos[: reqs * k].view(reqs, k), ours.seeds,
                                                        vocab=vocab)  # fmt: skip
        assert_same(noise_w, noise_v, "noise")
    fused_v.run(theirs, reqs, base.clone(), w1, w2, noise_v)
    _warmreg_run(ours, fused_w, reqs, base.clone(), w1, w2, noise_w)
    assert_same(ours.draft_tokens, theirs.draft_tokens, "draft_tokens")
    assert_same(ours.draft_logits.values, theirs.draft_logits.values, "draft logits cache")
    assert_same(fused_w.prev, fused_v.prev, "prev")
    assert_same(fused_w.bufs[0], fused_v.bufs[0], "out_max")
    assert_same(fused_w.bufs[1], fused_v.bufs[1], "out_arg")


def test_noise_kernel_alone_matches_vllm(ptx: None) -> None:
    """The noise of a larger block count (three 1024-programs) and seeds of both signs, every step."""
    reqs, k, vocab = 4, 4, 2100
    spec = _spec(reqs, k, vocab, 9, 7, torch.bfloat16)
    fused = vllm_markov.FusedMarkov(vocab, 16, 9, torch.device("cpu"), False)
    theirs = fused.fork_noise(spec, reqs, k).clone()
    args = clones(idx=spec.sample_idx_mapping[: reqs * k].view(reqs, k), pos=spec.sample_pos[: reqs * k].view(reqs, k))
    ours = MarkovNoise(num_speculative_tokens=k)(args["idx"], args["pos"], spec.seeds, vocab=vocab)
    assert_same(ours, theirs, "noise")


# -- the draft attention's balanced tables -------------------------------------------------------------------------
from warmreg_kimi_k3.draft_fold import RowCopy, TierPlan  # noqa: E402


@pytest.mark.parametrize(("rows", "split_rows", "pairs"), [(40, 12, 74), (70, 28, 76), (33, 4, 2)])
def test_balanced_tables_match_vllm(rows: int, split_rows: int, pairs: int) -> None:
    """``_balanced_tables`` (plan + block-table gather) against the tier plan and a row copy: every table, ties in
    the lengths included (rank order), a few long rows that move and short ones that stay."""
    g = seeded(rows)
    lens = torch.randint(1, 4000, (rows,), generator=g, dtype=torch.int32)
    lens[: rows // 5] = torch.randint(200_000, 400_000, (rows // 5,), generator=g, dtype=torch.int32)
    lens[-3:] = lens[0]  # ties
    tot = lens * 8 + torch.randint(0, 8, (rows,), generator=g, dtype=torch.int32)
    bt = torch.randint(0, 1 << 20, (rows, 37), generator=g, dtype=torch.int32)
    theirs = vllm_attn._balanced_tables(None, bt, lens, tot, split_rows, pairs)
    dst, rest, tier_sl, tier_tot = TierPlan(rows=[rows])(lens.clone(), tot.clone(), split_rows=split_rows, pairs=pairs)
    tier_bt = bt.new_empty((split_rows, bt.shape[1]))
    theirs_bt = theirs[2].clone()
    theirs_bt[theirs[0] >= rows] = 0  # unmoved tier rows: never written by either side (torch.empty)
    RowCopy()(bt, tier_bt, dst, rows, True)
    tier_bt[dst >= rows] = 0
    for got, want, what in ((dst, theirs[0], "dst"), (rest, theirs[1], "rest"), (tier_bt, theirs_bt, "tier block table"),
                            (tier_sl, theirs[3], "tier lengths"), (tier_tot, theirs[4], "tier totals")):  # fmt: skip
        assert_same(got, want, what)


@pytest.mark.parametrize("gather", [True, False])
def test_row_copies_match_vllm(gather: bool) -> None:
    """``_row_copy`` of bf16 outputs ``[rows, 1, heads, 512]`` (two 4096-word blocks a row) and fp32 LSEs, both
    directions, some rows skipped (``target >= bound``)."""
    g, rows, bound = seeded(5), 6, 9
    target = torch.tensor([3, 9, 0, 12, 8, 5], dtype=torch.int32)
    for shape, dtype in (((rows, 1, 24, 512), torch.bfloat16), ((rows, 24), torch.float32)):
        src = torch.randn((bound, *shape[1:]) if gather else shape, generator=g).to(dtype)
        dst = torch.randn(shape if gather else (bound, *shape[1:]), generator=g).to(dtype)
        args = clones(src=src, dst=dst)
        vllm_attn._row_copy(src, dst, target, bound, gather)
        RowCopy()(args["src"], args["dst"], target, bound, gather)
        assert_same(args["dst"], dst, f"row copy {dtype}")


# -- the KV-balanced MLA plan ------------------------------------------------------------------------------------
def _vllm_core_module() -> types.ModuleType:
    """``kv_balanced_mla.core`` imported with empty stand-ins for its CuTe imports (the module docstring)."""
    name = "vllm.models.kimi_k3.nvidia.kv_balanced_mla.core"
    if name in sys.modules:
        return sys.modules[name]
    cutlass = types.ModuleType("cutlass")
    cutlass.Float32 = cutlass.Int32 = object  # type: ignore[attr-defined]
    cute = types.ModuleType("cutlass.cute")
    cutlass.cute = cute  # type: ignore[attr-defined]
    pkg = "vllm.models.kimi_k3.nvidia.kv_balanced_mla"
    helpers, kernel = types.ModuleType(pkg + ".helpers"), types.ModuleType(pkg + ".kernel")
    helpers.get_mla_decode_arch = helpers.select_mla_decode_tilers = None  # type: ignore[attr-defined]
    kernel.BlackwellMultiHeadLatentAttentionForwardFP8 = None  # type: ignore[attr-defined]
    stand_ins = {"cutlass": cutlass, "cutlass.cute": cute, "tvm_ffi": types.ModuleType("tvm_ffi"),
                 pkg + ".helpers": helpers, pkg + ".kernel": kernel}  # fmt: skip
    saved = {k: sys.modules.get(k) for k in stand_ins}
    sys.modules.update(stand_ins)
    try:
        return engine(name)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


from warmreg_kimi_k3.kv_balanced_plan import BalancedCore, KvBalancedPlan  # noqa: E402


@pytest.mark.parametrize(
    ("heads", "q", "max_requests", "requests", "capacity", "min_split_tokens"),
    [
        (12, 5, 64, 37, 8, 256),  # TP8 verify, 8 splits
        (96, 5, 1, 1, 16, 256),  # DCP8: 4 query tiles, one long request
        (12, 1, 12, 9, 32, 1024),  # plain decode, the kernel's default shortest split
        (64, 2, 32, 32, 8, 256),  # a full batch
    ],
)
def test_kv_balanced_plan_matches_vllm(heads: int, q: int, max_requests: int, requests: int, capacity: int,
                                       min_split_tokens: int) -> None:  # fmt: skip
    """``KvBalancedMla.plan`` against the plan op: the split counts (past the batch: untouched) and the work list."""
    core_mod = _vllm_core_module()
    clusters = 74
    core = object.__new__(core_mod.KvBalancedMla)  # __init__'s derived values, through the module's functions
    core.q_tiles = core_mod.query_tiles(heads, q)
    core.clusters, core.capacity, core.min_split_tokens = clusters, capacity, min_split_tokens
    core.max_requests = max_requests
    core.list_len = core_mod.work_list_len(heads, q, max_requests, clusters)
    core.max_waves = core.list_len // clusters - 1
    core.block_b = triton.next_power_of_2(max(16, max_requests))
    g = seeded(requests + q)
    lens = torch.randint(1, 9000, (requests,), generator=g, dtype=torch.int32)
    lens[: requests // 4 + 1] *= 40  # a few long requests
    counts = torch.full((max_requests,), 77, dtype=torch.int32)
    work = torch.full((core.list_len,), 55, dtype=torch.int32)
    args = clones(lens=lens, counts=counts, work=work)
    core.plan(lens, counts, work)
    ours = BalancedCore.create(heads=heads, q=q, max_requests=max_requests, clusters=clusters, capacity=capacity,
                               min_split_tokens=min_split_tokens)  # fmt: skip
    assert (ours.list_len, ours.max_waves) == (core.list_len, core.max_waves)
    KvBalancedPlan(heads=heads, q=q, dcp=False)(args["lens"], args["counts"], args["work"], core=ours)
    assert_same(args["counts"], counts, "counts")
    assert_same(args["work"], work, "work list")
