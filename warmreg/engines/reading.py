"""What every engine reader shares: the canonical settings read, where each came from, and the values refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..values.errors import ConfigError

__all__ = ["DSV4_ARCH", "DTYPE_ALIASES", "EngineRead", "Reading", "dotted", "model_dict"]


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


#: The engines' other names of activation dtypes (vLLM's and SGLang's ``--dtype half|float``) -> torch's.
DTYPE_ALIASES: Mapping[str, str] = {"half": "float16", "float": "float32"}


def _got(value: Any) -> str:
    return f"{type(value).__name__} {repr(value)[:60]}"


def model_dict(hf: Any, engine: str, field: str) -> dict[str, Any]:
    """The Hugging Face config's values (``hf.to_dict()``, or ``hf`` itself if it is a mapping).

    :param field: where the engine object holds ``hf`` (``model_config.hf_config``), quoted in errors.
    :raises ConfigError: if they are not a mapping, or ``architectures`` is not a list of names.
    """
    fix = "pass the engine's config object as the engine built it (its hf_config a transformers PretrainedConfig)"
    if hasattr(hf, "to_dict"):
        values, where = hf.to_dict(), f"{engine}.{field}.to_dict()"
    elif isinstance(hf, Mapping):
        values, where = hf, f"{engine}.{field}"
    else:
        raise ConfigError(f"{engine}.{field}", f"is a {type(hf).__name__}, not a Hugging Face config", fix=fix)
    if not isinstance(values, Mapping):
        raise ConfigError(where, f"must be a mapping of the model's config values (got {_got(values)})", fix=fix)
    architectures = values.get("architectures")
    if architectures is not None and not (isinstance(architectures, (list, tuple)) and all(isinstance(a, str) for a in architectures)):
        raise ConfigError(
            f"{engine}.{field}.architectures", f"must be a list of architecture names (got {_got(architectures)})",
            fix=f"{fix}; its config.json lists e.g. [{DSV4_ARCH!r}]",
        )  # fmt: skip
    return dict(values)


class Reading:
    """Collects one object's canonical settings, their origins and the unmapped values.

    The typed reads (:meth:`name`, :meth:`count`, :meth:`dtype`) refuse a value of the wrong type at
    once, naming the engine field and the value: such a value is never read as something else (a bool
    as an int, a list as its repr) nor dropped. Ranges are :data:`~warmreg.engines.settings.SERVING_FIELDS`'.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.serving: dict[str, Any] = {}
        self.origins: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}

    def wrong(self, field: str, value: Any, expected: str, example: Any = None) -> ConfigError:
        """The error for ``value`` of the engine field ``field``, which is not ``expected``."""
        e_g = f" (e.g. {example!r})" if example is not None else ""
        return ConfigError(
            f"{self.engine}.{field}", f"must be {expected} (got {_got(value)})",
            fix=f"set {self.engine}.{field} to {expected}{e_g}, as the engine itself holds it",
        )  # fmt: skip

    def name(self, value: Any, field: str, example: str | None = None, *, expected: str = "a string") -> str | None:
        """``value`` if it is ``None`` or a string (as a plain ``str``).

        :param expected: what the engine holds there, quoted in the error.
        :raises ConfigError: for anything else (a list, a number, a bool).
        """
        if value is None or type(value) is str:
            return value
        if isinstance(value, str):
            return str.__str__(value)  # a str subclass (a StrEnum member): its text
        raise self.wrong(field, value, expected, example)

    def count(self, value: Any, field: str) -> int | None:
        """``value`` if it is ``None`` or an int (never a bool).

        :raises ConfigError: for anything else (a bool, a float, NaN, a string, a list).
        """
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise self.wrong(field, value, "an int")

    def flag(self, value: Any, field: str) -> bool | None:
        """``value`` if it is ``None`` or a bool.

        :raises ConfigError: for anything else (an int, a string).
        """
        if value is None or isinstance(value, bool):
            return value
        raise self.wrong(field, value, "true or false")

    def dtype(self, value: Any, field: str) -> str:
        """A dtype's name: ``torch.bfloat16`` -> ``bfloat16``; a string as it is (``half``, ``float``: torch's names).

        :raises ConfigError: for anything but a ``torch.dtype`` or a string (``-1``, a list).
        """
        if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
            return str(value).rsplit(".", 1)[-1]
        if not isinstance(value, str):
            raise self.wrong(field, value, "a torch dtype or its name", "bfloat16")
        name = str.__str__(value)
        return DTYPE_ALIASES.get(name, name)

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
