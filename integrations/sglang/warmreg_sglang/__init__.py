"""warmreg inside SGLang (0.5.23): every Triton key of the deployment warmed in each model runner at start-up,
through SGLang's own plugin door (the ``sglang.srt.plugins`` entry point :func:`warmreg_sglang.plugin.register`),
switched on by :mod:`warmreg.api.startup`'s ``WARMREG_*`` variables."""

from __future__ import annotations

__all__: list[str] = []
