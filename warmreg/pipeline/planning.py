"""Planning: the kernels and keys a deployment needs, computed once, without compiling anything.

``plan`` loads the plugins, lets each register its kernels in its own registry scope, evaluates the
platform predicates, merges registrations of the same kernel by name (the Q/KV RMSNorm registered by
two families compiles once per distinct key) and computes each kernel's keys from its domains.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from .. import _triton
from ..contract.config import WarmConfig
from ..contract.kernel import TritonKernel
from ..contract.registry import Registration, Registry, Skipped
from ..contract.space import enumerate_keys
from ..values.errors import ConfigError, KernelContractError
from ..values.key import CompileKey
from ..values.platform import Platform, check_features, resolve_platform
from .plugins import OnPluginError, PluginProblem, call_register_hooks, load_plugins

__all__ = ["KernelPlan", "OnPluginError", "Plan", "Platform", "plan"]


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


@attrs.frozen(kw_only=True)
class Plan:
    """What a warm will compile: kernels with their keys, for one config and platform."""

    config: WarmConfig = attrs.field(eq=False, repr=False)
    platform: Platform
    kernels: tuple[KernelPlan, ...]
    skipped: tuple[Skipped, ...] = ()
    plugins: tuple[str, ...] = ()
    plugin_problems: tuple[PluginProblem, ...] = ()

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
            "plugin_problems": [attrs.asdict(p) for p in self.plugin_problems],
            "num_kernels": len(self.kernels),
            "num_keys": self.num_keys,
            "kernels": [
                {"name": k.name, "plugins": list(k.plugins), "keys": [key.to_json() for key in k.keys]}
                for k in self.kernels
            ],
            "skipped": [attrs.asdict(s) for s in self.skipped],
        }


def plan(
    config: Any,
    *,
    target: str | Platform | None = None,
    plugins: Iterable[Any] = (),
    entry_points: bool = True,
    on_plugin_error: OnPluginError = "raise",
    serving: Mapping[str, Any] | None = None,
) -> Plan:
    """The kernels and keys a deployment needs, without compiling anything.

    :param config: anything :meth:`WarmConfig.load` accepts.
    :param serving: serving settings that override those of ``config`` (e.g. a plain Hugging Face
        ``config.json`` with ``{"max_num_batched_tokens": 8192}``).
    :param target: ``None`` for the local GPU, or a target such as ``"cuda:90"``.
    :param plugins: extra plugin modules/objects besides the installed entry points.
    :param entry_points: load installed plugins (group ``warmreg``).
    :param on_plugin_error: ``"raise"`` or ``"skip"`` a plugin that fails (see :mod:`warmreg.pipeline.plugins`).
    :raises ConfigError: for a missing or invalid field, naming it, the plugin and the fix.
    :raises PluginError: for a broken plugin under ``on_plugin_error="raise"``.
    """
    _triton.check_version()
    cfg = WarmConfig.load(config, serving=serving)
    platform = resolve_platform(target)
    loaded = load_plugins(plugins, entry_points=entry_points, on_plugin_error=on_plugin_error)
    registry = Registry(cfg, platform)
    hook_problems = tuple(call_register_hooks(loaded, registry, cfg, platform, on_plugin_error))
    problems = loaded.problems + hook_problems
    check_features(platform)
    kernels = _kernel_plans(registry.registrations(), cfg, platform)
    if not kernels and not registry.skipped() and not hook_problems:
        _check_served(cfg, {t for types in loaded.manager.hook.warmreg_model_types() for t in types})
    failed = {p.plugin for p in hook_problems}
    return Plan(
        config=cfg,
        platform=platform,
        kernels=kernels,
        skipped=registry.skipped(),
        plugins=tuple(n for n in loaded.names if n not in failed),
        plugin_problems=problems,
    )


def _kernel_plans(registrations: Iterable[Registration], config: WarmConfig, platform: Platform) -> tuple[KernelPlan, ...]:
    """Every registered kernel's keys, registrations of one kernel name merged."""
    by_name: dict[str, list[Registration]] = {}
    for reg in registrations:
        by_name.setdefault(reg.kernel.name, []).append(reg)
    kernels = []
    for name in sorted(by_name):
        regs = by_name[name]
        owners: dict[CompileKey, TritonKernel[Any]] = {}
        for reg in regs:
            for key in _candidates(reg.kernel, enumerate_keys(reg.kernel, reg.kernel.domains(config, platform))):
                owners.setdefault(key, reg.kernel)  # each key is warmed by an instance that produced it
        plugins = tuple(sorted({r.plugin for r in regs}))
        kernels.append(KernelPlan(name=name, kernel=regs[0].kernel, keys=tuple(sorted(owners, key=CompileKey.sort_key)), plugins=plugins, owners=owners))
    return tuple(kernels)


def _candidates(kernel: TritonKernel[Any], keys: Iterable[CompileKey]) -> Iterator[CompileKey]:
    """The keys to compile: a tuned kernel's tuning keys, each once per autotune candidate."""
    if not kernel.tune_configs:
        yield from keys
        return
    for key in keys:
        names = {f.name for f in attrs.fields(type(key))}
        if "config" not in names or names & {"num_warps", "num_stages"}:
            raise KernelContractError(
                kernel.name, f"declares tune_configs, but its key {type(key).__name__} has no field config or has num_warps/num_stages",
                fix="give the key a field `config: int | None = None` and take num_warps/num_stages from the TuneConfigs",
            )  # fmt: skip
        if key.config is not None:  # type: ignore[attr-defined]
            raise KernelContractError(kernel.name, f"dispatch returned {key} with config set", fix="return config=None")
        yield from (attrs.evolve(key, config=i) for i in range(len(kernel.tune_configs)))  # type: ignore[call-arg]


def _check_served(config: WarmConfig, served: set[str]) -> None:
    """A plan with nothing in it: an error if no installed plugin serves this model type at all."""
    if served and config.model_type not in served:
        raise ConfigError(
            "model.model_type",
            f"is {config.model_type!r}, which no installed plugin serves (served: {', '.join(sorted(served))})",
            fix=(
                "check model_type, or install the warmreg plugin of this model family: warmreg-deepseek-v4 and "
                "warmreg-kimi-k3 are built from the warmreg repository's plugins/ (not on an index yet: "
                "pip install --find-links DIST warmreg-<family>, README 'Set up'); other families ship their own"
            ),
        )
