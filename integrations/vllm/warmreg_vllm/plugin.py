"""The ``vllm.general_plugins`` entry point: with ``WARMREG_WARM=1``, warm in every vLLM worker.

vLLM calls :func:`register` in each of its processes (``vllm.plugins.load_general_plugins``: the API server, the
engine core, ``WorkerWrapperBase.init_worker`` before it builds the worker). A general plugin gets no config and
runs before the model exists, so it installs wrappers on ``vllm.v1.worker.gpu_worker.Worker``:

- ``load_model``: :func:`warmreg.api.startup.prefetch` first, so Triton's hash of itself, the plugins' import and the
  pack's install run while vLLM loads the weights;
- ``compile_or_warm_up_model``: :func:`install_pack` (a ``WARMREG_PACK`` of vLLM's own kernels), then
  :func:`warmreg.api.startup.warm_once` with the worker's ``vllm_config``. vLLM runs it once the KV cache is
  allocated and the hybrid block size is final (``Platform.update_block_size_for_backend`` runs after
  ``load_model``), and it holds vLLM's own ``kernel_warmup`` (whose ``JitWarmupRegistry.warmup`` then finds the
  pack's binaries in Triton's cache) and ``capture_model``: the pack and warm come before both, and the JIT monitor
  (``WARMREG_MONITOR``) is armed after them, so vLLM's own warmup compiling its kernels is not a miss.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

import warmreg
from warmreg.api import startup

__all__ = ["install", "install_pack", "register"]

log = logging.getLogger("warmreg_vllm")
F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__warmreg_wrapped__"
_lock = threading.Lock()
_installed: dict[int, str] = {}  # pid -> the vLLM pack this process installed (a forked child installs again)


def register() -> None:
    """The entry point: reads the settings (a bad ``WARMREG_*`` value stops vLLM with a message naming it) and,
    if they warm, wraps the GPU worker."""
    settings = startup.StartupSettings.from_env()
    if not settings.enabled:
        return
    from vllm.v1.worker.gpu_worker import Worker

    install(Worker, settings)


def install(worker_class: type, settings: startup.StartupSettings | None = None) -> None:
    """Wrap ``worker_class``'s ``load_model`` and ``compile_or_warm_up_model`` (once: a second call does nothing)."""
    for name, wrap in (("load_model", _before_load), ("compile_or_warm_up_model", _around_warmup)):
        method = worker_class.__dict__.get(name) or getattr(worker_class, name)
        if not getattr(method, _MARK, False):
            wrapped = wrap(method, settings)
            setattr(wrapped, _MARK, True)
            setattr(worker_class, name, wrapped)


def _before_load(method: F, settings: startup.StartupSettings | None) -> F:
    @functools.wraps(method)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        startup.prefetch(settings)
        return method(self, *args, **kwargs)

    return load_model  # type: ignore[return-value]


def install_pack(settings: startup.StartupSettings | None = None) -> startup.StartupSettings:
    """Install ``WARMREG_PACK`` into Triton's cache now if it is a pack of vLLM's own kernels (``warmreg-vllm build``),
    once per process, and return the settings warm is to get: those without that pack (no warmreg plan holds vLLM's
    kernels). Its prefetch (``load_model``) is waited for, not repeated. Any other pack is left to warm.

    The pack must fit this GPU's target (any target on a machine without a GPU): its entries then sit under the
    cache keys vLLM's own ``compile(key)`` computes. Entries refused (a vLLM whose kernel sources differ from the
    build's) are logged; vLLM's warmup compiles those keys as without a pack.

    :raises PackError: if the pack cannot be read or does not fit this machine (Triton, ptxas, target).
    """
    settings = startup.StartupSettings.from_env() if settings is None else settings
    if not settings.enabled or settings.pack is None:
        return settings
    with _lock:
        if _installed.get(os.getpid()) == settings.pack:
            return attrs.evolve(settings, pack=None)
        report = warmreg.install_engine_pack(settings.pack, engine="vllm", target=warmreg.runtime_platform())
        if report is None:
            return settings
        _installed[os.getpid()] = settings.pack
    log.info(
        "warmreg (vLLM): pack %s of vLLM's kernels: %d entries installed, %d already present, %d refused%s",
        settings.pack, report.installed, report.present, len(report.refused), " (prefetched)" if report.prefetched else "",
    )  # fmt: skip
    if report.refused:
        log.warning("warmreg (vLLM): first refused entry of %s: %s: %s", settings.pack, *report.refused[0])
    return attrs.evolve(settings, pack=None)


def _around_warmup(method: F, settings: startup.StartupSettings | None) -> F:
    @functools.wraps(method)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        startup.warm_once(self.vllm_config, install_pack(settings), engine="vLLM")
        result = method(self, *args, **kwargs)
        startup.arm_monitor(settings)
        return result

    return compile_or_warm_up_model  # type: ignore[return-value]
