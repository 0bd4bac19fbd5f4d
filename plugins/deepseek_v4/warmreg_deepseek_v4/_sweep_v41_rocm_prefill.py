"""The DeepSeek-V4.1 sweep's MXFP8 prefill rows on gfx950 (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py:
DeepseekV41ROCMAiterMLAAttention._forward_prefill``), called once a step by :func:`._sweep_v41_rocm.drive_rocm41`: a
step with prefill tokens hands its attention's bf16 rows ``[num_prefill_tokens, n_local_heads, head_dim]`` (random: the
sparse prefill is another op) to the inverse RoPE + MXFP8 quant, which writes the prefill rows of the step's ``wo_a``
input (``mxfp8_out`` sliced past the decode tokens), with the prefill tokens' positions and V4.1's rotary cache. The
scales are checked against the reference bitwise; the e4m3 values are not (Triton's interpreter neither rounds fp32 ->
e4m3 to nearest even nor keeps a rounding's carry across a binade: the unit tests bound that, and the comparison with
vLLM's own kernel is bitwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sweep_inputs import DSV4_PREFIX, DSV4Step
from .v41_rocm_inverse_rope_mxfp8 import inverse_rope_mxfp8_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ROCM_PREFILL_DRIVES", "drive_rocm_prefill_rows"]

INV_MXFP8 = DSV4_PREFIX + "v41_rocm_inverse_rope_mxfp8"
#: The kernels :func:`drive_rocm_prefill_rows` launches.
ROCM_PREFILL_DRIVES = frozenset({INV_MXFP8})


def drive_rocm_prefill_rows(s: DSV41Sweep, st: DSV4Step) -> None:
    """The step's prefill rows into its MXFP8 ``wo_a`` input (see the module docstring); nothing without prefill."""
    b, m = st.batch, s.m
    if INV_MXFP8 not in s.names or not b.num_prefills:
        return
    heads, d, dec = m.num_attention_heads // s.tp, m.head_dim, b.decode_tokens
    n = b.tokens - dec
    o = s.randn(n, heads, d, scale=3)
    data = torch.empty(b.tokens, heads * d, dtype=torch.float8_e4m3fn, device=s.dev)
    scale = torch.empty(b.tokens, heads * d // 32, dtype=torch.uint8, device=s.dev)
    args = (o, st.positions[dec:], s.rope41)

    def launch() -> torch.Tensor:
        s.k("v41_rocm_inverse_rope_mxfp8")(*args, rope_head_dim=m.qk_rope_head_dim, out=(data[dec:], scale[dec:]))
        return scale[dec:]

    s.launch(
        INV_MXFP8, f"{n} prefill rows of {heads} heads", launch,
        ref=lambda: inverse_rope_mxfp8_reference(*args, rope_head_dim=m.qk_rope_head_dim)[1],
    )  # fmt: skip
