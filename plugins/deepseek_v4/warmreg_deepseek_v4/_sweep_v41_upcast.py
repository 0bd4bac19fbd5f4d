"""The DeepSeek-V4.1 sweep's indexer logits upcast (vLLM 0.34 ``model_executor/layers/sparse_attn_indexer.py:
as_fp32_logits`` on the SM100 family's BF16 logits), called by :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep` for
each index-source layer type and by :class:`~warmreg_deepseek_v4.sweep.DSV4Sweep` for DeepSeek-V4's C4 indexer (ratio 4)
where the plan holds it.

The logits of the step's tokens stand in for DeepGEMM's (random BF16: the MQA logits GEMM is not a Triton kernel),
``[tokens, width]`` with a row stride padded to 16 columns (DeepGEMM's aligned stride, which the FP32 copy keeps);
each row ends at its token's causal compressed length ``(position + 1) // ratio``, as the prefill chunk's ``cu_seqlen_ke
- cu_seqlen_ks`` and the decode rows' ``seq_lens`` give it. Like the indexer Q quant it runs on every step, short
contexts included (vLLM's short-context steps fill the top-k instead and score nothing), so that the CPU test's short
contexts launch it. The FP32 buffer is the caller's (``out=``, zeros): the columns past a row's end stay zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sweep_inputs import BF16, DSV4_PREFIX, F32, I32, DSV4Step
from .v41_upcast_logits import upcast_logits_reference

if TYPE_CHECKING:
    from .sweep import DSV4Sweep

__all__ = ["UPCAST", "drive_upcast"]

#: The kernel :func:`drive_upcast` launches.
UPCAST = DSV4_PREFIX + "indexer_upcast_logits"


def drive_upcast(sweep: DSV4Sweep, st: DSV4Step, ratio: int, name: str) -> None:
    """Upcast one indexer layer's BF16 logits of the step (see the module docstring); nothing where the plan lacks
    the upcast."""
    if UPCAST not in sweep.names:
        return
    T = st.batch.tokens
    ends = torch.div(st.positions[:T] + 1, ratio, rounding_mode="floor").to(I32)
    width = max(int(ends.max()) if T else 1, 1)
    pitch = -(-width // 16) * 16
    logits = sweep.randn(T, pitch, dtype=BF16, scale=4.0)[:, :width]
    out = torch.zeros(T, pitch, dtype=F32, device=sweep.dev)[:, :width]
    sweep.launch(
        UPCAST, f"{name}, {T} rows of {width} (stride {pitch})",
        lambda: sweep.kernel(UPCAST)(logits, ends, out=out),
        ref=lambda: upcast_logits_reference(logits, ends, fill=0.0),
    )  # fmt: skip
