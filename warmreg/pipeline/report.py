"""``WarmReport``: what a warm declared, compiled, loaded from cache and failed, and how long each took."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from ..values.key import CompileKey

__all__ = ["KeyResult", "Status", "WarmReport"]

Status = Literal["compiled", "disk_cache", "memory", "failed"]


def _tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(items)


@attrs.frozen(kw_only=True)
class KeyResult:
    """The outcome of warming one key.

    :param status: ``compiled`` (paid for now), ``disk_cache`` (found in Triton's cache directory),
        ``memory`` (already loaded in this process) or ``failed``.
    :param seconds: compile (or cache read) time of this key in its worker.
    :param load_seconds: launcher build + module load at warm (local GPU only).
    :param triton_key: Triton's specialization key of the binary (what its JIT hooks report).
    :param binary_hash: Triton's cache hash of the binary.
    :param specialization_data: Triton's serialized specialization (what ``JITFunction.preload`` compiles).
    :param cache_files: the entry's metadata and binary in the local Triton cache (name -> path).
    """

    kernel: str
    key: CompileKey
    status: Status
    seconds: float = 0.0
    load_seconds: float = 0.0
    error: str | None = None
    triton_key: str | None = None
    binary_hash: str | None = None
    jit_name: str | None = None
    specialization_data: str | None = attrs.field(default=None, repr=False)
    cache_files: dict[str, str] = attrs.field(factory=dict, eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["key"] = self.key.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeyResult:
        return cls(**{**data, "key": CompileKey.from_json(data["key"])})


def _sections(value: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(name): dict(section) for name, section in value.items()}


@attrs.frozen(kw_only=True)
class WarmReport:
    """JSON-serializable result of :func:`warmreg.warm`.

    :param results: one :class:`KeyResult` per declared key.
    :param seconds: wall time of the whole warm (planning, compiling, loading).
    :param skipped: kernels whose predicate excluded them (``{kernel, plugin, reason}``); ``plugin_problems``
        the plugins skipped (``{plugin, reason}``).
    :param stages: each stage's own section, by the stage's name (:meth:`warmreg.pipeline.stage.Stage.section`:
        e.g. ``pack``, ``shard``, ``processes``, ``tuning``, ``rehearsal``); a section's ``summary``
        line joins :meth:`summary`.
    :param already_warm: this process had warmed this very plan, and every key was still in memory
        with its fast launch: nothing was done (the earlier warm's results, this call's time).
    """

    platform: str
    model_type: str
    triton_version: str
    workers: int
    seconds: float
    plan_seconds: float
    results: tuple[KeyResult, ...] = attrs.field(converter=_tuple)
    plugins: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    skipped: tuple[dict[str, str], ...] = attrs.field(default=(), converter=_tuple)
    plugin_problems: tuple[dict[str, str], ...] = attrs.field(default=(), converter=_tuple)
    stages: dict[str, dict[str, Any]] = attrs.field(factory=dict, converter=_sections)
    already_warm: bool = False

    @classmethod
    def of(cls, plan: Any, results: Iterable[KeyResult], stages: Iterable[Any], *, workers: int, seconds: float, plan_seconds: float) -> WarmReport:
        """The report of a warm of ``plan`` (a :class:`~warmreg.Plan`) that ran ``stages`` (each its section)."""
        import triton

        return cls(
            platform=plan.platform.target, model_type=plan.config.model_type, triton_version=triton.__version__,
            workers=workers, seconds=seconds, plan_seconds=plan_seconds, results=results, plugins=plan.plugins,
            skipped=tuple(attrs.asdict(s) for s in plan.skipped), plugin_problems=tuple(attrs.asdict(p) for p in plan.plugin_problems),
            stages={s.name: section for s in stages if (section := s.section()) is not None},
        )  # fmt: skip

    def stage(self, name: str) -> Mapping[str, Any]:
        """The section of the stage ``name`` (empty when that stage did not run)."""
        return self.stages.get(name, {})

    @property
    def declared(self) -> int:
        """Keys declared by the plan."""
        return len(self.results)

    def _count(self, *status: str) -> int:
        return sum(1 for r in self.results if r.status in status)

    @property
    def compiled(self) -> int:
        """Keys compiled during this warm."""
        return self._count("compiled")

    @property
    def from_cache(self) -> int:
        """Keys found in Triton's disk cache or already in memory."""
        return self._count("disk_cache", "memory")

    @property
    def failed(self) -> tuple[KeyResult, ...]:
        """The keys that failed, with their errors."""
        return tuple(r for r in self.results if r.status == "failed")

    @property
    def ok(self) -> bool:
        """Whether every declared key is warm."""
        return not self.failed

    def per_kernel(self) -> dict[str, dict[str, Any]]:
        """Per kernel: keys, compiled, cached, failed and summed compile seconds."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.results:
            row = out.setdefault(r.kernel, {"keys": 0, "compiled": 0, "cached": 0, "failed": 0, "seconds": 0.0})
            row["keys"] += 1
            row["seconds"] += r.seconds + r.load_seconds
            row["compiled" if r.status == "compiled" else "failed" if r.status == "failed" else "cached"] += 1
        return out

    def summary(self) -> str:
        """One line: keys declared / compiled / from cache / failed, seconds; then each stage's summary."""
        line = (
            f"{self.declared} keys over {len(self.per_kernel())} kernels for {self.platform}: "
            f"{self.compiled} compiled, {self.from_cache} from cache, {len(self.failed)} failed in {self.seconds:.2f} s"
        )
        return "; ".join([line, *(str(s["summary"]) for s in self.stages.values() if s.get("summary"))])

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["results"] = [r.to_json() for r in self.results]
        for name in ("plugins", "skipped", "plugin_problems"):
            data[name] = list(data[name])
        data["summary"] = {
            "declared": self.declared, "compiled": self.compiled, "from_cache": self.from_cache, "failed": len(self.failed),
            "per_kernel": self.per_kernel(),
        }  # fmt: skip
        return data

    def dumps(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WarmReport:
        """Read back :meth:`to_json` output (key types must be importable)."""
        fields = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["results"] = [KeyResult.from_json(r) for r in data["results"]]
        return cls(**kwargs)
