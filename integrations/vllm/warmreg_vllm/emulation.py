"""vLLM on a machine without a GPU, behaving for JIT-warmup registration and key computation as on a recorded GPU.

:func:`emulate_gpu` patches the fewest names that make vLLM (0.33.0, 0.34.0) answer as on the GPU of a
:class:`~warmreg_vllm.profile.GpuProfile`, and undoes each on exit. Each patch, and the vLLM file it targets:

1. **Triton stays on** (``vllm/triton_utils/importing.py``): vLLM decides ``HAS_TRITON`` once, at import, and turns
   every ``@triton.jit`` into a placeholder unless one non-CPU Triton driver is active, or ``CUDA_VISIBLE_DEVICES``
   is set and empty (its distributed-start case). If vLLM is not imported yet, ``CUDA_VISIBLE_DEVICES`` is set
   empty for the block; if it was imported with Triton off, :class:`EmulationError` says to set it first.
2. **``current_platform`` is a CUDA platform answering from the profile** (``vllm/platforms/__init__.py``,
   ``vllm/platforms/cuda.py``): every module binds the one ``current_platform`` object at import, so its class is
   swapped for a subclass of vLLM's own ``CudaPlatformBase`` whose device reads return the profile's values
   (capability, SM count, name, memory, PDL, FP8 dtype, CUDA version, device count). ``is_cuda()`` and
   ``is_cuda_alike()`` are then true, and a config built in the block takes the GPU's path
   (``CudaPlatformBase.check_and_update_config``: the GPU worker, chunked prefill, the batch defaults of the GPU,
   Model Runner V2). ``vllm/platforms/cuda.py`` imports vLLM's CUDA extension ``vllm._C_stable_libtorch``, which
   needs ``libcuda.so.1``; a stand-in module takes its place in ``sys.modules`` while that one module is imported.
3. **A module whose CUDA import branch loads a CUDA extension it cannot do without is imported first, under the CPU
   platform**: ``vllm/model_executor/layers/quantization/online/base.py``
   (``torch.ops._C.cutlass_scaled_mm_supports_fp8``). Its module-level choices are the CPU's; it holds no JIT-warmup
   registration. A model package that picks its implementation at import
   (``vllm/models/deepseek_v4/__init__.py``: ``nvidia/`` or ``cpu/``) must be imported
   inside the block: one already imported under the CPU platform is refused with :class:`EmulationError`.
4. **vLLM's own CUDA extensions answer as present where only their import is tested**: vLLM's wheel ships them, so
   on the GPU they load; here they need ``libcuda``. Each module of :data:`EXTENSION_PROBES` records at import
   whether its extensions import, and is imported in the block with a stand-in module for each in ``sys.modules``,
   removed right after: ``vllm/v1/attention/ops/flashmla.py`` (``vllm._flashmla_C``, ``vllm._flashmla_extension_C``:
   the FlashMLA backends' validity, Kimi-K3's MLA) and ``vllm/vllm_flash_attn/__init__.py``, whose
   ``flash_attn_interface`` tries ``_vllm_fa2_C`` and ``_vllm_fa3_C`` and whose ``__init__`` raises when neither
   loads (the FlashAttention MLA prefill backend's validity; the DeepSeek-V4 CuTeDSL indexer-Q kernel imports
   ``vllm.vllm_flash_attn.cute.utils``). Nothing in them is called here. Then ``vllm/v1/attention/backends/
   fa_utils.py``, which the CPU-platform imports of point 3 bring in with its CPU branch, is executed again
   (``importlib.reload``) to take its CUDA branch, which imports ``vllm.vllm_flash_attn``'s functions.
5. **torch's device queries answer from the profile**: ``torch.cuda.get_device_properties`` (name, capability,
   SM count, memory) and ``torch.cuda.get_device_capability``, which some keys read directly
   (``model_executor/kernels/mhc/tilelang_kernels.py``: the mHC split count from the SM count).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, cast

import torch

from warmreg import WarmregError

from .profile import GpuProfile

__all__ = ["CUDA_IMPORT_BRANCHES", "CUDA_RELOADS", "EXTENSION_PROBES", "EmulationError", "emulate_gpu"]

#: vLLM modules imported under the CPU platform before the swap: their CUDA branch imports a CUDA extension that
#: cannot load without a driver (see the module docstring, point 3).
CUDA_IMPORT_BRANCHES = ("vllm.model_executor.layers.quantization.online.base",)
#: vLLM modules imported under the CPU platform by point 3 and executed again in the block (end of point 4).
CUDA_RELOADS = ("vllm.v1.attention.backends.fa_utils",)
_CUDA_EXTENSION = "vllm._C_stable_libtorch"
#: module -> the vLLM CUDA extensions whose import it tests (point 4).
EXTENSION_PROBES = {
    "vllm.v1.attention.ops.flashmla": ("vllm._flashmla_C", "vllm._flashmla_extension_C"),
    "vllm.vllm_flash_attn": ("vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C"),
}


class EmulationError(WarmregError, RuntimeError):
    """vLLM cannot be made to behave as on the profiled GPU in this process."""


def _check_triton() -> tuple[bool, str | None]:
    """Keep vLLM's Triton on; returns whether ``CUDA_VISIBLE_DEVICES`` was set here, and its value before."""
    if "vllm.triton_utils.importing" in sys.modules:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise EmulationError(
                "vLLM was imported with Triton off (vllm/triton_utils/importing.py found no active GPU driver)",
                fix="set CUDA_VISIBLE_DEVICES= (empty) before vLLM is imported",
            )
        return False, None
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True, previous


def _cuda_platform_base() -> type[Any]:
    """vLLM's ``CudaPlatformBase``, imported with a stand-in for the CUDA extension ``vllm/platforms/cuda.py`` loads."""
    if "vllm.platforms.cuda" in sys.modules:
        return sys.modules["vllm.platforms.cuda"].CudaPlatformBase  # type: ignore[no-any-return]
    present = _CUDA_EXTENSION in sys.modules
    if not present:
        sys.modules[_CUDA_EXTENSION] = types.ModuleType(_CUDA_EXTENSION)
    try:
        module = importlib.import_module("vllm.platforms.cuda")
    finally:
        if not present:
            sys.modules.pop(_CUDA_EXTENSION, None)
    return module.CudaPlatformBase  # type: ignore[no-any-return]


def profiled_platform_class(profile: GpuProfile) -> type[Any]:
    """A subclass of vLLM's ``CudaPlatformBase`` whose device reads answer from ``profile``."""
    from vllm.platforms.interface import DeviceCapability

    base = _cuda_platform_base()
    fp8 = getattr(torch, profile.fp8_dtype)
    major, minor = profile.capability
    answers = {
        "get_device_capability": lambda cls, device_id=0: DeviceCapability(major, minor),
        "get_device_name": lambda cls, device_id=0: profile.name,
        "get_device_total_memory": lambda cls, device_id=0: profile.total_memory,
        "num_compute_units": lambda cls, device_id=0: profile.num_compute_units,
        "is_arch_support_pdl": lambda cls: profile.supports_pdl,
        "is_fp8_fnuz": lambda cls: profile.fp8_dtype == "float8_e4m3fnuz",
        "fp8_dtype": lambda cls: fp8,
        "get_cuda_runtime_major": lambda cls: int(profile.cuda_version.split(".")[0]),
        "device_count": lambda cls: profile.device_count,
        "is_fully_connected": lambda cls, device_ids: True,
        "is_integrated_gpu": lambda cls, device_id=0: False,
        "current_device": lambda cls: 0,
        # One process stands for every rank: no NCCL communicator (vllm/distributed/parallel_state.py builds one
        # for each group of more than one rank from this answer).
        "get_device_communicator_cls": lambda cls: (
            "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"
        ),
    }
    namespace: dict[str, Any] = {name: classmethod(cast(Any, fn)) for name, fn in answers.items()}
    namespace["profile"] = profile
    namespace["__doc__"] = (
        f"vLLM's CUDA platform answering from the GPU profile of {profile.name} ({profile.provenance})."
    )
    return type(f"Profiled{base.__name__}", (base,), namespace)


def _refuse_cpu_model_packages() -> None:
    cpu = sorted(m for m in sys.modules if m.startswith("vllm.models.") and m.endswith(".cpu"))
    if cpu:
        raise EmulationError(
            f"{', '.join(cpu)} were imported under the CPU platform, so their packages chose the CPU implementation",
            fix="enter emulate_gpu before vLLM builds a config or imports the model (one emulated GPU per process)",
        )


def _import_with_extensions(module: str, extensions: tuple[str, ...]) -> None:
    """Import ``module`` with a stand-in for each absent extension in ``extensions`` (point 4); one imported
    before (under the CPU platform) is left as it is."""
    if module in sys.modules:
        return
    absent = [name for name in extensions if name not in sys.modules]
    for name in absent:
        sys.modules[name] = types.ModuleType(name)
    try:
        importlib.import_module(module)
    finally:
        for name in absent:
            sys.modules.pop(name, None)


@contextlib.contextmanager
def _profiled_torch_cuda(profile: GpuProfile) -> Iterator[None]:
    """``torch.cuda``'s device queries answering from ``profile`` (point 5)."""
    major, minor = profile.capability
    properties = types.SimpleNamespace(
        name=profile.name, major=major, minor=minor, multi_processor_count=profile.num_compute_units,
        total_memory=profile.total_memory, warp_size=profile.triton_target.warp_size,
    )  # fmt: skip
    saved = torch.cuda.get_device_properties, torch.cuda.get_device_capability
    torch.cuda.get_device_properties = lambda device=None: properties  # type: ignore[assignment, return-value]
    torch.cuda.get_device_capability = lambda device=None: (major, minor)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.cuda.get_device_capability = saved  # type: ignore[assignment]


@contextlib.contextmanager
def emulate_gpu(profile: GpuProfile) -> Iterator[Any]:
    """Make vLLM, on this machine, register kernels and compute their keys as on ``profile``'s GPU.

    Build the ``VllmConfig`` inside the block (its platform rewrites are the GPU's). Yields the profiled
    ``current_platform``. Every patch is undone on exit, though modules imported inside stay imported.

    :raises EmulationError: if vLLM was imported with Triton off, or a model package already chose its CPU
        implementation.
    """
    changed, visible = _check_triton()
    try:
        from vllm import platforms

        current = platforms.current_platform
        for name in CUDA_IMPORT_BRANCHES:
            importlib.import_module(name)
        _refuse_cpu_model_packages()
        cls = profiled_platform_class(profile)
        previous = type(current)
        current.__class__ = cls
        try:
            for module, extensions in EXTENSION_PROBES.items():
                _import_with_extensions(module, extensions)
            for module in CUDA_RELOADS:
                if module in sys.modules:
                    importlib.reload(sys.modules[module])
            with _profiled_torch_cuda(profile):
                yield current
        finally:
            current.__class__ = previous
    finally:
        if changed and visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        elif changed and visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
