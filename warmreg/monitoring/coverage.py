"""Coverage: per kernel, keys declared, compiled at warmup, hit at runtime, missed, warmed but unused.

An autotuned kernel declares every candidate of each tuning key; the candidates warm's tuning did
not choose are counted apart (``not_chosen``), not as unused.

Built from a :class:`~warmreg.WarmReport` and what a monitor saw (its snapshot, or a record file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from ..pipeline.report import WarmReport
from ..values.errors import WarmregError
from ..values.key import CompileKey
from . import Miss

__all__ = ["Coverage", "KernelCoverage", "coverage", "load_observations"]


@attrs.frozen(kw_only=True)
class KernelCoverage:
    """Coverage of one kernel."""

    kernel: str
    declared: int
    compiled: int
    hit: int
    missed: int
    unused: int
    missed_keys: tuple[str, ...] = ()
    not_chosen: int = 0


@attrs.frozen
class Coverage:
    """Coverage of a deployment; :attr:`complete` is what CI asserts."""

    kernels: tuple[KernelCoverage, ...]
    misses: tuple[Miss, ...]

    @property
    def complete(self) -> bool:
        """No runtime miss of any kind."""
        return not self.misses

    def to_json(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "kernels": [attrs.asdict(k) for k in self.kernels],
            "misses": [m.to_json() for m in self.misses],
        }


def load_observations(path: str | Path) -> tuple[dict[str, set[CompileKey]], list[Miss]]:
    """Read a monitor snapshot (``Monitor.save``, JSON) or a record file (JSON lines).

    :raises WarmregError: naming the file if it is neither.
    """
    from .replay import read_records

    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return {}, read_records(path)
    if isinstance(data, dict) and "misses" in data:
        used = {k: {CompileKey.from_json(j) for j in v} for k, v in data.get("used", {}).items()}
        return used, [Miss.from_json(m) for m in data["misses"]]
    if isinstance(data, dict) and "kind" in data:  # a record file with a single line
        return {}, [Miss.from_json(data)]
    raise WarmregError(f"{path} is neither a monitor snapshot nor a record file", fix="pass Monitor.save() output or a record file")


def coverage(report: WarmReport | None, used: dict[str, set[CompileKey]], misses: list[Miss]) -> Coverage:
    """Combine what warm compiled with what runtime used and missed."""
    declared: dict[str, set[CompileKey]] = {}
    compiled: dict[str, int] = {}
    chosen = {(c["kernel"], json.dumps(c["key"], sort_keys=True)): c["config"] for c in (report.stage("tuning").get("choices", ()) if report else ())}
    for r in report.results if report else ():
        declared.setdefault(r.kernel, set()).add(r.key)
        compiled[r.kernel] = compiled.get(r.kernel, 0) + (r.status != "failed")
    names = sorted(set(declared) | set(used) | {m.kernel or m.jit_name for m in misses})
    rows = []
    for name in names:
        mine = [m for m in misses if (m.kernel or m.jit_name) == name]
        keys_used = used.get(name, set()) - {m.runtime_key for m in mine if m.runtime_key is not None}
        passed_over = {k for k in declared.get(name, set()) if _not_chosen(name, k, chosen)}
        rows.append(
            KernelCoverage(
                kernel=name,
                declared=len(declared.get(name, ())),
                compiled=compiled.get(name, 0),
                hit=len(keys_used & declared.get(name, set())) if declared else len(keys_used),
                missed=len(mine),
                unused=len(declared.get(name, set()) - keys_used - passed_over),
                missed_keys=tuple(str(m.runtime_key) if m.runtime_key else (m.triton_key or m.kind) for m in mine),
                not_chosen=len(passed_over - keys_used),
            )
        )
    return Coverage(tuple(rows), tuple(misses))


def _not_chosen(kernel: str, key: CompileKey, chosen: dict[tuple[str, str], int]) -> bool:
    """Whether ``key`` is a candidate of a tuning key for which warm chose another candidate."""
    index = getattr(key, "config", None)
    if index is None:
        return False
    base = json.dumps(attrs.evolve(key, config=None).to_json(), sort_keys=True)  # type: ignore[call-arg]
    return chosen.get((kernel, base), index) != index
