"""Warm inside an engine's start-up, switched on by environment variables: what the engine integrations
(``warmreg-vllm``, ``warmreg-sglang``) call from the engines' own plugin doors.

An engine process calls :func:`prefetch` early (before it loads weights), :func:`warm_once` where warm belongs
(the model built, the KV cache allocated, before graph capture) and :func:`arm_monitor` once the engine's own
warmup and capture are done. Nothing happens unless ``WARMREG_WARM`` is on; the settings are read once per call
from the environment, so every process of an engine (workers started by fork or spawn) sees the operator's:

``WARMREG_WARM``
    ``1`` (also ``true``, ``yes``, ``on``) to warm; unset, empty or ``0`` (``false``, ``no``, ``off``): nothing.
``WARMREG_PACK``
    a pack (directory or file) to install before warming; prefetched while the engine loads weights.
``WARMREG_MONITOR``
    ``off`` (default), ``warn``, ``error`` or ``record``: the JIT monitor armed after the engine's warmup.
``WARMREG_RECORD``
    with ``WARMREG_MONITOR=record``: the JSON-lines file misses are appended to.
``WARMREG_WORKERS``
    compile processes and threads (default: the CPUs available, shared by the ranks of a host).
``WARMREG_ON_ERROR``
    ``raise`` (default: the engine does not start if a key fails to compile) or ``continue`` (it starts, the
    failures logged).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import attrs

from ..monitoring import MODES, Mode, Monitor, arm
from ..pipeline.report import WarmReport
from ..values.errors import ConfigError
from .warm import prefetch as _prefetch
from .warm import warm

__all__ = ["StartupSettings", "arm_monitor", "prefetch", "warm_once"]

log = logging.getLogger("warmreg.api.startup")

_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}


def _variable(name: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(name, problem, fix=fix)


@attrs.frozen(kw_only=True)
class StartupSettings:
    """What the operator asked of a warm at start-up (:meth:`from_env`)."""

    enabled: bool
    pack: str | None = None
    monitor: Mode = "off"
    record: str | None = None
    workers: int | None = None
    on_error: Literal["raise", "continue"] = "raise"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StartupSettings:
        """Read the ``WARMREG_*`` variables (module docstring).

        :raises ConfigError: naming the variable, for a value that does not parse or a pack that does not exist.
        """
        env = os.environ if environ is None else environ
        raw = env.get("WARMREG_WARM", "").strip().lower()
        if raw not in _ON | _OFF:
            raise _variable(
                "WARMREG_WARM", f"must be 1 or 0 (got {raw!r})", "export WARMREG_WARM=1 to warm at start-up"
            )
        if raw in _OFF:
            return cls(enabled=False)
        pack = env.get("WARMREG_PACK") or None
        if pack is not None and not Path(pack).exists():
            raise _variable(
                "WARMREG_PACK", f"names {pack!r}, which does not exist", "point it at a pack built by warmreg build"
            )
        monitor = env.get("WARMREG_MONITOR", "off").strip().lower() or "off"
        if monitor not in MODES:
            raise _variable(
                "WARMREG_MONITOR",
                f"must be one of {', '.join(MODES)} (got {monitor!r})",
                "export WARMREG_MONITOR=error",
            )
        record = env.get("WARMREG_RECORD") or None
        if monitor == "record" and record is None:
            raise _variable(
                "WARMREG_RECORD", "is needed with WARMREG_MONITOR=record", "export WARMREG_RECORD=misses.jsonl"
            )
        workers: int | None = None
        if env.get("WARMREG_WORKERS"):
            try:
                workers = int(env["WARMREG_WORKERS"])
            except ValueError:
                workers = 0
            if workers < 1:
                raise _variable(
                    "WARMREG_WORKERS",
                    f"must be a whole number >= 1 (got {env['WARMREG_WORKERS']!r})",
                    "unset it to use every CPU",
                )
        on_error = env.get("WARMREG_ON_ERROR", "raise").strip().lower() or "raise"
        if on_error not in ("raise", "continue"):
            raise _variable(
                "WARMREG_ON_ERROR", f"must be raise or continue (got {on_error!r})", "unset it to fail on a failed key"
            )
        return cls(enabled=True, pack=pack, monitor=cast(Mode, monitor), record=record, workers=workers,
                   on_error=cast(Literal["raise", "continue"], on_error))  # fmt: skip


_lock = threading.Lock()
_warmed: dict[int, WarmReport] = {}  # pid -> this process's warm (a forked child warms again)
_armed: dict[int, Monitor] = {}  # pid -> the monitor armed after it


def prefetch(settings: StartupSettings | None = None) -> None:
    """Start the config-free part of a warm in the background (:func:`warmreg.prefetch`), the pack included,
    if the settings warm at all; call it before the engine loads its weights."""
    settings = StartupSettings.from_env() if settings is None else settings
    if settings.enabled:
        _prefetch(pack=settings.pack)


def warm_once(config: Any, settings: StartupSettings | None = None, *, engine: str) -> WarmReport | None:
    """Warm ``config`` (the engine's own config object) once in this process, if the settings warm at all;
    a second call in the same process returns the first warm's report without warming again.

    :param engine: the engine's name, for the log line.
    :returns: the report, or ``None`` when ``WARMREG_WARM`` is off.
    :raises CompileFailed: if a key failed and ``WARMREG_ON_ERROR`` is ``raise``.
    """
    settings = StartupSettings.from_env() if settings is None else settings
    if not settings.enabled:
        return None
    with _lock:
        done = _warmed.get(os.getpid())
        if done is not None:
            return done
        report = warm(config, pack=settings.pack, workers=settings.workers, on_error=settings.on_error, progress=False)
        _warmed[os.getpid()] = report
    log.info("warmreg (%s): %s", engine, report.summary())
    return report


def arm_monitor(settings: StartupSettings | None = None) -> Monitor | None:
    """Arm the JIT monitor in the mode the settings ask, once per process and only after it warmed (else nothing);
    a second call returns the monitor armed by the first."""
    settings = StartupSettings.from_env() if settings is None else settings
    if not settings.enabled or settings.monitor == "off":
        return None
    with _lock:
        pid = os.getpid()
        if pid not in _warmed:
            return None
        if pid not in _armed:
            _armed[pid] = arm(settings.monitor, record=settings.record)
        return _armed[pid]
