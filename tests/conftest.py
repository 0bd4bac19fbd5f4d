"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    """A fresh, empty Triton cache directory (TRITON_CACHE_DIR) for each test, and warmreg's state
    reset around it (the public ``warmreg_isolated`` fixture)."""
    return warmreg_isolated


@pytest.fixture(autouse=True)
def process_signals_kept() -> Iterator[None]:
    """A test leaves SIGINT as it found it (its handler, and its mask on this thread, which every process this one
    starts inherits: a warm subprocess of a later test would ignore Ctrl-C), and ends in the process it began in
    (a forked child that returned into the test would go on running the suite)."""
    pid, handler, mask = os.getpid(), signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    if os.getpid() != pid:
        os.write(2, f"a forked child ({os.getpid()}) of {pid} returned into the test; it exits\n".encode())
        os._exit(70)
    now_handler, now_mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    signal.signal(signal.SIGINT, handler)  # put back, so that one test's leak fails that test alone
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert now_handler is handler, f"the test left SIGINT's handler {now_handler!r} (it found {handler!r})"
    assert now_mask == mask, f"the test left this thread's signal mask {sorted(now_mask)} (it found {sorted(mask)})"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--network", action="store_true", help="run the tests marked network (they ask a package index)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is available (the device host), those marked ``network``
    only with ``--network``: the README's test command runs offline once set up."""
    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "network": None if config.getoption("--network") else pytest.mark.skip(reason="asks a package index: pass --network"),
    }
    for item in items:
        for mark, skip in skips.items():
            if skip is not None and mark in item.keywords:
                item.add_marker(skip)
