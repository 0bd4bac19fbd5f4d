"""Helpers shared by the DeepSeek-V4 kernel tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from warmreg_deepseek_v4.model import DSV4

import warmreg

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

Register = Callable[[warmreg.Registry, DSV4, warmreg.WarmConfig, warmreg.Platform], None]


class ModulePlugin:
    """A plugin object that registers only the given modules' kernels, as plugin.py would."""

    def __init__(self, *registers: Register) -> None:
        self.registers = registers

    @warmreg.hookimpl
    def warmreg_register_kernels(
        self, registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        model = DSV4.from_config(config)
        for register in self.registers:
            register(registry, model, config, platform)


def example_config(example: str, **serving: Any) -> dict[str, Any]:
    """An example config (``examples/<example>.json``) with serving settings overridden."""
    data = json.loads((EXAMPLES / f"{example}.json").read_text())
    data["serving"].update(serving)
    return data
