"""Plugin discovery through the ``warmreg`` entry-point group, with pluggy.

Policy (documented in the README): a plugin whose import fails with ``ImportError`` (a missing
optional dependency) is skipped, and the reason is logged and listed in the plan; any other error
while importing a plugin or running its hook raises :class:`~warmreg.PluginError` naming the plugin,
unless the caller passes ``on_plugin_error="skip"``, which skips that plugin with its reason and lets
the others warm.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import pluggy

from ..contract import hookspecs
from ..support.entry_points import entry_points as installed_entry_points
from ..values.errors import PluginError, WarmregError

if TYPE_CHECKING:
    from ..contract.registry import Registry

__all__ = [
    "HOOKS", "OnPluginError", "PluginProblem", "PluginSet", "call_register_hooks", "load_plugins",
]  # fmt: skip

log = logging.getLogger("warmreg")
OnPluginError = Literal["raise", "skip"]


@attrs.frozen
class PluginProblem:
    """A plugin that was skipped, and why."""

    plugin: str
    reason: str

    def __str__(self) -> str:
        return f"{self.plugin}: {self.reason}"


@attrs.frozen
class PluginSet:
    """Loaded plugins and the ones skipped, with reasons."""

    manager: pluggy.PluginManager = attrs.field(eq=False, repr=False)
    names: tuple[str, ...]
    problems: tuple[PluginProblem, ...]


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name}:{ep.name}" if dist is not None else ep.name


def load_plugins(
    extra: Iterable[Any] = (), *, entry_points: bool = True, on_plugin_error: OnPluginError = "raise"
) -> PluginSet:
    """Load the installed plugins (entry-point group ``warmreg``) and any ``extra`` plugin objects.

    :param extra: plugin modules or objects to register in addition (engines, tests).
    :param entry_points: whether to load installed distributions' entry points.
    :param on_plugin_error: ``"raise"`` or ``"skip"`` a plugin whose import raises something other
        than ``ImportError``.
    :raises PluginError: naming the plugin, under ``on_plugin_error="raise"``.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    problems: list[PluginProblem] = []
    if entry_points:
        seen: set[str] = set()
        for ep in sorted(installed_entry_points(hookspecs.PROJECT), key=lambda e: e.name):
            name = _dist_name(ep)
            if ep.name in seen:
                continue
            seen.add(ep.name)
            try:
                plugin = ep.load()
            except ImportError as exc:
                problems.append(PluginProblem(name, f"skipped, import failed: {exc}"))
                log.warning("warmreg plugin %s skipped: %s", name, exc)
                continue
            except Exception as exc:
                if on_plugin_error == "raise":
                    raise PluginError(name, f"import raised {exc!r}", fix="fix or uninstall the plugin") from exc
                problems.append(PluginProblem(name, f"skipped, import raised {exc!r}"))
                log.warning("warmreg plugin %s skipped: %r", name, exc)
                continue
            _register(pm, plugin, ep.name)
    for i, plugin in enumerate(extra):
        _register(pm, plugin, getattr(plugin, "__name__", f"extra-{i}"))
    names = tuple(name for name, _ in pm.list_name_plugin())
    return PluginSet(manager=pm, names=names, problems=tuple(problems))


#: The hooks a plugin may implement (``warmreg.contract.hookspecs``).
HOOKS = ("warmreg_model_types", "warmreg_pack_functions", "warmreg_register_kernels")


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Register ``plugin``, refusing one that implements no warmreg hook or names one that does not
    exist (a typo, or a hook without ``@warmreg.hookimpl``), which would otherwise warm nothing."""
    known = ", ".join(HOOKS)
    unknown = sorted(a for a in dir(plugin) if a.startswith("warmreg_") and a not in HOOKS and callable(getattr(plugin, a, None)))
    if unknown:
        raise PluginError(name, f"defines {', '.join(unknown)}, which is not a warmreg hook", fix=f"name it one of: {known}")
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(name, f"hook signature does not match the spec: {exc}", fix="see warmreg.contract.hookspecs") from exc
    except ValueError as exc:
        raise PluginError(name, f"cannot be registered: {exc}") from exc
    if not pm.get_hookcallers(plugin):
        pm.unregister(plugin)
        plain = [h for h in HOOKS if callable(getattr(plugin, h, None))]
        why = f"{', '.join(plain)} lacks @warmreg.hookimpl" if plain else "it implements no warmreg hook"
        raise PluginError(name, f"registers nothing: {why}", fix=f"mark each of its hooks ({known}) with @warmreg.hookimpl")


def call_register_hooks(
    plugins: PluginSet, registry: Registry, config: Any, platform: Any, on_plugin_error: OnPluginError
) -> list[PluginProblem]:
    """Call every plugin's ``warmreg_register_kernels`` in its own registry scope, so one failure
    is attributed to its plugin (and, skipped, registers nothing).

    :returns: the plugins skipped under ``on_plugin_error="skip"``.
    """
    kwargs = {"registry": registry, "config": config, "platform": platform}
    problems: list[PluginProblem] = []
    for impl in plugins.manager.hook.warmreg_register_kernels.get_hookimpls():
        if not _serves(plugins, impl.plugin, config.model_type):
            continue  # another family's config: the plugin's hook is not called
        try:
            with registry.scope(impl.plugin_name):
                impl.function(**{a: kwargs[a] for a in impl.argnames})
        except WarmregError:
            raise
        except Exception as exc:
            if on_plugin_error == "raise":
                raise PluginError(
                    impl.plugin_name, f"warmreg_register_kernels raised {exc!r}", fix="fix the plugin or pass on_plugin_error='skip'"
                ) from exc
            problems.append(PluginProblem(impl.plugin_name, f"skipped, warmreg_register_kernels raised {exc!r}"))
            log.warning("warmreg plugin %s skipped: %r", impl.plugin_name, exc)
    return problems


def _serves(plugins: PluginSet, plugin: Any, model_type: str) -> bool:
    """Whether ``plugin`` serves ``model_type``: the model types it declares include it, or it declares
    none (its ``warmreg_register_kernels`` then reads every config)."""
    caller = plugins.manager.hook.warmreg_model_types
    impls = [i for i in caller.get_hookimpls() if i.plugin is plugin]
    return not impls or any(model_type in cast("list[str]", impl.function()) for impl in impls)
