"""The registry plugins fill, and the :class:`Plan` the core derives from it.

Plugins declare kernels (``registry.add``); the core decides: it evaluates platform predicates,
merges registrations of the same kernel by name (the Q/KV RMSNorm registered by two families
compiles once per distinct key) and computes each kernel's keys from its domains.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from . import _triton
from .config import WarmConfig
from .errors import PluginError
from .kernel import TritonKernel
from .key import CompileKey
from .platform import Platform, Predicate
from .space import enumerate_keys

__all__ = ["KernelPlan", "Plan", "Registry", "Skipped", "loaded_jits"]


@attrs.frozen
class Skipped:
    """A registration whose predicate was false on this platform."""

    kernel: str
    plugin: str
    reason: str


@attrs.frozen
class _Registration:
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
        self._current_plugin = "<direct>"
        self._registrations: list[_Registration] = []
        self._skipped: list[Skipped] = []

    def add(self, kernel: TritonKernel[Any], *, when: bool | Predicate = True) -> None:
        """Declare that this deployment launches ``kernel``.

        :param kernel: a kernel instance (configured with this deployment's sizes).
        :param when: a bool, or a :class:`~warmreg.Predicate` on the platform that the core evaluates.
        :raises PluginError: if ``kernel`` is not a :class:`~warmreg.TritonKernel`, or another
            plugin registered a different kernel class under the same name.
        """
        if not isinstance(kernel, TritonKernel):
            raise PluginError(self._current_plugin, f"registered {kernel!r}, which is not a TritonKernel instance")
        for other in self._registrations:
            if other.kernel.name == kernel.name and type(other.kernel) is not type(kernel):
                raise PluginError(
                    self._current_plugin,
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
            self._skipped.append(Skipped(kernel.name, self._current_plugin, reason))
            return
        self._registrations.append(_Registration(kernel, self._current_plugin))

    def _mark(self) -> tuple[int, int]:
        return len(self._registrations), len(self._skipped)

    def _rollback(self, mark: tuple[int, int]) -> None:
        del self._registrations[mark[0] :]
        del self._skipped[mark[1] :]

    def plan(self) -> Plan:
        """Compute every registered kernel's keys and merge registrations by kernel name."""
        by_name: dict[str, list[_Registration]] = {}
        for reg in self._registrations:
            by_name.setdefault(reg.kernel.name, []).append(reg)
        kernels = []
        for name in sorted(by_name):
            regs = by_name[name]
            owners: dict[CompileKey, TritonKernel[Any]] = {}
            for reg in regs:
                for key in enumerate_keys(reg.kernel, reg.kernel.domains(self.config, self.platform)):
                    owners.setdefault(key, reg.kernel)  # each key is warmed by an instance that produced it
            plugins = tuple(sorted({r.plugin for r in regs}))
            kernels.append(
                KernelPlan(name=name, kernel=regs[0].kernel, keys=tuple(sorted(owners)), plugins=plugins, owners=owners)
            )
        return Plan(config=self.config, platform=self.platform, kernels=tuple(kernels), skipped=tuple(self._skipped))


@attrs.frozen
class KernelPlan:
    """One kernel and the keys a deployment needs compiled."""

    name: str
    kernel: TritonKernel[Any] = attrs.field(eq=False, repr=False)
    keys: tuple[CompileKey, ...]
    plugins: tuple[str, ...]
    owners: dict[CompileKey, TritonKernel[Any]] = attrs.field(factory=dict, eq=False, repr=False)

    def kernel_for(self, key: CompileKey) -> TritonKernel[Any]:
        """The registered instance whose domains produced ``key`` (the first one, if several did)."""
        return self.owners.get(key, self.kernel)


@attrs.frozen
class Plan:
    """What a warm will compile: kernels with their keys, for one config and platform."""

    config: WarmConfig = attrs.field(eq=False, repr=False)
    platform: Platform
    kernels: tuple[KernelPlan, ...]
    skipped: tuple[Skipped, ...] = ()
    plugins: tuple[str, ...] = ()
    plugin_problems: tuple[str, ...] = ()

    @property
    def num_keys(self) -> int:
        """Total distinct keys over all kernels."""
        return sum(len(k.keys) for k in self.kernels)

    def items(self) -> Iterator[tuple[KernelPlan, CompileKey]]:
        """Every ``(kernel plan, key)`` pair, in order."""
        for kp in self.kernels:
            for key in kp.keys:
                yield kp, key

    def jits(self) -> dict[str, Any]:
        """Every ``@triton.jit`` function the plan's kernels may launch, by Triton's full name."""
        return {_triton.full_name(j): j for kp in self.kernels for j in kp.kernel.jits() if j is not None}

    def kernel(self, name: str) -> KernelPlan:
        """The plan of one kernel by name.

        :raises KeyError: if the plan has no such kernel.
        """
        for kp in self.kernels:
            if kp.name == name:
                return kp
        raise KeyError(f"kernel {name!r} is not in this plan (kernels: {[k.name for k in self.kernels]})")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable description of the plan."""
        return {
            "platform": self.platform.target,
            "model_type": self.config.model_type,
            "plugins": list(self.plugins),
            "plugin_problems": list(self.plugin_problems),
            "num_kernels": len(self.kernels),
            "num_keys": self.num_keys,
            "kernels": [
                {"name": k.name, "plugins": list(k.plugins), "keys": [key.to_json() for key in k.keys]}
                for k in self.kernels
            ],
            "skipped": [attrs.asdict(s) for s in self.skipped],
        }


def loaded_jits(plugins: Iterable[Any] = (), *, entry_points: bool = True) -> dict[str, Any]:
    """The ``@triton.jit`` functions of every kernel class defined in this process, by Triton's full
    name, once the installed plugins (and ``plugins``) are loaded: what a pack may supply binaries
    for. Nothing is imported on behalf of a pack; a plugin that fails to load is skipped.
    """
    from .plugins import load_plugins

    load_plugins(plugins, entry_points=entry_points, on_plugin_error="skip")
    found: dict[str, Any] = {}
    todo: list[type[Any]] = [TritonKernel]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        jit = cls.__dict__.get("jit")
        if _triton.is_jit(jit):
            found[_triton.full_name(jit)] = jit
    return found
