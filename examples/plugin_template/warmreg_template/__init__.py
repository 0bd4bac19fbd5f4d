"""A warmreg plugin template: one small Triton kernel, its compile key, domains and registration.

Copy this folder, rename ``warmreg_template`` and ``template_llm``, and replace the kernel with yours.
Importing the package registers nothing; warmreg calls :func:`warmreg_template.plugin.warmreg_register_kernels`.
"""

from __future__ import annotations

from .scaled_add import ScaledAdd, ScaledAddKey, scaled_add_reference

PLUGIN = "warmreg-template"

__all__ = ["PLUGIN", "ScaledAdd", "ScaledAddKey", "scaled_add_reference"]
