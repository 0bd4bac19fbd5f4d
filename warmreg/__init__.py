"""warmreg: Triton kernels in LLM serving engines never compile while requests are served.

The public API: everything a plugin or an engine needs is importable from here.
"""

from __future__ import annotations

from .config import WarmConfig
from .domains import next_pow2, powers_of_two, runtime_platform, token_counts
from .errors import (
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
from .hookspecs import hookimpl
from .kernel import LaunchSpec, TritonKernel, kernel_launcher, meta
from .key import CompileKey, FieldDiff, IntClass, dtype_name, int_class, int_class_rep, is_aligned
from .monitor import JitMissError, Miss, Monitor, arm, disarm, monitor
from .platform import (
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
from .registry import KernelPlan, Plan, Registry
from .report import KeyResult, WarmReport
from .space import enumerate_keys
from .warm import plan, prefetch, warm

__version__ = "0.1.0"

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
    "WarmConfig",
    "WarmReport",
    "WarmregError",
    "__version__",
    "arm",
    "disarm",
    "dtype_name",
    "enumerate_keys",
    "has_feature",
    "hookimpl",
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
    "plan",
    "prefetch",
    "powers_of_two",
    "rocm_arch_in",
    "runtime_platform",
    "sm_at_least",
    "sm_below",
    "supports_pdl",
    "token_counts",
    "warm",
]
