"""Hook specifications: the whole interface between warmreg and its plugins.

A plugin is a module (or object) with functions marked ``@warmreg.hookimpl``, published through the
entry-point group ``warmreg``::

    [project.entry-points.warmreg]
    my_family = "warmreg_my_family.plugin"

Hooks are called with keyword arguments only; an implementation may accept any subset of them.
Specs only ever grow by new arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from ..values.platform import Platform
    from .config import WarmConfig
    from .registry import Registry

__all__ = ["PROJECT", "hookimpl", "hookspec", "warmreg_model_types", "warmreg_pack_functions", "warmreg_register_kernels"]

PROJECT = "warmreg"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def warmreg_register_kernels(registry: Registry, config: WarmConfig, platform: Platform) -> None:
    """Declare the kernels a deployment of ``config`` on ``platform`` launches.

    Call ``registry.add(kernel, when=...)`` once per kernel (instance) the deployment uses; return
    nothing. Do no work beyond reading the config: no compiling, no allocation, no imports of
    optional backends at module import time. A plugin that answers :func:`warmreg_model_types` is
    called only for configs of those model types; one that does not is called for every config.

    :param registry: collects kernels; deduplicates by kernel name and key.
    :param config: the deployment's :class:`~warmreg.WarmConfig`.
    :param platform: the :class:`~warmreg.Platform` compiled for (local GPU or a cross target).
    """


@hookspec
def warmreg_model_types() -> list[str]:  # type: ignore[empty-body]
    """The ``model_type`` values this plugin serves (optional).

    The core calls this plugin's :func:`warmreg_register_kernels` only for configs of these model
    types, and uses the answers to tell an unknown model type (an error naming ``model.model_type``)
    from a known one whose deployment simply launches no kernel here.

    :returns: model types, e.g. ``["deepseek_v4"]``.
    """


@hookspec
def warmreg_pack_functions(names: frozenset[str], engine: Mapping[str, Any] | None) -> Mapping[str, Any]:  # type: ignore[empty-body]
    """The Triton functions among ``names`` that this plugin's engine defines (optional): a pack of an engine's
    own kernels (:func:`warmreg.record_pack`) names functions no warmreg kernel class defines.

    Called by pack install and verify, only for names the loaded kernel classes do not define. Return the
    ``@triton.jit`` functions you vouch for, by full name (``module.qualname``), importing only your engine's
    own modules, and only for a pack of your engine (``engine["name"]``); return nothing for any other name.
    Each function is still checked against the pack (its source hash) before an entry is installed.

    :param names: full names of Triton functions the pack's entries hold binaries for.
    :param engine: the pack manifest's engine section (its ``name``, ``version`` and the builder's record), or
        ``None`` for a pack of plugin kernels.
    :returns: full name -> ``JITFunction``.
    """
