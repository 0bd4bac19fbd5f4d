"""DeepSeek-V4.1's decoder replay batch gather against vLLM 0.34's own, on identical runner-shaped inputs, under
Triton's interpreter: ``DeepseekV41ModelState._kept_input_batch`` (``models/deepseek_v41/nvidia/model_state.py``,
``_gather_replay_batch_kernel``) beside warmreg's ``deepseek_v4.v41_gather_replay_batch``.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. vLLM's
method is called as ``_prepare_replay_batch`` calls it (``self._kept_input_batch(input_batch, slot_mappings,
kept_replay_start, kept_lens, num_padded)``, no PCP) on a stand-in model state holding exactly the attributes it reads
(the persistent kept buffers, the UVA pool of the trimmed-row counts as a CPU tensor, the replay layers' window) and a
dataclass input batch with the fields it reads and replaces. warmreg's op runs on clones of the same seeded tensors
with the trimmed-row counts computed as vLLM computes them. Every buffer either side writes is compared bitwise (an
index copy), and vLLM's returned sub-batch is checked against warmreg's outputs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch

vllm_state = engine("vllm.models.deepseek_v41.nvidia.model_state")
import vllm  # noqa: E402
from warmreg_deepseek_v4.v41_replay_gather import GatherReplayBatch  # noqa: E402

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

I32, I64 = torch.int32, torch.int64


@dataclass
class _InputBatch:
    """The ``InputBatch`` fields ``_kept_input_batch`` reads or replaces."""

    num_reqs: int
    num_tokens: int
    num_tokens_after_padding: int
    query_start_loc: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor
    positions: torch.Tensor
    max_query_len: int
    is_padding: torch.Tensor
    fast_prefill: Any = None


class _Uva:
    """``UvaBufferPool.copy_to_uva``: the host array as a (CPU) int32 tensor."""

    def copy_to_uva(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)).clone()


def _step(seed: int, qlens: list[int], decodes: int, window: int, groups: int, max_tokens: int) -> dict[str, Any]:
    """A runner step: ``decodes`` decode requests then prefills, each prefill keeping its last ``window`` rows (as
    ``_prepare_replay_batch`` computes ``kept_lens`` without PCP), sequence lengths past the query, replay starts
    (some 0), the slot mappings of ``groups`` KV-cache groups and garbage in every persistent kept buffer."""
    g = seeded(seed)
    qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
    np.cumsum(qlens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = torch.tensor(qlens, dtype=I32) + torch.randint(0, 300, (len(qlens),), generator=g, dtype=I32)
    return {
        "kept_lens": np.array([q if i < decodes else min(q, window) for i, q in enumerate(qlens)], dtype=np.int64),
        "qsl_np": qsl,
        "qsl": torch.from_numpy(qsl.copy()),
        "seq_lens": seq_lens,
        "replay_start": torch.randint(0, 3, (len(qlens),), generator=g, dtype=I32) * 50,
        "positions": torch.randint(0, 1 << 20, (T + 4,), generator=g, dtype=I64),
        "slot_mappings": torch.randint(0, 1 << 40, (groups, T + 4), generator=g, dtype=I64),
        "rows": torch.randint(-9, 9, (max_tokens,), generator=g, dtype=I64),
        "kept_qsl": torch.randint(-9, 9, (len(qlens) + 8,), generator=g, dtype=I32),
        "kept_positions": torch.randint(-9, 9, (max_tokens,), generator=g, dtype=I64),
        "kept_slots": torch.randint(-9, 9, (groups, max_tokens), generator=g, dtype=I64),
        "kept_kv_start": torch.randint(-9, 9, (len(qlens) + 8,), generator=g, dtype=I32),
    }


@pytest.mark.parametrize(
    ("qlens", "decodes", "window", "groups"),
    [([1, 2, 300, 5, 128], 2, 128, 4), ([2100, 3], 0, 128, 3), ([4], 1, 128, 1), ([1, 1, 700], 2, 64, 5)],
)
def test_gather_replay_batch_equals_vllm(qlens: list[int], decodes: int, window: int, groups: int) -> None:
    """Decodes (never trimmed), prefills trimmed to the window, one past a 1024 tile, a step that trims nothing (one
    decode), V4.1's window 128 and a 64: the kept rows, offsets, positions, slots and KV starts."""
    s = _step(sum(qlens) + groups, qlens, decodes, window, groups, max_tokens=sum(qlens) + 16)
    theirs, ours = clones(**s), clones(**s)
    num_tokens = int(s["kept_lens"].sum())
    state = SimpleNamespace(
        _dropped_before=_Uva(), _kept_slot_mappings=theirs["kept_slots"], pcp_size=1, _kept_rows=theirs["rows"],
        _kept_query_start_loc=theirs["kept_qsl"], _kept_positions=theirs["kept_positions"],
        _kept_kv_start=theirs["kept_kv_start"], decoder_replay_layers=SimpleNamespace(window=window),
        device=torch.device("cpu"),
    )  # fmt: skip
    batch = _InputBatch(
        num_reqs=len(qlens), num_tokens=int(s["qsl_np"][-1]), num_tokens_after_padding=int(s["qsl_np"][-1]) + 4,
        query_start_loc=theirs["qsl"], query_start_loc_np=s["qsl_np"], seq_lens=theirs["seq_lens"],
        positions=theirs["positions"], max_query_len=max(qlens), is_padding=torch.zeros(1, dtype=torch.bool),
    )  # fmt: skip
    kept_batch, kept_slots = vllm_state.DeepseekV41ModelState._kept_input_batch(
        state, batch, theirs["slot_mappings"], theirs["replay_start"], s["kept_lens"], num_tokens
    )
    kept_qsl_np = np.zeros(len(qlens) + 1, dtype=np.int32)
    np.cumsum(s["kept_lens"], out=kept_qsl_np[1:])
    dropped = torch.from_numpy(s["qsl_np"] - kept_qsl_np)
    GatherReplayBatch()(
        ours["qsl"], dropped, ours["seq_lens"], ours["replay_start"], ours["positions"], ours["slot_mappings"],
        ours["rows"], ours["kept_qsl"], ours["kept_positions"], ours["kept_slots"][:, :num_tokens],
        ours["kept_kv_start"], window=window,
    )  # fmt: skip
    for name in ("rows", "kept_qsl", "kept_positions", "kept_slots", "kept_kv_start"):
        assert_same(ours[name], theirs[name], name)
    assert kept_batch.query_start_loc.tolist() == ours["kept_qsl"][: len(qlens) + 1].tolist()
    assert torch.equal(kept_slots, ours["kept_slots"][:, :num_tokens])
    assert not torch.equal(ours["rows"], s["rows"])  # both sides wrote the kept rows
