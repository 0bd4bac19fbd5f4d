"""The DeepSeek-V4.1 sweep's decoder replay batch (vLLM 0.34 ``nvidia/model_state.py``:
``DeepseekV41ModelState._prepare_replay_batch`` -> ``_kept_input_batch``), called once a step by
:class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` where the plan holds the replay gather.

Each prefill keeps its last ``window`` rows (the sliding window), a decode all of its rows, as ``_prepare_replay_batch``
computes ``kept_lens`` without PCP; the rows trimmed before each boundary are the batch's query offsets minus the kept
ones. The runner's slot mappings stand in as one int64 ``[groups, T + 8]`` buffer with a row per KV-cache group of the
driver (as :mod:`._sweep_v41_runner` builds them), the kept outputs as the runner's persistent buffers
(``max_num_batched_tokens`` rows). vLLM launches only on an eager step that trims a prefill; the driver launches on
every step (one that trims nothing copies every row), as it runs the replay padding, so that the CPU test's short
prefills launch it too. The outputs are checked, not fed back: the driver's replay layers are its ordinary layers.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from .sweep_inputs import DSV4_PREFIX, I32, I64, KV, DSV4Step
from .v41_replay_gather import gather_replay_batch_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["REPLAY_DRIVES", "drive_replay_gather"]

_GATHER = DSV4_PREFIX + "v41_gather_replay_batch"
#: The kernels :func:`drive_replay_gather` launches.
REPLAY_DRIVES = frozenset({_GATHER})


def drive_replay_gather(sweep: DSV41Sweep, st: DSV4Step, swa_block: int) -> None:
    """Gather one step's replay batch (see the module docstring) where the plan holds the kernel."""
    if _GATHER not in sweep.names:
        return
    b, dev, T, window = st.batch, sweep.dev, st.batch.tokens, sweep.window
    kept = [q if i < b.num_decodes else min(q, window) for i, q in enumerate(b.qlens)]
    kept_qsl = torch.zeros(len(kept) + 1, dtype=I32, device=dev)
    kept_qsl[1:] = torch.tensor(kept, dtype=I32, device=dev).cumsum(0)
    dropped = (st.qsl.to(I32) - kept_qsl).to(I32)
    sizes = (swa_block, KV, sweep.index_bs)
    slots = torch.full((len(sizes), T + 8), -1, dtype=I64, device=dev)
    for g, bs in enumerate(sizes):
        slots[g, :T] = st.slots[bs][:T]
    rows = sweep.lim.max_tokens
    outs = (
        torch.full((rows,), -1, dtype=I64, device=dev),
        torch.zeros(len(kept) + 1, dtype=I32, device=dev),
        torch.zeros(rows, dtype=I64, device=dev),
        torch.full((len(sizes), rows), -1, dtype=I64, device=dev),
        torch.zeros(len(kept), dtype=I32, device=dev),
    )
    args = (st.qsl.to(I32), dropped, st.seq_lens, st.replay, st.positions[:T], slots, *outs)
    sweep.launch(
        _GATHER, f"{sum(k < q for k, q in zip(kept, b.qlens))} trimmed requests, window {window}",
        partial(sweep.kernel(_GATHER), *args, window=window),
        ref=partial(gather_replay_batch_reference, *args, window=window),
    )  # fmt: skip
