"""``out=`` on every DeepSeek-V4 op that allocates its outputs: none is left unchecked.

Each op's own test module checks it with warmreg's kit (:mod:`warmreg.testing`), on inputs from that module's
helpers (Triton's interpreter on CPU): :func:`~warmreg.testing.check_out` (the caller's tensors come back
themselves, written as without ``out`` although they start as garbage: NaN, 7777, 0x7F bytes; a wrong buffer
raises a ``LaunchError`` naming the parameter; the launch code allocates nothing), or, for the ops that took
persistent buffers before (larger than needed, rows past T untouched, tested in their own modules),
:func:`~warmreg.testing.assert_allocates_nothing` with those buffers. The inverse RoPE + quant returns transposed
views of its group-major buffers, checked to lie on the caller's buffers (``test_inv_rope_quant.py``).
"""

from __future__ import annotations

from pathlib import Path

import warmreg_deepseek_v4

from warmreg.testing import assert_every_out_checked


def test_every_allocating_op_is_checked() -> None:
    ops = assert_every_out_checked(warmreg_deepseek_v4, Path(__file__).resolve().parent)
    # 52 ops; the K-cache gather takes the caller's workspace as a required out, and the block-table gather writes
    # the runner's tables through their addresses: they allocate nothing anyway
    assert len(ops) == 52 and not {"DequantGatherKCache", "GatherBlockTables"} & set(ops), sorted(ops)
