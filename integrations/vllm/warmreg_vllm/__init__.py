"""warmreg inside vLLM (0.33, 0.34): every Triton key of the deployment warmed in each worker at start-up.

Two doors, both vLLM's own (the settings are :mod:`warmreg.api.startup`'s ``WARMREG_*`` variables):

- the ``vllm.general_plugins`` entry point :func:`warmreg_vllm.plugin.register`, which vLLM calls in every
  process; with ``WARMREG_WARM=1`` it wraps ``vllm.v1.worker.gpu_worker.Worker``'s ``load_model`` (a prefetch,
  so the pack installs while the weights load) and ``compile_or_warm_up_model`` (the warm before vLLM's own
  warmup and graph capture, the monitor armed after them);
- ``--worker-cls warmreg_vllm.worker.WarmregWorker``, a ``Worker`` subclass doing the same for one deployment.
"""

from __future__ import annotations

__all__: list[str] = []
