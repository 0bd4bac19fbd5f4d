"""The DeepSeek-V4.1 sweep's V2-runner launch of ``prepare_attn`` (vLLM 0.34 ``nvidia/model_state.py``), called once
a step by :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` where the plan holds it: the SWA bounded-replay padding
of the replayed tokens' slots.

The runner's slot mappings stand in as one int64 ``[groups, T + 8]`` buffer (the step padded past its tokens) with a
row per KV-cache group of the driver (the sliding-window group first, then the compressed one and the indexer's), the
step's slots in it; every group but the sliding-window one is prefix-cacheable. The replay starts are the batch's
(a fifth of its requests replaying) with the decodes' zeroed, as vLLM's ``np.where(is_prefilling, ...)`` does. vLLM
launches only when one is non-zero; the driver launches on every step (one with no start writes nothing), as it
runs the indexer Q quant, so that the CPU test's few steps launch it too. The padded copy is checked, not fed back:
the driver's inserts write every token's KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sweep_inputs import DSV4_PREFIX, I32, I64, KV, DSV4Step
from .v41_replay_pad import pad_replayed_slots_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["REPLAY_PAD", "drive_replay_pad"]

#: The kernel :func:`drive_replay_pad` launches.
REPLAY_PAD = DSV4_PREFIX + "v41_pad_replayed_slots"


def drive_replay_pad(sweep: DSV41Sweep, st: DSV4Step, swa_block: int) -> None:
    """Pad one step's replayed slots in the cacheable groups (see the module docstring) where the plan holds the
    kernel."""
    if REPLAY_PAD not in sweep.names:
        return
    b, dev, T = st.batch, sweep.dev, st.batch.tokens
    replay = st.replay.clone()
    replay[: b.num_decodes] = 0  # only prefills carry a replay start
    sizes = (swa_block, KV, sweep.index_bs)
    slots = torch.full((len(sizes), T + 8), -1, dtype=I64, device=dev)
    for g, bs in enumerate(sizes):
        slots[g, :T] = st.slots[bs][:T]
    groups = torch.arange(1, len(sizes), dtype=I32, device=dev)
    args = (slots, groups, st.qsl, st.positions[:T], replay)
    window = sweep.window
    sweep.launch(
        REPLAY_PAD, f"{int((replay != 0).sum())} replaying requests, window {window}",
        lambda: sweep.kernel(REPLAY_PAD)(*args, window=window),
        ref=lambda: pad_replayed_slots_reference(*args, window=window),
    )  # fmt: skip
