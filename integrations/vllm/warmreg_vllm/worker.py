"""``--worker-cls warmreg_vllm.worker.WarmregWorker``: vLLM's GPU worker that warms with warmreg.

The per-deployment door (``ParallelConfig.worker_cls``, resolved in ``WorkerWrapperBase.init_worker``): the same
prefetch, pack of vLLM's kernels, warm and monitor as the general plugin (:mod:`warmreg_vllm.plugin`), here whatever ``WARMREG_WARM`` says
(the flag is the opt-in); the other ``WARMREG_*`` settings apply. With both doors open a process still warms once.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from warmreg.api import startup

from .plugin import install_pack

__all__ = ["WarmregWorker"]


def _settings() -> startup.StartupSettings:
    return startup.StartupSettings.from_env({**os.environ, "WARMREG_WARM": "1"})


class WarmregWorker(Worker):  # type: ignore[misc]
    """vLLM's ``Worker``, warming every Triton key of the deployment before vLLM's own warmup and capture."""

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        startup.prefetch(_settings())
        return super().load_model(*args, **kwargs)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        settings = _settings()
        startup.warm_once(self.vllm_config, install_pack(settings), engine="vLLM")
        result = super().compile_or_warm_up_model(*args, **kwargs)
        startup.arm_monitor(settings)
        return result
