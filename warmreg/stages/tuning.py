"""Autotuned kernels: every candidate compiled at warm, one chosen on the GPU before serving, kept.

A kernel that declares ``tune_configs`` (:class:`~warmreg.TuneConfig`) has one compile key per
candidate of each tuning key (``config=i``; planning expands them), so warm, packs and the disk
cache hold every candidate's binary, a CPU build for a named GPU target included. On the local GPU
the :class:`Tune` stage then, once every binary is loaded:

- takes the choice kept in the cache for this device and Triton release (a second warm, or a warm
  from a pack on a host that tuned before, benchmarks nothing);
- otherwise launches each candidate on the kernel's :meth:`~warmreg.TritonKernel.tuning_inputs`
  (Triton's ``do_bench``, median) and keeps the fastest: first a short screen of every candidate, then
  the full measurement of those within :data:`CLOSE` of the screen's fastest (a candidate clearly
  slower costs a screen, not a full measurement; a lone finalist is chosen from the screen);
- records the choices in :data:`warmreg.runtime.launch.TUNED`, which every runtime launch reads, and in
  ``<Triton cache>/warmreg-tuning/<device>-triton-<release>.json`` (written atomically, merged
  under a lock, so concurrent ranks lose nothing).

A key warm did not tune launches candidate 0 and is an ``autotune`` miss of the JIT monitor; warmreg
never benchmarks while serving. A tuned choice file that is unreadable, or an entry whose candidates
no longer match the kernel's, is ignored (the key is tuned again), never trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import triton

from .. import _triton
from .._triton import cache as _triton_cache
from ..pipeline.stage import Stage
from ..values.errors import KernelContractError, WarmregError
from ..values.key import CompileKey
from .pack_format import PackChoice

if TYPE_CHECKING:  # the launch state imports torch: a pack install that only keeps choices needs neither
    from ..pipeline.bind import Task
    from ..pipeline.planning import KernelPlan, Plan

__all__ = ["CLOSE", "SETTLE_MS", "Choice", "Tune", "choices_from_file", "choices_path", "keep", "pack_choices", "tuning_key"]

log = logging.getLogger("warmreg.stages.tuning")
_FORMAT = 1
#: A choice file larger than this is not read (it holds a few hundred bytes per tuning key).
_MAX_BYTES = 8 * 1024 * 1024
#: Candidates whose screened time is within this fraction of the fastest's are measured in full.
CLOSE = 0.05
#: The warmup of each candidate after a tuning key's first: the GPU's clocks are up by then.
SETTLE_MS = 1.0


def tuning_key(key: CompileKey) -> CompileKey:
    """The tuning key of a candidate key (``config=None``)."""
    return attrs.evolve(key, config=None)  # type: ignore[call-arg]


@attrs.frozen(kw_only=True)
class Choice:
    """The candidate chosen for one tuning key, and how.

    :param source: ``benchmark`` (measured in this warm), ``kept`` (read from the choice file) or
        ``only`` (one candidate compiled: nothing to compare).
    :param microseconds: the median time of each candidate benchmarked, by candidate index: its full
        measurement where it was a finalist, else its screen.
    :param finalists: the candidates measured in full (within :data:`CLOSE` of the screen's fastest).
    """

    kernel: str
    key: CompileKey
    config: int
    source: str
    microseconds: dict[int, float] = attrs.field(factory=dict)
    finalists: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel, "key": self.key.to_json(), "config": self.config, "source": self.source,
            "microseconds": {str(i): us for i, us in self.microseconds.items()}, "finalists": list(self.finalists),
        }  # fmt: skip


def choices_path(device_name: str) -> Path:
    """The choice file of this device and Triton release in Triton's cache directory."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name).strip("_") or "gpu"
    return Path(_triton_cache.cache_dir()) / "warmreg-tuning" / f"{slug}-triton-{triton.__version__}.json"


def _candidates_id(kp: KernelPlan) -> list[str]:
    return [str(c) for c in kp.kernel.tune_configs]


def _entry_id(kernel: str, key: CompileKey) -> str:
    return json.dumps([kernel, key.to_json()], sort_keys=True)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of a choice file, by entry id; an unreadable file reads as empty (re-tune)."""
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring the tuning choices in %s: %s", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
        log.warning("ignoring the tuning choices in %s: not a format-%d choice file", path, _FORMAT)
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(k, str) and isinstance(v, dict)}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, new: dict[str, dict[str, Any]], device_name: str) -> None:
    """Merge ``new`` into the choice file: read, update and replace it atomically, under its lock."""
    with _locked(path):
        entries = {**_read(path), **new}
        body = json.dumps({"format": _FORMAT, "device": device_name, "triton": triton.__version__, "entries": entries})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _kept(entry: dict[str, Any] | None, candidates: list[str], compiled: list[int]) -> int | None:
    """The kept choice, if the entry is well formed, its candidates are the kernel's and it compiled."""
    if entry is None or entry.get("candidates") != candidates:
        return None
    index = entry.get("config")
    return index if isinstance(index, int) and not isinstance(index, bool) and index in compiled else None


def pack_choices(plan: Plan, choices: list[Choice], device_name: str) -> list[PackChoice]:
    """The choices of a warm, as a pack carries them (so a serving host benchmarks nothing)."""
    candidates = {kp.name: _candidates_id(kp) for kp in plan.kernels if kp.kernel.tune_configs}
    return [
        PackChoice(kernel=c.kernel, key=c.key.to_json(), config=c.config, candidates=candidates[c.kernel], device=device_name)
        for c in choices
    ]


def choices_from_file(plan: Plan, path: str | os.PathLike[str]) -> list[PackChoice]:
    """The choices a GPU host kept (its ``warmreg-tuning/*.json``) for ``plan``'s tuning keys, for a
    pack built elsewhere (a CPU build for that GPU); entries whose candidates differ are left out.

    :raises WarmregError: if the file is not a choice file.
    """
    file = Path(path)
    entries = _read(file)
    if not entries:
        raise WarmregError(f"{file} holds no tuning choices warmreg reads", fix="pass a warmreg-tuning/*.json file of a GPU host's Triton cache")
    device = json.loads(file.read_text()).get("device")
    if not isinstance(device, str) or not device:
        raise WarmregError(f"{file} names no device", fix="pass a warmreg-tuning/*.json file written by warm")
    out = []
    for kp in plan.kernels:
        if not kp.kernel.tune_configs:
            continue
        candidates = _candidates_id(kp)
        for base in dict.fromkeys(tuning_key(k) for k in kp.keys):
            index = _kept(entries.get(_entry_id(kp.name, base)), candidates, list(range(len(candidates))))
            if index is not None:
                out.append(PackChoice(kernel=kp.name, key=base.to_json(), config=index, candidates=candidates, device=device))
    return out


def keep(choices: tuple[PackChoice, ...] | list[PackChoice]) -> int:
    """Write a pack's choices into the choice file of each device they were made on; returns how many."""
    by_device: dict[str, dict[str, dict[str, Any]]] = {}
    for c in choices:
        entry_id = json.dumps([c.kernel, c.key], sort_keys=True)
        by_device.setdefault(c.device, {})[entry_id] = {"candidates": list(c.candidates), "config": c.config, "microseconds": {}}
    for device, entries in by_device.items():
        _write(choices_path(device), entries, device)
    return len(choices)


class Tune(Stage):
    """The stage that chooses each tuned kernel's candidate on the local GPU, after loading.

    :ivar choices: every choice made or kept in this warm.
    :ivar seconds: time spent benchmarking.
    """

    name = "tuning"

    def __init__(self, *, warmup_ms: float = 5.0, rep_ms: float = 20.0, screen_ms: float = 4.0) -> None:
        self.warmup_ms, self.rep_ms, self.screen_ms = warmup_ms, rep_ms, screen_ms
        self.choices: list[Choice] = []
        self.seconds = 0.0

    @classmethod
    def for_plan(cls, plan: Plan) -> Tune | None:
        """The stage, if ``plan`` is for the local GPU and has a tuned kernel."""
        return cls() if plan.platform.local and any(kp.kernel.tune_configs for kp in plan.kernels) else None

    def section(self) -> dict[str, Any]:
        """Each choice (:meth:`Choice.to_json`: kernel, key, config, source, microseconds) and the time it took."""
        return {"choices": [c.to_json() for c in self.choices], "seconds": self.seconds}

    def after_load(self, plan: Plan, tasks: list[Task]) -> None:
        from ..runtime.launch import TUNED

        start = time.perf_counter()
        ok = {(t.kp.name, t.key) for t in tasks if t.status != "failed"}
        device_name = _triton.device_name()
        path = choices_path(device_name)
        kept = _read(path)
        new: dict[str, dict[str, Any]] = {}
        for kp in plan.kernels:
            if not kp.kernel.tune_configs:
                continue
            candidates = _candidates_id(kp)
            bases = dict.fromkeys(tuning_key(k) for k in kp.keys)
            for base in bases:
                compiled = [i for i in range(len(candidates)) if (kp.name, attrs.evolve(base, config=i)) in ok]  # type: ignore[call-arg]
                if not compiled:
                    continue  # every candidate failed: the report says so
                entry_id = _entry_id(kp.name, base)
                index = _kept(kept.get(entry_id), candidates, compiled)
                if index is not None:
                    choice = Choice(kernel=kp.name, key=base, config=index, source="kept")
                elif len(compiled) == 1:
                    choice = Choice(kernel=kp.name, key=base, config=compiled[0], source="only")
                else:
                    choice = self._benchmark(kp, base, compiled)
                if choice.source != "kept":
                    new[entry_id] = {"candidates": candidates, "config": choice.config, "microseconds": choice.microseconds}
                TUNED.setdefault(kp.name, {})[base] = choice.config
                self.choices.append(choice)
        if new:
            try:
                _write(path, new, device_name)
            except OSError as exc:  # the choices hold for this process; the next warm benchmarks again
                log.warning("could not keep the tuning choices in %s: %s", path, exc)
        self.seconds = time.perf_counter() - start

    def _benchmark(self, kp: KernelPlan, base: CompileKey, compiled: list[int]) -> Choice:
        from ..runtime.launch import capture, use_config

        kernel = kp.kernel_for(attrs.evolve(base, config=compiled[0]))  # type: ignore[call-arg]
        device = _triton.torch_device()
        inputs = kernel.tuning_inputs(base, device)
        launcher = getattr(kernel, kernel.launcher)
        with capture() as probe:
            launcher(**inputs)
        if probe.key != base:
            diff = ", ".join(str(d) for d in base.diff(probe.key)) if probe.key is not None else "no launch"
            raise KernelContractError(
                kp.name, f"tuning_inputs({base}) launch key {probe.key} ({diff})",
                fix="make tuning_inputs build inputs whose dispatch gives back the same tuning key",
            )  # fmt: skip
        def measure(indices: list[int], rep_ms: float, first_warmup_ms: float) -> dict[int, float]:
            times: dict[int, float] = {}
            for n, index in enumerate(indices):
                warmup = first_warmup_ms if n == 0 else SETTLE_MS
                try:
                    with use_config(index):
                        times[index] = _triton.benchmark(lambda: launcher(**inputs), warmup_ms=warmup, rep_ms=rep_ms) * 1e3
                except Exception as exc:  # a candidate that cannot run here is not chosen
                    log.warning("candidate %d of %s %s does not run: %s", index, kp.name, base, exc)
            return times

        times = measure(compiled, self.screen_ms, self.warmup_ms)  # the first candidate brings the clocks up
        if not times:
            raise WarmregError(f"no candidate of {kp.name} {base} runs on this GPU", fix="check the kernel's tune_configs")
        fastest = min(times.values())
        finalists = [i for i in times if times[i] <= fastest * (1 + CLOSE)]
        if len(finalists) > 1:
            full = measure(finalists, self.rep_ms, SETTLE_MS)
            times.update(full)
            finalists = list(full) or finalists
        best = min(finalists, key=lambda i: (times[i], i))
        return Choice(kernel=kp.name, key=base, config=best, source="benchmark", microseconds=times, finalists=tuple(finalists))
