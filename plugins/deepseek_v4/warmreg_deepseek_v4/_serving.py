"""Serving settings that several DeepSeek-V4 kernels read, each read and checked one way."""

from __future__ import annotations

import warmreg

from .model import DSV4, PLUGIN

__all__ = ["dcp_world_size", "max_model_len", "serving_int"]


def serving_int(config: warmreg.WarmConfig, field: str, default: int | None = None) -> int:
    """The int ``serving.<field>`` (required when ``default`` is None).

    :raises warmreg.ConfigError: if it is missing (and has no default) or not an int.
    """
    if default is None:
        return config.get(f"serving.{field}", int, plugin=PLUGIN)
    return config.get(f"serving.{field}", int, plugin=PLUGIN, default=default)


def max_model_len(config: warmreg.WarmConfig) -> int:
    """``serving.max_model_len`` (required; WarmConfig checks serving ints are > 0)."""
    return serving_int(config, "max_model_len")


def dcp_world_size(config: warmreg.WarmConfig, model: DSV4) -> int:
    """``serving.decode_context_parallel_size`` (default 1).

    :raises warmreg.ConfigError: for DCP with C4 layers, which the DeepSeek-V4 C4 indexer does not support.
    """
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    if dcp > 1 and model.has_c4:
        raise warmreg.ConfigError(
            "serving.decode_context_parallel_size",
            "must be 1: the DeepSeek-V4 C4 indexer does not support DCP",
            plugin=PLUGIN,
        )
    return dcp
