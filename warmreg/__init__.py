"""warmreg: Triton kernels in LLM serving engines never compile while requests are served.

The public API: everything a plugin or an engine needs is importable from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .contract.config import WarmConfig
from .contract.domains import next_pow2, powers_of_two, runtime_platform, token_counts
from .contract.hookspecs import hookimpl
from .pipeline.report import KeyResult, WarmReport
from .support.version import __version__
from .values.errors import (
    CacheError,
    CompileFailed,
    CompileKeyError,
    ConfigError,
    KernelContractError,
    LaunchError,
    PluginError,
    TargetError,
    WarmregError,
)
from .values.key import CompileKey, FieldDiff, IntClass, dtype_name, int_class, int_class_rep, is_aligned
from .values.platform import (
    Platform,
    Predicate,
    has_feature,
    is_cuda,
    is_fp8_fnuz,
    is_rocm,
    is_xpu,
    rocm_arch_in,
    sm_at_least,
    sm_below,
    supports_pdl,
)

if TYPE_CHECKING:
    from ._triton.target import cross_target
    from .api.prefetch import prefetch
    from .api.warm import reset_state, warm
    from .contract.kernel import LaunchSpec, TritonKernel, TuneConfig, kernel_launcher, meta, output
    from .contract.registry import Registry
    from .contract.space import enumerate_keys
    from .monitoring import JitMissError, Miss, Monitor, arm, disarm, monitor
    from .pipeline.planning import KernelPlan, Plan, plan
    from .runtime.launch import use_config
    from .stages.record import install_engine_pack, record_pack

# Imported on first use: these modules import torch (about 2 s on a small machine), which the CLI's
# refusals, pack checks and config checks do not need.
_LAZY = {
    **dict.fromkeys(("LaunchSpec", "TritonKernel", "TuneConfig", "kernel_launcher", "meta", "output"), "contract.kernel"),
    "use_config": "runtime.launch",
    **dict.fromkeys(("JitMissError", "Miss", "Monitor", "arm", "disarm", "monitor"), "monitoring"),
    **dict.fromkeys(("KernelPlan", "Plan", "plan"), "pipeline.planning"),
    "Registry": "contract.registry",
    "enumerate_keys": "contract.space",
    "cross_target": "_triton.target",  # compile for a named target in a block (a pack built beside an engine)
    **dict.fromkeys(("install_engine_pack", "record_pack"), "stages.record"),  # packs of an engine's own kernels
    "prefetch": "api.prefetch",  # torch-free: an engine calls it before it imports torch
    **dict.fromkeys(("reset_state", "warm"), "api.warm"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'warmreg' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CacheError",
    "CompileFailed",
    "CompileKey",
    "CompileKeyError",
    "ConfigError",
    "FieldDiff",
    "IntClass",
    "JitMissError",
    "KernelContractError",
    "KernelPlan",
    "KeyResult",
    "LaunchError",
    "LaunchSpec",
    "Miss",
    "Monitor",
    "Plan",
    "Platform",
    "PluginError",
    "Predicate",
    "Registry",
    "TargetError",
    "TritonKernel",
    "TuneConfig",
    "WarmConfig",
    "WarmReport",
    "WarmregError",
    "__version__",
    "arm",
    "cross_target",
    "disarm",
    "dtype_name",
    "enumerate_keys",
    "has_feature",
    "hookimpl",
    "install_engine_pack",
    "int_class",
    "int_class_rep",
    "is_aligned",
    "is_cuda",
    "is_fp8_fnuz",
    "is_rocm",
    "is_xpu",
    "kernel_launcher",
    "meta",
    "monitor",
    "next_pow2",
    "output",
    "plan",
    "prefetch",
    "reset_state",
    "powers_of_two",
    "record_pack",
    "rocm_arch_in",
    "runtime_platform",
    "sm_at_least",
    "sm_below",
    "supports_pdl",
    "token_counts",
    "use_config",
    "warm",
]
