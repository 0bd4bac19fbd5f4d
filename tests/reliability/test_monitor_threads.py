"""The monitor under threads, nesting and exceptions: the hooks are always restored."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import triton

import warmreg
from warmreg.monitoring import current


def _hooks() -> tuple[Any, tuple[Any, ...]]:
    return triton.knobs.runtime.jit_cache_hook, tuple(triton.knobs.runtime.kernel_load_start_hook.calls)


def test_arm_and_disarm_from_many_threads() -> None:
    """arm/disarm from 16 threads, 200 times each: afterwards the original hooks are back"""
    before = _hooks()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(200):
                mon = warmreg.arm("record")
                warmreg.disarm(mon)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and current() is None and _hooks() == before


def test_nested_contexts_with_a_foreign_hook() -> None:
    """nested monitor contexts over someone else's hook restore it exactly"""

    def theirs(**_: Any) -> None:
        return None

    triton.knobs.runtime.jit_cache_hook = theirs
    try:
        with warmreg.monitor("warn"), warmreg.monitor("error"), warmreg.monitor("record") as inner:
            assert current() is inner and triton.knobs.runtime.jit_cache_hook is not theirs
        assert triton.knobs.runtime.jit_cache_hook is theirs and current() is None
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def test_exception_inside_an_armed_block() -> None:
    """an exception inside an armed block disarms and restores the hooks"""
    before = _hooks()
    with pytest.raises(KeyError):
        with warmreg.monitor("error"):
            raise KeyError("boom")
    assert _hooks() == before and current() is None


def test_disarm_out_of_order() -> None:
    """disarming an outer monitor before the inner one keeps the inner in force until it goes too"""
    outer, inner = warmreg.arm("record"), warmreg.arm("error")
    warmreg.disarm(outer)
    assert current() is inner
    warmreg.disarm(inner)
    assert current() is None and triton.knobs.runtime.jit_cache_hook is None
