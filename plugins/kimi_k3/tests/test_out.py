"""``out=`` on every allocating Kimi-K3 op: none is left unchecked.

Each op's own test module checks it with :func:`warmreg.testing.check_out`, under Triton's interpreter on inputs
from that module's helpers at small sizes: with ``out`` the op returns the caller's tensors themselves, writes
every element it writes without ``out`` (the buffers start as garbage: NaN, or 7777 for integers), allocates
nothing in its launch code, and refuses a buffer of another shape, dtype or device naming the parameter. The
chunked-prefill stages take their inputs from the stage references (pure PyTorch) rather than from the kernels
(``test_kda_chunk.py``).
"""

from __future__ import annotations

from pathlib import Path

import warmreg_kimi_k3

from warmreg.testing import assert_every_out_checked


def test_every_allocating_op_is_checked() -> None:
    """``kimi_k3.stage_spec_decode_metadata`` writes in place into the caller's graph buffers and allocates
    nothing, so it takes no ``out``."""
    ops = assert_every_out_checked(warmreg_kimi_k3, Path(__file__).resolve().parent)
    assert len(ops) == 30 and "kimi_k3.stage_spec_decode_metadata" not in ops.values(), sorted(ops)
