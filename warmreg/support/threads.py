"""Worker pools whose threads block SIGINT: the compilers they start inherit it, so a Ctrl-C stops the work, not a compiler mid-file."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

__all__ = ["quiet_pool"]


def quiet_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``name``, each blocking SIGINT (inherited through fork and exec,
    which an LLVM handler set in a compiler cannot undo, as it can an ignore): the interrupt is the caller's."""
    return ThreadPoolExecutor(max(1, workers), name, initializer=signal.pthread_sigmask, initargs=(signal.SIG_BLOCK, {signal.SIGINT}))
