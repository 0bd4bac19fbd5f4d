"""Triton's launcher object made at its first use (``warmreg/_triton/deferred.py``).

On the CPU against a stand-in launcher class and kernel (the way ``CompiledKernel._init_handles`` builds and keeps
it); on the GPU against Triton's own, after a warm: keys with a C entry keep theirs unbuilt, a launch through
Triton's path builds it once and puts it in the kernel's place.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

from warmreg._triton.deferred import DeferredLauncher, deferring, launcher_now


class _Launcher:
    made: ClassVar[list[tuple[Any, Any]]] = []

    def __init__(self, src: Any, metadata: Any) -> None:
        _Launcher.made.append((src, metadata))
        self.src, self.launch_pdl = src, False

    def __call__(self, *args: Any) -> tuple[str, tuple[Any, ...]]:
        return ("launched", args)


class _Kernel:
    """Loads as ``CompiledKernel._init_handles`` does: ``self._run = launcher_cls(src, metadata)``."""

    def __init__(self, src: str = "src") -> None:
        self.src, self._run = src, None

    def _init_handles(self) -> None:
        self._run = _Launcher(self.src, "metadata")

    @property
    def run(self) -> Any:
        return self._run


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _Launcher.made.clear()


def test_a_load_inside_the_block_defers_the_launcher_until_its_first_call() -> None:
    kernel = _Kernel()
    with deferring(kernel, _Launcher):
        kernel._init_handles()
    assert isinstance(kernel._run, DeferredLauncher) and _Launcher.made == []
    assert kernel.run(1, 2) == ("launched", (1, 2))
    assert _Launcher.made == [("src", "metadata")]
    assert type(kernel._run) is _Launcher  # Triton's own object in the kernel's place from now on
    assert kernel.run(3) == ("launched", (3,)) and len(_Launcher.made) == 1


def test_reading_an_attribute_or_launcher_now_builds_it_once() -> None:
    kernel, other = _Kernel("a"), _Kernel("b")
    with deferring(kernel, _Launcher):
        kernel._init_handles()
    with deferring(other, _Launcher):
        other._init_handles()
    assert kernel.run.launch_pdl is False and type(kernel._run) is _Launcher
    assert type(launcher_now(other)) is _Launcher and other._run is launcher_now(other)
    assert _Launcher.made == [("a", "metadata"), ("b", "metadata")]


def test_outside_the_block_and_on_other_threads_launchers_are_built_as_before() -> None:
    kernel = _Kernel()
    kernel._init_handles()
    assert type(kernel._run) is _Launcher and launcher_now(kernel) is kernel._run
    built: list[Any] = []
    inside = _Kernel("inside")
    with deferring(inside, _Launcher):
        thread = threading.Thread(target=lambda: built.append(_Launcher("thread", "metadata")))
        thread.start()
        thread.join()
        inside._init_handles()
    assert type(built[0]) is _Launcher and isinstance(inside._run, DeferredLauncher)


def test_a_class_with_its_own_new_is_left_alone() -> None:
    class Own(_Launcher):
        def __new__(cls, *args: Any) -> Own:
            return super().__new__(cls)

    class Kernel(_Kernel):
        def _init_handles(self) -> None:
            self._run = Own(self.src, "metadata")

    kernel = Kernel()
    with deferring(kernel, Own):
        kernel._init_handles()
    assert type(kernel._run) is Own and Own.__new__ is not _Launcher.__new__


def test_tritons_load_makes_its_launcher_as_the_deferral_expects() -> None:
    """What ``warmreg._triton.deferred`` relies on in the installed Triton (checked on every supported release in CI):
    ``CompiledKernel._init_handles`` makes the launcher object as ``driver.active.launcher_cls(self.src,
    self.metadata)`` into ``self._run``, which ``run`` returns (building it where it is ``None``); the CUDA launcher
    class has no ``__new__`` of its own; a CompiledKernel keeps a ``__dict__`` and takes weak references."""
    import inspect

    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler.compiler import CompiledKernel

    from warmreg._triton import deferred

    assert "self._run = driver.active.launcher_cls(self.src, self.metadata)" in inspect.getsource(CompiledKernel._init_handles)
    run = inspect.getsource(CompiledKernel.run.fget)
    assert "self._init_handles()" in run and "return self._run" in run
    assert CudaLauncher.__new__ in (object.__new__, deferred._new)
    assert "__slots__" not in CompiledKernel.__dict__ and "__weakref__" in CompiledKernel.__dict__


@pytest.mark.gpu
def test_gpu_warm_leaves_tritons_launcher_unbuilt_until_a_launch_takes_its_path() -> None:
    """After a warm from the caches every key with a C entry keeps Triton's launcher unbuilt; Triton's own launch
    of it builds it once, puts it in the kernel's place, and computes what the C entry computed. (The first warm
    compiles; on Triton 3.6 its loads build each key's C launcher into the cache, which a launcher object defers
    only once it is there.)"""
    import warmreg
    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.runtime.launch import FAST_TABLES

    warmreg.reset_state()
    assert warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False).ok
    warmreg.reset_state()
    report = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False)
    entries = dict(FAST_TABLES[Scale.name])
    assert report.ok and len(entries) == report.declared == 3
    assert all(e.native is not None and isinstance(e.compiled.__dict__["_run"], DeferredLauncher) for e in entries.values())
    kernel, x = Scale(), torch.randn(17, device="cuda", dtype=torch.float16)
    fast = kernel(x, 2.0)
    compiled = entries[kernel.dispatch(x=x, block=64)].compiled
    assert isinstance(compiled.__dict__["_run"], DeferredLauncher)  # the C entry launched it
    FAST_TABLES[Scale.name].clear()  # the next launch takes Triton's path: JITFunction.run, then its launcher
    slow = kernel(x, 2.0)
    run = compiled.__dict__["_run"]
    assert not isinstance(run, DeferredLauncher) and launcher_now(compiled) is run
    assert torch.equal(fast, slow) and torch.equal(slow, x * 2)
