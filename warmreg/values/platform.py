"""Platforms: the GPU a warm compiles for, local or a named cross target, and predicates on it.

``Platform.parse("cuda:90")``, ``Platform.parse("rocm:gfx942")`` or ``Platform.detect()``.
Plugins never branch on the machine they run on; they hand the core :class:`Predicate` values
(``is_cuda & sm_at_least(90)``) that the core evaluates against the platform of this warm.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Literal

import attrs

from .errors import TargetError

__all__ = [
    "Backend", "CUDA_ARCHS", "FNUZ_ARCHS", "Platform", "Predicate", "ROCM_ARCHS", "check_features", "has_feature",
    "is_cuda", "is_fp8_fnuz", "is_rocm", "is_xpu", "resolve_platform", "rocm_arch_in", "sm_at_least", "sm_below",
    "supports_pdl",
]  # fmt: skip

Backend = Literal["cuda", "rocm", "xpu"]
#: ROCm architectures whose FP8 format is e4m3fnuz (MI300 family); gfx950 uses OCP e4m3fn.
FNUZ_ARCHS = frozenset({"gfx940", "gfx941", "gfx942"})
#: NVIDIA compute capabilities (sm_XY as XY) a target may name.
CUDA_ARCHS = frozenset({70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121})
#: AMD GPU processors (LLVM's AMDGPU names) a target may name.
ROCM_ARCHS = frozenset({
    "gfx900", "gfx902", "gfx904", "gfx906", "gfx908", "gfx909", "gfx90a", "gfx90c", "gfx940", "gfx941", "gfx942", "gfx950",
    "gfx1010", "gfx1011", "gfx1012", "gfx1013", "gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036",
    "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153", "gfx1200", "gfx1201", "gfx1250",
})  # fmt: skip
#: Every feature name a predicate (:func:`has_feature`) of a loaded plugin checks.
_FEATURES: set[str] = set()
_TARGET = re.compile(r"^(cuda|rocm|xpu):([A-Za-z0-9_]+)((?:\+[a-z0-9_]+)*)$")


def _features(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@attrs.frozen(order=True)
class Platform:
    """The accelerator a warm targets.

    :param backend: ``"cuda"``, ``"rocm"`` or ``"xpu"``.
    :param arch: compute capability as an int for CUDA (``90``), the gfx name for ROCm (``"gfx942"``),
        a device name for XPU.
    :param features: optional capabilities present on the deployment (``"cutedsl"``, ``"flashinfer"``,
        ``"aiter"``, ...); written as ``cuda:90+cutedsl`` in target strings.
    :param local: whether this is the GPU of this process (``detect()``) rather than a cross target.
    """

    backend: Backend
    arch: int | str
    features: frozenset[str] = attrs.field(default=frozenset(), converter=_features)
    local: bool = attrs.field(default=False, eq=False, order=False)

    @classmethod
    def parse(cls, target: str) -> Platform:
        """Parse a target string ``backend:arch[+feature...]``.

        :raises TargetError: if the string does not parse, naming the accepted forms.
        """
        match = _TARGET.match(target.strip()) if isinstance(target, str) else None
        if match is None:
            raise TargetError(
                str(target), "does not parse", fix="write backend:arch, e.g. cuda:90, cuda:100, rocm:gfx942, rocm:gfx950"
            )
        backend, arch, feats = match.group(1), match.group(2), match.group(3)
        features = frozenset(f for f in feats.split("+") if f)
        if backend == "cuda":
            if not arch.isdigit() or not 30 <= int(arch) < 1000:
                raise TargetError(target, f"CUDA arch {arch!r} is not a compute capability", fix="write e.g. cuda:90 for sm_90")
            if int(arch) not in CUDA_ARCHS:
                known = ", ".join(str(a) for a in sorted(CUDA_ARCHS))
                raise TargetError(target, f"sm_{arch} is no NVIDIA GPU's compute capability", fix=f"use one of cuda:{{{known}}}")
            return cls("cuda", int(arch), features)
        if backend == "rocm":
            if not re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
                raise TargetError(target, f"ROCm arch {arch!r} is not a gfx name", fix="write e.g. rocm:gfx942")
            if arch not in ROCM_ARCHS:
                raise TargetError(target, f"{arch} is no AMD GPU processor", fix=f"use one of rocm:{{{', '.join(sorted(ROCM_ARCHS, key=lambda a: (len(a), a)))}}}")
            return cls("rocm", arch, features)
        return cls("xpu", arch, features)

    @classmethod
    def detect(cls) -> Platform:
        """The platform of the current torch device.

        :raises TargetError: if no GPU is visible (pass a target such as ``cuda:90`` to cross-compile).
        """
        import torch

        if torch.cuda.is_available():
            if torch.version.hip is not None:
                name = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
                return cls("rocm", name, local=True)
            major, minor = torch.cuda.get_device_capability()
            return cls("cuda", major * 10 + minor, local=True)
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return cls("xpu", torch.xpu.get_device_name(), local=True)
        raise TargetError("local", "no GPU is visible to torch", fix="pass a target such as cuda:90 to cross-compile")

    @property
    def target(self) -> str:
        """The target string that parses back to this platform."""
        feats = "".join(f"+{f}" for f in sorted(self.features))
        return f"{self.backend}:{self.arch}{feats}"

    @property
    def is_cuda(self) -> bool:
        return self.backend == "cuda"

    @property
    def is_rocm(self) -> bool:
        return self.backend == "rocm"

    @property
    def is_xpu(self) -> bool:
        return self.backend == "xpu"

    @property
    def sm(self) -> int:
        """CUDA compute capability as an int (``90``); 0 on other backends."""
        return self.arch if isinstance(self.arch, int) else 0

    @property
    def fp8_fnuz(self) -> bool:
        """Whether the platform's native FP8 is e4m3fnuz (gfx942) rather than OCP e4m3fn."""
        return self.is_rocm and self.arch in FNUZ_ARCHS

    @property
    def supports_pdl(self) -> bool:
        """Programmatic dependent launch: CUDA sm_90 and newer."""
        return self.is_cuda and self.sm >= 90

    def __str__(self) -> str:
        return self.target


@attrs.frozen
class Predicate:
    """A named condition on a :class:`Platform`, combinable with ``&``, ``|`` and ``~``.

    The core evaluates predicates; ``repr`` is what ``warmreg plan`` shows for a skipped kernel.
    """

    name: str
    test: Callable[[Platform], bool] = attrs.field(eq=False, repr=False)

    def __call__(self, platform: Platform) -> bool:
        return bool(self.test(platform))

    def __and__(self, other: Predicate) -> Predicate:
        return Predicate(f"({self.name} & {other.name})", lambda p: self(p) and other(p))

    def __or__(self, other: Predicate) -> Predicate:
        return Predicate(f"({self.name} | {other.name})", lambda p: self(p) or other(p))

    def __invert__(self) -> Predicate:
        return Predicate(f"~{self.name}", lambda p: not self(p))

    def __repr__(self) -> str:
        return self.name


is_cuda = Predicate("is_cuda", lambda p: p.is_cuda)
is_rocm = Predicate("is_rocm", lambda p: p.is_rocm)
is_xpu = Predicate("is_xpu", lambda p: p.is_xpu)
is_fp8_fnuz = Predicate("is_fp8_fnuz", lambda p: p.fp8_fnuz)
supports_pdl = Predicate("supports_pdl", lambda p: p.supports_pdl)


def sm_at_least(capability: int) -> Predicate:
    """CUDA with compute capability >= ``capability`` (e.g. 90, 100)."""
    return Predicate(f"sm>={capability}", lambda p: p.is_cuda and p.sm >= capability)


def sm_below(capability: int) -> Predicate:
    """CUDA with compute capability < ``capability``."""
    return Predicate(f"sm<{capability}", lambda p: p.is_cuda and p.sm < capability)


def rocm_arch_in(*archs: str) -> Predicate:
    """ROCm on one of the given gfx architectures."""
    return Predicate(f"rocm in {sorted(archs)}", lambda p: p.is_rocm and p.arch in archs)


def has_feature(name: str) -> Predicate:
    """An optional backend or capability present on the deployment (``cuda:90+cutedsl``).

    Naming a feature here makes it known: a target with a feature no loaded plugin checks is
    refused by :func:`warmreg.plan` (it would change nothing, so it is most likely a typo).
    """
    _FEATURES.add(name)
    return Predicate(f"has({name})", lambda p: name in p.features)


def check_features(platform: Platform) -> None:
    """Refuse a platform whose features no loaded plugin checks (call once the plugins registered).

    :raises TargetError: naming the unknown features and the known ones.
    """
    unknown = sorted(platform.features - _FEATURES)
    if unknown:
        known = ", ".join(sorted(_FEATURES)) or "none"
        raise TargetError(
            platform.target, f"names {', '.join('+' + f for f in unknown)}, which no loaded plugin checks",
            fix=f"drop it; features the loaded plugins know: {known}",
        )  # fmt: skip


def resolve_platform(target: str | Platform | None) -> Platform:
    """``None``: the local GPU; a string such as ``"cuda:90"``: that cross target.

    :raises TargetError: if the string does not parse or no GPU is visible for ``None``.
    """
    if isinstance(target, Platform):
        return target
    if target is None:
        return Platform.detect()
    return Platform.parse(target)
