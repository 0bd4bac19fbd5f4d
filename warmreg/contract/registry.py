"""The registry plugins fill: which kernels a deployment launches, and which plugin said so.

Plugins declare kernels (``registry.add``) inside the scope the core opens for them
(:meth:`Registry.scope`); the core then plans from :meth:`Registry.registrations` (see
:mod:`warmreg.pipeline.planning`). A plugin that fails inside its scope registers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from ..values.errors import PluginError
from ..values.platform import Platform, Predicate
from .config import WarmConfig
from .kernel import TritonKernel

__all__ = ["Registration", "Registry", "Skipped"]


@attrs.frozen
class Skipped:
    """A registration whose predicate was false on this platform."""

    kernel: str
    plugin: str
    reason: str


@attrs.frozen
class Registration:
    """One kernel instance a plugin registered."""

    kernel: TritonKernel[Any]
    plugin: str


class Registry:
    """Collects the kernels plugins declare for one config and platform.

    :param config: the deployment's config.
    :param platform: the platform compiled for.
    """

    def __init__(self, config: WarmConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self._plugin = "<direct>"
        self._registrations: list[Registration] = []
        self._skipped: list[Skipped] = []

    @contextmanager
    def scope(self, plugin: str) -> Iterator[Registry]:
        """Attribute every :meth:`add` inside the block to ``plugin``; if the block raises, drop what
        it registered (a failing plugin registers nothing, not half its kernels) and re-raise."""
        previous, marks = self._plugin, (len(self._registrations), len(self._skipped))
        self._plugin = plugin
        try:
            yield self
        except BaseException:
            del self._registrations[marks[0] :]
            del self._skipped[marks[1] :]
            raise
        finally:
            self._plugin = previous

    def add(self, kernel: TritonKernel[Any], *, when: bool | Predicate = True) -> None:
        """Declare that this deployment launches ``kernel``.

        :param kernel: a kernel instance (configured with this deployment's sizes).
        :param when: a bool, or a :class:`~warmreg.Predicate` on the platform that the core evaluates.
        :raises PluginError: if ``kernel`` is not a :class:`~warmreg.TritonKernel`, or another
            plugin registered a different kernel class under the same name.
        """
        if not isinstance(kernel, TritonKernel):
            raise PluginError(self._plugin, f"registered {kernel!r}, which is not a TritonKernel instance")
        for other in self._registrations:
            if other.kernel.name == kernel.name and type(other.kernel) is not type(kernel):
                raise PluginError(
                    self._plugin,
                    f"registered kernel name {kernel.name!r} as {type(kernel).__qualname__}, but plugin "
                    f"{other.plugin!r} registered it as {type(other.kernel).__qualname__}",
                    fix="give each kernel class its own name",
                )
        active = when(self.platform) if isinstance(when, Predicate) else bool(when)
        if not active:
            reason = (
                f"{when!r} is false on {self.platform}"
                if isinstance(when, Predicate)
                else f"the plugin's condition for this config is false (on {self.platform})"
            )
            self._skipped.append(Skipped(kernel.name, self._plugin, reason))
            return
        self._registrations.append(Registration(kernel, self._plugin))

    def registrations(self) -> tuple[Registration, ...]:
        """Every active registration, in order."""
        return tuple(self._registrations)

    def skipped(self) -> tuple[Skipped, ...]:
        """Every registration whose condition was false, in order."""
        return tuple(self._skipped)
