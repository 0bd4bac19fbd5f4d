"""warmreg plugin for the DeepSeek-V4 family (``model_type == "deepseek_v4"``).

Importing this package registers nothing; warmreg calls :func:`warmreg_deepseek_v4.plugin.warmreg_register_kernels`
through the ``warmreg`` entry point.
"""

from __future__ import annotations

from .model import DSV4, PLUGIN, compress_ratios

__all__ = ["DSV4", "PLUGIN", "compress_ratios"]
