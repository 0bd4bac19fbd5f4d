"""Zeroed device memory without a torch kernel: the CUDA driver's memset, through ctypes."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["zeros"]


@functools.cache
def _memset() -> Any:
    """``cuMemsetD8Async`` of the ``libcuda.so.1`` torch loaded, or ``None`` where it cannot be opened."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemsetD8Async
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
    return fn


def zeros(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` zero bytes (``uint8``) on ``device``, written on its current stream.

    On a CUDA device the driver's ``cuMemsetD8Async`` writes them: no torch kernel is loaded for it (``torch.zeros``
    loads torch's fill kernel at its first use in a process; a warm's first rehearsed key took 6-7 ms on an H100 host,
    the others 0.2-0.3 ms). Elsewhere, or where the driver's memset is not found, ``torch.zeros``.

    :raises RuntimeError: the driver's error code, where its memset fails.
    """
    device = torch.device(device)
    memset = _memset() if device.type == "cuda" and torch.version.cuda is not None and nbytes else None
    if memset is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):  # the driver writes in the current context: the buffer's device's
        rc = memset(buf.data_ptr(), 0, nbytes, torch.cuda.current_stream(device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"cuMemsetD8Async of {nbytes} bytes on {device} failed with CUDA error {rc}")
    return buf
