"""The JIT monitor: proves that nothing compiles (or loads, or autotunes) after warmup.

Modes: ``off``, ``warn`` (log and warn), ``error`` (raise :class:`JitMissError` *before* Triton
compiles, through its pre-compile hook ``jit_cache_hook``), ``record`` (append each miss as a JSON
line that ``warmreg replay`` compiles and ``warmreg report`` turns into coverage gaps).

warmreg's own compiles are told apart by scope (a context variable set while :func:`warmreg.warm`
binds and compiles), never by a global "warmup is over" flag, so one thread may warm while another
serves. Arming chains the hooks already installed; disarming restores them exactly. Arm and disarm
nest: the innermost armed mode is in force.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import attrs

from .. import _triton
from ..pipeline.report import WarmReport
from ..runtime.launch import (
    IN_WARMUP,
    add_launch_listener,
    add_untuned_listener,
    current_launch,
    remove_launch_listener,
    remove_untuned_listener,
)
from ..values.errors import JitMissError, WarmregError
from ..values.key import CompileKey

__all__ = ["KNOWLEDGE", "MODES", "JitMissError", "Miss", "MissKind", "Mode", "Monitor", "arm", "current", "disarm", "monitor", "note_launch"]

log = logging.getLogger("warmreg.monitor")
Mode = Literal["off", "warn", "error", "record"]
MissKind = Literal["compile", "load", "autotune"]
MODES: tuple[str, ...] = ("off", "warn", "error", "record")


@attrs.frozen(kw_only=True)
class Miss:
    """One thing that happened at runtime that warmup should have done.

    :param kind: ``compile`` (Triton's compile path), ``load`` (launcher build + module load at a first
        launch) or ``autotune`` (autotuner benchmarking).
    :param jit_name: the Triton function's full name.
    :param kernel: the registered warmreg kernel that owns it, or ``None`` if warmreg does not know it.
    :param runtime_key: the warmreg key of the launch, when it came through a warmreg launcher.
    :param nearest: the closest warmed key of that kernel and the fields that differ from it.
    :param specialization: Triton's specialization of the launch (signature, constexprs, attributes,
        options), and ``specialization_data``, Triton's own replayable serialization.
    """

    kind: MissKind
    jit_name: str
    kernel: str | None = None
    runtime_key: CompileKey | None = None
    nearest: CompileKey | None = None
    diff: tuple[str, ...] = ()
    triton_key: str | None = None
    triton_diff: tuple[str, ...] = ()
    specialization: dict[str, Any] = attrs.field(factory=dict)
    specialization_data: str | None = None
    target: str | None = None

    def explain(self) -> str:
        """A readable, multi-line explanation that makes the fix obvious."""
        owner = f"warmreg kernel {self.kernel!r}" if self.kernel else "a Triton kernel warmreg does not know (unregistered)"
        what = {"compile": "compile", "load": "module load / launcher build", "autotune": "autotuner benchmark"}[self.kind]
        lines = [f"runtime {what} of {self.jit_name} ({owner})"]
        if self.runtime_key is not None:
            lines.append(f"  runtime key: {self.runtime_key}")
        if self.nearest is not None:
            lines.append(f"  nearest warmed key: {self.nearest}")
            lines.append(f"  differs in: {'; '.join(self.diff) or 'nothing (the key was declared but not warmed in this process)'}")
        elif self.kernel:
            lines.append("  no key of this kernel was warmed in this process")
        if self.triton_diff:
            lines.append(f"  Triton specialization differs from the nearest warmed one in: {'; '.join(self.triton_diff)}")
        elif self.specialization.get("signature"):
            lines.append(f"  Triton specialization: {self.specialization}")
        if self.kind == "autotune" and self.runtime_key is not None:
            lines.append("  the key was launched with candidate 0: no warm on this GPU tuned it")
            lines.append("  fix: warm on the serving GPU before serving (warm benchmarks every tuned key after loading)")
        elif self.kernel:
            lines.append("  fix: add the missing value to the kernel's domains (or warm this config), then re-run warm")
        else:
            lines.append("  fix: register this kernel with a warmreg plugin so warm() compiles it")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        for name in ("runtime_key", "nearest"):
            key = getattr(self, name)
            data[name] = key.to_json() if key is not None else None
        data["diff"], data["triton_diff"] = list(self.diff), list(self.triton_diff)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Miss:
        fields = {f.name for f in attrs.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        for name in ("runtime_key", "nearest"):
            if kwargs.get(name) is not None:
                try:
                    kwargs[name] = CompileKey.from_json(kwargs[name])
                except WarmregError:
                    kwargs[name] = None
        kwargs["diff"], kwargs["triton_diff"] = tuple(kwargs.get("diff", ())), tuple(kwargs.get("triton_diff", ()))
        return cls(**kwargs)


class _Knowledge:
    """What warm() compiled in this process: owners of jit functions and warmed keys per kernel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: dict[str, str] = {}
        self.keys: dict[str, dict[CompileKey, str | None]] = {}
        self.declared: dict[str, set[CompileKey]] = {}
        self.by_jit: dict[str, list[tuple[CompileKey, str]]] = {}

    def clear(self) -> None:
        """Forget everything (tests; after ``_triton.forget_compiled``)."""
        with self.lock:
            self.owner.clear()
            self.keys.clear()
            self.declared.clear()
            self.by_jit.clear()

    def learn(self, report: WarmReport, jit_owners: dict[str, str]) -> None:
        with self.lock:
            self.owner.update(jit_owners)
            for r in report.results:
                self.declared.setdefault(r.kernel, set()).add(r.key)
                if r.status != "failed":
                    self.keys.setdefault(r.kernel, {})[r.key] = r.triton_key
                    if r.jit_name and r.triton_key:
                        self.by_jit.setdefault(r.jit_name, []).append((r.key, r.triton_key))


KNOWLEDGE = _Knowledge()


def _nearest_key(kernel: str, key: CompileKey) -> tuple[CompileKey | None, tuple[str, ...]]:
    warmed = list(KNOWLEDGE.keys.get(kernel, {}))
    if not warmed:
        return None, ()
    best = min(warmed, key=lambda k: (len(k.diff(key)), k.sort_key()))
    return best, tuple(str(d) for d in best.diff(key))


def _triton_diff(jit_name: str, triton_key: str | None, fn: Any) -> tuple[CompileKey | None, tuple[str, ...]]:
    """Nearest warmed Triton specialization of the same function, diffed parameter by parameter."""
    candidates = KNOWLEDGE.by_jit.get(jit_name, [])
    runtime = _triton.parse_specialization_key(triton_key) if triton_key else None
    if not candidates or runtime is None:
        return None, ()
    names = _triton.param_names(fn) if fn is not None else []
    best: tuple[int, CompileKey | None, tuple[str, ...]] = (10**9, None, ())
    for ckey, tkey in candidates:
        warmed = _triton.parse_specialization_key(tkey)
        if warmed is None:
            continue
        diffs = []
        for i, (a, b) in enumerate(zip(warmed[0], runtime[0])):
            if a != b:
                name = names[i] if i < len(names) else f"arg{i}"
                diffs.append(f"{name}: warmed {a} != runtime {b}")
        for opt in sorted(set(warmed[1]) | set(runtime[1])):
            if warmed[1].get(opt) != runtime[1].get(opt):
                diffs.append(f"option {opt}: warmed {warmed[1].get(opt)!r} != runtime {runtime[1].get(opt)!r}")
        if len(diffs) < best[0]:
            best = (len(diffs), ckey, tuple(diffs))
    return best[1], best[2]


@attrs.define
class _Counter:
    launches: int = 0
    misses: int = 0
    used: set[CompileKey] = attrs.field(factory=set)

    @property
    def hits(self) -> int:
        return max(0, self.launches - self.misses)


class Monitor:
    """One armed monitor: its mode, its record file and what it saw.

    Obtain it from :func:`arm` or :func:`monitor`; read :attr:`misses` and :meth:`counters`.
    """

    def __init__(self, mode: Mode, record: str | Path | None = None) -> None:
        if mode not in MODES:
            raise WarmregError(f"monitor mode {mode!r} is not one of {MODES}", fix="pick off, warn, error or record")
        if mode == "record" and record is None:
            record = None  # in memory only
        self.mode: Mode = mode
        self.record_path = Path(record) if record is not None else None
        self.misses: list[Miss] = []
        self._counters: dict[str, _Counter] = {}
        self._lock = threading.Lock()

    def counters(self) -> dict[str, dict[str, int]]:
        """Per kernel: ``launches``, ``hits``, ``misses`` and ``keys_used``."""
        with self._lock:
            return {
                name: {"launches": c.launches, "hits": c.hits, "misses": c.misses, "keys_used": len(c.used)}
                for name, c in sorted(self._counters.items())
            }

    def used_keys(self, kernel: str) -> frozenset[CompileKey]:
        """Keys of ``kernel`` launched while this monitor was armed."""
        with self._lock:
            return frozenset(self._counters.get(kernel, _Counter()).used)

    def snapshot(self) -> dict[str, Any]:
        """Counters, keys used and misses as JSON (what ``warmreg report`` reads)."""
        with self._lock:
            used = {name: [k.to_json() for k in sorted(c.used)] for name, c in sorted(self._counters.items())}
            misses = [m.to_json() for m in self.misses]
        return {"mode": self.mode, "counters": self.counters(), "used": used, "misses": misses}

    def save(self, path: str | Path) -> None:
        """Write :meth:`snapshot` to ``path``."""
        Path(path).write_text(json.dumps(self.snapshot(), indent=2))

    def _launched(self, kernel: str, key: CompileKey) -> None:
        with self._lock:
            counter = self._counters.setdefault(kernel, _Counter())
            counter.launches += 1
            counter.used.add(key)

    def _missed(self, miss: Miss) -> None:
        with self._lock:
            self.misses.append(miss)
            self._counters.setdefault(miss.kernel or miss.jit_name, _Counter()).misses += 1
            if self.mode == "record" and self.record_path is not None:
                with self.record_path.open("a") as f:
                    f.write(json.dumps(miss.to_json()) + "\n")
        if self.mode == "warn":
            log.warning("%s", miss.explain())
            warnings.warn(miss.explain(), RuntimeWarning, stacklevel=4)
        elif self.mode == "error":
            raise JitMissError(miss)


class _State:
    """The stack of armed monitors and the hooks installed while it is non-empty."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stack: list[Monitor] = []
        self.hook: _triton.HookHandle | None = None

    @property
    def top(self) -> Monitor | None:
        return self.stack[-1] if self.stack else None


_STATE = _State()


def _owner(jit_name: str) -> str | None:
    return KNOWLEDGE.owner.get(jit_name)


def _on_compile(request: _triton.CompileRequest) -> None:
    """Before every compile Triton runs (its pre-compile hook): a miss unless warmreg itself compiles."""
    active = _STATE.top
    if active is None or active.mode == "off" or IN_WARMUP.get():
        return
    launch = current_launch()
    kernel = launch[0] if launch else _owner(request.jit_name)
    runtime_key = launch[1] if launch else None
    nearest, diff = _nearest_key(kernel, runtime_key) if kernel and runtime_key is not None else (None, ())
    t_nearest, t_diff = _triton_diff(request.jit_name, request.key, request.jit)
    if nearest is None and t_nearest is not None:
        nearest, diff = t_nearest, ()
    miss = Miss(
        kind="compile",
        jit_name=request.jit_name,
        kernel=kernel,
        runtime_key=runtime_key,
        nearest=nearest,
        diff=diff,
        triton_key=request.key,
        triton_diff=t_diff,
        specialization=dict(request.specialization),
        specialization_data=request.specialization_data,
        target=_current_target(),
    )
    active._missed(miss)  # raises in error mode: before the compile


def _current_target() -> str | None:
    try:
        from ..contract.domains import runtime_platform

        local = runtime_platform()
        return local.target if local else None
    except Exception:
        return None


def _on_load(name: str) -> None:
    active = _STATE.top
    if active is None or active.mode == "off" or IN_WARMUP.get():
        return
    launch = current_launch()
    active._missed(Miss(kind="load", jit_name=name, kernel=launch[0] if launch else None, runtime_key=launch[1] if launch else None))


def _autotune_hook(name: str) -> None:
    active = _STATE.top
    if active is None or active.mode == "off" or IN_WARMUP.get():
        return
    active._missed(Miss(kind="autotune", jit_name=name, kernel=_owner(name)))


def _on_untuned(kernel: str, key: CompileKey) -> None:
    """A tuned warmreg kernel launched a key warm did not tune (it takes candidate 0)."""
    active = _STATE.top
    if active is None or active.mode == "off" or IN_WARMUP.get():
        return
    nearest, diff = _nearest_key(kernel, attrs.evolve(key, config=0))  # type: ignore[call-arg]
    jit_name = next((j for j, owner in KNOWLEDGE.owner.items() if owner == kernel), kernel)
    active._missed(Miss(kind="autotune", jit_name=jit_name, kernel=kernel, runtime_key=key, nearest=nearest, diff=diff))


def arm(mode: Mode = "error", *, record: str | Path | None = None) -> Monitor:
    """Arm a monitor (nested arms stack; the newest is in force) and return it.

    :param mode: ``off``, ``warn``, ``error`` or ``record``.
    :param record: with ``record``, a JSON-lines file to append misses to (kept in memory too).
    """
    mon = Monitor(mode, record)
    with _STATE.lock:
        if not _STATE.stack:
            _STATE.hook = _triton.install_compile_hook(_on_compile)
            _triton.add_load_hook(_on_load)
            _triton.wrap_autotuner_bench(_autotune_hook)
            add_launch_listener(note_launch)
            add_untuned_listener(_on_untuned)
        _STATE.stack.append(mon)
    return mon


def disarm(mon: Monitor | None = None) -> None:
    """Disarm ``mon`` (default: the newest); when none is left, restore the previous hooks exactly."""
    with _STATE.lock:
        if not _STATE.stack:
            return
        target = mon if mon is not None else _STATE.stack[-1]
        if target in _STATE.stack:
            _STATE.stack.remove(target)
        if not _STATE.stack:
            if _STATE.hook is not None:
                _triton.remove_compile_hook(_STATE.hook)
            _triton.remove_load_hook(_on_load)
            _triton.unwrap_autotuner_bench()
            _STATE.hook = None
            remove_launch_listener(note_launch)
            remove_untuned_listener(_on_untuned)


def current() -> Monitor | None:
    """The monitor in force, if any."""
    return _STATE.top


@contextmanager
def monitor(mode: Mode = "error", *, record: str | Path | None = None) -> Iterator[Monitor]:
    """``with warmreg.monitor("error"):`` arm for the block; disarm (restoring hooks) on exit, even on error."""
    mon = arm(mode, record=record)
    try:
        yield mon
    finally:
        disarm(mon)


def note_launch(kernel: str, key: CompileKey) -> None:
    """Count a warmreg launch (called by the launcher while armed)."""
    for mon in _STATE.stack:
        mon._launched(kernel, key)
