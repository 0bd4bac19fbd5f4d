"""The prefetch's binders for the local GPUs: the target read without starting CUDA (NVML), Triton's binder of
every plugin function made for it on the prefetch thread, and none made once a warm has started binding."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch
from triton.backends.compiler import GPUTarget

from warmreg import _triton
from warmreg._triton import compiler as _compiler
from warmreg.api import prefetch as _prefetch
from warmreg.support import nvml

SM90, SM100 = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 100, 32)


class _FakeNvml:
    """``libnvidia-ml.so.1`` as ctypes sees it: each device's compute capability, and what was called."""

    def __init__(self, caps: list[tuple[int, int]], init: int = 0) -> None:
        self.caps, self.init, self.calls = caps, init, []

    def nvmlInit_v2(self) -> int:
        self.calls.append("init")
        return self.init

    def nvmlShutdown(self) -> int:
        self.calls.append("shutdown")
        return 0

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.caps)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, handle: Any) -> int:
        handle._obj.value = 1000 + index
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        if handle.value == 1002:
            return 999  # NVML_ERROR_UNKNOWN for the third device: left out
        major._obj.value, minor._obj.value = self.caps[handle.value - 1000]
        return 0


def test_nvml_gives_each_gpus_capability_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = _FakeNvml([(9, 0), (9, 0), (7, 5), (10, 0)])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake if name == "libnvidia-ml.so.1" else pytest.fail(name))
    assert nvml.capabilities() == {(9, 0), (10, 0)}  # the failing third device left out
    assert fake.calls == ["init", "shutdown"]
    failing = _FakeNvml([(9, 0)], init=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setattr(ctypes, "CDLL", lambda name: failing)
    assert nvml.capabilities() == set() and failing.calls == ["init"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for this process: NVML is not asked
    monkeypatch.setattr(ctypes, "CDLL", lambda name: pytest.fail("NVML opened"))
    assert nvml.capabilities() == set()


def test_no_nvml_library_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def missing(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert nvml.capabilities() == set()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine: torch has not started CUDA")
def test_local_targets_come_from_nvml_before_cuda_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "capabilities", lambda: {(10, 0), (9, 0)})
    assert _triton.local_targets() == [SM90, SM100]
    assert not torch.cuda.is_initialized()
    monkeypatch.setattr(nvml, "capabilities", set)
    assert _triton.local_targets() == []


def test_the_prefetch_makes_every_plugin_functions_binder_until_a_warm_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_import_plugins`` (the prefetch thread's work) makes the binder of each installed plugin function for each
    local target; once binding has started in the process (the first ``bind_launch``), it makes no more."""
    from triton.runtime import jit as triton_jit

    from warmreg.stages.pack import loaded_jits

    jits = list(loaded_jits().values())
    assert len(jits) > 20  # both plugins' kernels
    monkeypatch.setattr(_triton, "local_targets", lambda: [SM90])
    monkeypatch.setattr(_compiler, "_binding", type(_compiler._binding)())  # no warm has bound yet
    try:
        _prefetch._import_plugins()
        made = {jit for (jit, target) in _compiler._binders if target == SM90}
        assert made >= set(jits)
        for jit in jits:
            _compiler._binders.pop((jit, SM90))
        real, calls = triton_jit.create_function_from_signature, []

        def binding_starts_after_three(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 3:
                _compiler._binding.set()  # as bind_launch does when a warm binds its first key
            return real(*args)

        monkeypatch.setattr(triton_jit, "create_function_from_signature", binding_starts_after_three)
        _prefetch._import_plugins()
        assert len(calls) == 3 and len([k for k in _compiler._binders if k[1] == SM90 and k[0] in set(jits)]) == 3
    finally:
        for jit in jits:
            _compiler._binders.pop((jit, SM90), None)


def test_binding_marks_that_a_warm_has_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import _scale_kernel
    from warmreg.values.platform import Platform

    monkeypatch.setattr(_compiler, "_binding", type(_compiler._binding)())
    with _triton.cross_target(Platform.parse("cuda:90")):
        x = torch.empty(64, dtype=torch.float16, device="meta")
        _triton.specialize(_scale_kernel, {"x_ptr": x, "out_ptr": x, "n": 19, "scale": 1.0, "BLOCK": 64}, {"num_warps": 2})
    assert _compiler._binding.is_set()
