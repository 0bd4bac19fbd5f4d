"""Kernels shared by several model families (registered by their plugins, never at import)."""

from __future__ import annotations

from .qkv_rmsnorm import FusedQKVRMSNorm, QKVRMSNormKey, fused_qkv_rmsnorm_reference
from .slot_mapping import BlockTableSlotMapping, SlotMappingKey, block_table_slot_mapping_reference, block_table_width

__all__ = [
    "BlockTableSlotMapping",
    "FusedQKVRMSNorm",
    "QKVRMSNormKey",
    "SlotMappingKey",
    "block_table_slot_mapping_reference",
    "block_table_width",
    "fused_qkv_rmsnorm_reference",
]
