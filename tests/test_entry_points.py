"""The snapshot of installed entry points: read once, read again when a distribution appears."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from warmreg.support import entry_points as _entry_points


def _dist(site: Path, name: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[warmreg.test-group]\n{name} = {name}_pkg\n")


def test_a_distribution_installed_later_is_seen_and_an_unchanged_path_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    assert _entry_points.entry_points("warmreg.test-group") == ()
    snapshot = _entry_points._eps
    assert _entry_points.entry_points("warmreg.test-group") == () and _entry_points._eps is snapshot  # not read again
    _dist(site, "first")  # as pip installs one: a new directory in a sys.path entry
    assert [ep.name for ep in _entry_points.entry_points("warmreg.test-group")] == ["first"]
    _dist(site, "second")
    assert sorted(ep.name for ep in _entry_points.entry_points("warmreg.test-group")) == ["first", "second"]


def test_a_replaced_reader_is_called_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: ["fake"] if group == "g" else [])
    assert _entry_points.entry_points("g") == ("fake",)
