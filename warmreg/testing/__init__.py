"""Test kits for plugins: what a model family's plugin uses to test its kernels against the core.

Plain assertions on torch tensors (any test runner; pytest shows their messages), importing only warmreg's
public API; nothing in warmreg imports it. Kernel tests run on CPU tensors, through Triton's interpreter:

- :mod:`~warmreg.testing.reference`: an op equals its PyTorch reference (:func:`assert_matches`: tolerances per
  dtype, exact for integer, index and FP8 outputs);
- :mod:`~warmreg.testing.out`: the ``out=`` contract of an op (:func:`check_out` on an :class:`OpCall`: the
  caller's buffers come back written, wrong ones are refused naming them, the launch code allocates nothing;
  :func:`assert_every_out_checked`: no allocating op of a plugin is left out);
- :mod:`~warmreg.testing.planning`: example configs with serving overrides (:func:`config_loader`), a plugin
  of a few op modules (:class:`RegisterPlugin`), warmup inputs that give back their keys
  (:func:`assert_warmup_inputs_reproduce`) and, made real, launch them (:func:`materialize`);
- :mod:`~warmreg.testing.sweep`: the sweep-driver protocol of the zero-JIT sweep.
"""

from __future__ import annotations

from .out import (
    FACTORIES,
    TUPLE_ERROR,
    Allocations,
    OpCall,
    allocating_kernels,
    assert_allocates_nothing,
    assert_every_out_checked,
    assert_out_is_the_buffer_keywords,
    assert_out_refused,
    assert_out_written,
    bad_buffers,
    check_out,
    garbage_like,
    garbage_out,
    out_names,
)
from .planning import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader, materialize
from .reference import EXACT, FP8_DTYPES, TOLERANCES, Tolerance, assert_matches, leaves, tolerance

__all__ = [
    "EXACT",
    "FACTORIES",
    "FP8_DTYPES",
    "TOLERANCES",
    "TUPLE_ERROR",
    "Allocations",
    "OpCall",
    "RegisterPlugin",
    "allocating_kernels",
    "Tolerance",
    "assert_allocates_nothing",
    "assert_every_out_checked",
    "assert_matches",
    "assert_out_is_the_buffer_keywords",
    "assert_out_refused",
    "assert_out_written",
    "assert_warmup_inputs_reproduce",
    "bad_buffers",
    "check_out",
    "config_loader",
    "garbage_like",
    "garbage_out",
    "leaves",
    "materialize",
    "out_names",
    "tolerance",
]
