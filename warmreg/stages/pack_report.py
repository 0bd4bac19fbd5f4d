"""What a pack install did: its ``InstallReport``, and a warm's ``pack`` section with its one line.

For each pack a warm installed (the one it was asked for, and the installed pack wheels that fit),
the section says how many entries were installed, were already present and were refused (each
refusal as ``{entry, reason}``), how many of the warm's keys the pack serves (holds, installed or
present) and, where it could not serve, why (``problem``): it refused entries the warm needs, or
holds none of its keys. The installed pack wheels skipped are listed with their reasons. ``ok`` is
false when the pack the warm was asked for has a problem (``warmreg warm --pack`` then exits 1); an
installed pack wheel's problem is logged and listed, never a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .pack_install import entry_label

if TYPE_CHECKING:
    from ..pipeline.planning import Plan

__all__ = ["InstallReport", "pack_section", "plan_labels"]

log = logging.getLogger("warmreg.stages.pack")


@attrs.frozen
class InstallReport:
    """What an install did: entries written, already present, and refused with reasons."""

    pack: str
    installed: int
    present: int
    refused: tuple[tuple[str, str], ...]
    seconds: float
    #: prebuilt C launchers written into the cache (those for this machine's Python ABI, not yet there)
    launchers: int = 0
    #: autotune choices written into the cache's choice files (:mod:`warmreg.stages.tuning`)
    choices: int = 0
    #: installed by :func:`warmreg.prefetch` in the background, before the warm that reports it
    prefetched: bool = False
    #: the model type the pack was built for
    model_type: str = ""
    #: the entries installed or already present, named as refusals name them (:func:`~warmreg.stages.pack_install.entry_label`)
    usable: frozenset[str] = attrs.field(default=frozenset(), eq=False, repr=False)


def plan_labels(plan: Plan) -> frozenset[str]:
    """The plan's keys as a pack's entries for them are named (:func:`~warmreg.stages.pack_install.entry_label`)."""
    return frozenset(entry_label(kp.name, key.to_json()) for kp, key in plan.items())


def _short(reason: str) -> str:
    """A refusal's reason without the fix it ends with (the JSON keeps it)."""
    return reason.partition("; fix: ")[0]


def _kernel(entry: str) -> str:
    return entry.partition(" ")[0]


def _problem(report: InstallReport, refused: list[dict[str, str]], keys: frozenset[str], serves: int, model_type: str) -> str | None:
    needed = [x for x in refused if x["entry"] in keys]
    if needed:
        count = f"{len(needed)} entr{'y' if len(needed) == 1 else 'ies'}"
        return f"refused {count} this warm needs ({_kernel(needed[0]['entry'])}: {_short(needed[0]['reason'])})"
    if keys and not serves:
        if report.model_type and report.model_type != model_type:
            return f"built for model_type {report.model_type!r}, this warm is for {model_type!r}"
        return "holds none of this warm's keys"
    return None


def _record(wheel: str | None, report: InstallReport, keys: frozenset[str], model_type: str) -> dict[str, Any]:
    refused = [{"entry": entry, "reason": why.removeprefix(f"pack {report.pack}: ")} for entry, why in report.refused]
    serves = len(keys & report.usable)
    return {
        "pack": report.pack, "wheel": wheel, "model_type": report.model_type, "installed": report.installed, "present": report.present,
        "refused": refused, "serves": serves, "problem": _problem(report, refused, keys, serves, model_type),
        "launchers": report.launchers, "choices": report.choices, "seconds": report.seconds, "prefetched": report.prefetched,
    }  # fmt: skip


def _line(record: dict[str, Any], total: int) -> str:
    who = f"pack wheel {record['wheel']}" if record["wheel"] else f"pack {record['pack']}"
    refused = record["refused"]
    text = f"{who}: {record['installed']} installed, {record['present']} present, {len(refused)} refused, serves {record['serves']} of {total} keys"
    if record["launchers"]:
        text += f", {record['launchers']} C launchers"
    if record["choices"]:
        text += f", {record['choices']} autotune choices"
    text += f" in {record['seconds']:.2f} s{' (at prefetch)' if record['prefetched'] else ''}"
    if record["problem"]:
        return f"{text}: {record['problem']}"
    return f"{text}; refused e.g. {_kernel(refused[0]['entry'])}: {_short(refused[0]['reason'])}" if refused else text


def pack_section(
    installs: Iterable[tuple[str | None, InstallReport]], skipped: Sequence[tuple[str, str]], *, keys: frozenset[str], model_type: str
) -> dict[str, Any] | None:
    """The ``pack`` section of a warm of ``model_type`` whose keys are ``keys`` (:func:`plan_labels`).

    :param installs: each pack installed, with its wheel (``name==version``) or ``None`` for the pack
        the warm was asked for.
    :param skipped: the installed pack wheels skipped, with the reason.
    :returns: ``packs`` (one record each), ``skipped`` (``{wheel, reason}``), the totals ``installed``
        and ``present``, every refusal (``{pack, entry, reason}``), ``ok`` and the ``summary`` line;
        ``None`` when there was no pack.
    """
    records = [_record(wheel, report, keys, model_type) for wheel, report in installs]
    if not records and not skipped:
        return None
    for r in records:
        if r["wheel"] and r["problem"]:
            log.warning("installed pack wheel %s could not serve this warm: %s", r["wheel"], r["problem"])
    lines = [_line(r, len(keys)) for r in records] + [f"pack wheel {wheel} skipped: {_short(why)}" for wheel, why in skipped]
    return {
        "packs": records,
        "skipped": [{"wheel": wheel, "reason": why} for wheel, why in skipped],
        "installed": sum(r["installed"] for r in records),
        "present": sum(r["present"] for r in records),
        "refused": [{"pack": r["pack"], **x} for r in records for x in r["refused"]],
        "ok": not any(r["problem"] for r in records if r["wheel"] is None),
        "summary": "; ".join(lines),
    }
