"""The pytest plugin, exercised through pytester in a sub-session."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

_HELPER = """
import torch, warmreg
from warmreg import _triton
from warmreg.values.platform import Platform
from tests.helpers import CONFIG, Plugin, Scale

def warm_and_launch(n):
    kernel = Scale(sizes=(16,))
    warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(kernel)], entry_points=False)
    with _triton.cross_target(Platform.parse("cuda:90")):
        try:
            kernel(warmreg.meta((n,), torch.float16), 2.0)
        except warmreg.JitMissError:
            raise
        except Exception:
            pass  # the stand-in driver cannot launch the binary
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(warmhelp=_HELPER)
    return pytester


def test_marker_fails_a_test_that_compiles(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_x="""
import pytest
from warmhelp import warm_and_launch

@pytest.mark.warmreg_no_jit
def test_warmed():
    warm_and_launch(32)

@pytest.mark.warmreg_no_jit
def test_not_warmed():
    warm_and_launch(17)
"""
    )
    result = suite.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*runtime JIT event(s) in a warmreg_no_jit test*", "*n_class: 'div16' != 'other'*"])


def test_fixture_yields_an_armed_monitor(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_y="""
from warmhelp import warm_and_launch

def test_counts(warmreg_monitor):
    warm_and_launch(17)
    assert len(warmreg_monitor.misses) == 1
    assert warmreg_monitor.counters()["tests.scale"]["misses"] == 1
"""
    )
    suite.runpytest_subprocess("-q").assert_outcomes(passed=1)


def test_session_option_error_mode(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_z="""
import pytest, warmreg
from warmhelp import warm_and_launch

def test_raises():
    with pytest.raises(warmreg.JitMissError):
        warm_and_launch(17)
"""
    )
    suite.runpytest_subprocess("--warmreg-monitor=error", "-q").assert_outcomes(passed=1)
