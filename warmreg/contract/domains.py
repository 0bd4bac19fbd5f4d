"""Helpers that turn config values into domains of runtime inputs.

A domain lists the values one runtime input of ``dispatch`` takes in a deployment. These helpers
cover the common shapes of such lists; kernels are free to compute their own.
"""

from __future__ import annotations

import functools

from ..values.platform import Platform
from .config import WarmConfig

__all__ = ["next_pow2", "powers_of_two", "runtime_platform", "token_counts"]


def _positive(value: int) -> str | None:
    return None if value > 0 else f"must be > 0 (got {value})"


def token_counts(config: WarmConfig, *, plugin: str, full: bool = False, field: str = "max_num_batched_tokens") -> list[int]:
    """Token counts a step can carry: ``0..serving.<field>``.

    :param full: every count; otherwise one count of each integer class Triton distinguishes
        (0, 1, 2, 16, 17, the maximum, and its neighbour), which is exact for kernels whose key
        depends on the count only through ``int_class`` or not at all.
    :param plugin: who needs the field (quoted in the error if it is missing).
    """
    top = config.get(f"serving.{field}", int, plugin=plugin, check=_positive)
    if full:
        return list(range(top + 1))
    return sorted({v for v in (0, 1, 2, 16, 17, top - 1, top) if 0 <= v <= top})


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1), as ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` inclusive (``lo`` a power of two)."""
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


@functools.cache
def runtime_platform() -> Platform | None:
    """The local GPU's platform, detected once; ``None`` on a machine without one.

    Launch code uses it for platform-dependent key fields (PDL), exactly as domains use the
    platform a warm targets.
    """
    try:
        return Platform.detect()
    except Exception:
        return None
