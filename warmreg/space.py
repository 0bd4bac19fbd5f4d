"""The warmup space of a kernel: the image of ``dispatch`` over the declared domains.

``keys = {dispatch(point) for point in product(domains) if when(point)}``, deduplicated and
sorted. Inputs used only by ``when`` never reach ``dispatch``, so they cannot become key fields.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ConfigError, KernelContractError
from .kernel import K, TritonKernel

__all__ = ["enumerate_keys"]


def enumerate_keys(kernel: TritonKernel[K], domains: Mapping[str, Iterable[Any]]) -> tuple[K, ...]:
    """All compile keys ``kernel`` can produce over ``domains``.

    :param kernel: the kernel whose ``dispatch`` and ``when`` are evaluated.
    :param domains: runtime input name to the values it takes.
    :returns: the distinct keys, sorted.
    :raises KernelContractError: if ``dispatch`` needs an input no domain provides, returns something
        that is not the kernel's key type, or raises.
    """
    params = kernel.dispatch_params()
    names = list(domains)
    missing = [p for p in params if p not in domains]
    if missing:
        raise KernelContractError(
            kernel.name, f"dispatch reads {missing} but domains() declares only {names}", fix="declare a domain for each"
        )
    values = [tuple(domains[n]) for n in names]
    empty = [n for n, v in zip(names, values) if not v]
    if empty:
        raise KernelContractError(kernel.name, f"domain {empty[0]!r} is empty", fix="give it at least one value")
    key_type = getattr(type(kernel), "key_type", None)
    keys: set[K] = set()
    for combo in itertools.product(*values):
        point = dict(zip(names, combo))
        if not kernel.when(**point):
            continue
        try:
            key = kernel.dispatch(**{p: point[p] for p in params})
        except ConfigError:
            raise
        except Exception as exc:
            raise KernelContractError(kernel.name, f"dispatch raised {exc!r} at {_show(point)}") from exc
        if key_type is not None and not isinstance(key, key_type):
            raise KernelContractError(
                kernel.name, f"dispatch returned {type(key).__name__}, not {key_type.__name__}", fix="return the key type"
            )
        if key not in keys:
            key.validate()
            keys.add(key)
    return tuple(sorted(keys))


def _show(point: Mapping[str, Any]) -> str:
    def one(v: Any) -> str:
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            return f"tensor{tuple(v.shape)}:{v.dtype}"
        return repr(v)

    return "{" + ", ".join(f"{k}={one(v)}" for k, v in point.items()) + "}"
