"""Shared pieces of the DeepSeek-V4 per-step metadata and index kernels: tile size, state-cache page
sizes, integer-class representatives."""

from __future__ import annotations

from collections.abc import Mapping

import warmreg

__all__ = ["C4_STATE_BLOCK_SIZE", "C128_STATE_BLOCK_SIZE", "HIGH_REPS", "LOW_REPS", "TILE", "int_rep"]

#: Block sizes of the compressor-state KV-cache groups: the compressor's state cache holds 4 slots
#: per page for C4 and 8 for C128 (vLLM 0.33 ``models/deepseek_v4/compressor.py``).
C4_STATE_BLOCK_SIZE = 4
C128_STATE_BLOCK_SIZE = 8
#: Rows (metadata kernels) or columns (index kernels) handled per loop iteration, vLLM's
#: ``TRITON_BLOCK_SIZE`` of these kernels.
TILE = 1024

#: Representatives of the integer classes that keep ``0 <= start < stop`` and ``rank < world``.
LOW_REPS = {"div16": 0, "one": 1, "other": 3}
HIGH_REPS = {"one": 1, "other": 17, "div16": 32}


def int_rep(cls: warmreg.IntClass, table: Mapping[str, int]) -> int:
    """A representative of ``cls`` from ``table``, else warmreg's own."""
    return table.get(cls, warmreg.int_class_rep(cls))
