"""What each supported Triton release does differently: one table, read by the rest of the adapter.

Every difference the adapter (``warmreg/_triton*.py``) depends on is one field of :class:`Release`,
so a new release is one new row here, never an ``if version`` somewhere else. Each row was checked
against the installed source of that release (the patch release named in ``checked``), and
``tests/test_triton_adapter.py`` runs on every supported release in CI.
"""

from __future__ import annotations

import os
import warnings

import attrs
import triton

from ..values.errors import UnsupportedTriton

__all__ = [
    "ALLOW_UNSUPPORTED", "RELEASE", "RELEASES", "Release", "SUPPORTED_TRITON", "UnsupportedTriton", "check_version",
    "release_of",
]  # fmt: skip

#: Set to ``1`` to run warmreg on a Triton release it was not checked against (it warns instead of
#: refusing; the adapter then treats it as the newest supported release).
ALLOW_UNSUPPORTED = "WARMREG_ALLOW_UNSUPPORTED_TRITON"


@attrs.frozen(kw_only=True)
class Release:
    """The behaviour of one Triton release series that warmreg's adapter depends on."""

    #: the series, ``"3.8"``
    series: str
    #: the patch release this row was read from
    checked: str
    #: ``serialize_specialization_data(..., key, target)`` takes the target, the JSON carries it, and
    #: ``JITFunction.preload`` refuses data serialized for another target (3.7+)
    specialization_has_target: bool
    #: jit-function constexprs serialize as ``{"jit_function": "module:qualname"}`` (3.7+)
    jit_function_constants: bool
    #: ``preload`` turns JSON lists in constexprs and signatures back into tuples (3.8+); 3.6/3.7 kept
    #: the list in constexpr values
    constexpr_lists_as_tuples: bool
    #: Triton builds a C launcher per distinct kernel signature with the host's C compiler at a
    #: kernel's first load (``make_launcher``, 3.6). From 3.7 one generic launcher, compiled once with
    #: the driver, launches every kernel: there is nothing per kernel to prebuild or ship.
    per_signature_launcher: bool
    #: ``CompiledKernel.__del__`` unloads the kernel's module (3.8+): whatever launches a kernel's
    #: function directly must keep its ``CompiledKernel`` alive
    unloads_on_del: bool
    #: the knobs ``JITFunction.run`` adds to every launch's options (and so to its in-memory key)
    run_option_knobs: tuple[tuple[str, str], ...]


_BASE_KNOBS = (("instrumentation_mode", "compilation.instrumentation_mode"),)
RELEASES: dict[str, Release] = {
    r.series: r
    for r in (
        Release(
            series="3.6", checked="3.6.0", specialization_has_target=False, jit_function_constants=False,
            constexpr_lists_as_tuples=False, per_signature_launcher=True, unloads_on_del=False,
            run_option_knobs=_BASE_KNOBS,
        ),
        Release(
            series="3.7", checked="3.7.1", specialization_has_target=True, jit_function_constants=True,
            constexpr_lists_as_tuples=False, per_signature_launcher=False, unloads_on_del=False,
            run_option_knobs=_BASE_KNOBS,
        ),
        Release(
            series="3.8", checked="3.8.0", specialization_has_target=True, jit_function_constants=True,
            constexpr_lists_as_tuples=True, per_signature_launcher=False, unloads_on_del=True,
            run_option_knobs=_BASE_KNOBS,
        ),
        Release(
            series="3.9", checked="3.9.0", specialization_has_target=True, jit_function_constants=True,
            constexpr_lists_as_tuples=True, per_signature_launcher=False, unloads_on_del=True,
            run_option_knobs=(*_BASE_KNOBS, ("fpsan_homomorphic_casts", "compilation.fpsan_homomorphic_casts")),
        ),
    )
}
#: Triton release series warmreg's adapter was checked against.
SUPPORTED_TRITON = tuple(RELEASES)


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_version(version: str = triton.__version__) -> None:
    """Refuse a Triton release the adapter does not support, in one line (or warn, with
    ``WARMREG_ALLOW_UNSUPPORTED_TRITON=1``).

    :raises UnsupportedTriton: naming the installed and the supported releases.
    """
    if _series(version) in RELEASES:
        return
    supported = ", ".join(f"{s}.x" for s in SUPPORTED_TRITON)
    if os.environ.get(ALLOW_UNSUPPORTED) == "1":
        warnings.warn(
            f"warmreg runs on Triton {version}, which it was not checked against (supported: {supported}); "
            f"{ALLOW_UNSUPPORTED}=1 is set, so it treats it as Triton {SUPPORTED_TRITON[-1]}",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    raise UnsupportedTriton(
        f"Triton {version} is not supported by this warmreg (supported: {supported})",
        fix=f"install a supported Triton (e.g. pip install 'triton~=3.8.0'), or set {ALLOW_UNSUPPORTED}=1 to try it",
    )


def release_of(version: str) -> Release:
    """The row for ``version`` (an unsupported release gets the newest row; see :func:`check_version`)."""
    return RELEASES.get(_series(version), RELEASES[SUPPORTED_TRITON[-1]])


#: The installed release.
RELEASE: Release = release_of(triton.__version__)
