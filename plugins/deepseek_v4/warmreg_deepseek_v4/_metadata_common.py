"""Shared pieces of the DeepSeek-V4 metadata kernels (specs sections 12, 17-20): tile size, checks."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import warmreg

from .model import PLUGIN

__all__ = ["C4_STATE_BLOCK_SIZE", "C128_STATE_BLOCK_SIZE"]

#: Block sizes of the compressor-state KV-cache groups (specs section 2: page_bs 4 for C4, 8 for C128).
C4_STATE_BLOCK_SIZE = 4
C128_STATE_BLOCK_SIZE = 8
_TILE = 1024  # rows per loop iteration (sections 17-20)
_I32 = torch.int32


def _check_int32(kernel: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != _I32 or t.ndim != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                kernel, f"{name} must be a contiguous 1-D int32 tensor (got {t.dtype} {tuple(t.shape)})"
            )


def _check_table(kernel: str, name: str, table: torch.Tensor, rows: int) -> None:
    if table.ndim != 2 or table.dtype != _I32 or (table.shape[1] > 1 and table.stride(1) != 1) or table.shape[0] < rows:
        raise warmreg.LaunchError(
            kernel, f"{name} must be int32 [>= {rows}, W] with contiguous rows (got {tuple(table.shape)})"
        )


def _serving(config: warmreg.WarmConfig, field: str, default: int | None = None) -> int:
    if default is None:
        return config.get(f"serving.{field}", int, plugin=PLUGIN)
    return config.get(f"serving.{field}", int, plugin=PLUGIN, default=default)


#: Representatives of the integer classes that keep ``0 <= start < stop`` and ``rank < world``.
_LOW = {"div16": 0, "one": 1, "other": 3}
_HIGH = {"one": 1, "other": 17, "div16": 32}


def _rep(cls: warmreg.IntClass, table: Mapping[str, int]) -> int:
    return table.get(cls, warmreg.int_class_rep(cls))
