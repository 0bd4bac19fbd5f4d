"""The token -> KV slot mapping of Kimi-K3's MLA layers: the shared
:class:`warmreg.ops.BlockTableSlotMapping` (vLLM 0.33 ``v1/worker/block_table.py``:
``BlockTable.compute_slot_mapping``). The KDA layers keep per-request state slots instead and need no
slot mapping.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import BlockTableSlotMapping

from .model import PLUGIN, KimiK3

__all__ = ["register"]


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the slot mapping of the MLA layers' paged KV cache (``serving.block_size``).

    :raises warmreg.ConfigError: if ``serving.block_size`` or ``serving.max_model_len`` is missing.
    """
    block = config.get("serving.block_size", int, plugin=PLUGIN)
    max_len = config.get("serving.max_model_len", int, plugin=PLUGIN)
    registry.add(BlockTableSlotMapping(block_sizes=(block,), max_model_len=max_len, plugin=PLUGIN))
