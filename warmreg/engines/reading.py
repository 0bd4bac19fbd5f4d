"""What every engine reader shares: the canonical settings read, where each came from, and the values refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..values.errors import ConfigError

__all__ = ["DSV4_ARCH", "EngineRead", "Reading", "dotted", "dtype_name", "model_dict"]


#: DeepSeek-V4's architecture name in its config.json, whose cache formats the engines name their own way.
DSV4_ARCH = "DeepseekV4ForCausalLM"


@attrs.frozen
class EngineRead:
    """What :func:`read` found in an engine config object.

    :param engine: the object's type name (``VllmConfig``, ``ServerArgs``), quoted in errors.
    :param model: the Hugging Face config's values (``hf_config.to_dict()``).
    :param serving: the canonical serving settings found.
    :param origins: canonical setting -> the engine field (and value) it was read from.
    :param unmapped: canonical setting -> why the engine's value has no canonical counterpart
        (naming the engine's field, the value and the accepted values).
    """

    engine: str
    model: dict[str, Any]
    serving: dict[str, Any]
    origins: dict[str, str]
    unmapped: dict[str, str]


def dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def dtype_name(value: Any) -> Any:
    """``torch.bfloat16`` -> ``bfloat16`` (a string stays as it is)."""
    return value if isinstance(value, str) else str(value).rsplit(".", 1)[-1]


def model_dict(hf: Any, engine: str) -> dict[str, Any]:
    if hasattr(hf, "to_dict"):
        return dict(hf.to_dict())
    if isinstance(hf, Mapping):
        return dict(hf)
    raise ConfigError(f"{engine}.hf_config", f"is a {type(hf).__name__}, not a Hugging Face config", fix="pass the engine's config object as the engine built it")


class Reading:
    """Collects one object's canonical settings, their origins and the unmapped values."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.serving: dict[str, Any] = {}
        self.origins: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}

    def set(self, name: str, value: Any, field: str, raw: Any = None) -> None:
        if value is None:
            return
        self.serving[name] = value
        shown = raw if raw is not None else value
        self.origins[name] = f"{self.engine}.{field} = {shown!r}" + (f", read as {value!r}" if raw is not None and raw != value else "")

    def refuse(self, name: str, field: str, value: Any, why: str, accepted: Any) -> None:
        self.unmapped[name] = f"comes from {self.engine}.{field} = {value!r}, {why} (accepted: {', '.join(map(str, accepted))})"

    def done(self, model: dict[str, Any]) -> EngineRead:
        return EngineRead(self.engine, model, self.serving, self.origins, self.unmapped)
