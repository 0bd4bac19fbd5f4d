"""The ``sglang.srt.plugins`` entry point: with ``WARMREG_WARM=1``, warm in every SGLang model runner.

SGLang calls :func:`register` in each of its processes (``sglang.srt.plugins.load_plugins``), then
``HookRegistry.apply_hooks()`` patches the registered targets (and their ``from X import Y`` bindings). Two hooks on
``sglang.srt.model_executor.model_runner.ModelRunner``:

- BEFORE ``load_model``: :func:`warmreg.api.startup.prefetch`, so Triton's hash of itself, the plugins' import and the
  pack's install run while the weights load;
- AROUND ``init_cuda_graphs``: :func:`warmreg.api.startup.warm_once` with the runner's ``server_args`` (the KV cache is
  allocated by then: ``Scheduler.init_memory_pools`` runs before ``init_all_cuda_graphs``), then SGLang's capture,
  then the JIT monitor armed (``WARMREG_MONITOR``). A draft model's runner (``is_draft_worker``) is skipped: the
  target's plan holds the speculative decoding kernels, and a process warms once.

SGLang logs and swallows an exception a plugin raises while loading, which would start the server unwarmed; a bad
``WARMREG_*`` value is therefore raised from the hook instead, where it stops the start-up.
"""

from __future__ import annotations

from typing import Any

from warmreg import ConfigError
from warmreg.api import startup

__all__ = ["RUNNER", "register"]

#: The model runner whose methods the hooks wrap.
RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def register() -> None:
    """The entry point: registers the two hooks if the settings warm (or carry an error to raise at start-up)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        settings: startup.StartupSettings | ConfigError = startup.StartupSettings.from_env()
    except ConfigError as exc:
        settings = exc
    if isinstance(settings, startup.StartupSettings) and not settings.enabled:
        return
    HookRegistry.register(f"{RUNNER}.load_model", _Prefetch(settings), HookType.BEFORE)
    HookRegistry.register(f"{RUNNER}.init_cuda_graphs", _WarmAroundCapture(settings), HookType.AROUND)


class _Hook:
    def __init__(self, settings: startup.StartupSettings | ConfigError) -> None:
        self.settings = settings

    def checked(self) -> startup.StartupSettings:
        if isinstance(self.settings, ConfigError):
            raise self.settings
        return self.settings


class _Prefetch(_Hook):
    def __call__(self, runner: Any, *args: Any, **kwargs: Any) -> None:
        startup.prefetch(self.checked())


class _WarmAroundCapture(_Hook):
    def __call__(self, original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        settings = self.checked()
        if getattr(runner, "is_draft_worker", False):
            return original(runner, *args, **kwargs)
        startup.warm_once(runner.server_args, settings, engine="SGLang")
        result = original(runner, *args, **kwargs)
        startup.arm_monitor(settings)
        return result
