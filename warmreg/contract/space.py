"""The warmup space of a kernel: the image of ``dispatch`` over the declared domains.

``keys = {dispatch(point) for point in product(domains) if when(point)}``, deduplicated and
sorted. Inputs used only by ``when`` never reach ``dispatch``, so they cannot become key fields.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..values.errors import ConfigError, KernelContractError
from .kernel import K, TritonKernel

__all__ = ["Domains", "enumerate_keys"]

#: What ``TritonKernel.domains`` returns: a product of per-input values, or explicit points.
Domains = Mapping[str, Iterable[Any]] | Iterable[Mapping[str, Any]]


def _points(kernel: TritonKernel[Any], domains: Domains, params: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    if isinstance(domains, Mapping):
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
        for combo in itertools.product(*values):
            yield dict(zip(names, combo))
        return
    count = 0
    for point in domains:  # explicit points: inputs that vary together (one T for q, k and v)
        missing = [p for p in params if p not in point]
        if missing:
            raise KernelContractError(kernel.name, f"a domain point lacks {missing}", fix="give every point each input dispatch reads")
        count += 1
        yield dict(point)
    if not count:
        raise KernelContractError(kernel.name, "domains() returned no points", fix="return at least one point")


def enumerate_keys(kernel: TritonKernel[K], domains: Domains) -> tuple[K, ...]:
    """All compile keys ``kernel`` can produce over ``domains``.

    :param kernel: the kernel whose ``dispatch`` and ``when`` are evaluated.
    :param domains: either runtime input name to the values it takes (the product is enumerated), or
        an iterable of points (dicts of input name to value) for inputs that vary together.
    :returns: the distinct keys, sorted; each key's last point is kept on ``kernel`` as its default
        :meth:`~warmreg.TritonKernel.warmup_inputs`.
    :raises KernelContractError: if ``dispatch`` needs an input no domain provides, returns something
        that is not the kernel's key type, or raises.
    """
    params = kernel.dispatch_params()
    key_type = getattr(type(kernel), "key_type", None)
    keys: set[K] = set()
    witnesses = vars(kernel).setdefault("_witnesses", {})  # key -> its last point: the default warmup_inputs
    for point in _points(kernel, domains, params):
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
        witnesses[key] = point
    return tuple(sorted(keys, key=lambda k: k.sort_key()))  # one sort key per key, not two per comparison


def _show(point: Mapping[str, Any]) -> str:
    shown = (f"tensor{tuple(v.shape)}:{v.dtype}" if hasattr(v, "shape") and hasattr(v, "dtype") else repr(v) for v in point.values())
    return "{" + ", ".join(f"{k}={v}" for k, v in zip(point, shown)) + "}"
