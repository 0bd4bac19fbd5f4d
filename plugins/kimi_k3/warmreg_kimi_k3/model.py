"""The Kimi-K3 values more than one kernel registration reads, validated once per config, and the
config helpers the registrations share."""

from __future__ import annotations

from typing import Any

import attrs

import warmreg

__all__ = [
    "PLUGIN",
    "KimiK3",
    "attn_res_block_size",
    "local_pdl",
    "positive",
    "positive_text_int",
    "rms_norm_eps",
    "tensor_parallel_size",
]

PLUGIN = "warmreg-kimi-k3"


def positive(value: Any) -> str | None:
    """The problem with ``value`` as a positive int, or None (a ``check`` for :meth:`warmreg.WarmConfig.get`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an int (got {type(value).__name__} {value!r})"
    return None if value > 0 else f"must be > 0 (got {value})"


def positive_text_int(config: warmreg.WarmConfig, field: str) -> int:
    """The positive int ``text.<field>`` of the text config.

    :raises warmreg.ConfigError: if it is missing or not a positive int.
    """
    return config.get(f"text.{field}", int, plugin=PLUGIN, check=positive)


def attn_res_block_size(config: warmreg.WarmConfig) -> int | None:
    """``text.attn_res_block_size``: decoder layers per attention-residual block, or None when absent or
    null (the model then has plain residuals and never launches ``attn_res``).

    :raises warmreg.ConfigError: if it is set but not a positive int.
    """
    return config.get("text.attn_res_block_size", int, plugin=PLUGIN, check=positive, default=None)


def local_pdl(launch_pdl: bool | None) -> bool:
    """``launch_pdl``, or when None whether the local GPU has programmatic dependent launch: the default of the
    launchers whose key holds ``launch_pdl``, so that runtime launches match what the domains planned."""
    if launch_pdl is not None:
        return bool(launch_pdl)
    local = warmreg.runtime_platform()
    return bool(local and local.supports_pdl)


def _positive_float(value: Any) -> str | None:
    return None if value > 0 else f"must be > 0 (got {value})"


def rms_norm_eps(config: warmreg.WarmConfig) -> float:
    """``text.rms_norm_eps``: the epsilon of the model's RMSNorms (required: it is a constexpr of ``attn_res``,
    so a guessed default would warm binaries the engine never launches).

    :raises warmreg.ConfigError: if it is missing or not a number > 0.
    """
    return config.get("text.rms_norm_eps", float, plugin=PLUGIN, check=_positive_float)


def tensor_parallel_size(config: warmreg.WarmConfig) -> int:
    """``serving.tensor_parallel_size`` (default 1)."""
    return config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)


@attrs.frozen(kw_only=True)
class KimiK3:
    """The values every Kimi-K3 registration reads: only the activation dtype so far (each op module
    reads its own layout fields, so a config without KDA layers needs no KDA fields)."""

    dtype: str

    @classmethod
    def from_config(cls, config: warmreg.WarmConfig) -> KimiK3:
        """Read ``serving.dtype`` (default bfloat16).

        :raises warmreg.ConfigError: naming the field.
        """
        return cls(dtype=config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16"))
