"""Registration: which kernels a deployment of ``template_llm`` launches (read by warmreg, not at import)."""

from __future__ import annotations

import warmreg

from . import PLUGIN
from .scaled_add import ScaledAdd

__all__ = ["MODEL_TYPES", "warmreg_model_types", "warmreg_register_kernels"]

#: The Hugging Face ``model_type`` values this plugin serves.
MODEL_TYPES = ("template_llm",)


def _positive(value: int) -> str | None:
    return None if value > 0 else f"must be > 0 (got {value})"


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves: an unknown ``model_type`` is then a clear config error."""
    return list(MODEL_TYPES)


@warmreg.hookimpl
def warmreg_register_kernels(
    registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> None:
    """Register the scaled add for ``template_llm`` deployments on CUDA and ROCm."""
    if config.model_type not in MODEL_TYPES:
        return  # another family's config: register nothing
    hidden = config.get("text.hidden_size", int, plugin=PLUGIN, check=_positive)
    dtype = config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16")
    # The residual x is its own tensor; y is the second half of a fused [T, 2 * hidden] projection.
    registry.add(
        ScaledAdd(hidden=hidden, dtype=dtype, y_width=2 * hidden, y_offset=hidden, plugin=PLUGIN),
        when=warmreg.is_cuda | warmreg.is_rocm,  # a predicate the core evaluates against the target
    )
