"""Zeroed device memory without a torch kernel (``warmreg/support/cuda_memory.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from warmreg.support.cuda_memory import _memset, zeros

ROOT = Path(__file__).resolve().parents[1]


def test_off_cuda_it_is_torch_zeros() -> None:
    for device in ("cpu", torch.device("cpu"), torch.device("meta")):
        out = zeros(7, device)
        assert out.dtype == torch.uint8 and out.shape == (7,) and out.device.type == torch.device(device).type
        if out.device.type == "cpu":
            assert torch.equal(out, torch.zeros(7, dtype=torch.uint8))
    assert zeros(0, "cpu").numel() == 0


def test_tuning_inputs_are_zeros_shaped_as_the_warmup_inputs() -> None:
    """The default ``tuning_inputs`` makes each meta tensor real with these zeros: same shape, strides and offset."""
    from tests.helpers import Scale

    kernel = Scale()
    key = kernel.dispatch(x=torch.empty(17, dtype=torch.float16)[1:], block=64)  # an unaligned view
    real = kernel.tuning_inputs(key, torch.device("cpu"))
    meta = kernel.warmup_inputs(key)["x"]
    x = real["x"]
    assert x.device.type == "cpu" and x.dtype == meta.dtype and x.shape == meta.shape and x.stride() == meta.stride()
    assert x.storage_offset() == meta.storage_offset() and not x.any()


@pytest.mark.gpu
def test_gpu_zeros_are_written_on_the_current_stream() -> None:
    """The driver's memset zeroes a reused (dirty) allocator block, ordered on the current stream after a write
    still running there."""
    assert _memset() is not None
    dev = torch.device("cuda", torch.cuda.current_device())
    for nbytes in (1, 4097, 3 << 20):
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # the fill below runs late: a memset on another stream would run first
            dirty = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=dev)
            del dirty  # its block goes back to the allocator (for this stream), to hold 0xAB
            out = zeros(nbytes, dev)
            total = int(out.sum())
        assert out.dtype == torch.uint8 and out.shape == (nbytes,) and out.device == dev and total == 0


class _TorchKernels(TorchDispatchMode):
    """The torch ops run under it that launch a kernel on a device: not an allocation, not a view."""

    ALLOCATIONS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        if not func.is_view and name not in self.ALLOCATIONS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "kimi_k3_full"])
def test_no_rehearsed_launch_code_of_an_example_runs_a_torch_kernel(example: str) -> None:
    """Rehearsal runs each key's launch code on its tuning inputs (``warmreg/stages/rehearsal.py``); a torch kernel
    there (a ``fill_``, a ``zero_``) is one launch more a call, and torch loads each of its kernels at its first use
    in a process: 7-13 ms of the Flash warm on an H100 host, when compressed slot mapping filled its output first."""
    import attrs

    import warmreg
    from warmreg.runtime.launch import capture

    plan = warmreg.plan(str(ROOT / "examples" / f"{example}.json"), target="cuda:90")
    ran = {}
    for kp in plan.kernels:
        for key in kp.keys:
            kernel = kp.kernel_for(key)
            if not getattr(kernel, "rehearse", True):
                continue
            key = attrs.evolve(key, config=None) if kernel.tune_configs else key
            inputs = kernel.tuning_inputs(key, torch.device("cpu"))
            with capture(), _TorchKernels() as mode:
                getattr(kernel, kernel.launcher)(**inputs)
            if mode.ops:
                ran[kp.name] = mode.ops
    assert ran == {}
