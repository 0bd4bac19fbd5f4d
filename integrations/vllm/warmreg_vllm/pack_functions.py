"""warmreg's plugin for packs of vLLM's own kernels: the Triton functions their entries name, from the installed vLLM.

Published in the ``warmreg`` entry-point group (``vllm = "warmreg_vllm.pack_functions"``), so ``warmreg pack
install`` and ``verify`` of a pack :func:`warmreg_vllm.vllm_pack.build_vllm_pack` wrote find vLLM's functions; the
core checks each against the pack's source hash before it installs an entry. Importing this module imports
neither vLLM nor torch; the hook imports vLLM's modules only for a pack whose engine is vLLM.

On a machine without a GPU, vLLM's modules are imported under :func:`~warmreg_vllm.emulation.emulate_gpu` with the
pack's recorded profile: vLLM turns Triton off without a GPU (every ``@triton.jit`` a placeholder) and some modules
choose their implementation by platform at import, so only the GPU's import gives the functions the pack was built
from.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

from warmreg import hookimpl

__all__ = ["import_function", "warmreg_pack_functions"]

log = logging.getLogger("warmreg_vllm")
#: a vLLM function's full name: ``vllm.`` then dotted identifiers (a function defined in a function is not importable)
_NAME = re.compile(r"vllm(\.[A-Za-z_][A-Za-z0-9_]*)+")


def import_function(name: str) -> Any:
    """The ``@triton.jit`` function vLLM defines under ``name`` (``vllm.module.function``), unwrapped from Triton's
    autotuner or heuristics; ``None`` where the name is not a vLLM module attribute or not a Triton function."""
    from triton.runtime.jit import JITFunction

    if not _NAME.fullmatch(name):
        return None
    module_name, _, qual = name.rpartition(".")
    module: Any = None
    while module_name:
        try:
            module = importlib.import_module(module_name)
            break
        except ImportError:
            module_name, _, head = module_name.rpartition(".")
            qual = f"{head}.{qual}"
    obj = module
    for part in qual.split(".") if module is not None else ():
        obj = getattr(obj, part, None)
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)  # Autotuner / Heuristics around the JITFunction
    return obj


@contextlib.contextmanager
def _as_on_the_gpu(engine: Mapping[str, Any]) -> Iterator[None]:
    """vLLM imported as on the pack's GPU: as it is on a GPU host, under the recorded profile elsewhere."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    from .emulation import emulate_gpu
    from .profile import GpuProfile

    with emulate_gpu(GpuProfile.from_dict(engine["profile"], source="the pack's manifest")):
        yield


@hookimpl
def warmreg_pack_functions(names: frozenset[str], engine: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's Triton functions among ``names``, for a pack of vLLM's kernels (``engine["name"] == "vllm"``)."""
    wanted = sorted(n for n in names if _NAME.fullmatch(n))
    if engine is None or engine.get("name") != "vllm" or not wanted or importlib.util.find_spec("vllm") is None:
        return {}
    found: dict[str, Any] = {}
    with _as_on_the_gpu(engine):
        for name in wanted:
            function = import_function(name)
            if function is not None:
                found[name] = function
    if len(found) < len(wanted):
        log.warning("vLLM %s here defines %d of the pack's %d Triton functions", _version(), len(found), len(wanted))
    return found


def _version() -> str:
    from importlib.metadata import version

    return version("vllm")
