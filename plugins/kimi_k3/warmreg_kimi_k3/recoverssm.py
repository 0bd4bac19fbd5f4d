"""Kimi-K3's RecoverSSM speculative decode: when vLLM 0.34 runs it, and the per-layer tables its commit reads.

RecoverSSM (``--use-replayssm``, ``CacheConfig.use_replayssm``) changes how a KDA layer verifies draft tokens.
Without it every speculative step writes ``1 + spec`` recurrent states (one slot per token) and the next step
starts from the accepted one. With it each request keeps one checkpoint slot: the verify
(``warmreg_kimi_k3.recoverssm_verify``) runs the recurrence from the checkpoint without writing it, recording per
token the correction ``u_t`` and the key and raw gate; after sampling, the commit
(``warmreg_kimi_k3.recoverssm_commit``, its plan in ``warmreg_kimi_k3.recoverssm_plan``) folds the accepted tokens
into every layer's checkpoint and conv state at once.

vLLM turns it on in ``VllmConfig.validate_mamba_cached_kernel`` (``vllm/config/vllm.py``): ``use_kda_recoverssm =
use_replayssm and num_speculative_tokens > 0`` for the KDA architectures (Kimi-Linear, Kimi-K3, Kimi-K3.1); Kimi-K3's
layer refuses ``--use-replayssm`` without speculation (``vllm/models/kimi_k3/nvidia/kda.py:
KimiK3DeltaAttention.__init__``). The layer then picks the CuTe verify and commit where ``can_use_cute_recoverssm``
holds (SM10x, head_dim 128, width-4 conv, no conv bias, a gate bound and bfloat16 activations, conv state **and**
SSM state), else the Triton kernels. warmreg assumes vLLM's default float32 SSM state (``mamba_ssm_cache_dtype``
auto, :data:`warmreg_kimi_k3.backends.RECURRENT_STATE_DTYPE`), so the CuTe path never serves and every CUDA target
runs the Triton verify and commit. ROCm's KDA layer has no RecoverSSM path.

The serving setting is ``serving.use_replayssm`` (bool, default false; vLLM's ``--use-replayssm``). vLLM's other
RecoverSSM conditions (``--mamba-backend triton``, no stochastic rounding, one pipeline stage) are its defaults
and not warmreg settings; neither is ``mamba_cache_mode`` ``"align"`` (prefix caching), whose commit variant
(``ALIGN_MODE``) the ops implement but the plan leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

import warmreg

from .model import PLUGIN

if TYPE_CHECKING:  # backends may import this module: the layout is a type here only
    from .backends import KDALayout

__all__ = ["NULL_BLOCK_ID", "LayerTable", "state_slots", "use_recoverssm"]

#: The state slot of padded requests (``vllm/v1/attention/backends/utils.py: NULL_BLOCK_ID``).
NULL_BLOCK_ID = 0


def use_recoverssm(config: warmreg.WarmConfig, layout: KDALayout | None) -> bool:
    """Whether vLLM runs RecoverSSM for this deployment: ``serving.use_replayssm`` with KDA layers (``layout``).

    :raises warmreg.ConfigError: for ``serving.use_replayssm`` that is not a bool, or true with
        ``serving.num_speculative_tokens`` 0 (Kimi-K3's KDA layer refuses it).
    """
    on = config.get("serving.use_replayssm", bool, plugin=PLUGIN, default=False)
    if not on or layout is None:
        return False
    if not layout.num_speculative_tokens:
        raise warmreg.ConfigError(
            "serving.use_replayssm", "is true without speculative decoding, which Kimi-K3's KDA layer refuses",
            plugin=PLUGIN, fix="set serving.num_speculative_tokens > 0 or use_replayssm false",
        )  # fmt: skip
    return True


def state_slots(config: warmreg.WarmConfig, layout: KDALayout) -> int:
    """State slots a KDA request's speculative rows address, which is also the width of the KDA group's block-table
    rows: ``1 + num_speculative_tokens``, or 1 under RecoverSSM (:func:`use_recoverssm`).

    vLLM 0.34 gives the Mamba group ``num_speculative_blocks = 0 if use_replayssm else num_speculative_tokens``
    (``model_executor/layers/mamba/abstract.py: MambaBase.get_kv_cache_spec``), so a row of its block table is
    ``1 + num_speculative_blocks`` wide (``v1/kv_cache_interface.py: MambaSpec.max_num_blocks_per_req``, no token
    alignment; in align mode ``v1/worker/mamba_utils.py`` precomputes ``[R, 1 + num_speculative_blocks]`` indices),
    and the KDA builder keeps ``spec_state_slots = 1 if use_recoverssm else num_spec + 1`` columns, staging them into
    a ``[max_num_seqs, 1]`` graph buffer under RecoverSSM (``models/kimi_k3/nvidia/kda_metadata.py:
    KimiK3KDAMetadataBuilder.__init__``). Every state-index column a KDA kernel reads is therefore this wide apart,
    or 1 apart (a gathered or staged copy).

    :raises warmreg.ConfigError: as :func:`use_recoverssm`.
    """
    return 1 if use_recoverssm(config, layout) else 1 + layout.num_speculative_tokens


@attrs.frozen
class LayerTable:
    """One tensor per KDA layer as the commit kernels address it: a reference tensor (its dtype types the pointers),
    each layer's base address and block (page) stride, and, for the conv state, its dim and token strides.

    The commit runs once for all layers of a KV-cache group: program ``l`` of the grid's last axis reads layer
    ``l``'s tensor at ``base_addrs[l]`` (vLLM's ``KDARecoverSSMCommitContext.create``, ``_base_addrs`` and
    ``_block_strides``). The tables hold raw addresses: they are valid while the layers' tensors live.

    :param ref: the first layer's tensor (the pointer dtype; strides past the first are shared by every layer).
    :param base_addrs: int64 ``[L]``, each layer's ``data_ptr()``.
    :param block_strides: int64 ``[L]``, each layer's ``stride(0)``.
    :param dim_strides: int64 ``[L]``, each layer's ``stride(1)`` (read by the conv-state compaction only).
    :param token_strides: int64 ``[L]``, each layer's ``stride(2)`` (read by the conv-state compaction only).
    """

    ref: torch.Tensor
    base_addrs: torch.Tensor
    block_strides: torch.Tensor
    dim_strides: torch.Tensor
    token_strides: torch.Tensor

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> LayerTable:
        """The table of ``tensors`` (one per layer, same dtype, device and rank >= 3), on their device.

        :raises ValueError: for no tensors, or tensors of different dtypes, devices or ranks.
        """
        if not tensors:
            raise ValueError("LayerTable needs at least one layer's tensor")
        ref = tensors[0]
        if any(t.dtype != ref.dtype or t.device != ref.device or t.ndim != ref.ndim for t in tensors) or ref.ndim < 3:
            raise ValueError("LayerTable tensors must share one dtype, device and rank (>= 3)")

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=ref.device)

        return cls(
            ref=ref,
            base_addrs=column([t.data_ptr() for t in tensors]),
            block_strides=column([t.stride(0) for t in tensors]),
            dim_strides=column([t.stride(1) for t in tensors]),
            token_strides=column([t.stride(2) for t in tensors]),
        )

    @property
    def num_layers(self) -> int:
        """Layers in the table."""
        return int(self.base_addrs.shape[0])
