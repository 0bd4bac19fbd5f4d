"""The ``vllm.general_plugins`` entry point: with ``WARMREG_WARM=1``, warm in every vLLM worker.

vLLM calls :func:`register` in each of its processes (``vllm.plugins.load_general_plugins``: the API server, the
engine core, ``WorkerWrapperBase.init_worker`` before it builds the worker). A general plugin gets no config and
runs before the model exists, so it installs wrappers on ``vllm.v1.worker.gpu_worker.Worker``:

- ``load_model``: :func:`warmreg.api.startup.prefetch` first, so Triton's hash of itself, the plugins' import and the
  pack's install run while vLLM loads the weights;
- ``compile_or_warm_up_model``: :func:`warmreg.api.startup.warm_once` with the worker's ``vllm_config`` first. vLLM runs
  it once the KV cache is allocated and the hybrid block size is final (``Platform.update_block_size_for_backend``
  runs after ``load_model``), and it holds vLLM's own ``kernel_warmup`` and ``capture_model``: warm comes before
  both, and the JIT monitor (``WARMREG_MONITOR``) is armed after them, so vLLM's own warmup compiling its kernels is
  not a miss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from warmreg.api import startup

__all__ = ["install", "register"]

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__warmreg_wrapped__"


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


def _around_warmup(method: F, settings: startup.StartupSettings | None) -> F:
    @functools.wraps(method)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        startup.warm_once(self.vllm_config, settings, engine="vLLM")
        result = method(self, *args, **kwargs)
        startup.arm_monitor(settings)
        return result

    return compile_or_warm_up_model  # type: ignore[return-value]
