"""Plans in plugin tests: example configs, a plugin of a few op modules, warmup inputs that give back their keys.

:func:`config_loader` reads example configs with serving values overridden; :class:`RegisterPlugin` registers
through a few op modules' ``register`` functions; :func:`assert_warmup_inputs_reproduce` checks that a kernel's
warmup inputs give back their keys; :func:`materialize` turns warmup inputs (meta tensors) into real, zero-filled
tensors of the same layout, to launch a key's binary on them.

A plugin's tests plan a deployment without installing the plugin: ``warmreg.plan(config, target="cuda:90",
plugins=[RegisterPlugin(op.register, model=Model.from_config)], entry_points=False)`` plans only that op, as
the plugin's own hook would register it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import warmreg

from ..contract.kernel import _real

__all__ = ["RegisterPlugin", "assert_warmup_inputs_reproduce", "config_loader", "materialize"]


def config_loader(directory: str | Path) -> Callable[..., dict[str, Any]]:
    """A loader of the config files in ``directory``.

    :returns: ``load(name, **serving)``: ``<directory>/<name>.json`` as a fresh dict, its ``serving`` section
        updated with ``serving``; what :func:`warmreg.plan` and :meth:`warmreg.WarmConfig.load` take.
    """
    root = Path(directory)

    def load(name: str, **serving: Any) -> dict[str, Any]:
        """``<directory>/<name>.json`` as a fresh dict, with ``serving`` values overridden."""
        data: dict[str, Any] = json.loads((root / f"{name}.json").read_text())
        data.setdefault("serving", {}).update(serving)
        return data

    return load


class RegisterPlugin:
    """A plugin object registering through the given functions only, as the plugin's hook does through all.

    :param registers: each called as ``register(registry, config, platform)``, or, with ``model``, as
        ``register(registry, model(config), config, platform)`` (the op modules of warmreg's plugins).
    :param model: reads the family's model values from the config once per hook call (``Model.from_config``).
    """

    def __init__(self, *registers: Callable[..., None], model: Callable[[warmreg.WarmConfig], Any] | None = None) -> None:
        self.registers = registers
        self.model = model

    @warmreg.hookimpl
    def warmreg_register_kernels(
        self, registry: warmreg.Registry, config: warmreg.WarmConfig, platform: warmreg.Platform
    ) -> None:
        """Call every register function."""
        model = () if self.model is None else (self.model(config),)
        for register in self.registers:
            register(registry, *model, config, platform)


def assert_warmup_inputs_reproduce(kernel: warmreg.TritonKernel[Any], keys: Iterable[warmreg.CompileKey]) -> None:
    """Each key's :meth:`~warmreg.TritonKernel.warmup_inputs`, given to ``dispatch``, give back that key (for a
    tuned kernel, its tuning key: ``config=None``). Warm checks the same through the whole launch code; this is
    the cheap unit test, also for keys with field values a plan does not produce.

    :raises AssertionError: naming the key and the fields ``dispatch`` gave otherwise.
    """
    checked = 0
    for key in keys:
        inputs = kernel.warmup_inputs(key)
        got = kernel.dispatch(**{p: inputs[p] for p in kernel.dispatch_params()})
        want = type(key)(**{**key.fields(), "config": None}) if kernel.tune_configs else key
        assert got == want, f"{kernel.name}: warmup_inputs({want}) dispatch to {got}: " + ", ".join(
            str(d) for d in want.diff(got)
        )
        checked += 1
    assert checked, f"{kernel.name}: no keys to check"


def materialize(value: Any, device: Any = "cpu") -> Any:
    """``value`` with every meta tensor in it made real on ``device``: zero-filled, with the meta tensor's shape,
    strides and storage offset over a storage of the same size (so its alignment and its views are the ones the key
    was specialized for). Lists, tuples, named tuples and attrs classes (a launcher argument grouping tensors) are
    rebuilt around their materialized items; anything else is returned as it is. The same as the default
    :meth:`~warmreg.TritonKernel.tuning_inputs` makes of warmup inputs (zero bytes viewed as each dtype)."""
    return _real(value, device)
