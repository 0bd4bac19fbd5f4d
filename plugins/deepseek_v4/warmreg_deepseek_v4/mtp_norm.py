"""The MTP draft module's two RMSNorms, gathered under one name for importers (this module registers
nothing): the fused input norm (:mod:`.mtp_input_norm`) and the shared-head norm
(:mod:`.mtp_shared_head_norm`).
"""

from __future__ import annotations

from .mtp_input_norm import MTPInputNormKey, MTPInputRMSNorm, mtp_input_rmsnorm_reference
from .mtp_shared_head_norm import MTPSharedHeadNormKey, MTPSharedHeadRMSNorm, mtp_shared_head_rmsnorm_reference

__all__ = [
    "MTPInputNormKey",
    "MTPInputRMSNorm",
    "MTPSharedHeadNormKey",
    "MTPSharedHeadRMSNorm",
    "mtp_input_rmsnorm_reference",
    "mtp_shared_head_rmsnorm_reference",
]
