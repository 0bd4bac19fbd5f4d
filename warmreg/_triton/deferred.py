"""Triton's launcher object of a kernel warm loads, made at its first use instead of at the load.

Part of the Triton adapter (checked against Triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0). ``CompiledKernel._init_handles``
loads a kernel's module and also builds ``driver.active.launcher_cls(src, metadata)``, the object its Python
launch path calls (``CompiledKernel.run``): on 3.6 that generates the kernel's C launcher source and loads its
module (6.3 ms of a Flash warm from the disk cache on an H100 host: 75 keys, 23 launchers), on 3.7+ it prepares
the argument annotations. warmreg's C launch never calls it. :func:`deferring` makes the loads of one thread
give the kernel a :class:`DeferredLauncher` instead, which builds the real launcher the first time anything
calls it or reads from it, then puts it in the kernel's place (``CompiledKernel._run``), so later launches meet
Triton's own object. :func:`launcher_now` builds it at once: warm does for every key that will launch through
Triton's launcher (no C entry), so no first launch builds it.

The launcher class keeps its identity: ``CudaLauncher.__new__`` answers the deferred object only inside
:func:`deferring` on the calling thread (where ``__init__`` then does not run), else a launcher as before.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["DeferredLauncher", "deferring", "launcher_now"]

_local = threading.local()
_patched: set[type] = set()
_lock = threading.Lock()


class DeferredLauncher:
    """What ``launcher_cls(src, metadata)`` returned inside :func:`deferring`: the launcher, built at first use."""

    __slots__ = ("_cls", "_launcher", "_metadata", "_src", "kernel")

    def __init__(self, cls: type, src: Any, metadata: Any) -> None:
        self._cls, self._src, self._metadata, self._launcher = cls, src, metadata, None
        self.kernel: Any = None  # weakref to the CompiledKernel whose _run this is (set by the load)

    def launcher(self) -> Any:
        """The real launcher (built now if not yet), put in the kernel's place."""
        launcher: Any = self._launcher
        if launcher is None:
            launcher = self._launcher = object.__new__(self._cls)
            launcher.__init__(self._src, self._metadata)
            kernel = self.kernel() if self.kernel is not None else None
            if kernel is not None and kernel.__dict__.get("_run") is self:
                kernel._run = launcher
        return launcher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.launcher()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.launcher(), name)


def _new(cls: type, *args: Any, **kwargs: Any) -> Any:
    if getattr(_local, "on", False) and len(args) == 2 and not kwargs:
        return DeferredLauncher(cls, *args)
    return object.__new__(cls)


@contextlib.contextmanager
def deferring(kernel: Any, launcher_cls: type) -> Iterator[None]:
    """While the block runs on this thread, ``launcher_cls(src, metadata)`` answers a :class:`DeferredLauncher`;
    on exit, one that ``kernel._run`` holds is bound to ``kernel``. A class with its own ``__new__`` (or not a
    class) is left alone."""
    if not isinstance(launcher_cls, type) or launcher_cls.__new__ not in (object.__new__, _new):
        yield
        return
    with _lock:
        if launcher_cls not in _patched:
            launcher_cls.__new__ = _new  # type: ignore[assignment]
            _patched.add(launcher_cls)
    _local.on = True
    try:
        yield
    finally:
        _local.on = False
    run = kernel.__dict__.get("_run")
    if isinstance(run, DeferredLauncher):
        run.kernel = weakref.ref(kernel)


def launcher_now(kernel: Any) -> Any:
    """The kernel's launcher, built now where it was deferred (``kernel.run`` otherwise)."""
    run = kernel.__dict__.get("_run")
    return run.launcher() if isinstance(run, DeferredLauncher) else kernel.run
