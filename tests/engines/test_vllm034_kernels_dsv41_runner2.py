"""DeepSeek-V4.1's V2-runner kernels against vLLM 0.34's own, on identical runner-shaped inputs, under Triton's
interpreter: the engram look-back gather of ``DeepseekV41ModelState._fill_lookback`` (``_gather_lookback_kernel``)
and the SWA bounded-replay padding of ``DeepseekV41ModelState.prepare_attn`` (``_pad_replayed_slots_kernel``).

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's entry point as its call site does (``prepare_inputs`` calls ``self._fill_lookback(input_batch,
req_states)``: here on stand-ins holding exactly the attributes it reads, the persistent buffer, the batch's
``idx_mapping`` / ``query_start_loc`` / ``positions`` and ``req_states.all_token_ids.gpu``) and warmreg's op on clones
of the same seeded tensors, then compares every buffer either side writes, bitwise (an index copy).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch

vllm_state = engine("vllm.models.deepseek_v41.nvidia.model_state")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_lookback import GatherLookback  # noqa: E402
from warmreg_deepseek_v4.v41_replay_pad import PadReplayedSlots  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, I64 = torch.int32, torch.int64


def _batch(seed: int, reqs: int, max_reqs: int, depth: int, model_len: int) -> dict[str, torch.Tensor]:
    """A runner step: ``reqs`` of ``max_reqs`` request states scheduled in a shuffled order with 0-5 tokens each
    (decodes, chunks, an empty row), starting anywhere in their history, including position 0; the persistent buffer
    full of garbage (rows a larger batch wrote before); the history a column slice of a wider buffer (its row
    stride not the model length)."""
    g = seeded(seed)
    qlens = torch.randint(0, 6, (reqs,), generator=g)
    qsl = torch.zeros(reqs + 1, dtype=I32)
    qsl[1:] = torch.cumsum(qlens, 0)
    starts = torch.randint(0, model_len - 6, (reqs,), generator=g)
    if reqs:
        starts[0] = 0  # a fresh prompt: nothing before it
    pos = [torch.arange(s, s + q) for s, q in zip(starts.tolist(), qlens.tolist())]
    positions = torch.zeros(max(int(qsl[-1]), 1) + 7, dtype=I64)  # the runner's buffer is longer than the step
    if pos:
        flat = torch.cat(pos)
        positions[: flat.numel()] = flat
    return {
        "lookback": torch.randint(-5, 100, (max_reqs, depth), generator=g, dtype=I32),
        "idx_mapping": torch.randperm(max_reqs, generator=g)[:reqs].to(I64),
        "query_start_loc": qsl,
        "positions": positions,
        "all_token_ids": torch.randint(0, 129_280, (max_reqs, model_len + 9), generator=g, dtype=I32)[:, 9:],
    }


@pytest.mark.parametrize(
    ("reqs", "max_reqs", "depth", "model_len"), [(5, 8, 3, 64), (1, 1, 3, 40), (0, 4, 3, 16), (9, 16, 5, 100)]
)
def test_gather_lookback_equals_vllm(reqs: int, max_reqs: int, depth: int, model_len: int) -> None:
    """``_fill_lookback`` over the whole persistent buffer (V4.1-Flash's depth 3, a depth 5 of a 6-gram hash with 8
    lanes; a full batch, one request, an empty step). The history is read only: both sides read the same view."""
    args = _batch(reqs * 7 + depth, reqs, max_reqs, depth, model_len)
    theirs, ours = clones(**args), clones(**args)
    theirs["all_token_ids"] = ours["all_token_ids"] = args["all_token_ids"]
    state = SimpleNamespace(lookback_token_ids=theirs["lookback"])
    batch = SimpleNamespace(
        idx_mapping=theirs["idx_mapping"], query_start_loc=theirs["query_start_loc"], positions=theirs["positions"]
    )
    req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=theirs["all_token_ids"]))
    vllm_state.DeepseekV41ModelState._fill_lookback(state, batch, req_states)
    GatherLookback(depth=depth)(
        ours["lookback"], ours["idx_mapping"], ours["query_start_loc"], ours["positions"], ours["all_token_ids"]
    )
    for name in theirs:
        assert_same(ours[name], theirs[name], f"_fill_lookback: {name}")
    assert (theirs["lookback"][reqs:] == -1).all()  # the rows past the batch were rewritten on both sides


@pytest.mark.parametrize(("reqs", "groups", "window"), [(5, (0, 2, 3), 8), (1, (1,), 128), (4, (0, 1), 4)])
def test_pad_replayed_slots_equals_vllm(reqs: int, groups: tuple[int, ...], window: int) -> None:
    """``prepare_attn`` of a batch whose prefills carry replay starts around their chunks (decodes and one prefill
    with a start of 0 among them): vLLM gathers the starts by state row, keeps the prefills', and pads; warmreg's op
    is called with the starts vLLM uploaded. Stand-ins hold what ``prepare_attn`` reads: the replay window and the
    cacheable groups (``_replay``, set on first use from the KV-cache config), no PCP, no decoder replay layers; the
    UVA upload (CUDA only) is a CPU copy and the attention-metadata build (no kernel of this module) returns {}."""
    g = seeded(reqs * 11 + window)
    batch = _batch(reqs * 5 + window, reqs, 8, 2, 300)
    prefilling = torch.rand(reqs, generator=g) < 0.7
    qsl, pos = batch["query_start_loc"], batch["positions"]
    # Each state's replay start lies half a window before its chunk, so that some tokens fall in the window and some
    # do not; the first request's is 0 (no replay), and states outside the batch hold stale starts.
    state_starts = torch.randint(1, 300, (8,), generator=g).numpy().astype(np.int32)
    for r, q in enumerate(batch["idx_mapping"].tolist()):
        state_starts[q] = max(1, int(pos[int(qsl[r])]) - window // 2) if r else 0
    slots = torch.randint(0, 1 << 40, (4, pos.shape[0] + 5), generator=g, dtype=I64)
    cacheable = torch.tensor(groups, dtype=I32)
    theirs = slots.clone()
    uploaded: list[torch.Tensor] = []

    def upload(values: np.ndarray, num_reqs: int) -> torch.Tensor:  # UvaBufferPool.copy_to_gpu: CUDA only
        uploaded.append(torch.from_numpy(values.copy()))
        return uploaded[-1]

    state = SimpleNamespace(
        _replay=(window, cacheable), pcp_size=1, decoder_replay_layers=None, _replay_start_np=state_starts,
        _upload_replay_start=upload, _build_attn_metadata=lambda *args, **kwargs: {},
    )  # fmt: skip
    input_batch = SimpleNamespace(
        num_reqs=reqs, is_prefilling_np=prefilling.numpy(), idx_mapping_np=batch["idx_mapping"].numpy(),
        query_start_loc=qsl, positions=pos,
    )  # fmt: skip
    vllm_state.DeepseekV41ModelState.prepare_attn(state, input_batch, None, (), theirs, [], None)
    (replay_start,) = uploaded
    ours = slots.clone()
    if replay_start.any():  # vLLM's condition for the launch
        PadReplayedSlots()(ours, cacheable, qsl, pos, replay_start, window=window, pad_slot_id=vllm_state.PAD_SLOT_ID)
    assert_same(ours, theirs, "prepare_attn: slot_mappings")
    assert reqs < 2 or not torch.equal(theirs, slots)  # some slots were padded
