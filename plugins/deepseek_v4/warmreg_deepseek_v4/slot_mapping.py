"""The token -> KV slot mapping of each DeepSeek-V4 KV-cache group: the shared
:class:`warmreg.ops.BlockTableSlotMapping` (vLLM 0.33 ``v1/worker/block_table.py``:
``BlockTable.compute_slot_mapping``), declared once per group this deployment allocates.
"""

from __future__ import annotations

import warmreg
from warmreg.ops import BlockTableSlotMapping

from ._metadata_common import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from ._serving import dcp_world_size
from .backends import cache_block_size
from .model import DSV4, PLUGIN, SWA_PAGE_SIZE

__all__ = ["register"]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Declare the slot mapping once per KV-cache group: 64 (SWA), 256 (compressed and indexer caches),
    4 and 8 (compressor states), each only when the model has layers that use it.

    :raises warmreg.ConfigError: for a KV-manager block size other than 256 or DCP with C4 layers
        (neither is supported by the DSv4 backends).
    """
    cache_block = cache_block_size(config)
    dcp_world_size(config, model)  # DCP with C4 layers is refused before any group is declared
    groups = (
        (SWA_PAGE_SIZE, True),
        (cache_block, model.has_c4 or model.has_c128),
        (C4_STATE_BLOCK_SIZE, model.has_c4),
        (C128_STATE_BLOCK_SIZE, model.has_c128),
    )
    for block_size, used in groups:
        if used:  # built only when used: under DCP, from_config checks the interleave against the size
            registry.add(BlockTableSlotMapping.from_config(config, block_sizes=(block_size,), plugin=PLUGIN))
