"""Kernels shared by several model families (registered by their plugins, never at import)."""

from __future__ import annotations

from .qkv_rmsnorm import FusedQKVRMSNorm, QKVRMSNormKey, fused_qkv_rmsnorm_reference

__all__ = ["FusedQKVRMSNorm", "QKVRMSNormKey", "fused_qkv_rmsnorm_reference"]
