"""How many KV splits ROCm's sparse MLA decode walks a query in (vLLM 0.34 ``v1/attention/ops/rocm_aiter_mla_sparse.py``:
``_decode_num_splits`` on gfx942, ``_decode_gfx950_num_splits`` on gfx950, ``_decode_partial_iters``,
``_decode_cu_count``).

The split count only shapes the partial buffers and the grid: warmreg's decode kernels read it at run time (one binary
for every count), and the launcher picks it as vLLM does so that the partial buffers, and the rounding of the reduce,
are vLLM's. ``base = num_queries * cdiv(heads, 16)`` workgroups, ``cu`` the device's compute units (256 where the
device cannot be asked), average segment lengths read from the ragged stream sizes (``numel / num_queries``), keys
walked 32 at a time.
"""

from __future__ import annotations

import math

import torch

__all__ = ["cu_count", "decode_num_splits", "partial_iters"]


def cu_count(device: torch.device) -> int:
    """The device's compute units, as vLLM asks them (``multi_processor_count`` of device 0; 256 where that fails)."""
    if device.type != "cuda":
        return 256
    try:
        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    except Exception:  # vLLM's fallback, whatever the failure
        return 256


def partial_iters(avg_main: float, avg_extra: float, splits: int, block_k: int) -> int:
    """Key tiles one split walks: ``ceil(ceil(avg / splits) / block_k)`` for each non-empty segment, summed."""
    return sum(math.ceil(math.ceil(avg / splits) / block_k) for avg in (avg_main, avg_extra) if avg > 0)


def _snap_down(base: int, cu: int, splits: int, avg_main: float, avg_extra: float, block_k: int) -> int:
    """The fewest splits with the same wave count and tiles a split as ``splits``."""
    waves, iters = (base * splits + cu - 1) // cu, partial_iters(avg_main, avg_extra, splits, block_k)
    for fewer in range(1, splits):
        if (base * fewer + cu - 1) // cu == waves and partial_iters(avg_main, avg_extra, fewer, block_k) == iters:
            return fewer
    return splits


def _gfx942(base: int, cu: int, avg_main: float, avg_extra: float, block_k: int) -> int:
    """Minimise ``waves * (1 / s + 0.04)`` over ``s`` in 1..16 (ties: fewer), then snap down."""
    best, cost = 1, None
    for s in range(1, 17):
        c = ((base * s + cu - 1) // cu) * (1.0 / s + 0.04)
        if cost is None or c < cost - 1e-9:
            best, cost = s, c
    if best > 1 and (avg_main > 0 or avg_extra > 0):
        return _snap_down(base, cu, best, avg_main, avg_extra, block_k)
    return best


def _gfx950(base: int, cu: int, avg_main: float, avg_extra: float, block_k: int) -> int:
    """Two workgroups a CU (at most 32 splits); 4 where 4 splits walk at most 3 tiles; one or two waves for 16..63
    workgroups; then snap down (from 16 workgroups)."""
    splits = min(32, max(1, math.ceil(2 * cu / base)))
    if base >= 16 and splits > 4 and partial_iters(avg_main, avg_extra, 4, block_k) <= 3:
        return 4
    if 16 <= base < 64:
        one_wave = max(1, cu // base)
        waves = 1 if partial_iters(avg_main, avg_extra, one_wave, block_k) <= 9 else 2
        splits = min(splits, max(1, waves * cu // base))
    if base >= 16 and splits > 1:
        return _snap_down(base, cu, splits, avg_main, avg_extra, block_k)
    return splits


def decode_num_splits(
    num_queries: int, heads_blocks: int, avg_main: float, avg_extra: float, *, cu: int, gfx950: bool, block_k: int = 32
) -> int:
    """vLLM's split count for ``num_queries`` decode rows of ``heads_blocks`` head blocks (see the module docstring)."""
    base = max(1, num_queries * heads_blocks)
    pick = _gfx950 if gfx950 else _gfx942
    return pick(base, max(1, cu), avg_main, avg_extra, block_k)
