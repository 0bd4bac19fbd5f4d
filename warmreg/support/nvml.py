"""The compute capabilities of this host's NVIDIA GPUs, read without starting CUDA in this process.

NVML (``libnvidia-ml.so.1``, the driver's management library, which ``nvidia-smi`` uses) answers without a CUDA
context, so a process that forks later (an engine's workers, a warm's compile children) can still use CUDA in
its children. vLLM asks NVML the same question before CUDA starts (``vllm/platforms/cuda.py``,
``NvmlCudaPlatform``); torch opens the library through ctypes the same way (``torch.cuda._raw_device_count_nvml``).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["capabilities"]


def capabilities() -> set[tuple[int, int]]:
    """``(major, minor)`` of every GPU NVML lists (all of them: ``CUDA_VISIBLE_DEVICES`` only narrows the
    answer to none when it is set empty); empty where NVML cannot be opened or answers with an error."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return set()
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return set()
    if nvml.nvmlInit_v2() != 0:
        return set()
    try:
        count, found = ctypes.c_uint(0), set()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return set()
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0 and (
                nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
            ):
                found.add((major.value, minor.value))
        return found
    finally:
        nvml.nvmlShutdown()
