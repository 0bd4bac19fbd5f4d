"""The GPU a compile is for: Triton's driver for the local device, or a stand-in for a named cross target.

Part of the Triton adapter (:mod:`warmreg._triton`); checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver as _driver

from ..values.errors import TargetError
from ..values.platform import Platform

if TYPE_CHECKING:
    import torch

__all__ = ["benchmark", "compile_worker", "cross_target", "current_device", "device_name", "gpu_target", "local_targets", "set_device", "torch_device"]

log = logging.getLogger("warmreg._triton")


# Triton keeps one binder and backend per device id (JITFunction.device_caches): every cross target
# needs its own id, or a second target reuses the first one's backend. Ids start far above real GPUs.
_device_ids: dict[str, int] = {}


_ids_lock = threading.Lock()


_cross_lock = threading.RLock()


def gpu_target(platform: Platform) -> GPUTarget:
    """Triton's ``GPUTarget`` for a platform (backend ``cuda``/``hip``, warp 32/64).

    :raises TargetError: for XPU, which the PyPI Triton wheel cannot compile for.
    """
    if platform.is_cuda:
        return GPUTarget("cuda", platform.sm, 32)
    if platform.is_rocm:
        return GPUTarget("hip", str(platform.arch), 64)
    raise TargetError(platform.target, "cannot be cross-compiled with this Triton", fix="warm on the XPU host itself")


def _device_id(platform: Platform) -> int:
    with _ids_lock:
        return _device_ids.setdefault(platform.target, 10_000 + len(_device_ids))


class _CrossTargetDriver(DriverBase):
    """A stand-in driver that reports a named target, so ``JITFunction.warmup`` compiles for it."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.target = gpu_target(platform)
        self.device = _device_id(platform)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        import torch

        return torch.device("meta")

    def get_benchmarker(self) -> Any:
        raise TargetError(self.platform.target, "cannot run benchmarks (cross target)", fix="autotune on the GPU host")

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def cross_target(platform: Platform) -> Iterator[None]:
    """Make Triton compile for ``platform`` while the block runs (a no-op for the local GPU).

    Triton's driver is process-global (``triton.runtime.driver.driver``), so cross-target blocks are
    serialized with a lock, and the previous driver is restored exactly on exit.
    """
    if platform.local:
        yield
        return
    with _cross_lock:
        previous = _driver._active  # DriverConfig keeps the active driver here
        _driver.set_active(_CrossTargetDriver(platform))
        try:
            yield
        finally:
            _driver._active = previous


def compile_worker(platform: Platform) -> None:
    """Make this process one that only compiles ``platform``'s kernels into Triton's disk cache: a
    child forked by a warm (:mod:`warmreg.stages.processes`), whose parent then loads each binary as a hit.

    Triton's driver becomes the stand-in for ``platform``'s target, so a compile here never touches
    the GPU (CUDA cannot be used in a child forked after it started), and the parent's pre-compile
    hook and compilation listener are removed (the parent's own compile of the cached binary calls
    them).
    """
    _driver.set_active(_CrossTargetDriver(attrs.evolve(platform, local=False)))
    triton.knobs.runtime.jit_cache_hook = None
    triton.knobs.compilation.listener = None


def current_device() -> int:
    """The device id Triton's ``JITFunction.run`` uses right now."""
    return int(_driver.active.get_current_device())


def local_targets() -> list[GPUTarget]:
    """The targets this host's GPUs compile for, without starting CUDA here: Triton's driver where torch has
    started it already, else each distinct compute capability NVML lists (:mod:`warmreg.support.nvml`);
    empty where neither answers (no GPU, a ROCm host before torch starts it)."""
    import torch

    if torch.cuda.is_initialized():
        return [_driver.active.get_current_target()]
    from ..support.nvml import capabilities

    return [GPUTarget("cuda", major * 10 + minor, 32) for major, minor in sorted(capabilities())]


def device_name() -> str:
    """The name of the current GPU (e.g. ``NVIDIA H200``)."""
    import torch

    return str(torch.cuda.get_device_name(current_device()))


def torch_device() -> torch.device:
    """The current GPU as a torch device."""
    import torch

    return torch.device(_driver.active.get_active_torch_device().type, current_device())


def benchmark(fn: Callable[[], Any], *, warmup_ms: float, rep_ms: float) -> float:
    """The median time of ``fn`` in milliseconds, by Triton's own ``do_bench`` (as its autotuner)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def set_device(device: int) -> None:
    """Make ``device`` current on this thread (Triton loads modules onto the current device)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(device)
