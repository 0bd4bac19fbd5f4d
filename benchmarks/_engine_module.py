"""vLLM's kernel modules loaded from a file, for the benchmarks that time warmreg's ops beside them.

The GPU host has no vLLM: the benchmark is given a copy of one of vLLM's kernel files (``--engine-module PATH``) and
loads it as a private module. Where ``vllm`` imports, the file's imports are vLLM's own; elsewhere minimal stand-ins
answer them while the file executes (:data:`STAND_INS`, a superset of what the loaded files import) and are removed
afterwards. Under Triton's interpreter (the ``--dry-run`` of a benchmark) FLA's ``exp = tl.exp``-style aliases are
rebound to ``@triton.jit`` helpers the interpreter can run, as ``tests/engines/vllm_kernels.py`` does.

A benchmark's ``--dry-run`` sets ``TRITON_INTERPRET=1`` and an empty ``CUDA_VISIBLE_DEVICES`` at the top of its
script, before any kernel module (warmreg's or vLLM's) is imported: Triton reads the first when a ``@triton.jit``
decorator runs, and vLLM decides at its first import whether Triton is usable (the second keeps it on without a GPU
driver, its distributed-start case).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["STAND_INS", "interpreting", "load_engine", "uses_stand_ins"]


def interpreting() -> bool:
    """Whether kernels decorated now run under Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def uses_stand_ins() -> bool:
    """Whether :func:`load_engine` runs a file on stand-ins (``vllm`` does not import here)."""
    return importlib.util.find_spec("vllm") is None


class _Platform:
    """The questions vLLM's kernel files ask ``vllm.platforms.current_platform``, answered as vLLM's CUDA platform
    answers them (``is_device_capability_family``: the same major; ``is_arch_support_pdl``: SM >= 90)."""

    @staticmethod
    @functools.cache
    def _capability() -> tuple[int, int] | None:
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        cap = self._capability()
        return cap is not None and (cap[0] * 10 + cap[1]) // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        cap = self._capability()
        return cap is not None and cap[0] >= 9


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _next_power_of_2(n: int) -> int:
    return 1 if n < 1 else 1 << (n - 1).bit_length()


#: Module name -> attributes, a superset of what the loaded files import (their parent packages are made too).
#: ``_custom_ops`` is empty: attn_res checks ``hasattr(torch.ops._C, ...)`` before its C++ op, never reached here.
#: FLA's op aliases are Triton's builtins, as FLA binds them with ``FLA_USE_FAST_OPS`` unset.
STAND_INS: dict[str, dict[str, Any]] = {
    "vllm._custom_ops": {},
    "vllm.platforms": {"current_platform": _Platform()},
    "vllm.triton_utils": {"tl": tl, "triton": triton},
    "vllm.third_party.flash_linear_attention.ops.op": {"exp": tl.exp, "exp2": tl.exp2, "log": tl.log, "log2": tl.log2},
    "vllm.utils.math_utils": {"cdiv": _cdiv, "next_power_of_2": _next_power_of_2},
}


@contextmanager
def _vllm_stand_ins() -> Iterator[None]:
    """The stand-ins and their parent packages in ``sys.modules`` while a file executes (its imports bind what it
    needs), removed afterwards."""
    mods: dict[str, ModuleType] = {}
    for name, attrs in STAND_INS.items():
        parts = name.split(".")
        for i in range(1, len(parts)):  # parent packages, each an attribute of its own parent
            parent = ".".join(parts[:i])
            mods.setdefault(parent, ModuleType(parent)).__path__ = []  # type: ignore[attr-defined]
        mod = mods.setdefault(name, ModuleType(name))
        mod.__dict__.update(attrs)
    for name, mod in mods.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(mods[parent], child, mod)
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _rebind_for_interpreter(mod: ModuleType) -> None:
    """FLA's ``exp``/``log`` aliases hold Triton's compiled-mode builtins, which the interpreter patches only while a
    launch runs: rebind them to ``@triton.jit`` helpers (decorated now, under the interpreter)."""

    @triton.jit
    def _exp(x):  # type: ignore[no-untyped-def]
        return tl.exp(x)

    @triton.jit
    def _exp2(x):  # type: ignore[no-untyped-def]
        return tl.exp2(x)

    @triton.jit
    def _log(x):  # type: ignore[no-untyped-def]
        return tl.log(x)

    @triton.jit
    def _log2(x):  # type: ignore[no-untyped-def]
        return tl.log2(x)

    for name, (builtin, helper) in {"exp": (tl.exp, _exp), "exp2": (tl.exp2, _exp2), "log": (tl.log, _log),
                                    "log2": (tl.log2, _log2)}.items():  # fmt: skip
        if getattr(mod, name, None) is builtin:
            setattr(mod, name, helper)


def load_engine(path: str | Path, *, entry: str, name: str | None = None) -> ModuleType:
    """The vLLM kernel file at ``path`` as the private module ``name`` (default ``_vllm_<file stem>``): with vLLM's own
    imports where ``vllm`` imports, else on the stand-ins; FLA's aliases rebound under the interpreter.

    :param entry: the function the benchmark calls; the file must define it.
    :raises SystemExit: for a path that is not a Python file or lacks ``entry`` (a benchmark's usage error).
    """
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or f"_vllm_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--engine-module {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    if uses_stand_ins():
        with _vllm_stand_ins():
            spec.loader.exec_module(mod)
    else:
        spec.loader.exec_module(mod)
    if interpreting():
        _rebind_for_interpreter(mod)
    if not callable(getattr(mod, entry, None)):
        raise SystemExit(f"--engine-module {path}: no {entry} function")
    return mod
