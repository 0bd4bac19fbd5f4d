"""warmreg plugin for the Kimi-K3 family (``model_type == "kimi_k3"``, text config ``kimi_linear``).

Kernels: the shared fused Q/KV RMSNorm and block-table slot mapping (``warmreg.ops``) for the MLA layers
(:mod:`warmreg_kimi_k3.qkv_rmsnorm`, :mod:`warmreg_kimi_k3.slot_mapping`); for the KDA layers the recurrent
step of decode and speculative decode (:mod:`warmreg_kimi_k3.kda`), their short causal convolutions
(:mod:`warmreg_kimi_k3.causal_conv1d` for prefill, :mod:`warmreg_kimi_k3.causal_conv1d_update` for decode and
speculative decode), the gated RMSNorm of their output (:mod:`warmreg_kimi_k3.gated_rmsnorm`), the prefill's
initial-state gather (:mod:`warmreg_kimi_k3.gather_initial_states`) and the metadata builder's aligned state
indices and speculative-decode staging (:mod:`warmreg_kimi_k3.kda_state_indices`,
:mod:`warmreg_kimi_k3.kda_spec_metadata`), with vLLM's KDA backend resolution in :mod:`warmreg_kimi_k3.backends`;
the attention residuals (:mod:`warmreg_kimi_k3.attn_res`). Importing this package
registers nothing; warmreg calls :func:`warmreg_kimi_k3.plugin.warmreg_register_kernels` through the
``warmreg`` entry point.
"""

from __future__ import annotations

from .kda import KDARecurrent, KDARecurrentKey, kda_recurrent_reference
from .model import PLUGIN

__all__ = ["PLUGIN", "KDARecurrent", "KDARecurrentKey", "kda_recurrent_reference"]
