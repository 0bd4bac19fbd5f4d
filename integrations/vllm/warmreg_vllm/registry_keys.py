"""vLLM's own JIT-warmup registrations and compile keys for one deployment on a profiled GPU, computed here.

:func:`registered_kernels` runs vLLM's own code at each point where vLLM's Model Runner V2
(``vllm/v1/worker/gpu/model_runner.py``, the runner a GPU config picks in vLLM 0.33.0 and the only GPU runner of
0.34.0) activates its ``JitWarmupRegistry``, as rank 0 of the deployment on the meta device
(:func:`~warmreg_vllm.construction.meta_rank`) under :func:`~warmreg_vllm.emulation.emulate_gpu`, then expands
each registration with the kernel's own ``get_warmup_keys`` as ``JitWarmupRegistry.warmup`` does. Nothing is
hand-kept: which kernels register, with which arguments, is what vLLM's construction did.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import attrs

from warmreg import Platform, WarmregError

from .profile import GpuProfile

__all__ = ["KINDS", "POINTS", "RegisteredKernel", "RegistrationError", "Registrations", "kind_of", "registered_kernels"]

Kind = Literal["triton", "cutedsl", "tilelang", "autotuned", "live-gpu"]
#: How a kernel compiles: a Triton pack can hold only ``triton`` keys (see :func:`kind_of`).
KINDS: tuple[Kind, ...] = ("triton", "cutedsl", "tilelang", "autotuned", "live-gpu")
#: The runner's registration points, in the order the runner reaches them (see :func:`registered_kernels`).
POINTS = ("model", "sampler", "attention-backends", "kv-cache")


def _tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


def _frozenset(values: Iterable[str]) -> frozenset[str]:
    return frozenset(values)


@attrs.frozen(kw_only=True, order=True)
class RegisteredKernel:
    """One kernel vLLM's registry would warm for the deployment, with its compile keys.

    :param name: the kernel object's class name (``FusedQKVRMSNormKernel``).
    :param qualname: ``module.QualName`` of that class.
    :param kind: one of :data:`KINDS`.
    :param keys: ``repr`` of each compile key ``get_warmup_keys`` returned, sorted; empty for ``live-gpu``.
    :param points: the registration points (:data:`POINTS`) at which it registered.
    :param reason: why its keys could not be computed here (``live-gpu`` only).
    :param vllm_keys: the key objects themselves, in ``keys``' order (not compared).
    :param kernel: vLLM's kernel object (not compared).
    """

    name: str
    qualname: str
    kind: Kind = attrs.field(validator=attrs.validators.in_(KINDS))
    keys: tuple[str, ...] = attrs.field(converter=_tuple)
    points: frozenset[str] = attrs.field(converter=_frozenset)
    reason: str | None = None
    vllm_keys: tuple[Any, ...] = attrs.field(converter=_tuple, eq=False, order=False, repr=False, default=())
    kernel: Any = attrs.field(eq=False, order=False, repr=False, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (the points sorted; ``vllm_keys`` and ``kernel`` left out)."""
        return {
            "name": self.name, "qualname": self.qualname, "kind": self.kind, "keys": list(self.keys),
            "points": sorted(self.points), "reason": self.reason,
        }  # fmt: skip


class RegistrationError(WarmregError, RuntimeError):
    """vLLM's registrations for the deployment cannot be computed in this process."""


def kind_of(kernel: Any) -> Kind:
    """How vLLM compiles ``kernel`` (vLLM 0.33.0, 0.34.0, ``vllm/model_executor/warmup/``).

    ``cutedsl`` and ``tilelang``: a ``VllmCuTeDSLJitKernel`` / ``VllmTileLangJitKernel``, whose binaries are not in
    Triton's cache. ``autotuned``: a ``VllmTritonJitKernel`` with ``_run_autotune``, whose warmup launches the kernel
    (``kernel[grid]``) to benchmark its configs. ``triton``: any other ``VllmTritonJitKernel``, compiled by
    ``JITFunction.warmup`` without a launch. ``live-gpu``: any other kernel type.
    """
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import VllmCuTeDSLJitKernel
    from vllm.model_executor.warmup.jit_warmup_tilelang_helper import VllmTileLangJitKernel
    from vllm.model_executor.warmup.jit_warmup_triton_helper import VllmTritonJitKernel

    if isinstance(kernel, VllmCuTeDSLJitKernel):
        return "cutedsl"
    if isinstance(kernel, VllmTileLangJitKernel):
        return "tilelang"
    if isinstance(kernel, VllmTritonJitKernel):
        return "autotuned" if kernel._run_autotune else "triton"
    return "live-gpu"


@attrs.frozen(kw_only=True)
class Registrations:
    """What :func:`registered_kernels` found, with timings.

    :param kernels: one :class:`RegisteredKernel` per kernel object, sorted by name.
    :param seconds: wall seconds per phase (``config``, each of :data:`POINTS`, ``keys``).
    :param registries: vLLM's ``JitWarmupRegistry`` of each point of :data:`POINTS` (not compared): inside
        :func:`~warmreg_vllm.vllm_pack.deployment`, their ``warmup()`` is vLLM's own ``kernel_warmup`` step.
    """

    kernels: tuple[RegisteredKernel, ...] = attrs.field(converter=_tuple)
    seconds: dict[str, float] = attrs.field(eq=False)
    registries: dict[str, Any] = attrs.field(eq=False, factory=dict, repr=False)

    def keys_per_kind(self) -> dict[str, int]:
        """Compile keys per kind (every kind of :data:`KINDS`, zero where none)."""
        return {kind: sum(len(k.keys) for k in self.kernels if k.kind == kind) for kind in KINDS}

    def kernels_per_kind(self) -> dict[str, int]:
        """Kernels per kind (every kind of :data:`KINDS`)."""
        return {kind: sum(1 for k in self.kernels if k.kind == kind) for kind in KINDS}


def _vllm_config(config: Any) -> Any:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    if isinstance(config, EngineArgs):
        return config.create_engine_config()
    if not isinstance(config, VllmConfig):
        raise RegistrationError(
            f"config must be vLLM's EngineArgs or VllmConfig (got {type(config).__name__})",
            fix="pass EngineArgs(model=..., tensor_parallel_size=..., ...) as `vllm serve` takes them",
        )
    if config.device_config.device_type != "cuda":
        raise RegistrationError(
            f"the VllmConfig was built for {config.device_config.device_type!r}, not the GPU",
            fix="build it inside emulate_gpu(profile), or pass EngineArgs",
        )
    return config


def _check_runner(vllm_config: Any) -> None:
    # vLLM 0.33 has both runners and a property saying which one a config picks; 0.34 has Model Runner V2 only.
    if not getattr(vllm_config, "use_v2_model_runner", True):
        raise RegistrationError(
            "this config picks vLLM's V1 GPU model runner; registrations are computed for Model Runner V2",
            fix="set VLLM_USE_V2_MODEL_RUNNER=1 (the runner vLLM 0.34 always uses)",
        )


def _kv_cache_config(vllm_config: Any, memory: int) -> Any:
    """The KV-cache config the engine core hands this rank (``vllm/v1/engine/core.py``, ``_initialize_kv_caches``).

    The worker's part is ``get_kv_cache_spec`` and its backends' supported layouts; ``memory`` stands for the
    profiled memory left for the cache, which sets only the block count (no key reads it).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    specs = get_kv_cache_spec(vllm_config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
    layout = resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    record_kv_cache_layout(vllm_config.cache_config, layout.name)
    [kv_cache_config] = get_kv_cache_configs(vllm_config, [specs], [memory], groups)
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return kv_cache_config


@contextlib.contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = time.perf_counter() - start


def _run_points(vllm_config: Any, profile: GpuProfile, seconds: dict[str, float]) -> dict[str, Any]:
    """Activate one ``JitWarmupRegistry`` per registration point around vLLM's code for it; returns them."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import register_top_k_top_p_warmups
    from vllm.v1.worker.gpu.attn_utils import init_attn_backend, init_kv_cache

    registries = {point: JitWarmupRegistry(vllm_config) for point in POINTS}
    meta = torch.device("meta")
    with _timed(seconds, "model"), registries["model"].activate():
        initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    with _timed(seconds, "sampler"), registries["sampler"].activate():
        if vllm_config.speculative_config is not None:
            register_top_k_top_p_warmups()
    # The executor's step once the worker's load_model returns (v1/executor/multiproc_executor.py,
    # uniproc_executor.py): the block size every attention layer's backend supports and, for a hybrid model, the
    # block and mamba page sizes aligned (Platform._align_hybrid_block_size); it reads the layers the model built
    current_platform.update_block_size_for_backend(vllm_config)
    with _timed(seconds, "attention-backends"):
        kv_cache_config = _kv_cache_config(vllm_config, profile.total_memory // 2)
        with registries["attention-backends"].activate():
            attn_groups, _, kernel_block_sizes = init_attn_backend(kv_cache_config, vllm_config, meta)
    with _timed(seconds, "kv-cache"), registries["kv-cache"].activate():
        init_kv_cache(
            vllm_config.compilation_config.static_forward_context, kv_cache_config, meta, kernel_block_sizes,
            vllm_config, attn_groups=(group for groups in attn_groups for group in groups),
        )  # fmt: skip
    return registries


def _keys(kernel: Any, registrations: list[tuple[tuple[Any, ...], dict[str, Any]]], vllm_config: Any) -> Iterator[Any]:
    """``get_warmup_keys`` of each registration, as ``JitWarmupRegistry.warmup`` calls it (a registration without
    arguments gets ``vllm_config`` where the method takes it)."""
    import inspect

    for args, kwargs in registrations:
        if not args and not kwargs and "vllm_config" in inspect.signature(kernel.get_warmup_keys).parameters:
            kwargs = {"vllm_config": vllm_config}
        yield from kernel.get_warmup_keys(*args, **kwargs)


def registered_kernels(config: Any, profile: GpuProfile) -> Registrations:
    """Every kernel vLLM's ``JitWarmupRegistry`` holds for a deployment on ``profile``'s GPU, with its keys.

    ``config`` is vLLM's ``EngineArgs`` (the config is then built as on the GPU) or a ``VllmConfig`` built inside
    :func:`~warmreg_vllm.emulation.emulate_gpu`. One deployment per process: vLLM picks its model implementation
    at import, and this process becomes rank 0 of the deployment's tensor-parallel group while it runs.

    The runner's registration points (:data:`POINTS`), and the vLLM code called for each (the runner's own methods
    need a GPU: CUDA streams, pinned host buffers, the weights, memory profiling):

    - ``model``: ``initialize_model`` (``model_executor/model_loader/utils.py``), which the runner's
      ``load_model`` reaches through the model loader; layers register in ``__init__``. The weights are not loaded.
      A draft model (MTP) is loaded by the runner outside the active registry, so it registers nothing there either.
    - ``sampler``: ``register_top_k_top_p_warmups`` (``v1/sample/ops/topk_topp_sampler.py``), which the runner's
      ``load_model`` calls on CUDA when the deployment speculates.

    Then, as the executor does once ``load_model`` returns, ``Platform.update_block_size_for_backend``: the block
    size the built layers' backends support and, for a hybrid model (Kimi-K3's MLA beside its KDA state), the
    block and mamba page sizes aligned (``_align_hybrid_block_size``), which the engine core's KV-cache grouping
    needs.

    - ``attention-backends``: ``init_attn_backend`` (``v1/worker/gpu/attn_utils.py``; its metadata builders
      register), called by the runner's ``initialize_kv_cache`` with the KV-cache config the engine core computes
      (``get_kv_cache_configs``, for half the profiled GPU's memory: the block count, which no key reads).
    - ``kv-cache``: ``init_kv_cache`` (same file), which allocates the cache (on the meta device here) and binds
      each layer's view; layers register kernels keyed on the cache's strides (``bind_kv_cache``).

    :raises RegistrationError: for a config that is not vLLM's or not the GPU's, or that picks the V1 runner.
    :raises EmulationError: if vLLM cannot be made to behave as on the GPU in this process.
    """
    from warmreg import cross_target

    from .construction import meta_rank
    from .emulation import emulate_gpu

    seconds: dict[str, float] = {}
    with emulate_gpu(profile):
        with _timed(seconds, "config"):
            vllm_config = _vllm_config(config)
            _check_runner(vllm_config)
        with meta_rank(vllm_config):
            registries = _run_points(vllm_config, profile, seconds)
            # Keys derived from Triton's own cache key need Triton's active driver: the profile's target stands in
            with _timed(seconds, "keys"), cross_target(Platform.parse(profile.triton_target.target)):
                kernels = _collect(registries, vllm_config)
    return Registrations(kernels=sorted(kernels), seconds=seconds, registries=registries)


def _key_text(key: Any) -> str:
    """A key's text, the same in every process: vLLM's Triton-derived keys (``TritonCompileKey``) hold the kernel's
    ``id`` and Triton's device id, so they are written as the Triton cache keys they hold."""
    jit_keys = getattr(key, "jit_keys", None)
    if type(key).__name__ == "TritonCompileKey" and jit_keys is not None:
        return f"TritonCompileKey({', '.join(sorted(str(j.cache_key) for j in jit_keys))})"
    return repr(key)


def _names(kernel: Any) -> tuple[str, str]:
    """The kernel's name and qualname: its class's, or for vLLM's generic wrapper of a decorated ``@triton.jit``
    function (``triton_kernel_dispatcher_with_warmup``), the function's."""
    cls = type(kernel)
    function: Any = getattr(getattr(kernel, "kernel", None), "fn", None)
    while getattr(function, "fn", None) is not None:  # Autotuner / Heuristics around the JITFunction
        function = function.fn
    if cls.__name__.startswith("_") and callable(function):
        return function.__name__, f"{function.__module__}.{function.__qualname__}"
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _collect(registries: dict[str, Any], vllm_config: Any) -> list[RegisteredKernel]:
    seen: dict[int, tuple[Any, set[str], list[Any]]] = {}
    for point, registry in registries.items():
        for kernel, registrations in registry._registrations.items():
            _, points, regs = seen.setdefault(id(kernel), (kernel, set(), []))
            points.add(point)
            regs.extend(registrations)
    out = []
    for kernel, points, regs in seen.values():
        kind, reason, keys = kind_of(kernel), None, {}
        try:
            keys = {_key_text(key): key for key in _keys(kernel, regs, vllm_config)}
        except Exception as e:  # a key that needs a live GPU: listed with the reason
            kind, reason, keys = "live-gpu", f"{type(e).__name__}: {e}", {}
        name, qualname = _names(kernel)
        texts = sorted(keys)
        kernel_found = RegisteredKernel(name=name, qualname=qualname, kind=kind, keys=texts, points=points,
                                        reason=reason, vllm_keys=[keys[t] for t in texts], kernel=kernel)  # fmt: skip
        out.append(kernel_found)
    return out
