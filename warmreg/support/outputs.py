"""Output paths checked before the work that fills them (a build, a warm report), not after."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..values.errors import WarmregError

__all__ = ["check_output"]


def check_output(path: str | os.PathLike[str], what: str, *, create_parents: bool = False) -> None:
    """Refuse, before any work, an output path that could not be written once the work is done.

    :param create_parents: whether the writer creates missing parent directories.
    :raises WarmregError: naming the path and why.
    """
    out = Path(path)
    parent = out.parent
    if create_parents:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent  # the nearest existing ancestor: the missing ones would be created
    if out.is_dir() and not create_parents:
        problem = "is a directory"
    elif not parent.exists():
        problem = f"cannot be written: the directory {parent} does not exist"
    elif not parent.is_dir():
        problem = f"cannot be written: {parent} is not a directory"
    else:
        try:  # access() says yes to root on /proc or a read-only mount: try it, as the writer will
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".warmreg-probe-"):
                return
        except OSError as exc:
            problem = f"cannot be written: {parent} is not writable ({exc.strerror})"
    raise WarmregError(f"{what} {path} {problem}", fix="pass a path in an existing, writable directory")
