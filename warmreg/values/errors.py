"""Errors raised by warmreg.

Every error derives from :class:`WarmregError`, carries the offending object (``.field``,
``.kernel``, ``.key``, ``.pack``, ``.plugin``) and says what to do about it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CacheError", "CompileFailed", "CompileKeyError", "ConfigError", "JitMissError", "KernelContractError", "LaunchError",
    "LauncherError", "PackError", "PluginError", "TargetError", "UnsupportedTriton", "WarmregError",
]  # fmt: skip


class WarmregError(Exception):
    """Base class of every error warmreg raises on purpose.

    :param message: what went wrong, naming the offender.
    :param fix: what the caller can do about it; appended to the message.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(f"{message}; fix: {fix}" if fix else message)


class ConfigError(WarmregError, ValueError):
    """A configuration field is missing or invalid.

    :param field: dotted name of the field (``serving.max_num_seqs``), or the config file's path
        with ``file=True``.
    :param plugin: the plugin or kernel that needs the field, if any.
    :param accepted: the values the field accepts, where the reader named them.
    """

    def __init__(self, field: str, problem: str, *, plugin: str | None = None, fix: str | None = None, file: bool = False, accepted: Any = ()) -> None:  # fmt: skip
        self.field, self.problem, self.plugin, self.accepted = field, problem, plugin, tuple(accepted)
        needed = f" (needed by {plugin})" if plugin else ""
        super().__init__(f"config {'file' if file else 'field'} '{field}' {problem}{needed}", fix=fix)


class TargetError(WarmregError, ValueError):
    """A target string such as ``cuda:90`` does not parse or cannot be compiled for here."""

    def __init__(self, target: str, problem: str, *, fix: str | None = None) -> None:
        self.target = target
        super().__init__(f"target {target!r}: {problem}", fix=fix)


class PluginError(WarmregError):
    """A plugin failed to load or its hook raised."""

    def __init__(self, plugin: str, problem: str, *, fix: str | None = None) -> None:
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {problem}", fix=fix)


class KernelContractError(WarmregError, TypeError):
    """A kernel class breaks the :class:`~warmreg.TritonKernel` contract."""

    def __init__(self, kernel: str, problem: str, *, fix: str | None = None) -> None:
        self.kernel = kernel
        super().__init__(f"kernel {kernel!r}: {problem}", fix=fix)


class CompileKeyError(WarmregError, ValueError):
    """A compile key cannot be built or read back (bad field value, unknown key type)."""

    def __init__(self, key: str, problem: str, *, fix: str | None = None) -> None:
        self.key = key
        super().__init__(f"compile key {key}: {problem}", fix=fix)


class CacheError(WarmregError):
    """Triton's cache directory cannot be used: missing rights, a full disk, or not a directory.

    :param directory: the cache directory (``TRITON_CACHE_DIR``).
    """

    def __init__(self, directory: str, problem: str, *, fix: str | None = None) -> None:
        self.directory = directory
        super().__init__(
            f"the Triton cache directory {directory} {problem}", fix=fix or "free space, or set TRITON_CACHE_DIR to a writable directory"
        )


class CompileFailed(WarmregError):
    """One or more keys failed to compile during :func:`warmreg.warm` with ``on_error="raise"``.

    :param failures: ``(kernel name, key, error text)`` for each failed key.
    """

    def __init__(self, failures: list[tuple[str, Any, str]]) -> None:
        self.failures = failures
        first = failures[0]
        more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
        super().__init__(
            f"{len(failures)} key(s) failed to compile; first: kernel {first[0]!r} key {first[1]}: {first[2]}{more}",
            fix="read report.failed for every error, or pass on_error='continue' to warm the rest",
        )


class LaunchError(WarmregError, ValueError):
    """Runtime inputs a kernel's launch code cannot accept (wrong shape, dtype or layout)."""

    def __init__(self, kernel: str, problem: str, *, fix: str | None = None) -> None:
        self.kernel = kernel
        super().__init__(f"kernel {kernel!r}: {problem}", fix=fix)


class UnsupportedTriton(WarmregError):
    """The installed Triton release is not one warmreg's adapter was checked against."""


class LauncherError(WarmregError):
    """A C launcher could not be built for a pack."""


class PackError(WarmregError):
    """A pack is malformed, corrupt, or does not fit this machine; nothing was written to the cache."""

    def __init__(self, pack: str, problem: str, *, fix: str | None = None) -> None:
        self.pack = pack
        super().__init__(f"pack {pack}: {problem}", fix=fix)


class JitMissError(WarmregError, RuntimeError):
    """Raised in ``error`` mode before a runtime compile (or load, or autotune) is paid for.

    :param miss: the monitor's :class:`~warmreg.Miss` (its kernel, runtime key and explanation).
    """

    def __init__(self, miss: Any) -> None:
        self.miss = miss
        self.kernel = miss.kernel or miss.jit_name
        self.key = miss.runtime_key
        super().__init__(f"warmreg monitor (mode=error) refused a {miss.explain()}")
