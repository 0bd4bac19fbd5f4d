"""bf16 ``tl.dot`` and bf16 arithmetic under Triton's interpreter, by value: a fix to the interpreter for CPU runs,
not to any kernel.

Triton 3.8.0's interpreter (``triton/runtime/interpreter.py``) holds a bf16 tensor as its uint16 bit patterns and
hands them to numpy as stored: ``InterpreterBuilder.create_dot`` (which converts fp8 operands alone) multiplies raw
bits, and so does ``binary_op`` (``bf16 * bf16``, ``bf16 == bf16``, ...: a NaN equals itself there). While
:func:`bf16_dot_by_value` is active, a dot with a bf16 operand multiplies the values (bf16 -> fp32 is exact;
``np.matmul`` accumulates in the accumulator's dtype, fp32) and a binary op on two bf16 operands computes on their fp32
values, a float result rounded to the nearest bf16 (ties to even, as compiled code rounds), a comparison kept boolean.
The sweep driver runs the ROCm sparse-attention kernels inside it on the CPU, and their tests (vLLM's kernels and
warmreg's alike) do too. Compiled kernels are untouched: the interpreter is not on their path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import triton.language as tl

__all__ = ["bf16_dot_by_value"]


def _bf16_bits(values: Any) -> Any:
    """fp32 values rounded to the nearest bf16 (ties to even), as uint16 bit patterns; NaN stays NaN."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _values(handle: Any) -> Any:
    """The operand's values: bf16 bit patterns widened to the fp32 of the same value; others as stored."""
    if handle.dtype.scalar == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


@contextlib.contextmanager
def bf16_dot_by_value() -> Iterator[None]:
    """While active, the interpreter's ``tl.dot`` and binary ops take bf16 operands by value (see the module
    docstring); anything without bf16 operands takes the interpreter's own path."""
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    original_binary = interpreter.InterpreterBuilder.binary_op

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return original_binary(self, lhs, rhs, op)
        out = op(_values(lhs), _values(rhs))
        if out.dtype == np.bool_:
            return interpreter.TensorHandle(out, tl.int1)
        return interpreter.TensorHandle(_bf16_bits(out), tl.bfloat16)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return original(self, a, b, d, *rest)
        out = np.matmul(_values(a), _values(b), dtype=d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]
    interpreter.InterpreterBuilder.binary_op = binary_op  # type: ignore[method-assign]
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_dot = original  # type: ignore[method-assign]
        interpreter.InterpreterBuilder.binary_op = original_binary  # type: ignore[method-assign]
