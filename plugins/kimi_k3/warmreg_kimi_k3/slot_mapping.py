"""The token -> KV slot mapping of Kimi-K3's MLA layers: the shared
:class:`warmreg.ops.BlockTableSlotMapping` (vLLM 0.33 ``v1/worker/block_table.py``:
``BlockTable.compute_slot_mapping``), at the block size vLLM runs (:func:`warmreg_kimi_k3.backends.kv_block_size`:
the requested one raised until an attention page holds a KDA state page). The KDA layers keep per-request state
slots instead and need no slot mapping.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import BlockTableSlotMapping

from .backends import kv_block_size
from .model import PLUGIN, KimiK3

__all__ = ["register"]


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the slot mapping of the MLA layers' paged KV cache, at the block size vLLM runs
    (:func:`warmreg_kimi_k3.backends.kv_block_size`).

    :raises warmreg.ConfigError: if ``serving.max_model_len`` is missing, or a field the block size reads.
    """
    block = kv_block_size(m, config)
    max_len = config.get("serving.max_model_len", int, plugin=PLUGIN)
    registry.add(BlockTableSlotMapping(block_sizes=(block,), max_model_len=max_len, plugin=PLUGIN))
