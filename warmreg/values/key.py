"""Compile keys: small frozen values that hold exactly what changes a kernel's binary.

A plugin subclasses :class:`CompileKey` with ``@attrs.frozen``. Field values are JSON scalars
(``int``, ``float``, ``str``, ``bool``, ``None``) or tuples of them, so keys hash, order, print and
round-trip through JSON without drift. Helpers describe Triton's specialization classes
(:func:`int_class`, :func:`is_aligned`) so that keys carry classes, not raw values.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, TypeVar

import attrs

from .errors import CompileKeyError

__all__ = [
    "LAUNCH_OPTIONS",
    "dtype_name",
    "CompileKey",
    "FieldDiff",
    "IntClass",
    "int_class",
    "int_class_rep",
    "is_aligned",
]

#: Key field names that are Triton launch options rather than kernel arguments.
LAUNCH_OPTIONS: tuple[str, ...] = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "enable_fp_fusion")

#: Triton's value classes of a specialized integer argument (checked against Triton 3.6.0):
#: ``one`` (== 1, becomes a constexpr), ``div16`` (% 16 == 0, including 0), ``other``;
#: the ``_i64`` forms are the same classes for values that do not fit in int32.
IntClass = Literal["one", "div16", "other", "div16_i64", "other_i64"]

_K = TypeVar("_K", bound="CompileKey")
_SCALARS = (bool, int, float, str, type(None))


def int_class(value: int) -> IntClass:
    """The specialization class Triton gives a non-constexpr integer argument.

    :param value: the runtime integer.
    :returns: ``"one"``, ``"div16"`` or ``"other"`` (``_i64`` appended past the int32 range).
    """
    # ``& 15`` is ``% 16`` for Python ints, negative ones included; branches ordered for the hot path
    if -2147483648 <= value < 2147483648:
        if not value & 15:
            return "div16"
        return "one" if value == 1 else "other"
    return "other_i64" if value & 15 else "div16_i64"


def int_class_rep(cls: IntClass | str) -> int:
    """A representative integer of a specialization class, for building warmup inputs.

    Accepts the class as stored in a key field (a plain ``str`` in JSON-typed keys).

    :raises CompileKeyError: for an unknown class name.
    """
    reps = {"one": 1, "div16": 16, "other": 17, "div16_i64": 2**32, "other_i64": 2**32 + 1}
    if cls not in reps:
        raise CompileKeyError(repr(cls), "is not an integer class", fix=f"use one of {sorted(reps)}")
    return reps[cls]


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """The name keys store for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def is_aligned(tensor: Any) -> bool:
    """Whether a tensor's data pointer is 16-byte aligned (Triton's pointer specialization).

    Works for meta tensors: an offset view reports its offset in ``data_ptr()``.
    """
    return not tensor.data_ptr() & 15


def _check_value(name: str, value: Any) -> None:
    if isinstance(value, tuple):
        for item in value:
            _check_value(name, item)
    elif not isinstance(value, _SCALARS):
        raise CompileKeyError(
            name,
            f"must be a JSON scalar or a tuple of them (got {type(value).__name__} {value!r})",
            fix="store a class or a name in the key (e.g. int_class(n), str(dtype)), not the object",
        )


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


@attrs.frozen
class FieldDiff:
    """One field that differs between two keys."""

    field: str
    left: Any
    right: Any

    def __str__(self) -> str:
        return f"{self.field}: {self.left!r} != {self.right!r}"


@attrs.frozen
class CompileKey:
    """Base of every compile key.

    Subclass contract: decorate the subclass with ``@attrs.frozen``; annotate every field; use only
    JSON scalars or tuples; name launch options exactly as Triton does (:data:`LAUNCH_OPTIONS`) so
    that :meth:`launch_options` hands them to Triton at warmup and at runtime alike.
    """

    _types: ClassVar[dict[str, type[CompileKey]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        CompileKey._types[cls.type_name()] = cls

    def validate(self) -> None:
        """Check that every field is a JSON scalar or a tuple of them.

        Called where keys are declared (plan) and read back (JSON), not on the launch hot path:
        a runtime key only has to compare equal to a declared one.

        :raises CompileKeyError: naming the field.
        """
        for field in attrs.fields(type(self)):
            _check_value(f"{type(self).__name__}.{field.name}", getattr(self, field.name))

    @classmethod
    def type_name(cls) -> str:
        """Stable name of the key type used in JSON (``module:QualName``)."""
        return f"{cls.__module__}:{cls.__qualname__}"

    def fields(self) -> dict[str, Any]:
        """The key's fields as a plain ordered dict."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}

    def launch_options(self) -> dict[str, Any]:
        """The Triton launch options this key fixes (``num_warps``, ``num_stages``, ...).

        ``launch_pdl=False`` is left out: it is Triton's default, and only the CUDA backend accepts
        the option at all (Triton 3.6.0's HIP backend rejects it).
        """
        names = _option_names(type(self))  # type: ignore[arg-type]
        options = {name: getattr(self, name) for name in names}
        if options.get("launch_pdl") is False:
            del options["launch_pdl"]
        return options

    def sort_key(self) -> tuple[Any, ...]:
        """A total order across key types, numeric within numbers (used to sort keys in reports)."""
        return (self.type_name(), *(_sortable(v) for v in self.fields().values()))

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CompileKey):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict: ``{"type": ..., "fields": {...}}``."""
        return {"type": self.type_name(), "fields": {k: _jsonable(v) for k, v in self.fields().items()}}

    @classmethod
    def from_json(cls: type[_K], data: dict[str, Any]) -> _K:
        """Rebuild a key from :meth:`to_json` output.

        :raises CompileKeyError: if the type is unknown (its module not imported) or the fields do not fit.
        """
        try:
            type_name, fields = data["type"], data["fields"]
        except (KeyError, TypeError) as exc:
            raise CompileKeyError(repr(data)[:80], "is not a serialized key", fix="pass CompileKey.to_json() output") from exc
        key_type = CompileKey._types.get(type_name)
        if key_type is None:
            raise CompileKeyError(
                type_name, "has an unknown key type", fix="import (install) the plugin that defines it first"
            )
        if not issubclass(key_type, cls):
            raise CompileKeyError(type_name, f"is not a {cls.__name__}")
        try:
            key = key_type(**{k: _to_tuple(v) for k, v in fields.items()})
        except TypeError as exc:
            raise CompileKeyError(type_name, f"fields do not match: {exc}", fix="rebuild the pack or record") from exc
        key.validate()
        return key  # type: ignore[return-value]

    def diff(self, other: CompileKey) -> tuple[FieldDiff, ...]:
        """Field-by-field difference to another key (empty if equal).

        Keys of different types differ in a pseudo-field ``<type>``.
        """
        if type(self) is not type(other):
            return (FieldDiff("<type>", self.type_name(), other.type_name()),)
        return tuple(
            FieldDiff(name, value, getattr(other, name)) for name, value in self.fields().items() if value != getattr(other, name)
        )

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.fields().items())
        return f"{type(self).__name__}({inner})"


@functools.cache
def _option_names(cls: type[CompileKey]) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.name in LAUNCH_OPTIONS)


def _sortable(value: Any) -> tuple[Any, ...]:
    if value is None:
        return (0,)
    if isinstance(value, (bool, int, float)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, tuple(_sortable(v) for v in value))


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value
