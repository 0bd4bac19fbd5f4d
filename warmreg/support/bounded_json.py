"""JSON from untrusted files (packs, configs): bounded in size and nesting before it is parsed.

``json.loads`` recurses once per nesting level, so 100,000 nested arrays raise ``RecursionError``
and a document of millions of tiny values takes seconds and gigabytes. :func:`loads` measures both
first, outside strings and mostly at C speed, and refuses what is over its bounds with a ``ValueError``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from typing import Any

__all__ = ["loads", "read_regular_file"]

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def loads(data: bytes | str, *, max_depth: int = 32, max_values: int = 1_000_000) -> Any:
    """Parse JSON nested at most ``max_depth`` levels, with at most about ``max_values`` values.

    Both are measured before parsing, outside strings (what ``json.loads`` would build in memory):
    values as arrays and objects plus separating commas.

    :raises ValueError: for text that is not UTF-8, not JSON, or over either bound
        (``json.JSONDecodeError`` and ``UnicodeDecodeError`` are ``ValueError`` subclasses).
    """
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    quotes = text.count('"')
    if quotes > 4 * max_values:
        raise ValueError(f"holds about {quotes // 2} strings, more than warmreg reads")
    bare = _STRING.sub("", text)
    values = bare.count("[") + bare.count("{") + bare.count(",")  # counted first: these run at C speed
    if values > max_values:
        raise ValueError(f"holds about {values} values, more than the {max_values} warmreg reads")
    depth = max(accumulate((_STEP[c] for c in _NOT_BRACKET.sub("", bare).encode()), initial=0))
    if depth > max_depth:
        raise ValueError(f"nests {depth} levels deep, more than the {max_depth} warmreg reads")
    try:
        return json.loads(text)
    except RecursionError as exc:  # pragma: no cover - the depth bound above comes first
        raise ValueError(f"nests deeper than {max_depth} levels") from exc


def read_regular_file(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """Read a regular file of at most ``limit`` bytes, without blocking on a FIFO or a device.

    :raises OSError: as ``open`` would (missing file, no permission).
    :raises ValueError: for a FIFO, device, socket or directory, or a file over ``limit`` bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait for a writer
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, device or socket)"
            raise ValueError(f"is {kind}")
        if info.st_size > limit:
            raise ValueError(f"has {info.st_size} bytes, more than the {limit} warmreg reads")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"has more than the {limit} bytes warmreg reads")
    return data
