"""Shared helpers of the Kimi-K3 plugin's tests: the example configs, and variants of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example_config(name: str = "kimi_k3", **serving: Any) -> dict[str, Any]:
    """``examples/<name>.json`` as a dict, without its description, with ``serving`` values overridden."""
    data = json.loads((EXAMPLES / f"{name}.json").read_text())
    data.pop("description")
    data["serving"].update(serving)
    return data
