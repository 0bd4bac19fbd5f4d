"""A warmreg plugin template: one small Triton kernel and its registration for ``template_llm`` models.

Copy this folder, rename ``warmreg_template`` and ``template_llm``, and replace the kernel with yours. The
package is the plugin (entry point ``template = "warmreg_template"``): importing it registers nothing,
warmreg calls its hooks when a plan or a warm asks.
"""

from __future__ import annotations

import warmreg

from .scaled_add import ScaledAdd, ScaledAddKey, scaled_add_reference

__all__ = ["ScaledAdd", "ScaledAddKey", "scaled_add_reference", "warmreg_model_types", "warmreg_register_kernels"]


@warmreg.hookimpl
def warmreg_model_types() -> list[str]:
    """The model types this plugin serves: warmreg calls the hook below for these configs only."""
    return ["template_llm"]


@warmreg.hookimpl
def warmreg_register_kernels(registry: warmreg.Registry) -> None:
    """Register the scaled add on CUDA and ROCm (a predicate the core evaluates against the warm's target)."""
    registry.add(ScaledAdd(), when=warmreg.is_cuda | warmreg.is_rocm)
