"""The DeepSeek-V4.1 sweep's TP-sharded engram gate on gfx942 / gfx950 (vLLM 0.34 ``models/deepseek_v41/amd/engram.py:
RocmEngram._post_wkv``), called once a step by :func:`._sweep_v41_rocm.drive_rocm41`: for each engram layer, every
tensor-parallel rank's partials from its slice of a random ``wkv`` output (the GEMM is not a Triton kernel), the
all-gather as a concatenation of the ranks' rows along tokens, and the finish over the step's streams with an image
mask. The partials are checked against their reference unpacked (value slices and fp32 sums), the finish against
its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .sweep_inputs import DSV4_PREFIX, DSV4Step
from .v41_rocm_engram_gate import gate_finish_reference, gate_partials_reference, unpack_partials

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ROCM_ENGRAM_DRIVES", "drive_rocm_engram"]

PARTIALS, FINISH = (DSV4_PREFIX + n for n in ("v41_rocm_engram_gate_partials", "v41_rocm_engram_gate_finish"))
#: The kernels :func:`drive_rocm_engram` launches.
ROCM_ENGRAM_DRIVES = frozenset({PARTIALS, FINISH})


def drive_rocm_engram(s: DSV41Sweep, st: DSV4Step) -> None:
    """Each engram layer's sharded gate of the step (see the module docstring); nothing where it is not planned."""
    layout, t = s.m.engram, st.batch.tokens
    if layout is None or PARTIALS not in s.names or not t:
        return
    for layer in layout.layer_ids:
        _layer(s, t, f"engram layer {layer}, {s.tp} ranks")


def _layer(s: DSV41Sweep, t: int, what: str) -> None:
    c, d, p = s.m.hc_mult, s.m.hidden_size, s.tp
    w = d // p
    hidden, q, k = s.randn(t, c, d), s.randn(c, d), s.randn(c, d)
    kv_full = s.randn(t, c + 1, p, w)  # every rank's column slice of each key and of the value
    sends = []
    for r in range(p):
        send = _rank(s, (hidden, kv_full[:, :, r].reshape(t, (c + 1) * w), r * w), q, k, f"{what}, rank {r}")
        if send is None:
            return
        sends.append(send)
    gathered = torch.cat(sends)
    mask = torch.rand(t, generator=s.gen).ge(0.05).to(s.dev)  # image-span tokens shut the gate
    fin: dict[str, Any] = dict(tp_size=p, eps=s.m.rms_norm_eps)
    s.launch(
        FINISH, what, lambda: s.k("v41_rocm_engram_gate_finish")(hidden, gathered, mask, **fin),
        ref=lambda: gate_finish_reference(hidden, gathered, mask, **fin),
        tol=(2**-5, 2**-7),  # x + gate * v cancels: one bf16 rounding of operands up to ~4 in size
    )  # fmt: skip


def _rank(
    s: DSV41Sweep, args: tuple[torch.Tensor, torch.Tensor, int], q: torch.Tensor, k: torch.Tensor, what: str
) -> torch.Tensor | None:
    """One rank's ``send`` rows (None after a miss or a failure); checked unpacked."""
    c, out = s.m.hc_mult, []
    weights: dict[str, Any] = dict(q_weight=q, k_weight=k)

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        out.append(s.k("v41_rocm_engram_gate_partials")(*args, **weights))
        return unpack_partials(out[-1], c)

    got = s.launch(
        PARTIALS, what, launch, ref=lambda: unpack_partials(gate_partials_reference(*args, **weights), c),
        tol=(1e-5, 2**-20),  # the slice's fp32 sums in another order; the value slice is a copy
    )  # fmt: skip
    return out[-1] if got is not None else None
