"""``WarmConfig``: an engine-agnostic, read-only view of what kernel plugins need to know.

It holds the model's Hugging Face config values (``model``) and the deployment's serving
settings (``serving``). Build it from a dict, a ``config.json`` path, a Hugging Face config object
or an engine config object (vLLM's ``VllmConfig``, SGLang's ``ServerArgs``: :mod:`warmreg.engines`
maps each engine's vocabulary onto the canonical settings) with :meth:`WarmConfig.load`. Plugins read
fields with :meth:`WarmConfig.get`, which names the field, the plugin and the fix when a value is
missing or invalid.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import attrs

from .. import engines
from ..engines.settings import SERVING_FIELDS
from ..support import bounded_json as _json
from ..values.errors import ConfigError

__all__ = ["CONFIG_FILE_MAX", "MODEL_INT_MAX", "SERVING_FIELDS", "WarmConfig"]

_T = TypeVar("_T")


#: The widest int any model field may hold (Triton's int32 kernel arguments); plugins narrow it.
MODEL_INT_MAX = 2**31 - 1

#: A config file is read only if it is a regular file of at most this many bytes.
CONFIG_FILE_MAX = 16 * 1024 * 1024

def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@attrs.frozen(eq=False)
class WarmConfig:
    """Read-only view of a model config plus serving settings.

    :param model: the Hugging Face ``config.json`` values (a multimodal config keeps its
        ``text_config``; :attr:`text` reads through it).
    :param serving: serving settings (:data:`SERVING_FIELDS`).
    :param source: where the config came from, quoted in errors.
    :param origins: for settings read from an engine object, setting -> the engine field and value
        it came from (:mod:`warmreg.engines`), quoted in errors about the setting.
    :param unmapped: setting -> why the engine's value has no canonical counterpart; reading such a
        setting (one not given in ``serving``) raises that, naming the engine field and value.
    """

    model: Mapping[str, Any] = attrs.field(converter=_freeze)
    serving: Mapping[str, Any] = attrs.field(converter=_freeze, factory=dict)
    source: str = "<dict>"
    origins: Mapping[str, str] = attrs.field(converter=_freeze, factory=dict)
    unmapped: Mapping[str, str] = attrs.field(converter=_freeze, factory=dict)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.model, Mapping):
            got = f"{type(self.model).__name__} {repr(self.model)[:60]}"
            raise ConfigError("model", f"must be a mapping of the model's config values (got {got})", fix=f"{self.source} must hold a Hugging Face config")
        for name, value in self.serving.items():
            if name not in SERVING_FIELDS:
                raise ConfigError(
                    f"serving.{name}", "is not a serving setting", fix=f"use one of {', '.join(SERVING_FIELDS)}"
                )
            problem = SERVING_FIELDS[name][0](value)
            if problem:
                raise ConfigError(
                    f"serving.{name}", self._from_origin(name, problem), fix=f"set {SERVING_FIELDS[name][1]} in {self.source}"
                )
        if not isinstance(self.model.get("model_type"), str):
            raise ConfigError(
                "model.model_type", "is missing", fix=f"{self.source} must hold a Hugging Face config with model_type"
            )

    def _from_origin(self, name: str, problem: str) -> str:
        """``problem``, naming the engine field the setting ``name`` was read from, if any."""
        origin = self.origins.get(name)
        return f"{problem} ({origin})" if origin else problem

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, obj: Any, *, serving: Mapping[str, Any] | None = None) -> WarmConfig:
        """Build a config from any supported source.

        :param obj: a ``WarmConfig``; a dict ``{"model": {...}, "serving": {...}}``; a plain Hugging Face
            config dict; a path to a JSON file of either shape; a Hugging Face ``PretrainedConfig``; or an
            engine config object: a vLLM ``VllmConfig`` or an SGLang ``ServerArgs`` (resolved here if it is
            not yet), read by :func:`warmreg.engines.read` into the canonical settings.
        :param serving: serving settings that override those found in ``obj``.
        :raises ConfigError: naming the file or field that is wrong, and the fix.
        """
        overrides = dict(serving or {})
        if isinstance(obj, WarmConfig):
            if not overrides:
                return obj
            return attrs.evolve(
                obj, serving={**obj.serving, **overrides},
                origins={k: v for k, v in obj.origins.items() if k not in overrides},
                unmapped={k: v for k, v in obj.unmapped.items() if k not in overrides},
            )  # fmt: skip
        if isinstance(obj, (str, os.PathLike)):
            return cls._from_file(Path(obj), overrides)
        if isinstance(obj, Mapping):
            return cls._from_dict(obj, overrides, "<dict>")
        if hasattr(obj, "to_dict") and hasattr(obj, "model_type"):  # transformers.PretrainedConfig
            return cls(model=obj.to_dict(), serving=overrides, source=type(obj).__name__)
        return cls._from_engine(obj, overrides)

    @classmethod
    def _from_file(cls, path: Path, overrides: dict[str, Any]) -> WarmConfig:
        try:
            data = _json.loads(_json.read_regular_file(path, limit=CONFIG_FILE_MAX), max_depth=64)
        except FileNotFoundError as exc:
            raise ConfigError(str(path), "does not exist", fix="pass the path of a config.json or a warmreg config", file=True) from exc
        except OSError as exc:
            raise ConfigError(str(path), f"cannot be read ({exc.strerror})", fix="check the path and its permissions", file=True) from exc
        except ValueError as exc:
            first = (str(exc).splitlines() or [""])[0][:200]
            raise ConfigError(str(path), f"is not a JSON config warmreg reads ({first})", fix="pass a config.json file", file=True) from exc
        if not isinstance(data, Mapping):
            raise ConfigError(str(path), "must hold a JSON object", fix="write {\"model\": {...}, \"serving\": {...}}", file=True)
        return cls._from_dict(data, overrides, str(path))

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any], overrides: dict[str, Any], source: str) -> WarmConfig:
        if "model" in data:
            extra = set(data) - {"model", "serving", "description"}
            if extra:
                raise ConfigError(
                    sorted(extra)[0], "is not a top-level key", fix="use only 'model', 'serving' and 'description'"
                )
            model, serving = data["model"], data.get("serving", {})
            if not isinstance(model, Mapping):
                raise ConfigError("model", "must be an object", fix=f"put the Hugging Face config under 'model' in {source}")
            if not isinstance(serving, Mapping):
                raise ConfigError("serving", "must be an object", fix=f"write 'serving': {{...}} in {source}")
            return cls(model=model, serving={**serving, **overrides}, source=source)
        return cls(model=data, serving=overrides, source=source)

    @classmethod
    def _from_engine(cls, obj: Any, overrides: dict[str, Any]) -> WarmConfig:
        found = engines.read(obj)
        if found is None:
            raise ConfigError(
                type(obj).__name__,
                "is not a config warmreg can read",
                fix="pass a dict, a config.json path, a Hugging Face config, a vLLM VllmConfig or an SGLang ServerArgs",
            )
        return cls(
            model=found.model,
            serving={**found.serving, **overrides},
            source=found.engine,
            origins={k: v for k, v in found.origins.items() if k not in overrides},
            unmapped={k: v for k, v in found.unmapped.items() if k not in overrides},
        )

    # -- reading ------------------------------------------------------------------------------
    @property
    def model_type(self) -> str:
        """The model's ``model_type`` (top level, e.g. ``deepseek_v4`` or ``kimi_k3``)."""
        return str(self.model["model_type"])

    @property
    def text(self) -> Mapping[str, Any]:
        """The text model's config: ``model.text_config`` if present, else ``model``."""
        text = self.model.get("text_config")
        return text if isinstance(text, Mapping) else self.model

    def get(
        self,
        field: str,
        kind: type[_T],
        *,
        plugin: str,
        check: Callable[[Any], str | None] | None = None,
        default: Any = attrs.NOTHING,
        fix: str | None = None,
        choices: Iterable[Any] | None = None,
    ) -> _T:
        """Read one field, validated.

        :param field: ``serving.<name>``, ``model.<name>`` or ``text.<name>`` (the text config).
        :param kind: the expected Python type (``int`` rejects ``bool``).
        :param plugin: who needs the field; quoted in the error.
        :param check: extra validation returning a problem string or ``None``.
        :param default: value when missing; without it a missing field is an error.
        :param choices: the values the plugin knows; any other is an error listing them (a setting
            the plugin does not know must not silently drop kernels).
        :raises ConfigError: naming the field, the plugin and the fix.
        """
        section, _, name = field.partition(".")
        source = {"serving": self.serving, "model": self.model, "text": self.text}.get(section)
        if source is None or not name:
            raise ConfigError(field, "is not a field path", plugin=plugin, fix="write serving.<name>, model.<name> or text.<name>")
        if section == "serving" and name in self.unmapped and name not in source:
            raise ConfigError(
                field, self.unmapped[name], plugin=plugin,
                fix=fix or f"serve with one of those, or pass serving={{{name!r}: ...}} to WarmConfig.load",
            )  # fmt: skip
        if name not in source or source[name] is None:
            if default is not attrs.NOTHING:
                return default  # type: ignore[no-any-return]
            where = "the 'serving' section" if section == "serving" else "the model's config.json"
            what = SERVING_FIELDS[name][1] if section == "serving" and name in SERVING_FIELDS else name
            raise ConfigError(field, "is missing", plugin=plugin, fix=fix or f"set {what} in {where} of {self.source}", accepted=choices or ())
        return self._checked(field, source[name], kind, plugin=plugin, check=check, fix=fix, choices=choices)

    def _checked(
        self, field: str, value: Any, kind: type[_T], *, plugin: str, check: Callable[[Any], str | None] | None,
        fix: str | None, choices: Iterable[Any] | None,
    ) -> _T:  # fmt: skip
        """``value`` of ``field``, validated as :meth:`get` documents."""
        section, _, name = field.partition(".")
        source = self.origins.get(name, self.source) if section == "serving" else self.source  # --set NAME=..., an engine field
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if ok and kind is int and not -MODEL_INT_MAX <= value <= MODEL_INT_MAX:
            raise ConfigError(
                field, f"must be in -{MODEL_INT_MAX}..{MODEL_INT_MAX} (got an int of {value.bit_length()} bits)", plugin=plugin,
                fix=fix or f"correct it in {source}",
            )  # fmt: skip
        if not ok:
            raise ConfigError(
                field,
                f"must be {kind.__name__} (got {type(value).__name__} {repr(value)[:60]})",
                plugin=plugin,
                fix=fix or f"correct it in {source}",
            )
        if choices is not None and value not in (known := tuple(choices)):
            unknown = f"is {value!r}, which {plugin} does not know (accepted: {', '.join(map(str, known))})"
            raise ConfigError(
                field, self._from_origin(name, unknown) if section == "serving" else unknown, plugin=plugin,
                fix=fix or f"use one of those in {source}", accepted=known,
            )  # fmt: skip
        problem = check(value) if check else None
        if problem:
            shown = self._from_origin(name, problem) if section == "serving" else problem
            raise ConfigError(field, shown, plugin=plugin, fix=fix or f"correct it in {source}")
        return value  # type: ignore[no-any-return]

    def to_json(self) -> dict[str, Any]:
        """The config as ``{"model": ..., "serving": ...}`` (loadable by :meth:`load`)."""
        return {"model": _thaw(self.model), "serving": _thaw(self.serving)}
