"""Kernels on CPU tensors through Triton's interpreter, in a process that also compiles.

Part of the Triton adapter, checked against Triton 3.6.0; tested in ``tests/test_triton_adapter.py``.

``TRITON_INTERPRET=1`` switches a whole process to the interpreter; warmreg instead interprets one
launch at a time, so one process can both run kernels on CPU tensors (the tests) and cross-compile.
Importing this module patches ``JITFunction.__call__`` so that nested ``@triton.jit`` helpers are
interpreted too while such a launch runs (and only then).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["interpreted"]


def _interpreted(jit: JITFunction) -> InterpretedFunction[Any]:
    # Cached on the object: hashing a JITFunction computes its cache_key, which must not happen
    # while the interpreter has patched triton.language.
    cached = jit.__dict__.get("_warmreg_interpreted")
    if cached is None:
        cached = InterpretedFunction(
            jit.fn,
            do_not_specialize=jit.do_not_specialize,
            do_not_specialize_on_alignment=jit.do_not_specialize_on_alignment,
        )
        jit.__dict__["_warmreg_interpreted"] = cached
    return cached


class _InterpretedLaunch:
    """``fn[grid](...)`` through Triton's interpreter, with nested ``@triton.jit`` helpers interpreted too."""

    def __init__(self, jit: Any) -> None:
        self.jit = jit

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            token = _INTERPRETING.set(True)
            saved = _snapshot_lang()
            try:
                return self.jit[grid](*args, **kwargs)
            finally:
                _restore_lang(saved)
                _INTERPRETING.reset(token)

        return launch


def interpreted(jit: Any) -> _InterpretedLaunch:
    """The same kernel run by Triton's interpreter (for CPU tensors), as ``TRITON_INTERPRET=1`` would.

    Under ``TRITON_INTERPRET=1`` the jit function already is interpreted. Otherwise a nested
    ``@triton.jit`` helper is a compiled ``JITFunction`` that refuses to be called from Python; while
    an interpreted launch runs, :func:`_jit_call` sends such calls to the interpreter instead
    (Triton 3.6.0: ``JITFunction.__call__`` only raises).
    """
    return _InterpretedLaunch(jit if isinstance(jit, InterpretedFunction) else _interpreted(jit))


def _lang_namespaces() -> list[Any]:
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


def _snapshot_lang() -> list[tuple[Any, dict[str, Any]]]:
    return [(ns, dict(vars(ns))) for ns in _lang_namespaces()]


def _restore_lang(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    """Undo every patch the interpreter left on triton.language.

    Triton 3.6.0's interpreter patches ``triton.language`` for a nested ``@triton.jit`` call and never
    restores it; later compiles in the same process would then fail deep in the code generator.
    """
    for ns, before in saved:
        now = dict(vars(ns))
        for name, value in now.items():
            if name.startswith("__"):
                continue
            if name not in before:
                delattr(ns, name)
            elif before[name] is not value:
                setattr(ns, name, before[name])


def _fix_interpreter_index() -> None:
    """Triton 3.6.0's interpreter converts a scalar with ``int(array_of_shape_1)``, which NumPy >= 2.4
    refuses, so ``for i in range(n)`` with a runtime ``n`` fails under the interpreter. Convert with
    ``.item()`` instead (interpreter only; compiled kernels are unaffected)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_warmreg_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._warmreg_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_interpreter_index()


_INTERPRETING: ContextVar[bool] = ContextVar("warmreg_interpreting", default=False)
_original_jit_call = JITFunction.__call__


def _jit_call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    if _INTERPRETING.get():
        return _interpreted(self)(*args, **kwargs)
    return _original_jit_call(self, *args, **kwargs)


JITFunction.__call__ = _jit_call  # type: ignore[method-assign]
