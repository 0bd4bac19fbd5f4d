"""warmreg plugin for the Kimi-K3 family (``model_type == "kimi_k3"``, text config ``kimi_linear``)."""

from __future__ import annotations

PLUGIN = "warmreg-kimi-k3"

__all__ = ["PLUGIN"]
