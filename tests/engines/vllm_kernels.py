"""vLLM's own Triton kernels beside warmreg's ops, on identical CPU tensors, under Triton's interpreter.

Shared by the differential tests ``tests/engines/test_vllm_kernels*.py``, which run in the vLLM venv
(``bash scripts/engine-envs.sh test vllm``) and skip, naming why, anywhere vLLM does not import.

Importing this module, before vLLM or any kernel module is imported:

- sets ``TRITON_INTERPRET=1``: Triton reads it when a ``@triton.jit`` decorator runs, so every kernel
  imported afterwards, vLLM's and warmreg's, is interpreted on CPU tensors;
- sets ``CUDA_VISIBLE_DEVICES`` to the empty string: without an active GPU driver vLLM replaces every
  ``@triton.jit`` with a placeholder (``vllm/triton_utils/importing.py``), except in its
  distributed-start case, an empty ``CUDA_VISIBLE_DEVICES``, which keeps Triton on;
- hides the CuTeDSL, TileLang and quack packages (``sys.modules[name] = None``: ``find_spec`` answers None, an
  import fails), which the venvs hold for vLLM's registry keys (``warmreg_vllm.registry_keys``): where they import,
  vLLM's dequant-gather and indexer-Q entry points take their CuTeDSL branch (``vllm/utils/import_utils.py``
  ``_has_module``), and these tests compare warmreg's ops with vLLM's Triton kernels.

A test module must therefore import this module before anything that imports triton kernels, and the
kernel tests run in their own pytest process (``scripts/engine-envs.sh`` does).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # before the environment changes: the main suite collects this too
    pytest.skip(
        "vLLM is not installed here; run in its venv: bash scripts/engine-envs.sh test vllm", allow_module_level=True
    )
if "vllm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    # vLLM decided at its first import whether Triton is usable, and kernels imported since are compiled-mode.
    raise RuntimeError(
        "vLLM was imported before tests/engines/vllm_kernels.py: run the kernel tests in their own pytest process "
        "(pytest tests/engines/test_vllm_kernels*.py), as scripts/engine-envs.sh does"
    )
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
for _dsl in ("cutlass", "tilelang", "quack"):
    sys.modules.setdefault(_dsl, None)  # type: ignore[assignment]

import torch  # noqa: E402 (after the environment above)
import triton  # noqa: E402 (after the environment above)
import triton.language as tl  # noqa: E402 (after the environment above)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plans import engine_or_skip  # noqa: E402 (after the environment above)

__all__ = ["assert_same", "assert_within_ulps", "clones", "engine", "seeded"]


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


# FLA's ``ops/op.py`` binds ``exp = tl.exp`` (and log, exp2, log2) at import. The interpreter patches
# ``triton.language`` only while a launch runs, so a module-level alias still holds the compiled-mode builtin,
# which refuses to run outside a JIT function. These wrappers are ordinary @triton.jit helpers the interpreter
# runs; :func:`engine` rebinds the aliases to them in the modules it returns (for the interpreter only: the
# same source compiles to the same builtins on a GPU).
_ALIASES = {"exp": (tl.exp, _exp), "exp2": (tl.exp2, _exp2), "log": (tl.log, _log), "log2": (tl.log2, _log2)}


def engine(module: str) -> ModuleType:
    """Import one of vLLM's kernel modules (skipping the test module, naming why, where vLLM does not import),
    with FLA's ``exp``/``log`` aliases rebound to helpers Triton's interpreter can run."""
    engine_or_skip("vLLM", "vllm")
    mod = importlib.import_module(module)
    for name, (builtin, wrapper) in _ALIASES.items():
        if getattr(mod, name, None) is builtin:
            setattr(mod, name, wrapper)
    return mod


def seeded(seed: int) -> torch.Generator:
    """A CPU generator: every input of a comparison is drawn from one, so a failure reproduces."""
    return torch.Generator().manual_seed(seed)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (index, metadata and cache-byte kernels), naming the first differing element."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != engine's {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != engine's {want.dtype}"
    a, b = got.reshape(-1), want.reshape(-1)
    if a.dtype.is_floating_point:  # bitwise, NaNs included
        a, b = a.view(_int_view(a.dtype)), b.view(_int_view(b.dtype))
    diff = (a != b).nonzero()
    if diff.numel():
        i = int(diff[0])
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), got.shape))
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} elements differ from the engine's kernel; "
            f"first at {idx}: warmreg {got.reshape(-1)[i].item()!r}, vLLM {want.reshape(-1)[i].item()!r}"
        )


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, what: str) -> None:
    """Floats at most ``ulps`` representable steps apart (same sign and finiteness), elementwise."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype} {tuple(got.shape)}"
    int_dtype = _int_view(got.dtype)
    a, b = got.reshape(-1).view(int_dtype).long(), want.reshape(-1).view(int_dtype).long()
    sign = 1 << (torch.finfo(got.dtype).bits - 1)
    # map the sign-magnitude bit patterns onto a monotone integer line
    a, b = torch.where(a < 0, -(a + sign), a), torch.where(b < 0, -(b + sign), b)
    steps = (a - b).abs()
    worst = int(steps.max()) if steps.numel() else 0
    assert worst <= ulps, (
        f"{what}: {int((steps > ulps).sum())} elements more than {ulps} ulps from the engine's kernel "
        f"(worst {worst} ulps at flat index {int(steps.argmax())})"
    )


def _int_view(dtype: torch.dtype) -> torch.dtype:
    bits = torch.finfo(dtype).bits
    return {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]


def clones(**tensors: Any) -> dict[str, Any]:
    """Clones of every tensor argument (each side of a comparison writes into its own copies)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
